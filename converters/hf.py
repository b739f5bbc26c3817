"""Convert a Hugging Face safetensors checkpoint into an mlx-lm model directory.

The source is a local directory or a Hub repo id (resolved through the Hub
cache, so HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE apply). Loading, casting,
quantizing and saving are mlx-lm's own functions; this module adds the checks
around them: safetensors only, config keys as mlx-lm reads them (a top-level
``rope_theta``, the attention period of hybrid models), atomic output.

Hybrid checkpoints (Qwen3-Next, Qwen3.5, Nemotron-H) go through mlx-lm's own
``sanitize`` exactly once, on their published names; the output is in mlx-lm's
names and shapes, which the same ``sanitize`` leaves as they are when the
output is loaded.
"""

import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, Optional, Union

import mlx.core as mx

from ..checkpoint_checks import (
    check_config,
    check_no_remote_code,
    load_tokenizer,
    mlx_lm_model_type,
)
from ..file_checks import check_safetensors, one_line, read_json_object
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

# What MLX's affine quantization takes (mlx 0.32: mx.quantize refuses other bits and group
# sizes, and a group size of 0 crashes the process; mlx-lm silently reads 0 as its default 64).
Q_BITS = (1, 2, 3, 4, 5, 6, 8)
Q_GROUP_SIZES = (32, 64, 128)


def check_quantization(q_bits, q_group_size) -> None:
    """Refuse bits or a group size MLX cannot quantize with, before any conversion work."""
    for name, value, allowed in (("q_bits", q_bits, Q_BITS),
                                 ("q_group_size", q_group_size, Q_GROUP_SIZES)):
        flag = "--" + name.replace("_", "-")
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} ({flag}) must be an integer, got {value!r}")
        if value not in allowed:
            raise ValueError(f"{name} ({flag}) must be one of {', '.join(map(str, allowed))} "
                             f"(MLX affine quantization), got {value}")


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
    config = read_json_object(path / "config.json")  # mlx-lm's JSON errors name no file
    check_no_remote_code(path)
    check_config(config, path / "config.json", check_safetensors(safetensors))


# Hybrid models whose mlx-lm class makes every `full_attention_interval`-th layer an attention
# layer; transformers 5 saves the layer list (`layer_types`) instead of the period.
_ATTENTION_PERIOD_TYPES = {
    "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
}
def _attention_period(cfg: Dict[str, Any], where: str) -> Optional[int]:
    """The period of ``layer_types`` ("full_attention" every n-th layer), or None without it."""
    layer_types = cfg.get("layer_types")
    if not isinstance(layer_types, list) or not layer_types:
        return None
    kinds = {"linear_attention", "full_attention"}

    def fits(n):
        return all(
            t == ("full_attention" if (i + 1) % n == 0 else "linear_attention")
            for i, t in enumerate(layer_types)
        )

    n = next((n for n in range(1, len(layer_types) + 2) if fits(n)), None)
    given = cfg.get("full_attention_interval")
    if n is None or (given is not None and given != n):
        shown = ", ".join(map(str, layer_types[:8])) + (", ..." if len(layer_types) > 8 else "")
        problem = (
            f"has unknown layer types {sorted(set(layer_types) - kinds)}"
            if set(layer_types) - kinds
            else f"contradicts full_attention_interval {given}" if n is not None
            else "is not one attention layer every n layers"
        )
        raise ValueError(
            f"{where} layer_types [{shown}] {problem}; mlx-lm builds "
            f"{cfg.get('model_type')} models only as linear-attention layers with every n-th layer "
            "full attention"
        )
    return n


