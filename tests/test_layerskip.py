"""`--drafter layerskip`: the target's first E layers draft, and the verify pass reuses them.

Lossless (greedy identity at every exit layer, χ² when sampling), the verify pass of drafted
positions runs only layers >= E (counted), the cache after rollbacks equals one built from
scratch, and it runs from the CLI (generate, chat, bench) and the API on the default model."""

import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from test_sampling_exactness import (
    PROMPT,
    SAMPLING,
    VOCAB,
    chi_squared_pvalue,
    exact_distribution,
    sample_counts,
)
from tiny_models import tiny_llama, tiny_qwen3_next

import mlxspec
from mlxspec.cli.main import main
from mlxspec.drafters import load_drafter
from mlxspec.drafters.layerskip import LayerSkipDrafter
from mlxspec.engine import PlainDecoding, SpecStats, speculative_tokens
from mlxspec.backends.mlx.hidden_states import decoder_layers
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.sampling import SamplingConfig

GREEDY = SamplingConfig(temp=0.0)
LAYERS = 4


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=16, hidden=32, layers=LAYERS, seed=5, sharpness=3.0)


def run(model, drafter, prompt, n, sampling=GREEDY, num_draft=3, adaptive=False):
    stats, target = SpecStats(), MLXTarget(model, speculative=True)
    out = speculative_tokens(target, drafter, prompt, sampling=sampling, max_tokens=n,
                             num_draft=num_draft, stats=stats, adaptive=adaptive)
    return [t for t, _ in out], stats, target


@pytest.mark.parametrize("exit_layer", range(1, LAYERS))
@pytest.mark.parametrize("num_draft", [1, 2, 4])
def test_greedy_output_is_the_targets_at_every_exit(model, exit_layer, num_draft):
    prompt = [1, 2, 3, 4, 5, 1, 2]
    want, _, _ = run(model, PlainDecoding(), prompt, 40)
    got, stats, _ = run(model, LayerSkipDrafter(model, exit_layer), prompt, 40,
                        num_draft=num_draft)
    assert got == want
    assert stats.drafted > stats.accepted  # drafts were rejected: rollbacks happened


def test_drafts_are_rejected_at_every_position_and_still_lossless(model):
    """The drafter's tokens replaced by wrong ones: every pass rejects its first draft."""

    class Wrong(LayerSkipDrafter):
        def propose(self, tokens, k, sampling):
            draft = super().propose(tokens, k, sampling)
            draft.tokens = (draft.tokens + 1) % 16  # the early layers still ran on the true ones
            return draft

    prompt = [3, 1, 4, 1, 5]
    want, _, _ = run(model, PlainDecoding(), prompt, 30)
    got, stats, _ = run(model, Wrong(model, 2), prompt, 30)
    assert got == want and stats.accepted < stats.drafted


class Counted:
    """A decoder layer that counts its calls and the positions each call holds."""

    def __init__(self, layer, calls: list, index: int):
        self.layer, self.calls, self.index = layer, calls, index

    def __call__(self, x, *args, **kwargs):
        self.calls.append((self.index, x.shape[1]))
        return self.layer(x, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.layer, name)


def test_the_verify_pass_runs_only_the_layers_past_the_exit(model):
    exit_layer, k = 2, 3
    layers = decoder_layers(model)
    originals, calls = list(layers), []
    try:
        layers[:] = [Counted(layer, calls, i) for i, layer in enumerate(originals)]
        target = MLXTarget(model, speculative=True)
        drafter = LayerSkipDrafter(model, exit_layer)
        prompt = [1, 2, 3, 4]
        drafter.bind(target)
        target.prefill(prompt)
        calls.clear()
        draft = drafter.propose(prompt, k, GREEDY)
        mx.eval(draft.tokens)
        # drafting: the pending token and each draft through the early layers, one at a time
        assert calls == [(i, 1) for _ in range(k + 1) for i in range(exit_layer)]
        calls.clear()
        step = target.launch(prompt[-1], draft, GREEDY)
        step.verdict()
        assert calls == [(i, k + 1) for i in range(exit_layer, LAYERS)]
    finally:
        layers[:] = originals


