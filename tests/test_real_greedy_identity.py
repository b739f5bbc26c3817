"""On the real SmolLM2 target: every drafter's greedy output equals plain decoding, token for token,
on real HumanEval and MT-Bench prompts (HumanEval stubs make lookup find long copies)."""

import pytest
from conftest import chat_prompt

import mlxspec
from mlxspec.prompts import humaneval_prompts, mtbench_prompts

pytestmark = pytest.mark.slow
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def real_prompts(smollm):
    _, tokenizer = smollm
    texts = humaneval_prompts(limit=10) + mtbench_prompts(limit=10)
    return [chat_prompt(tokenizer, t) for t in texts]


@pytest.fixture(scope="module")
def plain_outputs(smollm, real_prompts):
    model, tokenizer = smollm
    return [run(model, tokenizer, p, None)[0] for p in real_prompts]


def run(model, tokenizer, prompt, drafter):
    responses = list(mlxspec.stream_generate(model, tokenizer, prompt, MAX_TOKENS, drafter=drafter))
    return [r.token for r in responses], responses[-1]


@pytest.mark.parametrize("kind", ["lookup", "draft"])
def test_spec_equals_plain_on_real_prompts(smollm, smollm_first_layers, real_prompts,
                                           plain_outputs, kind):
    model, tokenizer = smollm
    drafter = mlxspec.load_drafter(
        kind, smollm_first_layers if kind == "draft" else None, model=model, tokenizer=tokenizer
    )
    total_accepted = 0
    for prompt, plain in zip(real_prompts, plain_outputs):
        tokens, last = run(model, tokenizer, prompt, drafter)
        assert tokens == plain
        # Exact accounting: every pass commits its accepted drafts plus one target token.
        assert round(last.tau * last.target_passes) == last.accepted + last.target_passes
        total_accepted += last.accepted
    assert total_accepted > 0, f"{kind} never got a draft accepted: the test would prove nothing"
