"""Training drafters for a frozen target: data (prompts, target responses) and trainers."""

from .data import SequenceStore, build_sequences, load_examples, sharegpt_examples
from .dflash_trainer import TrainResult, train_dflash
from .eagle3_trainer import train_eagle3
from .medusa_trainer import train_medusa

__all__ = ["SequenceStore", "TrainResult", "build_sequences", "load_examples",
           "sharegpt_examples", "train_dflash", "train_eagle3", "train_medusa"]
