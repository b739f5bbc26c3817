"""Batched speculative decoding on the default model: decode tok/s of `mlxspec.batch_generate`
per drafter and batch size, against plain batched decoding (ours, and mlx-lm's batch_generate
on the same model object, greedy), one run.

Each configuration generates the same prompts (HumanEval and MT-Bench first turns in the chat
template, `--max-tokens` greedy tokens each) in batches of B; decode tok/s = a batch's
generated tokens / its seconds from the first token on (prefill, the same work for every
configuration, apart: on a 2-core CPU it would dominate), summed over batches. The drafters
take turns on each batch (`--repeat` turns each), so load from other work on a shared machine
falls on all of them alike and their ratios to plain decoding hold. Every
configuration's outputs are checked equal to plain decoding's (lossless), so a speed-up never
comes from a different text. `--workload copy` asks instead for HumanEval solutions rewritten
with one rename (mlxspec.prompts.copy_prompts): most of each answer repeats its prompt.

    .venv/bin/python benchmarks/batch_speed.py --out docs/results/batch-speed-cpu.json
    .venv/bin/python benchmarks/batch_speed.py --workload copy --max-tokens 160 \
        --out docs/results/batch-speed-copy-cpu.json
"""

import argparse
import json

import mlxspec  # first: it loads OpenBLAS before mlx.core would load its slow bundled BLAS

import mlx.core as mx  # noqa: E402
from mlxspec.bench import chat_prompt
from mlxspec.prompts import copy_prompts, humaneval_prompts, mtbench_prompts


def run_ours(model, tokenizer, prompts, batch, max_tokens, drafters, repeat=1):
    """{drafter name: (token ids, decode tok/s)}: every batch of prompts run by each drafter
    in turn (`repeat` times), so a machine shared with other work slows every configuration
    alike, and the ratios between them hold."""
    texts = {name: [] for name in drafters}
    seconds = dict.fromkeys(drafters, 0.0)
    generated = dict.fromkeys(drafters, 0)
    for i in range(0, len(prompts), batch):
        for turn in range(repeat):
            for name, drafter in drafters.items():
                mx.random.seed(0)
                out = mlxspec.batch_generate(model, tokenizer, prompts[i : i + batch],
                                             max_tokens, drafter=drafter)
                if turn == 0:
                    texts[name] += out.token_ids
                seconds[name] += out.generation_tokens / out.generation_tps
                generated[name] += out.generation_tokens
    return {name: (texts[name], generated[name] / seconds[name]) for name in drafters}


def run_mlx_lm(model, tokenizer, prompts, batch, max_tokens):
    from mlx_lm.generate import batch_generate

    encoded = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    texts, seconds = [], 0.0
    for i in range(0, len(encoded), batch):
        out = batch_generate(model, tokenizer, encoded[i : i + batch], max_tokens=max_tokens,
                             return_token_ids=True)
        texts += [list(ids) for ids in out.token_ids]
        seconds += out.stats.decode_time  # its decode steps only: no host work around them
    return texts, sum(map(len, texts)) / seconds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--drafters", default="none,lookup,dflash")
    parser.add_argument("--workload", choices=("chat", "copy"), default="chat")
    parser.add_argument("--no-mlx-lm", action="store_true", help="ours only")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each batch per drafter")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    model, tokenizer = mlxspec.load()
    if args.workload == "copy":
        texts = copy_prompts(args.prompts)
    else:
        half = args.prompts // 2
        texts = humaneval_prompts(half) + mtbench_prompts(args.prompts - half)
    prompts = [chat_prompt(tokenizer, t) for t in texts]
    drafters = {name: None if name == "none" else
                mlxspec.load_drafter(name, model=model, tokenizer=tokenizer)
                for name in args.drafters.split(",")}
    rows = []
    for batch in map(int, args.batches.split(",")):
        reference, plain = None, None
        results = run_ours(model, tokenizer, prompts, batch, args.max_tokens, drafters,
                           args.repeat)
        for name, (ids, tps) in results.items():
            reference = reference or ids
            plain = plain or tps
            row = dict(batch=batch, runtime="mlxspec", drafter=name, tok_s=tps,
                       vs_plain=tps / plain, lossless=ids == reference)
            rows.append(row)
            print(json.dumps(row), flush=True)
        if args.no_mlx_lm:
            continue
        ids, tps = run_mlx_lm(model, tokenizer, prompts, batch, args.max_tokens)
        row = dict(batch=batch, runtime="mlx-lm", drafter="none", tok_s=tps, vs_plain=tps / plain,
                   same_text=[i[: len(r)] == r[: len(i)] for i, r in zip(ids, reference)].count(True))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(blas=mlxspec.blas_in_use(), workload=args.workload, prompts=len(prompts),
                           max_tokens=args.max_tokens, repeat=args.repeat, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
