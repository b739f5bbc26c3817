"""Held-out τ of every drafter shipped for SmolLM2-135M-Instruct, and of prompt lookup, by the
training runs' protocol: the same 8 held-out ShareGPT prompts (never trained on; the split of
benchmarks/train_smollm2_*.sh), 48 tokens, greedy, by the real loop with a fixed K (each
drafter's own: Medusa's 3 heads, EAGLE-3's 4, a DFlash block's 15; lookup 4).

Usage: python benchmarks/heldout_tau_smollm2.py OUT.json
"""

import json
import sys

import mlxspec
from mlxspec.drafters import load_drafter
from mlxspec.training.data import load_examples, split_heldout
from mlxspec.training.run import encode_prompt, heldout_tau


def main(out: str) -> None:
    model, tokenizer = mlxspec.load(None)
    examples = load_examples("sharegpt", 912)
    _, heldout = split_heldout(examples, 16, 0)
    prompts = [encode_prompt(tokenizer, p)[-512:] for p, _ in heldout[:8]]
    taus = {}
    for name, k in (("lookup", 4), ("medusa", None), ("eagle3", None), ("dflash", None)):
        drafter = load_drafter(name, model=model, tokenizer=tokenizer)
        taus[name] = round(heldout_tau(model, drafter, prompts, tokenizer=tokenizer,
                                       max_tokens=48, num_draft=k), 4)
        print(name, taus[name], flush=True)
    with open(out, "w") as f:
        json.dump({"protocol": "8 held-out ShareGPT prompts, 48 tokens, greedy, fixed K",
                   "tau": taus}, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
