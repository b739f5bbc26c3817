"""Multi-token-prediction (MTP) modules as models ship them, built from mlx-lm's own layers.

Module k takes a hidden state h (for k = 1 the target's last hidden state after its final norm,
as every implementation feeds it: mlx-vlm, mtplx, vLLM, transformers; docs/mtp-notes.md) and the
embedding of the next token, normalises both, concatenates and projects them (2H -> H), runs
its decoder layer(s) with their own KV cache, and ranks the token after next through its final
norm and the target's output head. Chained on its own output, it drafts several tokens.

Three published layouts, one module class (names below are the module's own):

| family | weights | fc | norms (embedding, hidden, final) | concat | chained h |
|---|---|---|---|---|---|
| Qwen3-Next, Qwen3.5/3.6 | `mtp.*` (one module of `mtp_num_hidden_layers` layers) | fc | pre_fc_norm_embedding, pre_fc_norm_hidden, norm (all 1 + w) | [e; h] | after the norm |
| DeepSeek-V3, GLM-4.5 | `model.layers.{N+i}.*` (module i) | eh_proj | enorm, hnorm, shared_head.norm | [e; h] | before it |
| MiMo | `model.mtp_layers.{i}.*` | input_proj | token_layernorm, hidden_layernorm, final_layernorm | [h; e] | after it |

The chained hidden follows the peers of each family: Qwen's post-norm output (mlx-vlm,
mtplx), DeepSeek's transformer-block output before `shared_head.norm` (the DeepSeek-V3 paper's
h^k, vLLM, mtplx; transformers and mlx-vlm's GLM-5 feed the normed one instead, which
`chain_after_norm=True` selects). Decoder layers are mlx-lm's classes of the same family,
built as the MTP layer's index makes them (full attention; MoE where the model is MoE).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from ..file_checks import one_line
from ..backends.mlx.hidden_states import instance_attributes
from ..backends.mlx.tree_pass import TreeRoPE, attention_modules
from ..backends.mlx.window import window_mask, windowed

MTP_WEIGHTS = "mtp.safetensors"  # a converted model's MTP tensors, as published


@dataclass(frozen=True)
class Family:
    """How one family stores its MTP modules and builds their layers."""

    name: str
    model_types: tuple[str, ...]
    count_key: str  # the config key: modules (DeepSeek, MiMo) or layers of one module (Qwen)
    prefix: str  # module i's key prefix; {i} its number, {layer} num_hidden_layers + i
    stacked: bool  # Qwen: the count is layers inside one module
    hidden_first: bool  # MiMo concatenates [h; e]
    chain_after_norm: bool
    norms_offset: bool  # (1 + w) norms, as the target's own are stored
    # The layer's tensors need the target's own sanitize (DeepSeek's and GLM's: experts to
    # stack, MLA's kv_b_proj to split), which mlx-lm applies to the main layers only.
    target_sanitize: bool = False

    def prefixes(self, config: dict, count: int) -> list[str]:
        """The key prefix of each module."""
        first = int(config.get("num_hidden_layers", 0))
        return [self.prefix.format(i=i, layer=first + i)
                for i in range(1 if self.stacked else count)]

    def owns(self, key: str, config: dict) -> bool:
        """Whether checkpoint tensor `key` belongs to the MTP modules (mlx-lm drops these)."""
        head = self.prefix.split("{")[0]
        if not key.startswith(head):
            return False
        if "{layer}" not in self.prefix:
            return True
        index = key[len(head):].split(".")[0]
        return index.isdigit() and int(index) >= int(config["num_hidden_layers"])


# The module's own names for the three parts around its layers, per family.
PARTS = {
    "qwen": {"fc": "fc", "pre_fc_norm_embedding": "norm_embedding",
             "pre_fc_norm_hidden": "norm_hidden", "norm": "norm"},
    "deepseek": {"eh_proj": "fc", "enorm": "norm_embedding", "hnorm": "norm_hidden",
                 "shared_head.norm": "norm"},
    "mimo": {"input_proj": "fc", "token_layernorm": "norm_embedding",
             "hidden_layernorm": "norm_hidden", "final_layernorm": "norm"},
}
# Copies of the target's own tensors that a module ships (DeepSeek: "embed_tokens / shared_head
# share parameters with the main model"): the target's are used, as transformers does.
TARGET_COPIES = ("embed_tokens.weight", "shared_head.head.weight")

FAMILIES = (
    Family("qwen", ("qwen3_next", "qwen3_5", "qwen3_5_moe"), "mtp_num_hidden_layers", "mtp.",
           stacked=True, hidden_first=False, chain_after_norm=True, norms_offset=True),
    Family("deepseek", ("deepseek_v3", "glm4_moe"), "num_nextn_predict_layers",
           "model.layers.{layer}.", stacked=False, hidden_first=False, chain_after_norm=False,
           norms_offset=False, target_sanitize=True),
    Family("mimo", ("mimo",), "num_nextn_predict_layers", "model.mtp_layers.{i}.",
           stacked=False, hidden_first=True, chain_after_norm=True, norms_offset=False),
)
SHIPPING = "Qwen3.5/3.6, Qwen3-Next, DeepSeek-V3, GLM-4.5 and MiMo"


def family_of(model_type: str | None) -> Family | None:
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def text_config(config: dict) -> dict:
    """The language model's settings (Qwen3.5 nests them in text_config)."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def mtp_count(config: dict) -> int:
    """Modules (or Qwen's layers of its one module) that the config declares; 0 for none."""
    family = family_of(config.get("model_type"))
    if family is None:
        return 0
    return int(text_config(config).get(family.count_key) or 0)


