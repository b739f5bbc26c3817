"""Make the MTP parity fixtures: a tiny random Qwen3.5 target that ships its MTP module in the
published Hugging Face layout, and the draft logits mlx-vlm 0.7.10's own Qwen3.5 MTP drafter
(`mlx_vlm/speculative/drafters/qwen3_5_mtp`) computes with it (tests/test_mtp_parity.py
compares ours against them, without needing mlx-vlm).

Two steps, the first in our venv (tests/mtp_models.py builds the target from mlx-lm's classes),
the second in mlx-vlm's own venv (the one scripts/make_mlx_vlm_hybrid_fixtures.py describes;
mlx-vlm is never installed into ours):

    .venv/bin/python scripts/make_mtp_fixtures.py --target           # 1. target + inputs
    /work/peers/mlx-vlm/bin/python scripts/make_mtp_fixtures.py      # 2. mlx-vlm's logits

What it writes to tests/fixtures/mtp/qwen3_5/ (about 250 KB, nearly all the target's 4 layers):
  target/  config.json + model.safetensors from tests/mtp_models.py write_qwen3_5 (vocabulary
           64, seed 0): `model.language_model.*` and 15 top-level `mtp.*` tensors, norms stored
           zero-centred (w, used as 1 + w), safetensors metadata format "pt", so mlx-vlm takes
           its Hugging Face path (its own +1 shift) and we ours. Its config then gets a small
           vision_config (mlx-vlm's qwen3_5 config requires one; it has no weights, so neither
           loader builds a tower).
  inputs.safetensors (step 1): `ids` (1, L + 1) token ids, `hidden` (1, L, H) a random
           target hidden state (what the target's final norm would output), `seed_token` the
           token fed at depth 2. L = 6, H = 32.
  expected.safetensors (step 2), float32:
    depth1  (1, L, V) logits of mlx-vlm's prefill: `prefill_from_target_hidden(ids[:, :L],
            hidden, bonus=ids[L])` pairs hidden[p] with ids[p + 1] at RoPE position p.
    depth2  (1, 1, V) the chained step: `draft_block` feeds the prefill's last output (its
            post-norm hidden) and `seed_token` (which the prefill's sampler returned, instead of
            its argmax) at position L.
    depth3  (1, 1, V) one more chained step at L + 1, on depth 2's hidden and its argmax token
            (`chain_tokens` holds both chain tokens).
  expected.json: versions, max |logit| per depth, the chain tokens, how mlx-vlm was driven.

mlx-vlm is driven through its public entry points: `load_drafter(target_dir, kind="mtp")`
(its Qwen3_5MTPSplitter picks the `mtp.*` tensors and runs Qwen3_5MTPDraftModel.sanitize, which
adds the 1), `load_model(target_dir)` for the target it binds to (`reset(target)`: the target's
embed_tokens and lm_head), then the two calls its round loop makes. The logits are captured
where mlx-vlm computes them: the sampler it is handed receives `lm_head(h)`, and the prefill's
per-position outputs are read off `_forward_tokens`, which the prefill calls once.
"""

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "mtp" / "qwen3_5"
TARGET = OUT / "target"
VOCAB, SEED, L = 64, 0, 6
VISION = {"model_type": "qwen3_5", "depth": 1, "hidden_size": 16, "intermediate_size": 32,
          "out_hidden_size": 32, "num_heads": 2, "patch_size": 2, "spatial_merge_size": 2,
          "temporal_patch_size": 2, "num_position_embeddings": 16}


