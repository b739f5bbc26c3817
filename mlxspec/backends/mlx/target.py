"""The MLX target: forward passes, acceptance and cache trimming for the shared loop."""

import functools
import inspect
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache

from ... import verdict_layout
from ...engine import Draft, Pass, Verdict
from ...prompt_cache import KeptCache
from ...rollback import (is_recurrent, recurrent_layers, restore, restore_fields, save_fields,
                         snapshot, snapshot_fields, snapshotted_layers, trim_attention)
from ...sampling import SamplingConfig
from ...tree import TreeShape
from .acceptance import accept_chain
from .early_exit import late_forward
from .hidden_states import capture_layer_outputs, concat_features, decoder_layers, record_inputs
from .ngram_rows import context_caches, roll_back_contexts
from .sampling import allowed_logits, reported_logprobs
from .state_rollback import matched_replays, roll_back_states
from .state_tape import fused_kernel_would_run, state_tape, tape_modules
from .target_parts import input_embedding
from .tree_acceptance import accept_tree_greedy, accept_tree_sampled
from .tree_pass import attention_modules, holds_trees, keep_branch, tree_pass
from .window_cache import WindowKVCache, make_cache


STAGE = "mlxspec_stage"  # where mlxspec.distributed keeps a split model's Stage


def stage_of(model):
    """The share of a split target this process runs (a distributed Stage); None for a whole
    model. Read here, beside the model it is attached to, so that describing or running a model
    does not import the distributed package."""
    return getattr(model, STAGE, None)


def model_setting(model, name: str):
    """A setting of an mlx-lm model's config, wherever the model keeps it: its `args` (most
    models) or `config` (baichuan_m1, plamo2, youtu_llm), or a multimodal wrapper's text_config
    (a dict for qwen3_5, a ModelArgs for llama4 and kimi_vl) or language model's args."""
    for args in _model_configs(model):
        value = args.get(name) if isinstance(args, dict) else getattr(args, name, None)
        if value is not None:
            return value
    return None


def _model_configs(model):
    """The config objects of an mlx-lm model, the outer model's first."""
    for owner in (model, getattr(model, "language_model", None)):
        for attr in ("args", "config"):
            args = getattr(owner, attr, None) if owner is not None else None
            if args is None:
                continue
            yield args
            text = args.get("text_config") if isinstance(args, dict) else \
                getattr(args, "text_config", None)
            if text is not None:
                yield text


def context_length(model) -> int | None:
    """Positions the model takes (gpt2's and gpt_bigcode's `n_positions`: the rows of their
    learned position table); None where the config names none."""
    value = model_setting(model, "max_position_embeddings")
    return value if value is not None else model_setting(model, "n_positions")


def vocab_size(model) -> int:
    """Rows of the model's embedding table: the token ids it can read. Read off the weights
    (configs keep the size in different places, see model_setting), else the config."""
    embedding = input_embedding(model)
    rows = embedding.weight.shape[0] if embedding is not None else \
        model_setting(model, "vocab_size")
    if rows is None:
        raise ValueError(f"cannot tell the vocabulary size of {type(model).__module__}: it has "
                         "no token embedding or vocab_size setting that mlxspec can find")
    return int(rows)


def untrimmable_caches(cache: list) -> list[str]:
    """Names of cache kinds that can never be cut back, e.g. baichuan_m1's windowed layers'
    CacheList holding a convolution state beside a RotatingKVCache: the state must be restored
    and the keys and values cut, which a window mlx-lm rotates cannot be past its size.
    Recurrent layers, falcon_h1's CacheList of a Mamba state beside keys and values included,
    and caches put back by their fields (deepseek_v41's LayerCache) roll back by other means
    (see MLXTarget and mlxspec.rollback); callers that can leave them out, and any passed in
    are named."""
    names = []
    for c in cache:
        if isinstance(c, CacheList):
            if untrimmable_caches(c.caches) or any(is_recurrent(m) for m in c.caches):
                inner = ", ".join(type(m).__name__ for m in c.caches)
                names.append(f"{type(c).__name__}({inner})")
        elif not hasattr(c, "trim") or is_recurrent(c):
            names.append(type(c).__name__)
    return sorted(set(names))


