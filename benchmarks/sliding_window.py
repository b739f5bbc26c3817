"""Speculation before and past a sliding window (issue #64), alone and at 8 rows.

Random Gemma-3-shaped and gpt-oss-shaped targets (mlx-lm's own classes, window 128, fp32) and a
planted drafter: each step it proposes the target's own greedy continuation (decoded plainly
first) with each draft wrong with probability 0.2, so acceptance is the same wherever the text
is and what differs before and past the window is only what the caches cost. Per model and
context (a prompt inside the window and one 8 windows long): plain and speculative tok/s
(generated tokens after the first over their seconds) and τ, for one sequence and for a batch
of 8 rows; and one sequence over mlx-lm's RotatingKVCache, as before this issue (it cannot roll
back past its window, so speculation stopped there; batches were refused).

Also the cache's own cost past the window, plain decoding: ours (WindowKVCache) against
mlx-lm's generate_step (RotatingKVCache) on the same model and prompt, and the share of a
speculative step's time spent rolling back (target.settle, host time).

    .venv/bin/python benchmarks/sliding_window.py [--tokens 96] [--json OUT]
"""

import argparse
import json
import random
import time

import mlxspec  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxspec.backends.mlx.batch_target import MLXBatchTarget
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.engine import Draft, Drafter, Loop, OneRow, Row
from mlxspec.sampling import SamplingConfig

WINDOW, VOCAB, ROWS, WRONG = 128, 8192, 8, 0.2
GREEDY = SamplingConfig()


def gemma3_shaped(seed=0):
    from mlx_lm.models import gemma3_text

    mx.random.seed(seed)
    args = gemma3_text.ModelArgs.from_dict(dict(
        model_type="gemma3_text", hidden_size=512, num_hidden_layers=6, intermediate_size=1536,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=VOCAB,
        sliding_window=WINDOW, sliding_window_pattern=6, max_position_embeddings=4096))
    model = gemma3_text.Model(args)
    mx.eval(model.parameters())
    return model


def gpt_oss_shaped(seed=0):
    from mlx_lm.models import gpt_oss

    mx.random.seed(seed)
    args = gpt_oss.ModelArgs(
        model_type="gpt_oss", num_hidden_layers=6, num_local_experts=8, num_experts_per_tok=2,
        vocab_size=VOCAB, hidden_size=512, intermediate_size=512, head_dim=64,
        num_attention_heads=8, num_key_value_heads=4, sliding_window=WINDOW, rope_theta=10000)
    model = gpt_oss.Model(args)
    model.lm_head.weight = model.lm_head.weight * 8  # sharper: fewer near-ties between runs
    mx.eval(model.parameters())
    return model


class Planted(Drafter):
    """The target's own continuation (known per prompt), each draft wrong with prob WRONG."""

    name = "planted"
    default_num_draft = max_draft = 4

    def __init__(self, continuations: dict, seed=0):
        self.continuations, self.rng = continuations, random.Random(seed)

    def fork(self):
        twin = super().fork()
        twin.rng = random.Random(self.rng.random())
        return twin

    def propose(self, tokens, k, sampling):
        full = next(c for p, c in self.continuations.items() if tokens[: len(p)] == list(p))
        drafts = list(full[len(tokens) : len(tokens) + k])
        return Draft(tokens=[d if self.rng.random() > WRONG else (d + 1) % VOCAB
                             for d in drafts])


def run(target, rows: list[Row]):
    """Generated tokens after each row's first, and the seconds from the first token on."""
    loop = Loop(target)
    for row in rows:
        loop.join(row)
    first, count = None, 0
    for _ in loop:
        if first is None:
            first = time.perf_counter()
        else:
            count += 1
    return count, time.perf_counter() - first


def rows_for(prompts, drafter, tokens):
    return [Row(drafter.fork() if drafter else _plain(), list(p), GREEDY, tokens,
                4 if drafter else 0) for p in prompts]


def _plain():
    from mlxspec.engine import PlainDecoding

    return PlainDecoding()


