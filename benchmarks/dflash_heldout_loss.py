"""Training loss of a DFlash run's weights on sequences it trained on vs sequences it never saw.

The held-out τ says whether drafting got better; this says why it did not get better faster: a
loss far lower on seen sequences than on unseen ones means the drafter is memorising its data
(more data is the lever), equal losses mean it is under-trained (more steps are).

Usage: python benchmarks/dflash_heldout_loss.py RUN_DIR DATA_DIR SEEN_RANGE UNSEEN_RANGE [STATE_DIR]
  e.g. ... runs/dflash-smollm2 data/dflash-smollm2/responses 0:64 640:704
Ranges index the sequence store; STATE_DIR (default RUN_DIR/train_state) holds the weights.
Anchors are drawn as in training (the run's anchor count, sequences cut at 1,024 tokens); the loss
is training's (slot weights, loss vocabulary), on MLX, no gradient.
"""

import json
import sys
from pathlib import Path

import mlxspec  # noqa: F401  (sets up BLAS before mlx.core)
import mlx.core as mx
import numpy as np

from mlxspec.models.dflash import DFlashConfig
from mlxspec.training.data import SequenceStore
from mlxspec.training.dflash_trainer import MLXDFlashTraining, _schedule, sample_anchors


def _range(text: str) -> range:
    lo, hi = text.split(":")
    return range(int(lo), int(hi))


def main(run_dir, data_dir, seen, unseen, state_dir=None):
    run_dir = Path(run_dir)
    state_dir = Path(state_dir or run_dir / "train_state")
    state = json.loads((state_dir / "state.json").read_text())
    target, _ = mlxspec.load(None)
    args = DFlashConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
    weights = dict(mx.load(str(state_dir / "params.safetensors")))
    loss_ids = mx.load(str(state_dir / "loss_vocab.safetensors"))["ids"].tolist()
    inv_scale = mx.load(str(state_dir / "feature_scale.safetensors")).get("inv_scale")
    math = MLXDFlashTraining(target, args, weights, schedule=_schedule(1e-3, 1, 2),
                             weight_decay=0.0, grad_clip=0.0, gamma=state["gamma"],
                             loss_ids=loss_ids, inv_scale=inv_scale,
                             labels=state.get("labels", "text"))
    store = SequenceStore(data_dir)
    rng = np.random.default_rng(0)
    report = {"run": str(run_dir), "step": state["step"]}
    for name, ids in (("seen", _range(seen)), ("unseen", _range(unseen))):
        losses, accs = [], []
        for i in ids:
            tokens, prompt_len = store[i]
            tokens = tokens[:state.get("max_seq_len", 1024)]  # as the run cut them
            chosen = sample_anchors(rng, prompt_len, len(tokens), state["anchors"])
            loss, correct = math._loss([(math.features(tokens), tokens, chosen)])
            losses.append(loss.item())
            accs.append(int(correct.item()) / len(chosen))
        report[name] = {"sequences": f"{ids.start}:{ids.stop}", "loss": round(float(np.mean(losses)), 3),
                        "slot1_acc": round(float(np.mean(accs)), 4)}
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
