"""MTP drafting on the torch backend: models.mtp's modules built from transformers' own classes,
driven by the host side both backends share (drafters.mtp.MTPDrafting) with torch tensor math.

Shared with MLX, not ported: which families ship modules and where (models.mtp.Family), the
checks before any weight loads (drafters.mtp.check_mtp_source), reading the published tensors
(models.mtp.read_mtp_tensors: mlxspec's sidecar or the checkpoint's shards), the part names
(models.mtp.module_tensors) and the drafter's bookkeeping (committed pairs, chain by depth, cuts).

Covered: the DeepSeek-V3 layout (deepseek_v3, and glm4_moe, which ships the same one). A module
is enorm, hnorm, eh_proj and shared_head.norm around one decoder layer of the target's own
class, built at the MTP layer's index (N + i, so MoE as the checkpoint's is); its experts are
fused as transformers holds them by transformers' own conversion for the model type. The
target's embedding, rotary embedding, final norm and output head are used, not copies. Each
module has its own DynamicCache (its layer writes at index N + i), cut back with crop; a pass
of more than one entry gets an explicit causal mask (a tree's: its ancestors), under SDPA
whatever the target uses. Pair i sits at RoPE position i, where the MLX module puts it; a tree
node at its depth's. With `tree_budget`, module 1 grows EAGLE-2's dynamic tree
(drafters.paired.PairedDrafting.tree_candidates), as on MLX.
"""

import copy
import re
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache

from ...drafters.mtp import MTPDrafting, check_mtp_source, read_model_config
from ...drafters.paired import check_tree_options
from ...file_checks import one_line
from ...request import check_drafter_window
from ...models.mtp import family_of, module_tensors, mtp_count, read_mtp_tensors, text_config
from .dflash import block_mask
from .eagle3 import TorchPairedDrafting
from .target import additive, cache_argument, crop, decoder_layers, model_device
from .window import window_mask



class MTPModule(nn.Module):
    """models.mtp.MTPModule in torch, under the same names: two norms, the 2H -> H projection,
    decoder layers, a final norm (the norm class is the target's)."""

    def __init__(self, layers: list[nn.Module], hidden_size: int, eps: float, norm_class,
                 hidden_first: bool):
        super().__init__()
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.norm_embedding = norm_class(hidden_size, eps=eps)
        self.norm_hidden = norm_class(hidden_size, eps=eps)
        self.layers = nn.ModuleList(layers)
        self.norm = norm_class(hidden_size, eps=eps)
        self.hidden_first = hidden_first
        self._cache_arg = cache_argument(layers[0])  # transformers 5.2x renamed past_key_values

    def forward(self, embeddings, hidden, rotation, mask, cache) -> torch.Tensor:
        """(1, L, H) each -> the last layer's output (1, L, H), before the final norm."""
        e, h = self.norm_embedding(embeddings), self.norm_hidden(hidden)
        x = self.fc(torch.cat([h, e] if self.hidden_first else [e, h], dim=-1))
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_embeddings=rotation, use_cache=True,
                      **{self._cache_arg: cache})
        return x