def write_target():
    """Step 1 (our venv): the target, and the inputs both sides are fed."""
    import numpy as np

    import mlxspec  # noqa: F401  (loads OpenBLAS before mlx.core)
    import mlx.core as mx

    sys.path.insert(0, str(ROOT / "tests"))
    from mtp_models import write_qwen3_5

    write_qwen3_5(TARGET, vocab=VOCAB, seed=SEED, mtp=True)
    config = json.loads((TARGET / "config.json").read_text())
    text = config["text_config"]
    config["vision_config"] = VISION
    (TARGET / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    rng = np.random.default_rng(SEED)
    ids = rng.integers(0, VOCAB, size=(1, L + 1)).astype(np.int32)
    hidden = rng.standard_normal((1, L, text["hidden_size"])).astype(np.float32)
    seed_token = np.array([int(rng.integers(0, VOCAB))], np.int32)
    mx.save_safetensors(str(OUT / "inputs.safetensors"),
                        {"ids": mx.array(ids), "hidden": mx.array(hidden),
                         "seed_token": mx.array(seed_token)})
    print(f"wrote {TARGET} and {OUT / 'inputs.safetensors'}: ids {ids.tolist()}, "
          f"seed token {int(seed_token[0])}")


def mlx_vlm_logits():
    """Step 2 (mlx-vlm's venv): its drafter's logits on the target and inputs of step 1."""
    import mlx.core as mx
    import mlx_vlm
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import Qwen3_5MTPDraftModel
    from mlx_vlm.utils import load_model

    inputs = mx.load(str(OUT / "inputs.safetensors"))
    ids, hidden = inputs["ids"], inputs["hidden"]
    seed_token = int(inputs["seed_token"][0])

    drafter, kind = load_drafter(str(TARGET), kind="mtp")
    assert kind == "mtp" and isinstance(drafter, Qwen3_5MTPDraftModel), (kind, type(drafter))
    # Its Hugging Face path, not its MLX one: its sanitize added the 1 to the stored norms.
    stored = mx.load(str(TARGET / "model.safetensors"))
    for name in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        assert mx.array_equal(getattr(drafter, name).weight, stored[f"mtp.{name}.weight"] + 1)
    target = load_model(TARGET)
    assert getattr(target, "vision_tower", None) is None  # no weights: not built
    drafter.reset(target)  # what its round loop calls first: binds embed_tokens and lm_head

    outputs = []
    forward_tokens = drafter._forward_tokens

    def recording_forward_tokens(*args, **kwargs):
        h = forward_tokens(*args, **kwargs)
        outputs.append(h)
        return h

    drafter._forward_tokens = recording_forward_tokens
    sampled = []

    def sampler(logits):
        """The seed (draft 1) is `seed_token`; later drafts are the argmax."""
        sampled.append(logits.astype(mx.float32))
        if len(sampled) == 1:
            return mx.array([[seed_token]], dtype=mx.int32)
        return mx.argmax(logits, axis=-1)

    drafter.prefill_from_target_hidden(ids[:, :L], hidden, bonus_token=int(ids[0, L]),
                                       sampler=sampler, greedy=False)
    assert len(outputs) == 1 and outputs[0].shape[1] == L, [o.shape for o in outputs]
    depth1 = drafter._lm_head_fn(outputs[0]).astype(mx.float32)
    # The seed's logits (the prefill's sampler) are the last position's.
    assert mx.array_equal(sampled[0][:, -1], depth1[:, -1]), "seed logits differ"
    drafts = drafter.draft_block(int(ids[0, L]), None, None, 4, sampler, greedy=False)
    assert drafts.shape == (1, 3) and int(drafts[0, 0]) == seed_token, drafts
    assert len(outputs) == 3 and len(sampled) == 3
    assert all(c.offset == L + 2 for c in drafter._cache)  # L pairs + 2 chained steps
    depth2, depth3 = sampled[1], sampled[2]
    chain_tokens = [seed_token, int(drafts[0, 1])]

    expected = {"depth1": depth1, "depth2": depth2, "depth3": depth3,
                "chain_tokens": mx.array(chain_tokens, dtype=mx.int32)}
    mx.save_safetensors(str(OUT / "expected.safetensors"), expected)
    scale = {k: float(mx.abs(v).max()) for k, v in expected.items() if k.startswith("depth")}
    meta = {
        "positions": {"depth1": list(range(L)), "depth2": L, "depth3": L + 1},
        "chain_tokens": chain_tokens,
        "max_abs_logit": scale,
        "driven_by": "load_drafter(target, kind='mtp'); reset(load_model(target)); "
                     "prefill_from_target_hidden(ids[:, :L], hidden, ids[L]); "
                     "draft_block(block_size=4)",
        "made_with": {"mlx_vlm": mlx_vlm.__version__, "mlx": mx.__version__,
                      "device": str(mx.default_device())},
    }
    text = json.dumps(meta, indent=1)  # lists of numbers on one line each
    text = re.sub(r"\[\s+([-\d.,\s]*?)\s+\]", lambda m: "[" + " ".join(m[1].split()) + "]", text)
    (OUT / "expected.json").write_text(text + "\n")
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"mlx-vlm {mlx_vlm.__version__} (mlx {mx.__version__}): max |logit| {scale}; "
          f"chain tokens {chain_tokens}; wrote {OUT} ({total / 1024:.0f} KiB)")


if __name__ == "__main__":
    if "--target" in sys.argv[1:]:
        write_target()
    else:
        mlx_vlm_logits()
