"""Rollback everywhere: drafts that are right up to one planted wrong token, at every position.

A drafter proposes the target's true greedy continuation with the token at draft position j
made wrong, for every j in 0..K-1 and for none wrong (j = K), over several K and prompts, on every
kind of target cache the project runs: mlx-lm's KVCache, a RotatingKVCache whose window the
generation outgrows (drafts shrink at its edge, then stop), a PromptCache reused from an earlier
call, the recurrent ArraysCache of hybrid models beside their KVCache (Gated DeltaNet in Qwen3-Next
and Qwen3.5, Mamba-2 in Nemotron-H, short convolutions in LFM2), and transformers' DynamicCache on the torch backend. Each step then accepts exactly j
drafts and rolls back the rest, so the output must be plain greedy decoding (computed outside the
loop, token by token) and the stats must be exactly the ones the planting implies.
"""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from tiny_models import tiny_lfm2, tiny_llama, tiny_nemotron_h, tiny_qwen3_5, tiny_qwen3_next

from mlxspec.engine import Draft, Drafter, SpecStats, speculative_tokens
from mlxspec.backends.mlx.target import MLXTarget, PromptCache
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

    def __init__(self, full: list[int], j: int, vocab: int = VOCAB):
        self.full, self.j, self.vocab = full, j, vocab

    def propose(self, tokens, k, sampling):
        drafts = list(self.full[len(tokens) : len(tokens) + k])
        if self.j < len(drafts):
            drafts[self.j] = (drafts[self.j] + 1) % self.vocab
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

    from mlxspec.backends.torch import TorchTarget

    twin = torch_twin(target, tmp_path / "twin")
    ids, reference = list(prompt), []
    with torch.inference_mode():
        for _ in range(N):  # no cache at all: the whole sequence each step
            logits = twin(input_ids=torch.tensor([ids], device=twin.device)).logits
            reference.append(int(logits[0, -1].argmax()))
            ids.append(reference[-1])
    check_every_planting(lambda: TorchTarget(twin, speculative=True), prompt, reference)


HYBRIDS = [tiny_qwen3_next, tiny_qwen3_5, tiny_nemotron_h, tiny_lfm2]


GATED_DELTANET = (tiny_qwen3_next, tiny_qwen3_5)
MECHANISMS = ("default", "re-run", "whole")


def hybrid_target(model, mechanism: str) -> MLXTarget:
    """A target rolling back by `mechanism`: its default (a state tape for Gated DeltaNet layers
    on the CPU, else re-running the recurrent layers), re-running the recurrent layers on the
    kept positions, or the kept tokens through the whole model (the fallback for a hybrid whose
    state modules are unknown)."""
    target = MLXTarget(model, speculative=True)
    if mechanism != "default":
        target._taped = []
    if mechanism == "whole":
        target._mixers = []
    return target


def rollbacks_seen(target) -> list:
    """What each rollback of `target` had recorded: (states, inputs, replays, tape)."""
    seen, trim = [], target.trim

    def spy(n):
        if n > 0:
            seen.append(target._last_pass)
        trim(n)

    target.trim = spy
    return seen


@pytest.mark.parametrize("build", HYBRIDS)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_hybrid_recurrent_and_attention_caches(build, prompt):
    """Gated DeltaNet, Mamba-2 and short-convolution layers keep a convolution window and/or a
    recurrent state: a rejected draft is undone by selecting the state the pass recorded at the
    last kept position, or by restoring the state from before the pass and running the kept
    tokens again, through the recurrent layers only or (the fallback) the whole model."""
    model = build(vocab=VOCAB, seed=3)
    reference = mlx_reference(model, prompt, lambda: make_prompt_cache(model))
    check_every_planting(lambda: hybrid_target(model, "default"), prompt, reference,
                         overlaps=(True, False))
    for mechanism in MECHANISMS[1:]:
        check_every_planting(lambda: hybrid_target(model, mechanism), prompt, reference)


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("build", HYBRIDS)
def test_hybrid_state_after_rollback_equals_a_fresh_prefill(build, mechanism):
    """After a generation full of rejected drafts, every layer's state (convolution window,
    recurrent state, attention keys and values) is the one a fresh prefill of the committed
    tokens builds, by each mechanism; the default one never runs the whole model (Nemotron-H
    included, whose cache list skips its MLP blocks), and on the CPU Gated DeltaNet layers
    roll back from their state tape alone."""
    model = build(vocab=VOCAB, seed=4)
    prompt = [1, 2, 3, 4, 5]
    full = prompt + mlx_reference(model, prompt, lambda: make_prompt_cache(model))
    target = hybrid_target(model, mechanism)
    seen = rollbacks_seen(target)
    out = list(speculative_tokens(target, PlantedDrafter(full, 1), prompt,
                                  sampling=SamplingConfig(), max_tokens=N, num_draft=4,
                                  stats=SpecStats()))
    committed = prompt + [t for t, _ in out]
    fresh = make_prompt_cache(model)
    model(mx.array(committed[:-1])[None], cache=fresh)
    assert seen, "no draft was ever rejected"
    if mechanism != "whole":
        assert all(replays is not None for _, _, replays, _ in seen), "ran the whole model"
    taped = mechanism == "default" and build in GATED_DELTANET
    assert all(len(tape) == len(target._recurrent) for *_, tape in seen) == taped
    for ours, theirs in zip(target.cache, fresh):
        if hasattr(theirs, "offset"):
            assert ours.offset == theirs.offset == len(committed) - 1
            pairs = [(ours.keys[..., : ours.offset, :], theirs.keys[..., : theirs.offset, :]),
                     (ours.values[..., : ours.offset, :], theirs.values[..., : theirs.offset, :])]
        else:
            pairs = list(zip(ours.cache, theirs.cache))
        for a, b in pairs:
            assert a.shape == b.shape and mx.allclose(a, b, atol=1e-4).item()


