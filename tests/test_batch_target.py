"""MLXBatchTarget against the single-sequence MLXTarget, row by row (issue #39).

Every row of a batch must see exactly what an MLXTarget fed that row alone sees: the same verify
logits (bit for bit with the reference BLAS, within 1e-5 with OpenBLAS, whose matmul blocking
depends on the batch size), the same greedy verdicts, and after each per-row rollback the same
caches as a fresh prefill of the kept tokens. Rows join and leave mid-way, drafts are ragged
(K = 0 included), some all wrong, some right up to a point.
"""

import random
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, BatchKVCache, ChunkedKVCache
from scipy import stats as scipy_stats
from tiny_models import tiny_llama, tiny_qwen3_5, tiny_qwen3_next

import mlxspec.backends.mlx.batch_target as batch_module
from mlxspec import blas_in_use
from mlxspec.backends.mlx.batch_target import MLXBatchTarget
from mlxspec.backends.mlx.sampling import processed_logprobs
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.engine import Draft
from mlxspec.sampling import SamplingConfig

VOCAB = 64
GREEDY = SamplingConfig()
# Relative to the logits' scale: OpenBLAS sums a matmul in an order that depends on the batch
# size; with the reference BLAS (MLXSPEC_BLAS=reference) the batch is bit-identical (0.0).
EXACT = blas_in_use().startswith("bundled reference BLAS")
TOLERANCE = 0.0 if EXACT else 2e-5  # measured up to 8.3e-6 (qwen3_next)
MODELS = {
    "llama": lambda: tiny_llama(vocab=VOCAB, sharpness=4.0),
    "qwen3_next": lambda: tiny_qwen3_next(vocab=VOCAB),
    "qwen3_5": lambda: tiny_qwen3_5(vocab=VOCAB),
}
DIFFS = {}  # largest |batch - single| logits per case, printed with -s for the report


class Single(MLXTarget):
    """The reference: an MLXTarget fed one row alone, keeping its last verify logits."""

    def _chain_forward(self, inputs, num_drafts, early_exit=None):
        self.logits, features = super()._chain_forward(inputs, num_drafts, early_exit)
        return self.logits, features


def join_rows(batch, prompts, starts=None, budget=None) -> list:
    """Rows join the batch: added, then prefilled until every one is ready (in `budget`-token
    steps); their features, in the order given."""
    tickets = batch.add(prompts, starts)
    features = {}
    while batch.joining:
        features.update(batch.fill(budget))
    return [features[t] for t in tickets]


def relative_diff(want, got) -> float:
    """max |got - want| over the scale of `want` (at least 1)."""
    return mx.abs(got - want).max().item() / max(1.0, mx.abs(want).max().item())


def greedy_continuation(model, tokens, n):
    """The target's own next n greedy tokens after `tokens`, by full forward passes."""
    out = list(tokens)
    for _ in range(n):
        out.append(int(model(mx.array([out]))[0, -1].argmax().item()))
    return out[len(tokens):]


def drafts_for(model, tokens, k, rnd):
    """K drafts: the target's greedy continuation spoiled at a random place (or not at all),
    so acceptance lands anywhere from none to all."""
    drafts = greedy_continuation(model, tokens, k) if rnd.random() < 0.6 else \
        [rnd.randrange(VOCAB) for _ in range(k)]
    if k and rnd.random() < 0.5:
        at = rnd.randrange(k)
        drafts[at] = (drafts[at] + 1) % VOCAB
    return drafts


def model_and_path(case, monkeypatch):
    """The tiny model of a case; "-rerun" forces the recurrent rollback of the fused-kernel
    path (restore and re-run with per-row lengths) instead of the state tape."""
    name, _, path = case.partition("-")
    if path == "rerun":
        monkeypatch.setattr(batch_module, "fused_kernel_would_run", lambda: True)
    return MODELS[name]()


def assert_caches_match_fresh(model, batch, row, tokens):
    """Row `row`'s caches equal a fresh prefill of everything it committed but the pending
    token (its KV entries and recurrent states, copied out as a prompt cache to keep)."""
    fresh = MLXTarget(model)
    fresh.prefill(tokens)
    caches, held, _ = batch.row_cache(row)
    assert held == len(tokens) - 1
    for b, got, f in zip(batch.cache, caches, fresh.cache):
        if isinstance(b, BatchKVCache):
            assert got.offset == f.offset == len(tokens) - 1
            for g, w in ((got.keys, f.keys[..., : f.offset, :]),
                         (got.values, f.values[..., : f.offset, :])):
                assert relative_diff(w, g) <= TOLERANCE
        else:
            assert isinstance(b, ArraysCache)
            for g, w in zip(got.cache, f.cache):
                assert relative_diff(w, g) <= TOLERANCE


