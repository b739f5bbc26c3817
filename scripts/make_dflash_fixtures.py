"""Make the DFlash reference fixtures with z-lab's own torch drafter (PyPI `dflash` 0.1.0).

Runs in a separate venv, never in ours (it pins torch 2.13.0 and transformers 5.15.0):

    python3 -m venv /work/dflash-ref
    /work/dflash-ref/bin/pip install torch==2.13.0       # CPU wheel first, no CUDA download
    /work/dflash-ref/bin/pip install "dflash[local]==0.1.0" safetensors
    /work/dflash-ref/bin/python scripts/make_dflash_fixtures.py

A tiny random drafter in the released format (2 layers, one sliding_attention, H=64) is loaded
back with `DFlashDraftModel.from_pretrained` and driven exactly as `dflash.model.dflash_generate`
drives it: new context features plus one block per step, the draft cache cropped back to the
committed length after each block. Three steps: an 11-position prompt context; 3 newly committed
positions; 1 more with a shortened block (as near max_tokens). The drafts' logits are saved.
"""

import json
from pathlib import Path

import dflash
import safetensors.torch
import torch
import transformers
from dflash.model import (
    DFlashDraftModel,
    _crop_to,
    _draft_value,
    _make_cache,
    _output_head,
    _raw_input_embeddings,
)

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "dflash"
H, VOCAB, TARGET_LAYERS, LAYER_IDS, BLOCK = 64, 96, 6, [1, 4], 8
MASK = VOCAB - 1
# (new context rows, block length) per step; positions follow from the running total.
STEPS = [(11, BLOCK), (3, BLOCK), (1, 5)]

CONFIG = {
    "architectures": ["DFlashDraftModel"],
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
    "layer_types": ["sliding_attention", "full_attention"],
    "use_sliding_window": True,
    "sliding_window": 5,
    "tie_word_embeddings": False,
    "block_size": BLOCK,
    "num_target_layers": TARGET_LAYERS,
    "dflash_config": {
        "mask_token_id": MASK,
        "target_layer_ids": LAYER_IDS,
        "input_embedding_scale": 0.8,
        "output_multiplier": 1.25,
        "final_logit_softcapping": 20.0,
    },
    "torch_dtype": "float32",
}


class TinyTarget(torch.nn.Module):
    """Just what dflash_generate takes from a target: input embeddings and lm_head."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(VOCAB, H)
        self.lm_head = torch.nn.Linear(H, VOCAB, bias=False)

    def get_input_embeddings(self):
        return self.embed_tokens


def write_random_drafter(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    model = DFlashDraftModel(transformers.Qwen3Config.from_dict(CONFIG))
    weights = {}
    for name, p in model.state_dict().items():
        if name.endswith("norm.weight"):  # non-trivial norms, so a missed norm shows
            weights[name] = 1 + 0.2 * torch.randn(p.shape)
        else:
            weights[name] = torch.randn(p.shape) * p.shape[-1] ** -0.5
    safetensors.torch.save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def random_target() -> tuple[TinyTarget, dict]:
    """The tiny target (normal embeddings, a head sharp enough to rank), and its tensors."""
    target = TinyTarget()
    torch.nn.init.normal_(target.embed_tokens.weight)
    torch.nn.init.normal_(target.lm_head.weight, std=4 * H**-0.5)
    return target, {"embed_tokens": target.embed_tokens.weight, "lm_head": target.lm_head.weight}


def drive(model, target):
    """The STEPS as dflash_generate runs them: new context features and one block per step,
    context + block positions, the draft cache cropped after. Yields (i, the step's record,
    features, block, the block's hidden states of slots 1..)."""
    position_ids = torch.arange(64)[None]
    cache = _make_cache(model.config)
    scale = float(_draft_value(model.config, "input_embedding_scale", 1.0))
    start = 0
    for i, (new, length) in enumerate(STEPS):
        start += new  # positions start-new .. start-1 were just committed
        features = torch.randn(1, new, len(LAYER_IDS) * H)
        block = torch.full((1, length), MASK, dtype=torch.long)
        block[0, 0] = int(torch.randint(0, VOCAB - 1, ()))
        hidden = model(
            target_hidden=features,
            noise_embedding=_raw_input_embeddings(target, block, scale),
            position_ids=position_ids[:, start - new : start + length],
            past_key_values=cache,
            use_cache=True,
        )[:, 1 - length :, :]
        _crop_to(cache, start)
        yield i, {"new_context": new, "start": start, "block_length": length,
                  "pending": int(block[0, 0])}, features, block, hidden


@torch.inference_mode()
def main():
    torch.manual_seed(0)
    drafter_dir = OUT / "drafter"
    write_random_drafter(drafter_dir)
    model = DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    assert model.layers[0].self_attn.sliding_window == 5, "reference lost the sliding window"

    target, tensors = random_target()
    steps = []
    for i, step, features, block, hidden in drive(model, target):
        logits = model.compute_logits(hidden, _output_head(target))[0]
        tensors[f"features_{i}"] = features[0]
        tensors[f"logits_{i}"] = logits
        steps.append(step)

    tensors = {k: v.detach().float().contiguous() for k, v in tensors.items()}
    save_reference(OUT, tensors, {"steps": steps, "mask_token_id": MASK})


def save_reference(out: Path, tensors: dict, meta: dict) -> None:
    """reference.safetensors and reference.json (`meta` and the versions that made them)."""
    safetensors.torch.save_file(tensors, out / "reference.safetensors")
    meta["made_with"] = {"dflash": getattr(dflash, "__version__", "0.1.0"),
                         "torch": torch.__version__, "transformers": transformers.__version__}
    (out / "reference.json").write_text(json.dumps(meta, indent=2) + "\n")
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {out} ({total / 1024:.0f} KiB)")

if __name__ == "__main__":
    main()