def cache_arrays(cache, length):
    return [np.array(a[..., :length, :]) for c in cache for a in (c.keys, c.values)]


def test_cache_after_rollbacks_equals_one_built_from_scratch(model):
    prompt = [2, 7, 1, 8, 2, 8]
    out, stats, target = run(model, LayerSkipDrafter(model, 1), prompt, 25, num_draft=4)
    assert stats.accepted < stats.drafted
    committed = prompt + out
    fresh = MLXTarget(model)
    fresh.prefill(committed)  # all but the pending token, as the loop's cache holds
    assert target.offset == fresh.offset == len(committed) - 1
    for got, want in zip(cache_arrays(target.cache, fresh.offset),
                         cache_arrays(fresh.cache, fresh.offset)):
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.slow  # χ²: thousands of sampled generations
def test_sampled_output_follows_the_target_distribution():
    target = tiny_llama(vocab=VOCAB, layers=2, seed=11, sharpness=2.5)
    exact = exact_distribution(target, SAMPLING)
    pvalue = chi_squared_pvalue(sample_counts(target, LayerSkipDrafter(target, 1), SAMPLING),
                                exact)
    assert pvalue > 0.001, f"p = {pvalue:.2g}"


def test_refusals_are_one_line_before_any_compute(model):
    with pytest.raises(ValueError, match=r"--exit-layer must be in 1\.\.3 .* got 4"):
        load_drafter("layerskip", model=model, tokenizer=None, exit_layer=4)
    with pytest.raises(ValueError, match="one kind of KV cache; this one mixes ArraysCache, "
                                         "KVCache"):
        LayerSkipDrafter(tiny_qwen3_next(), 2)
    with pytest.raises(ValueError, match="its own target"):
        LayerSkipDrafter(model, 1).bind(MLXTarget(tiny_llama(layers=2)))


# ---- the default model, from the API and the CLI ----------------------------------------------


def test_api_on_the_default_model(smollm):
    model, tokenizer = smollm
    prompt = "def add(a, b):"
    want = mlxspec.generate(model, tokenizer, prompt, max_tokens=24)
    drafter = load_drafter("layerskip", model=model, tokenizer=tokenizer, exit_layer=24)
    assert drafter.exit_layer == 24
    got = mlxspec.generate(model, tokenizer, prompt, max_tokens=24, drafter=drafter,
                           adaptive=False, num_draft=3)
    assert got == want
    default = load_drafter("layerskip", model=model, tokenizer=tokenizer)
    assert 1 <= default.exit_layer < 30


def test_cli_generate_chat_and_bench(smollm_dir, tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["generate", "--drafter", "layerskip", "--exit-layer", "24",
                                  "-n", "12", "-p", "Name a color.", "--verbose"])
    assert result.exit_code == 0, result.output
    assert "Drafter: layerskip" in result.output

    result = runner.invoke(main, ["chat", "--drafter", "layerskip", "--max-tokens", "8"],
                           input="Hi\n")
    assert result.exit_code == 0, result.output

    out = tmp_path / "report.json"
    result = runner.invoke(main, [
        "bench", "--drafters", "none,layerskip:exit-layer=24", "--suite", "humaneval",
        "--limit", "1", "--max-tokens", "6", "--temp", "0", "--no-mlx-lm", "--no-llama-cpp",
        "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["results"]
    assert [r["drafter"] for r in rows] == ["none", "layerskip:exit-layer=24"]
    assert rows[0]["tokens"] == rows[1]["tokens"] > 0

    result = runner.invoke(main, ["generate", "--drafter", "layerskip", "--exit-layer", "30",
                                  "-p", "x"])
    assert result.exit_code == 2  # refused before the model loads, from its config.json
    assert result.output.strip().splitlines()[-1] == (
        "Error: Invalid value for --exit-layer: must be in 1..29 for this 30-layer target, got 30")
