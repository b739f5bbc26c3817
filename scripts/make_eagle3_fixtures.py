"""Make the EAGLE-3 parity fixtures: tiny random drafters in both published layouts, and the
draft logits two implementations nobody here wrote compute with them (tests/test_eagle3.py
compares ours against them).

Two runs, each in its own venv, never in ours:

    # 1. mlx-vlm 0.7.10 (the venv scripts/make_mlx_vlm_hybrid_fixtures.py describes):
    python3 -m venv /work/peers/mlx-vlm
    /work/peers/mlx-vlm/bin/pip install "mlx-vlm==0.7.10" "mlx[cpu]"   # resolved mlx 0.32.4
    /work/peers/mlx-vlm/bin/python scripts/make_eagle3_fixtures.py

    # 2. speculators 0.9.0 (vLLM's EAGLE-3 trainer; torch on the CPU), after run 1:
    python3 -m venv /work/peers/speculators
    /work/peers/speculators/bin/pip install torch==2.13.0     # the CPU wheel first
    /work/peers/speculators/bin/pip install speculators==0.9.0  # (its torchaudio pulled 2.14.1)
    /work/peers/speculators/bin/python scripts/make_eagle3_fixtures.py --speculators

The target is tests/fixtures/mlx_vlm_hybrid/target (a random qwen3_5: hidden 32, 4 layers, 96
tokens; read, not written). Drafters, written to tests/fixtures/eagle3/ (about 250 KB in all):
  speculators/     speculators layout, llama layer, hidden 32 = the target's, draft vocabulary
                   48 of 96, no embed_tokens (the target's), norm_before_residual,
                   norm_before_fc, rope_theta 50000, eagle_aux_hidden_state_layer_ids [1, 2, 4]
                   (hidden-state counting: outputs of target layers 0, 1, 3); t2d and
                   verifier_norm.weight ride along unused.
  specforge/       SpecForge/SGLang layout (LlamaForCausalLMEagle3, flat config, midlayer.*),
                   hidden 48 with target_hidden_size 32 (fc 96 -> 48), its own embed_tokens,
                   eagle_config.eagle_aux_hidden_state_layer_ids [0, 1, 3] (layer outputs).
  speculators_qwen3/  speculators layout with a qwen3 layer (q_norm/k_norm), legacy top-level
                   rope_theta, no aux ids (the default [2, L/2, L-3]: outputs of 1, 1, 0).

What mlx-vlm computes (reference.json + reference.safetensors), per drafter it can run:
  session: its Eagle3DraftModel driven as its round loop drives it, with fixed features:
    prefill_from_target_hidden on an 8-position prompt, then rounds of draft_block (greedy) and
    accept_verified_tokens with scripted verdicts (1 of 3 drafts accepted, then 2 of 2, then a
    last block). Recorded: every _forward_tokens output (the layer's hidden states), the draft
    logits of every chain step, the drafts, and the logits of every prefill position.
  generate: mlx-vlm's own speculative generate_step (draft_kind="eagle3", block 4) on the
    target, greedily: tokens, drafted and accepted counts per round, and plain greedy tokens.
What speculators computes (reference_speculators.safetensors): its Eagle3DraftModel loaded with
from_pretrained from the same directory, embed_tokens set to the target's (what its
load_verifier_weights does), forward() with 3 test-time-training steps over the same prompt
and features: the draft logits of every position at every step (captured at lm_head).

To make drafts sometimes right, every drafter prefers the 4 tokens the target favours (its
embedding rows carry +3.5 on dimension 0): dimension 0 is made a private channel (v_proj and
o_proj carry it to the layer's output, only those tokens' lm_head rows read it, nothing else
touches it), and attention's output is scaled down, so which of the 4 a drafter picks depends on
the target's features and rounds accept 0-3 drafts. A drafter reading the wrong target layers
then drafts differently, which tests/test_eagle3.py's round-by-round comparison notices.
Weights are numpy draws (seed per drafter) in sorted name order: a rerun writes the same tensors
(speculators' safetensors header orders its metadata differently from run to run).
"""

