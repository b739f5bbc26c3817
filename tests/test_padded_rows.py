"""Batches of models whose mlx-lm code folds a padded row's pads into its recurrent state
(recurrent_gemma, rwkv7, bailing_moe_linear, olmo_hybrid's convolutions): their mixers run row by
row to each row's length in a padded pass (mlxspec.backends.mlx.padded_rows), recurrent_gemma's
rows that start from no state start so in a batch too, and each row comes out as it does alone.
longcat_flash_ngram's n-gram context (its last n - 1 token ids, kept beside its layers) is each
row's own after a padded chunk and a rollback (mlxspec.backends.mlx.ngram_rows).
"""

import mlx.core as mx
import pytest
from architectures import CONFIGS, window
from architectures import build as build_tiny
from test_api_hardening import tiny_tokenizer
from test_architectures import MAX_TOKENS, assert_same, mlx_lm_tokens, repeat

import mlxspec
from mlxspec.backends.mlx.batch_target import MLXBatchTarget
from mlxspec.backends.mlx.ngram_rows import context_after, held_context, widened
from mlxspec.backends.mlx.padding_probe import _alone, _relative, padding_refusal
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.engine import Draft
from mlxspec.sampling import SamplingConfig

MODELS = ["recurrent_gemma", "olmo_hybrid", "bailing_moe_linear", "rwkv7", "longcat_flash_ngram"]
GREEDY = SamplingConfig()
NGRAM = 4  # longcat_flash_ngram's n here: a context of 3 ids (its tiny config keeps 1)


def build(name):
    """The tiny model `name`; longcat_flash_ngram with an n-gram context of NGRAM - 1 ids."""
    if name != "longcat_flash_ngram":
        return build_tiny(name)
    saved = CONFIGS[name]
    CONFIGS[name] = dict(saved, emb_neighbor_num=NGRAM)
    try:
        return build_tiny(name)
    finally:
        CONFIGS[name] = saved


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer(65)


@pytest.mark.parametrize("name", MODELS)
def test_the_probe_accepts_the_model(name):
    assert padding_refusal(build(name), MLXBatchTarget) is None


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("drafter", ["lookup", None])
def test_each_row_of_a_batch_is_the_prompt_alone(name, drafter, tokenizer):
    model = build(name)
    prompts = [[1, 2, 3, 4, 5], repeat([5, 6, 7, 8, 9, 10, 11, 12], 19),
               repeat([21, 4, 33, 17, 40, 2], 3 * (window(model) or 8) + 5), [7]]
    batch = mlxspec.batch_generate(model, tokenizer, prompts, MAX_TOKENS, drafter=drafter)
    for i, (prompt, row) in enumerate(zip(prompts, batch.token_ids)):
        assert_same(model, prompt, list(row), mlx_lm_tokens(model, prompt), f"row {i}")
    if drafter:
        assert sum(s.drafted for s in batch.stats) > 0


def _joined_apart(model, prompts):
    """A batch whose rows join apart (one after another row's first chunk ran), one with
    nothing to prefill; returns it and its rows' prompts in its row order."""
    batch = MLXBatchTarget(model)
    tickets = batch.add(prompts[:2])
    order = [t for t, _ in batch.fill(4)]
    tickets += batch.add(prompts[2:])
    while batch.joining:
        order += [t for t, _ in batch.fill(4)]
    return batch, [prompts[tickets.index(t)] for t in order]


@pytest.mark.parametrize("name", MODELS)
def test_uneven_rows_have_the_logits_of_rows_alone(name):
    """Logits, not tokens: a state slightly off (recurrent_gemma's zeros for no state) may
    still pick the same tokens in a tiny model."""
    model = build(name)
    batch, prompts = _joined_apart(model, [[3, 14, 15, 9, 26, 53, 58, 9], [7],
                                           [5, 6, 7, 8, 9, 10]])
    alone = [MLXTarget(model, speculative=True) for _ in prompts]
    for target, prompt in zip(alone, prompts):
        target.prefill(prompt)
    pending = [p[-1] for p in prompts]
    for drafts in ([[1, 2], [], [4, 5, 6]], [[], [9], []], [[], [], []]):
        passes = batch.launch(pending, [Draft(tokens=d) for d in drafts], [GREEDY] * 3)
        verdicts = passes.verdicts()
        for i, (target, d) in enumerate(zip(alone, drafts)):
            logits, own = _alone(target, pending[i], d)
            assert _relative(logits, passes.logits[i, : len(d) + 1]) < 1e-4, f"row {i}"
            assert own.accepted == verdicts[i].accepted
            target.settle(own)
        batch.settle(verdicts)
        pending = [v.committed[-1] for v in verdicts]


