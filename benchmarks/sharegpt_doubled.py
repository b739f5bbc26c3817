"""Write ShareGPT exchanges whose answer is written twice (answer, blank line, answer), as JSONL.

Why: a copy test for drafters. In the second copy the target's own greedy predictions follow the
first copy (82-99% of positions in 6 sequences on SmolLM2; 39-61% in the first copy), so with
`--labels target` half of every sequence rewards a drafter that can find where its anchor appeared
before and read on, which is what prompt lookup does on HumanEval and what a one-layer DFlash
drafter cannot do (docs/dflash-training.md). Answers of 200-600 characters (both copies mostly fit
the 256-token cut), from index START on (the shipped drafter's data and the code mix stop before
it).

Usage: python benchmarks/sharegpt_doubled.py OUT.jsonl [N=600] [START=12000]
"""

import json
import sys

from mlxspec.training.data import sharegpt_examples


def main(out, n=600, start=12000):
    n, start = int(n), int(start)
    rows = [(p, a) for p, a in sharegpt_examples()[start:] if a and 200 <= len(a) <= 600][:n]
    with open(out, "w") as f:
        for prompt, answer in rows:
            f.write(json.dumps({"prompt": prompt, "response": f"{answer}\n\n{answer}"}) + "\n")
    print(f"{out}: {len(rows)} exchanges, each answer written twice (ShareGPT from {start} on)")


if __name__ == "__main__":
    main(*sys.argv[1:])