import json
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "eagle3"
TARGET = ROOT / "tests" / "fixtures" / "mlx_vlm_hybrid" / "target"
VOCAB, TARGET_H, TARGET_LAYERS = 96, 32, 4
FAVOURED, BIAS = (7, 19, 33, 71), 3.5
# The drafters' preference for them (see random_weights): dimension 0 carried at CARRY, the
# favoured lm_head rows' other weights scaled by SPREAD, attention's output by ATTN.
CARRY, SPREAD, ATTN = 3.0, 3.0, 0.2
DRAFT_VOCAB = 48
PROMPT_LEN = 8  # positions with target features in the session's prefill
BLOCK, MAX_TOKENS = 4, 24


def draft_vocabulary(rng) -> np.ndarray:
    """48 sorted target ids: the favoured 4 and 44 others."""
    others = [i for i in range(VOCAB) if i not in FAVOURED]
    ids = list(FAVOURED) + list(rng.choice(others, DRAFT_VOCAB - len(FAVOURED), replace=False))
    return np.array(sorted(int(i) for i in ids))


def layer_config(kind: str, hidden: int, intermediate: int, **extra) -> dict:
    config = {
        "model_type": kind,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "vocab_size": VOCAB,
        "attention_bias": False,
        "tie_word_embeddings": False,
    }
    config.update(extra)
    return config


def speculators_config(layer: dict, **top) -> dict:
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": DRAFT_VOCAB,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": None,
                         "architectures": ["Qwen3_5ForConditionalGeneration"]},
        },
        "torch_dtype": "float32",
    }
    config.update(top)
    return config


DRAFTERS = {
    "speculators": speculators_config(
        layer_config("llama", TARGET_H, 32,
                     rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
        norm_before_residual=True, norm_before_fc=True, target_hidden_size=TARGET_H,
        eagle_aux_hidden_state_layer_ids=[1, 2, 4],
    ),
    "specforge": {
        "architectures": ["LlamaForCausalLMEagle3"],
        **layer_config("llama", 48, 32, rope_theta=10000.0, pretraining_tp=1),
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": TARGET_H,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 3],
                         "use_aux_hidden_state": True},
        "torch_dtype": "float32",
    },
    "speculators_qwen3": speculators_config(
        layer_config("qwen3", TARGET_H, 32, rope_theta=20000.0), norm_before_residual=False,
    ),
}
OWN_EMBED = {"speculators": False, "specforge": True, "speculators_qwen3": False}
SEEDS = {"speculators": 6, "specforge": 2, "speculators_qwen3": 3}


def param_shapes(name: str) -> dict[str, tuple]:
    """Tensor names (speculators spelling) and shapes a drafter's config implies."""
    config = DRAFTERS[name]
    layer = config.get("transformer_layer_config", config)
    H, I, hd = layer["hidden_size"], layer["intermediate_size"], layer["head_dim"]
    q, kv = layer["num_attention_heads"] * hd, layer["num_key_value_heads"] * hd
    fc_in = 3 * config.get("target_hidden_size", H)
    shapes = {
        "fc.weight": (H, fc_in),
        "layers.0.input_layernorm.weight": (H,),
        "layers.0.hidden_norm.weight": (H,),
        "layers.0.self_attn.q_proj.weight": (q, 2 * H),
        "layers.0.self_attn.k_proj.weight": (kv, 2 * H),
        "layers.0.self_attn.v_proj.weight": (kv, 2 * H),
        "layers.0.self_attn.o_proj.weight": (H, q),
        "layers.0.post_attention_layernorm.weight": (H,),
        "layers.0.mlp.gate_proj.weight": (I, H),
        "layers.0.mlp.up_proj.weight": (I, H),
        "layers.0.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
        "lm_head.weight": (DRAFT_VOCAB, H),
    }
    if layer["model_type"] == "qwen3":
        shapes["layers.0.self_attn.q_norm.weight"] = (hd,)
        shapes["layers.0.self_attn.k_norm.weight"] = (hd,)
    if config.get("norm_before_fc"):
        shapes["input_norm.weight"] = (fc_in,)
    if OWN_EMBED[name]:
        shapes["embed_tokens.weight"] = (VOCAB, H)
    return shapes


