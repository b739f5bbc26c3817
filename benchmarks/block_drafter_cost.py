"""What one draft pass of each block drafter costs on the default SmolLM2-135M-Instruct, against
DFlash's and against a decode step of the target (issue #41's "cost of one draft pass").

The three share the shipped DFlash drafter's backbone sizes (1 layer, H 576, 9 heads, MLP 1536,
the target's 49,152-row head); weights are random (cost does not depend on them): DFlash as
shipped; DFlash2 with z-lab's released selector and convolution settings (rank 256, top 16,
kernel 2, groups of 16); DSpark with DeepSpec's (rank-256 Markov head, a confidence head
reading [h ; W1[x]]). Each drafts the same number of tokens from the same 256-token context
(DFlash and DFlash2 a block of n + 1, DSpark a block of n), greedy and at T = 1, timed to the
drafts' evaluation (`mx.eval`); DSpark also with its confidences read back to the host, as its
draft length does. Medians of REPEATS after a warm-up, with (min, max); dense fp32, OpenBLAS.

    .venv/bin/python benchmarks/block_drafter_cost.py --out docs/results/block-drafter-cost-cpu.json
    .venv/bin/python benchmarks/block_drafter_cost.py --plot-only docs/results/block-drafter-cost-cpu.json
"""

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlxspec  # before anything imports mlx.core: binds MLX to OpenBLAS
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.drafters import load_drafter
from mlxspec.sampling import SamplingConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_dflash import random_weights, save_drafter  # noqa: E402
from test_dflash2 import dflash2_weights  # noqa: E402
from test_dspark import dspark_weights  # noqa: E402

REPEATS, CONTEXT, DRAFTS = 15, 256, (7, 15)
SHIPPED = Path(mlxspec.__file__).parent / "drafters" / "trained" / "smollm2-135m-instruct-b16"


def configs(drafts: int) -> dict[str, dict]:
    """Each kind's config drafting `drafts` tokens a step: DFlash and DFlash2 shrink their
    block of 16 to drafts + 1 slots; DSpark, whose block always runs whole, gets a block of
    `drafts`."""
    base = json.loads((SHIPPED / "config.json").read_text())
    base.pop("torch_dtype")
    dflash = dict(base, block_size=16)
    dflash2 = json.loads(json.dumps(dflash))
    dflash2["architectures"] = ["DFlash2DraftModel"]
    dflash2["dflash_config"].update(conv_kernel_size=2, conv_group_size=16, selector_rank=256,
                                    selector_top_k=16)
    dspark = dict(base, architectures=["Qwen3DSparkModel"], block_size=drafts, markov_rank=256,
                  markov_head_type="vanilla", enable_confidence_head=True,
                  confidence_head_with_markov=True, **base["dflash_config"])
    dspark.pop("dflash_config")
    return {"dflash": dflash, "dflash2": dflash2, "dspark": dspark}


WEIGHTS = {"dflash": random_weights, "dflash2": dflash2_weights,
           "dspark": lambda c: dspark_weights(c, own_vocab=False)}


def draft(drafter, kind: str, prompt: list[int], n: int, temp: float) -> None:
    """One draft of n tokens, evaluated (DSpark's confidences read, as its K needs them)."""
    d = drafter.propose(prompt, n, SamplingConfig(temp=temp))
    mx.eval(d.tokens, *([] if d.probs is None else [d.probs]))
    if kind == "dspark":
        drafter.confidence_reach()


def timed(call) -> dict:
    call()  # warm-up
    seconds = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return {"median": statistics.median(seconds), "min": min(seconds), "max": max(seconds)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="the report (JSON); a .png beside it")
    parser.add_argument("--plot-only", default=None, metavar="JSON")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.plot_only).read_text()), Path(args.plot_only).with_suffix(".png"))
        return
    model, tokenizer = mlxspec.load(None)
    prompt = list(range(1000, 1000 + CONTEXT))
    report = {"machine": platform.platform(), "blas": mlxspec.blas_in_use(), "context": CONTEXT,
              "repeats": REPEATS, "ms": {}}
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt)[None], cache=cache))
    last = mx.array([[prompt[-1]]])

    def decode():
        mx.eval(model(last, cache=cache))
        for c in cache:
            c.trim(1)

    report["ms"]["decode step (target)"] = timed(decode)
    with tempfile.TemporaryDirectory() as tmp:
        for n, (kind, config) in ((n, c) for n in DRAFTS for c in configs(n).items()):
            path = save_drafter(Path(tmp) / f"{kind}-{n}", config, WEIGHTS[kind](config))
            drafter = load_drafter(kind, str(path), model=model, tokenizer=tokenizer)
            features = MLXTarget(model, capture_layers=drafter.capture_layers).prefill(prompt)
            drafter.begin(prompt, features)
            for temp in (0.0, 1.0):
                key = f"{kind} {n} drafts T={temp:g}"
                report["ms"][key] = timed(lambda: draft(drafter, kind, prompt, n, temp))
                print(key, f"{1000 * report['ms'][key]['median']:.1f} ms", flush=True)
    report["ms"] = {k: {s: 1000 * v for s, v in t.items()} for k, t in report["ms"].items()}
    unit = report["ms"]["decode step (target)"]["median"]
    report["vs_dflash"] = {k: t["median"] / report["ms"][f"dflash {k.split(' ', 1)[1]}"]["median"]
                           for k, t in report["ms"].items() if k.split(" ")[0] in WEIGHTS}
    report["vs_decode"] = {k: t["median"] / unit for k, t in report["ms"].items()}
    print(json.dumps({k: round(v, 2) for k, v in report["vs_dflash"].items()}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        plot(report, Path(args.out).with_suffix(".png"))


def plot(report: dict, path: Path) -> None:
    """Each drafter's pass in decode steps of the target, per draft count and temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = [f"{n} drafts, T={t}" for n in DRAFTS for t in ("0", "1")]
    for i, kind in enumerate(WEIGHTS):
        keys = [f"{kind} {n} drafts T={t}" for n in DRAFTS for t in ("0", "1")]
        unit = report["ms"]["decode step (target)"]["median"]
        mid = [report["ms"][k]["median"] / unit for k in keys]
        low = [m - report["ms"][k]["min"] / unit for m, k in zip(mid, keys)]
        high = [report["ms"][k]["max"] / unit - m for m, k in zip(mid, keys)]
        ax.bar([j + 0.27 * i for j in range(len(keys))], mid, 0.27, yerr=[low, high],
               capsize=2, label=kind)
    ax.set_xticks([j + 0.27 for j in range(len(labels))], labels, fontsize=8)
    ax.axhline(1.0, color="0.5", lw=0.8)
    ax.set(ylabel="one draft pass / a decode step",
           title="Block drafters' pass on SmolLM2-135M (fp32, OpenBLAS)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
