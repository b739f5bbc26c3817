"""MTP draft logits against a peer nobody here wrote: mlx-vlm 0.7.10's Qwen3.5 MTP drafter
(`mlx_vlm/speculative/drafters/qwen3_5_mtp`), on the same random weights.

scripts/make_mtp_fixtures.py wrote a tiny Qwen3.5 target in the published Hugging Face layout
(top-level `mtp.*`, zero-centred norms) and, in mlx-vlm's own venv, recorded what mlx-vlm's
loader and drafter compute from it: the prefill's logits at every position (the pair target
hidden[p], token p + 1 at RoPE position p), then two chained steps on the module's own output
hidden (positions L and L + 1). Here the same directory goes through our loader
(`load_checkpoint`, `read_mtp_tensors`, `build_mtp_model`: our +1 shift, not mlx-vlm's) and the
same inputs through `MTPModel.run` on a fresh cache, which puts entry p at position p as
mlx-vlm does. The fixture hidden is already the target's normed output that mlx-vlm is handed,
so it bypasses `project`.

Measured (CPU, float32, mlx 0.32.4 on both sides): |ours - mlx-vlm| is 0 at depth 1 and 2
(bit-identical: the same MLX ops in the same order) and at most 9.5e-7 at depth 3, against
logits of size about 3 (max |logit| 3.23, 2.84, 2.98); the tolerance is 1e-4 of max |logit|.
Without the +1 shift (`published=False`, the MLX convention applied to published tensors) the
logits move by 2.6-3.0, about 10^4 times the tolerance; chaining depth 2 from a cache one
pair short moves them by 0.36.
"""

import json
from pathlib import Path

import mlx.core as mx
import pytest

import mlxspec  # noqa: F401  (loads OpenBLAS before mlx.core does)
from mlxspec.converters.hf import load_checkpoint
from mlxspec.models.mtp import build_mtp_model, read_mtp_tensors

FIXTURES = Path(__file__).parent / "fixtures" / "mtp" / "qwen3_5"
TARGET = FIXTURES / "target"
META = json.loads((FIXTURES / "expected.json").read_text())
RELATIVE_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def checkpoint():
    model, config = load_checkpoint(TARGET, lazy=False, action="load")
    tensors, published = read_mtp_tensors(TARGET, config)
    assert published  # format "pt": norms stored as w, used as 1 + w
    return model, config, tensors


@pytest.fixture(scope="module")
def expected():
    return mx.load(str(FIXTURES / "expected.safetensors"))


def draft_logits(mtp) -> dict[str, mx.array]:
    """What mlx-vlm's prefill and two chained steps compute, through our MTPModel."""
    inputs = mx.load(str(FIXTURES / "inputs.safetensors"))
    ids, hidden = inputs["ids"], inputs["hidden"]
    first, second = (int(t) for t in META["chain_tokens"])
    assert first == int(inputs["seed_token"][0])
    cache = mtp.make_cache()
    x1 = mtp.run(0, ids[:, 1:], hidden, cache)  # (hidden[p], ids[p + 1]) at position p
    x2 = mtp.run(0, mx.array([[first]]), mtp.chained(x1[:, -1:], 0), cache)
    assert cache[0][0].offset == META["positions"]["depth3"]
    x3 = mtp.run(0, mx.array([[second]]), mtp.chained(x2, 0), cache)
    return {f"depth{d}": mtp.logits(x, 0).astype(mx.float32)
            for d, x in ((1, x1), (2, x2), (3, x3))}


def differences(ours, expected) -> dict[str, float]:
    return {k: mx.abs(ours[k] - expected[k]).max().item() for k in ours}


def test_fixture_is_what_mlx_vlm_produced(expected):
    assert META["made_with"]["mlx_vlm"] == "0.7.10"
    inputs = mx.load(str(FIXTURES / "inputs.safetensors"))
    length = inputs["hidden"].shape[1]
    vocab = json.loads((TARGET / "config.json").read_text())["text_config"]["vocab_size"]
    assert inputs["ids"].shape == (1, length + 1)
    assert expected["depth1"].shape == (1, length, vocab)
    assert expected["depth2"].shape == expected["depth3"].shape == (1, 1, vocab)
    assert META["positions"] == {"depth1": list(range(length)), "depth2": length,
                                 "depth3": length + 1}
    # depth 3's token is the argmax of depth 2, as mlx-vlm's chain picked it
    assert int(mx.argmax(expected["depth2"][0, -1])) == META["chain_tokens"][1]


def test_draft_logits_equal_mlx_vlm(checkpoint, expected):
    """Depth 1 at every position, depth 2 and 3 chained on the module's own hidden."""
    model, config, tensors = checkpoint
    ours = draft_logits(build_mtp_model(model, config, tensors, published=True))
    for depth, difference in differences(ours, expected).items():
        assert ours[depth].shape == expected[depth].shape, depth
        scale = mx.abs(expected[depth]).max().item()
        assert difference <= RELATIVE_TOLERANCE * scale, (depth, difference, scale)


def test_the_comparison_sees_a_wrong_norm_convention(checkpoint, expected):
    """The published tensors read as MLX-convention ones (no +1 on the seven norms): the
    logits move far beyond the tolerance, so the parity above is not a vacuous check."""
    model, config, tensors = checkpoint
    ours = draft_logits(build_mtp_model(model, config, tensors, published=False))
    for depth, difference in differences(ours, expected).items():
        scale = mx.abs(expected[depth]).max().item()
        assert difference > 100 * RELATIVE_TOLERANCE * scale, (depth, difference, scale)


def test_the_comparison_sees_a_wrong_position(checkpoint, expected):
    """Chaining from a cache one entry short (depth 2 at position L - 1, over L - 1 pairs) gives
    other logits: the positions and the cache contents are part of what is compared."""
    model, config, tensors = checkpoint
    mtp = build_mtp_model(model, config, tensors, published=True)
    inputs = mx.load(str(FIXTURES / "inputs.safetensors"))
    ids, hidden = inputs["ids"], inputs["hidden"]
    cache = mtp.make_cache()
    x1 = mtp.run(0, ids[:, 1:], hidden, cache)
    for c in cache[0]:
        c.trim(1)  # drop the last pair's entry
    x2 = mtp.run(0, mx.array([[META["chain_tokens"][0]]]), mtp.chained(x1[:, -1:], 0), cache)
    difference = mx.abs(mtp.logits(x2, 0) - expected["depth2"]).max().item()
    scale = mx.abs(expected["depth2"]).max().item()
    assert difference > 100 * RELATIVE_TOLERANCE * scale, (difference, scale)
