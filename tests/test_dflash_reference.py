"""Our MLX DFlash drafter against z-lab's torch reference (dflash 0.1.0), on saved fixtures.

scripts/make_dflash_fixtures.py drove z-lab's drafter through three steps of its generation
loop (prompt context, 3 committed positions, 1 more with a shortened block). Here the same
checkpoint is loaded by our loader and driven through the engine contract (begin, propose,
commit), so the test covers positions, cache appends and block layout, not only the layers.
Tolerance: float32 on both sides; logits agree to atol 1e-4 (measured ~1e-6).
"""

import json
from pathlib import Path

import mlx.core as mx
from mlx import nn
import numpy as np
import pytest

from mlxspec.drafters.dflash import DFlashDrafter
from mlxspec.engine import Verdict
from mlxspec.models.dflash import load_model

FIXTURES = Path(__file__).parent / "fixtures" / "dflash"
ATOL = 1e-4


@pytest.fixture(scope="module")
def reference():
    return mx.load(str(FIXTURES / "reference.safetensors")), json.loads(
        (FIXTURES / "reference.json").read_text()
    )


def drafter_with_target_vocab(tensors):
    model, _ = load_model(FIXTURES / "drafter")
    vocab, hidden = tensors["embed_tokens"].shape
    embed, head = nn.Embedding(vocab, hidden), nn.Linear(hidden, vocab, bias=False)
    embed.weight, head.weight = tensors["embed_tokens"], tensors["lm_head"]
    return DFlashDrafter(model, embed_tokens=embed, lm_head=head)


def test_config_read_as_reference(reference):
    model, _ = load_model(FIXTURES / "drafter")
    attn = [layer.self_attn for layer in model.layers]
    assert [(a.is_causal, a.window) for a in attn] == [(True, 5), (False, None)]
    assert model.args.target_layer_ids == [1, 4] and model.args.mask_token_id == 95


def test_logits_match_reference(reference):
    tensors, meta = reference
    drafter = drafter_with_target_vocab(tensors)
    worst = 0.0
    for i, step in enumerate(meta["steps"]):
        features = tensors[f"features_{i}"]
        # Only the pending token (at position `start`) enters the block; earlier ids don't matter.
        tokens = [0] * step["start"] + [step["pending"]]
        if i == 0:
            drafter.begin(tokens, features)
        else:
            drafter.commit(tokens, Verdict([], 0, step["pending"], features=features))
        num_draft = step["block_length"] - 1
        logits = drafter.block_logits(tokens, num_draft)
        want = tensors[f"logits_{i}"]
        assert logits.shape == want.shape
        diff = mx.abs(logits - want).max().item()
        worst = max(worst, diff)
        assert diff < ATOL, f"step {i}: max |logit diff| {diff:.2e}"
        drafts = drafter.propose(tokens, num_draft, None).tokens
        assert drafts.tolist() == np.argmax(np.array(want), axis=-1).tolist()
    print(f"max |logit diff| vs z-lab reference: {worst:.2e}")
