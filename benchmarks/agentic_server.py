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
With --repeats R every configuration runs R times, the drafters' order reversed on every other
repeat (a machine drifting over the run favours none of them); a level's throughput is then
all its repeats' tokens over their wall time, and the paired intervals run over (session,
repeat) pairs, so they hold the run-to-run spread of continuous batching's arrival order.

    .venv/bin/python benchmarks/agentic_server.py --out docs/results/agentic-server-cpu.json
    .venv/bin/python benchmarks/agentic_server.py --sessions 2 --max-tokens 16 \\
        --drafters none,suffix --levels 1   # a smoke run
    .venv/bin/python benchmarks/agentic_server.py --plot-only docs/results/agentic-server-cpu.json
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


def run_config(mlxspec_bin: str, model_dir: str, drafter: str, max_batch: int, sessions,
               clients: int, max_tokens: int) -> dict:
    """One level on a fresh server: no drafter learns from another's run."""
    proc = Process([mlxspec_bin, "serve", "--model", model_dir, "--drafter", drafter,
                    "--max-batch", str(max_batch), "--port", "{port}"], 300)
    try:
        api = client(proc.url, 60)
        api.chat.completions.create(model=api.models.list().data[0].id, max_tokens=4,
                                    messages=[{"role": "user", "content": "Hello"}])
        return run_level(proc.url, sessions, clients, max_tokens)
    finally:
        proc.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--drafters", default=",".join(DRAFTERS))
    parser.add_argument("--levels", default="1,4")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default=None, help="the report (JSON); a .png beside it")
    parser.add_argument("--plot-only", default=None, metavar="JSON",
                        help="draw an earlier report's plot (JSON path -> .png) and stop")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.plot_only).read_text()), Path(args.plot_only).with_suffix(".png"))
        return
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    model_dir = str(resolve_model_dir(args.model))
    sessions = agentic_sessions(args.sessions)
    levels = [int(c) for c in args.levels.split(",")]
    mlxspec_bin = str(Path(sys.executable).with_name("mlxspec"))
    report = {"model": model_dir, "sessions": len(sessions), "max_tokens": args.max_tokens,
              "machine": platform.platform(), "mlxspec": version("mlxspec"),
              "blas": mlxspec.blas_in_use(), "runs": {}}
    drafters = args.drafters.split(",")
    for repeat in range(args.repeats):
        for drafter in drafters if repeat % 2 == 0 else drafters[::-1]:
            for clients in levels:
                result = run_config(mlxspec_bin, model_dir, drafter, max(levels), sessions,
                                    clients, args.max_tokens)
                report["runs"].setdefault(drafter, {}).setdefault(str(clients), []).append(
                    result)
                print(f"{drafter} @ {clients} clients, repeat {repeat + 1}: "
                      f"{result['throughput_tps']:.1f} tok/s, tau {result['tau'] or 0:.2f}, "
                      f"{result['wall_s']:.0f} s", flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(summarise(report), indent=1))
    print(json.dumps(summarise(report)["summary"], indent=1))
    if args.out:
        plot(summarise(report), Path(args.out).with_suffix(".png"))


def plot(report: dict, path: Path) -> None:
    """Throughput per drafter at each level, and the per-session ratio to plain with its
    interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["summary"]
    drafters = list(summary)
    levels = sorted({int(c) for d in drafters for c in summary[d]})
    fig, (speed, ratios) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(levels)
    for j, clients in enumerate(levels):
        rows = [summary[d].get(str(clients)) for d in drafters]
        x = [i + j * width for i in range(len(drafters))]
        label = f"{clients} client{'s' if clients > 1 else ''}"
        speed.bar(x, [r["throughput_tps"] if r else 0 for r in rows], width, label=label)
        ratio = [r.get("per_session_vs_none") if r else None for r in rows]
        mid = [r["ratio"] if r else 1.0 for r in ratio]
        low = [m - r["interval"][0] if r and r["interval"] else 0 for m, r in zip(mid, ratio)]
        high = [r["interval"][1] - m if r and r["interval"] else 0 for m, r in zip(mid, ratio)]
        ratios.bar(x, mid, width, yerr=[low, high], capsize=3, label=label)
    for ax in (speed, ratios):
        ax.set_xticks([i + width * (len(levels) - 1) / 2 for i in range(len(drafters))], drafters)
        ax.legend(fontsize=8)
    ratios.axhline(1.0, color="0.5", lw=0.8)
    speed.set(ylabel="completion tok/s (all clients)",
              title=f"Agentic suite through mlxspec serve ({report['sessions']} sessions)")
    ratios.set(ylabel="per-session tok/s / plain's",
               title="against plain decoding (95% paired bootstrap)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def pooled(repeats: list[dict]) -> dict:
    """A level's repeats as one run: their tokens over their wall time, sessions end to end."""
    tokens = sum(r["tokens"] for r in repeats)
    passes = [p["target_passes"] for r in repeats for s in r["sessions"] for p in s]
    return {"throughput_tps": tokens / sum(r["wall_s"] for r in repeats),
            "tau": tokens / sum(passes) if all(passes) else None,
            "repeats_tps": [r["throughput_tps"] for r in repeats],
            "sessions": [s for r in repeats for s in r["sessions"]]}


def summarise(report: dict) -> dict:
    """Per configuration and level: throughput and its ratio to plain's, the same-text count,
    and at each level the per-session paired ratio to plain and to lookup (over the repeats
    both sides have run)."""
    runs, summary = report["runs"], {}
    for drafter, levels in runs.items():
        for clients, repeats in levels.items():
            result = pooled(repeats)
            row = {"throughput_tps": result["throughput_tps"], "tau": result["tau"],
                   "repeats_tps": result["repeats_tps"]}
            for base in ("none", "lookup"):
                others = runs.get(base, {}).get(clients)
                if others is None or base == drafter:
                    continue
                n = min(len(repeats), len(others))
                mine, theirs = pooled(repeats[:n]), pooled(others[:n])
                row[f"vs_{base}"] = mine["throughput_tps"] / theirs["throughput_tps"]
                a = [(sum(r["tokens"] for r in s), sum(r["seconds"] for r in s))
                     for s in mine["sessions"]]
                b = [(sum(r["tokens"] for r in s), sum(r["seconds"] for r in s))
                     for s in theirs["sessions"]]
                row[f"per_session_vs_{base}"] = paired_ratio(
                    ([x[0] for x in a], [x[1] for x in a]), ([y[0] for y in b], [y[1] for y in b]))
                if base == "none":
                    row["same_text"] = sum(
                        x["text"] == y["text"]
                        for s, t in zip(mine["sessions"], theirs["sessions"])
                        for x, y in zip(s, t))
                    row["replies"] = sum(len(s) for s in mine["sessions"])
            summary.setdefault(drafter, {})[clients] = row
    return {**report, "summary": summary}


if __name__ == "__main__":
    main()
