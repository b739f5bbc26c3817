"""kv_bits: the target's keys and values quantized (mlx-lm's QuantizedKVCache) once the prompt is
prefilled. Speculation stays exact against that target: drafts right up to a planted wrong token
at every position give greedy decoding with the same quantized cache, chains and trees, and the
cache after the rollbacks holds what a fresh quantized prefill of the same tokens holds."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
from test_rollback_property import KS, N, PlantedDrafter
from tiny_models import tiny_llama, tiny_qwen3_next

import mlxspec
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.engine import SpecStats, speculative_tokens
from mlxspec.request import Request
from mlxspec.sampling import SamplingConfig

VOCAB = 40
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7, 7]]
BITS = dict(kv_bits=4, kv_group_size=32)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=VOCAB, hidden=128, seed=2, sharpness=8.0)  # head_dim 32


def quantized_reference(model, prompt: list[int]) -> tuple[list[int], list]:
    """Greedy one token per call with mlx-lm's own caches: the prompt but its last token
    prefilled in full precision, then quantized (as mlxspec's target does), then each token."""
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=cache)
    cache = [c.to_quantized(group_size=32, bits=4) if type(c) is KVCache else c for c in cache]
    out, token = [], prompt[-1]
    for _ in range(N):
        logits = model(mx.array([[token]]), cache=cache)
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
    return out, cache


@pytest.mark.parametrize("prompt", PROMPTS)
def test_planted_drafts_give_the_quantized_target_s_greedy_output(target, prompt):
    reference, _ = quantized_reference(target, prompt)
    assert reference != quantized_reference_full_precision(target, prompt)  # it is quantized
    full = prompt + reference
    for k in KS:
        for j in range(k + 1):
            made = MLXTarget(target, speculative=True, **BITS)
            out = [t for t, _ in speculative_tokens(
                made, PlantedDrafter(full, j), prompt, sampling=SamplingConfig(),
                max_tokens=N, num_draft=k, stats=SpecStats())]
            assert out == reference, (k, j)
            assert all(type(c) is QuantizedKVCache for c in made.cache)


def quantized_reference_full_precision(model, prompt):
    cache, out, token = make_prompt_cache(model), [], None
    logits = model(mx.array(prompt)[None], cache=cache)
    for _ in range(N):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)
    return out


def test_the_cache_after_rollbacks_is_a_fresh_quantized_one(target):
    prompt = PROMPTS[0]
    reference, fresh = quantized_reference(target, prompt)
    made = MLXTarget(target, speculative=True, **BITS)
    out = [t for t, _ in speculative_tokens(
        made, PlantedDrafter(prompt + reference, 2), prompt, sampling=SamplingConfig(),
        max_tokens=N, num_draft=5, stats=SpecStats())]
    assert out == reference
    for mine, theirs in zip(made.cache, fresh):
        n = mine.offset  # the prompt but its last token, and every token since but the last
        assert theirs.offset == n == len(prompt) - 1 + N
        for a, b in zip(mine.keys + mine.values, theirs.keys + theirs.values):
            a, b = a[..., :n, :], b[..., :n, :]
            if a.dtype == mx.uint32:  # packed: most groups identical, none far off
                assert (a == b).mean().item() > 0.99
            else:
                assert mx.allclose(a, b, atol=1e-4, rtol=1e-3)


def test_trees_and_a_hybrid_target_with_kv_bits():
    """A tree drafter verifies its trees in the quantized cache; Qwen3-Next's recurrent layers
    stay as they are, its attention layers quantized, and lookup stays exact."""
    from mlxspec.drafters import PromptLookupDrafter
    from test_api_hardening import tiny_tokenizer

    for model in (tiny_llama(vocab=VOCAB, hidden=128, seed=2, sharpness=8.0),
                  tiny_qwen3_next(vocab=VOCAB, seed=2, head_dim=32, num_attention_heads=2)):
        tokenizer = tiny_tokenizer(VOCAB)
        prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
        plain = [r.token for r in mlxspec.stream_generate(model, tokenizer, prompt, 16, **BITS)]
        for drafter in (PromptLookupDrafter(), PromptLookupDrafter(branches=3)):
            spec = [r.token for r in mlxspec.stream_generate(
                model, tokenizer, prompt, 16, drafter=drafter, num_draft=4, **BITS)]
            assert spec == plain


