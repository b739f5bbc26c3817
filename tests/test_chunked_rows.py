"""llama4's chunked attention and NoPE temperature in a batch, and nemotron-nas's unwritten caches.

Each row of a batch must decode as that prompt does alone in mlx-lm, with rows at different
positions crossing chunk boundaries (the tiny llama4's chunks are 8 positions), and each row's
caches, after rollbacks by different amounts, must hold what a fresh prefill of its tokens does.
"""

import copy

import mlx.core as mx
import pytest
from architectures import CONFIGS, build
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ChunkedKVCache, make_prompt_cache
from test_api_hardening import tiny_tokenizer
from test_architectures import assert_same, repeat

import mlxspec
from mlxspec.backends.mlx.batch_target import MLXBatchTarget
from mlxspec.backends.mlx.padding_probe import padding_refusal
from mlxspec.engine import Draft, Start
from mlxspec.sampling import SamplingConfig

TOKENS = 24
CHUNK = CONFIGS["llama4"]["text_config"]["attention_chunk_size"]
# Rows at different positions, past two or more chunks.
PROMPTS = [[1, 2, 3, 4, 5], repeat([5, 6, 7, 8, 9, 10, 11, 12], 19),
           repeat([21, 4, 33, 17, 40, 2], 29), repeat([3, 9, 27, 17], 37)]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer(65)


def tempered_llama4():
    """The tiny llama4 with a NoPE attention temperature that changes every 4 positions (the
    default, every 8192, never changes in a short prompt)."""
    config = copy.deepcopy(CONFIGS["llama4"])
    config["text_config"].update(floor_scale=4, attn_scale=0.5)
    CONFIGS["llama4_tempered"] = config
    try:
        return build("llama4_tempered")
    finally:
        del CONFIGS["llama4_tempered"]


MODELS = {"llama4": lambda: build("llama4"), "llama4_tempered": tempered_llama4,
          "nemotron-nas": lambda: build("nemotron-nas")}


def alone(model, prompt, n=TOKENS):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("drafter", ["lookup", None])
def test_each_row_decodes_as_its_prompt_alone(name, drafter, tokenizer):
    model = MODELS[name]()
    assert padding_refusal(model, MLXBatchTarget) is None
    batch = mlxspec.batch_generate(model, tokenizer, PROMPTS, TOKENS, drafter=drafter)
    if drafter:
        assert sum(s.drafted for s in batch.stats) > 0
    for i, (prompt, row) in enumerate(zip(PROMPTS, batch.token_ids)):
        assert_same(model, prompt, list(row), alone(model, prompt), f"{name} row {i}")


def test_a_row_continues_its_kept_chunked_cache(tokenizer):
    """A reply's kept caches (each chunked layer's copied out as a ChunkedKVCache) start the
    next turn's rows, which then decode as the whole conversation does alone."""
    model = tempered_llama4()
    caches = [mlxspec.PromptCache() for _ in PROMPTS]
    first = mlxspec.batch_generate(model, tokenizer, PROMPTS, 12, drafter="lookup",
                                   prompt_caches=caches)
    turns = [p + list(r) + [7, 8, 9] for p, r in zip(PROMPTS, first.token_ids)]
    second = mlxspec.batch_generate(model, tokenizer, turns, 12, drafter="lookup",
                                    prompt_caches=caches)
    assert min(second.cached_tokens) > 0
    for i, (prompt, row) in enumerate(zip(turns, second.token_ids)):
        assert_same(model, prompt, list(row), alone(model, prompt, 12), f"turn 2 row {i}")


def visible(cache, n: int) -> tuple:
    """What the next query of a sequence holding n positions sees of one layer's cache: its
    chunk's positions (a chunked layer), else all; as (keys, values)."""
    assert cache.offset == n
    first = 0
    if isinstance(cache, ChunkedKVCache):
        first = n // cache.chunk_size * cache.chunk_size - cache.start_position
        n -= cache.start_position
    return tuple(a[..., first:n, :] for a in (cache.keys, cache.values))


def assert_rows_hold(model, target, sequences):
    """Each row's caches hold what a fresh prefill of its tokens (all but the pending) does."""
    for i, tokens in enumerate(sequences):
        fresh = make_prompt_cache(model)
        model(mx.array([tokens[:-1]]), cache=fresh)
        ours, _, _ = target.row_cache(i)
        assert [type(c) for c in ours] == [type(c) for c in fresh]
        for layer, (a, b) in enumerate(zip(ours, fresh)):
            for x, y in zip(visible(a, len(tokens) - 1), visible(b, len(tokens) - 1)):
                assert x.shape == y.shape and mx.allclose(x, y, atol=1e-4).item(), (i, layer)


def test_rows_rolled_back_apart_hold_what_a_fresh_prefill_does():
    """Rows at different positions (one from a kept cache whose chunked layers forgot their
    front, as mlx-lm leaves them) verify drafts, each accepting its own number, pass after pass
    across chunk boundaries and past the positions the batch forgets."""
    model = tempered_llama4()
    kept_prompt = repeat([11, 22, 33, 44, 55], 30)
    kept = make_prompt_cache(model)
    for start in range(0, 21, 7):  # three calls: mlx-lm trims the chunked caches' front
        model(mx.array([kept_prompt[start : start + 7]]), cache=kept)
    assert kept[0].start_position > 0
    target = MLXBatchTarget(model)
    target.add(PROMPTS[1:] + [kept_prompt], starts=[None] * 3 + [Start(kept, 21)])
    target.fill()
    sequences = [list(p) for p in PROMPTS[1:] + [kept_prompt]]
    assert_rows_hold(model, target, sequences)
    plans = [(2, 0, 3, 1), (0, 3, 1, 2), (3, 1, 0, 0), (1, 2, 2, 3), (0, 0, 3, 1)]
    uneven = 0
    for plan in plans:
        drafts = []
        for tokens, right in zip(sequences, plan):
            follow = alone(model, tokens, 4)
            drafts.append(follow[:right] + ([(follow[right] + 1) % 64] if right < 3 else []))
        pending = [tokens[-1] for tokens in sequences]
        verdicts = target.launch(pending, [Draft(tokens=d) for d in drafts],
                                 [SamplingConfig()] * len(drafts)).verdicts()
        target.settle(verdicts)
        uneven += len({v.accepted for v in verdicts}) > 1
        for tokens, v in zip(sequences, verdicts):
            tokens += v.committed
        assert_rows_hold(model, target, sequences)
    assert uneven and min(len(t) for t in sequences) > 3 * CHUNK
    chunked = target.cache[0]  # its columns no row's chunk reaches were forgotten
    assert max(chunked.ends) < max(chunked.offset.tolist())