class MTPModel(nn.Module):
    """models.mtp.MTPModel in torch, called as MTPDrafting calls it (project, run, logits,
    chained, make_cache), plus each module's cache length. The target's parts are held outside
    this module's state: they stay the target's."""

    def __init__(self, modules: list[MTPModule], *, layer_indices: list[int], embed, head,
                 final_norm, rotary, chain_after_norm: bool):
        super().__init__()
        self.mtp = nn.ModuleList(modules)
        self.layer_indices = tuple(layer_indices)  # the cache index module i's layer writes at
        self.chain_after_norm = chain_after_norm
        self._target_parts = (embed, head, final_norm, rotary)
        self.context_window: int | None = None  # --drafter-window, as models.mtp.MTPModel's

    @property
    def dtype(self) -> torch.dtype:
        return self.mtp[0].fc.weight.dtype

    def make_cache(self) -> list[DynamicCache]:
        return [DynamicCache() for _ in self.mtp]

    def cache_length(self, cache: list, index: int) -> int:
        return int(cache[index].get_seq_length(self.layer_indices[index]))

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Captured last-layer outputs -> module 1's input: the target's final norm of them."""
        return self._target_parts[2](features.to(self.dtype))

    def run(self, index: int, ids, hidden, cache: list) -> torch.Tensor:
        """Module `index` on ids (1, L) and hidden (1, L, H) at the next L positions of its
        cache, causally: its output (1, L, H), L entries appended."""
        past, length, window = self.cache_length(cache, index), ids.shape[1], self.context_window
        positions = torch.arange(past, past + length, device=hidden.device)
        visible = (block_mask(past, past, length, causal=True, window=window,
                              device=hidden.device) if length > 1 or window else None)
        return self._pass(index, ids, hidden, cache, positions, visible)

    def forward(self, ids, previous, cache: list, *, mask=None, positions=None):
        """models.mtp.MTPModel.__call__, which drafters.paired's tree expansion calls: module 1
        on (ids, its own earlier outputs `previous`, chained), (1, L) and (1, L, H); with
        `positions` (L,), the embedded tokens' positions as paired counts them, each seeing
        what the bool `mask` (L, cached + L) allows."""
        hidden = self.chained(previous, 0)
        if positions is None:
            return self.run(0, ids, hidden, cache)
        if self.context_window is not None:
            mask = window_mask(self.cache_length(cache, 0), positions, mask, self.context_window)
        # A pair (h_p, t_{p+1}) sits at RoPE position p: one before its token's.
        return self._pass(0, ids, hidden, cache, positions - 1, mask)

    def _pass(self, index: int, ids, hidden, cache: list, positions, visible) -> torch.Tensor:
        embed, _, _, rotary = self._target_parts
        h = hidden.to(self.dtype)
        return self.mtp[index](embed(ids).to(self.dtype), h, rotary(h, positions[None]),
                               additive(visible, self.dtype), cache[index])

    def logits(self, x: torch.Tensor, index: int = 0) -> torch.Tensor:
        return self._target_parts[1](self.mtp[index].norm(x))

    def chained(self, x: torch.Tensor, index: int) -> torch.Tensor:
        return self.mtp[index].norm(x) if self.chain_after_norm else x


class TorchMTPDrafter(MTPDrafting, TorchPairedDrafting):
    """MTP on torch: one DynamicCache per module; a chain step extends only its module's."""

    def _cache_length(self) -> int:
        return max(self.model.cache_length(self.cache, i) for i in range(self.num_modules))

    def _cut(self, n: int) -> None:
        keep = self._cache_length() - n  # modules a chain skipped hold fewer entries
        for i, module_cache in enumerate(self.cache):
            crop(module_cache, max(self.model.cache_length(self.cache, i) - keep, 0))


# ---- Building from a target and its checkpoint ------------------------------------------------


def _as_torch(array) -> torch.Tensor:
    """An MLX array as a CPU torch tensor; floats through float32 (numpy has no bfloat16)."""
    import mlx.core as mx

    if mx.issubdtype(array.dtype, mx.floating):
        array = array.astype(mx.float32)
    return torch.from_numpy(np.array(array))


def fused_experts(block: dict[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """A decoder layer's published tensors as transformers holds them in memory, by its own
    conversion for `model_type` (for deepseek_v3 and glm4_moe: the per-expert gate and up
    projections stacked and concatenated into gate_up_proj, down_proj stacked)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    out = dict(block)
    for converter in get_checkpoint_conversion_mapping(model_type) or []:
        if not isinstance(converter, WeightConverter):
            continue
        collected = {}
        for pattern in converter.source_patterns:
            found = _numbered(out, pattern)
            if found:
                collected[pattern] = [out.pop(key) for key in found]
        if not collected:
            continue
        try:
            for operation in converter.operations:
                collected = operation.convert(collected, target_patterns=converter.target_patterns,
                                              source_patterns=converter.source_patterns)
        except RuntimeError as err:  # experts of different shapes
            names = " and ".join(converter.source_patterns)
            raise ValueError(f"the MTP weights do not fit the target: {names}: "
                             f"{one_line(err)}") from None
        out.update(collected)
    return out


def _numbered(tensors: dict, pattern: str) -> list[str]:
    """The keys matching a converter's source pattern ("*": an expert number), by number."""
    regex = re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))
    matches = [(m, key) for key in tensors if (m := regex.fullmatch(key))]
    return [key for m, key in sorted(matches, key=lambda pair: int(pair[0].group(1)))]