def state_mixers(model, cache: list | None = None) -> list[tuple[object, str]]:
    """(decoder layer, attribute) of each child module of a layer that takes a `cache`: where a
    layer's recurrent state is updated, whatever the model names it (Gated DeltaNet's
    `linear_attn`, Mamba's `mixer` or `mamba`, lfm2's `conv`, gear's `local_mixer`, kimi_linear's
    `self_attn`, bailing_hybrid's `attention`). Where the model keeps one cache per layer
    (`cache`, else a fresh one), only the layers whose cache is recurrent count; otherwise
    (nemotron_h keeps none for its MLP blocks) every layer's. A rollback replays the recorded
    calls that received a recurrent state (state_rollback.matched_replays), each as it was
    called (hidden_states.replay)."""
    try:
        layers = decoder_layers(model)
    except ValueError:
        return []
    caches = make_cache(model) if cache is None else cache
    if len(caches) == len(layers):
        layers = [layer for layer, c in zip(layers, caches) if is_recurrent(c)]
    return [(layer, name) for layer in layers for name in _cache_takers(layer)]


def _cache_takers(layer) -> list[str]:
    """The names of a decoder layer's child modules whose call takes a `cache`."""
    if not isinstance(layer, nn.Module):
        return []
    return [name for name, child in layer.children().items()
            if isinstance(child, nn.Module) and _takes_cache(type(child))]


@functools.cache
def _takes_cache(kind: type) -> bool:
    """Whether a module class's call takes a `cache`; read once per class (a target is built per
    generation)."""
    return "cache" in inspect.signature(kind.__call__).parameters


def committed_scores(logits, drafts, scored_at, next_row, next_token, sampling: SamplingConfig,
                     top_n: int) -> tuple[mx.array, mx.array, int]:
    """What a pass's logprobs need, lazily on the device (Pass.scores): each draft's
    log-probability at the row that scores it (`scored_at`, its parent's), the next token's at
    `next_row`, and each row's top_n (ids, values), best first. Returns (ids, values, n): top_n
    capped by the vocabulary."""
    dist = reported_logprobs(logits, sampling)  # (rows, V)
    values = [dist[scored_at, drafts]] if drafts.size else []
    values.append(dist[next_row, next_token].reshape(1))
    n = min(top_n, dist.shape[-1])
    ids = mx.zeros((0,), dtype=mx.int32)
    if n:
        ids = mx.argpartition(-dist, n - 1, axis=-1)[:, :n]
        top = mx.take_along_axis(dist, ids, axis=-1)
        order = mx.argsort(-top, axis=-1)
        ids = mx.take_along_axis(ids, order, axis=-1).flatten().astype(mx.int32)
        values.append(mx.take_along_axis(top, order, axis=-1).flatten())
    return ids, mx.concatenate(values), n


def cache_offset(cache: list) -> int | None:
    """Positions the cache holds, read off its first layer that counts them (a recurrent layer
    does not); None when none does."""
    return next((c.offset for c in cache if hasattr(c, "offset")), None)


class WholeModel:
    """The forward of a model this process holds whole, the MLX target's default. A target
    split across processes hands each rank's MLXTarget its share instead
    (mlxspec.distributed.stage.Share), with the same three methods but no early exit."""

    def __call__(self, model, tokens: mx.array, cache: list, capture_layers: Sequence[int],
                 early_exit=None):
        """Logits (1, n, V) and captured features (1, n, H*layers) or None of tokens (1, n);
        with early_exit (E, (1, n, hidden)), the first E layers already ran on them (LayerSkip's
        draft) and only layers E.. run."""
        with capture_layer_outputs(model, capture_layers) as hidden:
            if early_exit is None:
                logits = model(tokens, cache=cache)
            else:
                exit_layer, states = early_exit
                logits = late_forward(model, tokens, cache, exit_layer, states)
        return logits, concat_features(hidden) if hidden else None

    def outputs(self) -> list:
        """What a prefill chunk evaluates besides the cache's state: nothing more here."""
        return []

    def rerun(self, model, tokens: mx.array, cache: list) -> None:
        """Run kept tokens (1, n) through the model again, lazily, to rebuild a recurrent state
        of a kind that was not recorded, or a cache put back by its fields (see MLXTarget.trim)."""
        model(tokens, cache=cache)


