"""What the shipped DFlash drafter's draft vocabulary saves and what it leaves out
(docs/dflash-training.md): the time of a drafter pass drafting from the full head and from the
draft vocabulary's rows, beside the target's decode step; and the share of the target's own
greedy tokens on the benchmark prompts that a draft vocabulary of the N most frequent answer
tokens holds (8,192 is the shipped one).
Usage: python benchmarks/draft_vocab_cost.py
"""

import time

import mlxspec  # first: it loads OpenBLAS before MLX is imported

import mlx.core as mx  # noqa: I001
from mlxspec.bench import chat_prompt
from mlxspec.engine import EMPTY_DRAFT
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.prompts import humaneval_prompts, mtbench_prompts
from mlxspec.sampling import SamplingConfig
from mlxspec.training.data import eos_ids
from mlxspec.training.dflash_trainer import frequent_tokens
from smollm2_draft_vocab import stage2_answers  # benchmarks/, beside this script

GREEDY = SamplingConfig()


def best_ms(fn, calls=40, repeats=3):
    for _ in range(5):  # warm-up
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e3)
    return min(times)


def pass_times(model, tokenizer):
    sub = mlxspec.load_drafter("dflash", model=model, tokenizer=tokenizer)
    full = mlxspec.load_drafter("dflash", model=model, tokenizer=tokenizer, draft_vocab=False)
    prompt = tokenizer.encode("Write a Python function returning the sum of a list's squares.")
    target = MLXTarget(model, capture_layers=sub.capture_layers, speculative=True)
    features = target.prefill(prompt)
    sub.begin(prompt, features)
    full.begin(prompt, features)

    def decode():
        target.verify(prompt[-1], EMPTY_DRAFT, GREEDY)
        target.trim(1)

    print(f"target decode step: {best_ms(decode):.1f} ms")
    for k in (1, 2, 4, 15):
        full_ms, sub_ms = (best_ms(lambda d=d: mx.eval(d.propose(prompt, k, GREEDY).tokens))
                           for d in (full, sub))
        print(f"drafter pass, {k} drafts: full vocabulary {full_ms:.1f} ms, "
              f"draft vocabulary {sub_ms:.1f} ms")


def coverage(model, tokenizer, sizes=(8192, 16384, 32768)):
    # Chosen as the conversations stage chose its loss vocabulary (smollm2_draft_vocab.py).
    answers = stage2_answers()
    vocabs = {n: set(frequent_tokens(answers, tokenizer.vocab_size, n, always=eos_ids(tokenizer)))
              for n in sizes}
    for suite, prompts in (("humaneval", humaneval_prompts(10)), ("mtbench", mtbench_prompts(10))):
        tokens = []
        for p in prompts:
            text = chat_prompt(tokenizer, p)
            tokens += [r.token for r in mlxspec.stream_generate(model, tokenizer, text, 64)]
        for n, vocab in vocabs.items():
            inside = sum(t in vocab for t in tokens)
            print(f"{suite}: {inside}/{len(tokens)} = {inside / len(tokens):.1%} of the target's "
                  f"greedy tokens in the {n} most frequent answer tokens")


if __name__ == "__main__":
    model, tokenizer = mlxspec.load(None)
    pass_times(model, tokenizer)
    coverage(model, tokenizer)
