"""Survey: does mlxspec decode every mlx-lm architecture exactly as mlx-lm does?

For each tiny random model of tests/architectures.py (CONFIGS), greedy (temperature 0):

  plain    mlxspec.stream_generate(drafter=None) vs mlx-lm's generate_step, same prompt
  lookup   drafter="lookup" on a prompt with repetition (so lookup drafts) vs mlx-lm
  window   drafter="lookup" on a prompt of 3x the model's sliding window (8 without one) plus
           repetition, vs mlx-lm; with the loop's drafted/accepted counts and target passes,
           which say whether speculation kept running past the window
  batch    mlxspec.batch_generate(drafter="lookup") on three prompts of different lengths, each
           row vs mlx-lm on that prompt alone

Each cell is "ok"; "near-tie" (at the first differing position mlx-lm's own top two logits,
from a full forward of the prefix, are within 1e-4); "WRONG@pos(gap)"; "REFUSED: message" (a
ValueError or SystemExit raised by mlxspec itself); "ERR: Type: message"; or, when the model
takes the worker process down or runs past --timeout, "CRASH: ..." / "TIMEOUT". The tiny
tokenizer's end-of-sequence token is t64, which a 64-token model never produces, so every output
runs --max-tokens tokens (with --eos-in-vocab it is t63, and outputs are compared up to it).

Each architecture runs in a worker process (a segfault costs one row, not the survey):

    .venv/bin/python scripts/architecture_survey.py                 # every architecture
    .venv/bin/python scripts/architecture_survey.py --only llama,gemma3_text --json /tmp/s.json
"""

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
CELLS = ("plain", "lookup", "window", "batch")
NEAR_TIE = 1e-4
DEFAULT_WINDOW = 8  # the "past the window" prompt length for models without one


# ------------------------------------------------------------------------------------ worker