def test_state_tape_puts_mlx_lm_back_even_when_the_pass_fails():
    """The tape swaps mlx-lm's gated-delta update and each layer's convolution for one pass:
    afterwards (also after an exception inside the pass) they are mlx-lm's own again."""
    from mlx_lm.models import gated_delta, qwen3_5

    from mlxspec.backends.mlx.state_tape import state_tape, tape_modules

    model = tiny_qwen3_5(vocab=VOCAB, seed=2)
    modules = tape_modules([layer.linear_attn for layer in model.language_model.model.layers
                            if hasattr(layer, "linear_attn")])
    assert modules and all("conv1d" not in vars(m) for m in modules)
    with pytest.raises(RuntimeError, match="in the pass"):
        with state_tape(modules):
            assert qwen3_5.gated_delta_update is not gated_delta.gated_delta_update
            raise RuntimeError("in the pass")
    assert qwen3_5.gated_delta_update is gated_delta.gated_delta_update
    assert all("conv1d" not in vars(m) for m in modules)


@pytest.mark.parametrize("build", [tiny_qwen3_next, tiny_qwen3_5])
def test_dflash_on_hybrid_targets_is_lossless(build, tmp_path):
    """A random DFlash drafter (z-lab layout) reading a linear-attention layer (0), an attention
    layer (1) and the last layer of a hybrid target: greedy output is plain decoding's."""
    from test_dflash import drafter_config, random_weights, save_drafter

    from mlxspec.drafters.dflash import load_dflash_drafter
    from mlxspec.engine import PlainDecoding

    model = build(vocab=VOCAB, seed=3)
    config = drafter_config(vocab=VOCAB, hidden=32, target_layers=4, num_hidden_layers=1,
                            layer_types=["full_attention"], block_size=6, mask_token_id=0,
                            target_layer_ids=[0, 1, 3])
    drafter = load_dflash_drafter(save_drafter(tmp_path, config, random_weights(config)),
                                  model=model)
    prompt = [1, 2, 3, 4, 5]
    plain = [t for t, _ in speculative_tokens(MLXTarget(model), PlainDecoding(), prompt,
                                              sampling=SamplingConfig(), max_tokens=N,
                                              num_draft=1, stats=SpecStats())]
    stats = SpecStats()
    out = [t for t, _ in speculative_tokens(
        MLXTarget(model, capture_layers=drafter.capture_layers, speculative=True), drafter,
        prompt, sampling=SamplingConfig(), max_tokens=N, num_draft=5, stats=stats)]
    assert out == plain and stats.drafted > 0


@pytest.mark.parametrize("own", [False, True], ids=["window-layer", "transformers-layer"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_torch_sliding_window_cache(prompt, own):
    """The torch target holds a sliding window as a WindowLayer, which keeps what a rollback of
    the last pass needs: drafts are never cut short. transformers' DynamicSlidingWindowLayer (a
    cache handed in: `own`) keeps its last window - 1 positions and refuses a crop past them
    (it used to raise mid-generation): drafts shrink at its edge, then stop."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from mlxspec.backends.torch import TorchTarget

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0,
        layer_types=["sliding_attention"] * 2)
    model = transformers.Qwen2ForCausalLM(config).eval()
    ids, reference = list(prompt), []
    with torch.inference_mode():
        for _ in range(N):  # no cache at all: the whole sequence each step, windowed by the mask
            reference.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            ids.append(reference[-1])

    def target():
        cache = transformers.DynamicCache(config=config) if own else None
        return TorchTarget(model, speculative=True, cache=cache)

    check_every_planting(target, prompt, reference, window=WINDOW - 1 if own else None)


def test_a_cache_that_cannot_roll_back_is_refused_by_name():
    """A CacheList keeping a recurrent state beside keys and values in a window mlx-lm rotates
    (baichuan_m1's windowed layers): the state can be restored, but the window cannot be cut
    back past its size, so a drafter is refused, naming it. Beside plain keys and values
    (falcon_h1's Mamba state) the layer rolls back: states restored, keys and values cut."""
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache

    model = tiny_llama(vocab=VOCAB, seed=1)
    layers = [CacheList(ArraysCache(size=2), RotatingKVCache(max_size=8)), KVCache()]
    with pytest.raises(ValueError,
                       match=r"CacheList\(ArraysCache, RotatingKVCache\).*--drafter none"):
        MLXTarget(model, cache=layers, speculative=True)
    MLXTarget(model, cache=[CacheList(KVCache(), KVCache()), KVCache()], speculative=True)
    MLXTarget(model, cache=[CacheList(ArraysCache(size=2), KVCache()), KVCache()],
              speculative=True)
    MLXTarget(model, cache=layers)  # plain decoding needs no rollback
