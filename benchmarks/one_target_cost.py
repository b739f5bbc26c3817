"""The precondition for one MLX target (issue #64): what one sequence costs on the batched path
(MLXBatchTarget, a batch of one row) against the one-sequence path (MLXTarget behind OneRow).

Same loop, same drafter, same prompts; the two paths alternate prompt by prompt. Reports ms per
token after the first and the paired ratio batched / single with a 95% bootstrap interval over
prompts. The tiny target (mlxspec.overhead's: 2 layers, hidden 64, SmolLM2's vocabulary) makes
host costs visible; SmolLM2-135M is the default model.

    .venv/bin/python benchmarks/one_target_cost.py [--prompts 8] [--tokens 64] [--json OUT]
"""

import argparse
import json
import time

import mlxspec
from mlxspec.backends.mlx.batch_target import MLXBatchTarget
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.drafters import load_drafter
from mlxspec.engine import Loop, OneRow, Row, requested_drafts
from mlxspec.intervals import paired_ratio
from mlxspec.overhead import TINY_TARGET, tiny_llama
from mlxspec.prompts import suite_prompts
from mlxspec.sampling import SamplingConfig


def run(target, drafter, prompt: list[int], tokens: int) -> tuple[int, float]:
    """Tokens after the first and their seconds, one sequence through the loop."""
    sampling = SamplingConfig()
    max_k = requested_drafts(drafter, None, True)
    policy = drafter.draft_policy(max_k, True) if max_k else None
    loop = Loop(target)
    loop.join(Row(drafter, list(prompt), sampling, tokens, max_k, policy))
    first, count = None, 0
    for _ in loop:
        if first is None:
            first = time.perf_counter()
        else:
            count += 1
    return count, time.perf_counter() - first


def measure(model, tokenizer, drafter_kind: str, prompts: list[list[int]], tokens: int):
    sums = {"single": ([], []), "batched": ([], [])}
    paths = {"single": lambda: OneRow(MLXTarget(model, speculative=True)),
             "batched": lambda: MLXBatchTarget(model)}
    for i, prompt in enumerate([prompts[0]] + prompts):  # the first prompt warms up, unrecorded
        order = list(paths) if i % 2 else list(paths)[::-1]
        for name in order:
            drafter = load_drafter(drafter_kind, model=model, tokenizer=tokenizer)
            count, seconds = run(paths[name](), drafter, prompt, tokens)
            if i:
                sums[name][0].append(seconds * 1e3)
                sums[name][1].append(count)
    ratio = paired_ratio(sums["batched"], sums["single"])
    ms = {name: sum(s[0]) / sum(s[1]) for name, s in sums.items()}
    return {"ms_per_token": ms, "batched_over_single": ratio}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args()
    model, tokenizer = mlxspec.load()
    texts = suite_prompts("humaneval", args.prompts, tokenizer)
    prompts = [tokenizer.encode(t) for t in texts]
    tiny = tiny_llama(model.args.vocab_size, 0, **TINY_TARGET)
    report = {"blas": mlxspec.blas_in_use(), "prompts": args.prompts, "tokens": args.tokens}
    for name, target in (("tiny", tiny), ("smollm2", model)):
        for kind in ("none", "lookup"):
            result = measure(target, tokenizer, kind, prompts, args.tokens)
            report[f"{name}/{kind}"] = result
            r = result["batched_over_single"]
            lo, hi = r["interval"]
            print(f"{name:8s} {kind:7s} single {result['ms_per_token']['single']:.2f} ms/tok, "
                  f"batched {result['ms_per_token']['batched']:.2f} ms/tok: "
                  f"{r['ratio']:.3f}x [{lo:.3f}, {hi:.3f}]", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