class MTPModule(nn.Module):
    """One MTP module: two norms, the 2H -> H projection, decoder layers, a final norm."""

    def __init__(self, layers: list, hidden_size: int, eps: float, hidden_first: bool):
        super().__init__()
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.norm_embedding = nn.RMSNorm(hidden_size, eps=eps)
        self.norm_hidden = nn.RMSNorm(hidden_size, eps=eps)
        self.layers = layers
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.hidden_first = hidden_first

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: list,
                 mask: mx.array | None = None) -> mx.array:
        """(1, L, H) each -> the last layer's output (1, L, H), before the final norm; `mask`
        (L, cached + L) bool replaces the causal one (a tree's ancestors)."""
        e, h = self.norm_embedding(embeddings), self.norm_hidden(hidden)
        x = self.fc(mx.concatenate([h, e] if self.hidden_first else [e, h], axis=-1))
        if mask is None:
            mask = create_attention_mask(x, cache[0], return_array=True)
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask, cache=c)
        return x


class MTPModel(nn.Module):
    """A target's MTP modules with the target parts they use: its embedding, its final norm
    (the hidden fed to module 1 is the target's normed last layer) and its output head.

    `project(features)` turns captured last-layer outputs into module 1's input, `run(i, ids,
    hidden, cache)` runs module i, `logits(x, i)` ranks from module i's output x (before its
    final norm), `chained(x, i)` is what the next depth reads. Called as a whole, it is what
    mlxspec.drafters.paired's tree expansion calls a drafter: module 1 on the chained form of
    a previous output, at given positions under a given mask. With `context_window` N
    (--drafter-window), each entry sees the entries of its module's cache at most N - 1
    positions behind it (mlxspec.backends.mlx.window)."""

    context_window: int | None = None

    def __init__(self, modules: list[MTPModule], *, embed, head: Callable, final_norm,
                 chain_after_norm: bool):
        super().__init__()
        self.mtp = modules
        self.chain_after_norm = chain_after_norm
        # The target's parts, not parameters of this model (they stay the target's).
        object.__setattr__(self, "_target_parts", (embed, head, final_norm))

    def make_cache(self) -> list[list[KVCache]]:
        return [[KVCache() for _ in m.layers] for m in self.mtp]

    def project(self, features: mx.array) -> mx.array:
        return self._target_parts[2](features)

    def run(self, index: int, ids: mx.array, hidden: mx.array, cache: list) -> mx.array:
        module = self.mtp[index]
        return module(self._target_parts[0](ids), hidden, windowed(cache[index],
                                                                   self.context_window))

    def __call__(self, ids: mx.array, previous: mx.array, cache: list, *,
                 mask: mx.array | None = None, positions: mx.array | None = None) -> mx.array:
        """Module 1 on (ids, its own earlier outputs `previous`), (1, L) and (1, L, H): each
        token at `positions` (L,) when given (the embedded token's position, as
        mlxspec.drafters.paired counts), seeing what `mask` (L, cached + L) allows."""
        hidden = self.chained(previous, 0)
        if positions is None:
            return self.run(0, ids, hidden, cache)
        if not hasattr(self, "_attentions"):
            object.__setattr__(self, "_attentions", attention_modules(self.mtp[0]))
        # A pair (h_p, t_{p+1}) sits at RoPE position p, mlx-vlm's and mtplx's convention (the
        # cache's offset for a chain): one before its token's.
        shift = positions - 1 - cache[0][0].offset
        if self.context_window is not None:
            mask = window_mask(cache[0][0].offset, ids.shape[1], self.context_window, mask,
                               positions)
        ropes = [(a, "rope", TreeRoPE(a["rope"], shift)) for a in self._attentions]
        with instance_attributes(ropes):
            return self.mtp[0](self._target_parts[0](ids), hidden, cache[0], mask=mask)

    def logits(self, x: mx.array, index: int = 0) -> mx.array:
        return self._target_parts[1](self.mtp[index].norm(x))

    def chained(self, x: mx.array, index: int) -> mx.array:
        return self.mtp[index].norm(x) if self.chain_after_norm else x


