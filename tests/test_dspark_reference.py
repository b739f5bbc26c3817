"""Our MLX DSpark drafter against DeepSeek's torch reference (deepseek-ai/DeepSpec's
Qwen3DSparkModel driven by its evaluator's forward_dspark_draft_block), on saved fixtures
(scripts/make_dspark_fixtures.py).

The checkpoint in DeepSpec's own layout (its embed_tokens and lm_head included) loads through
our loader and is driven through the engine contract (begin, commit, propose) over the
reference's two steps: the block's hidden states and base logits, the greedy walk with the
Markov head, the confidences along it, and q at T = 0.7 along a fixed path. float32 on both
sides.
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxspec.drafters.dspark import DSparkDrafter
from mlxspec.engine import Verdict
from mlxspec.models.dflash import check_weights, read_config, read_weights
from mlxspec.models.dspark import DSparkConfig, DSparkModel
from mlxspec.sampling import SamplingConfig

FIXTURES = Path(__file__).parent / "fixtures" / "dspark"
ATOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    return mx.load(str(FIXTURES / "reference.safetensors")), json.loads(
        (FIXTURES / "reference.json").read_text())


def reference_drafter() -> DSparkDrafter:
    args = DSparkConfig.from_dict(read_config(FIXTURES / "drafter"))
    weights = read_weights(FIXTURES / "drafter")
    model = check_weights(args, weights, DSparkModel)
    model.load_weights(list(weights.items()))
    return DSparkDrafter(model, embed_tokens=model.embed_tokens, lm_head=model.lm_head)


def steps(drafter, tensors, meta):
    for i, step in enumerate(meta["steps"]):
        tokens = [0] * step["start"] + [step["pending"]]
        if i == 0:
            drafter.begin(tokens, tensors["features_0"])
        else:
            drafter.commit(tokens, Verdict([], 0, step["pending"], features=tensors[f"features_{i}"]))
        yield i, tokens


def test_block_walk_and_confidences_match_the_reference(reference):
    tensors, meta = reference
    drafter = reference_drafter()
    B = meta["block_size"]
    worst = 0.0
    for i, tokens in steps(drafter, tensors, meta):
        hidden = drafter.block_hidden(tokens, B - 1)[0]
        logits = drafter.model.compute_logits(hidden, drafter.lm_head)
        for ours, name in ((hidden, "hidden"), (logits, "logits")):
            diff = mx.abs(ours - tensors[f"{name}_{i}"]).max().item()
            worst = max(worst, diff)
            assert diff < ATOL, f"step {i}: max |{name} diff| {diff:.2e}"
        draft = drafter.propose(tokens, B, SamplingConfig())
        assert draft.tokens.tolist() == tensors[f"greedy_{i}"].tolist()
        np.testing.assert_allclose(np.array(drafter._confidence), np.array(tensors[f"confidence_{i}"]),
                                   atol=ATOL)
    print(f"max |diff| vs DeepSpec's DSpark: {worst:.2e}")


def test_q_along_a_fixed_path_matches_the_reference(reference):
    tensors, meta = reference
    drafter = reference_drafter()
    B, temp = meta["block_size"], meta["temperature"]
    for i, tokens in steps(drafter, tensors, meta):
        hidden = drafter.block_hidden(tokens, B - 1)
        logits = drafter.model.compute_logits(hidden, drafter.lm_head)[0]
        path = tensors[f"path_{i}"]
        drafts, q, _ = drafter.model.walk(hidden, logits[None], mx.array([tokens[-1]]), [temp],
                                          forced=path[None])
        assert drafts[0].tolist() == path.tolist()
        np.testing.assert_allclose(np.array(q[0]), np.array(tensors[f"q_{i}"]), atol=ATOL)
