"""`--drafter medusa`: heads on the target's last hidden state, chains and trees.

Parity with the Medusa reference code (tests/fixtures/medusa, made by
scripts/make_medusa_fixtures.py in the reference's own virtualenv), greedy identity and χ²
exactness for chains and trees, the published layouts (unprefixed and prefixed names, blocks
repeated, heads without projections), refusals before any weight loads, and the CLI and API."""

import json
from pathlib import Path

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
from tiny_models import tiny_llama

import mlxspec
from mlxspec.cli.main import main
from mlxspec.converters.hf import load_checkpoint
from mlxspec.drafters import load_drafter
from mlxspec.drafters.medusa import MedusaDrafter, load_medusa_drafter
from mlxspec.engine import PlainDecoding, SpecStats, speculative_tokens
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.sampling import SamplingConfig

FIXTURES = Path(__file__).parent / "fixtures" / "medusa"
GREEDY = SamplingConfig(temp=0.0)


def write_heads(path: Path, *, hidden: int, vocab: int, heads: int = 3, layers: int = 1,
                projection=None, prefix: str = "", seed: int = 0, scale: float = 0.3) -> Path:
    """Random heads in the published layout; `projection` (V, H) starts each head's own
    projection (None: no projections, the target's head is used)."""
    mx.random.seed(seed)
    tensors = {}
    for i in range(heads):
        for j in range(layers):
            tensors[f"{prefix}{i}.{j}.linear.weight"] = mx.random.normal((hidden, hidden)) * scale
            tensors[f"{prefix}{i}.{j}.linear.bias"] = mx.random.normal((hidden,)) * scale
        if projection is not None:
            noise = mx.random.normal(projection.shape) * scale
            tensors[f"{prefix}{i}.{layers}.weight"] = projection + noise
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "medusa_lm_head.safetensors"), tensors)
    (path / "config.json").write_text(json.dumps(
        {"medusa_num_heads": heads, "medusa_num_layers": layers}))
    return path


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=16, hidden=32, layers=2, seed=3, sharpness=3.0)


@pytest.fixture(scope="module")
def heads_dir(model, tmp_path_factory):
    return write_heads(tmp_path_factory.mktemp("heads"), hidden=32, vocab=16,
                       projection=model.lm_head.weight)


def run(model, drafter, prompt, n, sampling=GREEDY, num_draft=3):
    stats = SpecStats()
    target = MLXTarget(model, capture_layers=drafter.capture_layers, speculative=True)
    out = speculative_tokens(target, drafter, prompt, sampling=sampling, max_tokens=n,
                             num_draft=num_draft, stats=stats)
    return [t for t, _ in out], stats


# ---- against the reference ------------------------------------------------------------------


@pytest.mark.parametrize("layers", [1, 2])
def test_head_logits_match_the_reference(layers):
    target, _ = load_checkpoint(FIXTURES / "target", lazy=False, action="load")
    expected = mx.load(str(FIXTURES / f"expected_l{layers}.safetensors"))
    ids = expected["input_ids"][0].tolist()
    drafter = load_medusa_drafter(FIXTURES / f"heads_l{layers}", model=target)
    mlx_target = MLXTarget(target, capture_layers=drafter.capture_layers)
    features = mlx_target.prefill(ids + [0])  # every position of `ids` through the target
    drafter.begin(ids + [0], features)
    np.testing.assert_allclose(np.array(drafter._hidden[0]),
                               np.array(expected["hidden_states"][0, -1]), atol=2e-5)
    got = drafter.head_logits(3)  # (3, V) from the last position
    np.testing.assert_allclose(np.array(got), np.array(expected["medusa_logits"][:, 0, -1]),
                               atol=1e-4)
    all_positions = drafter.heads(drafter.norm(features)[None])  # every position at once
    np.testing.assert_allclose(np.array(all_positions), np.array(expected["medusa_logits"]),
                               atol=1e-4)


# ---- lossless ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tree_budget", [None, 4, 12])
@pytest.mark.parametrize("num_draft", [1, 2, 3])
def test_greedy_output_is_the_targets(model, heads_dir, tree_budget, num_draft):
    prompt = [1, 2, 3, 4, 5, 1, 2]
    want, _ = run(model, PlainDecoding(), prompt, 40)
    drafter = load_medusa_drafter(heads_dir, model=model, tree_budget=tree_budget)
    got, stats = run(model, drafter, prompt, 40,
                     num_draft=num_draft if tree_budget is None else tree_budget)
    assert got == want
    assert 0 < stats.accepted < stats.drafted


def test_a_one_token_prompt_drafts_from_the_first_committed_position(model, heads_dir):
    want, _ = run(model, PlainDecoding(), [5], 12)
    got, stats = run(model, load_medusa_drafter(heads_dir, model=model), [5], 12)
    assert got == want and stats.drafted > 0


def test_drafts_rejected_at_every_position_are_still_lossless(model, heads_dir):
    class Wrong(MedusaDrafter):
        def propose(self, tokens, k, sampling):
            draft = super().propose(tokens, k, sampling)
            draft.tokens = (draft.tokens + 1) % 16
            return draft

    base = load_medusa_drafter(heads_dir, model=model)
    wrong = Wrong(base.heads, model)
    prompt = [3, 1, 4, 1, 5]
    want, _ = run(model, PlainDecoding(), prompt, 30)
    got, stats = run(model, wrong, prompt, 30)
    assert got == want and stats.accepted < stats.drafted