# ---- Building from a target and its checkpoint ------------------------------------------------


def target_parts(model):
    """(inner model, output head) of an mlx-lm target: the inner model holds embed_tokens, the
    layers and the final norm; the head is lm_head or the tied embedding."""
    owner = getattr(model, "language_model", model)  # qwen3_5's multimodal wrapper
    inner = owner.model
    head = owner.lm_head if "lm_head" in owner else inner.embed_tokens.as_linear
    return inner, head


def _qwen3_next_layer(model):
    from mlx_lm.models.qwen3_next import Qwen3NextDecoderLayer

    args = model.args
    return lambda: Qwen3NextDecoderLayer(args, args.full_attention_interval - 1)


def _qwen3_5_layer(model):
    from mlx_lm.models.qwen3_5 import DecoderLayer

    args = model.language_model.args
    return lambda: DecoderLayer(args, args.full_attention_interval - 1)


def _deepseek_v3_layer(model):
    from mlx_lm.models.deepseek_v3 import DeepseekV3DecoderLayer

    return lambda: DeepseekV3DecoderLayer(model.args, model.args.num_hidden_layers)


def _glm4_moe_layer(model):
    from mlx_lm.models.glm4_moe import DecoderLayer

    return lambda: DecoderLayer(model.args, model.args.num_hidden_layers)


def _mimo_layer(model):
    from mlx_lm.models.mimo import TransformerBlock

    return lambda: TransformerBlock(model.args)


# model type -> (target -> a new decoder layer of its family, as its MTP layer is built: at the
# MTP layer's index, so full attention, and MoE where the model is MoE).
LAYERS = {"qwen3_next": _qwen3_next_layer, "qwen3_5": _qwen3_5_layer,
          "qwen3_5_moe": _qwen3_5_layer, "deepseek_v3": _deepseek_v3_layer,
          "glm4_moe": _glm4_moe_layer, "mimo": _mimo_layer}


_OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                 ".q_norm.weight", ".k_norm.weight")


def _qwen_layer_weights(layer: dict[str, mx.array], offset: bool) -> dict[str, mx.array]:
    """One Qwen MTP layer's published tensors in mlx-lm's names: (1 + w) norms stored as w get
    their 1 back (mlx-lm does this in sanitize, but only for the main layers), experts stacked
    (one by one as transformers saves them, or fused as Qwen publishes them)."""
    out = {}
    experts: dict[str, dict[int, mx.array]] = {}
    for key, value in layer.items():
        if offset and ("." + key).endswith(_OFFSET_NORMS) and value.ndim == 1:
            value = value + 1.0
        parts = key.split(".")
        if key.startswith("mlp.experts.") and parts[2].isdigit():
            experts.setdefault(parts[3], {})[int(parts[2])] = value
        elif key == "mlp.experts.gate_up_proj":
            gate, up = mx.split(value, 2, axis=-2)
            out["mlp.switch_mlp.gate_proj.weight"], out["mlp.switch_mlp.up_proj.weight"] = gate, up
        elif key == "mlp.experts.down_proj":
            out["mlp.switch_mlp.down_proj.weight"] = value
        else:
            out[key] = value
    for name, by_expert in experts.items():
        out[f"mlp.switch_mlp.{name}.weight"] = mx.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def module_tensors(family: Family, tensors: dict, prefix: str) -> tuple[dict, dict]:
    """One module's published tensors (under `prefix`), for either backend: its own parts
    under MTPModule's names, and its decoder layers' tensors by their names inside the module;
    the module's copies of the target's embedding and head left out."""
    parts = PARTS[family.name]
    own, block = {}, {}
    for key, value in tensors.items():
        if not key.startswith(prefix) or key[len(prefix):] in TARGET_COPIES:
            continue
        key = key[len(prefix):]
        part = next((p for p in parts if key == f"{p}.weight"), None)
        if part is not None:
            own[f"{parts[part]}.weight"] = value
        else:
            block[key] = value
    return own, block


