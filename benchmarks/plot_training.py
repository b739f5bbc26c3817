"""Plot a DFlash training run's log: loss and held-out tau against blocks trained on.

Usage: python benchmarks/plot_training.py RUN_DIR OUT.png [OUT.json]
(RUN_DIR/train_state/state.json is written by `mlxspec train dflash`; OUT.json keeps the curve.)
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(run_dir: str, png: str, curve_json: str | None = None) -> None:
    log = json.loads((Path(run_dir) / "train_state" / "state.json").read_text())["log"]
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
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    if curve_json:
        Path(curve_json).write_text(json.dumps(
            {"tau": [{"step": e["step"], "block_tokens": e["trained_blocks"] * 16, "tau": e["tau"]}
                     for e in log if "tau" in e],
             "loss": [{"step": e["step"], "loss": round(s, 4)} for e, s in zip(log, smooth)
                      if e["step"] % 25 == 0]}, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
