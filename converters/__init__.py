"""Converters from model file formats to mlx-lm model directories.

``convert(source, out_dir)`` picks the converter from the source: a ``.gguf``
file goes through :func:`convert_gguf`, a directory or Hub repo id through
:func:`convert_hf`. Every converter writes atomically: ``out_dir`` either
appears complete or not at all.
"""

import shutil
from pathlib import Path
from typing import Optional, Union

from .atomic import OUTPUT_FIX, atomic_output_dir, check_output_dir, temp_dir_in
from .dflash import convert_dflash, is_dflash_checkpoint
from .gguf import convert_gguf
from .hf import check_quantization, convert_hf, looks_like_repo_id, resolve_hf_source

__all__ = [
    "atomic_output_dir",
    "convert",
    "convert_dflash",
    "convert_gguf",
    "convert_hf",
    "resolve_source_kind",
]


def resolve_source_kind(source: Union[str, Path]) -> str:
    """``"gguf"``, ``"hf-dir"`` or ``"hf-repo"``; raises if it is none of them.

    Cheap: looks at the path only, never at the network.
    """
    path = Path(source).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return "gguf"
    if path.is_dir():
        return "hf-dir"
    if path.exists():
        raise ValueError(
            f"{path} is neither a .gguf file nor a model directory."
        )
    if looks_like_repo_id(str(source)):
        return "hf-repo"
    raise FileNotFoundError(
        f"{source!r} does not exist and is not a Hugging Face repo id (org/name)."
    )


def convert(
    source: Union[str, Path],
    out_dir: Union[str, Path],
    *,
    dtype: Optional[str] = None,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    overwrite: bool = False,
    **options,
) -> Path:
    """Convert ``source`` (.gguf file, model directory or repo id) into ``out_dir``.

    The common options mean the same for every source: ``dtype`` (None keeps
    a checkpoint's dtypes and gives float32 for GGUF), ``quantize`` with
    ``q_bits`` / ``q_group_size`` (MLX affine, via mlx-lm) and ``overwrite``.
    Other ``options`` go to :func:`convert_gguf` (``keep_quantized``,
    ``progress``) or :func:`convert_hf` (``revision``).
    """
    check_quantization(q_bits, q_group_size)
    if resolve_source_kind(source) != "gguf":
        if is_dflash_checkpoint(resolve_hf_source(source, options.get("revision"))):
            if quantize:
                raise ValueError("DFlash drafters are converted without quantization")
            return convert_dflash(source, out_dir, dtype=dtype, overwrite=overwrite)
        return convert_hf(
            source, out_dir, dtype=dtype, quantize=quantize, q_bits=q_bits,
            q_group_size=q_group_size, overwrite=overwrite, **options,
        )
    if not quantize:
        return convert_gguf(source, out_dir, dtype=dtype, overwrite=overwrite, **options)
    if options.get("keep_quantized"):
        raise ValueError("Use either quantize (requantize with MLX) or keep_quantized, not both.")
    # Requantizing a GGUF: dequantize into a hidden scratch directory next to
    # out_dir, then quantize that like any safetensors checkpoint.
    out_dir = check_output_dir(out_dir, overwrite)
    tmp = temp_dir_in(out_dir.parent, f".{out_dir.name}.dense-", OUTPUT_FIX)
    try:
        dense = convert_gguf(source, tmp / "dense", dtype=dtype, **options)
        return convert_hf(
            dense, out_dir, quantize=True, q_bits=q_bits, q_group_size=q_group_size,
            overwrite=overwrite,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
