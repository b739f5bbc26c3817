"""Sliding-window targets on the torch backend past their window: the torch target holds their
layers as WindowLayers (mlxspec.backends.torch.window_cache), which keep what a rollback of the
last pass needs, so speculation goes on at any context length and stays the model's own output.

A tiny random Qwen2 (sliding window 8; sliding, full and sliding layers), built from its config,
float32 on the CPU (MLXSPEC_TORCH_DEVICE=cuda for a GPU); every prompt is 3 windows long.
Checked: lookup keeps drafting past the window where transformers' own sliding-window cache
leaves no room, and its greedy output is `model.generate`'s, which the window changes; a wrong
draft planted at every position rolls back exactly, and the cache left is a fresh prefill's
(every key and value attention can still see); a crop past what is held is refused; a draft
model with sliding layers cuts back its drafts; a prompt cache keeps a long conversation
that the next turn extends and rebuilds one it cannot cut back.
"""

import os

import pytest
from test_api_hardening import tiny_tokenizer
from test_rollback_property import KS, N, PlantedDrafter, expected_stats

torch = pytest.importorskip("torch", reason="needs torch (pip install .[reference])")
transformers = pytest.importorskip("transformers", reason="the torch backend needs transformers")

import mlxspec  # noqa: E402
from mlxspec.backends.torch import TorchDraftModelDrafter, TorchPromptCache  # noqa: E402
from mlxspec.backends.torch import TorchTarget  # noqa: E402
from mlxspec.backends.torch.target import cache_argument, make_cache  # noqa: E402
from mlxspec.backends.torch.window_cache import WindowLayer  # noqa: E402
from mlxspec.drafters.lookup import PromptLookupDrafter  # noqa: E402
from mlxspec.engine import SpecStats, speculative_tokens  # noqa: E402
from mlxspec.sampling import SamplingConfig  # noqa: E402

DEVICE = torch.device(os.environ.get("MLXSPEC_TORCH_DEVICE", "cpu"))
VOCAB, WINDOW = 48, 8
LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]
PROMPT = [5, 9, 2, 7, 1, 9, 2, 7, 3, 5, 9, 2, 7, 1, 4, 6, 5, 9, 2, 7, 1, 9, 2, 7]  # 3 windows


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread(one_torch_thread):
    """torch on one thread while this module runs (conftest.one_torch_thread)."""


def tiny_qwen2(seed: int, layer_types=LAYERS):
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        use_sliding_window=True, sliding_window=WINDOW, layer_types=list(layer_types))
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).to(DEVICE).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_qwen2(seed=0)


def ids(tokens) -> torch.Tensor:
    return torch.tensor([list(tokens)], device=DEVICE)


def model_generate(model, prompt, n: int) -> list[int]:
    """transformers' own greedy generation, with its own sliding-window cache."""
    with torch.inference_mode():
        out = model.generate(ids(prompt), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run(target, drafter, prompt, n: int, k: int):
    stats = SpecStats()
    out = speculative_tokens(target, drafter, prompt, sampling=SamplingConfig(), max_tokens=n,
                             num_draft=k, stats=stats)
    return [t for t, _ in out], stats


def test_the_target_cache_holds_sliding_layers_as_window_layers(model):
    target = TorchTarget(model, speculative=True)
    kinds = [type(layer).__name__ for layer in target.cache.layers]
    assert kinds == ["WindowLayer", "DynamicLayer", "WindowLayer"]
    assert target.rollback_room() is None and not target.holds_trees()


def test_lookup_drafts_past_the_window_and_is_the_models_generate(model):
    """Through the API: every pass runs past the window (the prompt is 3 windows long), lookup
    drafts and some drafts are rejected, and the tokens are `model.generate`'s. The same weights
    without a window decode otherwise, so the window was applied."""
    n, tokenizer = 40, tiny_tokenizer(VOCAB + 1)
    reference = model_generate(model, PROMPT, n)
    responses = list(mlxspec.stream_generate(model, tokenizer, PROMPT, n, drafter="lookup",
                                             num_draft=4, adaptive=False))
    plain = [r.token for r in mlxspec.stream_generate(model, tokenizer, PROMPT, n)]
    assert [r.token for r in responses] == plain == reference
    last = responses[-1]
    assert 0 < last.accepted < last.drafted and last.target_passes < n
    full = tiny_qwen2(seed=0, layer_types=["full_attention"] * len(LAYERS))
    assert model_generate(full, PROMPT, n) != reference


def test_transformers_own_sliding_cache_leaves_no_room_past_the_window(model):
    """What WindowLayer changes: with transformers' DynamicSlidingWindowLayer (a cache handed
    in) the target has no room to roll back past the window, and the loop decodes plainly."""
    own = transformers.DynamicCache(config=model.config)
    target = TorchTarget(model, speculative=True, cache=own)
    out, stats = run(target, PromptLookupDrafter(), PROMPT, 12, 4)
    assert target.rollback_room() == 0
    assert out == model_generate(model, PROMPT, 12)
    assert stats.drafted == 0 and stats.plain_fallback_steps > 0


def fresh_prefill(model, tokens):
    """transformers' own cache after one prefill of `tokens`."""
    cache = transformers.DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids(tokens), **{cache_argument(model): cache}, use_cache=True)
    return cache


