"""Make the Medusa parity fixtures: a tiny random Llama target, two Medusa head sets in the
published (Medusa-1, "v0.1") layout, and the logits the reference implementation computes with
them (tests against mlxspec's own Medusa heads compare with these).

Run in its own venv, never in ours (the reference is medusa-llm 0.1, the only release on PyPI):

    python3 -m venv /work/peers/medusa
    /work/peers/medusa/bin/pip install --no-deps medusa-llm==0.1
    /work/peers/medusa/bin/pip install /opt/wheels/torch-2.13.0+cpu-*.whl   # or torch==2.13.0 (CPU)
    /work/peers/medusa/bin/pip install transformers==4.34.1 "numpy<2" safetensors \
        sentencepiece protobuf accelerate==0.24.1
    /work/peers/medusa/bin/python scripts/make_medusa_fixtures.py

(fschat, also a dependency of medusa-llm, is only imported by medusa.train / medusa.inference,
not by medusa.model, and is not installed.)

Written to tests/fixtures/medusa/ (see its README.md):
  target/          tiny LlamaForCausalLM (hidden 64, 2 layers, 4 heads / 2 kv heads, vocab 512),
                   save_pretrained(safe_serialization=True), plus a WordLevel tokenizer (the
                   reference's MedusaModel.__init__ calls AutoTokenizer.from_pretrained on
                   base_model_name_or_path, so the target must have one).
  heads_l1/        3 heads, medusa_num_layers=1: config.json as MedusaConfig.save_pretrained
                   writes it (base_model_name_or_path "target", relative to this folder) and
                   medusa_lm_head.safetensors = medusa_head.state_dict() (names "0.0.linear.weight",
                   "0.0.linear.bias", "0.1.weight", ...; no prefix).
  heads_l2/        the same with medusa_num_layers=2; the reference repeats ONE ResBlock object
                   in each head, so "i.0.linear.*" and "i.1.linear.*" are the same tensor (both
                   names are written, with equal values).
  expected_l1.safetensors, expected_l2.safetensors: input_ids (1, 12) int32, base_logits
                   (1, 12, 512), medusa_logits (3, 1, 12, 512), hidden_states (1, 12, 64) = the
                   final-norm output that fed the heads; all float32.

The forward is the reference's: MedusaModel.from_pretrained(heads dir) (which loads
medusa_lm_head.pt with torch.load: the .pt is written to a temporary copy of the heads dir with
the reference's own torch.save(medusa_head.state_dict())) and then
model(input_ids, output_orig=True). Weights are numpy draws in sorted name order (fixed seeds),
so a rerun writes the same bytes.
"""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import medusa.model.medusa_model as medusa_model
from medusa.model.medusa_model import MedusaConfig, MedusaModel
from medusa.model.modeling_llama_kv import LlamaForCausalLM as KVLlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "medusa"
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB, MAX_POS = 64, 128, 2, 4, 2, 512, 256
NUM_MEDUSA_HEADS = 3
INPUT_IDS = [1, 17, 301, 42, 5, 498, 260, 77, 133, 9, 411, 256]  # 12 ids, batch 1
HEAD_SETS = [("l1", 1, 101), ("l2", 2, 202)]  # (name, medusa_num_layers, seed)


def say(*a):
    print(*a, flush=True)


def fill(module: torch.nn.Module, seed: int, scales) -> None:
    """Overwrite every parameter (named_parameters: shared ones once) with numpy draws, in
    sorted name order. scales(name, shape) -> (mean, std)."""
    rng = np.random.default_rng(seed)
    for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        mean, std = scales(name, tuple(p.shape))
        draw = mean + std * rng.standard_normal(p.shape)
        with torch.no_grad():
            p.copy_(torch.from_numpy(draw.astype(np.float32)))


def target_scales(name, shape):
    if "norm" in name:
        return 1.0, 0.1  # RMSNorm weights around 1, not exactly 1
    if "embed_tokens" in name:
        return 0.0, 1.0
    return 0.0, 1.0 / np.sqrt(shape[-1])  # Linear: std 1/sqrt(fan_in)


def head_scales(name, shape):
    # ResBlock linear (the reference zero-initialises its weight) and the head projection.
    if name.endswith("linear.bias"):
        return 0.0, 0.2
    return 0.0, 1.0 / np.sqrt(shape[-1])


def make_tokenizer(path: Path) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"t{i}": i for i in range(3, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(str(path))


def make_target() -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=MAX_POS,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,  # the reference's KV Llama hard-codes base 10000 (ignores rope_theta)
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    fill(model, 0, target_scales)
    return model


def maxdiff(a, b) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max())


