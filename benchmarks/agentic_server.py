"""The agentic suite through `mlxspec serve`: suffix decoding against prompt lookup, plain
decoding and a model drafter (DFlash, alone and behind suffix), on coding-agent conversations
that repeat their tool-call structure across requests (mlxspec.prompts.agentic_sessions: real
code from HumanEval and ShareGPT, three requests a session, each the conversation so far with
the agent's own earlier replies).

Each configuration gets a fresh server process (`mlxspec serve --drafter D --max-batch 4`, the
embedded SmolLM2-135M-Instruct fp32, OpenBLAS preloaded, loopback), so no drafter learns from
another's run: suffix's history starts empty and fills with this run's replies only. Per level:
  1 client:  the sessions one after another, each request after the last;
  4 clients: the same sessions split over 4 closed-loop clients.
Greedy, --max-tokens per request. Throughput = completion tokens / wall time; at 1 client,
each configuration against plain per session (paired bootstrap over sessions, tokens per second
of the session's requests). Every reply is compared with plain's (greedy: the same text).

    .venv/bin/python benchmarks/agentic_server.py --out docs/results/agentic-server-cpu.json
    .venv/bin/python benchmarks/agentic_server.py --sessions 2 --max-tokens 16 \\
        --drafters none,suffix --levels 1   # a smoke run
"""

import argparse
import json
import platform
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlxspec  # before anything imports mlx.core: binds MLX to OpenBLAS
from mlxspec.intervals import paired_ratio
from mlxspec.loading import resolve_model_dir
from mlxspec.prompts import agentic_sessions

sys.path.insert(0, str(Path(__file__).parent))
from server_batching import Process, client, version  # noqa: E402

DRAFTERS = ("none", "lookup", "suffix", "dflash", "dflash+suffix")


def run_session(api, model: str, session, max_tokens: int) -> list[dict]:
    """The session's three requests in order; each reply joins the next request."""
    replies, out = [], []
    for _ in session.turns():
        start = time.perf_counter()
        reply = api.chat.completions.create(model=model, messages=session.messages(replies),
                                            max_tokens=max_tokens, temperature=0)
        seconds = time.perf_counter() - start
        text = reply.choices[0].message.content or ""
        extra = (reply.usage.model_extra or {}).get("mlxspec", {})
        out.append({"tokens": reply.usage.completion_tokens, "seconds": seconds,
                    "target_passes": extra.get("target_passes"), "text": text})
        replies.append(text)
    return out


def run_level(url: str, sessions, clients: int, max_tokens: int) -> dict:
    api = client(url, timeout=900)
    model = api.models.list().data[0].id
    results: list = [None] * len(sessions)
    lock = threading.Lock()
    order = iter(range(len(sessions)))

    def worker(_):
        while True:
            with lock:
                index = next(order, None)
            if index is None:
                return
            results[index] = run_session(api, model, sessions[index], max_tokens)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(worker, range(clients)))
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for s in results for r in s)
    passes = [r["target_passes"] for s in results for r in s]
    return {"clients": clients, "wall_s": wall, "tokens": tokens, "throughput_tps": tokens / wall,
            "tau": tokens / sum(passes) if all(passes) else None, "sessions": results}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--drafters", default=",".join(DRAFTERS))
    parser.add_argument("--levels", default="1,4")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model_dir = str(resolve_model_dir(args.model))
    sessions = agentic_sessions(args.sessions)
    levels = [int(c) for c in args.levels.split(",")]
    mlxspec_bin = str(Path(sys.executable).with_name("mlxspec"))
    report = {"model": model_dir, "sessions": len(sessions), "max_tokens": args.max_tokens,
              "machine": platform.platform(), "mlxspec": version("mlxspec"),
              "blas": mlxspec.blas_in_use(), "runs": {}}
    for drafter in args.drafters.split(","):
        for clients in levels:
            proc = Process([mlxspec_bin, "serve", "--model", model_dir, "--drafter", drafter,
                            "--max-batch", str(max(levels)), "--port", "{port}"], 300)
            try:
                api = client(proc.url, 60)
                api.chat.completions.create(model=api.models.list().data[0].id, max_tokens=4,
                                            messages=[{"role": "user", "content": "Hello"}])
                result = run_level(proc.url, sessions, clients, args.max_tokens)
            finally:
                proc.stop()
            report["runs"].setdefault(drafter, {})[str(clients)] = result
            print(f"{drafter} @ {clients} clients: {result['throughput_tps']:.1f} tok/s, "
                  f"tau {result['tau'] or 0:.2f}, {result['wall_s']:.0f} s", flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(summarise(report), indent=1))
    print(json.dumps(summarise(report)["summary"], indent=1))


def summarise(report: dict) -> dict:
    """Per configuration and level: throughput and its ratio to plain's, the same-text count,
    and at each level the per-session paired ratio to plain and to lookup."""
    runs, summary = report["runs"], {}
    for drafter, levels in runs.items():
        for clients, result in levels.items():
            row = {"throughput_tps": result["throughput_tps"], "tau": result["tau"]}
            for base in ("none", "lookup"):
                other = runs.get(base, {}).get(clients)
                if other is None or base == drafter:
                    continue
                row[f"vs_{base}"] = result["throughput_tps"] / other["throughput_tps"]
                mine = [(sum(r["tokens"] for r in s), sum(r["seconds"] for r in s))
                        for s in result["sessions"]]
                theirs = [(sum(r["tokens"] for r in s), sum(r["seconds"] for r in s))
                          for s in other["sessions"]]
                row[f"per_session_vs_{base}"] = paired_ratio(
                    ([m[0] for m in mine], [m[1] for m in mine]),
                    ([t[0] for t in theirs], [t[1] for t in theirs]))
                if base == "none":
                    row["same_text"] = sum(
                        a["text"] == b["text"]
                        for s, t in zip(result["sessions"], other["sessions"])
                        for a, b in zip(s, t))
                    row["replies"] = sum(len(s) for s in result["sessions"])
            summary.setdefault(drafter, {})[clients] = row
    return {**report, "summary": summary}


if __name__ == "__main__":
    main()
