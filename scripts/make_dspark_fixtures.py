"""Make the DSpark reference fixtures with DeepSeek's own torch drafter (deepseek-ai/DeepSpec,
`Qwen3DSparkModel`, and its evaluator's `forward_dspark_draft_block`).

DeepSpec is not on PyPI; it runs from its source tree in the venv scripts/make_dflash_fixtures.py
uses (torch 2.13 CPU, transformers 5.15; DeepSpec pins torch 2.9.1 and transformers 5.10.2, and
its Qwen3 path runs the same on these):

    git clone https://github.com/deepseek-ai/DeepSpec /work/DeepSpec
    PYTHONPATH=/work/DeepSpec /work/dflash-ref/bin/python scripts/make_dspark_fixtures.py

A tiny random DSpark in DeepSpec's own layout (2 full-attention layers, H=64, a block of 4, a
rank-8 Markov head, a confidence head reading [h ; W1[x]]; its embed_tokens and lm_head, as
DeepSpec saves them) is saved with DeepSpec's names and driven as its evaluator drives it: new
context features and one whole block per step, the draft cache cropped to the committed length
after each. Two steps: an 11-position context; 3 more committed positions and a new anchor.
Per step it saves the block's hidden states, its base logits, the greedy walk
(`sample_draft_tokens` at T = 0), the confidences along it (`predict_confidence_step`), and for a
fixed token path the Markov-corrected logits and q at T = 0.7 (no random draw to match).
"""

import json
from pathlib import Path

import safetensors.torch
import torch
from deepspec.eval.dspark.draft_ops import forward_dspark_draft_block
from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel
from transformers import DynamicCache, Qwen3Config

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "dspark"
H, VOCAB, TARGET_LAYERS, LAYER_IDS, BLOCK, RANK = 64, 96, 6, [1, 4], 4, 8
MASK = VOCAB - 1
STEPS = [11, 3]  # new context rows per step
TEMPERATURE = 0.7

CONFIG = {
    "architectures": ["Qwen3DSparkModel"],
    "model_type": "qwen3",
    "hidden_size": H,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "vocab_size": VOCAB,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "layer_types": ["full_attention", "full_attention"],
    "num_target_layers": TARGET_LAYERS,
    "block_size": BLOCK,
    "target_layer_ids": LAYER_IDS,
    "mask_token_id": MASK,
    "num_anchors": 8,
    "markov_rank": RANK,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
    "torch_dtype": "float32",
}


def random_weight(name: str, shape) -> torch.Tensor:
    noise = torch.randn(shape)
    if name.endswith("norm.weight"):
        return 1 + 0.2 * noise
    if name.startswith("markov_head"):
        return 1.5 * noise * shape[-1] ** -0.25  # a bias that rivals the logits
    if name == "lm_head.weight":
        return 4 * noise * shape[-1] ** -0.5
    if name == "embed_tokens.weight":
        return noise
    return noise * shape[-1] ** -0.5


def build() -> Qwen3DSparkModel:
    config = Qwen3Config.from_dict({k: v for k, v in CONFIG.items() if k != "torch_dtype"})
    config._attn_implementation = "eager"
    model = Qwen3DSparkModel(config).float().eval()
    weights = {name: random_weight(name, p.shape) for name, p in model.state_dict().items()
               if not name.endswith("inv_freq")}
    model.load_state_dict(weights, strict=False)
    OUT.joinpath("drafter").mkdir(parents=True, exist_ok=True)
    (OUT / "drafter" / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    safetensors.torch.save_file(weights, OUT / "drafter" / "model.safetensors",
                                metadata={"format": "pt"})
    return model


@torch.inference_mode()
def main():
    torch.manual_seed(0)
    model = build()
    cache, positions = DynamicCache(), torch.arange(64)[None]
    tensors, steps, start = {}, [], 0
    for i, new in enumerate(STEPS):
        start += new
        features = torch.randn(1, new, len(LAYER_IDS) * H)
        block = torch.full((1, BLOCK), MASK, dtype=torch.long)
        block[0, 0] = int(torch.randint(0, VOCAB - 1, ()))
        hidden = forward_dspark_draft_block(
            model, draft_input_ids=block, position_ids=positions, past_key_values_draft=cache,
            target_hidden_states=features, start=start, block_size=BLOCK)[:, :BLOCK]
        base = model.compute_logits(hidden)
        greedy, _ = model.sample_draft_tokens(base, first_prev_token_ids=block[:, 0],
                                              temperature=0.0, hidden_states=hidden)
        before = torch.cat([block[:, :1], greedy[:, :-1]], dim=1)
        confidence = model.predict_confidence_step(hidden, prev_token_ids=before).sigmoid()
        path = torch.randint(0, VOCAB, (1, BLOCK))  # a fixed path: q given its prefixes
        path_before = torch.cat([block[:, :1], path[:, :-1]], dim=1)
        corrected = torch.stack([
            model.markov_head.apply_step_logits(base[:, k], token_ids=path_before[:, k],
                                                hidden_states=None)
            for k in range(BLOCK)], dim=1)
        q = torch.softmax(corrected.float() / TEMPERATURE, dim=-1)
        tensors.update({
            f"features_{i}": features[0], f"hidden_{i}": hidden[0], f"logits_{i}": base[0],
            f"greedy_{i}": greedy[0], f"confidence_{i}": confidence[0], f"path_{i}": path[0],
            f"q_{i}": q[0],
        })
        steps.append({"new_context": new, "start": start, "pending": int(block[0, 0])})
    tensors = {k: v.detach().to(torch.int32 if v.dtype == torch.long else torch.float32)
               .contiguous() for k, v in tensors.items()}
    safetensors.torch.save_file(tensors, OUT / "reference.safetensors")
    meta = {"steps": steps, "block_size": BLOCK, "temperature": TEMPERATURE,
            "made_with": {"DeepSpec": "deepseek-ai/DeepSpec afdfa7c", "torch": torch.__version__}}
    (OUT / "reference.json").write_text(json.dumps(meta, indent=2) + "\n")
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"wrote {OUT} ({total / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