WHOLE_MODEL = WholeModel()


class MLXTarget:
    """Wraps an mlx-lm model and its KV cache for one generation; `forward` runs the model's
    passes (this process's share of them, for a target split across processes)."""

    def __init__(
        self,
        model,
        *,
        capture_layers: Sequence[int] = (),
        speculative: bool = False,
        prefill_step_size: int = 2048,
        cache: list | None = None,
        forward=WHOLE_MODEL,
        held_features=None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
    ):
        self.model = model
        self.kv_quantization = (kv_group_size, kv_bits) if kv_bits is not None else None
        if kv_bits is not None:
            check_kv_group_size(model, kv_group_size)
        # The captured features of the positions a kept `cache` holds (its prompt's prefix), so a
        # drafter that reads them starts from it; `prompt_features` are the whole prompt's.
        self.held_features = held_features
        self.prompt_features = None
        # With features captured and recurrent layers: their states at the end of the prompt
        # (all but its last token), so a kept cache can be rewound to the prompt it keeps.
        self.prompt_state = None
        self.forward = forward
        self.cache = cache if cache is not None else make_cache(model)
        self.context_length = context_length(model)
        self.capture_layers = tuple(capture_layers)
        self.prefill_step_size = prefill_step_size
        # Recurrent layers roll back by restoring the state from before the last pass with drafts
        # and running its kept tokens again (the attention layers' caches are cut back first).
        self._recurrent = recurrent_layers(self.cache)
        # Where they are n-gram contexts only (longcat_flash_ngram's, in a model held whole), a
        # rollback sets them from the pass's inputs instead (ngram_rows).
        contexts = context_caches(model, self.cache) if forward is WHOLE_MODEL else []
        self._contexts = contexts if len(contexts) == len(self._recurrent) else []
        # Caches put back by a copy of their attributes (mlxspec.rollback.SNAPSHOT_CACHES) roll
        # back alike, always by running the kept tokens through the whole model again.
        self._snapshotted = snapshotted_layers(self.cache)
        self._mixers = state_mixers(model, self.cache) \
            if self._recurrent and not self._snapshotted else []
        # Where the recurrence runs position by position anyway, Gated DeltaNet layers keep every
        # position's state during the pass and a rollback selects (mlxspec.backends.mlx.state_tape).
        self._taped = [] if fused_kernel_would_run() else tape_modules(
            [getattr(layer, name) for layer, name in self._mixers])
        self._last_pass = None  # (states before it, its input tokens, mixer replays, tape)
        self._last_fields = None  # the snapshotted caches' fields before it
        self._attentions = None  # the modules a tree pass gives per-node RoPE positions, once
        if speculative:
            bad = untrimmable_caches([c for c in self.cache
                                      if not is_recurrent(c) and not snapshot_fields(c)])
            if bad:
                raise ValueError(
                    f"speculative decoding needs a cache that can roll back rejected drafts; this "
                    f"model uses {', '.join(bad)}, which cannot. Use --drafter none."
                )

    # It starts from a kept cache's features (held_features) and leaves its prompt's
    # (prompt_features): a drafter that reads features can continue a prompt cache.
    keeps_prompt_features = True

    def _forward(self, tokens: mx.array, cache: list | None = None, early_exit=None):
        """Logits (n, V) and captured features of `tokens`; with early_exit (E, hidden), the
        first E layers already ran on them (LayerSkip's draft) and only layers E.. run."""
        cache = self.cache if cache is None else cache
        inputs = (self.model, tokens[None], cache, self.capture_layers)
        if early_exit is None:
            logits, features = self.forward(*inputs)
        else:  # LayerSkip's (E, states (n, hidden)), batched as the tokens are (whole models only)
            exit_layer, states = early_exit
            logits, features = self.forward(*inputs, (exit_layer, states[None]))
        return logits[0], None if features is None else features[0]

    def prefill(self, tokens: Sequence[int], held: int | None = None):
        """Process all tokens but the last that the cache does not hold yet (a reused cache holds
        a prefix); return the captured features of the processed ones (n, H*layers) or None.
        `held` says how many it holds where no layer counts them (a rank of a split target
        whose layers are all recurrent is told by rank 0)."""
        held = self.offset if held is None else held
        kept = self.held_features if self.capture_layers and held else None
        if self.capture_layers and held and (kept is None or kept.shape[0] != held):
            raise ValueError("a drafter that reads target features needs a fresh target cache, "
                             "or the features of what it holds")
        body = mx.array(list(tokens[held:-1]), dtype=mx.int32)
        features = []
        for start in range(0, body.shape[0], self.prefill_step_size):
            _, chunk_features = self._forward(body[start : start + self.prefill_step_size])
            if chunk_features is not None:
                features.append(chunk_features)
            mx.eval([c.state for c in self.cache] + features + self.forward.outputs())
            mx.clear_cache()
        self._quantize_cache()
        if not self.capture_layers:
            return None
        if self._recurrent:
            self.prompt_state = snapshot(self._recurrent)
        if kept is not None:
            features.insert(0, kept)
        if not features:
            return mx.zeros((0, 0))
        self.prompt_features = mx.concatenate(features, axis=0)
        return self.prompt_features

    def _quantize_cache(self) -> None:
        """With kv_bits: the attention layers' caches become QuantizedKVCache once the prompt
        is in them (mlx-lm's maybe_quantize_kv_cache at quantized_kv_start 0), in place, so a
        kept prompt cache holds them quantized too; each later position is quantized as it is
        written."""
        if self.kv_quantization is None:
            return
        group_size, bits = self.kv_quantization
        for i, c in enumerate(self.cache):
            if type(c) is KVCache:
                self.cache[i] = c.to_quantized(group_size=group_size, bits=bits)

    def launch(self, pending: "int | Pass", draft: Draft, sampling: SamplingConfig,
               logprobs: int | None = None) -> Pass:
        """Build one pass over [pending, drafts] with its acceptance (and with `logprobs` n, the
        scores of engine.Target.launch) and queue it on the device (mx.async_eval); nothing is
        read back until `Pass.verdict()`."""
        if isinstance(draft.tokens, list):
            drafts = mx.array(draft.tokens, dtype=mx.int32)
        else:
            drafts = draft.tokens.astype(mx.int32)
        if isinstance(pending, Pass):
            head = pending.next_token.reshape(1)
        else:
            head = mx.array([pending], dtype=mx.int32)
        inputs = mx.concatenate([head, drafts]) if drafts.size else head
        if draft.parents is not None:
            return self._launch_tree(inputs, drafts, draft, sampling, logprobs)
        return self._launch_chain(inputs, drafts, draft, sampling, logprobs)

    def run_pass(self, tokens: list[int], parents: tuple[int, ...] | None = None) -> None:
        """The forward of a pass over `tokens` ([pending, drafts]; a tree's with `parents`) as
        `launch` runs it, undoable alike, without acceptance: nothing is computed until its
        outputs are evaluated (a split target's other ranks run their share of rank 0's passes
        this way, mlxspec.distributed)."""
        inputs = mx.array(tokens, dtype=mx.int32)
        if parents is None:
            self._chain_forward(inputs, len(tokens) - 1)
        else:
            with self._tree_cache(TreeShape(parents)) as cache:
                self._forward(inputs, cache)

    def _chain_forward(self, inputs, num_drafts: int, early_exit=None):
        """Logits (K+1, V) and features of a chain pass, kept undoable where a rejection must
        restore a recurrent state and re-run its kept positions."""
        undoable = bool(num_drafts and (self._recurrent or self._snapshotted))
        states = snapshot(self._recurrent) if undoable else None
        self._last_fields = save_fields(self._snapshotted) if undoable else None
        with (record_inputs(self._mixers if undoable else []) as calls,
              state_tape(self._taped if undoable else []) as tape):
            logits, features = self._forward(inputs, early_exit=early_exit)
        # Replays None (a mixer of a kind not recorded, or caches put back by their fields): a
        # rollback runs the kept tokens through the whole model instead.
        replays = None if self._snapshotted else matched_replays(calls, self._recurrent)
        self._last_pass = (states, inputs, replays, tape) if undoable else None
        return logits, features

    def _launch_chain(self, inputs, drafts, draft: Draft, sampling: SamplingConfig,
                      logprobs: int | None = None) -> Pass:
        logits, features = self._chain_forward(inputs, drafts.size, draft.early_exit)
        if draft.masks is not None:
            logits = allowed_logits(logits, draft.masks)
        accepted, next_token = accept_chain(logits, drafts, draft.probs, sampling)
        scores = None if logprobs is None else committed_scores(
            logits, drafts, mx.arange(drafts.size), accepted, next_token, sampling, logprobs)
        return self._queue(drafts, None, accepted, next_token, features, scores)

    def _launch_tree(self, inputs, drafts, draft: Draft, sampling: SamplingConfig,
                     logprobs: int | None = None) -> Pass:
        """One pass over a tree of drafts: every node sees its ancestors only (tree_pass)."""
        if draft.masks is not None:
            raise ValueError("grammar masks follow one path: send a constrained tree's first "
                             "chain")
        shape = TreeShape(draft.parents)
        with self._tree_cache(shape) as cache:
            logits, features = self._forward(inputs, cache)  # (N+1, V), (N+1, H*n)
        if sampling.greedy:
            accepted, next_token, path = accept_tree_greedy(logits, drafts, shape)
        else:
            accepted, next_token, path = accept_tree_sampled(logits, drafts, shape, draft.probs,
                                                             sampling)
        scores = None if logprobs is None else committed_scores(
            logits, drafts, mx.array(shape.parents, dtype=mx.int32), path[-1], next_token,
            sampling, logprobs)  # the branch's last node scores the next token
        return self._queue(drafts, path, accepted, next_token, features, scores)

    def _tree_cache(self, shape: TreeShape):
        if self._attentions is None:
            self._attentions = attention_modules(self.model)
        return tree_pass(self._attentions, self.cache, shape)

    @staticmethod
    def _queue(drafts, path, accepted, next_token, features, scores=None) -> Pass:
        """The pass's ints and floats (`scores`: top ids, values, n) as mlxspec.verdict_layout
        lays them out, queued."""
        next_token = next_token.astype(mx.int32)
        top_ids, values, top_n = scores if scores is not None else (None, None, 0)
        packed = mx.concatenate(verdict_layout.int_parts(
            drafts, None if path is None else path.astype(mx.int32), top_ids,
            accepted.astype(mx.int32)[None], next_token[None]))
        mx.async_eval(packed, *[a for a in (features, values) if a is not None])
        return Pass(num_draft=drafts.size, packed=packed, next_token=next_token,
                    features=features, path_slots=None if path is None else path.size,
                    scores=values, top_n=top_n)

    def settle(self, verdict: Verdict) -> None:
        if verdict.branch is None:
            self.trim(len(verdict.draft_tokens) - verdict.accepted)
        else:  # the pass put the pending token, then every node, after what the cache held
            pending_at = self.offset - len(verdict.draft_tokens) - 1
            keep_branch(self.cache, pending_at, verdict.branch)

    def holds_trees(self) -> bool:
        return holds_trees(self.cache)

    def trim(self, n: int) -> None:
        """Drop the last n positions, all of them from the last pass with drafts."""
        if n <= 0:
            return
        if not self._recurrent and not self._snapshotted:
            for c in self.cache:
                c.trim(n)
            return
        # Recurrent states and caches put back by their fields return to before the pass; the
        # kept tokens then run again.
        states, inputs, replays, tape = self._last_pass
        keep = inputs.size - n
        if self._contexts:
            trim_attention(self.cache, n)
            roll_back_contexts(self._contexts, [s[0] for s in states], inputs[None], [keep])
            return
        if replays is not None:
            # Causal layers: the kept positions' inputs to each recurrent layer are the ones the
            # pass recorded, so only those layers' state updates run again (state_rollback);
            # attention caches drop n.
            trim_attention(self.cache, n)
            roll_back_states(self._recurrent, states, replays, tape, [keep])
            return
        restore(self._recurrent, states)
        restore_fields(self._snapshotted, self._last_fields)
        trim_attention(self.cache, inputs.size)
        self.forward.rerun(self.model, inputs[None, :keep], self.cache)  # lazy: with the next pass

    def rollback_room(self) -> int | None:
        """How many positions the next pass may write and still roll back (None: any number).
        A sliding window held as a WindowKVCache keeps what any rollback of its last pass
        needs; one mlx-lm still rotates (a RotatingKVCache keeping leading positions) rolls
        back exactly only while the pass stays within its window. A cache put back by its
        fields (SNAPSHOT_CACHES) rolls back any pass."""
        room = None
        for c in self.cache:
            if is_recurrent(c) or isinstance(c, WindowKVCache) or snapshot_fields(c):
                continue
            if not c.is_trimmable():
                return 0
            window = getattr(c, "max_size", None)
            if window is not None:
                room = min(window - c.offset, room if room is not None else window)
        return room

    @property
    def offset(self) -> int:
        return cache_offset(self.cache) or 0


