"""Benchmark drafters against plain decoding and against mlx-lm, interleaved in one run.

Every prompt is run by every configuration before the next prompt starts, so a change in machine
load hits all of them alike and the ratios (spec vs plain, ours vs mlx-lm) stay meaningful even
where absolute tok/s do not.
"""

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from functools import partial

import mlx.core as mx

from . import _blas
from .generate import encode_prompt, stream_request
from .intervals import paired_ratio, paired_tau_ratio, tau, tau_interval
from .peers import LlamaCppPeer, llama_cpp_missing
from .prompts import LONG_CONTEXT_SIZES, SUITES, suite_prompts
from .request import Request, check_count
from .rollback import (recurrent_layers, restore, restore_fields, save_fields, snapshot,
                       snapshotted_layers, trim_attention)
from .sampling import SamplingConfig



@dataclass
class RunResult:
    """One configuration over one suite at one temperature, summed over prompts."""

    engine: str  # "mlxspec" or "mlx-lm"
    drafter: str
    suite: str
    temp: float
    ttft: list[float] = field(default_factory=list)
    target_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    # Per prompt, in order, for intervals over prompts (mlxspec.intervals):
    passes_per_prompt: list[int] = field(default_factory=list)
    accepted_per_prompt: list[int] = field(default_factory=list)
    # Generation time, first token excluded (as mlx-lm reports tok/s), and the tokens it timed:
    tokens_per_prompt: list[int] = field(default_factory=list)
    seconds_per_prompt: list[float] = field(default_factory=list)
    peak_memory_gb: float | None = None  # None where the engine does not report it (llama.cpp)

    def run_prompt(self, run, prompt, max_tokens, temp, seed) -> None:
        """One prompt through `run` (an engine's runner), its passes and accepts kept apart."""
        passes, accepted = self.target_passes, self.accepted
        run(prompt, max_tokens, temp, seed, self)
        self.passes_per_prompt.append(self.target_passes - passes)
        self.accepted_per_prompt.append(self.accepted - accepted)

    def add_timing(self, n: int, start: float, first: float, end: float) -> None:
        """One prompt's n tokens: TTFT, then tok/s over the tokens after the first."""
        self.ttft.append(first - start)
        self.tokens_per_prompt.append(max(n - 1, 0))
        self.seconds_per_prompt.append(end - first if n > 1 else 0.0)

    @property
    def tokens(self) -> int:
        return sum(self.tokens_per_prompt)

    @property
    def seconds(self) -> float:
        return sum(self.seconds_per_prompt)

    @property
    def tps_per_prompt(self) -> list[float]:
        return [t / s for t, s in zip(self.tokens_per_prompt, self.seconds_per_prompt) if t]

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self, plain_tps: float | None) -> dict:
        d = asdict(self)
        tps_per_prompt = self.tps_per_prompt
        d.update(
            tokens=self.tokens,
            seconds=self.seconds,
            tps_per_prompt=tps_per_prompt,
            tps=self.tps,
            tps_stdev=statistics.pstdev(tps_per_prompt) if tps_per_prompt else 0.0,
            speedup=self.tps / plain_tps if plain_tps else None,
            tau=tau([self.target_passes], [self.accepted]) if self.target_passes else None,
            tau_interval=tau_interval(self.passes_per_prompt, self.accepted_per_prompt)
            if self.target_passes else None,
            acceptance_rate=self.accepted / self.drafted if self.drafted else None,
            acceptance_per_position=[
                a / d for a, d in zip(self.accepted_per_position, self.drafted_per_position)
            ],
            ttft_mean=statistics.mean(self.ttft) if self.ttft else None,
        )
        # tau is the ideal speedup (free drafts, verify as cheap as one decode step); the cost
        # of one step relative to a plain decode step is what stands between the two.
        if plain_tps and self.target_passes and self.seconds:
            d["step_cost"] = (self.seconds / self.target_passes) * plain_tps
        else:
            d["step_cost"] = None
        return d


