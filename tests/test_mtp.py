"""`--drafter mtp` on MLX: the MTP modules a target ships (tests/mtp_models.py: a tiny hybrid
Qwen3.5 and a tiny DeepSeek-V3, random weights in their published Hugging Face layouts) draft
losslessly, from the CLI and the API, through conversion, and bench skips it on targets that
ship none. Draft logits against a peer (mlx-vlm) are in test_mtp_parity."""

import json
import re
import shutil
from collections import Counter

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
import pytest
from click.testing import CliRunner
from mtp_models import write_deepseek_v3, write_qwen3_5
from test_sampling_exactness import (
    LENGTH,
    PROMPT,
    SAMPLES,
    SAMPLING,
    VOCAB,
    chi_squared_pvalue,
    exact_distribution,
)

import mlxspec
from mlxspec.cli.main import main
from mlxspec.converters.hf import load_checkpoint
from mlxspec.drafters.mtp import MTPDrafter, load_mtp_drafter
from mlxspec.engine import SpecStats, speculative_tokens
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.sampling import SamplingConfig

WRITERS = {"qwen3_5": write_qwen3_5, "deepseek_v3": write_deepseek_v3}
TEXT = "one two three one two three one two"
GREEDY = SamplingConfig(temp=0.0)


@pytest.fixture(scope="module", params=sorted(WRITERS))
def hf_dir(request, smollm_dir, tmp_path_factory):
    """A target with SmolLM2's tokenizer, as its Hugging Face checkpoint."""
    out = tmp_path_factory.mktemp(request.param)
    return WRITERS[request.param](out, seed=3, tokenizer_dir=smollm_dir)


def small_target(tmp_path, family: str, seed: int = 0, sharpness: float = 3.0, vocab: int = 16):
    """A small-vocabulary target (its drafts are sometimes right) and its MTP drafter."""
    path = WRITERS[family](tmp_path / family, vocab=vocab, seed=seed, sharpness=sharpness)
    model, _ = load_checkpoint(path, lazy=False, action="load")
    return model, load_mtp_drafter(path, model=model)


def run(model, drafter, prompt, n, sampling=GREEDY, num_draft=3, adaptive=False):
    stats = SpecStats()
    out = speculative_tokens(MLXTarget(model, capture_layers=drafter.capture_layers,
                                       speculative=True), drafter, prompt, sampling=sampling,
                             max_tokens=n, num_draft=num_draft, stats=stats, adaptive=adaptive)
    return [t for t, _ in out], stats


def plain(model, prompt, n):
    tokens, cache = list(prompt), make_prompt_cache(model)
    logits = model(mx.array(tokens)[None], cache=cache)
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1])))
        logits = model(mx.array([out[-1]])[None], cache=cache)
    return out


@pytest.mark.parametrize("family", sorted(WRITERS))
@pytest.mark.parametrize("num_draft", [1, 2, 4])
def test_greedy_output_is_the_targets(tmp_path, family, num_draft):
    """Chains of 1, 2 (the module reused once) and 4, the random module's drafts rejected at
    (nearly) every position: each rejection cuts the chain's entries and the target's."""
    model, drafter = small_target(tmp_path, family)
    prompt = [1, 5, 3, 7, 2, 9, 4, 12, 5, 3]
    out, stats = run(model, drafter, prompt, 40, num_draft=num_draft)
    assert out == plain(model, prompt, 40)
    assert stats.drafted >= 30 and stats.accepted < stats.drafted


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_draft_cache_after_steps_equals_a_fresh_one(tmp_path, family):
    """After a sampled generation with drafts accepted and rejected, the modules' caches hold
    exactly the committed pairs from the target's verified hidden states: the next chain's
    logits are those of a drafter begun afresh on the same tokens."""
    model, drafter = small_target(tmp_path, family, seed=1, vocab=VOCAB, sharpness=1.0)
    prompt = [1, 0, 3, 2, 4, 1, 0]
    mx.random.seed(7)
    out, stats = run(model, drafter, prompt, 24, sampling=SamplingConfig(temp=1.0))
    assert 0 < stats.accepted < stats.drafted, (stats.accepted, stats.drafted)
    tokens = prompt + out[:-1]  # the drafter has seen every verdict but the last token pending
    used = drafter.chain_logits(tokens, 3)
    target = MLXTarget(model, capture_layers=drafter.capture_layers)
    fresh = load_mtp_drafter(drafter_source(tmp_path, family), model=model)
    fresh.begin(tokens, target.prefill(tokens))
    for a, b in zip(used, fresh.chain_logits(tokens, 3)):
        assert mx.allclose(a, b, atol=1e-4).item()


def drafter_source(tmp_path, family):
    return tmp_path / family