def config_fixes(config: Dict[str, Any]) -> Dict[str, Any]:
    """Keys to set so mlx-lm reads the config as transformers meant it.

    transformers 5 nests ``rope_theta`` (and the scaling, and Qwen3-Next's
    ``partial_rotary_factor``) under ``rope_parameters``; mlx-lm's llama/qwen2
    read only the top-level keys and would silently fall back to their
    defaults (qwen3_next fails). It also saves hybrid Qwen models' layer pattern
    as ``layer_types`` only, where mlx-lm reads ``full_attention_interval``
    (default 4, silently wrong for any other period), and a text-only Qwen3.5
    as ``qwen3_5_text``, a model type mlx-lm knows as ``qwen3_5``.
    """
    fixes: Dict[str, Any] = {}
    model_type = config.get("model_type")
    if mlx_lm_model_type(model_type) != model_type:
        fixes["model_type"] = mlx_lm_model_type(model_type)
    for cfg, prefix in ((config, None), (config.get("text_config"), "text_config")):
        if not isinstance(cfg, dict):
            continue
        local = {}
        rp = cfg.get("rope_parameters")
        if isinstance(rp, dict):
            for key in ("rope_theta", "partial_rotary_factor"):
                if key not in cfg and key in rp:
                    local[key] = rp[key]
            rope_type = rp.get("rope_type", rp.get("type", "default"))
            if rope_type != "default" and cfg.get("rope_scaling") is None:
                local["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
        if cfg.get("model_type", model_type) in _ATTENTION_PERIOD_TYPES:
            where = "config.json" + (f" {prefix}" if prefix else "")
            period = _attention_period(cfg, where)
            if period is not None and cfg.get("full_attention_interval") != period:
                local["full_attention_interval"] = period
        if prefix and "tie_word_embeddings" not in cfg and "tie_word_embeddings" in config:
            # A multimodal config may say it once, at the top; mlx-lm reads the text config's.
            local["tie_word_embeddings"] = config["tie_word_embeddings"]
        if local and prefix:
            fixes[prefix] = {**cfg, **local}
        else:
            fixes.update(local)
    return fixes


def _one_line(err: BaseException) -> str:
    # A KeyError is a tensor sanitize looked up, e.g. an expert's to stack.
    return one_line(f"missing {err}" if isinstance(err, KeyError) else err)


def _fuse_experts(weights: Dict[str, mx.array], num_experts: int) -> Dict[str, mx.array]:
    """Per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` -> the fused
    ``experts.gate_up_proj`` / ``experts.down_proj`` of published Qwen3.5-MoE checkpoints."""
    prefixes = sorted(
        k[: -len(".experts.0.gate_proj.weight")]
        for k in weights
        if k.endswith(".mlp.experts.0.gate_proj.weight") and not k.startswith("mtp.")
    )
    for p in prefixes:
        gate, up, down = (
            mx.stack([weights.pop(f"{p}.experts.{e}.{n}_proj.weight") for e in range(num_experts)])
            for n in ("gate", "up", "down")
        )
        weights[f"{p}.experts.gate_up_proj"] = mx.concatenate([gate, up], axis=-2)
        weights[f"{p}.experts.down_proj"] = down
    return weights


def _model_classes(config: Dict[str, Any]):
    """mlx-lm's classes for `config`, their sanitize fixed (`_fixed_classes`) and handed no MTP
    tensors: those are kept apart (models/mtp.py), and mlx-lm's own rule for dropping them does
    not hold everywhere (deepseek_v3 drops layer 61 only, whatever the model's depth)."""
    from ..models.mtp import family_of

    model_class, args_class = _fixed_classes(config)
    family = family_of(config.get("model_type"))
    if family is None:
        return model_class, args_class
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config

    class WithoutMTP(model_class):
        def sanitize(self, weights):
            return super().sanitize(
                {k: v for k, v in weights.items() if not family.owns(k, text)})

    WithoutMTP.__name__ = WithoutMTP.__qualname__ = model_class.__name__
    return WithoutMTP, args_class


def _fixed_classes(config: Dict[str, Any]):
    """mlx-lm's classes, with sanitize fixed where it cannot tell published names from its own.

    mlx-lm's qwen3_next sanitize takes a checkpoint without MoE layers for an
    already-converted one and returns it untouched: a dense Qwen3-Next in
    transformers' layout would keep its (channels, 1, kernel) convolutions and
    its zero-centred norms. Such a checkpoint is recognised by the convolution
    shape instead, and gets the same transformation the MoE path applies.

    mlx-lm's qwen3_5_moe sanitize reads the experts fused, as Qwen publishes
    them; transformers 5 saves them one by one (``save_pretrained`` of a
    fine-tune), so those are fused first.
    """
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    if config.get("model_type") == "qwen3_5_moe":

        class Qwen3_5MoeModel(model_class):
            def sanitize(self, weights):
                n = self.language_model.args.num_experts
                return super().sanitize(_fuse_experts(dict(weights), n))

        Qwen3_5MoeModel.__name__ = Qwen3_5MoeModel.__qualname__ = model_class.__name__
        return Qwen3_5MoeModel, args_class
    if config.get("model_type") != "qwen3_next":
        return model_class, args_class

    class Qwen3NextModel(model_class):
        def sanitize(self, weights):
            moe = any(k.endswith(".mlp.experts.0.up_proj.weight") for k in weights)
            published = any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in weights.items())
            if moe or not published:
                return super().sanitize(weights)
            weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
            if self.args.tie_word_embeddings:
                weights.pop("lm_head.weight", None)
            norms = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                     "model.norm.weight", ".q_norm.weight", ".k_norm.weight")
            for k, v in weights.items():
                if "conv1d.weight" in k and v.shape[-1] != 1:
                    weights[k] = v.moveaxis(2, 1)
                elif k.endswith(norms) and v.ndim == 1:
                    weights[k] = v + 1.0
            return weights

    Qwen3NextModel.__name__ = Qwen3NextModel.__qualname__ = model_class.__name__
    return Qwen3NextModel, args_class


