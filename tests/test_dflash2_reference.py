"""Our MLX DFlash2 drafter against z-lab's torch reference (dflash 0.1.0's DFlash2DraftModel),
on saved fixtures (scripts/make_dflash2_fixtures.py).

The released-layout checkpoint loads through our loader and is driven through the engine
contract (begin, commit, propose) over the reference's three steps: the block's hidden states,
its logits, the greedy walk, each slot's candidates, and the q of the reference's sampled walk
(its path forced: the two frameworks' random streams differ). float32 on both sides.
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from mlxspec.drafters.dflash2 import DFlash2Drafter
from mlxspec.engine import Verdict
from mlxspec.models.dflash import check_weights, read_weights
from mlxspec.models.dflash2 import DFlash2Config, DFlash2Model
from mlxspec.models.dflash import read_config
from mlxspec.sampling import SamplingConfig

FIXTURES = Path(__file__).parent / "fixtures" / "dflash2"
ATOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    return mx.load(str(FIXTURES / "reference.safetensors")), json.loads(
        (FIXTURES / "reference.json").read_text())


def reference_drafter(tensors) -> DFlash2Drafter:
    args = DFlash2Config.from_dict(read_config(FIXTURES / "drafter"))
    weights = read_weights(FIXTURES / "drafter")
    model = check_weights(args, weights, DFlash2Model)
    model.load_weights(list(weights.items()))
    vocab, hidden = tensors["embed_tokens"].shape
    embed, head = nn.Embedding(vocab, hidden), nn.Linear(hidden, vocab, bias=False)
    embed.weight, head.weight = tensors["embed_tokens"], tensors["lm_head"]
    return DFlash2Drafter(model, embed_tokens=embed, lm_head=head)


def steps(drafter, tensors, meta):
    """Each step's tokens after the reference's context is committed, as the engine would."""
    for i, step in enumerate(meta["steps"]):
        features = tensors[f"features_{i}"]
        tokens = [0] * step["start"] + [step["pending"]]  # only the pending token enters
        if i == 0:
            drafter.begin(tokens, features)
        else:
            drafter.commit(tokens, Verdict([], 0, step["pending"], features=features))
        yield i, tokens, step["block_length"] - 1


def test_hidden_logits_and_greedy_walk_match_the_reference(reference):
    tensors, meta = reference
    drafter = reference_drafter(tensors)
    worst = 0.0
    for i, tokens, n in steps(drafter, tensors, meta):
        hidden = drafter.block_hidden(tokens, n)[0, 1:]
        logits = drafter.model.compute_logits(hidden, drafter.lm_head)
        for ours, name in ((hidden, "hidden"), (logits, "logits")):
            diff = mx.abs(ours - tensors[f"{name}_{i}"]).max().item()
            worst = max(worst, diff)
            assert diff < ATOL, f"step {i}: max |{name} diff| {diff:.2e}"
        ids, _ = drafter.model.candidate_selector.candidates(logits[None])
        assert mx.sort(ids[0], axis=-1).tolist() == tensors[f"candidates_{i}"].tolist()
        greedy = drafter.propose(tokens, n, SamplingConfig())
        assert greedy.probs is None
        assert greedy.tokens.tolist() == tensors[f"path_{i}"].tolist()
    print(f"max |diff| vs z-lab's DFlash2: {worst:.2e}")


def test_the_sampled_walks_q_matches_the_reference(reference):
    tensors, meta = reference
    drafter = reference_drafter(tensors)
    temp = meta["temperature"]
    for i, tokens, n in steps(drafter, tensors, meta):
        hidden = drafter.block_hidden(tokens, n)[:, 1:]
        logits = drafter.model.compute_logits(hidden, drafter.lm_head)
        path = tensors[f"sampled_path_{i}"]
        ids, q = drafter.model.candidate_selector.forced_q(
            hidden, logits, mx.array([tokens[-1]]), path[None], temp)
        vocab = logits.shape[-1]
        ours, theirs = np.zeros((n, vocab)), np.zeros((n, vocab))
        np.put_along_axis(ours, np.array(ids[0]), np.array(q[0]), axis=-1)
        np.put_along_axis(theirs, np.array(tensors[f"sampled_candidates_{i}"]),
                          np.array(tensors[f"q_{i}"]), axis=-1)
        np.testing.assert_allclose(ours, theirs, atol=ATOL)
        assert all(theirs[t, int(path[t])] > 0 for t in range(n))  # each drawn from its q
