"""Suffix decoding's adaptive K, two policies side by side in one `run_benchmark` run: its own
path frequencies (ScoredDraftLength, the default) and acceptance by match length
(MatchLengthDraftLength, lookup's), against fixed K 8 and plain decoding.

    python benchmarks/suffix_policy.py --suite long1k,copy,humaneval --limit 4 -n 64 --out F
"""

import argparse
import json

import mlxspec
from mlxspec.bench import run_benchmark
from mlxspec.draft_length import copier_policy
from mlxspec.drafters.suffix import SuffixDrafter


def by_match_length() -> SuffixDrafter:
    drafter = SuffixDrafter()
    drafter.draft_policy = lambda max_k, greedy: copier_policy(drafter, max_k, greedy)
    drafter.latest_tokens = []
    commit, begin = drafter.commit, drafter.begin

    def remembering_commit(tokens, verdict):  # match_length reads the latest tokens
        drafter.latest_tokens = tokens
        commit(tokens, verdict)

    def remembering_begin(prompt, features=None):
        drafter.latest_tokens = prompt
        begin(prompt, features)

    drafter.commit, drafter.begin = remembering_commit, remembering_begin
    return drafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="long1k,copy,humaneval")
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("-n", "--max-tokens", type=int, default=64)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model, tokenizer = mlxspec.load(None)
    drafters = {"none": None, "suffix": SuffixDrafter(), "suffix-by-match": by_match_length(),
                "suffix@8": SuffixDrafter()}
    report = run_benchmark(model, tokenizer, drafters=drafters, suites=args.suite.split(","),
                           temps=[0.0], max_tokens=args.max_tokens, limit=args.limit,
                           with_mlx_lm=False, with_llama_cpp=False,
                           compare=[("suffix", "suffix-by-match"), ("suffix", "suffix@8")])
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    for c in report["comparisons"]:
        print(c["suite"], c["a"], "/", c["b"], round(c["speed_ratio"], 3), c["speed_interval"])


if __name__ == "__main__":
    main()