def test_an_ngram_context_is_a_rows_last_ids_after_its_own_length():
    before = held_context(mx.array([[7], [8]]), 2, 3)  # a lone run's short context, widened
    assert before.tolist() == [[0, 0, 7], [0, 0, 8]]
    inputs = mx.array([[1, 2, 3, 4], [5, 0, 0, 0]])  # row 1 right-padded
    assert context_after(before, inputs, mx.array([4, 1])).tolist() == [[2, 3, 4], [0, 8, 5]]
    assert context_after(before, inputs, mx.array([0, 0])).tolist() == before.tolist()


def test_a_kept_caches_short_ngram_context_joins_a_batch_widened():
    model = build("longcat_flash_ngram")
    lone = MLXTarget(model)
    lone.prefill([9, 5])  # holds 1 position: a context of 1 id
    assert lone.cache[0][0].shape == (1, 1)
    caches = widened(model, lone.cache)
    assert caches[0][0].tolist() == [[0, 0, 9]] and caches[1:] == lone.cache[1:]
    assert lone.cache[0][0].shape == (1, 1)  # the kept cache itself left as it was


def test_each_rows_ngram_context_after_uneven_rollbacks_is_its_own():
    """Rows joined apart (padded chunks), then passes whose rows keep different numbers of
    drafts: each row's context is the last NGRAM - 1 ids it holds."""
    model = build("longcat_flash_ngram")
    batch, prompts = _joined_apart(model, [[3, 14, 15, 9, 26, 53, 58, 9], [7], [5, 6, 7, 8]])
    held = [list(p[:-1]) for p in prompts]
    pending = [p[-1] for p in prompts]
    for drafts in ([[1, 2], [], [4, 5, 6]], [[], [9], []], [[3, 3, 3], [1], [2, 2]]):
        verdicts = batch.launch(pending, [Draft(tokens=d) for d in drafts], [GREEDY] * 3)
        verdicts = verdicts.verdicts()
        batch.settle(verdicts)
        for i, v in enumerate(verdicts):
            held[i] += [pending[i]] + list(v.committed[:-1])
        pending = [v.committed[-1] for v in verdicts]
        want = [([0] * NGRAM + h)[-(NGRAM - 1):] for h in held]
        assert batch.cache[0][0].tolist() == want


def test_a_lone_sequences_ngram_context_rolls_back_from_the_pass_inputs(tokenizer,
                                                                      monkeypatch):
    """Alone, a rollback sets the context from the pass's inputs (nothing runs again): it is the
    last NGRAM - 1 ids the sequence holds, and speculation stays mlx-lm's greedy decode."""
    model = build("longcat_flash_ngram")
    target = MLXTarget(model, speculative=True)
    prompt = [3, 14, 15, 9, 26, 53, 58, 9]
    target.prefill(prompt)
    held, pending = prompt[:-1], prompt[-1]
    monkeypatch.setattr(target.forward, "rerun", None)  # a rerun would fail
    for drafts in ([1, 2, 3], [4], [5, 6]):
        verdict = target.launch(pending, Draft(tokens=drafts), GREEDY).verdict()
        target.settle(verdict)
        held += [pending] + verdict.committed[:-1]
        pending = verdict.committed[-1]
        assert target.cache[0][0].tolist() == [held[-(NGRAM - 1):]]
    prompt = repeat([5, 6, 7, 8, 9, 10, 11, 12], 19)
    out = list(mlxspec.stream_generate(model, tokenizer, prompt, MAX_TOKENS, drafter="lookup"))
    assert out[-1].drafted > 0
    assert_same(model, prompt, [r.token for r in out], mlx_lm_tokens(model, prompt), "alone")


def test_rows_joining_from_kept_caches_keep_their_own_ngram_context():
    """Kept prompt caches holding 1 and 2 positions (a lone run's context shorter than
    NGRAM - 1) and a fresh row join one batch: each row's verify logits are its lone run's."""
    model = build("longcat_flash_ngram")
    prompts = [[3, 14, 15, 9, 26, 53], [7, 8, 9], [5, 6, 7, 8, 9, 10, 11]]
    starts = []
    for prompt, held in zip(prompts, (1, 2, 0)):
        single = MLXTarget(model)
        single.prefill(prompt[: held + 1])  # holds all but the last: `held` positions
        starts.append((single.cache, held) if held else None)
    batch = MLXBatchTarget(model)
    tickets = batch.add(prompts, starts)
    order = []
    while batch.joining:
        order += [t for t, _ in batch.fill(4)]
    rows = [prompts[tickets.index(t)] for t in order]
    drafts = [[1, 2], [3], []]
    passes = batch.launch([r[-1] for r in rows], [Draft(tokens=d) for d in drafts], [GREEDY] * 3)
    for i, (prompt, d) in enumerate(zip(rows, drafts)):
        alone = MLXTarget(model, speculative=True)
        alone.prefill(prompt)
        logits, _ = _alone(alone, prompt[-1], d)
        assert _relative(logits, passes.logits[i, : len(d) + 1]) < 1e-4, f"row {i}"
