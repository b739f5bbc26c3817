"""The MLX target for many sequences at once (issue #39): one forward pass verifies every row's
ragged drafts, and each row then rolls back by its own amount.

Rows live in mlx-lm's batch caches: its batch-aware ArraysCache for recurrent layers, and for
attention its BatchKVCache with an end per row (RaggedKVCache); joining rows are prefilled in
mlx-lm's own BatchKVCache and then `extend` the batch, leaving rows are `filter`ed out.
A pass right-pads each row's [pending, drafts] to S = 1 + max K with any token: causal masking
keeps every real query blind to the pads after it, and the rollback always drops them.

Rolling back row i by drop_i positions: every attention cache (a RaggedKVCache: mlx-lm's
BatchKVCache with an end per row) moves row i's end back by drop_i, nothing copied, and the
next pass writes each row after its own end. A recurrent layer takes each row's state after its
last kept position: from the state tape where the recurrence runs position by position anyway
(the CPU), else by re-running the layer on the pass's recorded input from the state before it
with `ArraysCache.prepare(lengths=keep)`, which stops each row's state at its own length
(baichuan_m1's state, its attention's last position's projections: that module run again on
each row's last kept input alone, state_rollback.stop_at_last_position). Where the recorded
calls miss a state (rwkv7's two mixers share one cache), the states go back to before the pass
and the pass runs again over each row's kept positions (padded_rows.rerun_kept).

A layer's CacheList (falcon_h1's Mamba state beside keys and values, an indexer's keys beside
the attention's) holds each member as the batch holds that kind at top level, and its members
roll back each as their kind does. A chunked-attention layer (llama4's ChunkedKVCache) is held as
ChunkedRows, each row masked to its own chunk (batch_adapters). Models that no batch can hold
exactly are refused in one line (batch_refusal): minimax_m3_vl's sparse attention. deepseek_v41's
layers hold one LayerCache per row, its attentions run row by row (layer_rows).
longcat_flash_ngram's n-gram context, kept beside its layers, is each row's own through a
per-call adapter and is set back from the pass's inputs (ngram_rows).

Rows sample from the global MLX random stream, in row order: there are no per-row seeds.
"""

import copy
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    make_prompt_cache,
)

from ... import verdict_layout
from ...engine import Draft, Pass, Start, Verdict
from ...rollback import is_recurrent, leaves, recurrent_layers, restore, snapshot
from ...sampling import SamplingConfig
from ...verdict_layout import HostInts
from .acceptance import accept_chain
from .batch_adapters import rows_at_their_positions
from .batch_prefill import JoiningRows, keep_rows, last_position_mixers
from .hidden_states import capture_layer_outputs, concat_features, record_inputs
from .layer_rows import holds_rows, joining_rows
from .ngram_rows import context_caches, roll_back_contexts, widened
from .padded_rows import rerun_kept
from .padding_probe import padding_refusal
from .ragged_cache import ChunkedRows, RaggedKVCache, RaggedQuantizedKVCache
from .sampling import allowed_logits
from .state_rollback import matched_replays, roll_back_states
from .state_tape import fused_kernel_would_run, state_tape, tape_modules
from .window_cache import WindowKVCache, make_cache
from .target import (
    cache_offset,
    check_kv_group_size,
    committed_scores,
    context_length,
    state_mixers,
)


@dataclass
class BatchPass:
    """One batched pass queued on the device and not yet read. `verdicts()` is its one wait."""

    num_drafts: list[int]
    next_tokens: mx.array  # (rows,) int32, device: the pending tokens of a plain pass after it
    logits: mx.array  # (rows, S, V): row i's verify logits are [i, : num_drafts[i] + 1]
    packed: mx.array  # every row's ints (mlxspec.verdict_layout), one row after another
    scores: mx.array | None  # every scored row's floats (verdict_layout), one after another
    features: list | None  # per row (K_i + 1, H * layers), or None
    top_n: list[int]  # per row: how many top logprobs it scores; -1 where none were asked
    layout: int  # the batch's row layout it ran on (see MLXBatchTarget._layout)

    def verdicts(self) -> list[Verdict]:
        ints = self.packed.tolist()  # waits for the pass: its one host sync
        floats = self.scores.tolist() if self.scores is not None else None  # evaluated with it
        verdicts, at, fat = [], 0, 0
        for i, k in enumerate(self.num_drafts):  # each row's part, decoded as a lone pass's
            n = self.top_n[i]
            width = verdict_layout.int_width(k, None, max(n, 0))
            row_scores = None
            if floats is not None and n >= 0:
                row_scores = HostInts(floats[fat : fat + verdict_layout.float_width(k, n)])
                fat += len(row_scores)
            row = Pass(num_draft=k, packed=HostInts(ints[at : at + width]), next_token=None,
                       features=None if self.features is None else self.features[i],
                       scores=row_scores, top_n=max(n, 0))
            verdicts.append(row.verdict())
            at += width
        return verdicts


