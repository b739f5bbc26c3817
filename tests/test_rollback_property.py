"""Rollback everywhere: drafts that are right up to one planted wrong token, at every position.

A drafter proposes the target's true greedy continuation with the token at draft position j
made wrong, for every j in 0..K-1 and for none wrong (j = K), over several K and prompts, on every
kind of target cache the project runs: mlx-lm's KVCache, a RotatingKVCache whose window the
generation outgrows (drafts shrink at its edge, then stop), a PromptCache reused from an earlier
call, and transformers' DynamicCache on the torch backend. Each step then accepts exactly j
drafts and rolls back the rest, so the output must be plain greedy decoding (computed outside the
loop, token by token) and the stats must be exactly the ones the planting implies.
"""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from tiny_models import tiny_llama

from mlxspec.engine import Draft, Drafter, SpecStats, speculative_tokens
from mlxspec.mlx_backend import MLXTarget, PromptCache
from mlxspec.sampling import SamplingConfig

VOCAB, N = 40, 14
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7, 7], [3]]
KS = [1, 3, 5]
WINDOW = 10  # the rotating cache's window: every prompt's generation runs past it


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=VOCAB, seed=1, sharpness=8.0)


class PlantedDrafter(Drafter):
    """Proposes `full`'s continuation of the committed tokens, its draft position j made wrong."""

    name = "planted"

    def __init__(self, full: list[int], j: int):
        self.full, self.j = full, j

    def propose(self, tokens, k, sampling):
        drafts = list(self.full[len(tokens) : len(tokens) + k])
        if self.j < len(drafts):
            drafts[self.j] = (drafts[self.j] + 1) % VOCAB
        return Draft(tokens=drafts)


def expected_stats(prompt_length: int, k: int, j: int, window: int | None) -> SpecStats:
    """What each step must count: it drafts k (fewer near max_tokens, or where a window leaves
    less room to roll back) and keeps the drafts before position j."""
    stats, produced, held = SpecStats(), 0, prompt_length - 1  # the pending token is not held
    while produced < N:
        drafts = min(k, N - produced - 1)
        if window is not None:
            drafts = max(min(drafts, window - held - 1), 0)
        accepted = min(j, drafts)
        stats.record(drafts, accepted, accepted + 1)
        produced, held = produced + accepted + 1, held + accepted + 1
    return stats


def mlx_reference(model, prompt: list[int], make_cache) -> list[int]:
    """Greedy decoding one token per call, outside the loop under test."""
    cache, out = make_cache(), []
    logits = model(mx.array(prompt)[None], cache=cache)
    for _ in range(N):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)
    return out


def check_every_planting(make_target, prompt, reference, window=None, overlaps=(True,)):
    full = prompt + reference
    for k, overlap in ((k, overlap) for k in KS for overlap in overlaps):
        for j in range(k + 1):
            stats = SpecStats()
            out = [t for t, _ in speculative_tokens(
                make_target(), PlantedDrafter(full, j), prompt, sampling=SamplingConfig(),
                max_tokens=N, num_draft=k, stats=stats, overlap=overlap)]
            assert out == reference, (k, j)
            want = expected_stats(len(prompt), k, j, window)
            for field in ("target_passes", "drafted", "accepted", "generated",
                          "drafted_per_position", "accepted_per_position"):
                assert getattr(stats, field) == getattr(want, field), (k, j, field)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_kv_cache(target, prompt):
    reference = mlx_reference(target, prompt, lambda: make_prompt_cache(target))
    check_every_planting(lambda: MLXTarget(target, speculative=True), prompt, reference,
                         overlaps=(True, False))  # passes queued ahead, or one at a time


@pytest.mark.parametrize("prompt", PROMPTS)
def test_rotating_cache_past_its_window(target, prompt):
    def rotating():
        return [RotatingKVCache(max_size=WINDOW) for _ in target.layers]

    reference = mlx_reference(target, prompt, rotating)
    check_every_planting(lambda: MLXTarget(target, speculative=True, cache=rotating()), prompt,
                         reference, window=WINDOW)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_cache_reused_from_an_earlier_call(target, prompt):
    """The cache holds an earlier conversation that shares the prompt's first tokens (and more
    that it does not): it is cut back to the shared prefix, then drafts roll back as usual."""
    reference = mlx_reference(target, prompt, lambda: make_prompt_cache(target))
    earlier = prompt[:-1] + [9, 9, 8, 7, 6]

    def reused():
        prompt_cache = PromptCache()
        prompt_cache.take(target, earlier)
        list(speculative_tokens(MLXTarget(target, cache=prompt_cache.cache), Drafter(), earlier,
                                sampling=SamplingConfig(), max_tokens=4, num_draft=1,
                                stats=SpecStats()))
        prompt_cache.remember(earlier)
        return MLXTarget(target, speculative=True, cache=prompt_cache.take(target, prompt))

    check_every_planting(reused, prompt, reference)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_torch_dynamic_cache(target, prompt, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_torch_backend import torch_twin

    from mlxspec.torch_backend import TorchTarget

    twin = torch_twin(target, tmp_path / "twin")
    ids, reference = list(prompt), []
    with torch.inference_mode():
        for _ in range(N):  # no cache at all: the whole sequence each step
            logits = twin(input_ids=torch.tensor([ids], device=twin.device)).logits
            reference.append(int(logits[0, -1].argmax()))
            ids.append(reference[-1])
    check_every_planting(lambda: TorchTarget(twin, speculative=True), prompt, reference)
