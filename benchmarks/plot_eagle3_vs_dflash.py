"""Held-out tau against training minutes: the EAGLE-3 run of benchmarks/train_smollm2_eagle3.sh
beside the shipped DFlash drafter's first stage, on the same data (the target's own answers to
the same ShareGPT prompts) and the same held-out protocol (8 prompts never trained on, 48
tokens, greedy).

Usage: python benchmarks/plot_eagle3_vs_dflash.py RUN_DIR RUN_LOG OUT.png OUT.json

Minutes: the EAGLE-3 run's from its progress bar (RUN_LOG, tqdm's elapsed at each evaluated
step: training and evaluations, the start-up excluded); the DFlash run's from its three sessions
(docs/dflash-training.md: steps 1-800 in 46 min, 801-2200 in 62, 2201-2800 in 49, evaluations
included), spread evenly over each session's steps, so its points are estimates.
"""

import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DFLASH_SESSIONS = [(0, 0.0), (800, 46.0), (2200, 108.0), (2800, 157.0)]  # (step, minutes)
DFLASH_CURVE = Path(__file__).resolve().parent.parent / "docs/results/dflash-smollm2-training.json"


def dflash_minutes(step: int) -> float | None:
    for (s0, m0), (s1, m1) in zip(DFLASH_SESSIONS, DFLASH_SESSIONS[1:]):
        if s0 < step <= s1:
            return m0 + (m1 - m0) * (step - s0) / (s1 - s0)
    return None


def elapsed_minutes(log_text: str, step: int) -> float:
    """tqdm's elapsed time where the bar first shows `step` done."""
    match = re.search(rf"\| {step}/\d+ \[(?:(\d+):)?(\d+):(\d+)<", log_text)
    if match is None:
        raise ValueError(f"step {step} is not in the progress log")
    hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    return 60 * hours + minutes + seconds / 60


def main(run_dir: str, run_log: str, png: str, out_json: str) -> None:
    log = json.loads((Path(run_dir) / "train_state" / "state.json").read_text())["log"]
    text = Path(run_log).read_text(errors="replace")
    eagle3 = [{"step": e["step"], "minutes": round(elapsed_minutes(text, e["step"]), 1),
               "tau": e["tau"]} for e in log if "tau" in e]
    dflash = [{"step": e["step"], "minutes": round(dflash_minutes(e["step"]), 1), "tau": e["tau"]}
              for e in json.loads(DFLASH_CURVE.read_text())["tau"]
              if dflash_minutes(e["step"]) is not None]
    Path(out_json).write_text(json.dumps({"eagle3": eagle3, "dflash_stage1": dflash}, indent=1))
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot([p["minutes"] for p in eagle3], [p["tau"] for p in eagle3], marker="o",
            label="EAGLE-3, chain of 4 (this run)")
    ax.plot([p["minutes"] for p in dflash], [p["tau"] for p in dflash], marker="s",
            label="DFlash, blocks of 16 (shipped drafter's stage 1)")
    ax.set_xlabel("training minutes on the 2-core CPU")
    ax.set_ylabel("held-out tau (greedy)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:5])
