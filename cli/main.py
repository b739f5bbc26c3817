"""`mlxspec` command line: a thin layer over the Python API."""

import sys

import click

from mlxspec import _blas

_blas.preload_openblas()

from mlxspec.cli.errors import _fail, _user_errors  # noqa: E402  (after OpenBLAS is loaded above)
from mlxspec.cli.options import (  # noqa: E402
    DrafterChoice,
    _backend,
    _check_backend,
    _check_drafter,
    _check_kv_bits,
    _constraint,
    _drafter_option_flags,
    _options_for,
    constraint_options,
    kv_cache_options,
    model_options,
    shard_option,
)
from mlxspec.cli.prompt_cache_files import (  # noqa: E402
    PROMPT_CACHE_FILE,
    check_prompt_cache_file,
    open_prompt_cache,
    save_prompt_cache,
)
from mlxspec.cli.serve import serve  # noqa: E402
from mlxspec.cli.targets import _backend_line, load_target, split_target  # noqa: E402
from mlxspec.cli.train import train  # noqa: E402
from mlxspec.distributed import DistributedError  # noqa: E402
from mlxspec.drafters import registry  # noqa: E402
from mlxspec.prompts import SUITES  # noqa: E402


POSITIVE = click.IntRange(min=1)  # a count: 0 or -1 would mean "none" or "all", silently


