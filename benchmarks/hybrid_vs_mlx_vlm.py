"""Hybrid-target rollback, ours against mlx-vlm 0.7.10's state tape, on the same random weights.

A random qwen3_5 target (default: hidden 1024, 16 layers, 3 of 4 Gated DeltaNet, float32, the
shape of benchmarks/hybrid_rollback_cost.py) is written once to a temporary directory in MLX
layout; both engines load those files. 256 tokens of context, then for K = 1, 4, 8, 16 drafts:

  plain     the pass over [pending, K drafts] with the engine's rollback bookkeeping off and
            the cache restored afterwards, untimed (ours: no recording of the recurrent layers'
            inputs; mlx-vlm: its exact verifier outside a cache transaction, where on a CPU the
            gated-delta step of a multi-token pass is its chunked scan)
  baseline  the same pass with the kernels the engine's verify pass runs: ours = plain; mlx-vlm
            outside a transaction but with the per-token gated-delta loop its tape runs on
  verify    the pass as the engine runs it while speculating (ours: MLXTarget.launch + verdict,
            recording the recurrent layers' inputs and, on the CPU, keeping the Gated DeltaNet
            states of every position (mlxspec.backends.mlx.state_tape); mlx-vlm: _dflash_verify, which opens a cache
            transaction so the gated-delta step writes the state after every token), with the
            greedy acceptance argmax and the captured layers' features, as the DFlash loops do
  capture   verify - baseline: what making the pass undoable costs during it
  rollback  after a verify pass, keeping 1 + K - rejected positions (ours: MLXTarget.trim, which
            on the CPU selects the recorded state and convolution window at the last kept
            position; mlx-vlm: commit_speculative_round, which picks the recorded state at the
            accepted position), then evaluating every cache state
  cost      capture (if positive) + rollback, also as a share of verify: the issue's goal is at
            most 10% at K = 16, and no more than mlx-vlm's
  peak MB   mx.get_peak_memory() during one more verify + rollback (all rejected), untimed, above
            the memory in use before it: both hold per-token states (K x value heads x Dv x Dk
            floats per Gated DeltaNet layer; ours on the CPU), ours also the recorded layer
            inputs (K x hidden)

Plain, baseline and verify + rollback run in turn each repeat (load on a shared machine hits them
alike); medians of --repeats after one warm-up. mlx-vlm runs in its own venv (--peer-python, default
/work/peers/mlx-vlm/bin/python; see scripts/make_mlx_vlm_hybrid_fixtures.py for how to make it):
this file is also its helper, run there with --helper and answering one JSON line. Both processes
load OpenBLAS before mlx.core (mlx-vlm alone would run on mlx[cpu]'s bundled reference BLAS on
Linux, which would measure BLAS, not rollback). The full size writes about 1.1 GB of weights
under $TMPDIR (removed afterwards) and takes minutes; run it when the machine is otherwise idle:

    .venv/bin/python benchmarks/hybrid_vs_mlx_vlm.py                  # hidden 1024, 16 layers
    .venv/bin/python benchmarks/hybrid_vs_mlx_vlm.py --hidden 64 --layers 4 --vocab 512 --repeats 10
"""

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PEER_PYTHON = "/work/peers/mlx-vlm/bin/python"
OPENBLAS = ("libopenblas.so.0", "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
            "/usr/lib/aarch64-linux-gnu/libopenblas.so.0", "libopenblas.so")
PENDING, FIRST_DRAFT = 7, 9  # token ids of the verify pass: [7, 9, 10, ...]


