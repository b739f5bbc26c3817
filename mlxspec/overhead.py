"""The loop's own cost: how much of a step is host work, on a target too small to hide it.

On an Apple GPU a decode step of an 8B 4-bit model takes 10-20 ms, so 1-2 ms of host work a step
(building the next graph, reading results back, statistics, detokenising) is 5-20% of the speed.
A tiny target makes that share visible on any machine: a random Llama with 2 layers, hidden 64
and the real tokenizer's vocabulary, whose passes cost little more than its LM head. Per drafter:
ms per token, and per step the time spent waiting for the device's results against the rest
(host work), with passes queued ahead (the default) and one at a time (`overlap=False`); and
mlx-lm's stream_generate on the same model object and prompt tokens, paired over prompts.
"""

import time
from dataclasses import dataclass, field

import mlx.core as mx

from .bench import chat_prompt, fixed_k
from .prompts import suite_prompts
from .drafters import CopyFirstDrafter, DraftModelDrafter, load_drafter, registry
from .generate import encode_prompt, stream_request
from .intervals import paired_ratio
from .request import Request

TINY_TARGET = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                   num_attention_heads=4, num_key_value_heads=2)
TINY_DRAFT = dict(hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                  num_attention_heads=2, num_key_value_heads=1)
OVERHEAD_DRAFTERS = ("none", "lookup", "draft@4", "dflash@15")


def tiny_llama(vocab_size: int, seed: int, **sizes):
    """A random mlx-lm Llama (mlx-lm's own class) with the given sizes."""
    from mlx_lm.models import llama

    mx.random.seed(seed)
    args = llama.ModelArgs(model_type="llama", vocab_size=vocab_size, rms_norm_eps=1e-5,
                           max_position_embeddings=8192, tie_word_embeddings=False, **sizes)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def tiny_dflash(target):
    """A random one-layer DFlash drafter for `target` (16-token blocks, both its layers read):
    its drafts are rejected, its cost per pass is real."""
    from .drafters.dflash import DFlashDrafter
    from .models.dflash import DFlashConfig, DFlashModel

    args = target.args
    config = DFlashConfig(hidden_size=args.hidden_size, num_hidden_layers=1,
                          num_attention_heads=args.num_attention_heads,
                          num_key_value_heads=args.num_key_value_heads,
                          head_dim=args.hidden_size // args.num_attention_heads,
                          intermediate_size=args.intermediate_size, vocab_size=args.vocab_size,
                          num_target_layers=args.num_hidden_layers, target_layer_ids=[0, 1],
                          block_size=16, mask_token_id=0)
    model = DFlashModel(config)
    mx.eval(model.parameters())
    return DFlashDrafter(model, embed_tokens=target.model.embed_tokens, lm_head=target.lm_head,
                         final_norm=target.model.norm, target_layers=args.num_hidden_layers)


# Random weights for the model drafters measured here, where the registry would load a
# checkpoint: (target, seed) -> the drafter.
TINY_MODELS = {
    "draft": lambda target, seed: DraftModelDrafter(
        tiny_llama(target.args.vocab_size, seed, **TINY_DRAFT)),
    "dflash": lambda target, seed: tiny_dflash(target),
}


def tiny_drafter(kind: str, target, seed: int = 1):
    """A registered drafter `kind` for the tiny target: as the registry builds it when it loads
    no checkpoint; else with random weights, behind its copier for an "X+lookup" or "X+suffix"
    kind."""
    entry = registry.drafter_kind(kind)
    if entry.checkpoint is None:
        return load_drafter(kind, model=target, tokenizer=None)
    if entry.model_name not in TINY_MODELS:
        raise ValueError(f"no tiny {kind!r} drafter; choose from the drafters that load no "
                         f"checkpoint, {', '.join(TINY_MODELS)} and their +lookup and +suffix forms")
    drafter = TINY_MODELS[entry.model_name](target, seed)
    if entry.base is None:
        return drafter
    copier = load_drafter(kind.removeprefix(f"{entry.base}+"), model=target, tokenizer=None)
    return CopyFirstDrafter(drafter, copier)


@dataclass
class Timing:
    """One configuration over the prompts: per prompt, the tokens after the first, the seconds
    they took, of those the seconds spent queuing passes and waiting for them, and the passes."""

    tokens: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    queued: list[float] = field(default_factory=list)
    waited: list[float] = field(default_factory=list)
    passes: list[int] = field(default_factory=list)

    def add(self, tokens: int, seconds: float, queued=0.0, waited=0.0, passes=0) -> None:
        for values, value in ((self.tokens, tokens), (self.seconds, seconds),
                              (self.queued, queued), (self.waited, waited),
                              (self.passes, passes)):
            values.append(value)

    def drop_first(self) -> None:
        for values in (self.tokens, self.seconds, self.queued, self.waited, self.passes):
            del values[0]

    def ms_per_token(self) -> float:
        return 1e3 * sum(self.seconds) / max(sum(self.tokens), 1)

    def step_ms(self) -> dict:
        """Per target pass: wall time, queuing passes, waiting for them, and the rest."""
        passes = max(sum(self.passes), 1)
        wall, queued, waited = (sum(v) / passes for v in (self.seconds, self.queued, self.waited))
        return {"wall": 1e3 * wall, "queued": 1e3 * queued, "waited": 1e3 * waited,
                "other": 1e3 * (wall - queued - waited)}


def _time_ours(target, tokenizer, ids, drafter, request: Request, timing: Timing) -> None:
    first = start = None
    for r in stream_request(target, tokenizer, ids, request, drafter=drafter):
        if first is None:  # timed from the first token on, as mlx-lm reports tok/s
            first, start = time.perf_counter(), r
    timing.add(r.generation_tokens - 1, time.perf_counter() - first,
               r.launch_seconds - start.launch_seconds, r.wait_seconds - start.wait_seconds,
               r.target_passes - start.target_passes)