def random_weights(name: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """float32 weights in the speculators spelling, and the draft vocabulary (target ids)."""
    rng = np.random.default_rng(SEEDS[name])
    weights = {}
    for key, shape in sorted(param_shapes(name).items()):
        if key.endswith("norm.weight"):  # non-trivial norms, so a missed norm shows
            w = 1 + 0.1 * rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) * shape[-1] ** -0.5
        weights[key] = w.astype(np.float32)
    vocab = draft_vocabulary(rng)
    if "embed_tokens.weight" in weights:
        weights["embed_tokens.weight"][:, 0] += BIAS
    # Dimension 0 is a private channel: the embedding's +3.5 reaches value 0 of the first kv
    # head, then output dimension 0, which only the favoured tokens' lm_head rows read. No other
    # weight reads or writes it, so the rest of the output varies with the context alone.
    prefix = "layers.0."
    v, o = weights[prefix + "self_attn.v_proj.weight"], weights[prefix + "self_attn.o_proj.weight"]
    o *= ATTN  # attention averages the context: keep its shared part below the residual's
    v[:, 0], o[:, 0], o[0, :] = 0, 0, 0
    v[0, 0], o[0, 0] = CARRY, CARRY
    weights[prefix + "mlp.gate_proj.weight"][:, 0] = 0
    weights[prefix + "mlp.up_proj.weight"][:, 0] = 0
    weights[prefix + "mlp.down_proj.weight"][0, :] = 0
    head = weights["lm_head.weight"]
    head[:, 0] = 0
    for draft_id, token in enumerate(vocab):
        if token in FAVOURED:  # on top, and which of them depends on the context
            head[draft_id] *= SPREAD
            head[draft_id, 0] = BIAS
    return weights, vocab


def checkpoint_tensors(name: str) -> dict[str, np.ndarray]:
    """What the drafter's model.safetensors holds, in its layout's names."""
    weights, vocab = random_weights(name)
    weights["d2t"] = (vocab - np.arange(DRAFT_VOCAB)).astype(np.int64)
    t2d = np.zeros(VOCAB, dtype=bool)
    t2d[vocab] = True
    weights["t2d"] = t2d
    if name == "specforge":
        weights = {k.replace("layers.0.", "midlayer."): v for k, v in weights.items()}
    else:
        weights["verifier_norm.weight"] = np.ones(TARGET_H, dtype=np.float32)
    return weights


def session_inputs() -> dict[str, np.ndarray]:
    """The session's fixed prompt, verdict tokens and target features (seed 10)."""
    rng = np.random.default_rng(10)
    width = 3 * TARGET_H
    return {
        "prompt": rng.integers(0, VOCAB, PROMPT_LEN + 1).astype(np.int32),  # last: the bonus
        "features_prefill": rng.standard_normal((PROMPT_LEN, width)).astype(np.float32),
        "features_round1": rng.standard_normal((BLOCK, width)).astype(np.float32),
        "features_round2": rng.standard_normal((BLOCK - 1, width)).astype(np.float32),
    }


# Scripted verdicts: (block size, accepted drafts, the target's own next token when it rejects)
ROUNDS = [(BLOCK, 1, 50), (BLOCK - 1, 2, None), (BLOCK, None, None)]


def compact_json(data) -> str:
    text = json.dumps(data, indent=1)  # lists of numbers on one line each
    return re.sub(r"\[\s+([-\d.,\s]*?)\s+\]", lambda m: "[" + " ".join(m[1].split()) + "]", text)