def decoding_options(f):
    options = [
        click.option("--drafter", type=DrafterChoice(), default="none", show_default=True,
                     help="Source of draft tokens for speculative decoding; X+lookup (X+suffix) "
                          "drafts by prompt lookup (suffix decoding) where it finds a match and "
                          "by X elsewhere."),
        click.option("--draft-model", "--drafter-model", "draft_model", default=None,
                     help="The checkpoint of a model drafter (and of its +lookup and +suffix "
                          "forms): "
                          + "; ".join(f"--drafter {k.name}: {_checkpoint_help(k)}"
                                      for k in registry.model_drafters()) + "."),
        *_drafter_option_flags(),
        click.option("--num-draft", "-k", type=int, default=None,
                     help="The most drafts per step (default: the drafter's own; with an "
                          "adaptive K it may be higher, e.g. 12 for a draft model, not 4)."),
        click.option("--adaptive/--fixed-k", default=True, show_default=True,
                     help="Draft fewer than --num-draft while live acceptance is low."),
        click.option("--max-tokens", "-n", type=int, default=256, show_default=True),
        click.option("--temp", type=float, default=0.0, show_default=True,
                     help="Sampling temperature; 0 is greedy."),
        click.option("--top-p", type=float, default=1.0, show_default=True),
        click.option("--top-k", type=int, default=0, show_default=True),
        click.option("--min-p", type=float, default=0.0, show_default=True),
        click.option("--seed", type=int, default=None),
        *kv_cache_options(),
        *constraint_options(),
        click.option("--system", default=None, help="System prompt for the chat template."),
        click.option("--no-chat-template", is_flag=True,
                     help="Use the prompt as raw text instead of a chat message."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _checkpoint_help(kind) -> str:
    shipped = f" (default: {kind.checkpoint.shipped_help})" if kind.checkpoint.shipped else ""
    return kind.checkpoint.what + shipped


def _request(max_tokens, num_draft=None, adaptive=True, kv_bits=None, kv_group_size=64,
             constraint=None, **sampling):
    """The generation's Request from the flags, checked before a model loads (chat: before the
    REPL starts); a refused value names its flag."""
    from mlxspec.request import Request
    from mlxspec.sampling import SamplingConfig

    try:
        return Request(max_tokens, SamplingConfig(**sampling), num_draft=num_draft,
                       adaptive=adaptive, kv_bits=kv_bits, kv_group_size=kv_group_size,
                       constraint=constraint)
    except (TypeError, ValueError) as err:
        name = str(err).split()[0]
        raise click.BadParameter(str(err), param_hint=f"--{name.replace('_', '-')}") from None


def _config_before_loading(folder) -> dict | None:
    """A config.json read without loading anything; None where there is none yet (a .gguf, a
    repo id, the default model before its first conversion) or it does not parse (the load
    names that problem)."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(folder).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _check_against_target(model, dtype, drafter, draft_model, options):
    """What the target's and the drafter's config.json already refuse, before any weight loads:
    --exit-layer past the target's layers, --block-size past the DFlash checkpoint's block.
    Where a config cannot be read yet, the load refuses it as before."""
    from mlxspec.loading import DEFAULT_MODEL_NAME, cache_dir

    folder = cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-{dtype}" if model is None else model
    target = _config_before_loading(folder) or {}
    layers = target.get("num_hidden_layers", target.get("text_config", {}).get("num_hidden_layers"))
    exit_layer = options.get("exit_layer")
    if exit_layer is not None and isinstance(layers, int) and not 1 <= exit_layer < layers:
        raise click.BadParameter(f"must be in 1..{layers - 1} for this {layers}-layer target, "
                                 f"got {exit_layer}", param_hint="--exit-layer")
    block_size = options.get("block_size")
    if block_size is None or registry.drafter_kind(drafter).model_name != "dflash":
        return
    blocks = [c.get("block_size") for c in map(_config_before_loading, _dflash_checkpoints(
        draft_model, target)) if c]
    if blocks and all(isinstance(b, int) for b in blocks) and not 2 <= block_size <= max(blocks):
        raise click.BadParameter(f"must be between 2 and the checkpoint's {max(blocks)}, got "
                                 f"{block_size}", param_hint="--block-size")


def _dflash_checkpoints(draft_model, target: dict) -> list:
    """The DFlash checkpoint(s) a run may load: --draft-model, else those shipped for a target
    of these sizes (which one is told by its weights, once loaded)."""
    from mlxspec.drafters.shipped import shipped_candidates

    if draft_model:
        return [draft_model]
    sizes = (target.get("hidden_size"), target.get("vocab_size"), target.get("num_hidden_layers"))
    return [folder for folder, _ in shipped_candidates(sizes)]


def _load_all(model, dtype, backend, device, drafter, draft_model, options, verbose, shard):
    import mlxspec

    target, tokenizer = load_target(model, dtype, backend, device, shard)
    split_target(target)
    try:
        spec = mlxspec.load_drafter(drafter, draft_model, model=target, tokenizer=tokenizer,
                                    **_options_for(drafter, options))
    except _user_errors() as err:
        _fail(err)
    if verbose:
        click.echo(_backend_line(target), err=True)
    return target, tokenizer, spec


def build_prompt(tokenizer, messages, no_chat_template, template: str = "the chat template"):
    """The prompt text; a template that fails to render (a syntax error, a `raise_exception`, an
    error of its own) is a ValueError naming `template` (where it came from)."""
    if no_chat_template or getattr(tokenizer, "chat_template", None) is None:
        return "\n".join(m["content"] for m in messages)
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as err:  # noqa: BLE001  the template is the model's data, not our code
        from mlxspec.file_checks import one_line

        raise ValueError(f"{template} failed to render: {one_line(err)}; fix it, or pass "
                         "--no-chat-template") from None


def _template_name(target) -> str:
    """Where the model's chat template lives, for messages: chat_template.jinja or
    tokenizer_config.json in the directory it loaded from."""
    from pathlib import Path

    from mlxspec.loading import SOURCE

    source = getattr(target, SOURCE, None)
    if source is None:
        return "the chat template"
    jinja = Path(source) / "chat_template.jinja"
    return f"chat template {jinja if jinja.exists() else Path(source) / 'tokenizer_config.json'}"


def _read_stdin() -> str:
    """Stdin as text, undecodable bytes kept as surrogates for `check_utf8` to name."""
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
    return sys.stdin.read()




def _messages(system, history):
    return ([{"role": "system", "content": system}] if system else []) + history


@click.group()
@click.version_option(package_name="mlxspec")
def main():
    """mlxspec: lossless speculative decoding on MLX."""


@main.command()
@click.option("--prompt", "-p", default=None, help="The prompt; '-' reads it from stdin.")
@click.option("--prompts", "prompts_file", default=None, type=click.File("rb"),
              help="A file of prompts, one per line ('-': stdin), generated together as a "
                   "batch; each reply is printed as a JSON line, in order.")
@model_options
@shard_option
@decoding_options
@PROMPT_CACHE_FILE
@click.option("--verbose", "-v", is_flag=True, help="Print speed and acceptance statistics.")
def generate(prompt, prompts_file, model, dtype, backend, device, shard, drafter, draft_model,
             num_draft, adaptive, max_tokens, temp, top_p, top_k, min_p, seed, kv_bits,
             kv_group_size, json_schema, json_object, regex, grammar, system, no_chat_template,
             prompt_cache_file, verbose, **drafter_options):
    """Generate a reply to one prompt, or to each of a file's prompts at once (--prompts)."""
    import mlxspec
    from mlxspec.generate import check_utf8, format_stats

    if (prompt is None) == (prompts_file is None):
        raise click.UsageError("give either --prompt or --prompts")
    if prompts_file is not None:
        prompts = _prompt_lines(prompts_file)
    else:
        try:
            prompt = check_utf8(_read_stdin() if prompt == "-" else prompt, "the prompt")
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--prompt") from None
        if not prompt.strip():
            raise click.BadParameter("the prompt is empty", param_hint="--prompt")
    request = _request(max_tokens, num_draft, adaptive, kv_bits, kv_group_size,
                       _constraint(json_schema, json_object, regex, grammar), temp=temp,
                       top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    _check_drafter(drafter, draft_model, drafter_options)
    _check_backend(backend, device)
    _check_kv_bits(kv_bits, backend)
    if prompts_file is not None:
        _check_batch(backend)
        if prompt_cache_file is not None:
            raise click.BadParameter("holds one prompt's cache: use it with --prompt",
                                     param_hint="--prompt-cache-file")
    check_prompt_cache_file(prompt_cache_file, backend)
    _check_against_target(model, dtype, drafter, draft_model, drafter_options)
    target, tokenizer, spec = _load_all(model, dtype, backend, device, drafter, draft_model,
                                        drafter_options, verbose, shard)
    if prompts_file is not None:
        return _generate_batch(target, tokenizer, spec, prompts, request, system,
                               no_chat_template, verbose)
    cache = open_prompt_cache(prompt_cache_file, target)
    last = None
    try:
        text = build_prompt(tokenizer, _messages(system, [{"role": "user", "content": prompt}]),
                            no_chat_template, _template_name(target))
        for last in mlxspec.stream_request(target, tokenizer, text, request, drafter=spec,
                                           prompt_cache=cache):
            click.echo(last.text, nl=False)
    except (ValueError, DistributedError) as err:
        _fail(err)
    click.echo()
    save_prompt_cache(cache, prompt_cache_file)
    if verbose and last is not None:
        click.echo("=" * 10, err=True)
        click.echo(format_stats(last), err=True)


def _prompt_lines(file) -> list[str]:
    """The non-empty lines of a --prompts file, each checked as UTF-8 text (named by line)."""
    from mlxspec.generate import check_utf8

    prompts = []
    for number, line in enumerate(file.read().splitlines(), start=1):
        text = line.decode("utf-8", errors="surrogateescape")
        try:
            check_utf8(text, f"line {number}")
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--prompts") from None
        if text.strip():
            prompts.append(text)
    if not prompts:
        raise click.BadParameter("the file has no prompts (one per line)", param_hint="--prompts")
    return prompts


def _check_batch(backend):
    """What a batch cannot run, refused before a model loads (a drafter that cannot draft for
    a row, LayerSkip, is refused once loaded, before any generation)."""
    from mlxspec.backends import backend_named
    from mlxspec.distributed import launched

    if backend_named(backend).batch_target is None:
        raise click.BadParameter(f"the {backend} backend runs one sequence at a time; batches "
                                 "run on MLX", param_hint="--backend")
    if launched():
        raise click.UsageError("--prompts: a target split across ranks runs one sequence at a "
                               "time")


def _generate_batch(target, tokenizer, spec, prompts, request, system, no_chat_template,
                    verbose):
    """--prompts: every prompt a row of one batch; a JSON line per reply, in order."""
    import json

    import mlxspec
    from mlxspec.batch import format_batch_stats

    try:
        texts = [build_prompt(tokenizer, _messages(system, [{"role": "user", "content": p}]),
                              no_chat_template, _template_name(target)) for p in prompts]
        sampling = request.sampling
        out = mlxspec.batch_generate(
            target, tokenizer, texts, request.max_tokens, drafter=spec,
            num_draft=request.num_draft, adaptive=request.adaptive, temp=sampling.temp,
            top_p=sampling.top_p, top_k=sampling.top_k, min_p=sampling.min_p, seed=sampling.seed,
            kv_bits=request.kv_bits, kv_group_size=request.kv_group_size,
            constraint=request.constraint)
    except ValueError as err:
        _fail(err)
    for i, (text, ids, reason) in enumerate(zip(out.texts, out.token_ids, out.finish_reasons)):
        click.echo(json.dumps({"index": i, "text": text, "finish_reason": reason,
                               "generation_tokens": len(ids)}))
    if verbose:
        click.echo("=" * 10, err=True)
        click.echo(format_batch_stats(out), err=True)


@main.command()
@model_options
@shard_option
@decoding_options
@click.option("--color/--no-color", default=None,
              help="Colour tokens that came from drafts (default: on when stdout is a TTY).")
@PROMPT_CACHE_FILE
def chat(model, dtype, backend, device, shard, drafter, draft_model, num_draft, adaptive,
         max_tokens, temp, top_p, top_k, min_p, seed, kv_bits, kv_group_size, json_schema,
         json_object, regex, grammar, system, no_chat_template, color, prompt_cache_file,
         **drafter_options):
    """Chat in a REPL. /reset clears history, /quit exits; Ctrl-C stops a reply, keeping history."""
    import mlxspec
    from mlxspec.backends import backend_for
    from mlxspec.generate import check_utf8

    request = _request(max_tokens, num_draft, adaptive, kv_bits, kv_group_size,
                       _constraint(json_schema, json_object, regex, grammar), temp=temp,
                       top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    _check_drafter(drafter, draft_model, drafter_options)
    _check_backend(backend, device)
    _check_kv_bits(kv_bits, backend)
    check_prompt_cache_file(prompt_cache_file, backend)
    _check_against_target(model, dtype, drafter, draft_model, drafter_options)
    target, tokenizer, spec = _load_all(model, dtype, backend, device, drafter, draft_model,
                                        drafter_options, False, shard)
    color = sys.stdout.isatty() if color is None else color
    # Turns prefill only what is new; with a file, across sessions too.
    prompt_cache = open_prompt_cache(prompt_cache_file, target) or \
        backend_for(target).prompt_cache()
    history = []
    template = _template_name(target)
    click.echo("mlxspec chat: /reset clears the history, /quit exits.")
    if hasattr(sys.stdin, "reconfigure"):  # a bad byte is refused per line, below
        sys.stdin.reconfigure(errors="surrogateescape")
    while True:
        try:
            line = input(">> ")
        except EOFError:
            break
        except KeyboardInterrupt:
            click.echo()
            continue
        command = line.strip()
        if command in ("/quit", "/exit"):
            break
        if command == "/reset":
            history = []
            click.echo("(history cleared)")
            continue
        if not command:
            continue
        try:
            check_utf8(line, "the line")
        except ValueError as err:  # the history stays as it was
            click.echo(f"Error: {err}", err=True)
            continue
        history.append({"role": "user", "content": line})
        reply, last = "", None
        try:
            prompt = build_prompt(tokenizer, _messages(system, history), no_chat_template,
                                  template)
            for last in mlxspec.stream_request(target, tokenizer, prompt, request, drafter=spec,
                                               prompt_cache=prompt_cache):
                reply += last.text
                shown = click.style(last.text, fg="cyan") if color and last.from_draft else last.text
                click.echo(shown, nl=False)
        except KeyboardInterrupt:
            click.echo("\n(interrupted)")
        except DistributedError as err:  # another rank is gone: no later turn can run
            _fail(err)
        except ValueError as err:  # e.g. the conversation outgrew the context window
            history.pop()
            click.echo(f"\nError: {err}", err=True)
            continue
        history.append({"role": "assistant", "content": reply})
        save_prompt_cache(prompt_cache if prompt_cache_file else None, prompt_cache_file)
        click.echo()
        if last is not None:
            click.echo(_turn_summary(last), err=True)


def _turn_summary(r) -> str:
    summary = f"[{r.generation_tokens} tokens, {r.generation_tps:.1f} tok/s"
    if r.drafter != "none":
        summary += (f", {r.drafter}: tau {r.tau:.2f}, accepted {r.accepted}/{r.drafted}"
                    f" ({100 * r.acceptance_rate:.0f}%)")
    return summary + "]"


@main.command()
@click.argument("source")
@click.option("--out", "-o", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Output directory (written atomically).")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
              help="Cast dense weights (GGUF default: float32).")
@click.option("--quantize", "-q", is_flag=True, help="Quantize to MLX affine weights.")
@click.option("--q-bits", type=int, default=4, show_default=True,
              help="Bits per quantized weight: 1, 2, 3, 4, 5, 6 or 8.")
@click.option("--q-group-size", type=int, default=64, show_default=True,
              help="Weights per quantization group: 32, 64 or 128.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
def convert(source, out_dir, dtype, quantize, q_bits, q_group_size, overwrite):
    """Convert a Hugging Face repo/directory or a .gguf file into an MLX model directory."""
    from mlxspec.converters import convert as convert_any

    try:
        out = convert_any(source, out_dir, dtype=dtype, quantize=quantize, q_bits=q_bits,
                          q_group_size=q_group_size, overwrite=overwrite)
    except _user_errors() as err:
        _fail(err)
    click.echo(f"Wrote {out}")


def _csv(kind):
    def parse(ctx, param, value):
        try:
            return [kind(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise click.BadParameter(f"expected a comma-separated list, got {value!r}") from None

    return parse


def bench_drafter_options(f):
    """bench: a --NAME-model flag per model drafter (--draft-model, --dflash-model, ...), then
    the drafters' options, all from the registry."""
    flags = [click.option(f"--{k.name}-model", f"{k.name}_model", default=None,
                          help=f"The {k.name} drafter's checkpoint: {_checkpoint_help(k)}.")
             for k in registry.model_drafters()]
    for option in reversed(flags + _drafter_option_flags()):
        f = option(f)
    return f


@main.command()
@model_options
@click.option("--drafters", default="none,lookup", show_default=True, callback=_csv(str),
              help=f"Comma-separated, from: {', '.join(registry.drafter_names())}; name@K for a "
                   "fixed K; name:flag=value for a drafter's own option, e.g. "
                   "dflash:tree-budget=16 beside dflash (chain and tree in one run).")
@bench_drafter_options
@click.option("--suite", "suites", default="humaneval,mtbench,copy", show_default=True,
              callback=_csv(str),
              help=f"Comma-separated prompt suites, from: {', '.join(SUITES)} (long1k/4k/8k: "
                   "long-context requests about a module of real code filling that window).")
@click.option("--temp", "temps", default="0", show_default=True, callback=_csv(float),
              help="Comma-separated temperatures.")
@click.option("--max-tokens", "-n", type=POSITIVE, default=128, show_default=True)
@click.option("--limit", type=POSITIVE, default=10, show_default=True, help="Prompts per suite.")
@click.option("--num-draft", "-k", type=POSITIVE, default=None)
@click.option("--adaptive/--fixed-k", default=True, show_default=True,
              help="Adaptive draft length for our drafters; a drafter written name@K (e.g. "
                   "draft@4) always drafts K.")
@click.option("--mlx-lm/--no-mlx-lm", "with_mlx_lm", default=None,
              help="Also run mlx-lm (plain, and --draft-model) on the same prompts "
                   "(default: on with --backend mlx; not available with --backend torch).")
@click.option("--mlx-lm-num-draft", type=POSITIVE, default=4, show_default=True)
@click.option("--llama-cpp/--no-llama-cpp", "with_llama_cpp", default=True, show_default=True,
              help="Also run llama.cpp (llama-cpp-python, if installed), plain and with its prompt "
                   "lookup, on the model's GGUF file; reported as skipped where it cannot run.")
@click.option("--llama-cpp-gguf", default=None, type=click.Path(exists=True, dir_okay=False),
              help="GGUF file for llama.cpp (default: the model's own, when it was loaded from one).")
@click.option("--llama-cpp-num-draft", type=POSITIVE, default=10, show_default=True,
              help="Tokens llama.cpp's prompt lookup drafts per step.")
@click.option("--server", default=None, metavar="URL",
              help="Also run each of --drafters through a running `mlxspec serve` of the same "
                   "model at URL (e.g. http://127.0.0.1:8080), timed at the client.")
@click.option("--compare", "comparisons", multiple=True, metavar="A/B",
              help="Report tau(A) / tau(B) and tok/s(A) / tok/s(B) for two of --drafters, paired "
                   "over the same prompts, with 95% bootstrap intervals (repeatable), e.g. "
                   "dflash+lookup/lookup.")
@click.option("--prefill-once", is_flag=True,
              help="Prefill each prompt once for all of our drafters (a kept prompt cache per "
                   "set of target layers they read) instead of once per drafter: long suites "
                   "run in a fraction of the time; tok/s and tau are unchanged, TTFT then times "
                   "a kept cache.")
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="Results JSON.")
@click.option("--markdown", default=None, type=click.Path(dir_okay=False),
              help="Also write the results table as Markdown.")
@click.option("--plot", default=None, type=click.Path(dir_okay=False),
              help="Also plot speedup and tau per suite (PNG; needs matplotlib).")
@click.option("--overhead", is_flag=True,
              help="Measure the loop's own cost instead: per drafter, ms/token and where a step's "
                   "time goes (waiting for the device vs host work) on a tiny random target (2 "
                   "layers, hidden 64, the model's tokenizer), passes queued ahead and one at a "
                   "time, against mlx-lm's plain decoding. Greedy; drafters default to "
                   "none,lookup,draft@4,dflash@15.")
def bench(model, dtype, backend, device, drafters, suites, temps, max_tokens, limit, num_draft,
          adaptive, with_mlx_lm, mlx_lm_num_draft, with_llama_cpp, llama_cpp_gguf,
          llama_cpp_num_draft, server, comparisons, prefill_once, out, markdown, plot, overhead,
          **drafter_flags):
    """Benchmark drafters against plain decoding and mlx-lm, interleaved in one run."""
    import mlxspec
    from mlxspec.bench import fixed_k, markdown_table, run_benchmark, suite_chat_prompts
    from mlxspec.distributed import launched
    from mlxspec.loading import gguf_file

    if launched():
        raise click.UsageError("bench runs in one process; a split target's benchmark is "
                               "benchmarks/distributed_loopback.py")

    paths = {k.name: drafter_flags.pop(f"{k.name}_model", None) for k in registry.model_drafters()}
    draft_model = paths.get("draft")  # mlx-lm's draft model too

    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.BadParameter("needs matplotlib: pip install 'mlxspec[bench]'",
                                     param_hint="--plot") from None
    bad = [d for d in drafters if d.split("@")[0].split(":")[0] not in registry.drafter_names()]
    if bad:
        raise click.BadParameter(f"unknown drafter(s) {bad}", param_hint="--drafters")
    try:
        labels = {d: registry.parse_label(d) for d in drafters}
        for d in drafters:
            fixed_k(d)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--drafters") from None
    kinds = sorted({name for name, _ in labels.values()})
    pairs = [tuple(c.split("/")) for c in comparisons]
    bad = [c for c, pair in zip(comparisons, pairs)
           if len(pair) != 2 or not set(pair) <= set(drafters)]
    if bad:
        raise click.BadParameter(f"{bad}: each must be A/B, two of --drafters {list(drafters)}",
                                 param_hint="--compare")
    bad = [s for s in suites if s not in SUITES]
    if bad:
        raise click.BadParameter(f"unknown suite(s) {bad}; choose from {', '.join(SUITES)}",
                                 param_hint="--suite")
    for temp in temps:
        _request(max_tokens, temp=temp)
    if overhead:
        return _bench_overhead(model, dtype, backend, drafters, suites, temps, max_tokens, limit,
                               out, markdown, plot)
    for kind in map(registry.drafter_kind, kinds):
        checkpoint, flag = kind.checkpoint, f"--{kind.model_name}-model"
        if checkpoint and not checkpoint.shipped and not paths.get(kind.model_name):
            raise click.BadParameter(f"the {kind.model_name} drafter needs {flag}", param_hint=flag)
    _check_backend(backend, device)
    if with_mlx_lm and not _backend(backend).mlx_lm:
        raise click.BadParameter("mlx-lm runs on MLX only; drop it with --backend torch",
                                 param_hint="--mlx-lm")
    with_mlx_lm = _backend(backend).mlx_lm if with_mlx_lm is None else with_mlx_lm
    try:
        if server is not None:  # an unreachable server fails here, before any model loads
            from mlxspec.bench import server_model

            server_model(server)
        target, tokenizer = mlxspec.load(model, dtype=dtype, backend=backend, device=device)
        prompts = suite_chat_prompts(target, tokenizer, suites, limit, max_tokens)
        made, built = {}, {}  # one drafter per kind and options, whatever the K
        skipped = []  # drafters this target cannot run (no MTP modules), with the reason
        for label, (name, own) in labels.items():
            reason = None if paths.get(registry.drafter_kind(name).model_name) else \
                registry.why_unavailable(name, target)
            if reason:
                skipped.append({"engine": f"mlxspec {label}", "reason": reason})
                continue
            options = {**_options_for(name, drafter_flags), **own}
            key = (name, tuple(sorted(options.items())))
            drafter = made.get(key)
            if drafter is None or drafter.remembers:  # one that learns from each request is
                # each label's own: suffix@8 must not draft from suffix's reply to the prompt
                drafter = mlxspec.load_drafter(
                    name, paths.get(registry.drafter_kind(name).model_name), model=target,
                    tokenizer=tokenizer, **options)
                made.setdefault(key, drafter)
            built[label] = drafter
        lm_draft = None
        if with_mlx_lm:
            ours = next((d for (name, _), d in made.items() if name == "draft"), None)
            lm_draft = ours.model if ours is not None else (
                mlxspec.load(draft_model, dtype=dtype)[0] if draft_model else None)
    except _user_errors() as err:
        _fail(err)
    click.echo(_backend_line(target), err=True)
    report = run_benchmark(
        target, tokenizer, drafters=built, suites=suites, temps=temps, max_tokens=max_tokens,
        limit=limit, num_draft=num_draft, mlx_lm_draft_model=lm_draft,
        mlx_lm_num_draft=mlx_lm_num_draft, with_mlx_lm=with_mlx_lm, with_llama_cpp=with_llama_cpp,
        llama_cpp_gguf=llama_cpp_gguf or gguf_file(model), llama_cpp_num_draft=llama_cpp_num_draft,
        adaptive=adaptive, compare=[p for p in pairs if set(p) <= set(built)], skipped=skipped,
        server=server, prompts_by_suite=prompts, prefill_once=prefill_once,
        progress=lambda line: click.echo(line, err=True),
    )
    report["settings"]["model"] = model or "default (SmolLM2-135M-Instruct)"
    report["settings"]["draft_model"] = draft_model
    report["settings"]["server"] = server
    report["settings"]["backend"] = backend
    if _backend(backend).devices:
        report["settings"]["device"] = _backend_line(target)
    from mlxspec.bench import plot_report

    _emit_report(report, markdown_table(report), out, markdown, plot, plot_report)


def _emit_report(report, table, out, markdown, plot, plotter):
    """Print the table; write the JSON, Markdown and plot asked for."""
    from mlxspec.bench import save_report

    click.echo(table)
    if out:
        save_report(report, out)
    if markdown:
        with open(markdown, "w") as f:
            f.write(table + "\n")
    if plot:
        plotter(report, plot)


def _bench_overhead(model, dtype, backend, drafters, suites, temps, max_tokens, limit, out,
                    markdown, plot):
    """`bench --overhead`: the tiny target needs only the model's tokenizer."""
    from mlxspec.checkpoint_checks import load_tokenizer
    from mlxspec.loading import resolve_model_dir
    from mlxspec.overhead import OVERHEAD_DRAFTERS, overhead_table, plot_overhead, run_overhead

    if not _backend(backend).mlx_lm:
        raise click.BadParameter("measures the MLX loop", param_hint="--overhead")
    if any(t != 0 for t in temps):
        raise click.BadParameter("--overhead runs greedy (--temp 0)", param_hint="--temp")
    source = click.get_current_context().get_parameter_source("drafters")
    if source == click.core.ParameterSource.DEFAULT:
        drafters = list(OVERHEAD_DRAFTERS)
    try:
        tokenizer = load_tokenizer(resolve_model_dir(model, dtype=dtype))
        report = run_overhead(tokenizer, drafters=drafters, suites=suites, limit=limit,
                              max_tokens=max_tokens, progress=lambda s: click.echo(s, err=True))
    except _user_errors() as err:
        _fail(err)
    click.echo(f"BLAS: {report['machine']['blas']}", err=True)
    _emit_report(report, overhead_table(report), out, markdown, plot, plot_overhead)


main.add_command(train)
main.add_command(serve)

if __name__ == "__main__":
    main()