class MLXBatchTarget:
    """An mlx-lm model verifying chains of drafts for a changing batch of sequences."""

    def __init__(self, model, *, capture_layers: Sequence[int] = (),
                 prefill_step_size: int = 2048, kv_bits: int | None = None,
                 kv_group_size: int = 64, check_padding: bool = True):
        self.model = model
        # kv_bits: the rows' attention caches hold keys and values quantized (as a single
        # sequence's with kv_bits: its prompt prefilled at full precision, then quantized).
        self.kv_quantization = None if kv_bits is None else (kv_group_size, kv_bits)
        if kv_bits is not None:
            check_kv_group_size(model, kv_group_size)
        self.context_length = context_length(model)
        self.capture_layers = tuple(capture_layers)
        probe = make_cache(model)
        refusal = batch_refusal(model, probe)
        if refusal is not None:
            raise ValueError(refusal)
        # Per layer: its sliding window (None: full attention or a recurrent state; a tuple of
        # its members' for a CacheList). Joining rows prefill such a layer in a plain batch
        # cache, masked to the window; the running batch holds it as a RaggedKVCache with that
        # window.
        self._windows = [_windows(c) for c in probe]
        if any(type(m).__name__ == "DynamicNTKScalingRoPE" for _, m in model.named_modules()):
            raise ValueError("dynamic NTK RoPE reads its position as one Python int, so rows "
                             "at different positions cannot share a pass")
        # An n-gram context (longcat_flash_ngram's) is a state no layer updates: a rollback
        # sets it from the pass's inputs (ngram_rows), apart from the recurrent layers'.
        self._contexts_held = len(context_caches(model, probe))  # first in the cache list
        self._has_recurrent = any(is_recurrent(c) for c in probe[self._contexts_held :])
        # deepseek_v41's layers: one LayerCache per row, put back by their fields (layer_rows).
        self._layer_rows = holds_rows(model)
        # The modules that update recurrent states, whose calls a rollback runs again: each
        # layer's modules taking a cache (state_mixers), and those whose state is their last
        # position's (baichuan_m1's attention: batch_prefill.last_position_mixers).
        known = state_mixers(model) if self._has_recurrent else []
        last_position = last_position_mixers(model) if self._has_recurrent else []
        self._mixers = known + last_position
        self._last_position = frozenset(id(getattr(layer, name)) for layer, name in last_position)
        self._taped = [] if fused_kernel_would_run() else tape_modules(
            [getattr(layer, name) for layer, name in self._mixers])
        self.cache = None  # mlx-lm batch caches, one per layer; None while no row is held
        self._joining = JoiningRows(model, self.capture_layers, prefill_step_size, known,
                                    last_position)
        # Rows prefilled alone as they were added (_prefill_alone), waiting for `fill`.
        self._prefilled: list = []
        self._tickets = 0
        self._rows = 0
        self._layout = 0  # bumped by add/remove: a pass's rollback cannot span them
        self._last = None  # what rolling back the last pass needs (see _record)
        # Per row whose caches are kept when it leaves (`add`'s `kept`), with features captured
        # and recurrent layers: their states at the end of its prompt, so its kept cache can be
        # rewound to it (KeptCache.remember_prompt); None for every other row.
        self._prompt_states: list = []
        self._keeping: set[int] = set()  # tickets of joining rows that will be kept
        # Once per model: its rows must come out of a batch as they do alone (padding_probe).
        refusal = padding_refusal(model, MLXBatchTarget) if check_padding else None
        if refusal is not None:
            raise ValueError(refusal)

    @property
    def rows(self) -> int:
        return self._rows

    def bind(self, drafter) -> None:
        """A row's drafter; one that drafts inside the target's own cache cannot be one."""
        drafter.check_batchable()
        refusal = self.drafting_refusal(drafter)
        if refusal is not None:
            raise ValueError(refusal)
        drafter.bind(self)

    def drafting_refusal(self, drafter) -> str | None:
        """Why rows with `drafter` cannot be verified in this batch (None: they can): a model
        with recurrent layers none of whose modules takes their cache cannot take one row's
        rejected drafts out of their states."""
        if drafter.max_draft and self._has_recurrent and not self._mixers:
            return (f"the {drafter.name} drafter cannot run in a batch on this model: mlxspec "
                    "finds no module updating its recurrent states, so it cannot take a row's "
                    "rejected drafts out of their states; its requests run one at a time")
        return None

    # -- joining and leaving ------------------------------------------------------------------

    def add(self, prompts: list[list[int]], starts: list | None = None,
            kept: list[bool] | None = None) -> list[int]:
        """New rows start joining, each to be prefilled on all its tokens but the last (the
        pending one) by `fill`; starts[i], where given, is an engine.Start (or a tuple of its
        fields): a kept prompt cache already holding the first n tokens of prompts[i] (and,
        for a target capturing features, their features); kept[i]: whether row i's caches
        will be copied out when it leaves (`row_cache`), so what rewinding them to the prompt
        needs is recorded for it alone. Returns a ticket per row, for `fill` to name it by."""
        if not prompts:
            return []
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        starts = [None if s is None else Start(*s) for s in starts or [None] * len(prompts)]
        if any(s is not None and not 0 <= s.length < len(p) for s, p in zip(starts, prompts)):
            raise ValueError("a kept cache holds a prefix of its prompt, never all of it")
        if self.capture_layers and any(
                s is not None and (s.features is None or s.features.shape[0] != s.length)
                for s in starts):
            raise ValueError("a row whose drafter reads the prompt's features starts from a "
                             "kept cache only with the features of what it holds")
        for s in starts:
            for c in s.caches if s is not None else ():
                if isinstance(c, QuantizedKVCache) and \
                        self.kv_quantization != (c.group_size, c.bits):
                    raise ValueError(
                        f"a kept cache quantized to {c.bits} bits in groups of {c.group_size} "
                        "continues only in a batch with the same kv_bits and kv_group_size")
        tickets = list(range(self._tickets, self._tickets + len(prompts)))
        self._tickets += len(prompts)
        self._keeping.update(t for t, keep in zip(tickets, kept or []) if keep)
        bodies = [list(p[s.length if s else 0 : -1]) for p, s in zip(prompts, starts)]
        quantized = [s is not None and any(isinstance(c, QuantizedKVCache) for c in s.caches)
                     for s in starts]
        for ticket, body, start in zip(tickets, bodies, starts):
            if start is not None and any(isinstance(c, QuantizedKVCache) for c in start.caches):
                self._prefilled.append((ticket, *self._prefill_alone(body, start)))
        rest = [i for i, q in enumerate(quantized) if not q]
        if rest:
            joining = [self._joining_caches(starts[i].caches if starts[i] else None)
                       for i in rest]
            self._joining.add([tickets[i] for i in rest], [bodies[i] for i in rest],
                              [caches for caches, _ in joining],
                              [starts[i].features if starts[i] and self.capture_layers else None
                               for i in rest],
                              [forgotten for _, forgotten in joining])
        return tickets

    def _joining_caches(self, kept: list | None) -> tuple[list, list[int]]:
        """A joining row's single-sequence caches (`kept`: a kept prompt cache's; None: fresh
        ones) as its prefill merges them, and per layer the positions forgotten before them:
        a sliding window's layer prefills in a plain KVCache of the positions it holds, which
        the batch's mask keeps to the window."""
        kept = make_prompt_cache(self.model) if kept is None else widened(self.model, kept)
        if self._layer_rows:
            kept = [joining_rows(c) for c in kept]
        joining = [_joining(c, window) for c, window in zip(kept, self._windows)]
        return [c for c, _ in joining], [forgotten for _, forgotten in joining]

    def _prefill_alone(self, body: list[int], start: Start) -> tuple[list, object]:
        """A row continuing a kept quantized cache (kv_bits) prefills the rest of its prompt by
        itself, into copies of those caches, as a lone sequence continues one: its new
        positions attend to quantized keys and are quantized as written (a batch's joining
        rows prefill at full precision). Returns its caches as the batch holds them and its
        features (held, then new; None without capture layers)."""
        caches = [copy_cache(c) for c in start.caches]
        features = [start.features] if self.capture_layers and start.length else []
        for i in range(0, len(body), self._joining.step_size):
            chunk = mx.array(body[i : i + self._joining.step_size], dtype=mx.int32)[None]
            with capture_layer_outputs(self.model, self.capture_layers) as hidden:
                self.model(chunk, cache=caches)
            if hidden:
                features.append(concat_features(hidden)[0])
            mx.eval([c.state for c in caches] + features[-1:])
        rows = [_batch_row(c) for c in caches]
        if not self.capture_layers:
            return rows, None
        return rows, (mx.concatenate(features, axis=0) if features
                      else mx.zeros((0, 0)))

    @property
    def joining(self) -> int:
        """Rows added and not yet ready."""
        return len(self._joining)

    def fill(self, budget: int | None = None) -> list[tuple[int, object]]:
        """Prefill joining rows by about `budget` tokens in all (None: to their ends), in
        chunks between which no pass runs; the rows now ready join the batch at its end, in
        the order they were added. Returns (ticket, its captured features (n_i, H*layers) or
        None) per ready row, in that order."""
        tickets, cache, features = self._joining.step(budget)
        if tickets:
            cache = [self._running(c, window) for c, window in zip(cache, self._windows)]
        for ticket, rows, row_features in self._prefilled:  # ready since they were added
            if not tickets:
                tickets, cache, features = [], rows, [] if self.capture_layers else None
            else:
                for joined, row in zip(cache, rows):
                    joined.extend(row)
            tickets.append(ticket)
            if features is not None:
                features.append(row_features)
        self._prefilled = []
        if not tickets:
            return []
        self._prompt_states += self._states_at_prompt_end(cache, tickets)
        self._keeping.difference_update(tickets)
        if self.cache is None:
            self.cache = cache
        else:
            for running, new in zip(self.cache, cache):
                running.extend(new)
        mx.eval([c.state for c in self.cache])
        self._rows += len(tickets)
        self._layout += 1
        self._last = None
        return list(zip(tickets, features or [None] * len(tickets)))

    def _running(self, cache, window, member: bool = False):
        """A prefilled layer's cache as the running batch holds it: an attention cache as a
        RaggedKVCache (`window`: its sliding window), quantized with kv_bits as one sequence's
        is (a full-attention layer's, not a sliding window's nor a CacheList member's); a
        CacheList's members each so (`window`: theirs); a recurrent state as it is."""
        if isinstance(cache, CacheList):
            return CacheList(*(self._running(c, w, True) for c, w in zip(cache.caches, window)))
        if not isinstance(cache, BatchKVCache):
            return cache
        if isinstance(window, Chunks):
            return ChunkedRows.from_batch(cache, int(window))
        if self.kv_quantization is None or window is not None or member:
            return RaggedKVCache.from_batch(cache, window)
        group_size, bits = self.kv_quantization
        return RaggedQuantizedKVCache.from_batch(cache, group_size, bits)

    def _states_at_prompt_end(self, cache: list, tickets: list[int]) -> list:
        if not (self.capture_layers and (self._has_recurrent or self._contexts_held)):
            return [None] * len(tickets)
        states = [[list(c.extract(i).cache) for c in recurrent_layers(cache)]
                  if ticket in self._keeping else None for i, ticket in enumerate(tickets)]
        mx.eval(states)
        return states

    def drop(self, ticket: int) -> None:
        """A joining row leaves before it is ready."""
        self._joining.drop(ticket)
        self._keeping.discard(ticket)

    def row_cache(self, row: int) -> tuple[list, int | None, list | None]:
        """Row `row`'s caches, copied out of the batch as one sequence's (a prompt cache to
        keep), the positions they hold (None: no layer counts them), and its recurrent layers'
        states at the end of its prompt where it was added as kept and captured features
        (else None)."""
        caches = [c.extract(row) for c in self.cache]
        mx.eval([c.state for c in caches])  # else they would hold on to the batch's arrays
        return caches, cache_offset(caches), self._prompt_states[row]

    def remove(self, rows: list[int]) -> None:
        """These rows leave; the others keep their order, renumbered from 0."""
        gone = set(rows)
        if any(not 0 <= r < self._rows for r in gone):
            raise IndexError(f"rows {sorted(gone)} not all in a batch of {self._rows}")
        keep = [i for i in range(self._rows) if i not in gone]
        if not gone:
            return
        self.cache = keep_rows(self.cache, keep)
        self._prompt_states = [self._prompt_states[i] for i in keep]
        self._rows = len(keep)
        self._layout += 1
        self._last = None

    # -- passes ---------------------------------------------------------------------------------

    def launch(self, pending: "list[int] | BatchPass", drafts: list[Draft],
               samplings: list[SamplingConfig], logprobs: list[int | None] | None = None
               ) -> BatchPass:
        """Queue one pass over every row's [pending, drafts] with each row's acceptance under
        its own sampling settings; nothing is read back until `BatchPass.verdicts()`."""
        rows = self._rows
        if not rows:
            raise ValueError("no rows to verify")
        if len(drafts) != rows or len(samplings) != rows:
            raise ValueError(f"{rows} rows need {rows} drafts and samplings")
        logprobs = logprobs if logprobs is not None else [None] * rows
        if any(d.parents is not None for d in drafts):
            raise ValueError("a batched pass verifies chains only: send a tree's first_chain()")
        if any(d.early_exit is not None for d in drafts):
            raise ValueError("a batched pass runs every layer: no early-exit (LayerSkip) drafts")
        tokens = [d.tokens.astype(mx.int32) if isinstance(d.tokens, mx.array)
                  else mx.array(d.tokens, dtype=mx.int32) for d in drafts]
        ks = [int(t.shape[0]) for t in tokens]
        width = 1 + max(ks)
        if isinstance(pending, BatchPass):
            if pending.layout != self._layout or len(pending.num_drafts) != rows:
                raise ValueError("a queued pass's rows must be this batch's rows")
            if max(pending.num_drafts):
                raise ValueError("only a plain pass (no drafts) can feed the next one queued")
            heads = pending.next_tokens
        else:
            heads = mx.array(pending, dtype=mx.int32)
        inputs = mx.stack([mx.concatenate([heads[i : i + 1], t, mx.zeros((width - 1 - k,),
                                                                           dtype=mx.int32)])
                           for i, (t, k) in enumerate(zip(tokens, ks))])  # (rows, S)

        undoable = width > 1 and self._has_recurrent
        states = snapshot(self._recurrent()) if undoable else None
        contexts = [c[0] for c in self._contexts()] if width > 1 else []
        fields = [c.fields() for c in self.cache] if width > 1 and self._layer_rows else None
        with (record_inputs(self._mixers if undoable else []) as calls,
              state_tape(self._taped if undoable else []) as tape,
              capture_layer_outputs(self.model, self.capture_layers) as hidden,
              rows_at_their_positions(self.model, self.cache) as cache):
            logits = self.model(inputs, cache=cache)  # (rows, S, V)
        features = concat_features(hidden) if hidden else None
        self._last = dict(width=width, written=[width] * rows, held=[k + 1 for k in ks],
                          layout=self._layout, states=states, calls=calls if undoable else [],
                          tape=tape, inputs=inputs, contexts=contexts, fields=fields)

        packed, scores, next_tokens, row_features, top_n = [], [], [], [], []
        for i, (t, k, d, s, n) in enumerate(zip(tokens, ks, drafts, samplings, logprobs)):
            row = logits[i, : k + 1]
            if d.masks is not None:
                row = allowed_logits(row, d.masks)
            accepted, nxt = accept_chain(row, t, d.probs, s)
            nxt = nxt.astype(mx.int32)
            top_ids = None
            if n is not None:
                top_ids, values, n = committed_scores(row, t, mx.arange(k), accepted, nxt, s, n)
                scores.append(values)
            top_n.append(-1 if n is None else n)
            packed += verdict_layout.int_parts(t, None, top_ids, accepted.astype(mx.int32)[None],
                                               nxt[None])
            next_tokens.append(nxt)
            if features is not None:
                row_features.append(features[i, : k + 1])
        packed = mx.concatenate(packed)
        scores = mx.concatenate(scores) if scores else None
        next_tokens = mx.stack(next_tokens)
        mx.async_eval(packed, next_tokens, *([scores] if scores is not None else []),
                      *row_features)
        return BatchPass(num_drafts=ks, next_tokens=next_tokens, logits=logits, packed=packed,
                         scores=scores, features=row_features if features is not None else None,
                         top_n=top_n, layout=self._layout)

    def settle(self, verdicts: list[Verdict]) -> None:
        """Keep what each row committed of the last pass: 1 + its accepted drafts."""
        if not any(v.draft_tokens for v in verdicts):
            return  # a plain pass holds its one committed position per row, and no pads
        self._roll_back([1 + v.accepted for v in verdicts], len(verdicts))

    def trim(self, counts: list[int]) -> None:
        """Drop the last counts[i] positions row i holds of the last pass (a queued pass's
        drafts, when the loop stops early); its pads go too."""
        if not any(counts) and (self._last is None or self._last["width"] == 1):
            return
        if self._last is None:
            raise ValueError("no pass to trim")
        self._roll_back([h - c for h, c in zip(self._last["held"], counts)], len(counts))

    def _roll_back(self, keeps: list[int], n: int) -> None:
        """Leave row i holding keeps[i] of the last pass's positions."""
        last = self._last
        if last is None or last["layout"] != self._layout or n != self._rows:
            raise ValueError("rolling back needs the last pass over this batch's rows")
        if any(not 1 <= k <= h for k, h in zip(keeps, last["held"])):
            raise ValueError(f"each row keeps 1..{last['held']} positions, got {keeps}")
        drop = [w - k for w, k in zip(last["written"], keeps)]
        if not any(drop):
            return
        for c in self.cache:
            _drop(c, drop)
        self._roll_back_states(keeps)
        last["written"], last["held"] = list(keeps), list(keeps)

    def _roll_back_states(self, keeps: list[int]) -> None:
        """Each recurrent layer's state after row i's keeps[i]-th position of the last pass."""
        last = self._last
        if last["fields"] is not None:  # LayerRows: back to before the pass, which runs again
            self._rerun_rows(last["fields"], last["inputs"], keeps)
            return
        roll_back_contexts(self._contexts(), last["contexts"], last["inputs"], keeps)
        if last["states"] is None:  # no recurrent layer, or a pass without drafts
            return
        replays = matched_replays(last["calls"], self._recurrent(), self._last_position)
        if replays is None:  # calls that cannot be replayed one by one: the pass runs again
            restore(self._recurrent(), last["states"])
            for c, context in zip(self._contexts(), last["contexts"]):
                c[0] = context
            rerun_kept(self.model, self.cache, last["inputs"], keeps, self._mixers, _drop)
            return
        roll_back_states(self._recurrent(), last["states"], replays, last["tape"], keeps,
                         self._last_position)

    def _rerun_rows(self, fields: list, inputs: mx.array, keeps: list[int]) -> None:
        """Every layer's rows put back to `fields` (before the pass `inputs`), and the pass run
        again over row i's first keeps[i] positions. Lazy: computed with the next pass."""
        for c, saved in zip(self.cache, fields):
            c.restore(saved)
            c.prepare(lengths=keeps)
        with rows_at_their_positions(self.model, self.cache) as view:
            self.model(inputs, cache=view)
        for c in self.cache:
            c.finalize()

    def _recurrent(self) -> list:
        """The recurrent states the batch holds, a CacheList's members too; not an n-gram
        context."""
        return recurrent_layers(self.cache[self._contexts_held :])

    def _contexts(self) -> list:
        """The n-gram contexts the batch holds (ngram_rows)."""
        return context_caches(self.model, self.cache)

    def holds_trees(self) -> bool:
        return False

    def rollback_room(self) -> int | None:
        """Every cache held rolls back whatever the last pass wrote (sliding windows keep what
        that needs: RaggedKVCache's window)."""
        return None


