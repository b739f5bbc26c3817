"""Training loss of a DFlash run's weights on sequences it trained on vs sequences it never saw.

The held-out τ says whether drafting got better; this says why it did not get better faster: a
loss far lower on seen sequences than on unseen ones means the drafter is memorising its data
(more data is the lever), equal losses mean it is under-trained (more steps are).

It also reports, per block, how many leading slots the drafter gets right through the full LM
head (argmax against the run's labels: with --labels target, the target's own greedy predictions,
so this is what greedy verification would accept there, full blocks): `accepted` is the mean of
that length (tau - 1 if every pass were one such block), `slot_acc` the rate of slot k given
slots < k right. It shows whether slots past the first learn anything.

Usage: python benchmarks/dflash_heldout_loss.py RUN_DIR DATA_DIR SEEN_RANGE UNSEEN_RANGE [STATE_DIR]
  e.g. ... runs/dflash-smollm2 data/dflash-smollm2/responses 0:64 640:704
Ranges index the sequence store, or "next:N": the next N sequences the run's epoch has not reached
(the same for two branches of a run at the same step). STATE_DIR (default RUN_DIR/train_state)
holds the weights. Anchors are drawn as in training (the run's anchor count, sequences cut as the
run cut them); the loss is training's (slot weights, loss vocabulary), on MLX, no gradient.
"""

import json
import sys
from pathlib import Path

import mlxspec  # noqa: F401  (sets up BLAS before mlx.core)
import mlx.core as mx
import numpy as np

from mlxspec.models.dflash import DFlashConfig
from mlxspec.backends.mlx.target_parts import target_head
from mlxspec.training.data import SequenceStore
from mlxspec.training.dflash_trainer import (
    MLXDFlashTraining,
    _schedule,
    epoch_order,
    sample_anchors,
    trainable_ids,
    training_logits,
)


def _sequences(text: str, store, state) -> list[int]:
    lo, hi = text.split(":")
    if lo != "next":
        return list(range(int(lo), int(hi)))
    train_ids = trainable_ids(store, state.get("max_seq_len", 1024))
    sizes = state.get("epoch_sizes", [len(train_ids)])
    order = epoch_order(state["seed"], state["epoch"], sizes)
    return [train_ids[int(k)] for k in order[state["cursor"]:state["cursor"] + int(hi)]]


def accepted_lengths(math, head, feats, labels, tokens, chosen, chunk=32) -> np.ndarray:
    """(anchors,) leading slots right, full head, argmax against the labels (text if None)."""
    tokens = mx.array(tokens, dtype=mx.int32)
    labels = tokens if labels is None else labels
    L, bs, out = tokens.shape[0], math.args.block_size, []
    for k in range(0, len(chosen), chunk):
        anchors = mx.array(chosen[k:k + chunk], dtype=mx.int32)
        logits = training_logits(math.model, feats, tokens, anchors, embed_tokens=math.embed,
                                 lm_head=head)
        idx = anchors[:, None] + mx.arange(1, bs)[None]
        right = (mx.argmax(logits, axis=-1) == labels[mx.minimum(idx, L - 1)]) & (idx < L)
        out.append(np.array(mx.cumprod(right.astype(mx.int32), axis=1).sum(axis=1)))
    return np.concatenate(out)


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
    head = target_head(target)
    rng = np.random.default_rng(0)
    report = {"run": str(run_dir), "step": state["step"], "layers": args.num_hidden_layers}
    for name, spec in (("seen", seen), ("unseen", unseen)):
        losses, accs, lengths = [], [], []
        ids = _sequences(spec, store, state)
        if not ids:  # e.g. "0:0": that side not wanted
            continue
        for i in ids:
            tokens, prompt_len = store[i]
            tokens = tokens[:state.get("max_seq_len", 1024)]  # as the run cut them
            chosen = sample_anchors(rng, prompt_len, len(tokens), state["anchors"])
            feats, labels = math.features(tokens)
            loss, correct = math._loss([((feats, labels), tokens, chosen)])
            losses.append(loss.item())
            accs.append(int(correct.item()) / len(chosen))
            lengths.append(accepted_lengths(math, head, feats, labels, tokens, chosen))
        lengths = np.concatenate(lengths)
        reached = [(lengths >= k).sum() for k in range(5)]
        report[name] = {"sequences": spec, "loss": round(float(np.mean(losses)), 3),
                        "slot1_acc": round(float(np.mean(accs)), 4),
                        "accepted": round(float(lengths.mean()), 4),
                        "slot_acc": [round(float(reached[k + 1] / max(reached[k], 1)), 4)
                                     for k in range(4)]}
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
