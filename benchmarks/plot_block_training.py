"""Held-out tau against training minutes: the DFlash2 and DSpark runs of
benchmarks/train_smollm2_block.sh beside the Medusa, EAGLE-3 and DFlash (the shipped drafter's
first stage) runs (docs/results/medusa-vs-eagle3-dflash-training.json), all on the same data (the
target's own answers to the same ShareGPT prompts) and held-out protocol (8 prompts never trained
on, 48 tokens, greedy, each drafter's fixed K: DFlash2 15, DSpark 7, EAGLE-3 4, Medusa 3, DFlash
15). A run missing from runs/ is left out.

Usage: python benchmarks/plot_block_training.py OUT.png OUT.json
Minutes: each run's from its progress bar (training and evaluations), as the others'.
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from plot_eagle3_vs_dflash import elapsed_minutes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OTHERS = ROOT / "docs/results/medusa-vs-eagle3-dflash-training.json"
RUNS = {"dflash2": "DFlash2, blocks of 16 (this run)", "dspark": "DSpark, blocks of 7 (this run)"}
EARLIER = {"eagle3": ("EAGLE-3, chain of 4", "o"), "medusa": ("Medusa, 3 heads", "^"),
           "dflash_stage1": ("DFlash, blocks of 16 (shipped drafter's stage 1)", "s")}


def curve(kind: str) -> list[dict]:
    run = ROOT / "runs" / f"{kind}-smollm2"
    log = json.loads((run / "train_state" / "state.json").read_text())["log"]
    text = (ROOT / "runs" / f"{kind}-smollm2.log").read_text(errors="replace")
    return [{"step": e["step"], "minutes": round(elapsed_minutes(text, e["step"]), 1),
             "tau": e["tau"], "slot1_acc": e["slot1_acc"]} for e in log if "tau" in e]


def main(png: str, out_json: str) -> None:
    ours = {k: curve(k) for k in RUNS if (ROOT / "runs" / f"{k}-smollm2").is_dir()}
    others = json.loads(OTHERS.read_text())
    Path(out_json).write_text(json.dumps({**ours, **others}, indent=1))
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for kind, points in ours.items():
        ax.plot([p["minutes"] for p in points], [p["tau"] for p in points], marker="D",
                label=RUNS[kind])
    for kind, (label, marker) in EARLIER.items():
        points = [p for p in others[kind] if p["minutes"] <= 60]
        ax.plot([p["minutes"] for p in points], [p["tau"] for p in points], marker=marker,
                label=label, alpha=0.6)
    ax.set_xlabel("training minutes on the 2-core CPU")
    ax.set_ylabel("held-out tau (greedy)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:3])
