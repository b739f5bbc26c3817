"""Fit 'copy heads' for a drafter offline, and write the shipped drafter with them as a new first
layer: a two-layer checkpoint for `mlxspec train dflash --init OUT`.

Why: a one-layer DFlash drafter cannot follow copied text (its mask slots all ask the same
query), and a second layer trained by the drafting loss alone did not learn to on this CPU
(docs/dflash-training.md). The lookup half of copying can be taught directly and cheaply: heads
0, 3 and 6 (one per KV group) of a new first layer are fitted so the anchor row attends to
earlier positions j whose token k places back equals the anchor (k = 0, 1, 2: the match itself
and the one or two tokens after it, which is what slots 1 and 2 want). The loss is -log of the
attention mass on those positions, over the anchor row only: no LM head and no block, so an
iteration costs milliseconds on cached context features. Only those heads' q/k (and the q/k
norms) learn; the new layer's other heads and its MLP start silent (zero output) and the copy
heads write at ALPHA x the shipped layer's output projection, so the shipped layer (now second)
starts close to where it was.

Usage: python benchmarks/copy_heads.py DATA_DIR OUT_DIR [ALPHA=0.5] [ITERS=400]
  DATA_DIR: a `train dflash` sequence store, e.g. the doubled answers of sharegpt_doubled.py.
Prints the held-out attention mass on matches, per offset, as it fits.
"""

import json
import sys
import time
from pathlib import Path

import mlxspec
import mlx.core as mx
import numpy as np
import torch

from mlxspec.models.dflash import DFlashConfig, read_weights
from mlxspec.backends.torch.dflash_training import TorchDFlashTraining, _rotate
from mlxspec.training.data import SequenceStore
from mlxspec.training.dflash_trainer import _schedule, sample_anchors

SHIPPED = Path("mlxspec/drafters/trained/smollm2-135m-instruct-b16")
OFFSETS = (0, 1, 2)
HEADS = (0, 3, 6)  # one per KV group, so each offset's keys are free to differ
FIT, HELD_OUT = range(0, 64), range(64, 80)


def match_mask(tokens: torch.Tensor, anchors: torch.Tensor, length: int, k: int) -> torch.Tensor:
    """(anchors, length): context positions j < anchor whose token k places back is the anchor's."""
    j = torch.arange(length)
    back = j - k
    return ((back[None] >= 0) & (j[None] < anchors[:, None])
            & (tokens[back.clamp(min=0)][None] == tokens[anchors][:, None]))