class SharedPrefill:
    """Each prompt prefilled once for all of our runs (`bench --prefill-once`): a kept prompt
    cache per set of target layers the drafters read (plain decoding's none, DFlash's, EAGLE-3's),
    which each run starts from and leaves cut back to the prompt. At 8k tokens a prefill takes
    minutes on a CPU, each drafter's run otherwise repeats it, and decode speed (timed after the
    first token) does not depend on it; TTFT then times a kept cache instead."""

    def __init__(self, model):
        from .backends import backend_for

        self.make = backend_for(model).prompt_cache
        self.prompt, self.caches = None, {}

    def cache_for(self, prompt, drafter):
        if prompt != self.prompt:
            self.prompt, self.caches = prompt, {}
        layers = tuple(drafter.capture_layers) if drafter is not None else ()
        if layers not in self.caches:
            self.caches[layers] = self.make()
        return self.caches[layers]


def _ours(model, tokenizer, prompt, max_tokens, temp, seed, result, *, drafter, num_draft,
          adaptive=True, shared_prefill: SharedPrefill | None = None):
    request = Request(max_tokens, SamplingConfig(temp=temp, seed=seed), num_draft=num_draft,
                      adaptive=adaptive)
    cache = shared_prefill.cache_for(prompt, drafter) if shared_prefill is not None else None
    start = time.perf_counter()
    first = last = None
    for last in stream_request(model, tokenizer, prompt, request, drafter=drafter,
                               prompt_cache=cache):
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    n = last.generation_tokens
    result.add_timing(n, start, first, end)
    result.target_passes += last.target_passes
    result.drafted += last.drafted
    result.accepted += last.accepted
    for mine, theirs in ((result.drafted_per_position, last.drafted_per_position),
                         (result.accepted_per_position, last.accepted_per_position)):
        mine += [0] * (len(theirs) - len(mine))
        for i, count in enumerate(theirs):
            mine[i] += count
    result.peak_memory_gb = max(result.peak_memory_gb or 0.0, last.peak_memory)


def _mlx_lm(model, tokenizer, prompt, max_tokens, temp, seed, result, *, draft_model, num_draft):
    from mlx_lm.generate import stream_generate as lm_stream
    from mlx_lm.sample_utils import make_sampler

    if seed is not None:
        mx.random.seed(seed)
    kwargs = {"sampler": make_sampler(temp=temp)}
    if draft_model is not None:
        kwargs.update(draft_model=draft_model, num_draft_tokens=num_draft)
    start = time.perf_counter()
    first = last = None
    drafted_hits = 0
    for last in lm_stream(model, tokenizer, prompt, max_tokens=max_tokens, **kwargs):
        if first is None:
            first = time.perf_counter()
        drafted_hits += bool(last.from_draft)
    end = time.perf_counter()
    result.add_timing(last.generation_tokens, start, first, end)
    # mlx-lm reports only which tokens came from drafts; each pass adds one target token.
    result.accepted += drafted_hits
    result.target_passes += last.generation_tokens - drafted_hits
    result.peak_memory_gb = max(result.peak_memory_gb or 0.0, last.peak_memory)