@pytest.mark.slow  # χ²: thousands of sampled generations
@pytest.mark.parametrize("family", sorted(WRITERS))
def test_sampled_output_follows_the_targets_distribution(tmp_path, family):
    """Drafts drawn from the MTP distribution p, accepted by min(1, q/p) with residual
    resampling: the samples follow the target's q exactly (chi-squared over all sequences)."""
    model, drafter = small_target(tmp_path, family, seed=2, sharpness=1.5, vocab=VOCAB)
    probs = exact_distribution(model, SAMPLING)
    assert abs(sum(probs.values()) - 1) < 1e-4 and max(probs.values()) < 0.5
    mx.random.seed(1234)
    counts, stats = Counter(), SpecStats()
    for _ in range(SAMPLES):
        out = speculative_tokens(
            MLXTarget(model, capture_layers=drafter.capture_layers, speculative=True), drafter,
            PROMPT, sampling=SAMPLING, max_tokens=LENGTH, num_draft=2, stats=stats)
        counts[tuple(t for t, _ in out)] += 1
    assert stats.accepted > SAMPLES / 20  # drafts were accepted, not only rejected
    pvalue = chi_squared_pvalue(counts, probs)
    assert pvalue > 0.001, f"p = {pvalue:.2g}"


def generate(*args):
    result = CliRunner().invoke(main, ["generate", "--no-chat-template", "-n", "24", "-p", TEXT,
                                       *args])
    return result


def test_cli_from_the_checkpoint_and_after_convert(hf_dir, tmp_path):
    """The Hugging Face directory drafts with its own MTP weights; `mlxspec convert` keeps them
    (mtp.safetensors, as published) and the converted model drafts the same; a directory
    converted without them gets the message, not a traceback."""
    base = generate("--model", str(hf_dir))
    assert base.exit_code == 0, base.output
    spec = generate("--model", str(hf_dir), "--drafter", "mtp", "--verbose")
    assert spec.exit_code == 0, spec.output
    assert spec.stdout == base.stdout
    assert int(re.search(r"drafted: (\d+)", spec.stderr)[1]) > 0, spec.stderr

    converted = tmp_path / "converted"
    result = CliRunner().invoke(main, ["convert", str(hf_dir), "--out", str(converted)])
    assert result.exit_code == 0, result.output
    assert (converted / "mtp.safetensors").is_file()
    again = generate("--model", str(converted), "--drafter", "mtp", "--verbose")
    assert again.exit_code == 0, again.output
    assert again.stdout == base.stdout and again.stderr.count("drafted") == 1

    (converted / "mtp.safetensors").unlink()
    refused = generate("--model", str(converted), "--drafter", "mtp")
    assert refused.exit_code != 0
    assert "converted without them" in refused.output and "Traceback" not in refused.output


def test_api_finds_the_modules_of_the_loaded_model(hf_dir):
    model, tokenizer = mlxspec.load(hf_dir)
    drafter = mlxspec.load_drafter("mtp", model=model, tokenizer=tokenizer)
    assert isinstance(drafter, MTPDrafter)
    prompt = tokenizer.encode(TEXT)
    want = [r.token for r in mlxspec.stream_generate(model, tokenizer, prompt, 16)]
    for source in (drafter, "mtp", "mtp+lookup"):
        got = [r.token for r in mlxspec.stream_generate(model, tokenizer, prompt, 16,
                                                        drafter=source)]
        assert got == want


def test_a_target_without_modules_is_refused_in_one_line(smollm_dir, tmp_path):
    refused = generate("--drafter", "mtp")
    assert refused.exit_code != 0 and "Traceback" not in refused.output
    assert "ships multi-token-prediction layers" in refused.output and "llama" in refused.output
    declared_none = write_deepseek_v3(tmp_path / "plain", mtp=False, tokenizer_dir=smollm_dir)
    refused = generate("--model", str(declared_none), "--drafter", "mtp")
    assert refused.exit_code != 0 and "declares no MTP layers" in refused.output