@pytest.mark.parametrize("case", ["llama", "qwen3_next", "qwen3_next-rerun", "qwen3_5",
                                  "qwen3_5-rerun"])
def test_rows_verify_and_roll_back_as_the_single_path(case, monkeypatch):
    model = model_and_path(case, monkeypatch)
    rnd = random.Random(0)
    prompts = {u: [rnd.randrange(VOCAB) for _ in range(n)]
               for u, n in enumerate([5, 11, 1, 3, 8])}
    batch = MLXBatchTarget(model)
    singles, tokens, ids = {}, {}, []

    def join(uids):
        join_rows(batch, [prompts[u] for u in uids])
        for u in uids:
            singles[u] = Single(model, speculative=True)
            singles[u].prefill(prompts[u])
            tokens[u] = list(prompts[u])
            ids.append(u)

    def leave(uid):
        batch.remove([ids.index(uid)])
        ids.remove(uid)

    worst = 0.0
    join([0, 1])
    for step in range(12):
        if step == 3:
            join([2, 3])  # a one-token prompt among them
        if step == 7:
            leave(1)
        if step == 9:
            join([4])
        ks = [rnd.choice([0, 1, 2, 3, 5]) for _ in ids]
        drafts = [Draft(tokens=drafts_for(model, tokens[u], k, rnd)) for u, k in zip(ids, ks)]
        if step % 2:  # drafts as device arrays too
            drafts = [Draft(tokens=mx.array(d.tokens, dtype=mx.int32)) for d in drafts]
        bp = batch.launch([tokens[u][-1] for u in ids], drafts, [GREEDY] * len(ids))
        verdicts = bp.verdicts()
        for r, (u, d, v) in enumerate(zip(ids, drafts, verdicts)):
            ref = singles[u].launch(tokens[u][-1], d, GREEDY).verdict()
            diff = relative_diff(singles[u].logits, bp.logits[r, : len(d) + 1])
            worst = max(worst, diff)
            assert diff <= TOLERANCE, (step, u)
            assert (v.draft_tokens, v.accepted, v.next_token) == \
                (ref.draft_tokens, ref.accepted, ref.next_token), (step, u)
            singles[u].settle(ref)
            tokens[u] += v.committed
        batch.settle(verdicts)

    # A plain step (K = 0 everywhere), then a plain pass queued on it before it is read.
    first = batch.launch([tokens[u][-1] for u in ids], [Draft(tokens=[])] * len(ids),
                         [GREEDY] * len(ids))
    second = batch.launch(first, [Draft(tokens=[])] * len(ids), [GREEDY] * len(ids))
    for bp in (first, second):
        verdicts = bp.verdicts()
        for r, (u, v) in enumerate(zip(ids, verdicts)):
            ref = singles[u].launch(tokens[u][-1], Draft(tokens=[]), GREEDY).verdict()
            worst = max(worst, relative_diff(singles[u].logits, bp.logits[r, :1]))
            assert (v.accepted, v.next_token) == (0, ref.next_token)
            tokens[u] += v.committed
        batch.settle(verdicts)
    assert worst <= TOLERANCE
    DIFFS[case] = worst
    print(f"\n{case}: max |batch - single| / max(1, |logits|) = {worst:.3e}")
    for r, u in enumerate(ids):
        assert_caches_match_fresh(model, batch, r, tokens[u])


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_rows_join_from_kept_caches_in_chunks_as_a_fresh_prefill(name):
    """Rows joining with a kept prompt cache (holding a prefix of their prompt, as a chat's
    next turn) prefill only the rest, a few tokens per step with a pass over the running rows
    between the chunks; each row's verify logits then equal the single path's, and its caches
    (in the batch, and copied out by row_cache to be kept) equal a fresh prefill."""
    model = MODELS[name]()
    rnd = random.Random(1)
    prompts = [[rnd.randrange(VOCAB) for _ in range(n)] for n in (9, 14, 6, 1, 5)]
    kept = {0: 5, 1: 13, 2: 0, 4: 4}  # tokens a kept cache holds: a prefix, all but the last

    def start(r):
        if r not in kept:
            return None
        single = MLXTarget(model)
        single.prefill(prompts[r][: kept[r] + 1])  # holds all but the last: kept[r] tokens
        return single.cache, kept[r]

    batch = MLXBatchTarget(model)
    join_rows(batch, [prompts[3]])  # a running row, stepping between the others' chunks
    tokens = {3: list(prompts[3])}
    order = [3]
    tickets = dict(zip(batch.add(prompts[:3] + prompts[4:], [start(r) for r in (0, 1, 2, 4)]),
                       (0, 1, 2, 4)))
    steps = 0
    while batch.joining:
        ready = batch.fill(budget=4)
        assert sum(1 for t in tickets if t in dict(ready)) == len(ready)
        for ticket, _ in ready:
            r = tickets[ticket]
            order.append(r)
            tokens[r] = list(prompts[r])
        bp = batch.launch([tokens[r][-1] for r in order], [Draft(tokens=[])] * len(order),
                          [GREEDY] * len(order))
        for r, v in zip(order, bp.verdicts()):
            tokens[r] += v.committed
        batch.settle(bp.verdicts())
        steps += 1
    assert steps >= 3  # 4 tokens a step: the 13 prompt tokens not kept take several
    drafts = [Draft(tokens=[rnd.randrange(VOCAB) for _ in range(2)]) for _ in order]
    bp = batch.launch([tokens[r][-1] for r in order], drafts, [GREEDY] * len(order))
    for i, (r, d, v) in enumerate(zip(order, drafts, bp.verdicts())):
        single = Single(model, speculative=True)
        single.prefill(tokens[r])
        ref = single.launch(tokens[r][-1], d, GREEDY).verdict()
        assert relative_diff(single.logits, bp.logits[i, :3]) <= TOLERANCE, r
        assert (v.accepted, v.next_token) == (ref.accepted, ref.next_token)
        tokens[r] += v.committed
    batch.settle(bp.verdicts())
    for i, r in enumerate(order):
        assert_caches_match_fresh(model, batch, i, tokens[r])


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_a_row_starts_from_a_kept_cache_with_its_features(name):
    """A target capturing features (for DFlash, EAGLE-3) takes a kept cache with the features
    of what it holds: the row's features are those of a fresh prefill of its whole prompt,
    and its verify pass is the single path's."""
    model = MODELS[name]()
    layers = (0, 1) if name == "llama" else (1, 3)
    prompt = [5, 3, 9, 1, 7, 2, 8, 4, 6]
    single = Single(model, capture_layers=layers, speculative=True)
    want = single.prefill(prompt)
    kept = MLXTarget(model, capture_layers=layers)
    held = kept.prefill(prompt[:5])  # 4 tokens and their features
    batch = MLXBatchTarget(model, capture_layers=layers)
    got, = join_rows(batch, [prompt], [(kept.cache, 4, held)], budget=2)
    assert got.shape == want.shape and relative_diff(want, got) <= TOLERANCE
    bp = batch.launch([prompt[-1]], [Draft(tokens=[1, 2])], [GREEDY])
    ref = single.launch(prompt[-1], Draft(tokens=[1, 2]), GREEDY).verdict()
    assert relative_diff(single.logits, bp.logits[0, :3]) <= TOLERANCE
    v, = bp.verdicts()
    assert (v.accepted, v.next_token) == (ref.accepted, ref.next_token)
    assert relative_diff(ref.features, v.features) <= TOLERANCE


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_only_a_kept_row_records_its_prompt_s_recurrent_states(name):
    """A hybrid capturing features: a row added as kept (its caches copied out when it leaves)
    records its recurrent states at the end of its prompt, those a lone prefill leaves; a row
    not kept records nothing (a big hybrid's states are not held for every row in vain)."""
    model = MODELS[name]()
    prompts = [[5, 3, 9, 1, 7, 2], [8, 4, 6, 2, 1]]
    batch = MLXBatchTarget(model, capture_layers=(1, 3))
    tickets = batch.add(prompts, kept=[False, True])
    order = []  # rows join as they are ready
    while batch.joining:
        order += [ticket for ticket, _ in batch.fill(budget=3)]
    not_kept, kept = order.index(tickets[0]), order.index(tickets[1])
    assert batch.row_cache(not_kept)[2] is None
    lone = MLXTarget(model, capture_layers=(1, 3))
    lone.prefill(prompts[1])
    got = batch.row_cache(kept)[2]
    assert len(got) == len(lone.prompt_state) > 0
    for row_states, lone_states in zip(got, lone.prompt_state):
        for g, w in zip(row_states, lone_states):
            assert relative_diff(w, g) <= TOLERANCE
    batch.remove([not_kept])
    assert batch.row_cache(0)[2] is got