def server_model(url: str) -> tuple[str, list[str]]:
    """The model a running `mlxspec serve` at `url` serves and the drafters it offers
    (ValueError, one line, if none answers)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=10) as response:
            served = json.loads(response.read())["data"][0]
        return served["id"], list(served.get("drafters", []))
    except (OSError, ValueError, KeyError, IndexError) as err:
        raise ValueError(f"no mlxspec server answers at {url}: {err}") from None


def _server(url, model_id, prompt, max_tokens, temp, seed, result, *, drafter, num_draft):
    """One prompt through a running `mlxspec serve`: streamed text completion of the prompt as
    bench built it (chat template applied), timed at the client; passes and accepts from usage."""
    import urllib.request

    body = {"model": model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": temp,
            "seed": seed, "stream": True, "stream_options": {"include_usage": True},
            "drafter": drafter, "num_draft": num_draft}
    request = urllib.request.Request(url.rstrip("/") + "/v1/completions",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    start, first, usage = time.perf_counter(), None, None
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the server failed: {event['error']['message']}")
            if event.get("choices") and event["choices"][0].get("text") and first is None:
                first = time.perf_counter()
            usage = event.get("usage") or usage
    end = time.perf_counter()
    n = usage["completion_tokens"]
    result.add_timing(n, start, first or end, end)
    details, ours = usage["completion_tokens_details"], usage["mlxspec"]
    result.target_passes += ours["target_passes"]
    result.accepted += details["accepted_prediction_tokens"]
    result.drafted += details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"]


def _llama_cpp(peer, tokenizer, prompt, max_tokens, temp, seed, result):
    peer.run(encode_prompt(tokenizer, prompt), max_tokens, temp, seed, result,
             stop_ids=tokenizer.eos_token_ids)


def check_counts(**counts) -> None:
    """Each count a positive integer (None: the default), before any prompt runs: --limit -1
    once ran every prompt and --limit 0 none, with exit status 0."""
    for name, value in counts.items():
        if value is not None:
            check_count(name, value)


def suite_chat_prompts(model, tokenizer, suites: list[str], limit: int | None,
                       max_tokens: int) -> dict:
    """Each suite's prompts as the benchmark sends them, checked before any compute: the suite
    is known, and every prompt with its answer fits the model's window (a long-context suite
    on a model with a shorter window is refused, naming both)."""
    from .backends import backend_for

    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        raise ValueError(f"unknown suite(s) {unknown}; choose from {', '.join(SUITES)}")
    prompts_by_suite = {suite: [chat_prompt(tokenizer, p)
                                for p in suite_prompts(suite, limit, tokenizer)]
                        for suite in suites}
    window = backend_for(model).context_length(model)
    for suite, prompts in prompts_by_suite.items():
        longest = max(len(encode_prompt(tokenizer, p)) for p in prompts)
        if window is not None and longest + max_tokens > window:
            raise ValueError(f"suite {suite}: a prompt of {longest} tokens + max_tokens "
                             f"{max_tokens} exceeds the model's context window of {window} "
                             "tokens")
    return prompts_by_suite


def run_benchmark(
    model,
    tokenizer,
    *,
    drafters: dict,
    suites: list[str],
    temps: list[float],
    max_tokens: int,
    limit: int,
    num_draft: int | None = None,
    mlx_lm_draft_model=None,
    mlx_lm_num_draft: int = 4,
    with_mlx_lm: bool = True,
    with_llama_cpp: bool = True,
    llama_cpp_gguf: "str | os.PathLike | None" = None,
    llama_cpp_num_draft: int = 10,
    adaptive: bool = True,
    compare: "list[tuple[str, str]]" = (),
    seed: int = 0,
    skipped: "list[dict]" = (),
    server: str | None = None,
    prompts_by_suite: dict | None = None,
    prefill_once: bool = False,
    progress=print,
) -> dict:
    """`drafters` maps a label to a Drafter (or None for plain decoding); a label "name@K"
    runs with a fixed K drafts per step, others with the adaptive K unless `adaptive` is off.
    Peers: mlx-lm on the same model object, llama.cpp on `llama_cpp_gguf` (the same weights'
    GGUF); a peer that cannot run is listed under "skipped" with the reason. Each (a, b) in
    `compare` (two of our labels) adds tau(a) / tau(b) and tok/s(a) / tok/s(b) per suite and T,
    paired over prompts (mlxspec.intervals). `skipped` lists runs left out before this call
    ({"engine", "reason"}: a drafter the target cannot run), reported with the peers'.
    `server` (a URL of a running `mlxspec serve` of the same model) runs each of our drafter
    labels through it too, as the engine "mlxspec serve", timed at the client.
    `prompts_by_suite`: suite_chat_prompts' (built and checked before the drafters load).
    `prefill_once`: our runs of a prompt share its prefill (SharedPrefill)."""
    check_counts(max_tokens=max_tokens, limit=limit, num_draft=num_draft,
                 mlx_lm_num_draft=mlx_lm_num_draft, llama_cpp_num_draft=llama_cpp_num_draft)
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        raise ValueError(f"unknown suite(s) {unknown}; choose from {', '.join(SUITES)}")
    unknown = [label for pair in compare for label in pair if label not in drafters]
    if unknown:
        raise ValueError(f"cannot compare {unknown}: not among the drafters {list(drafters)}")
    configs, skipped = [], list(skipped)
    shared = SharedPrefill(model) if prefill_once else None
    for name, drafter in drafters.items():
        k = fixed_k(name)
        configs.append(("mlxspec", name, partial(
            _ours, model, tokenizer, drafter=drafter, num_draft=k or num_draft,
            adaptive=adaptive and k is None, shared_prefill=shared)))
    if server is not None:
        model_id, offered = server_model(server)
        for name in drafters:
            base, *options = name.split("@", 1)[0].split(":")
            reason = ("a drafter's own options are the server's, set when it started" if options
                      else None if base in offered else
                      f"the server offers {', '.join(offered)} (start it with --drafter {base})")
            if reason:
                skipped.append({"engine": f"mlxspec serve {name}", "reason": reason})
                continue
            configs.append(("mlxspec serve", name, partial(
                _server, server, model_id, drafter=base, num_draft=fixed_k(name) or num_draft)))
    if with_mlx_lm:
        configs.append(("mlx-lm", "none", partial(_mlx_lm, model, tokenizer, draft_model=None,
                                                  num_draft=mlx_lm_num_draft)))
        if mlx_lm_draft_model is not None:
            configs.append(("mlx-lm", "draft", partial(
                _mlx_lm, model, tokenizer, draft_model=mlx_lm_draft_model,
                num_draft=mlx_lm_num_draft)))
    else:
        skipped.append({"engine": "mlx-lm",
                        "reason": "turned off" if _is_mlx(model) else "runs on MLX models only"})
    if not with_llama_cpp:
        missing = "turned off"
    elif llama_cpp_gguf is None:
        missing = "no GGUF file for this model (give one with --llama-cpp-gguf)"
    else:
        missing = llama_cpp_missing()
    if prompts_by_suite is None:
        prompts_by_suite = suite_chat_prompts(model, tokenizer, suites, limit, max_tokens)
    if missing:
        skipped.append({"engine": "llama.cpp", "reason": missing})
    else:
        longest = max(len(encode_prompt(tokenizer, p))
                      for prompts in prompts_by_suite.values() for p in prompts)
        n_ctx = longest + max_tokens + llama_cpp_num_draft + 16
        for name, lookup in (("none", 0), ("lookup", llama_cpp_num_draft)):
            peer = LlamaCppPeer(llama_cpp_gguf, n_ctx, lookup_tokens=lookup)
            configs.append(("llama.cpp", name, partial(_llama_cpp, peer, tokenizer)))

    # Warm-up: first calls compile kernels and fault weights in (a kept cache's path too).
    for _ in range(2 if prefill_once else 1):
        for engine, name, run in configs:
            run(chat_prompt(tokenizer, "Hello"), 4, 0.0, seed,
                RunResult(engine, name, "warmup", 0.0))

    results, comparisons = [], []
    for suite, prompts in prompts_by_suite.items():
        for temp in temps:
            for drafter in drafters.values():  # what one suite taught stays out of the next
                if drafter is not None:
                    drafter.forget()
            row = {(e, n): RunResult(e, n, suite, temp) for e, n, _ in configs}
            for i, prompt in enumerate(prompts):
                for engine, name, run in configs:
                    row[engine, name].run_prompt(run, prompt, max_tokens, temp, seed + i)
                progress(f"{suite} T={temp} prompt {i + 1}/{len(prompts)}, so far: " + ", ".join(
                    f"{e}/{n} {r.tps:.1f} tok/s" for (e, n), r in row.items()))
            plain = {e: row[e, "none"].tps for e, n, _ in configs if (e, "none") in row}
            for (engine, _), r in row.items():
                results.append(r.summary(plain.get(engine)))
                results[-1]["speedup_vs_mlx_lm_plain"] = (
                    r.tps / plain["mlx-lm"] if plain.get("mlx-lm") else None
                )
                results[-1]["speedup_interval"] = (
                    _paired_speed(r, row[engine, "none"])["interval"] if plain.get(engine) else None
                )
            for a, b in compare:
                sides = [row["mlxspec", label] for label in (a, b)]
                comparison = {"a": a, "b": b, "suite": suite, "temp": temp}
                if all(side.target_passes for side in sides):
                    comparison.update(paired_tau_ratio(
                        *[(side.passes_per_prompt, side.accepted_per_prompt) for side in sides]))
                if all(side.seconds for side in sides):
                    speed = _paired_speed(*sides)
                    comparison.update(speed_ratio=speed["ratio"], speed_interval=speed["interval"],
                                      a_faster=speed["a_higher"], b_faster=speed["b_higher"])
                comparisons.append(comparison)
    return {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "blas": _blas.blas_in_use(), "mlx": mx.__version__},
        "settings": {"suites": suites, "temps": temps, "max_tokens": max_tokens, "limit": limit,
                     "num_draft": num_draft, "mlx_lm_num_draft": mlx_lm_num_draft,
                     "llama_cpp_gguf": llama_cpp_gguf and str(llama_cpp_gguf),
                     "llama_cpp_num_draft": llama_cpp_num_draft,
                     "seed": seed, "adaptive": adaptive, "prefill_once": prefill_once},
        "verify_cost": verify_cost(model, tokenizer) if _is_mlx(model) else None,
        "results": results,
        "comparisons": comparisons,
        "skipped": skipped,
    }


def _paired_speed(a: RunResult, b: RunResult) -> dict:
    """tok/s of a over tok/s of b, paired over the prompts both ran."""
    return paired_ratio((a.tokens_per_prompt, a.seconds_per_prompt),
                        (b.tokens_per_prompt, b.seconds_per_prompt))


def fixed_k(label: str) -> int | None:
    """K of a "name@K" drafter label, else None."""
    if "@" not in label:
        return None
    k = label.rsplit("@", 1)[1]
    if not k.isdigit() or int(k) < 1:
        raise ValueError(f"drafter label {label!r}: expected name@K with K >= 1")
    return int(k)


def _is_mlx(model) -> bool:
    return not type(model).__module__.startswith("transformers")


def verify_cost(model, tokenizer, sizes=(1, 2, 4, 8, 16), context: int = 256, repeats: int = 5):
    """Seconds of one target pass over n tokens (after `context` cached ones), relative to n=1:
    what verifying K drafts costs against one plain decode step on this machine."""
    from mlx_lm.models.cache import make_prompt_cache

    ids = (tokenizer.encode("The quick brown fox jumps over the lazy dog. ") * context)[:context]
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([ids]), cache=cache))
    # A hybrid's recurrent states are put back as they were (each pass replaces them), and so
    # are caches that roll back by their fields (deepseek_v41's).
    recurrent, snapshotted = recurrent_layers(cache), snapshotted_layers(cache)
    states, fields = snapshot(recurrent), save_fields(snapshotted)
    times = {}
    for n in sizes:
        samples = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            mx.eval(model(mx.array([ids[:n]]), cache=cache))
            samples.append(time.perf_counter() - start)
            trim_attention(cache, n)
            restore(recurrent, states)
            restore_fields(snapshotted, fields)
        times[n] = statistics.median(samples[1:])
    return {str(n): times[n] / times[sizes[0]] for n in sizes}


def chat_prompt(tokenizer, text: str) -> str:
    """A suite's prompt as the benchmark sends it: one user message in the chat template."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )


def markdown_table(report: dict) -> str:
    head = ("| suite | T | engine | drafter | tok/s | speedup vs plain | vs mlx-lm plain | tau | "
            "step cost | acceptance | TTFT s | peak GB |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for r in report["results"]:
        rows.append(
            f"| {r['suite']} | {r['temp']:g} | {r['engine']} | {r['drafter']} | "
            f"{r['tps']:.2f} ± {r['tps_stdev']:.2f} | {_x(r['speedup'])}"
            f"{_interval(r.get('speedup_interval'))} | "
            f"{_x(r['speedup_vs_mlx_lm_plain'])} | {_f(r['tau'])}{_interval(r.get('tau_interval'))} | "
            f"{_f(r.get('step_cost'))} | "
            f"{_pct(r['acceptance_rate'])} | {_f(r['ttft_mean'])} | {_f(r['peak_memory_gb'])} |"
        )
    lines = [head] + rows
    if report.get("comparisons"):
        lines += ["", "Paired over the same prompts (one drafter's tau, or tok/s, over the "
                  "other's; on how many prompts each side's own was higher):", ""]
        for c in report["comparisons"]:
            parts = []
            if "ratio" in c:
                parts.append(f"tau {c['ratio']:.3f}{_interval(c['interval'], 3)}, higher on "
                             f"{c['a_higher']} vs {c['b_higher']} of {c['prompts']} prompts")
            if "speed_ratio" in c:
                parts.append(f"tok/s {c['speed_ratio']:.3f}{_interval(c['speed_interval'], 3)}, "
                             f"faster on {c['a_faster']} vs {c['b_faster']}")
            lines.append(f"- {c['suite']} T={c['temp']:g}, {c['a']} / {c['b']}: " + "; ".join(parts))
    for skip in report.get("skipped", []):
        lines += ["", f"Skipped: {skip['engine']} ({skip['reason']})."]
    cost = report.get("verify_cost")
    if cost:
        lines += ["", "Target pass over n tokens vs one decode step (n = 1): " + ", ".join(
            f"n={n}: {c:.2f}x" for n, c in cost.items())]
    if report.get("settings", {}).get("prefill_once"):
        lines += ["", "Each prompt was prefilled once for all our runs (--prefill-once): their "
                  "TTFT times a start from a kept cache, not a prefill."]
    lines += ["", "tau is the ideal speedup (drafts free, a verify pass as cheap as a decode step); "
              "step cost = seconds per target pass (drafting + verify) / seconds per plain token, "
              "so speedup = tau / step cost."]
    return "\n".join(lines)


def _interval(bounds, digits: int = 2) -> str:
    return f" [{bounds[0]:.{digits}f}, {bounds[1]:.{digits}f}]" if bounds else ""


def _x(v):
    return f"{v:.2f}x" if v is not None else "-"


def _f(v):
    return f"{v:.2f}" if v is not None else "-"


def _pct(v):
    return f"{100 * v:.0f}%" if v is not None else "-"


def save_report(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def plot_report(report: dict, path: str) -> None:
    """Speedup over the same engine's plain decoding (bars, with their 95% intervals over the
    prompts) and tau (labels) per suite and configuration, one panel per T. Engines differ in
    absolute speed (llama.cpp runs quantised kernels): the table has tok/s, the plot what each
    engine's drafting buys it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in report["results"] if r["drafter"] != "none"]
    temps = sorted({r["temp"] for r in results})
    suites = list(dict.fromkeys(r["suite"] for r in results))
    configs = list(dict.fromkeys((r["engine"], r["drafter"]) for r in results))
    fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 4), squeeze=False)
    width = 0.8 / max(len(configs), 1)
    for ax, temp in zip(axes[0], temps):
        for j, config in enumerate(configs):
            xs, ys, taus, errors = [], [], [], [[], []]
            for i, suite in enumerate(suites):
                for r in results:
                    if (r["engine"], r["drafter"]) == config and r["suite"] == suite and r["temp"] == temp:
                        xs.append(i + j * width)
                        ys.append(r["speedup"] or 0)
                        taus.append(r["tau"])
                        low, high = r.get("speedup_interval") or (ys[-1], ys[-1])
                        errors[0].append(ys[-1] - low)
                        errors[1].append(high - ys[-1])
            bars = ax.bar(xs, ys, width, yerr=errors, capsize=2, label=f"{config[0]} {config[1]}")
            for bar, bar_tau, above in zip(bars, taus, errors[1]):
                if bar_tau:  # above the interval's top, where there is one
                    ax.annotate(f"τ{bar_tau:.2f}", (bar.get_x() + bar.get_width() / 2,
                                                     bar.get_height() + above),
                                ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xticks([i + width * (len(configs) - 1) / 2 for i in range(len(suites))], suites)
        ax.set_title(f"T = {temp:g}")
        ax.set_ylabel("speedup over the engine's plain decoding")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{report['settings'].get('model', '')} — {report['machine']['blas']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