# Cache kinds a batch cannot hold, and what rules each out.
_UNBATCHABLE = {
    "ChunkedKVCache": "mlxspec masks each row to its own chunk only in mlx-lm's llama4, whose "
                      "chunked layers batch_adapters fits to per-row positions",
}
# Cache kinds a batch holds only for the mlx-lm model whose code batch_adapters fits to its rows
# (llama4's chunks: ChunkedRows; deepseek_v41's LayerCache: one per row, layer_rows).
_ADAPTED = {"ChunkedKVCache": "mlx_lm.models.llama4", "LayerCache": "mlx_lm.models.deepseek_v41"}
# Attention modules that read a batch's cache slots as positions, by the flag marking them.
_SLOT_POSITIONS = {
    "is_sparse_attn": "mlx-lm's minimax_m3_vl sparse attention picks key blocks by cache slot "
                      "(its queries at slots S - L .. S - 1), and a row of a batch does not sit "
                      "at the slots of its positions",
}


def batch_refusal(model, cache: list) -> str | None:
    """Why `model`'s rows cannot share a batch (None: as far as its caches say, they can): a
    cache kind the batch cannot hold per row (a CacheList's members are held as the same
    kinds at top level are), or model code reading one position for every row."""
    kinds = sorted({type(c).__name__ for layer in cache for c in leaves(layer)
                    if type(c) not in (KVCache, WindowKVCache) and not isinstance(c, ArraysCache)
                    and _ADAPTED.get(type(c).__name__) != type(model).__module__})
    for kind in kinds:
        if kind in _UNBATCHABLE:
            return f"rows cannot share a batch of this model ({kind}): {_UNBATCHABLE[kind]}"
    if kinds:
        return (f"batched verification rolls back KV caches, sliding windows and recurrent "
                f"states (in CacheLists too); this model uses {', '.join(kinds)}, which mlxspec "
                f"cannot yet cut back per row exactly")
    for flag, reason in _SLOT_POSITIONS.items():
        if any(getattr(m, flag, False) is True for _, m in model.named_modules()):
            return f"rows cannot share a batch of this model: {reason}"
    return None


