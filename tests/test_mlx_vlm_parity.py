"""Parity with a peer nobody here wrote: mlx-vlm 0.7.10's DFlash speculative decoding on a hybrid
(qwen3_5: Gated DeltaNet layers between attention layers) target.

scripts/make_mlx_vlm_hybrid_fixtures.py, run in mlx-vlm's own venv, wrote tiny random target and
drafter weights and recorded what mlx-vlm generates greedily with them: plain, with its DFlash
round loop (fixed block size, and its own adaptive block sizing), and how many drafts each round
accepted. Here the same files load unchanged (mlx-lm's qwen3_5 for the target, our DFlash loader
for the drafter, z-lab's layout for both engines) and must give the same tokens, with and without
the drafter, through the API and the CLI.

mlx-vlm's first token comes from its prefill step; its rounds start after it. Ours start at the
last prompt token, so the rounds line up when our loop is given that first token as the end of
its prompt: then each step must draft and accept what mlx-vlm's round did (same target, same
drafter, same context: same drafts, same verdict), which checks the recurrent state after every
rollback, not just the final text.
"""

import json
import re
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner

import mlxspec
from mlxspec.cli.main import main
from mlxspec.drafters.dflash import load_dflash_drafter

FIXTURES = Path(__file__).parent / "fixtures" / "mlx_vlm_hybrid"
TARGET, DRAFTER = FIXTURES / "target", FIXTURES / "drafter"
REFERENCE = json.loads((FIXTURES / "reference.json").read_text())
CASES = REFERENCE["cases"]
MAX_TOKENS = REFERENCE["max_tokens"]


@pytest.fixture(scope="module")
def target():
    return mlxspec.load(TARGET)


def dflash(model, case):
    return load_dflash_drafter(DRAFTER, model=model, block_size=case["block_size"])


def tokens_of(model, tokenizer, prompt, max_tokens=MAX_TOKENS, **options):
    return [r.token for r in mlxspec.stream_generate(model, tokenizer, prompt, max_tokens,
                                                     **options)]


def test_fixture_is_what_mlx_vlm_produced():
    """The reference is self-consistent: mlx-vlm's speculative tokens equal its plain ones."""
    assert REFERENCE["made_with"]["mlx_vlm"] == "0.7.10"
    for case in CASES:
        assert case["speculative"] == case["plain"] == case["speculative_adaptive_blocks"]
        assert len(case["plain"]) == MAX_TOKENS
        assert sum(case["accept_lens"]) > 0  # some drafts were accepted, most rolled back
    assert any(max(c["accept_lens"]) == c["block_size"] - 1 for c in CASES)  # a full block too


def test_target_log_probs_equal_mlx_vlm(target):
    """The same weights give the same numbers, not just the same argmax: mlx-lm's qwen3_5 (one
    pass over prompt + output) against mlx-vlm's (prefill, then one token at a time)."""
    model, _ = target
    case = CASES[0]
    reference = mx.load(str(FIXTURES / "reference.safetensors"))["plain_logprobs_0"]
    tokens = case["prompt"] + case["plain"][:-1]
    logits = model(mx.array([tokens]))[0, len(case["prompt"]) - 1 :].astype(mx.float32)
    ours = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    difference = mx.abs(ours - reference).max().item()
    # Far below the smallest gap between the top two tokens: equal tokens are not luck.
    assert difference < 5e-4 < case["min_top2_logprob_margin"] / 10, difference


@pytest.mark.parametrize("case", CASES, ids=[f"prompt{i}" for i in range(len(CASES))])
def test_greedy_tokens_equal_mlx_vlm(target, case):
    """Ours plain, ours with the drafter (fixed K = block - 1, and adaptive K) and mlx-vlm's."""
    model, tokenizer = target
    expected = case["speculative"]
    assert tokenizer.encode(case["text"]) == case["prompt"]
    assert tokens_of(model, tokenizer, case["prompt"]) == expected
    fixed = tokens_of(model, tokenizer, case["prompt"], drafter=dflash(model, case),
                      adaptive=False)
    assert fixed == expected
    text = mlxspec.generate(model, tokenizer, case["prompt"], MAX_TOKENS,
                            drafter=dflash(model, case))  # adaptive K, the default
    assert text == tokenizer.decode(expected)


@pytest.mark.parametrize("case", CASES, ids=[f"prompt{i}" for i in range(len(CASES))])
def test_each_round_accepts_what_mlx_vlm_accepted(target, case):
    model, tokenizer = target
    drafter = dflash(model, case)
    rounds = []
    commit = drafter.commit

    def recording_commit(tokens, verdict):
        rounds.append((len(verdict.draft_tokens), verdict.accepted))
        commit(tokens, verdict)

    drafter.commit = recording_commit
    first, rest = case["speculative"][0], case["speculative"][1:]
    # max_tokens = MAX_TOKENS, not MAX_TOKENS - 1: our loop drafts at most max_tokens - produced - 1
    # (no draft past the end), mlx-vlm's one more, so this makes each step draft what its round
    # did; our extra last token (a plain step) is past mlx-vlm's output.
    produced = tokens_of(model, tokenizer, case["prompt"] + [first], MAX_TOKENS, drafter=drafter,
                         adaptive=False)
    assert produced[: len(rest)] == rest
    mlx_vlm_rounds = list(zip(case["draft_lens"], case["accept_lens"]))
    assert rounds[: len(mlx_vlm_rounds)] == mlx_vlm_rounds
    assert all(drafted == 0 for drafted, _ in rounds[len(mlx_vlm_rounds) :])


def test_cli_generate_equals_mlx_vlm():
    case = CASES[0]
    result = CliRunner().invoke(main, [
        "generate", "--model", str(TARGET), "--drafter", "dflash", "--draft-model", str(DRAFTER),
        "--no-chat-template", "--fixed-k", "-n", str(MAX_TOKENS), "-p", case["text"], "--verbose",
    ])
    assert result.exit_code == 0, result.output
    _, tokenizer = mlxspec.load(TARGET)
    assert result.stdout == tokenizer.decode(case["speculative"]) + "\n"
    drafted = int(re.search(r"drafted: (\d+)", result.stderr)[1])
    accepted = int(re.search(r"accepted: (\d+)", result.stderr)[1])
    assert drafted > accepted > 0, result.stderr


def test_benchmark_against_mlx_vlm_runs_our_side(tmp_path):
    """benchmarks/hybrid_vs_mlx_vlm.py reaches into MLXTarget (recording off for its baseline):
    its own half runs at a tiny size, so a change there shows here, not on the day it is run."""
    import importlib.util

    path = Path(__file__).parents[1] / "benchmarks" / "hybrid_vs_mlx_vlm.py"
    spec = importlib.util.spec_from_file_location("hybrid_vs_mlx_vlm", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.write_target(tmp_path, hidden=32, layers=4, vocab=64)
    result = bench.measure_ours(tmp_path, [1, 4], context=8, repeats=1)
    assert [(r["k"], r["rejected"]) for r in result["rows"]] == [(1, 1), (4, 4), (4, 2)]
    assert all(r["verify_ms"] > 0 and r["rollback_ms"] > 0 for r in result["rows"])
    assert "| 4 | 2 | mlxspec |" in bench.table([result])
