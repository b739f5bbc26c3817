"""The torch target: a transformers causal LM and its DynamicCache, for the shared loop.

Same contract as mlxspec.backends.mlx.target.MLXTarget: prefill all but the pending token, verify
[pending, drafts] in one forward pass, accept on the device, read one packed tensor back to the
host, crop the cache to the committed tokens. Sliding-window layers are held as WindowLayers
(window_cache.py), which keep what that crop needs past the window. Hybrid models (Qwen3-Next,
Qwen3.5) also hold linear-attention layers whose state each pass overwrites: a rejection
restores it from a copy taken before the pass and runs the kept tokens again.

A tree of drafts goes through the model as one sequence [pending, node 1, ..., node N] with a 4D
attention mask (each node sees the cached context, itself and its ancestors) and position ids
past + depth; transformers uses a 4D mask as given (masking_utils returns it unchanged, and SDPA
or eager attention adds it). Afterwards the committed branch's keys and values are moved to the
positions after the pending token, which is where their rotation already put them.
"""

import inspect
from contextlib import contextmanager
from typing import Sequence

import torch

from ... import verdict_layout
from ...engine import Draft, Pass, Verdict
from ...prompt_cache import KeptCache
from ...sampling import SamplingConfig
from ...target_sizes import TargetSizes
from ...tree import TreeShape
from .acceptance import accept_greedy, accept_sampled
from .sampling import allowed_logits, reported_logprobs, sample_token
from .transfer import host_tokens
from .tree_acceptance import DeviceTree, accept_tree_greedy, accept_tree_sampled
from .window_cache import WindowLayer, rollback_windows


