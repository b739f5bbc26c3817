"""DSpark: a DFlash backbone with a sequential Markov head and a confidence head (DeepSeek's
DeepSpec, 2026).

The backbone is DFlash's (models.dflash): the target's features fused by `fc` + `hidden_norm`
into context K/V, Qwen3 layers over a block at its true positions, bidirectional inside the
block. What differs:
- the block [anchor, MASK x (B - 1)] always has all B slots (attention sees the whole block, so
  a shorter block would draft differently), and every slot drafts: slot j predicts the token
  after position start + j, the anchor's slot the first;
- slot k's logits get a low-rank bigram bias on the token drafted before it, W1[x_{k-1}] W2^T
  (x_{-1} the anchor), so the block is walked left to right: greedy, each step's argmax;
  sampling, each step drawn from softmax((l_k + bias) / T), the proposal q the lossless rule
  divides by;
- a confidence head, where the checkpoint has one, predicts each slot's chance of acceptance
  given the drafts before it, sigma(w . [h_k ; W1[x_{k-1}]] + b): mlxspec's draft length reads
  it (drafters.dspark).

Layouts: DeepSpec's `Qwen3DSparkModel` (flat keys, its own embed_tokens and lm_head, frozen
copies of the target's) and LiquidAI's LFM2.5 `Lfm2DSparkDraftModel` (mask token, target layers
and their count under `dflash_config`, interleaved RoPE, the target's embedding and head, and no
`confidence_head_with_markov`: the head's width says).
"""

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
from mlx import nn

from .dflash import _DRAFT_KEYS, DFlashConfig, DFlashModel

ARCHITECTURE = "Qwen3DSparkModel"
MARKOV_HEAD_TYPES = ("vanilla",)  # DeepSpec's "gated" and "rnn" ship in no published checkpoint


@dataclass
class DSparkConfig(DFlashConfig):
    markov_rank: int = 0
    markov_head_type: str | None = None
    enable_confidence_head: bool = False
    # None: read from the confidence head's width (LFM2.5 configs omit it).
    confidence_head_with_markov: bool | None = None
    num_anchors: int | None = None  # training only: blocks sampled per sequence
    rope_is_neox_style: bool = True  # LFM2.5: false, interleaved (GPT-J) rotations

    architecture: ClassVar[str] = ARCHITECTURE
    kind: ClassVar[str] = "dspark"
    draft_keys: ClassVar[tuple[str, ...]] = _DRAFT_KEYS + (
        "num_target_layers", "markov_rank", "markov_head_type", "enable_confidence_head",
        "confidence_head_with_markov", "num_anchors", "rope_is_neox_style")

    def __post_init__(self):
        super().__post_init__()
        if type(self.markov_rank) is not int or self.markov_rank < 0:
            raise ValueError(f"DSpark markov_rank must be an integer >= 0, got {self.markov_rank!r}")
        if self.markov_rank and self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"DSpark markov_head_type {self.markov_head_type!r} is not supported; "
                             f"only {', '.join(MARKOV_HEAD_TYPES)} (every published checkpoint's)")
        if self.enable_confidence_head and self.confidence_head_with_markov and not self.markov_rank:
            raise ValueError("DSpark confidence_head_with_markov needs a Markov head (markov_rank > 0)")

    def read_head_width(self, shapes: dict) -> None:
        """confidence_head_with_markov from the stored head's width where the config leaves it
        out (LFM2.5): H + r reads [h ; W1[x]], H reads h alone."""
        shape = shapes.get("confidence_head.proj.weight")
        if self.enable_confidence_head and self.confidence_head_with_markov is None and shape:
            self.confidence_head_with_markov = bool(self.markov_rank) and \
                tuple(shape)[-1] == self.hidden_size + self.markov_rank

    @property
    def confidence_width(self) -> int:
        return self.hidden_size + (self.markov_rank if self.confidence_head_with_markov else 0)


class MarkovHead(nn.Module):
    """The bigram bias: the previous token's row of W1 (V, r) through W2 (r -> V)."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def __call__(self, previous: mx.array, rows: mx.array | None = None) -> mx.array:
        """The bias over the vocabulary, or over its `rows` only (a training loss vocabulary)."""
        if rows is None:
            return self.markov_w2(self.markov_w1(previous))
        return self.markov_w1(previous) @ self.markov_w2.weight[rows].T


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def __call__(self, features: mx.array) -> mx.array:
        return mx.sigmoid(self.proj(features)[..., 0].astype(mx.float32))


class DSparkModel(DFlashModel):
    """The drafter: DFlash's backbone, then the walk over its block (`walk`)."""

    def __init__(self, args: DSparkConfig, *, own_embed: bool = False, own_head: bool = False):
        super().__init__(args, own_embed=own_embed, own_head=own_head)
        if args.markov_rank:
            self.markov_head = MarkovHead(args.vocab_size, args.markov_rank)
        if args.enable_confidence_head:
            self.confidence_head = ConfidenceHead(args.confidence_width)

    def confidence_input(self, hidden: mx.array, previous: mx.array) -> mx.array:
        """What the confidence head reads for slots of `hidden` after tokens `previous`:
        [h ; W1[x]] with confidence_head_with_markov, else h."""
        if not self.args.confidence_head_with_markov:
            return hidden
        before = self.markov_head.markov_w1(previous).astype(hidden.dtype)
        return mx.concatenate([hidden, before], axis=-1)

    @staticmethod
    def prefix_survival(confidence: mx.array) -> list[float]:
        """Slots' confidences (n,) -> c_1, c_1 c_2, ..., read to the host."""
        return mx.cumprod(confidence).tolist() if confidence.size else []

    def walk(self, hidden: mx.array, logits: mx.array, anchors: mx.array, temps: list[float],
             forced: mx.array | None = None) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """Drafts (B, n) from the block's normed hidden states (B, n, H), their logits (B, n, V)
        and the anchors (B,): rows with temps[i] > 0 sample each step, the others take its
        argmax (`forced` (B, n): follow these tokens instead, as training's teacher forcing).
        Also q (B, n, V) when any row samples, and each slot's confidence (B, n) when the
        checkpoint has the head. Nothing is read back to the host."""
        markov = getattr(self, "markov_head", None)
        confidence = getattr(self, "confidence_head", None)
        sampled = [t > 0 for t in temps]
        inverse = mx.array([1.0 / t if t > 0 else 1.0 for t in temps], dtype=mx.float32)[:, None]
        greedy_rows = mx.array([not s for s in sampled])
        previous, drafts, qs, confidences = anchors, [], [], []
        for k in range(hidden.shape[1]):
            step = logits[:, k]
            if markov is not None:
                step = step + markov(previous).astype(step.dtype)
            if confidence is not None:
                confidences.append(confidence(self.confidence_input(hidden[:, k], previous)))
            token = mx.argmax(step, axis=-1)
            if any(sampled):
                scaled = step.astype(mx.float32) * inverse
                qs.append(mx.softmax(scaled, axis=-1))
                token = mx.where(greedy_rows, token, mx.random.categorical(scaled))
            previous = (token if forced is None else forced[:, k]).astype(mx.int32)
            drafts.append(previous)
        return (mx.stack(drafts, axis=1), mx.stack(qs, axis=1) if qs else None,
                mx.stack(confidences, axis=1) if confidences else None)