def _time_mlx_lm(target, tokenizer, ids, max_tokens, timing: Timing) -> None:
    from mlx_lm.generate import stream_generate as lm_stream
    from mlx_lm.sample_utils import make_sampler

    first = None
    for r in lm_stream(target, tokenizer, ids, max_tokens=max_tokens,
                       sampler=make_sampler(temp=0.0)):
        if first is None:
            first = time.perf_counter()
    timing.add(r.generation_tokens - 1, time.perf_counter() - first)


def run_overhead(tokenizer, *, drafters=OVERHEAD_DRAFTERS, suites=("humaneval", "mtbench"),
                 limit: int = 5, max_tokens: int = 300, seed: int = 0, progress=print) -> dict:
    """Time every configuration on each prompt before the next (greedy): ours per drafter with
    passes queued ahead and one at a time, and mlx-lm plain decoding, on the tiny target."""
    from . import _blas

    vocab = len(tokenizer.get_vocab())
    target = tiny_llama(vocab, seed, **TINY_TARGET)
    built = {label: (tiny_drafter(label.split("@")[0], target), fixed_k(label))
             for label in drafters}
    prompts = [encode_prompt(tokenizer, chat_prompt(tokenizer, text))
               for suite in suites for text in suite_prompts(suite, limit, tokenizer)]
    ours = {(label, overlap): Timing() for label in built for overlap in (True, False)}
    mlx_lm = Timing()
    for ids in [prompts[0]] + prompts:  # the first run warms up, and is dropped
        for (label, overlap), timing in ours.items():
            drafter, k = built[label]
            request = Request(max_tokens, num_draft=k, adaptive=k is None, overlap=overlap)
            _time_ours(target, tokenizer, ids, drafter, request, timing)
        _time_mlx_lm(target, tokenizer, ids, max_tokens, mlx_lm)
        progress(f"prompt {len(mlx_lm.tokens) - 1}/{len(prompts)}: " + ", ".join(
            f"{label}{'' if overlap else ' (one at a time)'} {t.ms_per_token():.2f}"
            for (label, overlap), t in ours.items()) + f", mlx-lm {mlx_lm.ms_per_token():.2f} ms/tok")
    for timing in [mlx_lm, *ours.values()]:
        timing.drop_first()
    rows = []
    for (label, overlap), timing in ours.items():
        versus = paired_ratio((timing.seconds, timing.tokens), (mlx_lm.seconds, mlx_lm.tokens))
        rows.append({"drafter": label, "overlap": overlap, "ms_per_token": timing.ms_per_token(),
                     "step_ms": timing.step_ms(), "vs_mlx_lm": versus["ratio"],
                     "vs_mlx_lm_interval": versus["interval"], "faster_prompts": versus["b_higher"],
                     "tokens": sum(timing.tokens)})
    return {
        "machine": {"blas": _blas.blas_in_use(), "mlx": mx.__version__},
        "settings": {"target": {**TINY_TARGET, "vocab_size": vocab}, "suites": list(suites),
                     "limit": limit, "max_tokens": max_tokens, "prompts": len(prompts),
                     "seed": seed},
        "mlx_lm": {"ms_per_token": mlx_lm.ms_per_token(), "tokens": sum(mlx_lm.tokens)},
        "rows": rows,
    }


def overhead_table(report: dict) -> str:
    lm = report["mlx_lm"]["ms_per_token"]
    lines = ["| drafter | passes | ms/token | ours / mlx-lm (95% interval) | step ms | queuing "
             "| waiting | other host |", "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        low, high = r["vs_mlx_lm_interval"] or (r["vs_mlx_lm"], r["vs_mlx_lm"])
        step = r["step_ms"]
        lines.append(f"| {r['drafter']} | {'queued ahead' if r['overlap'] else 'one at a time'} "
                     f"| {r['ms_per_token']:.3f} | {r['vs_mlx_lm']:.3f} [{low:.3f}, {high:.3f}] "
                     f"| {step['wall']:.3f} | {step['queued']:.3f} | {step['waited']:.3f} "
                     f"| {step['other']:.3f} |")
    lines += ["", f"mlx-lm stream_generate, plain: {lm:.3f} ms/token. Per target pass, in ms: wall "
              "time; queuing (drafting, building the pass's graph, handing it to the device: "
              "mx.async_eval, which on a CPU also runs part of it and waits for a pass it "
              "depends on); waiting (blocked on its result); other host work (the loop, "
              "statistics, detokenising, the caller). One at a time, the device idles during "
              "host work; queued ahead, the next pass is queued before this one's tokens are "
              "handled."]
    return "\n".join(lines)


def plot_overhead(report: dict, path: str) -> None:
    """Per drafter and way of queuing passes: a step's time split into waiting and host work,
    with mlx-lm's plain ms/token for scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    labels = [f"{r['drafter']}\n{'queued' if r['overlap'] else 'one at a time'}" for r in rows]
    bottom = [0.0] * len(rows)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4))
    for part, name in (("queued", "queuing passes"), ("waited", "waiting for results"),
                       ("other", "other host work")):
        values = [r["step_ms"][part] for r in rows]
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(report["mlx_lm"]["ms_per_token"], color="gray", ls="--", lw=0.8,
               label="mlx-lm plain, ms/token")
    ax.set_ylabel("ms per target pass")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7)
    ax.set_title(f"Tiny target, {report['machine']['blas']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