def _module_weights(family: Family, tensors: dict[str, mx.array], prefix: str, model,
                    offset: bool) -> dict[str, mx.array]:
    """One module's published tensors (under `prefix`) -> MTPModule names, in MLX's
    conventions."""
    own, block = module_tensors(family, tensors, prefix)
    out = {k: v + 1.0 if offset and k != "fc.weight" else v for k, v in own.items()}
    if family.stacked:
        layers: dict[int, dict] = {}
        for key, value in block.items():
            if not key.startswith("layers."):
                raise ValueError(f"unexpected MTP tensor {prefix}{key}")
            _, index, rest = key.split(".", 2)
            layers.setdefault(int(index), {})[rest] = value
        for index, layer in layers.items():
            for key, value in _qwen_layer_weights(layer, offset).items():
                out[f"layers.{index}.{key}"] = value
        return out
    if family.target_sanitize:  # the block passes through it as the target's layer 0
        renamed = model.sanitize({f"model.layers.0.{k}": v for k, v in block.items()})
        block = {k[len("model.layers.0."):]: v for k, v in renamed.items()}
    out.update({f"layers.0.{k}": v for k, v in block.items()})
    return out


def build_mtp_model(model, config: dict, tensors: dict[str, mx.array], *,
                    published: bool = True, chain_after_norm: bool | None = None) -> MTPModel:
    """The MTP model of mlx-lm target `model` from its MTP tensors in published names;
    `published=False` for tensors already in MLX's convention (norms stored as 1 + w).
    A tensor missing, left over or of the wrong shape is a ValueError naming it."""
    family = family_of(config.get("model_type"))
    count = mtp_count(config)
    settings = text_config(config)
    hidden, eps = int(settings["hidden_size"]), float(settings.get("rms_norm_eps", 1e-6))
    new_layer = LAYERS[config["model_type"]](model)
    layers_per_module = count if family.stacked else 1
    modules = [MTPModule([new_layer() for _ in range(layers_per_module)], hidden, eps,
                         family.hidden_first)
               for _ in range(1 if family.stacked else count)]
    inner, head = target_parts(model)
    offset = family.norms_offset and published
    weights = {}
    for i, prefix in enumerate(family.prefixes(config, count)):
        for key, value in _module_weights(family, tensors, prefix, model, offset).items():
            weights[f"mtp.{i}.{key}"] = value
    mtp = MTPModel(modules, embed=inner.embed_tokens, head=head, final_norm=inner.norm,
                   chain_after_norm=family.chain_after_norm if chain_after_norm is None
                   else chain_after_norm)
    dtype = inner.embed_tokens.weight.dtype
    if not mx.issubdtype(dtype, mx.floating):  # a quantized target: its scales' dtype
        dtype = inner.embed_tokens.scales.dtype
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in weights.items()}
    try:
        mtp.load_weights(list(weights.items()), strict=True)
    except ValueError as err:
        raise ValueError(f"the MTP weights do not fit the target: {one_line(err)}") from None
    mx.eval(mtp.parameters())
    return mtp


def read_mtp_tensors(model_dir: Path, config: dict) -> tuple[dict[str, mx.array], bool]:
    """The MTP tensors of a model directory: mlxspec's `mtp.safetensors` (kept as published by
    `mlxspec convert`), or those inside a Hugging Face checkpoint's own shards. Returns them and
    whether they are in the published convention (a shard saved by MLX tools, format "mlx",
    has its norms stored as 1 + w already). Empty when the directory holds none."""
    family = family_of(config.get("model_type"))
    sidecar = model_dir / MTP_WEIGHTS
    if sidecar.is_file():
        arrays, metadata = mx.load(str(sidecar), return_metadata=True)
        return dict(arrays), metadata.get("format") != "mlx"
    tensors, published = {}, True
    for shard in sorted(model_dir.glob("*.safetensors")):
        arrays, metadata = mx.load(str(shard), return_metadata=True)
        found = {k: v for k, v in arrays.items() if family.owns(k, config)}
        if found:
            tensors.update(found)
            published = published and metadata.get("format") != "mlx"
    return tensors, published
