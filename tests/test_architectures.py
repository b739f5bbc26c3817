"""Every architecture mlx-lm has, as a tiny random model (tests/architectures.py), through mlxspec
(issue #64): plain decoding equals mlx-lm's greedy decoding; prompt lookup and a draft model are
lossless; a prompt past the model's sliding window still drafts and stays lossless; a batch of
three prompts gives each row what it gets alone, or the model's batches are refused in one line
for a reason listed here.

"Equal" is token for token, except that where two runs part, mlx-lm's own top-2 logit gap there
must be a near-tie (< 1e-4): summation order may then pick either. The whole matrix is slow (about
two minutes); a few architectures of each cache kind run in the fast tier.
"""

import mlx.core as mx
import pytest
from architectures import CONFIGS, SKIPPED, build, uncovered, window
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from test_api_hardening import tiny_tokenizer
from tiny_models import tiny_llama

import mlxspec
from mlxspec.drafters import DraftModelDrafter

MAX_TOKENS = 20
NEAR_TIE = 1e-4
# One of each kind: full attention, sliding windows (alternating, Gemma's pattern, gpt-oss's
# sinks), hybrids (Gated DeltaNet, Mamba-2, Mamba, a state beside keys), shared or reused keys,
# learned positions, an MoE.
FAST = ["llama", "gemma3_text", "gpt_oss", "qwen3_next", "nemotron_h", "jamba", "falcon_h1",
        "afm7", "gpt_bigcode", "gemma3n", "mixtral"]
# Batches refused in one line, and the words that say why.
BATCH_REFUSED = {
    # the model's own code depends on how its input is split into passes (SPLIT_DEPENDENT)
    "plamo3": "other logits",
}
# No speculation at all, and why.
SPEC_REFUSED: dict[str, str] = {}
# mlx-lm's own output depends on how its input is split into passes (plamo3's sliding mask is
# one position wider than its rotating cache), so no verifier of several tokens per pass can
# equal its token-by-token decode: only plain decoding is compared.
SPLIT_DEPENDENT = {"plamo3"}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer(65)  # its end-of-sequence token (t64) is one no model here produces


@pytest.fixture(scope="module")
def draft_model():
    return tiny_llama(vocab=64, seed=9, sharpness=2.0)  # random: mostly rejected drafts


def repeat(pattern, n):
    return [pattern[i % len(pattern)] for i in range(n)]


def mlx_lm_tokens(model, prompt):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS)]


def assert_same(model, prompt, got, want, what):
    """Token for token, or parted at a near-tie of mlx-lm's own logits."""
    if got == want:
        return
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    logits = model(mx.array([prompt + want[:at]]), cache=make_prompt_cache(model))[0, -1]
    top = mx.sort(logits.astype(mx.float32))
    gap = (top[-1] - top[-2]).item()
    assert gap < NEAR_TIE, f"{what}: parts from mlx-lm at token {at} (top-2 gap {gap:.2g})"


def ours(model, tokenizer, prompt, drafter=None):
    out = list(mlxspec.stream_generate(model, tokenizer, prompt, MAX_TOKENS, drafter=drafter,
                                       num_draft=3, adaptive=False))
    return [r.token for r in out], out[-1]


def check_architecture(name, tokenizer, draft_model):
    model = build(name)
    plain_prompt = [3, 14, 15, 9, 26, 53, 58, 9, 7, 9]
    assert_same(model, plain_prompt, ours(model, tokenizer, plain_prompt)[0],
                mlx_lm_tokens(model, plain_prompt), "plain")
    lookup_prompt = repeat([5, 6, 7, 8, 9, 10, 11, 12], 19)
    past_prompt = repeat([21, 4, 33, 17, 40, 2], 3 * (window(model) or 8) + 5)
    if name in SPEC_REFUSED:
        with pytest.raises(ValueError, match=SPEC_REFUSED[name]):
            ours(model, tokenizer, lookup_prompt, "lookup")
        return
    if name not in SPLIT_DEPENDENT:
        for prompt, drafter, what in ((lookup_prompt, "lookup", "lookup"),
                                      (plain_prompt, DraftModelDrafter(draft_model), "draft"),
                                      (past_prompt, "lookup", "past the window")):
            tokens, last = ours(model, tokenizer, prompt, drafter)
            assert last.drafted > 0, what
            assert_same(model, prompt, tokens, mlx_lm_tokens(model, prompt), what)
    prompts = [[1, 2, 3, 4, 5], lookup_prompt, past_prompt]
    if name in BATCH_REFUSED:
        with pytest.raises(ValueError, match=BATCH_REFUSED[name]) as err:
            mlxspec.batch_generate(model, tokenizer, prompts, MAX_TOKENS, drafter="lookup")
        assert "\n" not in str(err.value)
        return
    batch = mlxspec.batch_generate(model, tokenizer, prompts, MAX_TOKENS, drafter="lookup")
    for i, (prompt, row) in enumerate(zip(prompts, batch.token_ids)):
        assert_same(model, prompt, list(row), mlx_lm_tokens(model, prompt), f"batch row {i}")


def test_every_architecture_is_built_or_skipped_for_a_reason():
    assert not uncovered()
    assert set(FAST) <= set(CONFIGS) and not set(BATCH_REFUSED) - set(CONFIGS)
    assert all(SKIPPED.values())


@pytest.mark.parametrize("name", FAST)
def test_one_architecture_of_each_kind(name, tokenizer, draft_model):
    check_architecture(name, tokenizer, draft_model)


@pytest.mark.slow  # every architecture: about two minutes
@pytest.mark.parametrize("name", sorted(set(CONFIGS) - set(FAST)))
def test_every_architecture(name, tokenizer, draft_model):
    check_architecture(name, tokenizer, draft_model)
