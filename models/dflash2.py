"""DFlash2: DFlash with block-local convolutions and a candidate selector (z-lab, 2026).

The backbone, the context (target features fused by `fc` + `hidden_norm`, kept as K/V), the
block [pending, MASK, ...] and the head are DFlash's (models.dflash). Two things are new:
- every attention and MLP sublayer is wrapped in a grouped dynamic causal convolution over the
  block's own slots: before the sublayer with one set of taps, after it with another, each tap a
  static per-channel weight plus a per-slot, per-group weight projected from the sublayer's
  normed input. Taps never reach past slot 0, so no convolution state crosses steps;
- drafts are not each slot's argmax but a left-to-right walk over each slot's top-k tokens,
  scored S_t(a, b) = U_t(b) + <A[a] * W h_t, B[b]> with U_t the slot's logits and a the token
  drafted before (the pending token for slot 1): a bigram the block's independent slots cannot
  express. When sampling, each step draws from softmax(S_t / T) over the candidates, the
  proposal q the lossless rule divides by.

Weight names are z-lab's (the codebooks have no `.weight`: they are plain arrays here).
"""

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
from mlx import nn

from .dflash import _DRAFT_KEYS, DecoderLayer, DFlashConfig, DFlashModel

ARCHITECTURE = "DFlash2DraftModel"


@dataclass
class DFlash2Config(DFlashConfig):
    # z-lab reads these four without defaults: a DFlash2 config names them all.
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None

    architecture: ClassVar[str] = ARCHITECTURE
    kind: ClassVar[str] = "dflash2"
    draft_keys: ClassVar[tuple[str, ...]] = _DRAFT_KEYS + (
        "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

    def __post_init__(self):
        super().__post_init__()
        missing = [k for k in self.draft_keys[len(_DRAFT_KEYS):] if getattr(self, k) is None]
        if missing:
            raise ValueError(f"DFlash2 config.json lacks dflash_config.{', '.join(missing)}")
        for key in self.draft_keys[len(_DRAFT_KEYS):]:
            value = getattr(self, key)
            if type(value) is not int or value < 1:
                raise ValueError(f"DFlash2 config {key} must be a positive integer, got {value!r}")
            setattr(self, key, value)
        if self.hidden_size % self.conv_group_size:
            raise ValueError(f"DFlash2 conv_group_size {self.conv_group_size} does not divide "
                             f"hidden_size {self.hidden_size}")
        if self.selector_top_k > self.vocab_size:
            raise ValueError(f"DFlash2 selector_top_k {self.selector_top_k} exceeds the "
                             f"vocabulary of {self.vocab_size}")


def grouped_convolve(y: mx.array, dynamic: mx.array, base: mx.array, group_size: int) -> mx.array:
    """out[t, c] = sum_k (base[k, c] + dynamic[t, k, c // group_size]) * y[t - k, c], with y
    zero before slot 0: y (B, L, H), dynamic (B, L, K, G), base (K, H). z-lab's order of
    operations (the static product added first), so float32 results agree to the last bit."""
    B, L, H = y.shape
    groups = H // group_size
    blocks = y.reshape(B, L, groups, group_size)
    out = mx.zeros_like(blocks)
    for k in range(min(base.shape[0], L)):  # a tap past slot 0 reads only zeros
        values = blocks if k == 0 else mx.pad(blocks[:, : L - k], [(0, 0), (k, 0), (0, 0), (0, 0)])
        out = out + base[k].astype(y.dtype).reshape(1, 1, groups, group_size) * values
        out = out + dynamic[:, :, k, :, None] * values
    return out.reshape(B, L, H)


class GroupedDynamicCausalConv(nn.Module):
    """A sublayer's two convolutions: `prepare` before it, `finish` after, both with taps
    projected from the sublayer's normed input."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(
            hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Normed input (B, L, H) -> (its convolution, the taps `finish` applies)."""
        B, L, H = x.shape
        dynamic = self.kernel_projection(x).reshape(B, L, 2, self.kernel_size, -1)
        return (grouped_convolve(x, dynamic[:, :, 0], self.base_kernel[0], self.group_size),
                dynamic[:, :, 1])

    def finish(self, x: mx.array, dynamic: mx.array) -> mx.array:
        return grouped_convolve(x, dynamic, self.base_kernel[1], self.group_size)


class DecoderLayer2(DecoderLayer):
    """DFlash's layer with each sublayer between its two convolutions. The attention's keys and
    values of the block come from the convolved input; the context's do not pass through it."""

    def __init__(self, args: DFlash2Config, layer_type: str):
        super().__init__(args, layer_type)
        conv = (args.hidden_size, args.conv_kernel_size, args.conv_group_size)
        self.attention_conv = GroupedDynamicCausalConv(*conv)
        self.mlp_conv = GroupedDynamicCausalConv(*conv)

    # rows: right-padded rows, and a causal convolution leaves each row's slots as alone.

    def around(self, x, attend):
        n, taps = self.attention_conv.prepare(self.input_layernorm(x))
        h = x + self.attention_conv.finish(attend(n), taps)
        m, taps = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(m), taps)


