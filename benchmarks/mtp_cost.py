"""What MTP drafting costs against the target, and the speedup that follows from published
acceptance rates (issue 26: no MTP model small enough for this CPU ships in a package).

Two random-weight targets in their published layouts (tests/mtp_models.py), scaled down from
the real families but keeping their structure: a Qwen3.5-shaped hybrid (Gated DeltaNet with
every 4th layer full attention, dense MLP, its one MTP layer) and a DeepSeek-V3-shaped MoE (MLA
attention, routed + shared experts, layer 0 dense, its MoE MTP layer). Dense fp32, OpenBLAS,
256 tokens of context. Medians of `REPEATS` after a warm-up, each with an interval over the
repeats (min, max):
- decode: one target pass over 1 token (the unit);
- draft: one MTP draft token (a chain of K drafts, over K);
- verify(K): one target pass over K + 1 tokens;
- step(K): one whole speculative step of the loop at fixed K (draft, verify, accept, commit),
  measured over a generation whose random drafts are all rejected (so every step is K drafts
  and one committed token: the step's cost, not its yield); step(0) is plain decoding through
  the same loop (its passes overlap the host's work, as the loop's do).

    .venv/bin/python benchmarks/mtp_cost.py --out docs/results/mtp-cost-cpu.json \
        --plot docs/results/mtp-cost-cpu.png
    .venv/bin/python benchmarks/mtp_cost.py --replot docs/results/mtp-cost-cpu.json \
        --plot docs/results/mtp-cost-cpu.png

The plot's right panel is the speedup that follows at K = 1 for an acceptance a of the one
draft, S = (1 + a) / step(1): measured step(1) on this CPU, and the model of a Mac that
docs/benchmarks.md derives (verify(1) = 1.02, a draft 0.04 of a decode step), not measured.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlxspec
import mlx.core as mx

from mlxspec.converters.hf import load_checkpoint
from mlxspec.drafters.mtp import load_mtp_drafter
from mlxspec.engine import PlainDecoding, SpecStats, speculative_tokens
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.sampling import SamplingConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from mtp_models import write_deepseek_v3, write_qwen3_5  # noqa: E402

REPEATS, CONTEXT, VOCAB = 9, 256, 32768
TARGETS = {
    "qwen3_5-shaped (16 layers, H 1024, vocab 32k)": (write_qwen3_5, dict(
        hidden_size=1024, num_hidden_layers=16, intermediate_size=3072,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_num_value_heads=16,
        linear_num_key_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        full_attention_interval=4, max_position_embeddings=4096)),
    "deepseek_v3-shaped (8 layers, H 1024, 16 experts, vocab 32k)": (write_deepseek_v3, dict(
        hidden_size=1024, num_hidden_layers=8, intermediate_size=2816,
        moe_intermediate_size=512, num_attention_heads=8, num_key_value_heads=8,
        n_routed_experts=16, num_experts_per_tok=2, kv_lora_rank=256, qk_rope_head_dim=32,
        qk_nope_head_dim=64, v_head_dim=64, max_position_embeddings=4096)),
}
GREEDY = SamplingConfig(temp=0.0)


def median_range(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def timed(fn) -> dict:
    fn()  # warm-up
    samples = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return median_range(samples)


def measure(model, drafter) -> dict:
    prompt = [(i * 7919) % 30000 + 100 for i in range(CONTEXT)]
    target = MLXTarget(model, capture_layers=drafter.capture_layers, speculative=True)
    drafter.begin(prompt, target.prefill(prompt))
    mx.eval([c.state for c in target.cache])

    def target_pass(n):
        def run():
            result = target.launch(prompt[-1], _draft(n), GREEDY)
            result.verdict()
            target.trim(n)
        return run

    def chain(k):
        def run():
            draft = drafter.propose(prompt, k, GREEDY)
            mx.eval(draft.tokens)
        return run

    out = {"decode": timed(target_pass(0)), "step(0)": step_cost(model, drafter, prompt, 0)}
    unit = out["decode"]["median"]
    for k in (1, 2, 3, 4):
        out[f"verify({k})"] = timed(target_pass(k))
        drafting = timed(chain(k))
        out[f"draft chain({k})"] = drafting
        out[f"step({k})"] = step_cost(model, drafter, prompt, k)
    out["draft"] = {key: v / 4 for key, v in out["draft chain(4)"].items()}
    return {"seconds": out, "relative": {k: v["median"] / unit for k, v in out.items()}}


def _draft(n):
    from mlxspec.engine import Draft

    return Draft(tokens=list(range(1000, 1000 + n)))


def step_cost(model, drafter, prompt, k, steps: int = 12) -> dict:
    """Seconds per step of the loop at fixed K: `steps` steps of K drafts each (the generation
    runs K + 1 tokens longer, so that no measured step is cut short by max_tokens), one
    generation per repeat, a warm-up first."""
    samples = []
    for repeat in range(REPEATS + 1):
        stats = SpecStats()
        target = MLXTarget(model, capture_layers=drafter.capture_layers, speculative=True)
        times = []
        for _ in speculative_tokens(target, drafter if k else PlainDecoding(), prompt,
                                    sampling=GREEDY, max_tokens=steps + k + 2,
                                    num_draft=max(k, 1), stats=stats):
            times.append(time.perf_counter())
        if k and (stats.drafted_per_position[k - 1] < steps or stats.accepted):
            raise RuntimeError(f"step({k}): {stats}: not {steps} steps of {k} rejected drafts")
        if repeat:
            samples.append((times[steps] - times[0]) / steps)
    return median_range(samples)


MAC_MODEL = {"verify(1)": 1.02, "draft": 0.04}  # docs/benchmarks.md, "MTP": a model, not measured


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (costs, gains) = plt.subplots(1, 2, figsize=(11, 4.2))
    ks = [1, 2, 3, 4]
    for i, (name, result) in enumerate(report["targets"].items()):
        seconds, unit = result["seconds"], result["seconds"]["decode"]["median"]
        short = name.split(" (")[0]
        for key, style in (("step", "-o"), ("verify", "--s")):
            mid = [seconds[f"{key}({k})"]["median"] / unit for k in ks]
            low = [m - seconds[f"{key}({k})"]["min"] / unit for m, k in zip(mid, ks)]
            high = [seconds[f"{key}({k})"]["max"] / unit - m for m, k in zip(mid, ks)]
            costs.errorbar(ks, mid, yerr=[low, high], fmt=style, color=f"C{i}", capsize=3,
                           label=f"{short}: {'whole step' if key == 'step' else 'verify pass'}")
        a = [x / 100 for x in range(50, 101)]
        step1 = seconds["step(1)"]["median"] / unit
        gains.plot(a, [(1 + x) / step1 for x in a], color=f"C{i}",
                   label=f"{short}, this CPU (step(1) = {step1:.2f})")
    mac = MAC_MODEL["verify(1)"] + MAC_MODEL["draft"]
    gains.plot(a, [(1 + x) / mac for x in a], "k:", label=f"a Mac, modelled (step(1) = {mac:.2f})")
    gains.axvspan(0.8, 0.9, color="0.9", label="DeepSeek-V3's published 2nd-token acceptance")
    gains.axhline(1.0, color="0.5", lw=0.8)
    costs.set(xlabel="drafts per step K", ylabel="time / one decode step", xticks=ks,
              title="MTP step cost, random-weight targets (fp32, OpenBLAS)")
    gains.set(xlabel="acceptance of the one MTP draft", ylabel="speedup over plain decoding",
              title="Speedup at K = 1: (1 + a) / step(1)")
    costs.legend(fontsize=7)
    gains.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--replot", default=None, help="plot a saved report; measure nothing")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), args.plot)
        return
    print(f"BLAS: {mlxspec.blas_in_use()}")
    report = {"blas": mlxspec.blas_in_use(), "mlx": mx.__version__, "context": CONTEXT,
              "repeats": REPEATS, "targets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (write, sizes) in TARGETS.items():
            path = write(Path(tmp) / name.split("-")[0], vocab=VOCAB, seed=0, **sizes)
            model, _ = load_checkpoint(path, lazy=False, action="load")
            drafter = load_mtp_drafter(path, model=model)
            result = measure(model, drafter)
            report["targets"][name] = result
            rel = result["relative"]
            print(f"{name}: decode {result['seconds']['decode']['median'] * 1e3:.1f} ms; "
                  f"draft token {rel['draft']:.3f}x; "
                  + f"step(0) {rel['step(0)']:.2f}x; "
                  + ", ".join(f"verify({k}) {rel[f'verify({k})']:.2f}x step({k}) "
                              f"{rel[f'step({k})']:.2f}x" for k in (1, 2, 3, 4)))
            del model, drafter
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(report, args.plot)


if __name__ == "__main__":
    main()
