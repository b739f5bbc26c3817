"""Batches of models whose mlx-lm code folds a padded row's pads into its recurrent state
(recurrent_gemma, rwkv7, bailing_moe_linear, olmo_hybrid's convolutions): their mixers run row by
row to each row's length in a padded pass (mlxspec.backends.mlx.padded_rows), recurrent_gemma's
rows that start from no state start so in a batch too, and each row comes out as it does alone.
"""

import pytest
from architectures import build, window
from test_api_hardening import tiny_tokenizer
from test_architectures import MAX_TOKENS, assert_same, mlx_lm_tokens, repeat

import mlxspec
from mlxspec.backends.mlx.batch_target import MLXBatchTarget
from mlxspec.backends.mlx.padding_probe import _alone, _relative, padding_refusal
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.engine import Draft
from mlxspec.sampling import SamplingConfig

MODELS = ["recurrent_gemma", "olmo_hybrid", "bailing_moe_linear", "rwkv7"]
GREEDY = SamplingConfig()


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