# ---- mlx-vlm ----------------------------------------------------------------------------------


def mlx_vlm_main():
    import mlx.core as mx
    import mlx_vlm
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.speculative.drafters.eagle3 import Eagle3DraftModel, ModelConfig
    from mlx_vlm.utils import load_model

    OUT.mkdir(parents=True, exist_ok=True)
    for name, config in DRAFTERS.items():
        d = OUT / name
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        mx.save_safetensors(str(d / "model.safetensors"),
                            {k: mx.array(v) for k, v in checkpoint_tensors(name).items()},
                            metadata={"format": "pt"})
    inputs = session_inputs()
    mx.save_safetensors(str(OUT / "inputs.safetensors"),
                        {k: mx.array(v) for k, v in inputs.items()})

    target = load_model(TARGET)

    def speculators_view(name: str) -> dict:
        """mlx-vlm reads only the speculators layout: the same drafter written that way."""
        config = DRAFTERS[name]
        if "transformer_layer_config" in config:
            return config
        layer = {k: v for k, v in config.items() if k not in (
            "architectures", "draft_vocab_size", "target_hidden_size", "eagle_config")}
        ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        return speculators_config(
            layer, target_hidden_size=config["target_hidden_size"],
            eagle_aux_hidden_state_layer_ids=[i + 1 for i in ids])  # outputs -> hidden states

    def build(name: str):
        if DRAFTERS[name].get("transformer_layer_config", {}).get("model_type") == "qwen3":
            # mlx-vlm's attention has no q_norm/k_norm: only its own loader's verdict counts.
            drafter, _ = load_drafter(str(OUT / name), kind="eagle3")
            raise RuntimeError(f"load_drafter loaded {type(drafter).__name__} from a qwen3 "
                               "layer although its attention has no q_norm/k_norm")

        """mlx-vlm's own loader where it reads the directory, else its model class on the same
        weights (renamed to its spelling); returns (drafter, how it was loaded)."""
        try:
            drafter, _ = load_drafter(str(OUT / name), kind="eagle3")
            if isinstance(drafter, Eagle3DraftModel):
                drafter.reset(target)  # what its round loop calls first
                return drafter, "mlx_vlm.speculative.drafters.load_drafter"
            how = f"load_drafter returned {type(drafter).__module__}.{type(drafter).__name__}"
        except Exception as err:  # noqa: BLE001 - recorded in reference.json
            how = (f"load_drafter + reset(target) failed: {type(err).__name__}: "
                   f"{str(err).splitlines()[0][:200]}")
        config = ModelConfig.from_dict(json.loads(json.dumps(speculators_view(name))))
        drafter = Eagle3DraftModel(config)
        weights = {k.replace("midlayer.", "layers.0."): mx.array(v)
                   for k, v in checkpoint_tensors(name).items()}
        weights = drafter.sanitize(weights)
        strict = OWN_EMBED[name]
        drafter.load_weights(list(weights.items()), strict=strict)
        drafter.eval()
        return drafter, how + "; built Eagle3DraftModel(ModelConfig.from_dict(speculators " \
            f"form)) and load_weights(strict={strict}) instead"

    tensors, meta = {}, {"drafters": {}}
    for name in DRAFTERS:
        try:
            drafter, how = build(name)
        except Exception as err:  # noqa: BLE001 - mlx-vlm cannot run this drafter at all
            meta["drafters"][name] = {"mlx_vlm": None,
                                      "why": f"{type(err).__name__}: {str(err)[:300]}"}
            print(f"{name}: mlx-vlm cannot run it: {err}")
            continue
        print(f"{name}: {how}")
        entry = {"loaded_by": how, "capture_layer_ids": list(drafter.config.capture_layer_ids)}
        entry.update(session(mx, drafter, target, inputs, tensors, name))
        entry["generate"] = generate(mx, generate_step, drafter, target)
        meta["drafters"][name] = entry

    mx.save_safetensors(str(OUT / "reference.safetensors"), tensors)
    meta.update({
        "rounds": ROUNDS,
        "block": BLOCK,
        "max_tokens": MAX_TOKENS,
        "favoured_tokens": list(FAVOURED),
        "made_with": {"mlx_vlm": mlx_vlm.__version__, "mlx": mx.__version__,
                      "device": str(mx.default_device())},
    })
    (OUT / "reference.json").write_text(compact_json(meta) + "\n")
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"wrote {OUT} ({total / 1024:.0f} KiB)")