@pytest.mark.slow  # χ²: thousands of sampled generations
def test_sampled_output_follows_the_target_distribution(tmp_path):
    """A chain drawn from the heads' distributions (trees have deterministic children, whose
    rule tests/test_tree_acceptance.py checks by χ²)."""
    target = tiny_llama(vocab=VOCAB, seed=11, sharpness=2.5)
    heads = write_heads(tmp_path, hidden=32, vocab=VOCAB, heads=2,
                        projection=target.lm_head.weight, scale=0.1)
    exact = exact_distribution(target, SAMPLING)
    drafter = load_medusa_drafter(heads, model=target)
    counts = sample_counts(target, drafter, SAMPLING, num_draft=2)
    pvalue = chi_squared_pvalue(counts, exact)
    assert pvalue > 0.001, f"p = {pvalue:.2g}"


# ---- layouts and refusals -------------------------------------------------------------------


def test_prefixed_names_and_heads_without_projections_load(model, tmp_path):
    prompt = [2, 7, 1, 8, 2, 8]
    want, _ = run(model, PlainDecoding(), prompt, 24)
    prefixed = write_heads(tmp_path / "prefixed", hidden=32, vocab=16, prefix="medusa_head.",
                           projection=model.lm_head.weight, layers=2)
    shared = write_heads(tmp_path / "shared", hidden=32, vocab=16)  # the target's head projects
    for path in (prefixed, shared):
        drafter = load_drafter("medusa", str(path), model=model, tokenizer=None)
        got, stats = run(model, drafter, prompt, 24)
        assert got == want and stats.drafted
    assert not load_medusa_drafter(shared, model=model).heads.own_projection


def test_refusals_are_one_line_before_any_weight_loads(model, heads_dir, tmp_path):
    def refused(path, match):
        with pytest.raises(ValueError, match=match):
            load_drafter("medusa", str(path), model=model, tokenizer=None)

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(heads_dir.joinpath("config.json").read_text())
    (pickled / "medusa_lm_head.pt").write_bytes(b"\x80\x04not really")
    refused(pickled, r"medusa_lm_head\.pt is a pickle, which mlxspec never loads")
    refused(write_heads(tmp_path / "wide", hidden=48, vocab=16, projection=mx.zeros((16, 48))),
            r"has shape \(48, 48\), this target \(hidden size 32, vocabulary 16\) needs "
            r"\(32, 32\): the heads were trained for another model")
    refused(tmp_path / "nothing", "has no config.json")
    bad = write_heads(tmp_path / "bad", hidden=32, vocab=16)
    (bad / "config.json").write_text(json.dumps({"medusa_num_heads": 0, "medusa_num_layers": 1}))
    refused(bad, "medusa_num_heads must be an integer >= 1, got 0")
    with pytest.raises(ValueError, match="needs Medusa heads trained for this target"):
        load_drafter("medusa", model=model, tokenizer=None)


# ---- the default model, from the API and the CLI ----------------------------------------------


@pytest.fixture(scope="module")
def smollm_heads(smollm, tmp_path_factory):
    """Untrained heads shaped for SmolLM2, without projections (4 MB, not 340): lossless, not
    accepted."""
    return write_heads(tmp_path_factory.mktemp("smollm_heads"), hidden=576, vocab=49152,
                       scale=0.02)


def test_api_on_the_default_model(smollm, smollm_heads):
    model, tokenizer = smollm
    want = mlxspec.generate(model, tokenizer, "def add(a, b):", max_tokens=16)
    for budget in (None, 8):
        drafter = load_drafter("medusa", str(smollm_heads), model=model, tokenizer=tokenizer,
                               tree_budget=budget)
        got = mlxspec.generate(model, tokenizer, "def add(a, b):", max_tokens=16,
                               drafter=drafter, adaptive=False)
        assert got == want


def test_cli_generate_chat_and_bench(smollm_heads, tmp_path):
    runner = CliRunner()
    heads = str(smollm_heads)
    result = runner.invoke(main, ["generate", "--drafter", "medusa", "--drafter-model", heads,
                                  "-n", "8", "-p", "Name a color.", "--verbose"])
    assert result.exit_code == 0, result.output
    assert "Drafter: medusa" in result.output
    result = runner.invoke(main, ["chat", "--drafter", "medusa", "--drafter-model", heads,
                                  "--tree-budget", "6", "--max-tokens", "6"], input="Hi\n")
    assert result.exit_code == 0, result.output
    out = tmp_path / "report.json"
    result = runner.invoke(main, [
        "bench", "--drafters", "none,medusa,medusa:tree-budget=8", "--medusa-model", heads,
        "--suite", "humaneval", "--limit", "1", "--max-tokens", "6", "--temp", "0",
        "--no-mlx-lm", "--no-llama-cpp", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["results"]
    assert [r["drafter"] for r in rows] == ["none", "medusa", "medusa:tree-budget=8"]
    assert len({r["tokens"] for r in rows}) == 1
    # without --drafter-model: the heads shipped for the default model
    result = runner.invoke(main, ["generate", "--drafter", "medusa", "-n", "6", "-p", "x",
                                  "--verbose"])
    assert result.exit_code == 0, result.output
    assert "Drafter: medusa (up to 3 drafts per step)" in result.output


def test_the_shipped_heads_are_found_for_the_default_model_only(smollm, model):
    drafter = load_drafter("medusa", model=smollm[0], tokenizer=smollm[1])
    assert drafter.heads.num_heads == 3 and not drafter.heads.own_projection
    assert drafter.heads.dtype == mx.float32  # shipped in bf16, run in the target's dtype
    with pytest.raises(ValueError, match="ships one only for the default SmolLM2"):
        load_drafter("medusa", model=model, tokenizer=None)
