"""Load a converted model directory with transformers, on a chosen device and dtype."""

from pathlib import Path

import torch

from ..file_checks import read_json_object

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """None: CUDA when available, else the CPU. A requested accelerator must exist."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown torch device {device!r}; use cpu, cuda or cuda:N") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA (a CPU build)"
            raise ValueError(
                f"device {str(device)!r} requested but CUDA is not available (torch "
                f"{torch.__version__}, built with {build}); use --device cpu"
            )
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {str(device)!r} requested but only {torch.cuda.device_count()} CUDA "
                "device(s) exist"
            )
    elif resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {str(device)!r} requested but MPS is not available")
    elif resolved.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"unsupported torch device {str(device)!r}; use cpu, cuda or cuda:N")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None: bfloat16 on CUDA (float16 where bf16 is unsupported), float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is not None:
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_causal_lm(model_dir: Path, *, device: torch.device, dtype: torch.dtype):
    """A transformers causal LM from a converted (dense, HF-named) directory, for inference."""
    from transformers import AutoModelForCausalLM

    config = read_json_object(Path(model_dir) / "config.json")
    if config.get("quantization") or config.get("quantization_config"):
        raise ValueError(
            f"{model_dir} holds MLX-quantized weights, which the torch backend cannot read; "
            "convert the model without --quantize (dense weights)"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    except (KeyError, ValueError) as err:  # an architecture transformers does not know
        raise ValueError(f"transformers cannot load {model_dir}: {err}") from None
    model.requires_grad_(False)
    return model.to(device).eval()


def load(model_dir: Path, *, device=None, dtype=None):
    """(transformers model, mlx-lm TokenizerWrapper) for a converted model directory."""
    from mlx_lm.utils import load_tokenizer

    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    model = load_causal_lm(model_dir, device=device, dtype=dtype)
    eos = read_json_object(Path(model_dir) / "config.json").get("eos_token_id")
    return model, load_tokenizer(Path(model_dir), eos_token_ids=eos)
