"""Adaptive K against the best fixed K of the same `mlxspec bench` run (issue #40's measure).

Reads bench JSON reports whose drafters include a label X and fixed-K labels X@K; prints, per
suite and drafter, the adaptive tok/s, the best fixed K's, their paired ratio with a bootstrap
interval over prompts (mlxspec.intervals), τ and step cost of each, and plain's tok/s; each
sampling temperature apart.

    python benchmarks/adaptive_vs_fixed.py docs/results/adaptive-k-all-cpu.json [...]
"""

import argparse
import json
from collections import defaultdict

from mlxspec.intervals import paired_ratio


def rows(report: dict) -> list[dict]:
    """One row per (suite, drafter with fixed-K runs beside it)."""
    by = defaultdict(dict)
    for r in report["results"]:
        if r["engine"] == "mlxspec":
            by[r["suite"], r.get("temp", 0.0), r["drafter"].split("@")[0]][r["drafter"]] = r
    out = []
    for (suite, temp, base), runs in by.items():
        fixed = {label: r for label, r in runs.items() if "@" in label}
        if base not in runs or not fixed:
            continue
        adaptive, best = runs[base], max(fixed.values(), key=lambda r: r["tps"])
        ratio = paired_ratio((adaptive["tokens_per_prompt"], adaptive["seconds_per_prompt"]),
                             (best["tokens_per_prompt"], best["seconds_per_prompt"]))
        plain = by[suite, temp, "none"].get("none")
        out.append(dict(suite=suite, temp=temp, drafter=base, adaptive=adaptive["tps"],
                        adaptive_tau=adaptive["tau"], adaptive_cost=adaptive["step_cost"],
                        best=best["drafter"], best_tps=best["tps"], best_tau=best["tau"],
                        best_cost=best["step_cost"], ratio=ratio["ratio"],
                        interval=ratio["interval"], plain=plain and plain["tps"],
                        fixed={label: round(r["tps"], 2) for label, r in fixed.items()}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+")
    args = parser.parse_args()
    print("| suite | T | drafter | plain tok/s | adaptive tok/s (τ, step cost) | best fixed | "
          "its tok/s (τ, step cost) | adaptive / best [95%] | fixed K tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in args.reports:
        for r in rows(json.load(open(path))):
            low, high = r["interval"] or (float("nan"), float("nan"))
            fixed = ", ".join(f"{k.split('@')[1]}: {v}" for k, v in r["fixed"].items())
            print(f"| {r['suite']} | {r['temp']:g} | {r['drafter']} | {r['plain']:.1f} | "
                  f"{r['adaptive']:.1f} ({r['adaptive_tau']:.2f}, {r['adaptive_cost']:.2f}) | "
                  f"{r['best']} | "
                  f"{r['best_tps']:.1f} ({r['best_tau']:.2f}, {r['best_cost']:.2f}) | "
                  f"{r['ratio']:.2f}x [{low:.2f}, {high:.2f}] | {fixed} |")


if __name__ == "__main__":
    main()
