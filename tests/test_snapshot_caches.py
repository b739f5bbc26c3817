"""Speculation on a model whose cache forgets as it writes but only rebinds its attributes
(mlxspec.rollback.SNAPSHOT_CACHES): mlx-lm's deepseek_v41, whose LayerCache keeps a sliding
window, closed compressed groups with their index keys, and the open group's pending rows.

A rollback puts the attributes back as they were before the pass and runs the kept positions
again, which is exact only because the model's output does not depend on how its input is split
into passes (checked first). Two tiny models: the architecture matrix's (window only) and one
that compresses groups of 4 positions, with an indexer and a candidate mask.

A batch holds one LayerCache per row and runs each layer's attention row by row
(mlxspec.backends.mlx.layer_rows); its rows roll back as a lone sequence does.
"""

import copy

import mlx.core as mx
import pytest
from architectures import CONFIGS, build, window
from mlx_lm.generate import generate_step
from test_api_hardening import tiny_tokenizer
from test_architectures import MAX_TOKENS, assert_same, mlx_lm_tokens, ours, repeat
from test_padded_rows import _joined_apart as joined_apart
from tiny_models import tiny_llama

import mlxspec
from mlxspec.backends.mlx.batch_target import MLXBatchTarget
from mlxspec.backends.mlx.target import MLXTarget, PromptCache
from mlxspec.drafters import DraftModelDrafter
from mlxspec.engine import Draft, Drafter, SpecStats, speculative_tokens
from mlxspec.rollback import SNAPSHOT_CACHES, snapshot_fields
from mlxspec.sampling import SamplingConfig

N = 14
FIELDS = SNAPSHOT_CACHES["mlx_lm.models.deepseek_v41.LayerCache"]


def compressing_model():
    """deepseek_v41 with compressed layers: layer 0 pools groups of 4 positions and indexes them
    (choosing candidate blocks), layer 1 reads them through its own indexer, layer 2 has only
    the window."""
    config = copy.deepcopy(CONFIGS["deepseek_v41"])
    config.update(num_hidden_layers=3, compress_ratios=[4, 4, 0], kv_source_layer_ids=[0],
                  index_source_layer_ids=[0, 1], candidate_source_layer_id=0,
                  candidate_topk_blocks=1, candidate_block_size=2, index_topk=2)
    CONFIGS["deepseek_v41_compressing"] = config
    try:
        return build("deepseek_v41_compressing")
    finally:
        del CONFIGS["deepseek_v41_compressing"]


@pytest.fixture(scope="module", params=["window", "compressing"])
def model(request):
    return build("deepseek_v41") if request.param == "window" else compressing_model()


@pytest.fixture(scope="module")
def compressing():
    return compressing_model()


def past_prompt(model):
    """A prompt 3 windows long (and past several compressed groups)."""
    return repeat([21, 4, 33, 17, 40, 2], 3 * window(model) + 5)


class PlantedDrafter(Drafter):
    """Proposes `full`'s continuation of the committed tokens with draft position j made wrong;
    with `tree`, as a tree whose first chain is that draft (a sibling beside its first node)."""

    name = "planted"

    def __init__(self, full: list[int], j: int, tree: bool = False):
        self.full, self.j, self.tree = full, j, tree

    def propose(self, tokens, k, sampling):
        drafts = list(self.full[len(tokens) : len(tokens) + k])
        if self.j < len(drafts):
            drafts[self.j] = (drafts[self.j] + 1) % 64
        if not self.tree or not drafts:
            return Draft(tokens=drafts)
        parents = tuple(range(len(drafts))) + (0,)  # the chain, then a sibling of its first
        return Draft(tokens=drafts + [(drafts[0] + 2) % 64], parents=parents)