def assert_prefill_of(cache, model, tokens):
    """`cache` holds what a prefill of `tokens` builds: the positions counted, all keys and
    values of a full layer, those of a sliding layer that the next position can see."""
    fresh = fresh_prefill(model, tokens)
    assert cache.get_seq_length() == fresh.get_seq_length() == len(tokens)
    for ours, theirs in zip(cache.layers, fresh.layers):
        seen = theirs.keys.shape[-2]  # the window - 1 last positions of a sliding layer
        assert seen == (WINDOW - 1 if isinstance(ours, WindowLayer) else len(tokens))
        assert torch.allclose(ours.keys[..., -seen:, :], theirs.keys, atol=1e-5)
        assert torch.allclose(ours.values[..., -seen:, :], theirs.values, atol=1e-5)


@pytest.mark.parametrize("k", KS)
def test_a_wrong_draft_at_every_position_rolls_back_to_a_fresh_prefill(model, k):
    """test_rollback_property's plantings: each pass accepts exactly the drafts before the
    planted one and crops the rest, at every draft position, all past the window. The output
    is `model.generate`'s, the stats are the planting's with no room limit, and the
    cache left behind is a fresh prefill of the committed tokens."""
    reference = model_generate(model, PROMPT, N)
    for j in range(k + 1):
        target = TorchTarget(model, speculative=True)
        out, stats = run(target, PlantedDrafter(PROMPT + reference, j), PROMPT, N, k)
        assert out == reference, j
        want = expected_stats(len(PROMPT), k, j, window=None)
        for field in ("target_passes", "drafted", "accepted", "drafted_per_position",
                      "accepted_per_position"):
            assert getattr(stats, field) == getattr(want, field), (j, field)
        assert_prefill_of(target.cache, model, (PROMPT + out)[: target.offset])


def test_a_crop_past_the_kept_window_is_refused(model):
    """A WindowLayer crops what the last write added past the window, not more: the next
    position's window would be gone. While it has forgotten nothing it crops anything."""
    cache = make_cache(model)
    with torch.inference_mode():
        model(input_ids=ids(PROMPT[:5]), **{cache_argument(model): cache}, use_cache=True)
        layer = cache.layers[0]
        assert layer.crops_anything() and layer.room() == 5
        model(input_ids=ids(PROMPT[5:20]), **{cache_argument(model): cache}, use_cache=True)
        model(input_ids=ids(PROMPT[20:23]), **{cache_argument(model): cache}, use_cache=True)
    assert not layer.crops_anything() and layer.room() == 3
    with pytest.raises(RuntimeError, match="cannot crop 4 positions"):
        layer.crop(-4)
    cache.crop(-3)
    assert_prefill_of(cache, model, PROMPT[:20])


def test_a_sliding_draft_model_cuts_back_its_drafts(model):
    """A draft model with sliding layers (another random Qwen2) keeps `CUT_SLACK` positions
    past its window, so cutting back a step's drafts stays exact past the window."""
    drafter = TorchDraftModelDrafter(tiny_qwen2(seed=1))
    reference = model_generate(model, PROMPT, N)
    out, stats = run(TorchTarget(model, speculative=True), drafter, PROMPT, N, 3)
    assert out == reference and stats.drafted > 0
    assert isinstance(drafter.cache.layers[0], WindowLayer)


def test_a_prompt_cache_keeps_a_conversation_past_the_window(model):
    """A turn that extends what the cache holds prefills only its new tokens; one that parts
    from it after the window was passed gets a fresh cache (the forgotten positions cannot be
    cut back to); a short one, inside the window, is cut back. Replies are the same as
    without a cache."""
    tokenizer, cache = tiny_tokenizer(VOCAB + 1), TorchPromptCache()

    def reply(prompt, prompt_cache=None, n=10):
        return [r.token for r in mlxspec.stream_generate(
            model, tokenizer, prompt, n, drafter="lookup", prompt_cache=prompt_cache)]

    first = reply(PROMPT, cache)
    assert first == model_generate(model, PROMPT, 10)
    held, before = len(cache.tokens), cache.cache
    assert held >= len(PROMPT) and cache.cache.get_seq_length() == held
    second = PROMPT + first + [3, 5, 9]
    assert reply(second, cache) == reply(second) and cache.cache is before
    assert cache.cache.get_seq_length() == len(cache.tokens) > held
    parted = PROMPT[:-3] + [1, 1]
    assert reply(parted, cache) == reply(parted) and cache.cache is not before
    cache = TorchPromptCache()
    reply([5, 9, 2], cache, n=3)  # holds 5 positions, inside the window
    before = cache.cache
    assert reply([5, 9, 4], cache, n=3) == reply([5, 9, 4], n=3) and cache.cache is before
