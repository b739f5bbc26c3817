"""Make the mlx-vlm parity fixtures: a tiny random hybrid (qwen3_5) target, a tiny random DFlash
drafter in z-lab's released layout, and the greedy tokens mlx-vlm 0.7.10's own speculative loop
produces with them (tests/test_mlx_vlm_parity.py compares ours against them).

Runs in a separate venv, never in ours (mlx-vlm pulls transformers, opencv, mlx-audio...):

    python3 -m venv /work/peers/mlx-vlm
    /work/peers/mlx-vlm/bin/pip install "mlx-vlm==0.7.10" "mlx[cpu]"   # resolved mlx 0.32.4
    /work/peers/mlx-vlm/bin/python scripts/make_mlx_vlm_hybrid_fixtures.py

What it writes to tests/fixtures/mlx_vlm_hybrid/ (about 270 KB):
  target/   config.json (model_type qwen3_5, a text_config and a tiny vision_config that neither
            loader materialises), model.safetensors (float32, MLX layout, "language_model.*"
            names only: mlx-vlm drops the weightless vision tower, mlx-lm ignores it), and a
            byte-level BPE tokenizer.json of 96 single characters (no merges): transformers
            always loads a qwen3_5 directory's tokenizer as Qwen3_5Tokenizer, which rebuilds a
            BPE from tokenizer.json's vocab, so a word-level tokenizer would encode to nothing.
  drafter/  config.json + model.safetensors: z-lab's DFlashDraftModel layout (model_type qwen3,
            dflash_config.mask_token_id / target_layer_ids), one full_attention layer.
  reference.json, reference.safetensors: per prompt the ids, mlx-vlm's plain greedy tokens, its
            DFlash speculative tokens (fixed block size, and its own adaptive block sizing) and
            per-round drafted/accepted counts; the plain path's log-probabilities for prompt 0.

Both loaders read the same files unchanged: in MLX layout (conv1d weights (C, K, 1), RMSNorm
weights used as stored) neither sanitizer converts anything (mlx-vlm adds 1 to norm weights only
for names outside "language_model." or for HF-layout checkpoints; mlx-lm only for HF layout).

Weights are numpy draws (seed 0) in sorted parameter order, so a rerun writes the same files.
A random drafter agrees with a random target about 1 time in 96. To exercise partial acceptance
and rollback, every embedding row gets +3.5 on dimension 0, and so do the LM-head rows of 4
tokens: the target then prefers those 4 (which one depends on the context) and the drafter,
reading the same embedding and head, proposes them. 0-2 of 4 drafts are accepted per round;
with a 2-token block (prompt 2) the one draft is now and then accepted, so nothing rolls back.
"""

import json
import re
from pathlib import Path

import mlx.core as mx
import mlx_vlm
import numpy as np
import transformers
from mlx.utils import tree_flatten
from mlx_vlm.generate.ar import generate_step
from mlx_vlm.models import qwen3_5
from mlx_vlm.speculative.drafters import load_drafter
from mlx_vlm.speculative.drafters.qwen3_dflash import DFlashDraftModel
from mlx_vlm.speculative.drafters.qwen3_dflash import ModelConfig as DFlashConfig
from mlx_vlm.utils import load_model

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "mlx_vlm_hybrid"
VOCAB, H, BLOCK, MAX_TOKENS = 96, 32, 5, 32
MASK = VOCAB - 1  # "\n"
FAVOURED, BIAS = (7, 19, 33, 71), 3.5  # the characters ( 4 B h

