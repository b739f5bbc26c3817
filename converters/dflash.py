"""Convert a released DFlash, DFlash2 (z-lab format) or DSpark drafter into a checked, MLX-loadable
directory.

The layout stays z-lab's (config.json + safetensors with their names), so the result is still a
valid DFlash checkpoint; what conversion adds is the validation (config, every weight name and
shape), one safetensors file, an optional dtype cast (float32 is the fast path on a CPU) and an
atomic write. Repo ids resolve through the Hugging Face cache, so HF_HUB_OFFLINE applies.
"""

import json
from pathlib import Path

import mlx.core as mx

from ..file_checks import read_json_object
from ..models.dflash import (
    ARCHITECTURE,
    BLOCK_DRAFTERS,
    DRAFT_VOCAB_FILE,
    DFlashConfig,
    DFlashModel,
    check_weights,
    draft_vocab_json,
    read_config,
    read_draft_vocab,
    read_weights,
)
from .atomic import atomic_output_dir, check_output_dir
from .hf import resolve_hf_source

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def is_dflash_checkpoint(path: str | Path) -> bool:
    """True for a directory whose config.json names a block drafter (DFlash, DFlash2, DSpark)
    or has a dflash_config.

    A config.json that is not a JSON object raises ValueError naming it: no converter could
    read it, and guessing "not DFlash" would only move the error somewhere vaguer.
    """
    config_path = Path(path).expanduser() / "config.json"
    if not config_path.is_file():
        return False
    config = read_json_object(config_path)
    architectures = config.get("architectures") or []
    return any(a in BLOCK_DRAFTERS for a in architectures) or "dflash_config" in config


def _classes(config: dict) -> tuple[type, type]:
    """(config class, model class) of the block drafter the config's architectures name."""
    kinds = {BLOCK_DRAFTERS.get(a) for a in config.get("architectures") or []}
    if "dflash2" in kinds:
        from ..models.dflash2 import DFlash2Config, DFlash2Model

        return DFlash2Config, DFlash2Model
    if "dspark" in kinds:
        from ..models.dspark import DSparkConfig, DSparkModel

        return DSparkConfig, DSparkModel
    return DFlashConfig, DFlashModel


def convert_dflash(
    source: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Validate `source` (directory or Hub repo id) and write it to `out_dir`.

    dtype: "float32", "float16" or "bfloat16"; None keeps the checkpoint's dtypes.
    Raises before writing anything if the checkpoint is not a consistent DFlash drafter.
    """
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    check_output_dir(out_dir, overwrite)
    path = resolve_hf_source(source)
    if not is_dflash_checkpoint(path):
        raise ValueError(
            f"{source} is not a DFlash drafter: its config.json has neither "
            f"architectures [{ARCHITECTURE!r}] nor a dflash_config"
        )
    config = read_config(path)
    config_class, model_class = _classes(config)
    args = config_class.from_dict(config)
    draft_vocab = read_draft_vocab(path, args.vocab_size)
    weights = read_weights(path)
    if hasattr(args, "read_head_width"):  # DSpark: a config may leave its head's input out
        args.read_head_width({name: w.shape for name, w in weights.items()})
    check_weights(args, weights, model_class)
    if dtype is not None:
        weights = {
            k: v.astype(_DTYPES[dtype]) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in weights.items()
        }
        config["torch_dtype"] = dtype
    with atomic_output_dir(out_dir, overwrite=overwrite) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if draft_vocab is not None:
            (tmp / DRAFT_VOCAB_FILE).write_text(draft_vocab_json(draft_vocab))
    return Path(out_dir).expanduser()
