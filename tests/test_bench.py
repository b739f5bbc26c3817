"""`mlxspec bench` end to end on the real model, tiny settings: structure, not speed."""

import json

import pytest
from click.testing import CliRunner

from mlxspec.cli.main import main

pytestmark = pytest.mark.slow


def test_bench_writes_results_table_and_plot(smollm_dir, tmp_path):
    """lookup at a fixed K: the adaptive K follows measured step times, so whether 8 tokens get a
    draft would depend on the machine's speed (CI drafted none where this machine drafted)."""
    out, md, png = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.png"
    result = CliRunner().invoke(main, [
        "bench", "--model", str(smollm_dir), "--drafters", "none,lookup@4", "--suite", "copy",
        "--temp", "0,1", "--limit", "1", "--max-tokens", "8", "--out", str(out),
        "--markdown", str(md), "--plot", str(png),
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert "OpenBLAS" in report["machine"]["blas"] or "reference" in report["machine"]["blas"]
    rows = {(r["engine"], r["drafter"], r["temp"]): r for r in report["results"]}
    assert set(rows) == {(e, d, t) for e, d in [("mlxspec", "none"), ("mlxspec", "lookup@4"),
                                                 ("mlx-lm", "none")] for t in (0.0, 1.0)}
    for (engine, drafter, _), r in rows.items():
        assert r["tokens"] > 0 and r["tps"] > 0
        if drafter == "none":
            assert r["speedup"] == pytest.approx(1.0)
    assert rows["mlxspec", "lookup@4", 0.0]["drafted"] > 0  # the copy suite gives lookup matches
    assert "| copy | 0 | mlxspec | lookup@4 |" in md.read_text()
    assert png.stat().st_size > 1000
    # A model loaded from a directory has no GGUF for llama.cpp: reported, not faked.
    assert {"engine": "llama.cpp", "reason": "no GGUF file for this model (give one with "
            "--llama-cpp-gguf)"} in report["skipped"]
    assert "Skipped: llama.cpp" in md.read_text()


def test_bench_dflash_and_lookup_with_full_vocab(smollm_dir, tmp_path):
    """The combined drafter under its own name, adaptive and at a fixed K, with a DFlash option;
    tau's interval over prompts and a paired comparison."""
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    result = CliRunner().invoke(main, [
        "bench", "--model", str(smollm_dir), "--drafters",
        "none,dflash+lookup,dflash+lookup@4,lookup,lookup:lookup-branches=3",
        "--full-vocab", "--no-mlx-lm", "--no-llama-cpp", "--suite", "copy", "--limit", "2",
        "--max-tokens", "12", "--compare", "dflash+lookup@4/none", "--out", str(out),
        "--markdown", str(md),
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    rows = {r["drafter"]: r for r in report["results"]}
    assert set(rows) == {"none", "dflash+lookup", "dflash+lookup@4", "lookup",
                         "lookup:lookup-branches=3"}
    # a label's own option: the branched lookup drafts trees, the plain one chains
    assert rows["lookup:lookup-branches=3"]["tau"] >= 1.0
    fixed = rows["dflash+lookup@4"]
    assert fixed["accepted"] > 0  # the copy prompts repeat their text
    assert len(fixed["passes_per_prompt"]) == 2 and sum(fixed["passes_per_prompt"]) == fixed["target_passes"]
    low, high = fixed["tau_interval"]
    assert low <= fixed["tau"] <= high
    assert rows["none"]["tau_interval"] == [1.0, 1.0]
    (comparison,) = report["comparisons"]
    assert comparison["ratio"] == pytest.approx(fixed["tau"]) and comparison["prompts"] == 2
    assert comparison["b_higher"] == 0
    assert comparison["speed_ratio"] == pytest.approx(fixed["speedup"])  # tok/s over plain's
    low, high = comparison["speed_interval"]
    assert low <= comparison["speed_ratio"] <= high and fixed["speedup_interval"] == [low, high]
    assert rows["none"]["speedup_interval"] == [1.0, 1.0]
    assert "copy T=0, dflash+lookup@4 / none: tau " in md.read_text()


def test_bench_llama_cpp_peer_on_the_same_gguf(smollm_dir, tmp_path):
    """llama.cpp plain and prompt lookup on the default model's GGUF, same prompts as ours; where
    llama-cpp-python is not installed the report says so instead."""
    from mlxspec.loading import default_gguf_path
    from mlxspec.peers import llama_cpp_missing

    out = tmp_path / "r.json"
    result = CliRunner().invoke(main, [
        "bench", "--model", str(smollm_dir), "--llama-cpp-gguf", str(default_gguf_path()),
        "--drafters", "none", "--no-mlx-lm", "--suite", "copy", "--limit", "1",
        "--max-tokens", "24", "--out", str(out),
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    missing = llama_cpp_missing()
    rows = {(r["engine"], r["drafter"]): r for r in report["results"]}
    if missing:
        assert {"engine": "llama.cpp", "reason": missing} in report["skipped"]
        assert set(rows) == {("mlxspec", "none")}
        return
    assert set(rows) == {("mlxspec", "none"), ("llama.cpp", "none"), ("llama.cpp", "lookup")}
    plain, lookup = rows["llama.cpp", "none"], rows["llama.cpp", "lookup"]
    assert plain["tokens"] == 23 and plain["tau"] == pytest.approx(1.0)
    assert plain["speedup"] == pytest.approx(1.0)
    assert lookup["tokens"] == 23 and lookup["tau"] > 1.0  # the copy prompt repeats its text


def test_bench_rejects_unknown_suite_and_missing_draft_model():
    runner = CliRunner()
    result = runner.invoke(main, ["bench", "--suite", "nope"])
    assert result.exit_code != 0 and "unknown suite" in result.output
    for drafters in ("none,draft", "none,draft+lookup@2"):
        result = runner.invoke(main, ["bench", "--drafters", drafters])
        assert result.exit_code != 0 and "--draft-model" in result.output
    result = runner.invoke(main, ["bench", "--llama-cpp-gguf", "/no/such.gguf"])
    assert result.exit_code != 0 and "does not exist" in result.output
    for pair in ("lookup/dflash", "lookup", "none/lookup/none"):  # before any model loads
        result = runner.invoke(main, ["bench", "--drafters", "none,lookup", "--compare", pair])
        assert result.exit_code != 0 and "two of --drafters" in result.output


def test_bench_overhead_splits_a_step_and_compares_with_mlx_lm(smollm_dir, tmp_path):
    """`bench --overhead`: every drafter, passes queued ahead and one at a time, on the tiny
    target with the model's tokenizer; the parts of a step add up to its wall time."""
    out, md, png = tmp_path / "o.json", tmp_path / "o.md", tmp_path / "o.png"
    result = CliRunner().invoke(main, [
        "bench", "--overhead", "--model", str(smollm_dir), "--drafters",
        "none,lookup@3,draft@2,dflash+lookup@4", "--suite", "humaneval", "--limit", "2",
        "--max-tokens", "12", "--out", str(out), "--markdown", str(md), "--plot", str(png),
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["settings"]["target"]["vocab_size"] == 49152
    rows = {(r["drafter"], r["overlap"]): r for r in report["rows"]}
    assert set(rows) == {(d, o) for d in ("none", "lookup@3", "draft@2", "dflash+lookup@4")
                         for o in (True, False)}
    for r in rows.values():
        step = r["step_ms"]
        assert r["tokens"] > 0 and step["wall"] > 0 and step["queued"] > 0
        assert step["queued"] + step["waited"] + step["other"] == pytest.approx(step["wall"])
        assert r["vs_mlx_lm"] > 0 and len(r["vs_mlx_lm_interval"]) == 2
    assert report["mlx_lm"]["ms_per_token"] > 0
    assert "| none | queued ahead |" in md.read_text() and png.stat().st_size > 1000


@pytest.mark.parametrize("options, words", [
    (["--temp", "1"], "--overhead runs greedy"),
    (["--backend", "torch"], "measures the MLX loop"),
])
def test_bench_overhead_refuses_what_it_does_not_measure(options, words):
    result = CliRunner().invoke(main, ["bench", "--overhead", *options])
    assert result.exit_code == 2 and words in result.output


def test_the_agentic_suite_is_three_step_tool_sessions_on_real_code():
    """mlxspec.prompts.agentic_sessions: HumanEval and ShareGPT code alternating, the same system
    prompt and steps in each session, each request the conversation so far."""
    from mlxspec.prompts import AGENT_SYSTEM, agentic_sessions

    sessions = agentic_sessions(4)
    assert len(sessions) == 4 and sessions == agentic_sessions(4)  # the same every time
    assert [s.path.startswith("src/pasted_") for s in sessions] == [False, True, False, True]
    assert "def " in sessions[0].code and sessions[0].failure.startswith("assert")
    first = sessions[1].messages([])
    assert [m["role"] for m in first] == ["system", "user"]
    assert first[0]["content"] == AGENT_SYSTEM and sessions[1].path in first[1]["content"]
    last = sessions[1].messages(["{read}", "{write}"])
    assert [m["role"] for m in last] == ["system", "user", "assistant", "user", "assistant",
                                         "user"]
    assert sessions[1].code in last[3]["content"] and "run_tests" in last[5]["content"]


def test_long_context_suites_fill_their_window_with_real_code(smollm):
    """long1k/4k/8k: a module of HumanEval functions then a request, each prompt (in the chat
    template) within its window less the answer room and most of it, the three kinds of
    request in turn, a different module for each prompt."""
    from mlxspec.bench import chat_prompt, suite_chat_prompts
    from mlxspec.generate import encode_prompt
    from mlxspec.prompts import ANSWER_ROOM, LONG_CONTEXT_SIZES

    model, tokenizer = smollm
    prompts = suite_chat_prompts(model, tokenizer, list(LONG_CONTEXT_SIZES), 3, 128)
    for suite, size in LONG_CONTEXT_SIZES.items():
        lengths = [len(encode_prompt(tokenizer, p)) for p in prompts[suite]]
        assert all(0.8 * size < n <= size - ANSWER_ROOM for n in lengths), (suite, lengths)
        assert len(set(prompts[suite])) == 3
        asks = [p.rsplit("```", 1)[1] for p in prompts[suite]]
        assert "Rewrite" in asks[0] and "Rewrite" in asks[1] and "combined" in asks[2]
        first = asks[0].split("`")[1]
        assert prompts[suite][0].index(f"def {first}(") < 300  # at the module's far end
    assert chat_prompt(tokenizer, "x") != prompts["long1k"][0]


def test_a_long_suite_past_the_window_is_refused_in_one_line(smollm_dir):
    """SmolLM2's window is 8192 tokens: long8k with a 300-token answer cannot fit."""
    result = CliRunner().invoke(main, ["bench", "--model", str(smollm_dir), "--suite", "long8k",
                                       "--limit", "1", "-n", "300", "--drafters", "none"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "suite long8k: a prompt of" in result.output
    assert "exceeds the model's context window of 8192 tokens" in result.output


def test_prefill_once_shares_each_prompt_s_prefill_and_changes_no_result(smollm, smollm_dir,
                                                                         tmp_path, monkeypatch):
    """--prefill-once: per prompt, one prefill per set of target layers the drafters read
    (plain's and lookup's none, DFlash's), where each run otherwise prefills its own; the
    tokens, passes and accepts of every run are those of runs that prefilled themselves."""
    import mlxspec
    from mlxspec.backends.mlx.target import MLXTarget
    from mlxspec.bench import run_benchmark, suite_chat_prompts
    from mlxspec.generate import encode_prompt

    model, tokenizer = smollm
    prefilled = []
    prefill = MLXTarget.prefill

    def counting(self, tokens, held=None):
        before = self.offset
        features = prefill(self, tokens, held)
        prefilled.append(self.offset - before)
        return features

    monkeypatch.setattr(MLXTarget, "prefill", counting)
    prompts = suite_chat_prompts(model, tokenizer, ["copy"], 2, 12)
    drafters = {"none": None, "lookup@4": mlxspec.load_drafter("lookup", model=model, tokenizer=tokenizer),
                "dflash@4": mlxspec.load_drafter("dflash", model=model, tokenizer=tokenizer,
                                                 draft_vocab=False)}
    reports = {}
    for once in (False, True):
        prefilled.clear()
        reports[once] = run_benchmark(
            model, tokenizer, drafters=drafters, suites=["copy"], temps=[0.0], max_tokens=12,
            limit=2, with_mlx_lm=False, with_llama_cpp=False, prompts_by_suite=prompts,
            prefill_once=once, progress=lambda line: None)
        lengths = [len(encode_prompt(tokenizer, p)) - 1 for p in prompts["copy"]]
        runs = prefilled[-6:]  # the warm-up's come first
        assert runs == ([n for n in lengths for _ in range(3)] if not once else
                        [n for n in lengths for n in (n, 0, n)])
    for a, b in zip(*(reports[once]["results"] for once in (False, True))):
        assert a["drafter"] == b["drafter"]
        for key in ("tokens_per_prompt", "passes_per_prompt", "accepted_per_prompt"):
            assert a[key] == b[key], (a["drafter"], key)
    assert reports[True]["settings"]["prefill_once"] is True
    assert sum(reports[True]["results"][2]["accepted_per_prompt"]) > 0

    out = tmp_path / "r.json"
    result = CliRunner().invoke(main, [
        "bench", "--model", str(smollm_dir), "--drafters", "none,lookup@4", "--suite", "copy",
        "--limit", "1", "-n", "8", "--no-mlx-lm", "--no-llama-cpp", "--prefill-once",
        "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["settings"]["prefill_once"] is True
    assert "prefilled once for all our runs" in result.output
