"""Our DSpark against mlx-vlm 0.7.10's, in LiquidAI's LFM2.5 layout (interleaved RoPE, the
target's embedding and head, the confidence head's input read from its width), on saved
fixtures (scripts/make_mlx_vlm_dspark_fixtures.py): the block's hidden states and logits, the
greedy walk and its confidences, over two steps of committed context."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx import nn

from mlxspec.drafters.dspark import DSparkDrafter
from mlxspec.engine import Verdict
from mlxspec.models.dflash import check_weights, read_config, read_weights
from mlxspec.models.dspark import DSparkConfig, DSparkModel
from mlxspec.sampling import SamplingConfig

FIXTURES = Path(__file__).parent / "fixtures" / "mlx_vlm_dspark"
ATOL = 1e-5


def test_block_walk_and_confidences_match_mlx_vlm():
    tensors = mx.load(str(FIXTURES / "reference.safetensors"))
    meta = json.loads((FIXTURES / "reference.json").read_text())
    args = DSparkConfig.from_dict(read_config(FIXTURES / "drafter"))
    weights = read_weights(FIXTURES / "drafter")
    args.read_head_width({name: w.shape for name, w in weights.items()})
    assert args.confidence_head_with_markov and not args.rope_is_neox_style
    model = check_weights(args, weights, DSparkModel)
    model.load_weights(list(weights.items()))
    embed, head = nn.Embedding(*tensors["embed_tokens"].shape), nn.Linear(64, 96, bias=False)
    embed.weight, head.weight = tensors["embed_tokens"], tensors["lm_head"]
    drafter = DSparkDrafter(model, embed_tokens=embed, lm_head=head)
    B, worst = meta["block_size"], 0.0
    for i, step in enumerate(meta["steps"]):
        tokens = [0] * step["start"] + [step["pending"]]
        if i == 0:
            drafter.begin(tokens, tensors["features_0"])
        else:
            drafter.commit(tokens, Verdict([], 0, step["pending"], features=tensors[f"features_{i}"]))
        hidden = drafter.block_hidden(tokens, B - 1)[0]
        logits = model.compute_logits(hidden, head)
        for ours, name in ((hidden, "hidden"), (logits, "logits")):
            diff = mx.abs(ours - tensors[f"{name}_{i}"]).max().item()
            worst = max(worst, diff)
            assert diff < ATOL, f"step {i}: max |{name} diff| {diff:.2e}"
        draft = drafter.propose(tokens, B, SamplingConfig())
        assert draft.tokens.tolist() == tensors[f"greedy_{i}"].tolist()
        np.testing.assert_allclose(np.array(drafter._confidence),
                                   np.array(tensors[f"confidence_{i}"]), atol=ATOL)
    print(f"max |diff| vs mlx-vlm's DSpark: {worst:.2e}")
