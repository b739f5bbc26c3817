"""Convert a Hugging Face safetensors checkpoint into an mlx-lm model directory.

The source is a local directory or a Hub repo id (resolved through the Hub
cache, so HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE apply). Loading, casting,
quantizing and saving are mlx-lm's own functions; this module adds the checks
around them: safetensors only, a top-level ``rope_theta``, atomic output.
"""

import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, Optional, Union

import mlx.core as mx

from ..file_checks import check_safetensors, read_json_object
from .atomic import atomic_output_dir, check_output_dir

ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "*.txt",
    "*.tiktoken",
    "tokenizer.model",
    "tiktoken.model",
]

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def looks_like_repo_id(source: str) -> bool:
    """``org/name`` with nothing path-like about it."""
    s = str(source)
    return bool(_REPO_ID.match(s)) and not s.startswith((".", "~")) and not s.endswith(".gguf")


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "on", "yes", "true")


def _hub_cache_dir() -> Optional[str]:
    # huggingface_hub reads these once, at import; read them per call so a
    # process (or a test) that sets them later is still honoured.
    if cache := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return os.path.expanduser(cache)
    if home := os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(home), "hub")
    return None


def _offline() -> bool:
    from huggingface_hub import constants

    return (
        _env_true("HF_HUB_OFFLINE")
        or _env_true("TRANSFORMERS_OFFLINE")
        or bool(constants.HF_HUB_OFFLINE)
    )


def resolve_hf_source(source: Union[str, Path], revision: Optional[str] = None) -> Path:
    """A local directory holding the checkpoint: ``source`` itself or a Hub snapshot."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{path} is a file, not a model directory (or a .gguf file).")
        return path
    if not looks_like_repo_id(str(source)):
        raise FileNotFoundError(f"No such model directory: {path}")

    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = _offline()
    try:
        return Path(
            snapshot_download(
                str(source),
                revision=revision,
                allow_patterns=ALLOW_PATTERNS,
                cache_dir=_hub_cache_dir(),
                local_files_only=offline,
            )
        )
    except (LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError) as e:
        where = _hub_cache_dir() or "the default Hugging Face cache"
        how = (
            "HF_HUB_OFFLINE is set, so only the local cache was searched"
            if offline
            else "the Hub could not provide it"
        )
        raise FileNotFoundError(
            f"{source!r} is not a local directory, and no snapshot of it"
            f"{'' if revision is None else f' at revision {revision!r}'} was found "
            f"in {where} ({how}). {e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e
    except HFValidationError as e:
        raise ValueError(f"{source!r} is neither a local path nor a valid repo id: {e}") from e


def check_weights(path: Path) -> None:
    """Require mlx-lm-loadable safetensors; never fall back to pickles."""
    safetensors = sorted(path.glob("*.safetensors"))
    if not safetensors:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickles:
            raise ValueError(
                f"{path} has only pickle-based weights ({', '.join(pickles[:4])}). "
                "They can run arbitrary code when loaded, so they are refused; "
                "convert them to safetensors first (or use a repo that ships "
                "*.safetensors)."
            )
        raise FileNotFoundError(f"No *.safetensors weights in {path}.")
    if not any(p.name.startswith("model") for p in safetensors):
        raise ValueError(
            f"{path} has safetensors ({', '.join(p.name for p in safetensors[:4])}) "
            "but none named model*.safetensors, which is what mlx-lm loads."
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"No config.json in {path}.")
    read_json_object(path / "config.json")  # mlx-lm's JSON errors name no file
    check_safetensors(safetensors)


def config_fixes(config: Dict[str, Any]) -> Dict[str, Any]:
    """Keys to set so mlx-lm reads the config as transformers meant it.

    transformers 5 nests ``rope_theta`` (and the scaling) under
    ``rope_parameters``; mlx-lm's llama/qwen2 read only the top-level keys and
    would silently fall back to their defaults.
    """
    fixes = {}
    for cfg, prefix in ((config, None), (config.get("text_config"), "text_config")):
        if not isinstance(cfg, dict):
            continue
        rp = cfg.get("rope_parameters")
        if not isinstance(rp, dict):
            continue
        local = {}
        if "rope_theta" not in cfg and "rope_theta" in rp:
            local["rope_theta"] = rp["rope_theta"]
        rope_type = rp.get("rope_type", rp.get("type", "default"))
        if rope_type != "default" and cfg.get("rope_scaling") is None:
            local["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
        if local and prefix:
            fixes[prefix] = {**cfg, **local}
        else:
            fixes.update(local)
    return fixes


def _cast(model, dtype: mx.Dtype) -> None:
    from mlx.utils import tree_map_with_path

    cast_predicate = getattr(model, "cast_predicate", lambda _: True)

    def set_dtype(k, v):
        if cast_predicate(k) and mx.issubdtype(v.dtype, mx.floating):
            return v.astype(dtype)
        return v

    model.update(tree_map_with_path(set_dtype, model.parameters()))


def convert_hf(
    source: Union[str, Path],
    out_dir: Union[str, Path],
    *,
    dtype: Optional[str] = None,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    revision: Optional[str] = None,
    overwrite: bool = False,
) -> Path:
    """Convert a safetensors checkpoint (directory or Hub repo id) to an mlx-lm directory.

    Args:
        source: A local model directory or a Hub repo id (``org/name``).
        out_dir: The model directory to create.
        dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``; ``None`` keeps
            the checkpoint's dtypes.
        quantize: Quantize the linear and embedding layers (MLX affine).
        q_bits: Bits per weight when quantizing.
        q_group_size: Group size when quantizing.
        revision: Hub revision (branch, tag or commit) for repo ids.
        overwrite: Replace ``out_dir`` if it exists.

    Returns:
        The path of the converted model directory.
    """
    from mlx_lm.utils import load_config, load_model, load_tokenizer
    from mlx_lm.utils import quantize_model, save_config, save_model

    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or None, got {dtype!r}.")
    out_dir = check_output_dir(out_dir, overwrite)
    src = resolve_hf_source(source, revision)
    check_weights(src)
    fixes = config_fixes(load_config(src))

    with atomic_output_dir(out_dir, overwrite) as tmp:
        model, config = load_model(src, lazy=True, model_config=fixes)
        if dtype is not None:
            _cast(model, _DTYPES[dtype])
            config["torch_dtype"] = dtype
        if quantize:
            model, config = quantize_model(model, config, q_group_size, q_bits)
        tokenizer = load_tokenizer(src, eos_token_ids=config.get("eos_token_id"))
        save_model(tmp, model, donate_model=True)
        save_config(config, config_path=tmp / "config.json")
        tokenizer.save_pretrained(str(tmp))
        if (src / "generation_config.json").is_file():
            shutil.copy(src / "generation_config.json", tmp)
    return out_dir