# tests/tiny_models.py HYBRID_SIZES: 4 layers, full attention every 2nd (linear, full, ...).
TEXT_CONFIG = {
    "model_type": "qwen3_5_text",
    "hidden_size": H,
    "num_hidden_layers": 4,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
    "full_attention_interval": 2,
    "vocab_size": VOCAB,
    "tie_word_embeddings": False,
    "attention_bias": False,
    # 4 rotary dims (2 frequencies); text-only positions are equal in all 3 M-RoPE sections, so
    # mlx-vlm's interleaved M-RoPE is mlx-lm's plain RoPE.
    "rope_parameters": {"type": "default", "mrope_section": [1, 1, 0], "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.5},
}
TARGET_CONFIG = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "tie_word_embeddings": False,
    "text_config": TEXT_CONFIG,
    "vision_config": {"model_type": "qwen3_5", "depth": 1, "hidden_size": 16,
                      "intermediate_size": 32, "out_hidden_size": H, "num_heads": 2,
                      "patch_size": 2, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "num_position_embeddings": 16},
}
DRAFTER_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": H,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "vocab_size": VOCAB,
    "attention_bias": False,
    # full_attention only: mlx-vlm 0.7.10 runs sliding_attention layers non-causally inside the
    # block (its DFlashConfig.is_causal defaults to False), z-lab's reference and ours causally.
    "layer_types": ["full_attention"],
    "tie_word_embeddings": False,
    "block_size": BLOCK,
    "num_target_layers": 4,
    # Not the last layer: z-lab (and we) feed hidden_states[-1] after the final norm, mlx-vlm
    # captures every layer before it.
    "dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 2]},
    "torch_dtype": "float32",
}
# (prompt text, block size: None = the checkpoint's, else mlx-vlm's draft_block_size override)
PROMPTS = [
    ("Speculative decoding on a hybrid target.", None),
    ("def rollback(state): return state[:keep]", None),
    ("0 1 1 2 3 5 8 13 21 34 55 89", 2),
]


QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
              r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def byte_level_vocab() -> dict[str, int]:
    """ids 0-93: the printable ASCII characters ! .. ~; 94: space; 95: newline, in GPT-2's
    byte-to-unicode spelling (printable ASCII stands for itself, space is 'Ġ', newline 'Ċ')."""
    vocab = {chr(c): c - 33 for c in range(33, 127)}
    vocab["\u0120"], vocab["\u010a"] = 94, 95
    return vocab


def write_tokenizer(path: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    # Qwen3_5Tokenizer's own pipeline (transformers.models.qwen3_5.tokenization_qwen3_5).
    tok = Tokenizer(BPE(vocab=byte_level_vocab(), merges=[], unk_token=None, fuse_unk=False,
                        byte_fallback=False))
    tok.decoder = decoders.ByteLevel()
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "Qwen2Tokenizer", "model_max_length": 256}, indent=2) + "\n")


def random_weights(module, rng, prefix: str = "") -> dict[str, mx.array]:
    weights = {}
    for name, p in sorted(tree_flatten(module.parameters())):
        shape = tuple(p.shape)
        if name.endswith("A_log"):
            w = np.log(rng.uniform(1, 16, shape))
        elif name.endswith("dt_bias"):
            w = rng.uniform(-1, 1, shape)
        elif name.endswith("norm.weight"):  # non-trivial norms, so a missed norm shows
            w = 1 + 0.1 * rng.standard_normal(shape)
        elif "conv1d" in name:
            w = 0.5 * rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) * shape[-1] ** -0.5
        weights[prefix + name] = mx.array(w.astype(np.float32))
    return weights


