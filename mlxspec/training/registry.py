"""One registry of trainers, read by the CLI's `mlxspec train`, so that a new trainer is its
module plus one `register` (as drafters/registry.py is for drafters).

An entry names the trainer's train function (imported when first called), what its command
says, and its own options, each with its command-line flag and the bound checked before
anything loads. The options every run shares (data, schedule, evaluation) are `RunSettings`'.
"""

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from ..backends import BACKENDS
from ..drafters.registry import lazy


@dataclass(frozen=True)
class TrainerOption:
    """A keyword a trainer takes, and the command-line flag that sets it."""

    name: str  # the train function's keyword, e.g. "block_size"
    flags: str  # click's spelling: "--block-size", or a switch "--own-projection/--shared-head"
    help: str | None = None
    type: Any = None  # click infers it from `default` when None
    default: Any = None
    choices: tuple[str, ...] | None = None  # the values it may take
    is_flag: bool = False  # a lone switch, False unless given
    parse: Callable[[str], Any] | None = None  # text -> value; ValueError says what is wrong
    check: Callable[[Any], str | None] | None = None  # what is wrong with a value, or None

    @property
    def flag(self) -> str:
        """The flag an error names: the first spelling."""
        return self.flags.partition("/")[0]

    def problem(self, value) -> str | None:
        """What is wrong with `value` (None: not given, or nothing)."""
        if value is None or self.check is None:
            return None
        return self.check(value)


def at_least(least: int) -> Callable[[Any], str | None]:
    return lambda value: f"must be >= {least}, got {value}" if value < least else None


def positive(value) -> str | None:
    return None if 0 < value < math.inf else f"must be > 0, got {value}"  # nan too


def non_negative(value) -> str | None:
    return None if 0 <= value < math.inf else f"must be >= 0, got {value}"  # nan too


def layer_ids(value: str) -> list[int]:
    """"2, 5,9" -> [2, 5, 9]."""
    try:
        return [int(v) for v in value.replace(" ", "").split(",") if v]
    except ValueError:
        raise ValueError(f"expected comma-separated layer indices, got {value!r}") from None


@dataclass(frozen=True)
class TrainerKind:
    """A kind of trainer: its train function, its command's help, its options."""

    name: str
    train: Callable  # (target, prompts, out, *, tokenizer, generator, backend, **options)
    help: str  # the command's --help line
    out_help: str  # what --out holds
    options: tuple[TrainerOption, ...] = ()
    # What is wrong with the options together (their values by name), or None: checked with
    # each option's own bound, before anything loads.
    check: Callable[[dict], str | None] | None = None


_REGISTERED: dict[str, TrainerKind] = {}


def register(kind: TrainerKind) -> TrainerKind:
    if not re.fullmatch(r"\w+", kind.name):
        raise ValueError(f"trainer name {kind.name!r}: letters, digits and _ only")
    if kind.name in _REGISTERED:
        raise ValueError(f"a trainer named {kind.name!r} is already registered")
    _REGISTERED[kind.name] = kind
    return kind


def trainer_kinds() -> dict[str, TrainerKind]:
    return dict(_REGISTERED)


# ---- The trainers -------------------------------------------------------------------------------

# The frozen target's feature pass on torch, feeding MLX steps (a run's `feature_pass`).
FEATURES_WITH = TrainerOption(
    "features_with", "--features-with", choices=BACKENDS, default="mlx",
    help="Backend of the frozen target's feature pass (torch: ~4x faster on a Linux CPU; needs "
         "mlxspec[torch]); the drafter's steps run on MLX.")

