"""Training drafters for a frozen target: data (prompts, target responses) and trainers."""

from .data import SequenceStore, build_sequences, load_examples, sharegpt_examples
from .dflash2_trainer import train_dflash2
from .dflash_trainer import TrainResult, train_dflash
from .dspark_trainer import train_dspark
from .eagle3_trainer import train_eagle3
from .medusa_trainer import train_medusa

__all__ = ["SequenceStore", "TrainResult", "build_sequences", "load_examples",
           "sharegpt_examples", "train_dflash", "train_dflash2", "train_dspark", "train_eagle3",
           "train_medusa"]
