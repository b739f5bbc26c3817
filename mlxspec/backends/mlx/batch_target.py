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
with `ArraysCache.prepare(lengths=keep)`, which stops each row's state at its own length.

Rows sample from the global MLX random stream, in row order: there are no per-row seeds.
"""

import copy
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    KVCache,
    QuantizedKVCache,
    make_prompt_cache,
)

from ...engine import Draft, Pass, Start, Verdict
from ...rollback import is_recurrent, restore, snapshot
from ...sampling import SamplingConfig
from .acceptance import accept_greedy, accept_sampled
from .batch_prefill import JoiningRows, keep_rows
from .hidden_states import (capture_layer_outputs, concat_features, record_inputs, replay,
                            run_rows, stops_rows)
from .padding_probe import padding_refusal
from .ragged_cache import RaggedKVCache, RaggedQuantizedKVCache
from .sampling import sample_token
from .state_tape import fused_kernel_would_run, state_tape, tape_modules
from .batch_adapters import rows_at_their_positions
from .window_cache import WindowKVCache, make_cache
from .target import (
    cache_offset,
    check_kv_group_size,
    committed_scores,
    context_length,
    state_mixers,
)


class _Host(list):
    """Host values already read, handed to engine.Pass.verdict in place of the device array it
    reads, so a row's verdict is decoded exactly as a single pass's is."""

    def tolist(self):
        return list(self)


@dataclass
class BatchPass:
    """One batched pass queued on the device and not yet read. `verdicts()` is its one wait."""

    num_drafts: list[int]
    next_tokens: mx.array  # (rows,) int32, device: the pending tokens of a plain pass after it
    logits: mx.array  # (rows, S, V): row i's verify logits are [i, : num_drafts[i] + 1]
    packed: mx.array  # per row: drafts, top ids (if scored), accepted count, next token
    scores: mx.array | None  # per row's scored floats, as Pass.scores, concatenated
    features: list | None  # per row (K_i + 1, H * layers), or None
    top_n: list[int]  # per row: how many top logprobs it scores; -1 where none were asked
    layout: int  # the batch's row layout it ran on (see MLXBatchTarget._layout)

    def verdicts(self) -> list[Verdict]:
        ints = self.packed.tolist()  # waits for the pass: its one host sync
        floats = self.scores.tolist() if self.scores is not None else None  # evaluated with it
        verdicts, at, fat = [], 0, 0
        for i, k in enumerate(self.num_drafts):
            n = self.top_n[i]
            width = k + max(n, 0) * (k + 1) + 2
            row_scores = None
            if floats is not None and n >= 0:
                row_scores = _Host(floats[fat : fat + k + 1 + n * (k + 1)])
                fat += len(row_scores)
            row = Pass(num_draft=k, packed=_Host(ints[at : at + width]), next_token=None,
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
        bad = sorted({type(c).__name__ for c in probe if type(c) not in (KVCache, WindowKVCache)
                      and not isinstance(c, ArraysCache)})
        if bad:
            raise ValueError(
                f"batched verification rolls back KV caches, sliding windows and recurrent "
                f"states only; this model uses {', '.join(bad)}, which mlxspec cannot yet cut "
                f"back per row exactly")
        # Per layer: its sliding window (None: full attention or a recurrent state). Joining
        # rows prefill such a layer in a plain batch cache, masked to the window; the running
        # batch holds it as a RaggedKVCache with that window.
        self._windows = [c.window if isinstance(c, WindowKVCache) else None for c in probe]
        if any(type(m).__name__ == "DynamicNTKScalingRoPE" for _, m in model.named_modules()):
            raise ValueError("dynamic NTK RoPE reads its position as one Python int, so rows "
                             "at different positions cannot share a pass")
        self._has_recurrent = any(is_recurrent(c) for c in probe)
        self._mixers = state_mixers(model) if self._has_recurrent else []
        self._taped = [] if fused_kernel_would_run() else tape_modules(
            [getattr(layer, name) for layer, name in self._mixers])
        self.cache = None  # mlx-lm batch caches, one per layer; None while no row is held
        self._joining = JoiningRows(model, self.capture_layers, prefill_step_size)
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
        with recurrent layers whose mixers mlxspec does not know cannot take one row's
        rejected drafts out of their states."""
        if drafter.max_draft and self._has_recurrent and not self._mixers:
            return (f"the {drafter.name} drafter cannot run in a batch on this model: mlxspec "
                    "knows none of its recurrent layers' mixers, so it cannot take a row's "
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
        if kept is None:
            kept = make_prompt_cache(self.model)
        caches, forgotten = [], []
        for c, window in zip(kept, self._windows):
            if window is None:
                caches.append(c)
                forgotten.append(0)
                continue
            plain = KVCache()
            if isinstance(c, WindowKVCache) and c.keys is not None and c.held:
                plain.keys, plain.values = (a[..., : c.held, :] for a in (c.keys, c.values))
                plain.offset = c.held
            caches.append(plain)
            forgotten.append(c.start if isinstance(c, WindowKVCache) else 0)
        return caches, forgotten

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
        rows = [RaggedQuantizedKVCache.from_single(c) if isinstance(c, QuantizedKVCache)
                else RaggedKVCache.from_window(c) if isinstance(c, WindowKVCache)
                else type(c).merge([c]) for c in caches]
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
            cache = [self._ragged(c, window) if isinstance(c, BatchKVCache) else c
                     for c, window in zip(cache, self._windows)]
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

    def _ragged(self, cache: BatchKVCache, window: int | None = None) -> RaggedKVCache:
        """A prefilled row's attention cache as the running batch holds it (a sliding window's
        unquantized, as one sequence's)."""
        if self.kv_quantization is None or window is not None:
            return RaggedKVCache.from_batch(cache, window)
        group_size, bits = self.kv_quantization
        return RaggedQuantizedKVCache.from_batch(cache, group_size, bits)

    def _states_at_prompt_end(self, cache: list, tickets: list[int]) -> list:
        if not (self.capture_layers and self._has_recurrent):
            return [None] * len(tickets)
        states = [[list(c.extract(i).cache) for c in cache if is_recurrent(c)]
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
        with (record_inputs(self._mixers if undoable else []) as calls,
              state_tape(self._taped if undoable else []) as tape,
              capture_layer_outputs(self.model, self.capture_layers) as hidden,
              rows_at_their_positions(self.model, self.cache) as cache):
            logits = self.model(inputs, cache=cache)  # (rows, S, V)
        features = concat_features(hidden) if hidden else None
        self._last = dict(width=width, written=[width] * rows, held=[k + 1 for k in ks],
                          layout=self._layout, states=states, calls=calls if undoable else [],
                          tape=tape)

        packed, scores, next_tokens, row_features, top_n = [], [], [], [], []
        for i, (t, k, d, s, n) in enumerate(zip(tokens, ks, drafts, samplings, logprobs)):
            row = logits[i, : k + 1]
            if k == 0:
                accepted, nxt = mx.array(0), sample_token(row[-1], s)
            elif s.greedy:
                accepted, nxt = accept_greedy(row, t)
            else:
                accepted, nxt = accept_sampled(row, t, d.probs, s)
            nxt = nxt.astype(mx.int32)
            ids = []
            if n is not None:
                top_ids, values, n = committed_scores(row, t, mx.arange(k), accepted, nxt, s, n)
                ids = [top_ids]
                scores.append(values)
            top_n.append(-1 if n is None else n)
            packed += [t] + ids + [accepted.astype(mx.int32)[None], nxt[None]]
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
            if not is_recurrent(c):
                c.drop(drop)
        self._roll_back_states(keeps)
        last["written"], last["held"] = list(keeps), list(keeps)

    def _roll_back_states(self, keeps: list[int]) -> None:
        """Each recurrent layer's state after row i's keeps[i]-th position of the last pass."""
        last = self._last
        if last["states"] is None:  # no recurrent layer, or a pass without drafts
            return
        recurrent = {id(c) for c in self._recurrent()}
        replays = [(m, x, c) for m, x, c in last["calls"] if id(c) in recurrent]
        if sorted(id(c) for _, _, c in replays) != sorted(recurrent):
            raise ValueError("a recurrent layer of an unknown kind: cannot roll back its state")
        keep = mx.array(keeps, dtype=mx.int32)
        restore(self._recurrent(), last["states"])
        for module, x, c in replays:
            if id(module) in last["tape"]:
                _select_rows(c, *last["tape"][id(module)], keep)
            elif stops_rows(module):  # re-run the layer from the state before the pass,
                c.prepare(lengths=keeps)  # each row stopped at its length by mask and lengths
                replay(module, x, c, c.make_mask(x.shape[1]))
                c.finalize()
            else:  # one that cannot stop rows (Jamba's, Mamba's, nemotron_h's) row by row
                run_rows(module, x, c, keeps)

    def _recurrent(self) -> list:
        return [c for c in self.cache if is_recurrent(c)]

    def holds_trees(self) -> bool:
        return False

    def rollback_room(self) -> int | None:
        """Every cache held rolls back whatever the last pass wrote (sliding windows keep what
        that needs: RaggedKVCache's window)."""
        return None


def _select_rows(cache, conv_input: mx.array, states: list, keep: mx.array) -> None:
    """state_tape.select per row: row i's recurrent state after keep[i] positions of the pass
    and its convolution window ending there."""
    width = conv_input.shape[1] - len(states)
    window = (keep[:, None] + mx.arange(width))[..., None]  # (rows, width, 1)
    conv = mx.take_along_axis(conv_input, window, axis=1)
    tape = mx.stack(states, axis=1)  # (rows, S, ...)
    at = (keep - 1).reshape((-1,) + (1,) * (tape.ndim - 1))
    cache.cache = [mx.contiguous(conv), mx.take_along_axis(tape, at, axis=1)[:, 0]]



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
