"""Plot a DFlash training run's log: loss and held-out tau against blocks trained on.

Usage: python benchmarks/plot_training.py RUN_DIR OUT.png [OUT.json] [--mark STEP=LABEL ...]
                                          [--then RUN_DIR2=LABEL ...]
(RUN_DIR/train_state/state.json is written by `mlxspec train dflash`; OUT.json keeps the curve;
a mark draws a dashed line where something changed at that step, e.g. a resume with more data;
--then appends a run started from the previous one's last checkpoint (`--init`), its steps and
block tokens counted on from where that one stopped, marked with LABEL.)
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _log(run_dir: str) -> list[dict]:
    return json.loads((Path(run_dir) / "train_state" / "state.json").read_text())["log"]


def chained_log(run_dir: str, then=()) -> tuple[list[dict], list[tuple[int, str]]]:
    """One log for a run and the runs continued from it, and a mark where each one begins."""
    log, marks = _log(run_dir), []
    for next_dir, label in then:
        step, blocks = log[-1]["step"], log[-1]["trained_blocks"]
        marks.append((step, label))
        log = log + [{**e, "step": e["step"] + step, "trained_blocks": e["trained_blocks"] + blocks}
                     for e in _log(next_dir)]
    return log, marks


def main(run_dir: str, png: str, curve_json: str | None = None, marks=(), then=()) -> None:
    log, run_marks = chained_log(run_dir, then)
    marks = list(marks) + run_marks
    blocks = [e["trained_blocks"] * 16 / 1e6 for e in log]  # block tokens, millions
    window = 25
    smooth = [sum(e["loss"] for e in log[max(0, i - window + 1): i + 1]) / min(i + 1, window)
              for i in range(len(log))]
    taus = [(e["trained_blocks"] * 16 / 1e6, e["tau"]) for e in log if "tau" in e]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.plot(blocks, smooth)
    ax1.set_xlabel("block tokens trained on (millions)")
    ax1.set_ylabel(f"loss (mean of {window} steps)")
    ax2.plot([t[0] for t in taus], [t[1] for t in taus], marker="o")
    ax2.set_xlabel("block tokens trained on (millions)")
    ax2.set_ylabel("held-out tau (greedy, 16-token blocks)")
    at_step = dict(zip((e["step"] for e in log), blocks))
    for step, label in marks:
        for ax in (ax1, ax2):
            ax.axvline(at_step[step], color="gray", linestyle="--", linewidth=0.8)
        ax2.annotate(label, (at_step[step], 0.02), xycoords=("data", "axes fraction"),
                     rotation=90, fontsize=7, color="gray", ha="right", va="bottom")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    if curve_json:
        Path(curve_json).write_text(json.dumps(
            {"tau": [{"step": e["step"], "block_tokens": e["trained_blocks"] * 16, "tau": e["tau"]}
                     for e in log if "tau" in e],
             "loss": [{"step": e["step"], "loss": round(s, 4)} for e, s in zip(log, smooth)
                      if e["step"] % 25 == 0]}, indent=1))


def _mark(text: str) -> tuple[int, str]:
    step, _, label = text.partition("=")
    return int(step), label


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("png")
    parser.add_argument("curve_json", nargs="?")
    parser.add_argument("--mark", type=_mark, action="append", default=[])
    parser.add_argument("--then", type=lambda t: tuple(t.split("=", 1)) if "=" in t else (t, ""),
                        action="append", default=[])
    a = parser.parse_args()
    main(a.run_dir, a.png, a.curve_json, a.mark, a.then)