def main() -> int:
    say(f"medusa-llm reference from {medusa_model.__file__}")
    say(f"torch {torch.__version__}, transformers {transformers.__version__}, numpy {np.__version__}")
    OUT.mkdir(parents=True, exist_ok=True)
    for sub in ["target", "heads_l1", "heads_l2"]:
        shutil.rmtree(OUT / sub, ignore_errors=True)
    for f in OUT.glob("expected_*.safetensors"):
        f.unlink()

    hf_target = make_target()
    hf_target.save_pretrained(str(OUT / "target"), safe_serialization=True)
    make_tokenizer(OUT / "target")
    ids = torch.tensor([INPUT_IDS], dtype=torch.long)
    with torch.no_grad():
        hf_out = hf_target(ids, output_hidden_states=True)
    hf_logits, hf_hidden = hf_out.logits, hf_out.hidden_states[-1]  # last = after final norm

    # base_model_name_or_path "target" is resolved against the working directory, as on the hub.
    os.chdir(OUT)
    ok = True
    for name, num_layers, seed in HEAD_SETS:
        say(f"--- heads_{name}: medusa_num_heads={NUM_MEDUSA_HEADS}, medusa_num_layers={num_layers}")
        # What MedusaModel.from_pretrained does: load the base with the reference's KV Llama and
        # wrap it with MedusaModel (heads built by its __init__).
        base = KVLlamaForCausalLM.from_pretrained("target", torch_dtype=torch.float32)
        model = MedusaModel(base, NUM_MEDUSA_HEADS, num_layers, "target").eval()
        head = model.medusa_head
        # Facts about the reference's construction, before randomising.
        for i in range(NUM_MEDUSA_HEADS):
            blocks = [head[i][j] for j in range(num_layers)]
            assert all(b is blocks[0] for b in blocks), "ResBlocks in a head are distinct objects"
            assert float(blocks[0].linear.weight.detach().abs().max()) == 0.0
            assert float(blocks[0].linear.bias.detach().abs().max()) > 0.0  # default nn.Linear init
            assert torch.equal(head[i][-1].weight, base.lm_head.weight)
            assert head[i][-1].bias is None
        if NUM_MEDUSA_HEADS > 1:
            assert head[0][0] is not head[1][0]
        say("  init: ResBlock weight zero, bias default-random (not zero); projection = copy of "
            "lm_head, no bias; ResBlocks within a head are "
            + ("one shared object" if num_layers > 1 else "a single block"))
        fill(head, seed, head_scales)
        sd = head.state_dict()
        say("  state_dict keys: " + ", ".join(f"{k}{tuple(v.shape)}" for k, v in sd.items()))
        say("  named_parameters: " + ", ".join(n for n, _ in head.named_parameters()))
        if num_layers > 1:
            shared = sd["0.0.linear.weight"].data_ptr() == sd["0.1.linear.weight"].data_ptr()
            say(f"  0.0.linear.weight and 0.1.linear.weight share storage: {shared}")
            try:
                save_file(sd, tempfile.mktemp(suffix=".safetensors"))
                say("  safetensors save_file(state_dict) accepted the shared tensors")
            except Exception as e:  # what train_legacy.py's save_file would hit
                say(f"  safetensors save_file(state_dict) refuses it: {type(e).__name__}: "
                    f"{next((l for l in str(e).splitlines() if l.strip()), '')[:100]}")

        # The published layout.
        hdir = OUT / f"heads_{name}"
        hdir.mkdir()
        MedusaConfig(
            medusa_num_heads=NUM_MEDUSA_HEADS,
            medusa_num_layers=num_layers,
            base_model_name_or_path="target",
        ).save_pretrained(str(hdir))
        save_file({k: v.detach().clone().contiguous() for k, v in sd.items()},
                  str(hdir / "medusa_lm_head.safetensors"))

        # Load it back through the reference's own loader (it reads only medusa_lm_head.pt).
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(hdir / "config.json", tmp)
            torch.save(sd, os.path.join(tmp, "medusa_lm_head.pt"))  # what train.py writes
            loaded = MedusaModel.from_pretrained(tmp, torch_dtype=torch.float32).eval()
        lsd = loaded.medusa_head.state_dict()
        assert list(lsd) == list(sd) and all(torch.equal(lsd[k], sd[k]) for k in sd)

        medusa_logits, outputs, base_logits = loaded(input_ids=ids, output_orig=True)
        hidden = outputs[0]

        # Cross-checks: transformers' Llama agrees with the reference's KV Llama; the heads are
        # x <- x + silu(W x + b) num_layers times (the same W, b), then P x.
        d_base, d_hidden = maxdiff(base_logits, hf_logits), maxdiff(hidden, hf_hidden)
        saved = load_file(str(hdir / "medusa_lm_head.safetensors"))
        manual = []
        for i in range(NUM_MEDUSA_HEADS):
            x = hidden
            for j in range(num_layers):
                w, b = saved[f"{i}.{j}.linear.weight"], saved[f"{i}.{j}.linear.bias"]
                x = x + torch.nn.functional.silu(x @ w.T + b)
            manual.append(x @ saved[f"{i}.{num_layers}.weight"].T)
        d_manual = maxdiff(torch.stack(manual), medusa_logits)
        say(f"  |reference - transformers| base logits {d_base:.2e}, hidden {d_hidden:.2e}; "
            f"|reference heads - by hand| {d_manual:.2e}")
        ok &= d_base < 1e-4 and d_hidden < 1e-4 and d_manual < 1e-4
        pre_norm = maxdiff(hf_out.hidden_states[-1], hf_out.hidden_states[-2])
        say(f"  (final norm changes the hidden state by up to {pre_norm:.3f})")

        expected = {
            "input_ids": ids.to(torch.int32),
            "base_logits": base_logits.detach().float().contiguous(),
            "medusa_logits": medusa_logits.detach().float().contiguous(),
            "hidden_states": hidden.detach().float().contiguous(),
        }
        save_file(expected, str(OUT / f"expected_{name}.safetensors"))
        for k, v in expected.items():
            say(f"  {k}: {tuple(v.shape)} {v.dtype}"
                + ("" if k == "input_ids" else f", max |value| {float(v.abs().max()):.4f}"))
        say("  argmax per head at the last position: "
            f"base {int(base_logits[0, -1].argmax())}, heads "
            f"{[int(medusa_logits[i, 0, -1].argmax()) for i in range(NUM_MEDUSA_HEADS)]}")

    for f in OUT.rglob("*"):
        if f.is_file():
            f.chmod(0o644)  # safetensors writes 0600
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    say(f"total size of {OUT}: {total} bytes")
    ok &= total < 2 * 1024 * 1024
    say("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
