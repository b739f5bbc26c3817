"""Speculative decoding over a split target: two ranks on loopback against one process, and what
a slower network would do to it (docs/benchmarks.md, "Targets split across ranks").

    python benchmarks/distributed_loopback.py run OUT.json      # alone, or on every rank
    python benchmarks/distributed_loopback.py report OUT_PREFIX SPLIT.json ONE.json [TWO.json]

`run` generates greedily for each drafter on HumanEval and MT-Bench prompts (the same ones in
every configuration) and keeps per prompt: tokens, target passes, accepted drafts, seconds. Run
under mlx.launch it loads the target split by pipeline and, on rank 0, also times the transfers a
step makes: rank 0's message (one all-sum of 4 KB) and the pipeline's hop (hidden states, with
the features a drafter reads, from rank 1 to rank 0) at 1, 4 and 16 positions.
`report` writes OUT_PREFIX.json / .md / .png: tok/s and tau with intervals over prompts, each
split run against one process, and the latency model: the measured step time plus two one-way
network latencies a step (rank 0's message out, the hidden states back), for growing latencies.
"""

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlxspec  # noqa: E402  (OpenBLAS before mlx.core)
import mlx.core as mx  # noqa: E402

from mlxspec.intervals import paired_ratio, ratio_interval, tau_interval  # noqa: E402
from mlxspec.prompts import humaneval_prompts, mtbench_prompts  # noqa: E402

DRAFTERS = ("none", "lookup", "dflash+lookup")
PROMPTS_PER_SUITE = int(os.environ.get("PROMPTS_PER_SUITE", 6))
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", 64))
# One-way, added per transfer: Thunderbolt RDMA, TCP over Thunderbolt or 10 GbE, Wi-Fi, and
# far past any LAN, where only tau is left.
LATENCIES_MS = (0.0, 0.05, 0.25, 1.0, 5.0, 20.0, 100.0)


def prompts(tokenizer) -> list[tuple[str, str]]:
    suites = {"humaneval": humaneval_prompts(PROMPTS_PER_SUITE),
              "mtbench": mtbench_prompts(PROMPTS_PER_SUITE)}
    return [(suite, tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                  add_generation_prompt=True, tokenize=False))
            for suite, texts in suites.items() for p in texts]


def timed(fn, repeats: int = 100) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def transfers(group, hidden: int, upstream_layers: int) -> dict:
    """Seconds per rank 0 message and per pipeline hop (on top of a message), every rank."""
    from mlxspec.distributed.link import CAPACITY

    message = mx.zeros((CAPACITY,), dtype=mx.int32)
    results = {"message_seconds": timed(lambda: mx.distributed.all_sum(message, group=group)
                                        .tolist())}
    for rows in (1, 4, 16):
        for width in (1, 1 + upstream_layers):
            packet = mx.ones((1, rows, hidden * width))

            def hop():
                if group.rank() == 1:
                    mx.eval(mx.distributed.send(packet, 0, group=group))
                else:
                    mx.eval(mx.distributed.recv_like(packet, 1, group=group))
                mx.distributed.all_sum(message, group=group).tolist()

            results[f"hop_{rows}x{width}_seconds"] = timed(hop) - results["message_seconds"]
            results[f"hop_{rows}x{width}_bytes"] = packet.nbytes
    return results


def run(out: Path) -> None:
    group = mx.distributed.init()
    split = group.size() > 1
    model, tokenizer = mlxspec.load(shard="pipeline" if split else None)
    leads = group.rank() == 0
    stage = mlxspec.distributed.stage_of(model)
    todo = prompts(tokenizer)
    drafters = {name: mlxspec.load_drafter(name, model=model, tokenizer=tokenizer)
                if leads else None for name in DRAFTERS}
    runs = {name: [] for name in DRAFTERS}
    mlxspec.generate(model, tokenizer, todo[0][1], 8)  # warm up
    for suite, prompt in todo:  # interleaved: a drift of the machine hits every drafter alike
        for name in DRAFTERS:
            start = time.perf_counter()
            last = None
            for last in mlxspec.stream_generate(model, tokenizer, prompt, MAX_TOKENS,
                                                drafter=drafters[name]):
                pass
            if leads:
                runs[name].append({"suite": suite, "seconds": time.perf_counter() - start,
                                   "tokens": last.generation_tokens,
                                   "passes": last.target_passes, "accepted": last.accepted,
                                   "drafted": last.drafted})
    report = {"ranks": group.size(), "runs": runs, "blas": mlxspec.blas_in_use(),
              "max_tokens": MAX_TOKENS}
    if split:
        capture = drafters["dflash+lookup"].capture_layers if leads else ()
        upstream = mx.distributed.all_sum(mx.array(sum(i < stage.start for i in capture)),
                                          group=group).item()
        hidden = model.args.hidden_size
        report["transfers"] = transfers(group, hidden, int(upstream))
        report["stage"] = stage.describe()
    if leads:
        out.write_text(json.dumps(report, indent=1))


def summary(runs: list[dict]) -> dict:
    tokens = [r["tokens"] for r in runs]
    seconds = [r["seconds"] for r in runs]
    passes = [r["passes"] for r in runs]
    accepted = [r["accepted"] for r in runs]
    return {"tok_s": sum(tokens) / sum(seconds), "tok_s_interval": ratio_interval(tokens, seconds),
            "tau": sum(tokens) / sum(passes), "tau_interval": tau_interval(passes, accepted),
            "seconds_per_pass": sum(seconds) / sum(passes),
            "drafted_per_pass": sum(r["drafted"] for r in runs) / sum(passes)}