def load_checkpoint(
    src: Path, fixes: Optional[Dict[str, Any]] = None, *, lazy: bool = True, action: str = "convert"
):
    """mlx-lm's ``load_model`` on a checkpoint directory, its errors as one-line ValueErrors.

    ``fixes`` defaults to :func:`config_fixes` of the directory's config. The
    model goes through mlx-lm's ``sanitize`` (once, as always). A missing
    tensor, a tensor of the wrong shape or a config mlx-lm cannot build a model
    from fails here: "cannot {action} {src}: ..." naming the tensor or key.
    """
    from mlx_lm.utils import load_config, load_model

    try:
        if fixes is None:
            fixes = config_fixes(load_config(src))
        return load_model(src, lazy=lazy, model_config=fixes, get_model_classes=_model_classes)
    except (KeyError, ValueError, TypeError, IndexError, RuntimeError) as err:
        raise ValueError(f"cannot {action} {src}: {_one_line(err)}") from err


# Kept in float32 whatever the dtype: the state-space decay of Gated DeltaNet and Mamba-2
# layers (mlx-lm's qwen3_5 and nemotron_h keep it too; its qwen3_next does not say).
_KEEP_FLOAT32 = ("A_log",)


def _cast(model, dtype: mx.Dtype) -> None:
    from mlx.utils import tree_map_with_path

    cast_predicate = getattr(model, "cast_predicate", lambda _: True)

    def set_dtype(k, v):
        if k.endswith(_KEEP_FLOAT32):
            return v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
        if cast_predicate(k) and mx.issubdtype(v.dtype, mx.floating):
            return v.astype(dtype)
        return v

    model.update(tree_map_with_path(set_dtype, model.parameters()))


def _keep_mtp_weights(src: Path, config: Dict[str, Any], out: Path,
                      dtype: Optional[mx.Dtype]) -> None:
    """Copy the multi-token-prediction tensors a checkpoint ships (mlx-lm's conversion drops
    them) to ``mtp.safetensors``, in their published names and convention, for ``--drafter mtp``;
    a model that ships none gets no file."""
    from ..models.mtp import MTP_WEIGHTS, mtp_count, read_mtp_tensors

    if mtp_count(config) < 1:
        return
    tensors, published = read_mtp_tensors(src, config)
    if not tensors:
        return
    if dtype is not None:
        tensors = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
                   for k, v in tensors.items()}
    mx.save_safetensors(str(out / MTP_WEIGHTS), tensors,
                        metadata={"format": "pt" if published else "mlx"})


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
    from mlx_lm.utils import quantize_model, save_config, save_model

    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or None, got {dtype!r}.")
    check_quantization(q_bits, q_group_size)
    out_dir = check_output_dir(out_dir, overwrite)
    src = resolve_hf_source(source, revision)
    check_weights(src)

    with atomic_output_dir(out_dir, overwrite) as tmp:
        model, config = load_checkpoint(src)
        if dtype is not None:
            _cast(model, _DTYPES[dtype])
            config["torch_dtype"] = dtype
        if quantize:
            model, config = quantize_model(model, config, q_group_size, q_bits)
        tokenizer = load_tokenizer(src, eos_token_ids=config.get("eos_token_id"))
        save_model(tmp, model, donate_model=True)
        _keep_mtp_weights(src, config, tmp, None if dtype is None else _DTYPES[dtype])
        save_config(config, config_path=tmp / "config.json")
        tokenizer.save_pretrained(str(tmp))
        if (src / "generation_config.json").is_file():
            shutil.copy(src / "generation_config.json", tmp)
    return out_dir
