"""LayerSkip's exit layer on SmolLM2-135M-Instruct: acceptance, tau, step cost and speedup per
exit, from one `mlxspec bench` run of every exit at 4 drafts a step (interleaved with plain
decoding, greedy, HumanEval and MT-Bench).

Usage: python benchmarks/plot_layerskip_exits.py REPORT.json OUT.png OUT.md
The report comes from:
  mlxspec bench --drafters none,layerskip:exit-layer=6@4,...,layerskip:exit-layer=26@4 \
    --suite humaneval,mtbench --limit 3 --max-tokens 64 --temp 0 --no-mlx-lm --no-llama-cpp
"""

import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def rows(report: dict):
    for r in report["results"]:
        match = re.fullmatch(r"layerskip:exit-layer=(\d+)@\d+", r["drafter"])
        if match:
            yield int(match.group(1)), r


def main(report_path: str, png: str, md: str) -> None:
    report = json.loads(Path(report_path).read_text())
    table = ["| suite | exit layer | acceptance at draft 1, 2, 3, 4 | tau | step cost | speedup |",
             "|---|---|---|---|---|---|"]
    fig, (ax_tau, ax_speed) = plt.subplots(1, 2, figsize=(9, 3.5))
    for suite in ("humaneval", "mtbench"):
        points = sorted((e, r) for e, r in rows(report) if r["suite"] == suite)
        for e, r in points:
            accept = ", ".join(f"{a:.0%}" for a in r["acceptance_per_position"])
            lo, hi = r["speedup_interval"]
            table.append(f"| {suite} | {e} | {accept} | {r['tau']:.2f} | {r['step_cost']:.2f} | "
                         f"{r['speedup']:.2f}x [{lo:.2f}, {hi:.2f}] |")
        exits = [e for e, _ in points]
        ax_tau.plot(exits, [r["tau"] for _, r in points], marker="o", label=suite)
        ax_speed.plot(exits, [r["speedup"] for _, r in points], marker="o", label=suite)
    ax_tau.set_xlabel("exit layer (of 30)")
    ax_tau.set_ylabel("tau (tokens per target pass)")
    ax_speed.set_xlabel("exit layer (of 30)")
    ax_speed.set_ylabel("speedup vs plain decoding")
    ax_speed.axhline(1.0, color="grey", lw=0.8)
    ax_tau.legend()
    fig.suptitle("LayerSkip on SmolLM2-135M (untrained for early exit), 4 drafts, greedy, CPU")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    Path(md).write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
