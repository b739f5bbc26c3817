"""Make the mlx-vlm DSpark parity fixtures: a tiny random DSpark in LiquidAI's LFM2.5 layout
(`Lfm2DSparkDraftModel`: mask token and target layers under `dflash_config`, interleaved RoPE,
no head or embedding of its own, a confidence head on [h ; W1[x]]) driven by mlx-vlm 0.7.10's
own DSparkDraftModel, the reference for the layout DeepSpec's torch code does not cover.

Runs in a separate venv, never in ours (mlx-vlm pulls transformers, opencv, mlx-audio...):

    python3 -m venv /work/peers/mlx-vlm
    /work/peers/mlx-vlm/bin/pip install "mlx-vlm==0.7.10" "mlx[cpu]"
    /work/peers/mlx-vlm/bin/python scripts/make_mlx_vlm_dspark_fixtures.py

mlx-vlm's draft_block is driven as its round loop drives it (its cache keeps the context K/V of
the features it is given; the block is [anchor, MASK x (B - 1)], all B slots drafting), with
the target's embedding and head set by hand (as its DFlash parity check does), over two steps:
an 11-position context; 3 more positions and a new anchor. Per step: the block's hidden states
(`_hidden`), logits (`_logits`), the greedy walk (`markov_head.sample_block` with argmax) and
its confidences (`confidence`). Weights are numpy draws (seed 0): a rerun writes the same files.
"""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_vlm
import numpy as np
from mlx.utils import tree_flatten
from mlx_vlm.speculative.drafters.dspark import DSparkDraftModel
from mlx_vlm.speculative.drafters.dspark.config import DSparkConfig

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "mlx_vlm_dspark"
H, VOCAB, BLOCK, RANK = 64, 96, 5, 8
MASK = VOCAB - 1
STEPS = [11, 3]

CONFIG = {
    "architectures": ["Lfm2DSparkDraftModel"],
    "model_type": "qwen3",
    "hidden_size": H,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "vocab_size": VOCAB,
    "layer_types": ["full_attention", "full_attention"],
    "block_size": BLOCK,
    "dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 4], "num_target_layers": 6},
    "markov_rank": RANK,
    "rope_is_neox_style": False,
    "enable_confidence_head": True,
    "markov_head_type": "vanilla",
    "torch_dtype": "float32",
}


def random_weights(model, rng) -> dict:
    weights = {}
    for name, p in tree_flatten(model.parameters()):
        noise = rng.standard_normal(p.shape).astype(np.float32)
        if name.endswith("norm.weight"):
            value = 1 + 0.2 * noise
        elif name.startswith("markov_head"):
            value = 1.5 * noise * p.shape[-1] ** -0.25
        else:
            value = noise * p.shape[-1] ** -0.5
        weights[name] = mx.array(value)
    return weights


def main():
    rng = np.random.default_rng(0)
    config = DSparkConfig.from_dict(CONFIG)
    model = DSparkDraftModel(config)
    weights = random_weights(model, rng)
    model.load_weights(list(model.sanitize(weights).items()))
    embed, head = nn.Embedding(VOCAB, H), nn.Linear(H, VOCAB, bias=False)
    embed.weight = mx.array(rng.standard_normal((VOCAB, H)).astype(np.float32))
    head.weight = mx.array((4 * rng.standard_normal((VOCAB, H)) * H**-0.5).astype(np.float32))
    model.embed_tokens, model.lm_head = embed, head
    drafter_dir = OUT / "drafter"
    drafter_dir.mkdir(parents=True, exist_ok=True)
    (drafter_dir / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    mx.save_safetensors(str(drafter_dir / "model.safetensors"), weights)

    tensors = {"embed_tokens": embed.weight, "lm_head": head.weight}
    cache, start, steps = model.make_cache(), 0, []
    for i, new in enumerate(STEPS):
        start += new
        features = mx.array(rng.standard_normal((1, new, 2 * H)).astype(np.float32))
        anchor = int(rng.integers(0, VOCAB - 1))
        inputs = mx.array([[anchor] + [MASK] * (BLOCK - 1)], dtype=mx.int32)
        hidden = model._hidden(inputs, features, cache)
        logits = model._logits(hidden)
        greedy = model.markov_head.sample_block(
            logits, first_prev_tokens=mx.array([anchor]), sampler=lambda x: mx.argmax(x, -1))
        confidence = model.confidence(hidden, mx.array([anchor]), greedy)
        tensors.update({f"features_{i}": features[0], f"hidden_{i}": hidden[0],
                        f"logits_{i}": logits[0], f"greedy_{i}": greedy[0].astype(mx.int32),
                        f"confidence_{i}": confidence[0]})
        steps.append({"new_context": new, "start": start, "pending": anchor})
    mx.save_safetensors(str(OUT / "reference.safetensors"), tensors)
    meta = {"steps": steps, "block_size": BLOCK, "made_with": {"mlx_vlm": mlx_vlm.__version__,
                                                              "mlx": mx.__version__}}
    (OUT / "reference.json").write_text(json.dumps(meta, indent=2) + "\n")
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"wrote {OUT} ({total / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