def module_weights(family, tensors: dict, prefix: str, model_type: str) -> dict:
    """One module's published tensors (under `prefix`) -> MTPModule names, its layer's as
    transformers names them (models.mtp.module_tensors splits them, for both backends)."""
    own, block = module_tensors(family, tensors, prefix)
    block = fused_experts({k: _as_torch(v) for k, v in block.items()}, model_type)
    return {**{k: _as_torch(v) for k, v in own.items()},
            **{f"layers.0.{k}": v for k, v in block.items()}}


def _dtypes(target) -> dict[str, torch.dtype]:
    """The dtype of each tensor of the target's last decoder layer, by name: an MTP layer's
    tensor is held as its twin there is (transformers keeps a MoE router in float32 in a
    bfloat16 model); the others in the target's dtype."""
    layer = decoder_layers(target)[-1]
    return {f"layers.0.{name}": t.dtype
            for name, t in [*layer.named_parameters(), *layer.named_buffers()]}


def layer_config(target):
    """The target's text config, with SDPA attention (it adds our 4D masks as given)."""
    config = copy.deepcopy(target.config.get_text_config(decoder=True))
    config._attn_implementation = "sdpa"
    return config


def build_mtp_model(target, config: dict, tensors: dict, *,
                    chain_after_norm: bool | None = None) -> MTPModel:
    """The MTP model of transformers target `target` from its MTP tensors in published names
    (models.mtp.read_mtp_tensors), on the target's device and in its dtype. A tensor missing,
    left over or of the wrong shape is a ValueError naming it."""
    family = family_of(config.get("model_type"))
    count, settings = mtp_count(config), text_config(config)
    hidden, eps = int(settings["hidden_size"]), float(settings.get("rms_norm_eps", 1e-6))
    first = int(settings["num_hidden_layers"])
    decoder = target.get_decoder()
    layer_class, norm_class = type(decoder_layers(target)[-1]), type(decoder.norm)
    layer_settings = layer_config(target)
    with torch.device("meta"):  # shapes only: the checkpoint's tensors are assigned below
        modules = [MTPModule([layer_class(layer_settings, first + i)], hidden, eps, norm_class,
                             family.hidden_first) for i in range(count)]
    model = MTPModel(modules, layer_indices=[first + i for i in range(count)],
                     embed=target.get_input_embeddings(), head=target.get_output_embeddings(),
                     final_norm=decoder.norm, rotary=decoder.rotary_emb,
                     chain_after_norm=family.chain_after_norm if chain_after_norm is None
                     else chain_after_norm)
    device, dtypes, weights = model_device(target), _dtypes(target), {}
    for i, prefix in enumerate(family.prefixes(config, count)):
        for key, value in module_weights(family, tensors, prefix, config["model_type"]).items():
            dtype = dtypes.get(key, target.dtype) if value.is_floating_point() else None
            weights[f"mtp.{i}.{key}"] = value.to(device=device, dtype=dtype)
    try:
        model.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as err:
        raise ValueError(f"the MTP weights do not fit the target: {one_line(err)}") from None
    return model.eval().requires_grad_(False)


def load_mtp_drafter(path, *, model, tokenizer=None, tree_budget: int | None = None,
                     tree_width: int = 4, tree_depth: int = 6,
                     window: int | None = None) -> TorchMTPDrafter:
    """The MTP drafter of transformers target `model` from its checkpoint directory `path` (by
    default the directory mlxspec.load read it from), checked as the MLX loader checks it;
    families other than DeepSeek-V3's layout are refused in one line (TORCH_MODEL_TYPES). `tokenizer` is accepted
    for symmetry with other drafters. `tree_budget`: EAGLE-2's dynamic tree of up to this many
    nodes (`tree_width` children per node, `tree_depth` levels) grown by module 1, instead of
    a chain."""
    check_tree_options(tree_budget, tree_width, tree_depth)
    check_drafter_window(window)
    path = Path(path)
    check_mtp_source(path, model)
    config = read_model_config(path)
    tensors, _ = read_mtp_tensors(path, config)  # the published convention: no (1 + w) norms
    mtp = build_mtp_model(model, config, tensors)
    mtp.context_window = window
    settings = text_config(config)
    return TorchMTPDrafter(mtp, num_target_layers=len(decoder_layers(model)),
                           hidden_size=int(settings["hidden_size"]),
                           target_vocab=int(settings["vocab_size"]), tree_budget=tree_budget,
                           tree_width=tree_width, tree_depth=tree_depth)


__all__ = ["MTPModel", "TorchMTPDrafter", "build_mtp_model", "load_mtp_drafter"]