def session(mx, drafter, target, inputs, tensors: dict, name: str) -> dict:
    """Drive mlx-vlm's drafter as _eagle3_rounds does, recording what it computes."""
    forwards, logits = [], []
    forward_tokens, logits_of = drafter._forward_tokens, drafter._logits

    def recording_forward(tokens, hidden, token_dtype):
        h = forward_tokens(tokens, hidden, token_dtype)
        forwards.append(h[0])
        return h

    def recording_logits(hidden):
        out = logits_of(hidden)
        logits.append(out[0])
        return out

    drafter.reset(target)  # binds the target's embedding where shapes match
    drafter._forward_tokens, drafter._logits = recording_forward, recording_logits
    prompt = mx.array(inputs["prompt"])[None]
    features = [mx.array(inputs[k])[None] for k in
                ("features_prefill", "features_round1", "features_round2")]
    drafter.prefill_from_target_hidden(prompt[:, :-1], features[0], int(inputs["prompt"][-1]),
                                       None, mx.int32, greedy=True)
    bonus, hidden = int(inputs["prompt"][-1]), features[0][:, -1:]
    rounds = []
    for r, (block, accepted, own) in enumerate(ROUNDS):
        start = len(logits) - 1  # the seed's logits, computed by the prefill or last verdict
        drafts = drafter.draft_block(bonus, hidden, None, block, None, mx.int32, greedy=True)
        drafts_list = drafts[0].tolist()
        chain = mx.concatenate(logits[start:], axis=0)
        assert chain.shape[0] == block - 1, chain.shape
        tensors[f"{name}.round{r}.logits"] = chain
        record = {"block": block, "drafts": drafts_list}
        top2 = mx.sort(chain, axis=-1)[:, -2:]
        record["min_top2_margin"] = float(mx.min(top2[:, 1] - top2[:, 0]).item())
        if accepted is not None:
            verify = features[r + 1]
            if accepted < len(drafts_list):
                nxt = own if own != drafts_list[accepted] else own + 1
            else:
                nxt = int(inputs["prompt"][r])  # any token: the target's bonus after all
            new_tokens = drafts_list[:accepted] + [nxt]
            drafter.accept_verified_tokens(verify, drafts, accepted, new_tokens, None, mx.int32,
                                           greedy=True)
            record.update(accepted=accepted, next_token=nxt)
            bonus, hidden = nxt, verify[:, accepted : accepted + 1]
        rounds.append(record)
    drafter._forward_tokens, drafter._logits = forward_tokens, logits_of
    # The committed-pair forwards: prefill, then one per verdict (chain steps are the others).
    committed = [forwards[0]] + [forwards[i] for i in committed_forward_indices()]
    for i, h in enumerate(committed):
        tensors[f"{name}.committed{i}.hidden"] = h
    tensors[f"{name}.prefill.logits"] = logits_of(committed[0][None])[0]
    return {"rounds": rounds}


def committed_forward_indices() -> list[int]:
    """Indices of accept_verified_tokens' forwards among all _forward_tokens calls: after the
    prefill's (0), each round runs block-2 chain forwards, then its verdict's one forward."""
    indices, n = [], 1
    for block, accepted, _ in ROUNDS:
        n += block - 2
        if accepted is not None:
            indices.append(n)
            n += 1
    return indices