def text_config(hidden: int, layers: int, vocab: int) -> dict:
    """qwen3_5 text settings scaled from hybrid_rollback_cost.py's hidden-1024 target."""
    heads = max(2, hidden // 128)
    head_dim = min(128, hidden // heads)
    linear_v_heads = max(2, hidden // 64)
    rotary_pairs = head_dim // 8  # partial_rotary_factor 0.25 -> head_dim / 4 dims
    return {
        "model_type": "qwen3_5_text", "vocab_size": vocab, "hidden_size": hidden,
        "num_hidden_layers": layers, "intermediate_size": hidden * 11 // 4,
        "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 4),
        "head_dim": head_dim, "linear_num_value_heads": linear_v_heads,
        "linear_num_key_heads": linear_v_heads // 2, "linear_key_head_dim": min(64, hidden // 2),
        "linear_value_head_dim": min(64, hidden // 2), "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "full_attention_interval": 4,
        "tie_word_embeddings": False, "attention_bias": False,
        # mlx-vlm's M-RoPE sections must cover the rotary frequencies; with text-only positions
        # (equal in every section) it is mlx-lm's plain RoPE.
        "rope_parameters": {"type": "default", "rope_theta": 100000.0,
                            "partial_rotary_factor": 0.25,
                            "mrope_section": [rotary_pairs - 2 * (rotary_pairs // 3),
                                              rotary_pairs // 3, rotary_pairs // 3]},
    }


def write_target(path: Path, hidden: int, layers: int, vocab: int) -> None:
    """mlx-lm's random qwen3_5 (seed 0) in MLX layout, "language_model.*" names, which both
    loaders read unchanged; the vision tower has no weights (mlx-vlm drops it, mlx-lm never
    builds one)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_5

    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "tie_word_embeddings": False, "text_config": text_config(hidden, layers, vocab),
              "vision_config": {"model_type": "qwen3_5", "depth": 1, "hidden_size": 16,
                                "intermediate_size": 32, "out_hidden_size": hidden,
                                "num_heads": 2, "patch_size": 2, "spatial_merge_size": 2,
                                "temporal_patch_size": 2, "num_position_embeddings": 16}}
    mx.random.seed(0)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(json.loads(json.dumps(config))))
    mx.eval(model.parameters())
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})


def cases(ks):
    """(K, rejected): all drafts rejected, and half of them."""
    return [(k, r) for k in ks for r in sorted({k, max(1, k // 2)}, reverse=True)]


def median_after_warmup(values):
    return statistics.median(values[1:]) if len(values) > 1 else values[0]


def capture_ids(layers: int) -> list[int]:
    return sorted({1, layers // 2, max(0, layers - 3)})  # DFlash-like feature layers


# ---- ours (our venv) ---------------------------------------------------------------------------


def measure_ours(model_dir: Path, ks, context: int, repeats: int) -> dict:
    import mlxspec  # noqa: I001  (OpenBLAS before mlx.core)

    import mlx.core as mx
    from mlx_lm.utils import load_model

    from mlxspec.engine import Draft
    from mlxspec.backends.mlx.target import MLXTarget, is_recurrent
    from mlxspec.sampling import SamplingConfig

    model, _ = load_model(model_dir)
    layers = len(model.language_model.model.layers)
    greedy = SamplingConfig()

    def states(target):
        return [c.state for c in target.cache]

    def timed_pass(target, k, record: bool) -> float:
        mixers, taped = target._mixers, target._taped
        if not record:
            # nothing recorded and no state tape (a rollback would re-run the whole model)
            target._mixers, target._taped = [], []
        start = time.perf_counter()
        try:
            target.launch(PENDING, Draft(tokens=list(range(FIRST_DRAFT, FIRST_DRAFT + k))),
                          greedy).verdict()
        finally:
            target._mixers, target._taped = mixers, taped
        return time.perf_counter() - start

    def undo(target, saved, k) -> None:
        """Back to the cache before the last pass, untimed."""
        for c in target.cache:
            if not is_recurrent(c):
                c.trim(k + 1)
        for c, state in zip([c for c in target.cache if is_recurrent(c)], saved):
            c.cache = state
        mx.eval(states(target))

    rows = []
    for k, rejected in cases(ks):
        target = MLXTarget(model, capture_layers=capture_ids(layers), speculative=True)
        target.prefill(list(range(1, context + 2)))  # context tokens, then the pending one
        plain, verify, rollback = [], [], []
        for _ in range(repeats + 1):  # interleaved, so load on the machine hits all alike
            saved = [list(c.cache) for c in target.cache if is_recurrent(c)]
            plain.append(timed_pass(target, k, record=False))
            undo(target, saved, k)
            verify.append(timed_pass(target, k, record=True))
            start = time.perf_counter()
            target.trim(rejected)
            mx.eval(states(target))
            rollback.append(time.perf_counter() - start)
        # Memory on one more step, untimed (resetting the peak frees MLX's buffer cache); the
        # last pass's record (its state tape) is dropped first, or `before` would count it.
        target._last_pass = None
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        timed_pass(target, k, record=True)
        target.trim(rejected)
        mx.eval(states(target))
        peak = mx.get_peak_memory() - before
        plain_ms = 1e3 * median_after_warmup(plain)
        rows.append({"k": k, "rejected": rejected, "plain_ms": plain_ms, "baseline_ms": plain_ms,
                     "verify_ms": 1e3 * median_after_warmup(verify),
                     "rollback_ms": 1e3 * median_after_warmup(rollback),
                     "peak_mb": peak / 2**20})
    return {"engine": "mlxspec", "blas": mlxspec.blas_in_use(), "rows": rows}


# ---- mlx-vlm (its own venv) --------------------------------------------------------------------


def preload_openblas() -> str:
    if os.environ.get("MLXSPEC_BLAS", "").lower() == "reference":
        return "bundled reference BLAS (MLXSPEC_BLAS=reference)"
    for name in OPENBLAS:
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        return f"OpenBLAS ({name})"
    return "bundled reference BLAS (OpenBLAS not found)"


def measure_mlx_vlm(model_dir: Path, ks, context: int, repeats: int) -> dict:
    blas = preload_openblas()  # before mlx.core, as mlxspec does

    import mlx.core as mx
    import mlx_vlm
    from mlx_vlm.models.cache import ArraysCache, make_prompt_cache
    from mlx_vlm.models.qwen3_5 import gated_delta, language
    from mlx_vlm.speculative.cache_state import commit_speculative_round
    from mlx_vlm.speculative.dflash import _dflash_verify
    from mlx_vlm.utils import load_model

    model = load_model(model_dir)
    lm = model.language_model
    ids = capture_ids(len(lm.model.layers))

    def states(cache):
        return [c.state for c in cache]

    def fresh_cache():
        lm._position_ids = lm._rope_deltas = None  # as generate_step does before a request
        cache = make_prompt_cache(lm)
        lm(mx.array([list(range(1, context + 1))]), cache=cache)
        mx.eval(states(cache))
        return cache

    def block(k):
        return mx.array([[PENDING] + list(range(FIRST_DRAFT, FIRST_DRAFT + k))])

    def finish(output):  # what the greedy DFlash round evaluates before it reads the tokens
        mx.eval(mx.argmax(output.logits, axis=-1), mx.concatenate(output.hidden_states, axis=-1))

    def untransacted(cache, k, sequential: bool) -> float:
        """The exact verifier outside a transaction; the cache restored afterwards, untimed."""
        chunked = gated_delta.gated_delta_chunked
        if sequential:  # the per-token loop, as under a transaction, minus the state history
            gated_delta.gated_delta_chunked = gated_delta.gated_delta_ops
        saved = [list(c.cache) if isinstance(c, ArraysCache) else None for c in cache]
        try:
            start = time.perf_counter()
            finish(language._EXACT_SPECULATIVE_VERIFIER(lm, block(k), cache=cache,
                                                        capture_layer_ids=ids))
            seconds = time.perf_counter() - start
        finally:
            gated_delta.gated_delta_chunked = chunked
        for c, state in zip(cache, saved):
            if state is None:
                c.trim(k + 1)
            else:
                c.cache = state
        mx.eval(states(cache))
        return seconds

    def speculate(cache, k, rejected) -> tuple[float, float]:
        """A DFlash round's verify pass, then its commit of 1 + K - rejected positions."""
        start = time.perf_counter()
        output, transaction = _dflash_verify(lm, block(k), cache, ids)
        finish(output)
        verified = time.perf_counter()
        commit_speculative_round(lm, cache, transaction, k - rejected, k + 1)
        mx.eval(states(cache))
        return verified - start, time.perf_counter() - verified

    rows = []
    for k, rejected in cases(ks):
        cache = fresh_cache()
        plain, baseline, verify, rollback = [], [], [], []
        for _ in range(repeats + 1):  # interleaved, so load on the machine hits all alike
            plain.append(untransacted(cache, k, sequential=False))
            baseline.append(untransacted(cache, k, sequential=True))
            seconds = speculate(cache, k, rejected)
            verify.append(seconds[0])
            rollback.append(seconds[1])
        # Memory on one more step, untimed (resetting the peak frees MLX's buffer cache).
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        speculate(cache, k, rejected)
        peak = mx.get_peak_memory() - before
        rows.append({"k": k, "rejected": rejected,
                     "plain_ms": 1e3 * median_after_warmup(plain),
                     "baseline_ms": 1e3 * median_after_warmup(baseline),
                     "verify_ms": 1e3 * median_after_warmup(verify),
                     "rollback_ms": 1e3 * median_after_warmup(rollback),
                     "peak_mb": peak / 2**20})
    return {"engine": f"mlx-vlm {mlx_vlm.__version__}", "blas": blas, "rows": rows}


def run_peer(python: str, model_dir: Path, args) -> dict:
    command = [python, str(Path(__file__).resolve()), "--helper", str(model_dir),
               "--ks", args.ks, "--context", str(args.context), "--repeats", str(args.repeats)]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
    line = next(l for l in reversed(done.stdout.splitlines()) if l.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


# ---- report ------------------------------------------------------------------------------------


def table(results: list[dict]) -> str:
    lines = [("| K | rejected | engine | plain ms | baseline ms | verify ms | capture ms | "
              "rollback ms | cost ms (share of verify) | peak MB |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    by_case = {}
    for result in results:
        for row in result["rows"]:
            by_case.setdefault((row["k"], -row["rejected"]), []).append((result["engine"], row))
    for (k, minus_rejected), entries in sorted(by_case.items()):
        for engine, row in entries:
            capture = row["verify_ms"] - row["baseline_ms"]
            cost = max(capture, 0.0) + row["rollback_ms"]
            peak = f"{row['peak_mb']:.1f}" if row["rejected"] == k else ""
            lines.append(
                f"| {k} | {-minus_rejected} | {engine} | {row['plain_ms']:.2f} | "
                f"{row['baseline_ms']:.2f} | {row['verify_ms']:.2f} | {capture:+.2f} | "
                f"{row['rollback_ms']:.2f} | {cost:.2f} ({cost / row['verify_ms']:.0%}) | {peak} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--context", type=int, default=256, help="tokens before the pass")
    parser.add_argument("--ks", default="1,4,8,16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peer-python", default=os.environ.get("MLX_VLM_PYTHON", PEER_PYTHON))
    parser.add_argument("--helper", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]

    if args.helper:  # inside mlx-vlm's venv: no mlxspec, no mlx-lm
        result = measure_mlx_vlm(Path(args.helper), ks, args.context, args.repeats)
        print("RESULT " + json.dumps(result), flush=True)
        return

    import mlxspec  # noqa: F401  (OpenBLAS before write_target imports mlx.core)

    with tempfile.TemporaryDirectory(prefix="hybrid_vs_mlx_vlm-") as tmp:
        model_dir = Path(tmp) / "qwen3_5"
        write_target(model_dir, args.hidden, args.layers, args.vocab)
        results = [measure_ours(model_dir, ks, args.context, args.repeats)]
        if Path(args.peer_python).is_file():
            results.append(run_peer(args.peer_python, model_dir, args))
        else:
            print(f"(no mlx-vlm: {args.peer_python} not found; --peer-python)", file=sys.stderr)
    config = text_config(args.hidden, args.layers, args.vocab)
    print(f"qwen3_5 float32: hidden {args.hidden}, {args.layers} layers "
          f"({args.layers - args.layers // 4} Gated DeltaNet), vocab {args.vocab}, "
          f"{config['num_attention_heads']} heads x {config['head_dim']}, "
          f"{args.context} tokens of context; medians of {args.repeats}")
    for result in results:
        print(f"{result['engine']}: {result['blas']}")
    print()
    print(table(results))


if __name__ == "__main__":
    main()
