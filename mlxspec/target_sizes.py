"""A target's sizes, the one record both backends read off their model, and a DFlash config
checked against it: a drafter trained for another target is refused in one voice, whichever
backend runs it, before any weight loads."""

from typing import NamedTuple


class TargetSizes(NamedTuple):
    """What a drafter checkpoint is checked against, and a shipped drafter found by: the MLX
    backend's `mlxspec.backends.mlx.target_parts.target_sizes`, the torch backend's
    `backends.torch.target.target_sizes`."""

    hidden_size: int
    vocab_size: int  # the embedding's rows
    num_layers: int  # decoder layers


def check_against_target(args, sizes: TargetSizes) -> None:
    """Refuse a DFlash drafter (`args`, its DFlashConfig) trained for another target, naming
    both sides, before any compute."""
    hidden, vocab, layers = sizes
    problems = []
    if args.hidden_size != hidden:
        problems.append(f"hidden size: drafter {args.hidden_size}, target {hidden}")
    if args.vocab_size != vocab:
        problems.append(f"vocab size: drafter {args.vocab_size}, target {vocab}")
    if args.num_target_layers is not None and args.num_target_layers != layers:
        problems.append(
            f"number of target layers: drafter config num_target_layers {args.num_target_layers}, "
            f"target has {layers}"
        )
    bad_ids = [i for i in args.target_layer_ids if not 0 <= i < layers]
    if bad_ids:
        problems.append(
            f"target_layer_ids {bad_ids} (of {args.target_layer_ids}) out of range for the "
            f"target's {layers} layers"
        )
    if not 0 <= args.mask_token_id < vocab:
        problems.append(
            f"mask_token_id: drafter {args.mask_token_id}, outside the target's vocab of {vocab}"
        )
    if problems:
        raise ValueError("DFlash drafter does not fit this target: " + "; ".join(problems))
