"""Plot benchmarks/server_batching.py's JSON: aggregate throughput (top row) and p95 latency
(bottom row) against concurrent clients, one line per server, one column per workload. Servers
that were skipped are named in the title; levels with failed requests are marked with an x.

Usage: python benchmarks/plot_server_batching.py [IN.json [OUT.png]]
(default: docs/results/server-batching-cpu.json and the same name with .png)
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DEFAULT = Path(__file__).resolve().parent.parent / "docs/results/server-batching-cpu.json"
ROWS = (("throughput_tps", "tok/s, all clients"), ("latency_p95", "p95 latency, s"))


def series(report: dict) -> dict:
    """{workload: {server: [load, ...]}} of the servers that ran."""
    out: dict = {}
    for entry in report["servers"]:
        for workload, result in entry.get("workloads", {}).items():
            out.setdefault(workload, {})[entry["server"]] = result["loads"]
    return out


def plot(report: dict, png: Path) -> None:
    data = series(report)
    if not data:
        raise SystemExit("no server ran in this report")
    workloads = sorted(data)
    fig, axes = plt.subplots(len(ROWS), len(workloads), figsize=(5.5 * len(workloads), 7.5),
                             squeeze=False, sharex=True)
    for col, workload in enumerate(workloads):
        info = report["workloads"].get(workload, {})
        for row, (key, label) in enumerate(ROWS):
            ax = axes[row][col]
            for server, loads in data[workload].items():
                points = [(x["clients"], x[key]) for x in loads if x[key] is not None]
                if not points:
                    continue
                line, = ax.plot(*zip(*points), marker="o", label=server)
                failed = [(x["clients"], x[key]) for x in loads
                          if x["errors"] and x[key] is not None]
                if failed:
                    ax.plot(*zip(*failed), "x", color=line.get_color(), markersize=10)
            ax.set_xscale("log", base=2)
            levels = sorted({x["clients"] for loads in data[workload].values() for x in loads})
            ax.set_xticks(levels, [str(c) for c in levels])
            ax.set_ylim(bottom=0)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(f"{workload} ({info.get('prompts', '?')} prompts, "
                             f"{info.get('max_tokens', '?')} tokens, greedy)")
            if row == len(ROWS) - 1:
                ax.set_xlabel("concurrent clients")
        axes[0][col].legend(fontsize=8)
    skipped = [e["server"] for e in report["servers"] if "skipped" in e]
    title = (f"{report['model']}, {report['blas']}, {report['machine']['cpus']} CPUs, "
             f"requests per client: {report['options']['per_client']}")
    if skipped:
        title += f"; skipped: {', '.join(skipped)}"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str]) -> None:
    source = Path(argv[0]) if argv else DEFAULT
    png = Path(argv[1]) if len(argv) > 1 else source.with_suffix(".png")
    plot(json.loads(source.read_text()), png)
    print(png)


if __name__ == "__main__":
    main(sys.argv[1:])