def context_length(model) -> int | None:
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def cache_argument(model) -> str:
    """transformers 5.2x renamed forward's `past_key_values` to `cache`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def make_cache(model, slack: int = 0):
    """A fresh DynamicCache laid out for the model's layer types, as transformers' own generate
    builds it: full or sliding attention, and for hybrids (Qwen3-Next, Qwen3.5) linear-attention
    layers holding a convolution window and a recurrent state. Its sliding-window layers are
    WindowLayers, which roll back exactly past the window (`slack`: see WindowLayer)."""
    from transformers import DynamicCache

    config = model.config
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    try:
        cache = DynamicCache(config=config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()
    return rollback_windows(cache, slack)


def cache_length(cache) -> int:
    return int(cache.get_seq_length()) if cache is not None else 0


def can_crop(cache) -> bool:
    """Whether cropping any number of positions puts the cache back exactly: not once a
    sliding-window layer has forgotten positions (a WindowLayer still crops what a pass
    wrote: see its `room`), nor with recurrent layers (transformers 5.25 calls them croppable,
    yet crops them only while they record their past, which mlxspec never asks for: it
    restores them from a snapshot instead)."""
    if recurrent_layers(cache):
        return False
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return all(crops_anything(layer) for layer in layers)
    croppable = getattr(cache, "is_croppable", None)
    if croppable is not None:
        return bool(croppable)
    return not any(getattr(cache, "is_sliding", None) or [])


def crops_anything(layer) -> bool:
    """Whether a layer crops any number of positions exactly: a sliding window only while
    it has forgotten nothing (transformers' layer keeps window - 1 of what it saw)."""
    if isinstance(layer, WindowLayer):
        return layer.crops_anything()
    if getattr(layer, "is_sliding", False):
        return layer.get_seq_length() < layer.sliding_window
    return bool(getattr(layer, "is_croppable", True))


def crop(cache, n: int) -> None:
    """Drop the last n positions. `crop(-n)` means "remove n" in every transformers 5 release
    (5.2x refuses positive values; earlier ones read them as a length to keep)."""
    if n > 0:
        cache.crop(-n)


def holds_recurrent_state(layer) -> bool:
    """A linear-attention layer's cache (transformers' LinearAttentionLayer: Gated DeltaNet in
    Qwen3-Next and Qwen3.5): a convolution window and a recurrent state that each pass overwrites
    in place, with no keys and values of its own. It cannot be cropped, only restored."""
    return (hasattr(layer, "recurrent_states") and hasattr(layer, "conv_states")
            and not hasattr(layer, "keys"))


def recurrent_layers(cache) -> list:
    return [layer for layer in getattr(cache, "layers", ()) if holds_recurrent_state(layer)]


def layers_that_cannot_roll_back(cache) -> list[str]:
    """Kinds of the cache's layers that neither crop exactly nor restore from a snapshot (e.g. a
    layer with both a recurrent state and keys); empty when speculative decoding can run."""
    layers = getattr(cache, "layers", None)
    if layers is None:  # a cache without per-layer objects: it crops as a whole, or not at all
        return [] if can_crop(cache) else [type(cache).__name__]
    return sorted({type(layer).__name__ for layer in layers if not rolls_back(layer)})


def rolls_back(layer) -> bool:
    """A recurrent layer restores from a snapshot; a layer with a recurrent state and keys
    neither restores nor crops (transformers 5.25 calls it croppable, but only while it
    records its past); any other crops where it says it can."""
    if holds_recurrent_state(layer):
        return True
    return not hasattr(layer, "recurrent_states") and getattr(layer, "is_croppable", True)


def holds_trees(cache, model) -> bool:
    """Whether one pass can verify a tree: every cache layer a full-attention DynamicLayer, whose
    entries can be moved by index (a recurrent state folds every node into one; a sliding
    window, even a WindowLayer, hands attention fewer keys than the one 4D tree mask covers),
    and an attention that adds a 4D mask as given (SDPA, eager; flash-attention kernels take no
    such mask)."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    lazy = getattr(cache, "layer_class_to_replicate", None)  # layers added on first use
    attention = getattr(model.config, "_attn_implementation", None)
    return (layers is not None and all(type(layer) is DynamicLayer for layer in layers)
            and lazy in (None, DynamicLayer) and attention in ("sdpa", "eager"))


def ancestor_mask(tree: DeviceTree) -> torch.Tensor:
    """(N+1, N+1) bool: row i is True at node i and at each of its ancestors."""
    node = torch.arange(tree.parents.shape[0], device=tree.parents.device)
    seen, up = node[:, None] == node, node
    for _ in range(tree.shape.max_depth):
        up = tree.parents[up]
        seen |= up[:, None] == node
    return seen


def tree_attention(tree: DeviceTree, past: int, dtype: torch.dtype):
    """The attention mask (1, 1, N+1, past + N+1) and position ids (1, N+1) that make one pass
    over [pending, nodes] score each node after its own branch: an additive mask, 0 where a node
    sees the cached context, itself or an ancestor and -inf elsewhere, and each node at position
    past + depth, where a prefill of its branch would put it."""
    ancestors = ancestor_mask(tree)
    visible = torch.cat([ancestors.new_ones(ancestors.shape[0], past), ancestors], dim=1)
    return additive(visible, dtype), (past + tree.depth)[None]


def additive(visible: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool visibility (L, S) as transformers' attention adds it: (1, 1, L, S), 0 or -inf
    (a 4D mask it uses as given)."""
    if visible is None:
        return None
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill(~visible, float("-inf"))[None, None]


def keep_branch(cache, pending_at: int, branch: list[int], device: torch.device) -> None:
    """After a tree pass that put the pending token at `pending_at` and its nodes after it, keep
    the pending token and the nodes of `branch` (1-based, root to leaf) in order: each layer's
    keys and values of the branch are gathered to the positions after the pending token, the
    rest cropped, leaving what a prefill of the committed tokens builds. A chain's branch is
    already in place and is only cropped."""
    start, end = pending_at + 1, pending_at + 1 + len(branch)
    if branch != list(range(1, len(branch) + 1)):
        sources = host_tokens([pending_at + n for n in branch], device)
        for layer in cache.layers:
            layer.keys[..., start:end, :] = layer.keys.index_select(-2, sources)
            layer.values[..., start:end, :] = layer.values.index_select(-2, sources)
    crop(cache, cache_length(cache) - end)


def committed_scores(logits, drafts, scored_at, next_row, next_token, sampling: SamplingConfig,
                     top_n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """mlxspec.backends.mlx.target.committed_scores in torch, with no host sync: (top ids, values, n).
    `next_row` and `next_token` are 1-element tensors (a 0-d index would be read to the host)."""
    dist = reported_logprobs(logits, sampling)  # (rows, V)
    values = [dist[scored_at, drafts], dist[next_row, next_token]]
    n = min(top_n, dist.shape[-1])
    top = torch.topk(dist, n, dim=-1)  # sorted, best first
    return top.indices.flatten(), torch.cat(values + [top.values.flatten()]), n


def snapshot(layers: list) -> list:
    """Copies of the recurrent layers' states (they are updated in place, so a reference would
    not do), with whether each had seen any token yet, and the tokens each has counted
    (transformers 5.25 counts them per linear-attention layer, and a hybrid cache's
    get_seq_length may read that count)."""
    return [
        ({i: (layer.has_previous_state[i],
              None if layer.conv_states[i] is None else layer.conv_states[i].clone(),
              None if layer.recurrent_states[i] is None else layer.recurrent_states[i].clone())
          for i in layer.conv_states},
         _cloned(getattr(layer, "cumulative_length_linear", None)))
        for layer in layers
    ]


def restore(layers: list, states: list) -> None:
    for layer, (saved, length) in zip(layers, states):
        for i, (seen, conv, recurrent) in saved.items():
            layer.has_previous_state[i] = seen  # False: the next pass starts the state afresh
            if conv is not None:
                layer.conv_states[i] = conv
            if recurrent is not None:
                layer.recurrent_states[i] = recurrent
        if length is not None:
            layer.cumulative_length_linear.copy_(length)


def _cloned(tensor):
    return None if tensor is None else tensor.clone()


def decoder_layers(model) -> list:
    for owner in (getattr(model, "model", None), model, getattr(model, "language_model", None)):
        layers = getattr(owner, "layers", None) if owner is not None else None
        if isinstance(layers, torch.nn.ModuleList):
            return list(layers)
    raise ValueError(f"{type(model).__name__} has no list of decoder layers to capture from")


def target_sizes(model) -> TargetSizes:
    """(hidden size, vocab size, decoder layers) of a transformers model, read as the MLX
    backend's target_parts.target_sizes reads them, so drafter checks speak in one voice."""
    vocab, hidden = model.get_input_embeddings().weight.shape
    hidden = getattr(model.config, "hidden_size", hidden)
    return TargetSizes(int(hidden), int(vocab), len(decoder_layers(model)))


def embedding_checksum(model) -> float:
    """Sum of the first 8 embedding rows, as target_parts.embedding_checksum."""
    return float(model.get_input_embeddings().weight[:8].float().sum().item())


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


@contextmanager
def capture_layer_outputs(model, layer_ids):
    """Yield a list that, after the forward pass, holds the outputs of `layer_ids` in order
    (before the final norm, as mlxspec.backends.mlx.hidden_states captures them). Hooks live for one call:
    the caller's model is never left altered and plain decoding pays nothing."""
    if not layer_ids:
        yield []
        return
    layers = decoder_layers(model)
    bad = [i for i in layer_ids if not 0 <= i < len(layers)]
    if bad:
        raise ValueError(f"layer ids {bad} out of range for a {len(layers)}-layer target")
    sink, outputs = {}, []

    def recorder(index):
        def hook(module, args, output):
            sink[index] = _first(output)

        return hook

    handles = [layers[i].register_forward_hook(recorder(i)) for i in set(layer_ids)]
    try:
        yield outputs
        outputs.extend(sink[i] for i in layer_ids)
    finally:
        for handle in handles:
            handle.remove()


class TorchTarget:
    """Wraps a transformers causal LM and its KV cache for one generation."""

    def __init__(
        self,
        model,
        *,
        capture_layers: Sequence[int] = (),
        speculative: bool = False,
        prefill_step_size: int = 2048,
        cache=None,
    ):
        self.model = model
        self.device = model_device(model)
        self.cache = cache if cache is not None else make_cache(model)
        self.context_length = context_length(model)
        self.capture_layers = tuple(capture_layers)
        self.prefill_step_size = prefill_step_size
        self._cache_arg = cache_argument(model)
        # Recurrent layers roll back by restoring their states from before the last pass with
        # drafts and running its kept tokens again (the attention layers are cropped first).
        self._recurrent = recurrent_layers(self.cache)
        self._last_pass = None  # (recurrent states before it, its input tokens)
        self._stuck = layers_that_cannot_roll_back(self.cache)  # its layers' kinds stay
        self._trees = holds_trees(self.cache, model)
        stuck = self._stuck if speculative else []
        if stuck:
            raise ValueError(
                f"speculative decoding needs a cache that can roll back rejected drafts; this "
                f"model's {type(self.cache).__name__} has {', '.join(stuck)} layers, which "
                "cannot. Use --drafter none."
            )

    def _forward(self, tokens: torch.Tensor, last_only: bool = False, **inputs):
        kwargs = {self._cache_arg: self.cache, "use_cache": True, **inputs}
        if last_only:
            kwargs["logits_to_keep"] = 1
        with capture_layer_outputs(self.model, self.capture_layers) as hidden:
            out = self.model(input_ids=tokens[None], **kwargs)
        features = torch.cat(hidden, dim=-1)[0] if hidden else None
        return out.logits[0], features

    @torch.inference_mode()
    def prefill(self, tokens: Sequence[int]):
        """Process all tokens but the last that the cache does not hold yet (a reused cache holds
        a prefix); return the captured features of the processed ones (n, H*layers) or None."""
        if self.capture_layers and self.offset:
            raise ValueError("a drafter that reads target features needs a fresh target cache")
        body = host_tokens(tokens[self.offset : -1], self.device)
        features = []
        for start in range(0, body.shape[0], self.prefill_step_size):
            _, chunk = self._forward(body[start : start + self.prefill_step_size], last_only=True)
            if chunk is not None:
                features.append(chunk)
        if not self.capture_layers:
            return None
        if not features:
            return torch.zeros((0, 0), device=self.device)
        return torch.cat(features, dim=0)

    @torch.inference_mode()
    def launch(self, pending: "int | Pass", draft: Draft, sampling: SamplingConfig,
               logprobs: int | None = None) -> Pass:
        """One forward pass over [pending, drafts] and its acceptance (and with `logprobs` n, the
        scores of engine.Target.launch), queued on the device (CUDA runs it asynchronously);
        nothing is read back until `Pass.verdict()`."""
        if isinstance(draft.tokens, list):
            drafts = host_tokens(draft.tokens, self.device)
        elif isinstance(draft.tokens, torch.Tensor):
            drafts = draft.tokens.to(device=self.device, dtype=torch.long)
        else:
            kind = type(draft.tokens)
            raise TypeError(
                f"draft tokens are a {kind.__module__}.{kind.__name__}: this drafter was built for "
                "another backend; load it with the torch target model"
            )
        if isinstance(pending, Pass):
            head = pending.next_token.reshape(1)
        else:
            head = host_tokens([pending], self.device)
        inputs = torch.cat([head, drafts])
        if draft.parents is not None and draft.masks is not None:
            raise ValueError("grammar masks follow one path: send a constrained tree's first "
                             "chain")
        if draft.parents is not None:
            return self._launch_tree(inputs, drafts, draft, sampling, logprobs)
        undoable = bool(drafts.shape[0] and self._recurrent)  # plain passes copy nothing
        self._last_pass = (snapshot(self._recurrent), inputs) if undoable else None
        logits, features = self._forward(inputs)  # (K+1, V), (K+1, H*n)
        if draft.masks is not None:
            logits = allowed_logits(logits, draft.masks)
        if drafts.shape[0] == 0:
            accepted = torch.zeros((), dtype=torch.long, device=self.device)
            next_token = sample_token(logits[-1], sampling)
        elif sampling.greedy:
            accepted, next_token = accept_greedy(logits, drafts)
        else:
            accepted, next_token = accept_sampled(logits, drafts, self._probs(draft), sampling)
        scores = None if logprobs is None else committed_scores(
            logits, drafts, torch.arange(drafts.shape[0], device=self.device),
            accepted.reshape(1), next_token.reshape(1), sampling, logprobs)
        return self._queue(drafts, None, accepted, next_token, features, scores)

    def _launch_tree(self, inputs, drafts, draft: Draft, sampling: SamplingConfig,
                     logprobs: int | None = None) -> Pass:
        """One pass over a tree of drafts: every node sees its ancestors only (tree_attention)."""
        tree = DeviceTree.of(TreeShape(draft.parents), self.device)
        mask, positions = tree_attention(tree, self.offset, self.model.dtype)
        logits, features = self._forward(inputs, attention_mask=mask, position_ids=positions)
        if sampling.greedy:
            accepted, next_token, path = accept_tree_greedy(logits, drafts, tree)
        else:
            accepted, next_token, path = accept_tree_sampled(logits, drafts, tree,
                                                             self._probs(draft), sampling)
        scores = None if logprobs is None else committed_scores(
            logits, drafts, tree.parents[1:], path[-1:], next_token.reshape(1), sampling,
            logprobs)  # the branch's last node scores the next token
        return self._queue(drafts, path, accepted, next_token, features, scores)

    def _probs(self, draft: Draft):
        return draft.probs.to(self.device) if draft.probs is not None else None

    @staticmethod
    def _queue(drafts, path, accepted, next_token, features, scores=None) -> Pass:
        """The pass's ints and floats (`scores`: top ids, values, n) as mlxspec.verdict_layout
        lays them out; the floats travel beside the ints."""
        next_token = next_token.reshape(()).to(torch.long)
        top_ids, values, top_n = scores if scores is not None else (None, None, 0)
        packed = torch.cat(verdict_layout.int_parts(drafts, path, top_ids, accepted.reshape(1),
                                                    next_token.reshape(1)))
        return Pass(num_draft=int(drafts.shape[0]), packed=packed, next_token=next_token,
                    features=features, path_slots=None if path is None else int(path.shape[0]),
                    scores=values, top_n=top_n)

    @torch.inference_mode()
    def trim(self, n: int) -> None:
        """Drop the last n positions, all of them from the last pass, which had drafts."""
        if n <= 0:
            return
        if not self._recurrent:
            crop(self.cache, n)
            return
        states, inputs = self._last_pass
        restore(self._recurrent, states)
        for layer in self.cache.layers:
            if not holds_recurrent_state(layer):
                layer.crop(-inputs.shape[0])
        keep = inputs[: inputs.shape[0] - n]
        self.model(input_ids=keep[None], **{self._cache_arg: self.cache, "use_cache": True},
                   logits_to_keep=1)
        self._last_pass = None

    @torch.inference_mode()
    def settle(self, verdict: Verdict) -> None:
        if verdict.branch is None:
            self.trim(len(verdict.draft_tokens) - verdict.accepted)
        else:  # the pass put the pending token, then every node, after what the cache held
            pending_at = self.offset - len(verdict.draft_tokens) - 1
            keep_branch(self.cache, pending_at, verdict.branch, self.device)

    def holds_trees(self) -> bool:
        return self._trees

    def rollback_room(self) -> int | None:
        """How many positions the next pass may write and still crop back exactly (None: any
        number). A WindowLayer keeps what any crop of its last pass needs; transformers' own
        sliding-window layer (a cache handed in) keeps its last window - 1 positions, so a pass
        crops back only while what it adds fits beside what it holds."""
        if self._stuck:
            return 0
        rooms = [layer.sliding_window - 1 - layer.get_seq_length()
                 for layer in getattr(self.cache, "layers", None) or []
                 if getattr(layer, "sliding_window", None) and not isinstance(layer, WindowLayer)]
        return max(min(rooms), 0) if rooms else None

    @property
    def offset(self) -> int:
        return cache_length(self.cache)


class TorchPromptCache(KeptCache):
    """mlxspec.PromptCache for the torch backend: a DynamicCache kept across calls (chat turns);
    see KeptCache."""

    def _new(self, model):
        return make_cache(model)

    def _held(self) -> int:
        return cache_length(self.cache)

    def _can_cut(self) -> bool:
        return can_crop(self.cache)

    def _cut(self, n: int) -> None:
        crop(self.cache, n)