def check_kv_group_size(model, group_size: int) -> None:
    """Keys and values are quantized in groups along each head: the head size must split into
    them (a one-line ValueError before any compute, not MLX's from inside a pass)."""
    args = getattr(model, "args", None)
    head_dim = getattr(args, "head_dim", None)
    if head_dim is None and args is not None and getattr(args, "num_attention_heads", None):
        head_dim = args.hidden_size // args.num_attention_heads
    if head_dim and head_dim % group_size:
        raise ValueError(f"kv_group_size {group_size} does not divide the model's attention "
                         f"head size {head_dim}; use a divisor of it (32, 64 or 128)")


class PromptCache(KeptCache):
    """mlx-lm's per-layer caches kept across calls (chat turns): see KeptCache. `save` and
    `load` keep it in a safetensors file across processes (prompt_cache_file.py beside this)."""

    def save(self, path) -> None:
        """Write what it holds to `path` (safetensors), whole or not at all."""
        model = self._model() if self._model is not None else None
        if model is None:
            raise ValueError("the prompt cache holds nothing yet: generate with it first")
        from .prompt_cache_file import save

        save(self, path, model)

    @classmethod
    def load(cls, path, model) -> "PromptCache":
        """A prompt cache for `model` holding what `path` holds; ValueError (one line) for
        another model's file, or one truncated or corrupted."""
        from .prompt_cache_file import load

        kept = cls()
        load(kept, path, model)
        return kept

    def _new(self, model) -> list:
        return make_cache(model)

    def _held(self) -> int | None:
        return cache_offset(self.cache)

    def _can_cut(self) -> bool:
        return all(c.is_trimmable() for c in self.cache)

    def _cut(self, n: int) -> None:
        for c in self.cache:
            c.trim(n)

    def _rewind(self, prompt_state, n: int) -> None:
        """The recurrent layers' states as MLXTarget.prefill left them (`prompt_state`), the
        attention layers cut back to the same n positions."""
        restore(recurrent_layers(self.cache), prompt_state)
        trim_attention(self.cache, (self._held() or 0) - n)

    def prefix(self, n: int) -> list:
        if n == len(self.tokens):
            return self.cache
        views = []
        for c in self.cache:  # cut short only where shared() found every layer trimmable
            if type(c) is QuantizedKVCache:  # kv_bits
                view = QuantizedKVCache(c.group_size, c.bits)
            elif type(c) is KVCache:
                view = KVCache()
            elif type(c) is WindowKVCache:  # nothing forgotten yet (shared() checked)
                view = WindowKVCache(c.window, c.spare)
            else:
                raise ValueError(f"a {type(c).__name__} cannot lend a shorter prefix")
            view.keys, view.values, view.offset = c.keys, c.values, n
            views.append(view)
        return views