def assert_caches_match(got: list, want: list) -> None:
    """Every LayerCache attribute: the same ints, the same arrays (None where none)."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert set(vars(g)) == set(vars(w)) and set(FIELDS) <= set(vars(g)), i
        for name in vars(g):
            a, b = getattr(g, name), getattr(w, name)
            if not isinstance(a, mx.array):
                assert a == b, (i, name)
                continue
            assert b is not None and a.shape == b.shape, (i, name)
            assert mx.allclose(a, b, atol=1e-5).item(), (i, name)


def test_output_does_not_depend_on_how_the_input_is_split(compressing):
    """The premise of an exact verifier: mlx-lm's own greedy decode is the same prefilled 1, 3
    or all positions at a time, and a pass over many positions gives the logits of one position
    at a time (to summation order)."""
    prompt = [(7 * i + 3) % 64 for i in range(29)]
    outs = [[int(t) for t, _ in generate_step(mx.array(prompt), compressing, max_tokens=N,
                                              prefill_step_size=step)] for step in (1, 3, 2048)]
    assert outs[0] == outs[1] == outs[2]
    tokens = mx.array([prompt + outs[0]])
    whole = compressing(tokens, cache=compressing.make_cache())[0]
    cache = compressing.make_cache()
    single = mx.concatenate([compressing(tokens[:, i : i + 1], cache=cache)[0]
                             for i in range(tokens.shape[1])])
    assert mx.allclose(whole, single, atol=1e-4).item()


@pytest.mark.parametrize("drafter", ["lookup", "draft model", "past the window"])
def test_speculation_equals_mlx_lm_greedy(model, drafter):
    """As tests/test_architectures.py checks every architecture: prompt lookup, a random draft
    model (mostly rejected drafts) and a prompt 3 windows long all draft, and the output is
    mlx-lm's greedy decode."""
    prompt = {"lookup": repeat([5, 6, 7, 8, 9, 10, 11, 12], 19),
              "draft model": [3, 14, 15, 9, 26, 53, 58, 9, 7, 9],
              "past the window": past_prompt(model)}[drafter]
    chosen = DraftModelDrafter(tiny_llama(vocab=64, seed=9, sharpness=2.0)) \
        if drafter == "draft model" else "lookup"
    tokens, last = ours(model, tiny_tokenizer(65), prompt, chosen)
    assert last.drafted > 0
    assert_same(model, prompt, tokens, mlx_lm_tokens(model, prompt), drafter)


@pytest.mark.parametrize("tree", [False, True])
def test_drafts_wrong_at_every_position(compressing, tree):
    """Each step keeps exactly the drafts before the planted wrong one (every position, and none
    wrong), so the output is greedy decoding and the counts are the planting's. Trees cannot be
    held (holds_trees): each is verified as its first chain."""
    prompt = past_prompt(compressing)
    reference = [int(t) for t, _ in generate_step(mx.array(prompt), compressing, max_tokens=N)]
    k = 3
    for j in range(k + 1):
        stats, target = SpecStats(), MLXTarget(compressing, speculative=True)
        assert not target.holds_trees() and target.rollback_room() is None
        out = [t for t, _ in speculative_tokens(
            target, PlantedDrafter(prompt + reference, j, tree), prompt,
            sampling=SamplingConfig(), max_tokens=N, num_draft=k, stats=stats)]
        assert out == reference, j
        assert stats.drafted > 0, j
        drafted, accepted = stats.drafted_per_position, stats.accepted_per_position
        assert accepted == [n if i < j else 0 for i, n in enumerate(drafted)][:len(accepted)]
        assert (stats.chain_fallback_steps > 0) == tree


def test_rolled_back_cache_equals_a_fresh_prefill_of_the_kept_tokens(compressing):
    """After every pass, its rejected drafts rolled back, each LayerCache holds what a fresh
    cache fed the kept tokens in one pass holds: window rows, closed groups and their index
    keys, pending rows and offset, across window evictions and group closings."""
    prompt = past_prompt(compressing)
    reference = [int(t) for t, _ in generate_step(mx.array(prompt), compressing, max_tokens=40)]
    full, k = prompt + reference, 3
    target = MLXTarget(compressing, speculative=True)
    target.prefill(prompt)
    pending, length = prompt[-1], len(prompt)
    for step in range(10):
        j = step % (k + 1)
        drafts = list(full[length : length + k])
        if j < k:
            drafts[j] = (drafts[j] + 1) % 64
        verdict = target.launch(pending, Draft(tokens=drafts), SamplingConfig()).verdict()
        target.settle(verdict)
        assert verdict.accepted == min(j, k)
        length += verdict.accepted + 1
        pending = verdict.next_token
        assert pending == full[length - 1]
        fresh = compressing.make_cache()
        mx.eval(compressing(mx.array([full[: length - 1]]), cache=fresh))
        assert_caches_match(target.cache, fresh)


def test_prompt_cache_keeps_it_uncut(compressing):
    """A prompt cache never cuts a LayerCache back (it is not trimmable): a prompt extending all
    it holds continues it, any other starts afresh, and both equal mlx-lm."""
    tokenizer, kept = tiny_tokenizer(65), PromptCache()
    first = past_prompt(compressing)

    def run(prompt):
        out = list(mlxspec.stream_generate(compressing, tokenizer, prompt, MAX_TOKENS,
                                           drafter="lookup", num_draft=3, adaptive=False,
                                           prompt_cache=kept))
        tokens = [r.token for r in out]
        assert_same(compressing, prompt, tokens, mlx_lm_tokens(compressing, prompt), "turn")
        return tokens

    reply = run(first)
    held = kept.cache
    assert all(snapshot_fields(c) for c in held) and held[0].offset == len(first + reply) - 1
    run(first + reply + [5, 6])  # extends all it holds: continued
    assert kept.cache is held and held[0].offset == len(first + reply) + 2 + MAX_TOKENS - 1
    run(first[:-3] + [9, 9, 9])  # shares a prefix only: rebuilt, not cut
    assert kept.cache is not held and held[0].offset == len(first + reply) + 2 + MAX_TOKENS - 1