def generate(mx, generate_step, drafter, target) -> list:
    """mlx-vlm's speculative round loop on the target (block BLOCK), against its plain one."""
    cases = []
    reference = json.loads((TARGET.parent / "reference.json").read_text())
    for case in reference["cases"][:2]:
        prompt = mx.array([case["prompt"]])
        plain = [int(t) for t, _ in generate_step(prompt, target, None, None,
                                                  max_tokens=MAX_TOKENS, temperature=0.0)]
        tokens = [int(t) for t, _ in generate_step(
            prompt, target, None, None, max_tokens=MAX_TOKENS, temperature=0.0,
            draft_model=drafter, draft_kind="eagle3", draft_block_size=BLOCK)]
        cases.append({"prompt": case["prompt"], "plain": plain, "speculative": tokens,
                      "draft_lens": [int(n) for n in drafter.draft_lens],
                      "accept_lens": [int(a) for a in drafter.accept_lens]})
        print(f"  generate: plain == speculative: {plain == tokens}; accepted "
              f"{drafter.accept_lens} of {drafter.draft_lens}")
    return cases


# ---- speculators ------------------------------------------------------------------------------


def speculators_main():
    import safetensors.numpy
    import speculators
    import torch
    import transformers
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    # Its from_pretrained calls load_verifier_weights, which reads the verifier's config and
    # embedding from the Hub (verifier.name_or_path); the fixture names no verifier, so the
    # target's embedding is copied in below instead, as that method would.
    Eagle3DraftModel.load_verifier_weights = lambda self: None
    inputs = safetensors.numpy.load_file(str(OUT / "inputs.safetensors"))
    target = safetensors.numpy.load_file(str(TARGET / "model.safetensors"))
    embedding = torch.from_numpy(target["language_model.model.embed_tokens.weight"].copy())
    prompt = torch.from_numpy(inputs["prompt"].astype(np.int64))
    features = torch.from_numpy(inputs["features_prefill"])[None]
    out, meta = {}, {}
    for name, config in DRAFTERS.items():
        if "transformer_layer_config" not in config:
            meta[name] = "not read: speculators reads only its own layout"
            continue
        if config.get("target_hidden_size", TARGET_H) != config["transformer_layer_config"][
                "hidden_size"]:
            meta[name] = "not read: speculators' fc reads 3 x hidden_size"
            continue
        spec_config = Eagle3SpeculatorConfig.from_pretrained(str(OUT / name))
        spec_config.transformer_layer_config._attn_implementation = "eager"
        model = Eagle3DraftModel.from_pretrained(str(OUT / name), config=spec_config,
                                                 torch_dtype=torch.float32)
        model.eval()
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embedding)  # as load_verifier_weights would
        captured = []
        hook = model.lm_head.register_forward_hook(
            lambda m, a, o, sink=captured: sink.append(o[0].clone()))
        T = PROMPT_LEN
        with torch.no_grad():
            drafts = model(hidden_states=features, input_ids=prompt[1:T + 1][None],
                           document_ids=torch.zeros(1, T, dtype=torch.long), ttt_steps=3)
        hook.remove()
        for step, logits in enumerate(captured):
            out[f"{name}.ttt{step}.logits"] = logits.numpy().astype(np.float32)
            out[f"{name}.ttt{step}.drafts"] = drafts[step][0].numpy().astype(np.int32)
        meta[name] = "forward(ttt_steps=3) on the prefill features and prompt[1:9]"
        print(f"{name}: {len(captured)} TTT steps recorded")
    meta["made_with"] = json.dumps({"speculators": speculators.__version__ if hasattr(
        speculators, "__version__") else "0.9.0", "torch": torch.__version__,
        "transformers": transformers.__version__})
    safetensors.numpy.save_file(out, str(OUT / "reference_speculators.safetensors"),
                                metadata={k: str(v) for k, v in meta.items()})
    print(f"wrote {OUT / 'reference_speculators.safetensors'}")


if __name__ == "__main__":
    if "--speculators" in sys.argv[1:]:
        speculators_main()
    else:
        mlx_vlm_main()
