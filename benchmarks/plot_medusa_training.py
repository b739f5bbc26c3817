"""Held-out tau against training minutes: the Medusa run of benchmarks/train_smollm2_medusa.sh
beside the EAGLE-3 run and the shipped DFlash drafter's first stage (docs/results/
eagle3-vs-dflash-training.json), all on the same data (the target's own answers to the same
ShareGPT prompts) and the same held-out protocol (8 prompts never trained on, 48 tokens,
greedy; Medusa drafts its 3 heads' chain, EAGLE-3 a chain of 4, DFlash blocks of 16).

Usage: python benchmarks/plot_medusa_training.py RUN_DIR RUN_LOG OUT.png OUT.json
Minutes: the Medusa run's from its progress bar (training and evaluations), as EAGLE-3's.
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from plot_eagle3_vs_dflash import elapsed_minutes  # noqa: E402

OTHERS = Path(__file__).resolve().parent.parent / "docs/results/eagle3-vs-dflash-training.json"


def main(run_dir: str, run_log: str, png: str, out_json: str) -> None:
    log = json.loads((Path(run_dir) / "train_state" / "state.json").read_text())["log"]
    text = Path(run_log).read_text(errors="replace")
    medusa = [{"step": e["step"], "minutes": round(elapsed_minutes(text, e["step"]), 1),
               "tau": e["tau"]} for e in log if "tau" in e]
    others = json.loads(OTHERS.read_text())
    Path(out_json).write_text(json.dumps({"medusa": medusa, **others}, indent=1))
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for points, label, marker in (
            (medusa, "Medusa, 3 heads, shared head (this run)", "^"),
            (others["eagle3"], "EAGLE-3, chain of 4", "o"),
            (others["dflash_stage1"], "DFlash, blocks of 16 (shipped drafter's stage 1)", "s")):
        ax.plot([p["minutes"] for p in points], [p["tau"] for p in points], marker=marker,
                label=label)
    ax.set_xlabel("training minutes on the 2-core CPU")
    ax.set_ylabel("held-out tau (greedy)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:5])