def measure(model, prompts, continuations, tokens, repeats=2):
    """{config: tok/s, τ} for one row (prompts[0]) and ROWS rows, plain and planted, and one
    row over mlx-lm's RotatingKVCache; each configuration warmed up once, then run `repeats`
    times, the configurations in turn (the order reversed every other round)."""
    planted = Planted(continuations)
    configs = {
        "1/plain": (1, None, lambda: OneRow(MLXTarget(model, speculative=True))),
        "1/planted": (1, planted, lambda: OneRow(MLXTarget(model, speculative=True))),
        "1/planted-rotating": (1, planted, lambda: OneRow(MLXTarget(
            model, speculative=True, cache=make_prompt_cache(model)))),
        f"{ROWS}/plain": (ROWS, None, lambda: MLXBatchTarget(model)),
        f"{ROWS}/planted": (ROWS, planted, lambda: MLXBatchTarget(model)),
    }
    totals = {name: [0, 0.0, 0.0] for name in configs}  # tokens, seconds, τ sum
    for n, drafter, make in configs.values():
        run(make(), rows_for(prompts[:n], drafter, 8))  # warm-up
    for round_ in range(repeats):
        order = list(configs) if round_ % 2 == 0 else list(configs)[::-1]
        for name in order:
            n, drafter, make = configs[name]
            rows = rows_for(prompts[:n], drafter, tokens)
            count, seconds = run(make(), rows)
            totals[name][0] += count
            totals[name][1] += seconds
            totals[name][2] += sum(r.stats.tau for r in rows) / n
    return {name: {"tok_s": t / s, "tau": tau / repeats}
            for name, (t, s, tau) in totals.items()}


def cache_cost(model, prompt, tokens):
    """Plain decoding past the window: our loop over WindowKVCache against mlx-lm's
    generate_step over RotatingKVCache (tok/s after the first token), and a speculative run's
    host seconds in settle (its rollbacks) over its wall time."""
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=tokens)
    next(steps)
    start = time.perf_counter()
    count = sum(1 for _ in steps)
    mlx_lm_tps = count / (time.perf_counter() - start)
    count, seconds = run(OneRow(MLXTarget(model, speculative=True)),
                         rows_for([prompt], None, tokens))
    return {"ours_plain_tok_s": count / seconds, "mlx_lm_plain_tok_s": mlx_lm_tps}


class TimedSettle(MLXTarget):
    settle_seconds = 0.0

    def settle(self, verdict):
        start = time.perf_counter()
        super().settle(verdict)
        mx.eval([c.state for c in self.cache])  # what the rollback leaves, computed now
        self.settle_seconds += time.perf_counter() - start


def rollback_share(model, prompt, continuations, tokens):
    target = TimedSettle(model, speculative=True)
    count, seconds = run(OneRow(target), rows_for([prompt], Planted(continuations), tokens))
    return target.settle_seconds / seconds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--json")
    args = parser.parse_args()
    report = {"blas": mlxspec.blas_in_use(), "window": WINDOW, "tokens": args.tokens,
              "rows": ROWS, "wrong": WRONG}
    rnd = random.Random(0)
    for name, build in (("gemma3", gemma3_shaped), ("gpt_oss", gpt_oss_shaped)):
        model = build()
        for context, length in (("inside", 48), ("past", 8 * WINDOW)):
            prompts = [[rnd.randrange(VOCAB) for _ in range(length + 7 * i)]
                       for i in range(ROWS)]
            continuations = {}
            for p in prompts:  # the target's own greedy continuation, decoded plainly
                rows = rows_for([p], None, args.tokens + 8)
                run(OneRow(MLXTarget(model)), rows)
                continuations[tuple(p)] = rows[0].tokens
            result = measure(model, prompts, continuations, args.tokens)
            if context == "past":
                result["cache"] = cache_cost(model, prompts[0], args.tokens)
                result["rollback_share"] = rollback_share(model, prompts[0], continuations,
                                                          args.tokens)
            report[f"{name}/{context}"] = result
            print(name, context, json.dumps(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