class Chunks(int):
    """A chunked-attention layer's chunk size, where `_windows` gives a sliding window's: its
    rows prefill as a window's do, then run as ChunkedRows."""


def _windows(cache):
    """A layer's sliding window (None: none; Chunks: a chunked layer's), a CacheList's members'
    as a tuple."""
    if isinstance(cache, CacheList):
        return tuple(_windows(c) for c in cache.caches)
    if isinstance(cache, ChunkedKVCache):
        return Chunks(cache.chunk_size)
    return cache.window if isinstance(cache, WindowKVCache) else None


def _joining(cache, window) -> tuple:
    """A joining row's cache of one layer as its prefill merges it, and the positions forgotten
    before it (a tuple of its members' for a CacheList): a sliding window's or chunked layer
    prefills in a plain KVCache of the positions it holds, which the batch's mask keeps to the
    window or the chunk."""
    if isinstance(cache, CacheList):
        parts = [_joining(c, w) for c, w in zip(cache.caches, window)]
        return CacheList(*(c for c, _ in parts)), tuple(f for _, f in parts)
    if window is None:
        return cache, 0
    plain, start, held = KVCache(), 0, 0
    if isinstance(cache, WindowKVCache):
        start, held = cache.start, cache.held
    elif isinstance(cache, ChunkedKVCache):
        start, held = cache.start_position, cache.offset - cache.start_position
    if held and cache.keys is not None:
        plain.keys, plain.values = (a[..., :held, :] for a in (cache.keys, cache.values))
        plain.offset = held
    return plain, start


