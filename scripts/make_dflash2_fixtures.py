"""Make the DFlash2 reference fixtures with z-lab's own torch drafter (PyPI `dflash` 0.1.0,
`DFlash2DraftModel`).

Runs in the separate venv scripts/make_dflash_fixtures.py uses, never in ours:

    python3 -m venv /work/dflash-ref
    /work/dflash-ref/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    /work/dflash-ref/bin/pip install "dflash==0.1.0" transformers==5.15.0 safetensors
    /work/dflash-ref/bin/python scripts/make_dflash2_fixtures.py

A tiny random DFlash2 drafter in the released layout (2 layers, one sliding_attention, all
non-causal as z-lab's config has it, H=64 in 4 conv groups, a rank-16 selector over the top 8
of 96 tokens; the codebooks saved as `candidate_selector.{predecessor,successor}_codebook`
without `.weight`) is loaded back with `DFlash2DraftModel.from_pretrained` and driven as
`dflash.model.dflash_generate` drives it: new context features plus one block per step, the
draft cache cropped to the committed length after each. Three steps: an 11-position context; 3
newly committed positions; 1 more with a shortened block. Per step it saves the block's
final-normed hidden states (slots 1..), the logits, the greedy walk (`propose` at T = 0), and a
walk sampled at T = 0.7 with its candidates and q (a test forces that path and compares q).
"""

import json
from pathlib import Path

import safetensors.torch
import torch
import transformers
from dflash.model import DFlash2DraftModel, _output_head
from make_dflash_fixtures import (
    BLOCK, H, LAYER_IDS, MASK, TARGET_LAYERS, VOCAB, drive, random_target, save_reference,
)

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "dflash2"
TEMPERATURE = 0.7

CONFIG = {
    "architectures": ["DFlash2DraftModel"],
    "model_type": "qwen3",
    "hidden_size": H,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "max_position_embeddings": 256,
    "vocab_size": VOCAB,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "is_causal": False,
    "layer_types": ["sliding_attention", "full_attention"],
    "use_sliding_window": True,
    "sliding_window": 5,
    "tie_word_embeddings": False,
    "num_target_layers": TARGET_LAYERS,
    "dflash_config": {
        "block_size": BLOCK,
        "mask_token_id": MASK,
        "target_layer_ids": LAYER_IDS,
        "input_embedding_scale": 0.8,
        "output_multiplier": 1.25,
        "final_logit_softcapping": 20.0,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 16,
        "selector_top_k": 8,
    },
    "torch_dtype": "float32",
}
CODEBOOKS = ("predecessor_codebook", "successor_codebook")


def random_weight(name: str, shape) -> torch.Tensor:
    """Every tensor drawn here (base_kernel starts as torch.empty): norms and taps that move
    the block, codebooks whose pair scores rival the logits."""
    noise = torch.randn(shape)
    if name.endswith("norm.weight"):
        return 1 + 0.2 * noise
    if name.endswith("base_kernel"):
        return torch.stack([1 + 0.2 * noise[0], 0.3 * noise[1]])
    if name.endswith("kernel_projection.weight"):
        return 0.1 * noise * shape[-1] ** -0.5
    if "codebook" in name:
        return 1.5 * noise * shape[-1] ** -0.25
    return noise * shape[-1] ** -0.5


def write_random_drafter(path: Path) -> dict:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    model = DFlash2DraftModel(transformers.Qwen3Config.from_dict(CONFIG))
    weights = {}
    for name, p in model.state_dict().items():
        released = name.removesuffix(".weight") if any(c in name for c in CODEBOOKS) else name
        weights[released] = random_weight(name, p.shape)
    safetensors.torch.save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return weights


@torch.inference_mode()
def main():
    torch.manual_seed(0)
    drafter_dir = OUT / "drafter"
    written = write_random_drafter(drafter_dir)
    model = DFlash2DraftModel.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    loaded = model.state_dict()
    for name, value in written.items():  # the released names mapped back, nothing left random
        key = name + ".weight" if name.endswith(CODEBOOKS) else name
        assert torch.equal(loaded[key], value), name
    assert model.layers[0].self_attn.sliding_window == 5, "reference lost the sliding window"
    assert not model.layers[0].self_attn.is_causal

    target, tensors = random_target()
    steps = []
    for i, step, features, block, hidden in drive(model, target):
        head = _output_head(target)
        logits = model.compute_logits(hidden, head)[0]
        path, candidates, _ = model.propose(hidden, block[:, 0], head, 0.0)
        torch.manual_seed(1000 + i)
        sampled, sampled_candidates, q = model.propose(hidden, block[:, 0], head, TEMPERATURE)
        tensors.update({
            f"features_{i}": features[0], f"hidden_{i}": hidden[0], f"logits_{i}": logits,
            f"path_{i}": path[0], f"candidates_{i}": candidates[0].sort(dim=-1).values,
            f"sampled_path_{i}": sampled[0], f"sampled_candidates_{i}": sampled_candidates[0],
            f"q_{i}": q[0],
        })
        steps.append(step)

    tensors = {k: v.detach().to(torch.int32 if v.dtype == torch.long else torch.float32)
               .contiguous() for k, v in tensors.items()}
    save_reference(OUT, tensors, {"steps": steps, "mask_token_id": MASK,
                                  "temperature": TEMPERATURE})

if __name__ == "__main__":
    main()