def test_a_kept_cache_must_leave_the_last_prompt_token():
    model = MODELS["llama"]()
    single = MLXTarget(model)
    single.prefill([1, 2, 3, 4])
    batch = MLXBatchTarget(model)
    with pytest.raises(ValueError, match="never all of it"):
        batch.add([[1, 2, 3]], [(single.cache, 3)])
    with pytest.raises(ValueError, match="only with the features of what it holds"):
        MLXBatchTarget(model, capture_layers=(0,)).add([[1, 2, 3, 4, 5]], [(single.cache, 3)])


@pytest.mark.parametrize("case", ["llama", "qwen3_5", "qwen3_5-rerun"])
def test_trim_drops_a_queued_pass_per_row(case, monkeypatch):
    """The loop stopping early with a pass queued cuts each row's drafts (and pads) off."""
    model = model_and_path(case, monkeypatch)
    prompts = [[3, 1, 4, 1, 5], [9, 2], [6]]
    batch = MLXBatchTarget(model)
    join_rows(batch, prompts)
    batch.launch([p[-1] for p in prompts],
                 [Draft(tokens=[1, 2, 3]), Draft(tokens=[]), Draft(tokens=[7])], [GREEDY] * 3)
    batch.trim([3, 0, 1])  # the pass's pending tokens stay: they were committed
    for r, p in enumerate(prompts):
        assert_caches_match_fresh(model, batch, r, p + [0])
    batch.trim([0, 0, 0])