def _batch_row(cache):
    """One sequence's cache of one layer as a running batch of that one row holds it."""
    if isinstance(cache, CacheList):
        return CacheList(*(_batch_row(c) for c in cache.caches))
    if isinstance(cache, QuantizedKVCache):
        return RaggedQuantizedKVCache.from_single(cache)
    if isinstance(cache, WindowKVCache):
        return RaggedKVCache.from_window(cache)
    if isinstance(cache, ChunkedKVCache):
        return ChunkedRows.from_chunked(cache)
    merged = type(cache).merge([cache])
    return RaggedKVCache.from_batch(merged) if isinstance(merged, BatchKVCache) else merged


def _drop(cache, counts: list[int]) -> None:
    """Row i of a layer's cache forgets its last counts[i] positions: an attention cache's (a
    CacheList's members' too); a recurrent state is put back by other means."""
    if isinstance(cache, CacheList):
        for c in cache.caches:
            _drop(c, counts)
    elif not isinstance(cache, ArraysCache):
        cache.drop(counts)



def copy_cache(cache):
    """A single sequence's cache whose later writes leave `cache` as it is (a kept prompt
    cache lends its prefix): a quantized one's held parts copied out, others deep-copied."""
    if not isinstance(cache, QuantizedKVCache):
        return copy.deepcopy(cache)
    twin = QuantizedKVCache(cache.group_size, cache.bits)
    if cache.keys is not None:
        twin.keys, twin.values = (tuple(mx.array(a[..., : cache.offset, :]) for a in part)
                                  for part in (cache.keys, cache.values))
        twin.offset = cache.offset
    return twin