def test_bad_kv_settings_are_refused_before_any_work():
    with pytest.raises(ValueError, match="kv_bits must be one of 2, 3, 4, 5, 6, 8, got 7"):
        Request(kv_bits=7)
    with pytest.raises(ValueError, match="kv_group_size must be one of 32, 64, 128"):
        Request(kv_bits=4, kv_group_size=16)


def test_a_head_size_the_groups_do_not_divide_is_refused_before_any_work(target):
    with pytest.raises(ValueError, match="kv_group_size 64 does not divide the model's "
                                         "attention head size 32"):
        MLXTarget(target, speculative=True, kv_bits=4, kv_group_size=64)


@pytest.mark.slow  # the real model through the CLI
def test_cli_kv_bits_with_a_drafter_is_the_plain_text_with_kv_bits():
    from test_cli import QUESTION, N as TOKENS, assert_clean_error, invoke, ok

    args = ["generate", "--prompt", QUESTION, "--max-tokens", TOKENS, "--kv-bits", "4"]
    plain = ok(invoke(*args))
    for drafter in ("lookup", "suffix", "dflash"):
        assert ok(invoke(*args, "--drafter", drafter)).stdout == plain.stdout
    assert_clean_error(invoke(*args, "--kv-group-size", "128"), "does not divide")
    assert_clean_error(invoke("generate", "--prompt", "hi", "--kv-bits", "7"), "--kv-bits",
                       "must be one of")


def each_alone(model, tokenizer, prompts, n, drafter=None, **options):
    outputs = []
    for prompt in prompts:
        tokens = [r.token for r in mlxspec.stream_generate(model, tokenizer, prompt, n,
                                                           drafter=drafter, **options)]
        outputs.append(tokens[:-1] if tokens and tokens[-1] in tokenizer.eos_token_ids
                       else tokens)
    return outputs


BATCH_PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [5] * 11, [3], [9, 4, 9, 4, 9, 4, 2]]


@pytest.mark.parametrize("kind", ["llama", "qwen3_next"])
def test_a_batch_with_kv_bits_gives_each_prompt_its_quantized_output_alone(kind):
    """batch_generate(kv_bits=...): every row's attention cache quantized as a lone
    sequence's (its prompt prefilled at full precision, then each position quantized as it is
    written, rows rolled back by different amounts), so each row's greedy tokens are that
    prompt's alone with the same kv_bits: drafts planted wrong at changing positions, and
    lookup with its adaptive K; a hybrid target's recurrent layers as they are."""
    from test_api_hardening import tiny_tokenizer
    from test_batch import Planted

    from mlxspec.backends.mlx.ragged_cache import RaggedQuantizedKVCache

    model = (tiny_llama(vocab=VOCAB, hidden=128, seed=2, sharpness=8.0) if kind == "llama"
             else tiny_qwen3_next(vocab=VOCAB, seed=2, head_dim=32, num_attention_heads=2))
    tokenizer = tiny_tokenizer(VOCAB)
    quantized = each_alone(model, tokenizer, BATCH_PROMPTS, 24, **BITS)
    assert quantized != each_alone(model, tokenizer, BATCH_PROMPTS, 24)
    full = {tuple(p): p + out for p, out in zip(BATCH_PROMPTS, quantized)}
    out = mlxspec.batch_generate(model, tokenizer, BATCH_PROMPTS, 24, drafter=Planted(full),
                                 adaptive=False, **BITS)
    assert out.token_ids == quantized
    assert len({round(s.acceptance_rate, 3) for s in out.stats}) > 1  # ragged rollbacks
    lookup = each_alone(model, tokenizer, BATCH_PROMPTS, 24, "lookup", **BITS)
    assert mlxspec.batch_generate(model, tokenizer, BATCH_PROMPTS, 24, drafter="lookup",
                                  **BITS).token_ids == lookup == quantized
    seen = []
    original = RaggedQuantizedKVCache.update_and_fetch
    try:  # the batch's attention really runs on quantized rows
        RaggedQuantizedKVCache.update_and_fetch = lambda self, k, v: seen.append(1) or \
            original(self, k, v)
        mlxspec.batch_generate(model, tokenizer, BATCH_PROMPTS[:2], 4, **BITS)
    finally:
        RaggedQuantizedKVCache.update_and_fetch = original
    assert seen


