"""Hybrid-attention targets (Gated DeltaNet + attention) from a model directory, through the CLI
and the API: a tiny random Qwen3-Next built from mlx-lm's own class, saved in its checkpoint
layout with SmolLM2's tokenizer. Rollback itself is tested in test_rollback_property."""

import json
import re
import shutil

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten
from tiny_models import HYBRID_SIZES, tiny_qwen3_next

import mlxspec
from mlxspec.cli.main import main

PROMPT = "one two three one two three one two three one two"


@pytest.fixture(scope="module")
def hybrid_dir(smollm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_next")
    model = tiny_qwen3_next(vocab=49152, seed=5)
    config = {**vars(model.args), **HYBRID_SIZES}
    (out / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    for f in smollm_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def generate(*args):
    result = CliRunner().invoke(main, ["generate", "--no-chat-template", "-n", "24", *args])
    assert result.exit_code == 0, result.output
    return result


@pytest.mark.parametrize("drafter", ["lookup", "dflash"])
def test_cli_drafters_on_a_hybrid_target_are_lossless(hybrid_dir, drafter, tmp_path):
    """`--drafter none` used to fail ('ArraysCache' object has no attribute 'offset') and every
    other drafter was refused."""
    plain = generate("--model", str(hybrid_dir), "-p", PROMPT)
    options = ["--drafter", drafter, "--fixed-k", "--verbose"]
    if drafter == "dflash":
        from test_dflash import drafter_config, random_weights, save_drafter

        config = drafter_config(vocab=49152, hidden=32, target_layers=4, num_hidden_layers=1,
                                layer_types=["full_attention"], block_size=6, mask_token_id=0,
                                target_layer_ids=[0, 1, 3])
        options += ["--drafter-model", str(save_drafter(tmp_path, config,
                                                        random_weights(config)))]
    spec = generate("--model", str(hybrid_dir), "-p", PROMPT, *options)
    assert spec.stdout == plain.stdout
    drafted = int(re.search(r"drafted: (\d+)", spec.stderr)[1])
    assert drafted > 0, spec.stderr


def test_api_chat_turns_on_a_hybrid_target_keep_the_state(hybrid_dir):
    """A turn that extends the conversation the cache holds prefills only its new tokens on top
    of the kept recurrent state; one that does not (its recurrent state cannot be cut back to a
    shared prefix) starts afresh. Replies are the ones without a cache either way."""
    model, tokenizer = mlxspec.load(hybrid_dir)
    cache = mlxspec.PromptCache()
    prompt = tokenizer.encode(PROMPT)
    for turn in range(3):
        kept = [r.token for r in mlxspec.stream_generate(model, tokenizer, prompt, 12,
                                                         drafter="lookup", prompt_cache=cache)]
        fresh = [r.token for r in mlxspec.stream_generate(model, tokenizer, prompt, 12)]
        assert kept == fresh
        assert cache.tokens == (prompt + kept)[: len(cache.tokens)]
        assert len(cache.tokens) >= len(prompt)  # kept for the next turn
        held = len(cache.tokens)
        prompt = prompt + kept + tokenizer.encode(" three one two")
        assert cache.take(model, prompt) is cache.cache and len(cache.tokens) == held
    diverging = tokenizer.encode(PROMPT + " four")
    before = cache.cache
    list(mlxspec.stream_generate(model, tokenizer, diverging, 4, prompt_cache=cache))
    assert cache.cache is not before  # rebuilt: a recurrent state cannot be cut back


def test_bench_runs_on_a_hybrid_target(hybrid_dir, tmp_path):
    """`mlxspec bench` measures what verifying n tokens costs by undoing each pass: a recurrent
    state is put back rather than trimmed (it used to fail with "'ArraysCache' object has no
    attribute 'trim'")."""
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(main, [
        "bench", "--model", str(hybrid_dir), "--drafters", "none,lookup", "--suite", "copy",
        "--limit", "1", "-n", "8", "--no-mlx-lm", "--no-llama-cpp", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert set(report["verify_cost"]) == {"1", "2", "4", "8", "16"}
    assert report["verify_cost"]["1"] == 1.0


def test_a_dflash_drafter_for_another_hybrid_is_refused_naming_both_sides(tmp_path):
    """A z-lab-style drafter config for a Qwen3.5 target is checked against the hybrid target it
    is given (hidden size, layer count, layer ids, mask token), before any compute."""
    from test_dflash import drafter_config, random_weights, save_drafter
    from tiny_models import tiny_qwen3_5

    from mlxspec.drafters.dflash import load_dflash_drafter

    model = tiny_qwen3_5(vocab=64, seed=1)
    config = drafter_config(vocab=64, hidden=32, target_layers=6, num_hidden_layers=1,
                            layer_types=["full_attention"], block_size=4, mask_token_id=70,
                            target_layer_ids=[0, 5])
    path = save_drafter(tmp_path, config, random_weights(config))
    with pytest.raises(ValueError) as refused:
        load_dflash_drafter(path, model=model)
    message = str(refused.value)
    for part in ("num_target_layers 6, target has 4", "[5]", "mask_token_id: drafter 70"):
        assert part in message, message
