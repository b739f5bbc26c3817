"""The shipped DFlash drafter against prompt lookup, against itself drafting from the full
vocabulary instead of its draft vocabulary, and the two combined (dflash+lookup: lookup where it
finds a match, DFlash elsewhere), all interleaved in one run (docs/dflash-training.md).
`mlxspec bench` takes one DFlash variant per run (--draft-vocab/--full-vocab); this puts both
in one, so their speed ratios share the run's conditions.
Usage: python benchmarks/bench_dflash.py [OUT_PREFIX]   (writes .json, .md and .png)
"""

import sys

import mlxspec
from mlxspec.bench import markdown_table, plot_report, run_benchmark, save_report


def main(prefix="docs/results/smollm2-dflash-vs-lookup"):
    target, tokenizer = mlxspec.load(None)

    def drafter(kind, **options):
        return mlxspec.load_drafter(kind, model=target, tokenizer=tokenizer, **options)

    lookup, dflash = drafter("lookup"), drafter("dflash")
    full_vocab = drafter("dflash", draft_vocab=False)
    hybrid = drafter("dflash+lookup")  # its own DFlash drafter and adaptive-K policies
    # name@15: a fixed 15 drafts a step (full blocks: the drafter's whole tau); others adaptive.
    drafters = {"none": None, "lookup": lookup, "dflash": dflash, "dflash-full-vocab": full_vocab,
                "dflash+lookup": hybrid, "lookup@15": lookup, "dflash@15": dflash,
                "dflash-full-vocab@15": full_vocab, "dflash+lookup@15": hybrid}
    report = run_benchmark(target, tokenizer, drafters=drafters, suites=["humaneval", "mtbench"],
                           temps=[0.0, 1.0], max_tokens=64, limit=10, with_mlx_lm=False,
                           with_llama_cpp=False, progress=lambda line: print(line, flush=True))
    report["settings"]["model"] = "default (SmolLM2-135M-Instruct)"
    table = markdown_table(report)
    print(table)
    save_report(report, prefix + ".json")
    with open(prefix + ".md", "w") as f:
        f.write(table + "\n")
    plot_report(report, prefix + ".png")


if __name__ == "__main__":
    main(*sys.argv[1:])