register(TrainerKind(
    "dflash", lazy("mlxspec.training.dflash_trainer", "train_dflash"),
    help="Train a DFlash drafter for TARGET on PROMPTS; resumable with --resume.",
    out_help="Output directory: the checkpoint (config.json + model.safetensors, z-lab format) "
             "and its resumable training state.",
    options=(
        TrainerOption(
            "layers", "--layers", type=int, check=at_least(1),
            help="Drafter layers (default 1). With --resume or --init DIR, more layers than the "
                 "drafter has are appended, starting as the identity."),
        TrainerOption("block_size", "--block-size", type=int, default=16, check=at_least(2)),
        TrainerOption(
            "target_layer_ids", "--target-layer-ids", parse=layer_ids,
            help="Comma-separated target layers to condition on (default: z-lab's spacing)."),
        TrainerOption("anchors", "--anchors", type=int, default=64, check=at_least(1),
                      help="Random blocks per training sequence."),
        TrainerOption(
            "gamma", "--gamma", type=float, check=positive,
            help="Loss decay over block slots, weight exp(-(k-1)/gamma) for slot k (default: "
                 "the paper's, 7 for blocks of 16); smaller puts the weight on the first slots."),
        TrainerOption(
            "init", "--init", default="target",
            help="'target': drafter layers start as copies of the target's last layers; "
                 "'random'; or a DFlash checkpoint directory to continue training from (e.g. "
                 "the shipped one, with a fresh optimizer and its own config)."),
        TrainerOption(
            "init_final_norm", "--init-final-norm", is_flag=True,
            help="With --init target: also start the drafter's final norm as the target's."),
        TrainerOption(
            "loss_vocab", "--loss-vocab", type=int,
            help="Train against the N most frequent response tokens' head rows only "
                 "(cheaper steps), which the checkpoint keeps as its draft vocabulary (cheaper "
                 "drafting; verification keeps the full head). 8192 held 85-92% of SmolLM2's "
                 "tokens on the benchmark suites, 16384 92-95%. Default: the full vocabulary."),
        TrainerOption(
            "backend", "--backend", choices=BACKENDS, default="mlx",
            help="Where the training steps run: MLX, or torch (same checkpoint; ~2.5x faster "
                 "on a Linux CPU, CUDA with --device; needs mlxspec[torch])."),
        TrainerOption("device", "--device",
                      help="torch device for --backend torch (cuda, cpu)."),
    ),
))
register(TrainerKind(
    "eagle3", lazy("mlxspec.training.eagle3_trainer", "train_eagle3"),
    help="Train an EAGLE-3 drafter for TARGET on PROMPTS (MLX); resumable with --resume.",
    out_help="Output directory: the checkpoint (speculators layout: config.json + "
             "model.safetensors, loadable by --drafter eagle3 --drafter-model) and its "
             "resumable training state.",
    options=(
        TrainerOption(
            "ttt_steps", "--ttt-steps", type=int, check=at_least(1),
            help="Training-time test steps: each position also learns to draft 2..N tokens "
                 "ahead from its own outputs, as the chain does (default 7, SpecForge's; a "
                 "resumed run keeps its own)."),
        TrainerOption(
            "decay", "--step-decay", type=float,
            check=lambda v: None if 0 < v <= 1 else f"must be in (0, 1], got {v}",
            help="Loss weight of TTT step s: decay**s (default 0.8)."),
        TrainerOption(
            "aux_layer_ids", "--aux-layer-ids", parse=layer_ids,
            help="Comma-separated target hidden states to fuse, counted as speculators and vLLM "
                 "do (0 = the embedding, j = layer j's input; default 2, L/2, L-3)."),
        TrainerOption(
            "speculative_tokens", "--speculative-tokens", type=int, default=4,
            check=at_least(1),
            help="The chain length the checkpoint suggests; held-out tau drafts this many."),
        TrainerOption(
            "loss_vocab", "--draft-vocab", type=int,
            help="Draft vocabulary: the N most frequent answer tokens (d2t maps them to target "
                 "ids; the loss and drafting read only their head rows). Default: the full "
                 "vocabulary."),
        FEATURES_WITH,
    ),
))
register(TrainerKind(
    "medusa", lazy("mlxspec.training.medusa_trainer", "train_medusa"),
    help="Train Medusa heads for TARGET on PROMPTS (MLX); resumable with --resume.",
    out_help="Output directory: the checkpoint (Medusa's published layout: config.json + "
             "medusa_lm_head.safetensors, loadable by --drafter medusa --drafter-model) and its "
             "resumable training state.",
    options=(
        TrainerOption(
            "num_heads", "--heads", type=int, check=at_least(1),
            help="Medusa heads: head i drafts the token i+2 ahead (default 3; a resumed run "
                 "keeps its own)."),
        TrainerOption("num_layers", "--head-layers", type=int, check=at_least(1),
                      help="Residual blocks per head (default 1, Medusa-1's)."),
        TrainerOption(
            "own_projection", "--own-projection/--shared-head",
            help="Each head trains its own output projection, started from the target's head "
                 "(Medusa-1's; 28M parameters a head on SmolLM2), or all heads share the "
                 "target's frozen head (default: 0.33M a head, a 2.6 MB checkpoint)."),
        TrainerOption(
            "loss_vocab", "--loss-vocab", type=int, check=at_least(1),
            help="Train against the N most frequent answer tokens' head rows only (cheaper "
                 "steps; drafting keeps the full head). Default: the full vocabulary."),
        FEATURES_WITH,
    ),
))