@pytest.mark.slow  # bench on SmolLM2
def test_bench_skips_mtp_on_a_target_without_modules_and_says_why(tmp_path):
    out = tmp_path / "report.json"
    result = CliRunner().invoke(main, [
        "bench", "--drafters", "none,mtp", "--suite", "humaneval", "--limit", "1",
        "--max-tokens", "4", "--temp", "0", "--no-mlx-lm", "--no-llama-cpp", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [r["drafter"] for r in report["results"]] == ["none"]
    skipped = [s for s in report["skipped"] if s["engine"] == "mlxspec mtp"]
    assert skipped and "ships multi-token-prediction layers" in skipped[0]["reason"]
    assert "Skipped: mlxspec mtp" in result.output


def test_bench_runs_mtp_beside_plain_on_a_target_with_modules(hf_dir, tmp_path):
    out = tmp_path / "report.json"
    result = CliRunner().invoke(main, [
        "bench", "--model", str(hf_dir), "--drafters", "none,mtp,mtp@2", "--suite", "humaneval",
        "--limit", "1", "--max-tokens", "6", "--temp", "0,1", "--no-mlx-lm", "--no-llama-cpp",
        "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    rows = [(r["drafter"], r["temp"]) for r in report["results"]]
    assert rows == [(d, t) for t in (0.0, 1.0) for d in ("none", "mtp", "mtp@2")]
    greedy = {r["tokens"] for r in report["results"] if r["temp"] == 0}
    assert len(greedy) == 1 and greedy.pop() > 0  # the same tokens, drafted or not
    assert not [s for s in report["skipped"] if s["engine"].startswith("mlxspec")]


def test_converting_keeps_the_published_tensors(hf_dir, tmp_path):
    """mtp.safetensors holds the checkpoint's MTP tensors unchanged (names and values), and
    model.safetensors none of them."""
    converted = tmp_path / "c"
    mlxspec.converters.convert(hf_dir, converted)
    source = mx.load(str(hf_dir / "model.safetensors"))
    kept = mx.load(str(converted / "mtp.safetensors"))
    config = json.loads((hf_dir / "config.json").read_text())
    from mlxspec.models.mtp import family_of, text_config

    family = family_of(config["model_type"])
    wanted = {k for k in source if family.owns(k, text_config(config))}
    assert set(kept) == wanted and wanted
    for k in wanted:
        assert mx.array_equal(kept[k], source[k]).item(), k
    names = set()
    for shard in converted.glob("model*.safetensors"):
        names |= set(mx.load(str(shard)))
    assert not any(family.owns(k, text_config(config)) for k in names)


def test_shipped_multi_module_checkpoints_cycle_their_modules(tmp_path, smollm_dir):
    """DeepSeek-style checkpoints may ship several modules (num_nextn_predict_layers > 1):
    depth j drafts with module j mod n, and output stays the target's."""
    path = write_deepseek_v3(tmp_path / "two", vocab=16, seed=4, sharpness=3.0)
    config = json.loads((path / "config.json").read_text())
    weights = mx.load(str(path / "model.safetensors"))
    n = config["num_hidden_layers"]
    for k in [k for k in weights if k.startswith(f"model.layers.{n}.")]:
        weights[k.replace(f"model.layers.{n}.", f"model.layers.{n + 1}.")] = weights[k] * 0.9
    config["num_nextn_predict_layers"] = 2
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    model, _ = load_checkpoint(path, lazy=False, action="load")
    drafter = load_mtp_drafter(path, model=model)
    assert drafter.num_modules == 2
    prompt = [1, 5, 3, 7, 2, 9, 4, 12, 5, 3]
    out, stats = run(model, drafter, prompt, 30, num_draft=3)
    assert out == plain(model, prompt, 30) and stats.drafted > 0
    shutil.rmtree(path)


# ---- Trees: EAGLE-2's dynamic tree grown by module 1 --------------------------------------------


@pytest.mark.parametrize("family", sorted(WRITERS))
@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temp=0.7)], ids=["greedy", "temp"])
def test_every_tree_candidate_scores_its_path_as_a_chain_does(tmp_path, family, sampling):
    """Each candidate's score (its path's log-probability, computed depth by depth for many
    nodes at once) equals a chain run down the same path: each tree entry saw only its
    ancestors, at its depth's RoPE position, through mlx-lm's own attention (MLA for
    DeepSeek)."""
    from test_eagle3_tree import candidate_path, chain_score

    path = WRITERS[family](tmp_path / family, vocab=16, seed=5, sharpness=2.0)
    model, _ = load_checkpoint(path, lazy=False, action="load")
    tokens = [1, 5, 3, 7, 2, 9, 4, 12, 5, 3]
    drafter = load_mtp_drafter(path, model=model, tree_budget=16, tree_width=3)
    drafter.begin(tokens, MLXTarget(model, capture_layers=drafter.capture_layers).prefill(tokens))
    scores, ids, parents = drafter.tree_candidates(tokens, 16, sampling)
    assert len(scores) == 3 + 5 * 9
    for c in range(len(scores)):
        chain = candidate_path(ids, parents, c)
        assert abs(scores[c] - chain_score(drafter, tokens, chain, sampling)) < 1e-4, (c, chain)


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_greedy_tree_output_is_the_targets(tmp_path, family):
    """DeepSeek's KV caches hold trees; Qwen3.5's recurrent layers do not, so its trees are
    verified as their first chain (counted), still losslessly."""
    model, _ = small_target(tmp_path, family)
    drafter = load_mtp_drafter(tmp_path / family, model=model, tree_budget=8, tree_width=3)
    prompt = [1, 5, 3, 7, 2, 9, 4, 12, 5, 3]
    out, stats = run(model, drafter, prompt, 30, num_draft=8)
    assert out == plain(model, prompt, 30) and stats.drafted > 0
    assert (stats.chain_fallback_steps > 0) == (family == "qwen3_5")


def test_chat_turns_with_mtp_reply_as_plain(hf_dir):
    """Two chat turns: the modules' caches start afresh each turn from the target's features of
    the whole conversation, and every reply is plain decoding's."""
    turns = "one two three\nfour five six one two\n/quit\n"
    replies = {}
    for drafter in ("none", "mtp"):
        result = CliRunner().invoke(main, ["chat", "--model", str(hf_dir), "--max-tokens", "12",
                                           "--drafter", drafter], input=turns)
        assert result.exit_code == 0, result.output
        replies[drafter] = result.stdout
    assert replies["mtp"] == replies["none"] and replies["none"].count(">> ") == 3