def test_remove_all_rows_then_add():
    model = MODELS["llama"]()
    batch = MLXBatchTarget(model)
    join_rows(batch, [[1, 2, 3], [4]])
    batch.remove([1, 0])
    assert batch.rows == 0
    join_rows(batch, [[5, 6, 7, 8]])
    assert batch.rows == 1
    bp = batch.launch([8], [Draft(tokens=[1, 2])], [GREEDY])
    single = Single(model, speculative=True)
    single.prefill([5, 6, 7, 8])
    ref = single.launch(8, Draft(tokens=[1, 2]), GREEDY).verdict()
    assert relative_diff(single.logits, bp.logits[0]) <= TOLERANCE
    v, = bp.verdicts()
    assert (v.accepted, v.next_token) == (ref.accepted, ref.next_token)
    batch.remove([0])
    join_rows(batch, [[9], [3]])  # one-token prompts only: nothing to prefill
    bp = batch.launch([9, 3], [Draft(tokens=[])] * 2, [GREEDY] * 2)
    for r, token in enumerate([9, 3]):
        single = Single(model)
        single.prefill([token])
        ref = single.launch(token, Draft(tokens=[]), GREEDY).verdict()
        assert relative_diff(single.logits, bp.logits[r]) <= TOLERANCE
        assert bp.verdicts()[r].next_token == ref.next_token


def test_refusals():
    model = MODELS["llama"]()
    batch = MLXBatchTarget(model)
    join_rows(batch, [[1, 2]])
    assert not batch.holds_trees() and batch.rollback_room() is None
    with pytest.raises(ValueError, match="chains only"):
        batch.launch([2], [Draft(tokens=[1, 2], parents=(0, 1))], [GREEDY])
    bp = batch.launch([2], [Draft(tokens=[1])], [GREEDY])
    with pytest.raises(ValueError, match="plain pass"):
        batch.launch(bp, [Draft(tokens=[])], [GREEDY])
    chunked = MODELS["llama"]()  # a cache kind no row can be cut back in, named
    chunked.make_cache = lambda: [ChunkedKVCache(8) for _ in chunked.layers]
    with pytest.raises(ValueError, match="ChunkedKVCache"):
        MLXBatchTarget(chunked)


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_features_and_logprobs_per_row_match_the_single_path(name):
    model = MODELS[name]()
    layers = (0, 1) if name == "llama" else (1, 3)
    prompts = [[5, 3, 9, 1, 7, 2], [8], [4, 4, 6]]
    batch = MLXBatchTarget(model, capture_layers=layers, prefill_step_size=4)
    got = join_rows(batch, prompts)
    singles = []
    for p, features in zip(prompts, got):
        single = Single(model, capture_layers=layers, speculative=True, prefill_step_size=4)
        want = single.prefill(p)
        singles.append(single)
        assert features.shape == want.shape
        if want.size:
            assert relative_diff(want, features) <= TOLERANCE
    drafts = [Draft(tokens=[3, 3]), Draft(tokens=[]), Draft(tokens=[1, 2, 3, 4])]
    samplings = [GREEDY, SamplingConfig(temp=0.7, top_k=5), GREEDY]
    # the sampled row reads no randomness: K = 0 draws the next token, compared below in law
    bp = batch.launch([p[-1] for p in prompts], drafts, samplings, logprobs=[3, 2, None])
    for r, (single, p, d, s, n, v) in enumerate(zip(singles, prompts, drafts, samplings,
                                                    [3, 2, None], bp.verdicts())):
        ref = single.launch(p[-1], d, s, logprobs=n).verdict()
        if s.greedy:
            assert (v.accepted, v.next_token) == (ref.accepted, ref.next_token)
        else:
            v.next_token = ref.next_token  # sampled independently: only its scores compare
        assert v.features.shape == ref.features.shape
        assert relative_diff(ref.features, v.features) <= TOLERANCE
        if n is None:
            assert v.logprobs is None and v.top_logprobs is None
        else:
            assert len(v.logprobs) == len(ref.logprobs) == v.accepted + 1
            scored = len(v.logprobs) if s.greedy else v.accepted  # the sampled row's next differs
            assert np.allclose(v.logprobs[:scored], ref.logprobs[:scored], atol=1e-5)
            assert np.allclose([[x for _, x in row] for row in v.top_logprobs],
                               [[x for _, x in row] for row in ref.top_logprobs], atol=1e-5)
            assert [[t for t, _ in row] for row in v.top_logprobs] == \
                [[t for t, _ in row] for row in ref.top_logprobs]