def write_models(rng) -> None:
    target_dir, drafter_dir = OUT / "target", OUT / "drafter"
    for d in (target_dir, drafter_dir):
        d.mkdir(parents=True, exist_ok=True)
    model = qwen3_5.Model(qwen3_5.ModelConfig.from_dict(json.loads(json.dumps(TARGET_CONFIG))))
    weights = random_weights(model.language_model, rng, "language_model.")
    embed, head = "language_model.model.embed_tokens.weight", "language_model.lm_head.weight"
    shift = np.zeros((VOCAB, H), np.float32)
    shift[:, 0] = BIAS
    weights[embed] = weights[embed] + mx.array(shift)
    favoured = np.zeros((VOCAB, H), np.float32)
    favoured[list(FAVOURED), 0] = BIAS
    weights[head] = weights[head] + mx.array(favoured)
    (target_dir / "config.json").write_text(json.dumps(TARGET_CONFIG, indent=2) + "\n")
    mx.save_safetensors(str(target_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_tokenizer(target_dir)

    drafter = DFlashDraftModel(DFlashConfig.from_dict(json.loads(json.dumps(DRAFTER_CONFIG))))
    (drafter_dir / "config.json").write_text(json.dumps(DRAFTER_CONFIG, indent=2) + "\n")
    mx.save_safetensors(str(drafter_dir / "model.safetensors"), random_weights(drafter, rng),
                        metadata={"format": "mlx"})


def speculative(target, drafter, ids, block, *, fixed: bool):
    """mlx-vlm's DFlash round loop through its public generate_step; `fixed` turns off its
    acceptance-driven block sizing (_dflash_next_block_size) so every round drafts block-1."""
    drafter.prefer_requested_block_size = fixed
    tokens = [int(t) for t, _ in generate_step(
        ids, target, None, None, max_tokens=MAX_TOKENS, temperature=0.0,
        draft_model=drafter, draft_kind="dflash", draft_block_size=block)]
    return tokens, [int(n) for n in drafter.draft_lens], [int(a) for a in drafter.accept_lens]


def main():
    rng = np.random.default_rng(0)
    write_models(rng)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(OUT / "target"))
    target = load_model(OUT / "target")
    drafter, kind = load_drafter(str(OUT / "drafter"), kind="dflash")
    assert kind == "dflash" and isinstance(drafter, DFlashDraftModel), (kind, type(drafter))
    assert target.vision_tower is None  # dropped: the checkpoint has no weights for it

    cases, tensors = [], {}
    for i, (text, block) in enumerate(PROMPTS):
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text and len(ids) == len(text), (text, ids)
        prompt = mx.array([ids])
        plain, logprobs = [], []
        for token, lp in generate_step(prompt, target, None, None, max_tokens=MAX_TOKENS,
                                       temperature=0.0):
            plain.append(int(token))
            logprobs.append(lp.reshape(-1).astype(mx.float32))
        logprobs = mx.stack(logprobs)
        top2 = mx.sort(logprobs, axis=-1)[:, -2:]
        margin = float(mx.min(top2[:, 1] - top2[:, 0]).item())
        if i == 0:
            tensors["plain_logprobs_0"] = logprobs
        fixed, draft_lens, accept_lens = speculative(target, drafter, prompt, block, fixed=True)
        adaptive, adaptive_drafts, _ = speculative(target, drafter, prompt, block, fixed=False)
        cases.append({
            "text": text,
            "prompt": ids,
            "block_size": block or BLOCK,
            "plain": plain,
            "speculative": fixed,
            "draft_lens": draft_lens,
            "accept_lens": accept_lens,
            "speculative_adaptive_blocks": adaptive,
            "adaptive_draft_lens": adaptive_drafts,
            "min_top2_logprob_margin": margin,
        })
        print(f"prompt {i}: plain == speculative: {plain == fixed == adaptive}; accepted per "
              f"round {accept_lens} of {draft_lens}; adaptive rounds drafted {adaptive_drafts}; "
              f"smallest top-1/top-2 log-prob gap {margin:.3f}")

    mx.save_safetensors(str(OUT / "reference.safetensors"), tensors)
    meta = {
        "max_tokens": MAX_TOKENS,
        "mask_token_id": MASK,
        "favoured_tokens": list(FAVOURED),
        "cases": cases,
        "made_with": {"mlx_vlm": mlx_vlm.__version__, "mlx": mx.__version__,
                      "transformers": transformers.__version__, "device": str(mx.default_device())},
    }
    text = json.dumps(meta, indent=1)  # lists of numbers on one line each
    text = re.sub(r"\[\s+([-\d.,\s]*?)\s+\]", lambda m: "[" + " ".join(m[1].split()) + "]", text)
    (OUT / "reference.json").write_text(text + "\n")
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"wrote {OUT} ({total / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