def tiny_tokenizer(vocab: int):
    """A word-level tokenizer whose words are t0..t{vocab-1}; t{vocab-1} ends a sequence (as
    tests/test_api_hardening.py's). With `vocab` one more than the model's, the end-of-sequence
    token is one the model never produces: every generation runs its full length."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return TokenizerWrapper(PreTrainedTokenizerFast(
        tokenizer_object=words, eos_token=f"t{vocab - 1}", unk_token="t0"))


def repeat(pattern, length):
    return [pattern[i % len(pattern)] for i in range(length)]


def prompts(window):
    """The prompts of each cell; those of the batch are three of different lengths."""
    w = window or DEFAULT_WINDOW
    plain = [3, 14, 15, 9, 26, 53, 58, 9, 7, 9]
    lookup = repeat([5, 6, 7, 8, 9, 10, 11, 12], 19)
    past = repeat([21, 4, 33, 17, 40, 2], 3 * w + 5)
    return {"plain": plain, "lookup": lookup, "window": past,
            "batch": [[1, 2, 3, 4, 5], lookup, past]}


def refusal(error: BaseException) -> bool:
    """A ValueError / SystemExit raised by mlxspec's own code (a `raise` line in mlxspec/),
    not one MLX or mlx-lm threw on the way (shape errors are ValueErrors too)."""
    import mlxspec

    if isinstance(error, SystemExit):
        return True
    if not isinstance(error, ValueError):
        return False
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return False
    last = frames[-1]
    package = os.path.dirname(mlxspec.__file__)
    return last.filename.startswith(package) and "raise" in (last.line or "")


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else ""


class Survey:
    def __init__(self, model_type, max_tokens, eos_in_vocab=False):
        import mlx.core as mx
        from architectures import build, window

        self.mx = mx
        self.model_type = model_type
        self.max_tokens = max_tokens
        self.model = build(model_type)
        self.window = window(self.model)
        self.tokenizer = tiny_tokenizer(64 if eos_in_vocab else 65)
        self.eos = set(self.tokenizer.eos_token_ids)
        self.references = {}

    def reference(self, prompt):
        """mlx-lm's greedy tokens, up to (not including) the first end-of-sequence token."""
        from mlx_lm.generate import generate_step

        key = tuple(prompt)
        if key not in self.references:
            tokens = []
            for token, _ in generate_step(self.mx.array(prompt), self.model,
                                          max_tokens=self.max_tokens):
                token = int(token)
                if token in self.eos:
                    break
                tokens.append(token)
            self.references[key] = tokens
        return self.references[key]

    def gap(self, prefix) -> "tuple[float, int]":
        """mlx-lm's top-2 logit gap after `prefix` (one full forward, fresh caches), and its
        argmax there."""
        from mlx_lm.models.cache import make_prompt_cache

        mx = self.mx
        logits = self.model(mx.array([prefix]), cache=make_prompt_cache(self.model))
        last = logits[0, -1].astype(mx.float32)
        top = mx.sort(last)
        return (top[-1] - top[-2]).item(), int(mx.argmax(last).item())

    def grade(self, prompt, tokens) -> str:
        """ok, near-tie or WRONG@pos(gap). A WRONG is marked "[mlx-lm: one pass != decode at k/n]"
        when, at k of the reference's n positions, mlx-lm's own one-pass forward of the prefix
        picks another token than its token-by-token decode: that model's outputs depend on how
        its input is split into passes (plamo3's sliding mask is one position wider than its
        rotating cache, for one), so a verifier of several tokens per pass cannot be held to
        mlx-lm's decode token for token."""
        expected = self.reference(prompt)
        if tokens == expected:
            return "ok"
        pos = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b),
                   min(len(tokens), len(expected)))
        gap, _ = self.gap(list(prompt) + expected[:pos])
        if gap < NEAR_TIE:
            return "near-tie"
        split = self.split_dependent(prompt)
        note = f" [mlx-lm: one pass != decode at {len(split)}/{len(expected)}]" if split else ""
        return f"WRONG@{pos}({gap:.2g}){note}"

    def split_dependent(self, prompt) -> list:
        """Positions of mlx-lm's reference where one forward pass of prompt + the reference
        before it picks another token than the decode did."""
        expected = self.reference(prompt)
        return [i for i in range(len(expected))
                if self.gap(list(prompt) + expected[:i])[1] != expected[i]]

    def stream(self, prompt, drafter):
        import mlxspec

        responses = list(mlxspec.stream_generate(self.model, self.tokenizer, prompt,
                                                 max_tokens=self.max_tokens, drafter=drafter))
        last = responses[-1]
        tokens = [r.token for r in responses]
        if last.finish_reason == "stop":  # the end-of-sequence token is not output
            tokens = tokens[:-1]
        stats = {"drafted": last.drafted, "accepted": last.accepted,
                 "passes": last.target_passes, "tokens": len(tokens)}
        return tokens, stats

    def cell(self, name, prompt):
        if name == "batch":
            import mlxspec

            out = mlxspec.batch_generate(self.model, self.tokenizer, prompt,
                                         max_tokens=self.max_tokens, drafter="lookup")
            grades = [self.grade(p, list(t)) for p, t in zip(prompt, out.token_ids)]
            bad = [f"row{i}:{g}" for i, g in enumerate(grades) if g != "ok"]
            stats = {"drafted": sum(s.drafted for s in out.stats),
                     "accepted": sum(s.accepted for s in out.stats),
                     "passes": max((s.target_passes for s in out.stats), default=0),
                     "plain_fallback_steps": sum(s.plain_fallback_steps for s in out.stats)}
            return ("ok" if not bad else " ".join(bad)), stats
        tokens, stats = self.stream(prompt, None if name == "plain" else "lookup")
        return self.grade(prompt, tokens), stats