def test_a_greedy_row_beside_a_sampled_row_keeps_its_tokens():
    model = MODELS["qwen3_5"]()
    prompt = [7, 3, 11, 2]
    batch = MLXBatchTarget(model)
    join_rows(batch, [prompt, [1, 9, 4]])
    rnd = random.Random(3)
    mx.random.seed(5)
    rows = [list(prompt), [1, 9, 4]]
    samplings = [GREEDY, SamplingConfig(temp=1.0)]
    for _ in range(8):
        drafts = [Draft(tokens=drafts_for(model, t, rnd.choice([1, 3]), rnd)) for t in rows]
        verdicts = batch.launch([t[-1] for t in rows], drafts, samplings).verdicts()
        batch.settle(verdicts)
        for t, v in zip(rows, verdicts):
            t += v.committed
    assert rows[0][len(prompt):] == greedy_continuation(model, prompt, len(rows[0]) - len(prompt))


@pytest.mark.slow
def test_sampled_rows_draw_from_the_target_distribution():
    """A greedy row and many sampled rows (temp 1) in one batch, deterministic drafts the
    target often rejects: each sampled row's first committed token follows target-only
    sampling's distribution (chi-squared over 2000 draws)."""
    model = tiny_llama(vocab=8, seed=11, sharpness=2.5)
    prompt, sampled, passes = [0, 1, 2], 200, 10
    sampling = SamplingConfig(temp=1.0)
    probs = np.exp(np.array(processed_logprobs(model(mx.array([prompt]))[0, -1], sampling),
                            dtype=np.float64))
    batch = MLXBatchTarget(model)
    mx.random.seed(1234)
    counts = Counter()
    greedy_token = greedy_continuation(model, prompt, 1)[0]
    for _ in range(passes):
        join_rows(batch, [prompt] * (1 + sampled))
        drafts = [Draft(tokens=[3, 5])] + [Draft(tokens=[3, 5][: 1 + r % 2])
                                           for r in range(sampled)]
        verdicts = batch.launch([prompt[-1]] * (1 + sampled), drafts,
                                [GREEDY] + [sampling] * sampled).verdicts()
        assert verdicts[0].committed[0] == greedy_token
        counts.update(v.committed[0] for v in verdicts[1:])
        batch.remove(list(range(batch.rows)))
    observed = [counts.get(t, 0) for t in range(8)]
    pvalue = scipy_stats.chisquare(observed, probs / probs.sum() * sum(observed)).pvalue
    assert max(probs) < 0.6 and min(probs) * sum(observed) >= 5  # a real test of the law
    assert pvalue > 1e-3, (observed, probs)


def test_both_row_holders_implement_the_declared_rows_protocol():
    """engine.Rows is what the loop drives: MLXBatchTarget and OneRow define all of it."""
    from mlxspec.engine import OneRow, Rows

    methods = {name for name, value in vars(Rows).items()
               if callable(value) and not name.startswith("_")}
    assert {"bind", "add", "fill", "drop", "remove", "row_cache", "launch", "settle", "trim",
            "holds_trees", "rollback_room"} <= methods
    for holder in (MLXBatchTarget, OneRow):
        assert all(callable(getattr(holder, name, None)) for name in methods), holder