def test_layerskip_is_refused_in_one_line(model):
    """LayerSkip drafts in the target's own cache and cuts its early layers back, which a
    LayerCache cannot be: refused by name before any compute."""
    from mlxspec.drafters.layerskip import LayerSkipDrafter

    with pytest.raises(ValueError, match="keeps LayerCache, which forgets as it writes") as err:
        ours(model, tiny_tokenizer(65), [1, 2, 3, 4, 5, 1, 2, 3], LayerSkipDrafter(model, 1))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("drafter", ["lookup", None])
def test_a_batchs_rows_each_equal_their_prompt_alone(model, drafter):
    """Rows of different lengths (one with nothing to prefill, one past the window) join in
    padded chunks and roll back by their own amounts: each gives mlx-lm's greedy decode."""
    prompts = [[1, 2, 3, 4, 5], repeat([5, 6, 7, 8, 9, 10, 11, 12], 19), past_prompt(model), [7]]
    batch = mlxspec.batch_generate(model, tiny_tokenizer(65), prompts, MAX_TOKENS,
                                   drafter=drafter)
    for i, (prompt, row) in enumerate(zip(prompts, batch.token_ids)):
        assert_same(model, prompt, list(row), mlx_lm_tokens(model, prompt), f"row {i}")
    if drafter:
        assert sum(s.drafted for s in batch.stats) > 0


def test_a_batchs_rolled_back_rows_each_hold_their_own_layer_caches(compressing):
    """Passes whose rows draft different numbers of tokens, wrong at different positions: after
    each, every row's LayerCaches hold what a fresh prefill of the row's kept tokens holds."""
    prompts = [past_prompt(compressing), [7, 8], [(5 * i + 1) % 64 for i in range(11)]]
    batch, ordered = joined_apart(compressing, prompts)
    rows = [p + [int(t) for t, _ in generate_step(mx.array(p), compressing, max_tokens=24)]
            for p in ordered]
    lengths = [len(p) for p in ordered]
    pending = [row[n - 1] for row, n in zip(rows, lengths)]
    for step in range(6):
        drafts = []
        for i, (row, n) in enumerate(zip(rows, lengths)):
            draft = list(row[n : n + 3 - (step + i) % 3])
            j = (step + 2 * i) % 4
            if j < len(draft):
                draft[j] = (draft[j] + 1) % 64
            drafts.append(Draft(tokens=draft))
        verdicts = batch.launch(pending, drafts, [SamplingConfig()] * 3).verdicts()
        batch.settle(verdicts)
        for i, verdict in enumerate(verdicts):
            lengths[i] += verdict.accepted + 1
            pending[i] = verdict.next_token
            assert pending[i] == rows[i][lengths[i] - 1], (step, i)
            fresh = compressing.make_cache()
            mx.eval(compressing(mx.array([rows[i][: lengths[i] - 1]]), cache=fresh))
            assert_caches_match(batch.row_cache(i)[0], fresh)


def test_rows_joining_from_kept_caches_leave_them_as_they_were(compressing):
    """Rows join a batch from kept prompt caches (a prefix of their prompt): each row's verify
    logits are its lone run's, and the kept LayerCaches are not written."""
    from mlxspec.backends.mlx.padding_probe import _alone, _relative

    prompts = [past_prompt(compressing), [(5 * i + 1) % 64 for i in range(11)], [7, 8]]
    starts = []
    for prompt, held in zip(prompts, (9, 6, 0)):
        single = MLXTarget(compressing)
        single.prefill(prompt[: held + 1])  # holds all but the last: `held` positions
        starts.append((single.cache, held) if held else None)
    before = [None if s is None else [dict(vars(c)) for c in s[0]] for s in starts]
    batch = MLXBatchTarget(compressing)
    tickets = batch.add(prompts, starts)
    order = []
    while batch.joining:
        order += [t for t, _ in batch.fill(4)]
    drafts = [[1, 2], [3], []]
    passes = batch.launch([prompts[tickets.index(t)][-1] for t in order],
                          [Draft(tokens=d) for d in drafts], [SamplingConfig()] * 3)
    for i, (t, d) in enumerate(zip(order, drafts)):
        prompt = prompts[tickets.index(t)]
        alone = MLXTarget(compressing, speculative=True)
        alone.prefill(prompt)
        logits, _ = _alone(alone, prompt[-1], d)
        assert _relative(logits, passes.logits[i, : len(d) + 1]) < 1e-4, f"row {i}"
    for start, fields in zip(starts, before):
        if start is not None:
            assert all(getattr(c, k) is v for c, f in zip(start[0], fields) for k, v in f.items())