def worker(model_types, max_tokens, eos_in_vocab):
    """Survey each architecture, one JSON line per event on stdout."""
    sys.path.insert(0, TESTS)
    import mlxspec  # noqa: F401  (first: it preloads OpenBLAS before mlx)

    def emit(**event):
        print(json.dumps(event), flush=True)

    for model_type in model_types:
        start = time.perf_counter()
        emit(event="start", model=model_type)
        try:
            survey = Survey(model_type, max_tokens, eos_in_vocab)
        except Exception as error:  # noqa: BLE001
            emit(event="build", model=model_type, error=f"{type(error).__name__}: "
                 f"{one_line(error)}", seconds=time.perf_counter() - start)
            continue
        cases = prompts(survey.window)
        emit(event="build", model=model_type, window=survey.window,
             seconds=time.perf_counter() - start)
        for name in CELLS:
            t0 = time.perf_counter()
            stats = {}
            try:
                grade, stats = survey.cell(name, cases[name])
            except (Exception, SystemExit) as error:  # noqa: BLE001
                kind = "REFUSED" if refusal(error) else "ERR"
                grade = (f"REFUSED: {one_line(error)}" if kind == "REFUSED"
                         else f"ERR: {type(error).__name__}: {one_line(error)}")
            emit(event="cell", model=model_type, cell=name, grade=grade, stats=stats,
                 seconds=round(time.perf_counter() - t0, 2))
        references = {}
        for name in ("plain", "lookup", "window"):
            try:
                references[name] = survey.reference(cases[name])
            except Exception as error:  # noqa: BLE001
                references[name] = f"{type(error).__name__}: {one_line(error)}"
        tokens = [t for r in references.values() if isinstance(r, list) for t in r]
        emit(event="done", model=model_type, seconds=round(time.perf_counter() - start, 2),
             distinct=len(set(tokens)), references=references)


# ------------------------------------------------------------------------------------ parent


def run_all(model_types, max_tokens, timeout, eos_in_vocab=False):
    """Feed `model_types` to worker processes, restarting one after a crash or a timeout."""
    results = {m: {"model": m, "cells": {}} for m in model_types}
    pending = list(model_types)
    while pending:
        command = [sys.executable, os.path.abspath(__file__), "--worker",
                   "--max-tokens", str(max_tokens), "--only", ",".join(pending)]
        if eos_in_vocab:
            command.append("--eos-in-vocab")
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, cwd=ROOT)
        lines: "queue.Queue[str | None]" = queue.Queue()
        errors: list[str] = []

        def pump(stream, sink):
            for line in stream:
                sink(line)
            if stream is process.stdout:
                lines.put(None)

        threading.Thread(target=pump, args=(process.stdout, lines.put), daemon=True).start()
        threading.Thread(target=pump, args=(process.stderr, errors.append), daemon=True).start()
        current, started = pending[0], time.perf_counter()
        while True:
            try:
                line = lines.get(timeout=max(0.1, timeout - (time.perf_counter() - started)))
            except queue.Empty:
                process.kill()
                process.wait()
                fail(results[current], "TIMEOUT", time.perf_counter() - started)
                pending = pending[pending.index(current) + 1:]
                break
            if line is None:  # the worker ended
                process.wait()
                if current in pending:
                    code = process.returncode
                    tail = next((e.strip() for e in reversed(errors) if e.strip()), "")
                    why = f"signal {-code}" if code < 0 else f"exit {code}"
                    fail(results[current], f"CRASH: {why}" + (f" ({tail[:120]})" if tail else ""),
                         time.perf_counter() - started)
                    pending = pending[pending.index(current) + 1:]
                else:
                    pending = []
                break
            try:
                event = json.loads(line)
            except ValueError:
                continue
            model = event.get("model")
            row = results.get(model)
            if row is None:
                continue
            if event["event"] == "start":
                current, started = model, time.perf_counter()
                print(f"{model} ...", file=sys.stderr, flush=True)
            elif event["event"] == "build":
                row["window"] = event.get("window")
                row["build_seconds"] = round(event["seconds"], 2)
                if "error" in event:
                    row["build_error"] = event["error"]
                    for name in CELLS:
                        row["cells"][name] = {"grade": f"ERR(build): {event['error']}"}
                    pending.remove(model)
            elif event["event"] == "cell":
                row["cells"][event["cell"]] = {"grade": event["grade"], "stats": event["stats"],
                                               "seconds": event["seconds"]}
            elif event["event"] == "done":
                row["seconds"] = event["seconds"]
                row["distinct"] = event["distinct"]
                row["references"] = event["references"]
                pending.remove(model)
    return [results[m] for m in model_types]


