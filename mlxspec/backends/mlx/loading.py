"""Load a model directory with mlx-lm."""

from pathlib import Path


def loader(device=None, dtype=None):
    """The MLX backend's loader (see mlxspec.backends.Backend.loader): mlx runs where it is
    built, so there is no device or dtype to choose (mlxspec.load refuses them before)."""
    from ... import _blas

    _blas.preload_openblas()
    return load_model_dir


def load_model_dir(model_dir: Path, split=None):
    """mlx_lm.load, with the config read as transformers 5 writes it (a Hugging Face directory
    of a hybrid model loads as it converts); missing or misshapen weights are one line. With
    `split`, the model loads lazily and split(model) keeps and reads this rank's share."""
    from ...checkpoint_checks import load_tokenizer
    from ...converters.hf import load_checkpoint

    model, config = load_checkpoint(model_dir, lazy=split is not None, action="load")
    if split is not None:
        split(model)
    return model, load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))
