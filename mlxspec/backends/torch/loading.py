"""Load a converted model directory with transformers, on a chosen device and dtype."""

import math
from contextlib import contextmanager
from pathlib import Path

import torch

from ...file_checks import one_line, read_json_object

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


_LAYOUT_HINT = ("a hybrid model that mlxspec converted is in mlx-lm's layout: give --backend torch "
                "its Hugging Face checkpoint directory")


@contextmanager
def quiet_transformers():
    from transformers.utils import logging

    before = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(before)


def check_size_against_files(model_dir: Path) -> None:
    """transformers allocates the model its config describes before it reads a weight; a config
    it reads otherwise than mlx-lm does (a converted text-only Qwen3.5's flat settings become
    its default sizes) would allocate many GB, so the sizes are compared first, on the meta
    device."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with quiet_transformers():
            config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)
            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except (KeyError, ValueError) as err:  # an architecture transformers does not know
        raise ValueError(f"transformers cannot load {model_dir}: {one_line(err, 300)}") from None
    wanted = sum(p.numel() for p in skeleton.parameters())
    held = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                held += math.prod(f.get_slice(name).get_shape())
    if wanted > 2 * held + 10**6:
        raise ValueError(
            f"to transformers {model_dir}/config.json describes a model of {wanted / 1e6:,.1f}M "
            f"parameters, but its weights hold {held / 1e6:,.1f}M; {_LAYOUT_HINT}"
        )


def load_causal_lm(model_dir: Path, *, device: torch.device, dtype: torch.dtype):
    """A transformers causal LM from a converted (dense, HF-named) directory, for inference."""
    from transformers import AutoModelForCausalLM

    config = read_json_object(Path(model_dir) / "config.json")
    if config.get("quantization") or config.get("quantization_config"):
        raise ValueError(
            f"{model_dir} holds MLX-quantized weights, which the torch backend cannot read; "
            "convert the model without --quantize (dense weights)"
        )
    check_size_against_files(Path(model_dir))
    try:
        with quiet_transformers():  # its load report would come before our one line
            model, info = AutoModelForCausalLM.from_pretrained(
                str(model_dir), dtype=dtype, output_loading_info=True, trust_remote_code=False)
    except (KeyError, ValueError) as err:  # an architecture transformers does not know
        raise ValueError(f"transformers cannot load {model_dir}: {err}") from None
    except RuntimeError as err:  # e.g. a tensor of another shape
        raise ValueError(
            f"transformers cannot load {model_dir}: {one_line(err, 300)}; {_LAYOUT_HINT}"
        ) from None
    unread = list(info.get("missing_keys") or []) + [
        str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys") or []]
    if unread:  # transformers would run those weights as initialised: random
        raise ValueError(
            f"{model_dir} lacks {len(unread)} weight(s) transformers' {type(model).__name__} "
            f"needs (e.g. {sorted(unread)[0]}); {_LAYOUT_HINT}"
        )
    model.requires_grad_(False)
    return model.to(device).eval()


def loader(device=None, dtype=None):
    """The torch backend's loader (see mlxspec.backends.Backend.loader): a missing CUDA fails
    here, before a model is resolved or converted."""
    device = resolve_device(device)
    return lambda model_dir: load(model_dir, device=device, dtype=dtype)


def load(model_dir: Path, *, device=None, dtype=None):
    """(transformers model, mlx-lm TokenizerWrapper) for a converted model directory."""
    from ...checkpoint_checks import load_tokenizer

    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    model = load_causal_lm(model_dir, device=device, dtype=dtype)
    eos = read_json_object(Path(model_dir) / "config.json").get("eos_token_id")
    return model, load_tokenizer(Path(model_dir), eos_token_ids=eos)