def test_a_batch_row_continues_a_kept_quantized_prompt_cache():
    """A PromptCache filled with kv_bits (quantized) starts a batch row: the row joins at the
    values it holds and continues as the lone generation from that cache does."""
    from test_api_hardening import tiny_tokenizer

    model = tiny_llama(vocab=VOCAB, hidden=128, seed=2, sharpness=8.0)
    tokenizer = tiny_tokenizer(VOCAB)
    prompt = BATCH_PROMPTS[0]
    first = mlxspec.PromptCache()
    turn = [r.token for r in mlxspec.stream_generate(model, tokenizer, prompt, 6,
                                                     prompt_cache=first, **BITS)]
    follow_up = prompt + turn + [4, 5]
    alone_cache = mlxspec.PromptCache()
    for r in mlxspec.stream_generate(model, tokenizer, prompt, 6, prompt_cache=alone_cache,
                                     **BITS):
        pass
    expected = [r.token for r in mlxspec.stream_generate(
        model, tokenizer, follow_up, 12, prompt_cache=alone_cache, **BITS)]
    out = mlxspec.batch_generate(model, tokenizer, [follow_up, BATCH_PROMPTS[1]], 12,
                                 prompt_caches=[first, None], **BITS)
    assert out.cached_tokens[0] > 0
    assert out.token_ids[0] == [t for t in expected if t not in tokenizer.eos_token_ids]


def test_a_server_with_kv_bits_answers_as_the_quantized_target(target):
    """serve --kv-bits: every request's target keeps quantized keys and values, so a reply is
    the text generate gives with the same kv_bits (not the full-precision one), with a drafter,
    from a kept prompt cache (the same prompt again), and with requests batched together."""
    pytest.importorskip("uvicorn", reason="mlxspec serve needs the server extra")
    from concurrent.futures import ThreadPoolExecutor

    from test_api_hardening import tiny_tokenizer
    from test_server import Running
    from test_server_batching import ask

    from mlxspec.server import make_server

    tokenizer = tiny_tokenizer(VOCAB)
    prompts = [" ".join(f"t{i}" for i in p) for p in BATCH_PROMPTS[:4]]

    def text(prompt, **options):
        return "".join(r.text for r in mlxspec.stream_generate(
            target, tokenizer, prompt, N, drafter="lookup", **options))

    quantized = [text(p, **BITS) for p in prompts]
    assert quantized[0] != text(prompts[0])  # the quantized target's own text
    server = make_server(target, tokenizer, drafter="lookup", model_id="tiny", max_batch=4,
                         **BITS)
    running = Running(server)
    try:
        assert server.worker.describe() == "batches of up to 4 requests"
        body = {"prompt": prompts[0], "max_tokens": N, "temperature": 0}
        first, again = ask(running, body), ask(running, body)
        assert first["text"] == again["text"] == quantized[0]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda p: ask(running, {**body, "prompt": p}), prompts))
        assert [r["text"] for r in replies] == quantized
    finally:
        running.stop()
    with pytest.raises(ValueError, match="kv_bits must be one of"):
        make_server(target, tokenizer, kv_bits=7)
    with pytest.raises(ValueError, match="does not divide"):
        make_server(target, tokenizer, kv_bits=4, kv_group_size=64)