def copy_loss(layer, rope, ctx, anchor_embeddings, tokens, anchors):
    """(mean over offsets of -log mass on matches, masses): anchors without a match skipped."""
    attn, (N, L) = layer.self_attn, (len(anchors), ctx.shape[1])
    keys, _ = attn.keys_values(ctx, rope, 0)  # (1, kv_heads, L, D)
    x = layer.input_layernorm(anchor_embeddings)[:, None]
    q = attn.q_norm(attn.q_proj(x).view(N, 1, attn.n_heads, -1)).transpose(1, 2)
    q = _rotate(rope, q, anchors[:, None])[:, :, 0]  # (N, heads, D)
    visible = torch.arange(L)[None] < anchors[:, None]
    losses, masses = [], []
    for h, k in zip(HEADS, OFFSETS):
        scores = (q[:, h] * attn.scale) @ keys[0, h // (attn.n_heads // attn.n_kv_heads)].T
        probs = torch.softmax(scores.masked_fill(~visible, -1e9), dim=-1)
        matches = match_mask(tokens, anchors, L, k)
        mass = (probs * matches).sum(-1)[matches.any(-1)]
        losses.append(-torch.log(mass + 1e-6).mean())
        masses.append(float(mass.detach().mean()))
    return sum(losses) / len(losses), masses


def with_copy_layer(config: dict, weights: dict, alpha: float) -> tuple[dict, dict]:
    """The drafter with a new first layer: the shipped layer's weights, silent but for HEADS."""
    have = config["num_hidden_layers"]
    grown = {}
    for name, v in weights.items():
        if name.startswith("layers."):
            i, rest = name[len("layers."):].split(".", 1)
            grown[f"layers.{int(i) + 1}.{rest}"] = v
            if i == "0":
                grown[name] = v  # the new first layer starts as the shipped one, then is silenced
        else:
            grown[name] = v
    head_dim = config["head_dim"]
    keep = np.zeros(config["num_attention_heads"] * head_dim, dtype=np.float32)
    for h in HEADS:
        keep[h * head_dim:(h + 1) * head_dim] = alpha
    o_proj = "layers.0.self_attn.o_proj.weight"
    grown[o_proj] = weights[o_proj] * mx.array(keep)[None]
    grown["layers.0.mlp.down_proj.weight"] = mx.zeros_like(weights["layers.0.mlp.down_proj.weight"])
    config = dict(config, num_hidden_layers=have + 1, torch_dtype="float32",
                  layer_types=[config["layer_types"][0]] + config["layer_types"])
    return config, grown


def main(data_dir, out, alpha=0.5, iters=400):
    alpha, iters = float(alpha), int(iters)
    torch.manual_seed(0)
    shipped = {k: v.astype(mx.float32) for k, v in read_weights(SHIPPED).items()}
    config, weights = with_copy_layer(json.loads((SHIPPED / "config.json").read_text()),
                                      shipped, alpha)
    target, _ = mlxspec.load(None, backend="torch")
    math = TorchDFlashTraining(target, DFlashConfig.from_dict(config), weights,
                               schedule=_schedule(1e-3, 1, 2), weight_decay=0.0, grad_clip=0.0,
                               gamma=2.0, loss_ids=None, inv_scale=None, device="cpu")
    model, embed = math.model, math.embed
    layer = model.layers[0]
    store, rng, started = SequenceStore(data_dir), np.random.default_rng(0), time.time()
    cached = {}
    for i in [*FIT, *HELD_OUT]:
        tokens, prompt_len = store[i]
        tokens = tokens[:1024]
        feats, _ = math.features(tokens)  # the shipped fc has the feature scale folded in
        with torch.no_grad():
            ctx = model.hidden_norm(model.fc(feats[None]))
        anchors = sample_anchors(rng, prompt_len, len(tokens), 256).astype(np.int64)
        cached[i] = (ctx, torch.tensor(tokens), torch.from_numpy(anchors))
    print(f"context features of {len(cached)} sequences: {time.time() - started:.0f} s")
    attn = layer.self_attn
    fitted = [attn.q_proj.weight, attn.k_proj.weight, attn.q_norm.weight, attn.k_norm.weight]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in fitted:
        p.requires_grad_(True)
    optimizer = torch.optim.Adam(fitted, lr=3e-3)

    def held_out_mass():
        with torch.no_grad():
            return np.round(np.mean([copy_loss(layer, model.rope, c, embed(t[a]), t, a)[1]
                                     for c, t, a in (cached[i] for i in HELD_OUT)], axis=0), 3)

    print(f"held-out mass on matches by offset {OFFSETS}: {held_out_mass()} at the start")
    for it in range(iters):
        ctx, tokens, anchors = cached[FIT[it % len(FIT)]]
        loss, _ = copy_loss(layer, model.rope, ctx, embed(tokens[anchors]), tokens, anchors)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (it + 1) % 100 == 0:
            print(f"iteration {it + 1}: loss {loss.item():.3f}, held-out mass {held_out_mass()}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    mx.save_safetensors(str(out / "model.safetensors"),
                        {k: mx.array(v.detach().float().numpy())
                         for k, v in model.state_dict().items()})
    print(f"{out}: {config['num_hidden_layers']} layers, copy heads {HEADS} in the first")


if __name__ == "__main__":
    main(*sys.argv[1:])