def fail(row, grade, seconds):
    for name in CELLS:
        row["cells"].setdefault(name, {"grade": grade})
    row["seconds"] = round(seconds, 2)


def stats_note(cell):
    s = cell.get("stats") or {}
    if "drafted" not in s:
        return ""
    return f"d{s['drafted']}/a{s['accepted']}/p{s['passes']}"


def table(rows) -> str:
    out = ["| architecture | window | plain | lookup | past window | window stats "
           "(drafted/accepted/passes) | batch | distinct | s |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["cells"]
        out.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            r["model"], r.get("window") or "-", *(c.get(n, {}).get("grade", "?").replace("|", "/")
                                                 for n in ("plain", "lookup", "window")),
            stats_note(c.get("window", {})), c.get("batch", {}).get("grade", "?").replace("|", "/"),
            r.get("distinct", "-"), r.get("seconds", "-")))
    return "\n".join(out)


def kind(grade: str) -> str:
    for prefix in ("ok", "near-tie", "WRONG", "REFUSED", "ERR", "CRASH", "TIMEOUT"):
        if grade.startswith(prefix):
            return prefix
    return "WRONG" if "WRONG" in grade else ("near-tie" if "near-tie" in grade else "other")


def summary(rows) -> str:
    lines = []
    for name in CELLS:
        counts = {}
        for r in rows:
            k = kind(r["cells"].get(name, {}).get("grade", "?"))
            counts[k] = counts.get(k, 0) + 1
        lines.append(f"{name:7s} " + ", ".join(f"{k}: {v}" for k, v in sorted(
            counts.items(), key=lambda kv: (kv[0] != "ok", kv[0]))))
    windowed = [r for r in rows if r.get("window")]
    speculating = [r["model"] for r in windowed
                   if (r["cells"].get("window", {}).get("stats") or {}).get("drafted", 0) > 0]
    lines.append(f"past the window, speculation ran (drafted > 0) in {len(speculating)} of "
                 f"{len(windowed)} sliding-window architectures")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types (default: all of CONFIGS)")
    parser.add_argument("--json", help="write the results to this path")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds one architecture may take before it is killed")
    parser.add_argument("--eos-in-vocab", action="store_true",
                        help="end sequences at t63, a token the models can produce (as the "
                             "tests' tiny tokenizer); by default the end-of-sequence token is "
                             "t64, outside the 64-token vocabulary, so no generation stops early")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    sys.path.insert(0, TESTS)
    if args.worker:
        worker(args.only.split(","), args.max_tokens, args.eos_in_vocab)
        return
    import mlxspec  # noqa: F401
    from architectures import CONFIGS, SKIPPED

    model_types = list(CONFIGS)
    if args.only:
        wanted = [m.strip() for m in args.only.split(",") if m.strip()]
        unknown = [m for m in wanted if m not in CONFIGS]
        if unknown:
            sys.exit("not in CONFIGS: " + ", ".join(
                f"{m} (skipped: {SKIPPED[m]})" if m in SKIPPED else m for m in unknown))
        model_types = wanted
    start = time.perf_counter()
    rows = run_all(model_types, args.max_tokens, args.timeout, args.eos_in_vocab)
    total = time.perf_counter() - start
    print(table(rows))
    print()
    print(summary(rows))
    print(f"{len(rows)} architectures in {total:.0f} s; {len(SKIPPED)} skipped: "
          + ", ".join(sorted(SKIPPED)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"max_tokens": args.max_tokens, "eos_in_vocab": args.eos_in_vocab,
                       "seconds": round(total, 1),
                       "skipped": SKIPPED, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