# DFlash's options that its successors share (all but its loss vocabulary and torch steps).
BLOCK_OPTIONS = {o.name: o for o in _REGISTERED["dflash"].options}


def block_options(**defaults) -> tuple[TrainerOption, ...]:
    """DFlash's layers, target layers, anchors, gamma, init and final-norm options, with the
    given defaults in place of its."""
    names = ("layers", "block_size", "target_layer_ids", "anchors", "gamma", "init",
             "init_final_norm")
    out = []
    for name in names:
        option = BLOCK_OPTIONS[name]
        if name in defaults:
            option = TrainerOption(**{**option.__dict__, "default": defaults[name]})
        out.append(option)
    return tuple(out)


BLOCK_LOSS_VOCAB = TrainerOption(
    "loss_vocab", "--loss-vocab", type=int, check=at_least(1),
    help="Train against the N most frequent answer tokens' head rows only (~6x cheaper steps on "
         "SmolLM2); the checkpoint still drafts over the full vocabulary, as its layout does. "
         "Default: the full vocabulary.")

register(TrainerKind(
    "dflash2", lazy("mlxspec.training.dflash2_trainer", "train_dflash2"),
    help="Train a DFlash2 drafter (DFlash with block convolutions and a candidate selector) "
         "for TARGET on PROMPTS (MLX); resumable with --resume.",
    out_help="Output directory: the checkpoint (z-lab's DFlash2DraftModel layout: config.json "
             "+ model.safetensors, loadable by --drafter dflash2 --drafter-model) and its "
             "resumable training state.",
    options=block_options() + (
        TrainerOption("conv_kernel_size", "--conv-kernel-size", type=int, default=2,
                      check=at_least(1), help="Taps of each block convolution."),
        TrainerOption("conv_group_size", "--conv-group-size", type=int, default=16,
                      check=at_least(1),
                      help="Channels sharing one projected tap (must divide the hidden size)."),
        TrainerOption("selector_rank", "--selector-rank", type=int, default=256,
                      check=at_least(1), help="Rank of the candidate selector's pair scores."),
        TrainerOption("selector_top_k", "--selector-top-k", type=int, default=16,
                      check=at_least(1), help="Candidates per slot the walk chooses among."),
        TrainerOption(
            "selector_weight", "--selector-weight", type=float, default=1.0,
            check=non_negative,
            help="Weight of the selector's K-way cross-entropy next to the unary loss "
                 "(speculators' 1.0)."),
        BLOCK_LOSS_VOCAB,
        FEATURES_WITH,
    ),
))
register(TrainerKind(
    "dspark", lazy("mlxspec.training.dspark_trainer", "train_dspark"),
    help="Train a DSpark drafter (DFlash backbone, Markov head, confidence head) for TARGET on "
         "PROMPTS with DeepSpec's losses (MLX); resumable with --resume.",
    out_help="Output directory: the checkpoint (DeepSpec's Qwen3DSparkModel layout without "
             "embedding and head copies: config.json + model.safetensors, loadable by "
             "--drafter dspark --drafter-model) and its resumable training state.",
    options=block_options(block_size=7, gamma=4.0) + (
        TrainerOption("markov_rank", "--markov-rank", type=int, default=256, check=at_least(0),
                      help="Rank of the Markov head's bigram bias W2 W1[x] (0: no head)."),
        TrainerOption("confidence_head", "--confidence-head/--no-confidence-head",
                      default=True, help="Train the confidence head (it sets K per step)."),
        TrainerOption("ce_weight", "--ce-weight", type=float, default=0.1,
                      check=non_negative,
                      help="Weight of the cross-entropy against the labels (DeepSpec's 0.1)."),
        TrainerOption("l1_weight", "--l1-weight", type=float, default=0.9,
                      check=non_negative,
                      help="Weight of the L1 distance to the target's distribution (0.9)."),
        TrainerOption("confidence_weight", "--confidence-weight", type=float, default=1.0,
                      check=non_negative,
                      help="Weight of the confidence head's cross-entropy (1.0)."),
        BLOCK_LOSS_VOCAB,
        FEATURES_WITH,
    ),
    check=lambda o: ("--ce-weight and --l1-weight cannot both be 0: nothing would train the "
                     "drafts") if o.get("ce_weight") == 0 and o.get("l1_weight") == 0 else None,
))