class CandidateSelector(nn.Module):
    """The walk over each slot's top-k tokens by pair scores (see the module docstring)."""

    def __init__(self, args: DFlash2Config):
        super().__init__()
        self.top_k = args.selector_top_k
        rank = args.selector_rank
        self.hidden_projection = nn.Linear(args.hidden_size, rank, bias=False)
        self.predecessor_codebook = mx.zeros((args.vocab_size, rank))
        self.successor_codebook = mx.zeros((args.vocab_size, rank))

    def candidates(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """Logits (B, n, V) -> each slot's top-k (token ids, their logits), (B, n, k) each, in
        no particular order (as torch.topk(sorted=False): the walk never reads the order)."""
        ids = mx.argpartition(logits, kth=logits.shape[-1] - self.top_k, axis=-1)
        ids = ids[..., -self.top_k :]
        return ids, mx.take_along_axis(logits, ids, axis=-1)

    def scores(self, projected: mx.array, unary: mx.array, ids: mx.array,
               predecessors: mx.array) -> mx.array:
        """One slot's pair scores for each row: projected W h_t (B, R), unary U_t (B, k) of
        candidates ids (B, k), the tokens before them (B,) -> (B, k)."""
        edge = self.predecessor_codebook[predecessors] * projected  # (B, R)
        return unary + (self.successor_codebook[ids] @ edge[:, :, None])[..., 0]

    def walk(self, hidden: mx.array, logits: mx.array, anchors: mx.array,
             temps: list[float]) -> tuple[mx.array, mx.array | None]:
        """The drafts (B, n) from final-normed slot hidden states (B, n, H), their logits
        (B, n, V) and the pending tokens (B,); rows with temps[i] > 0 sample each step from
        softmax(S / T), rows with 0 take its argmax. Also, when any row samples, q (B, n, k)
        over the candidates (B, n, k), the walk's ids: (drafts, (ids, q) or None). Nothing is
        read back to the host."""
        ids, unary = self.candidates(logits)
        projected = self.hidden_projection(hidden)
        sampled = [t > 0 for t in temps]
        inverse = mx.array([1.0 / t if t > 0 else 1.0 for t in temps], dtype=mx.float32)[:, None]
        greedy_rows = mx.array([not s for s in sampled])[:, None]
        predecessor, path, qs = anchors, [], []
        for t in range(hidden.shape[1]):
            scores = self.scores(projected[:, t], unary[:, t], ids[:, t], predecessor)
            index = mx.argmax(scores, axis=-1)
            if any(sampled):
                logits_q = scores.astype(mx.float32) * inverse
                q = mx.softmax(logits_q, axis=-1)
                drawn = mx.random.categorical(logits_q)
                index = mx.where(greedy_rows[:, 0], index, drawn)
                qs.append(q)
            predecessor = mx.take_along_axis(ids[:, t], index[:, None], axis=-1)[:, 0]
            path.append(predecessor)
        drafts = mx.stack(path, axis=1).astype(mx.int32)
        return drafts, ((ids, mx.stack(qs, axis=1)) if qs else None)

    def pair_logprobs(self, hidden: mx.array, logits: mx.array, anchor: mx.array):
        """For a tree over one block's candidates: ids (n, k), log softmax of slot 1's scores
        after the pending token `anchor` (1,) -> (k,), and of each later slot's scores after each
        candidate of the slot before, (n - 1, k, k) [before, after]. hidden (1, n, H), logits
        (1, n, V)."""
        ids, unary = self.candidates(logits)
        ids, unary, projected = ids[0], unary[0], self.hidden_projection(hidden)[0]
        first = self.scores(projected[:1], unary[:1], ids[:1], anchor)[0]
        edge = self.predecessor_codebook[ids[:-1]] * projected[1:, None, :]  # (n - 1, k, R)
        after = mx.swapaxes(self.successor_codebook[ids[1:]], -1, -2)  # (n - 1, R, k)
        pairs = unary[1:, None, :] + edge.astype(after.dtype) @ after
        return (ids, nn.log_softmax(first.astype(mx.float32), axis=-1),
                nn.log_softmax(pairs.astype(mx.float32), axis=-1))

    def forced_q(self, hidden: mx.array, logits: mx.array, anchors: mx.array,
                 drafts: mx.array, temp: float) -> tuple[mx.array, mx.array]:
        """(candidate ids, q) (B, n, k) of the walk that drew `drafts` (B, n): every step's
        scores at once, its predecessors known (a reference's sampled path, in tests)."""
        ids, unary = self.candidates(logits)
        projected = self.hidden_projection(hidden)
        before = mx.concatenate([anchors[:, None], drafts[:, :-1]], axis=1)  # (B, n)
        B, n = before.shape
        scores = self.scores(projected.reshape(B * n, -1), unary.reshape(B * n, -1),
                             ids.reshape(B * n, -1), before.reshape(-1)).reshape(B, n, -1)
        return ids, mx.softmax(scores.astype(mx.float32) / temp, axis=-1)


class DFlash2Model(DFlashModel):
    """The drafter: DFlash's, with convolutions in every layer and a candidate selector."""

    layer_class = DecoderLayer2

    def __init__(self, args: DFlash2Config, *, own_embed: bool = False, own_head: bool = False):
        super().__init__(args, own_embed=own_embed, own_head=own_head)
        self.candidate_selector = CandidateSelector(args)


def proposal_probs(ids: mx.array, q: mx.array, vocab_size: int) -> mx.array:
    """q over each slot's candidates (n, k) -> the dense proposal (n, V) Draft.probs holds,
    zero off the candidates (top-k ids are distinct: a scatter is exact)."""
    dense = mx.zeros((q.shape[0], vocab_size), dtype=mx.float32)
    return mx.put_along_axis(dense, ids, q, axis=-1)