def report(prefix: Path, split_file: Path, *others: Path) -> None:
    split = json.loads(split_file.read_text())
    singles = {f.stem: json.loads(f.read_text()) for f in others}
    rows, model_rows = [], []
    out = {"split": {}, "versus": {}, "transfers": split["transfers"], "latency_model": []}
    for name in DRAFTERS:
        s = summary(split["runs"][name])
        out["split"][name] = s
        for label, single in singles.items():
            r = single["runs"][name]
            pair = paired_ratio(([x["tokens"] for x in split["runs"][name]],
                                 [x["seconds"] for x in split["runs"][name]]),
                                ([x["tokens"] for x in r], [x["seconds"] for x in r]))
            out["versus"].setdefault(label, {})[name] = {**summary(r), "split_over_single": pair}
    t = split["transfers"]
    plain = out["split"]["none"]
    for name in DRAFTERS[1:]:
        spec = out["split"][name]
        for ms in LATENCIES_MS:
            extra = 2 * ms / 1000  # rank 0's message out, the hidden states back
            plain_rate = 1 / (plain["seconds_per_pass"] + extra)
            spec_rate = spec["tau"] / (spec["seconds_per_pass"] + extra)
            out["latency_model"].append({"drafter": name, "one_way_ms": ms,
                                         "plain_tok_s": plain_rate, "spec_tok_s": spec_rate,
                                         "speedup": spec_rate / plain_rate})
    prefix.with_suffix(".json").write_text(json.dumps(out, indent=1))

    def iv(x):
        return "–" if x is None else f"{x[0]:.2f}–{x[1]:.2f}"

    lines = [f"Two ranks ({split['stage']}), each pinned to one core, one OpenBLAS thread "
             f"({split['blas']}); greedy, {split['max_tokens']} tokens, "
             f"{len(split['runs']['none'])} prompts (HumanEval + MT-Bench), one run.", "",
             "| drafter | split tok/s | tau | s per pass | "
             + " | ".join(f"{label} tok/s | split / {label}" for label in singles) + " |",
             "|---|---|---|---|" + "---|---|" * len(singles)]
    for name in DRAFTERS:
        s = out["split"][name]
        cells = [f"{name}", f"{s['tok_s']:.2f} ({iv(s['tok_s_interval'])})",
                 f"{s['tau']:.2f} ({iv(s['tau_interval'])})", f"{1000 * s['seconds_per_pass']:.1f} ms"]
        for label in singles:
            v = out["versus"][label][name]
            pair = v["split_over_single"]
            cells += [f"{v['tok_s']:.2f}", f"{pair['ratio']:.2f}× ({iv(pair['interval'])})"]
        rows.append("| " + " | ".join(cells) + " |")
    lines += rows
    hidden_bytes = t["hop_1x1_bytes"]
    lines += ["", "Bytes a step sends, as run (fp32): rank 0's message 4 KB, and the hidden "
              "states of every position verified, "
              + ", ".join(f"{n} {(1 + out['split'][n]['drafted_per_pass']) * hidden_bytes / 1024:.1f} KB "
                          f"({1 + out['split'][n]['drafted_per_pass']:.2f} positions a pass)"
                          for n in DRAFTERS)
              + "; DFlash adds the features of its layers before rank 0's (x3 below)."]
    lines += ["", "Transfers on loopback, per step: rank 0's message "
              f"{1e3 * t['message_seconds']:.3f} ms; the pipeline's hop on top of it: "
              + ", ".join(f"{k[4:-8]} {1e3 * v:.3f} ms ({t[k[:-8] + '_bytes'] / 1024:.1f} KB)"
                          for k, v in t.items() if k.startswith("hop_") and k.endswith("seconds")),
              "", "The latency model: measured step time on the split target plus two one-way "
              "latencies a step (rank 0's message out, the hidden states back); the speedup "
              "tends to tau as the network comes to dominate a step.", "",
              "| one-way latency | " + " | ".join(
                  f"{n}: plain tok/s, spec tok/s, speedup" for n in DRAFTERS[1:]) + " |",
              "|---|" + "---|" * (len(DRAFTERS) - 1)]
    for ms in LATENCIES_MS:
        cells = [f"+{ms:g} ms" if ms else "loopback (measured)"]
        for name in DRAFTERS[1:]:
            m = next(x for x in out["latency_model"] if x["drafter"] == name
                     and x["one_way_ms"] == ms)
            cells.append(f"{m['plain_tok_s']:.2f}, {m['spec_tok_s']:.2f}, {m['speedup']:.2f}×")
        model_rows.append("| " + " | ".join(cells) + " |")
    lines += model_rows
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plot(prefix.with_suffix(".png"), out)


def _plot(path: Path, out: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name in DRAFTERS[1:]:
        points = [m for m in out["latency_model"] if m["drafter"] == name]
        ax.plot([m["one_way_ms"] for m in points], [m["speedup"] for m in points], marker="o",
                label=f"{name} (tau {out['split'][name]['tau']:.2f})")
        ax.axhline(out["split"][name]["tau"], ls=":", lw=0.8, color=ax.lines[-1].get_color())
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("symlog", linthresh=0.05)
    ax.set_xlim(0, LATENCIES_MS[-1] * 1.5)
    ax.set_xlabel("one-way network latency added per transfer (ms), two transfers a step")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title("SmolLM2 split over 2 ranks: speculation as the network slows", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(Path(sys.argv[2]))
    else:
        report(Path(sys.argv[2]), Path(sys.argv[3]), *map(Path, sys.argv[4:]))
