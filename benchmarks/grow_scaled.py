"""Write the shipped SmolLM2 drafter grown to two layers, the new layer's output projections at
ALPHA x its donor's instead of zero, as a checkpoint for `mlxspec train dflash --init OUT`.

Why: `grow_drafter` zeroes a new layer's output projections (it drafts exactly as before), which
also leaves its attention and MLP inputs without a gradient until those projections grow; on this
CPU they only random-walked (docs/dflash-training.md). With ALPHA > 0 every weight of the new layer
learns from the first step, at the price of a slightly changed drafter at the start.

Usage: python benchmarks/grow_scaled.py OUT_DIR [ALPHA=0.1]
"""

import json
import sys
from pathlib import Path

import mlx.core as mx

import mlxspec
from mlxspec.models.dflash import read_weights
from mlxspec.training.dflash_trainer import BRANCH_OUTPUTS, grow_drafter, growth_donors

SHIPPED = Path("mlxspec/drafters/trained/smollm2-135m-instruct-b16")


def main(out, alpha=0.1):
    out, alpha = Path(out), float(alpha)
    config = json.loads((SHIPPED / "config.json").read_text())
    weights = {k: v.astype(mx.float32) for k, v in read_weights(SHIPPED).items()}
    target, _ = mlxspec.load(None)
    have = config["num_hidden_layers"]
    donors = growth_donors(target, have, have + 1)
    config, weights = grow_drafter(config, weights, have + 1, donors)
    for name in BRANCH_OUTPUTS:
        if name in donors[0]:
            weights[f"layers.{have}.{name}"] = alpha * donors[0][name].astype(mx.float32)
    config["torch_dtype"] = "float32"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    print(f"{out}: {have + 1} layers, new output projections at {alpha} x target layer's")


if __name__ == "__main__":
    main(*sys.argv[1:])
