"""DFlash drafting for the shared loop: one drafter pass fills a whole block.

Each step the block [pending token, MASK x n] sits at positions len(tokens)-1 ...; its context is
the target features of every earlier position, kept as K/V in the drafter's cache. Drafts are the
argmax of each slot (one-hot p), so sampled acceptance stays lossless through accept_sampled's
one-hot rule; sampling each slot independently makes incoherent blocks (z-lab PR #169).
After verification the features of the newly committed positions extend the cache. A chain
reads nothing back to the host: drafting joins the target's one evaluation per step. A tree
(DDTree, `tree_budget`) reads each slot's best tokens first, since its shape depends on them.

DFlashDrafting is the host side, for both backends, and so is reading a checkpoint's config
(read_checkpoint); DFlashDrafter adds MLX's tensor math, mlxspec.backends.torch.dflash's
TorchDFlashDrafter torch's.
"""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..engine import EMPTY_DRAFT, Draft, Drafter, Verdict
from ..backends.mlx.hidden_states import decoder_layers
from ..models.dflash import (
    DFlashConfig,
    DFlashModel,
    check_weights,
    read_config,
    read_draft_vocab,
    read_weights,
)
from ..request import check_drafter_window
from ..sampling import SamplingConfig
from ..backends.mlx.target_parts import (
    dtype_of,
    head_rows,
    target_embedding,
    target_final_norm,
    target_head,
    target_sizes,
)
from ..target_sizes import TargetSizes, check_against_target
from ..tree import best_first_drafts, check_tree
from .ddtree import best_rows


class DFlashDrafting(Drafter):
    """The host side of DFlash drafting, one for both backends: the block's size and bounds,
    which features extend the context and when it is cut, the chain or DDTree drawn from a
    block. A backend's subclass brings the tensor math: its DFlashModel (models.dflash's or
    its torch twin), and the hooks below."""

    name = "dflash"

    def __init__(self, model, *, embed_tokens, lm_head, block_size: int | None = None,
                 final_norm=None, target_layers: int | None = None, draft_vocab=None,
                 tree_budget: int | None = None, tree_width: int = 4):
        self.model = model
        self.args = model.args
        self.block_size = check_block_size(block_size, self.args.block_size)
        self.default_num_draft = self.max_draft = self.block_size - 1
        # DDTree: a tree of up to `tree_budget` nodes grown best-first from each slot's
        # `tree_width` best tokens, instead of the chain of each slot's best.
        self.tree_budget, self.tree_width = check_tree(tree_budget, tree_width)
        self.draft_trees(self.tree_budget)
        self.capture_layers = tuple(self.args.target_layer_ids)
        self.embed_tokens = embed_tokens
        # Drafts come from `draft_vocab`'s head rows only when given (their logits are all a
        # draft needs); verification still uses the target's full head, so nothing is lost.
        self.draft_ids = None if draft_vocab is None else self._ids(draft_vocab)[0]
        self.lm_head = lm_head if draft_vocab is None else self._head_rows(lm_head, self.draft_ids)
        # transformers' hidden_states[-1], which z-lab's reference conditions on, is the last
        # layer's output after the final norm; our capture is before it.
        last = None if target_layers is None else target_layers - 1
        self._normed_slots = [i for i, l in enumerate(self.capture_layers) if l == last]
        if self._normed_slots and final_norm is None:
            raise ValueError("the drafter captures the target's last layer: pass its final_norm")
        self.final_norm = final_norm
        self.cache = model.make_cache()
        self._deferred: list = []  # features committed, not yet in the context (_flush)

    # ---- the backend's tensor math ----

    def _ids(self, tokens: list[int]):
        """Host token ids -> a (1, n) integer array on the drafter's device."""
        raise NotImplementedError

    def _head_rows(self, head, ids):
        """A head computing `head`'s logits for rows `ids` only."""
        raise NotImplementedError

    def _concat(self, parts):
        """Feature slices (n, H) each -> (n, parts * H)."""
        raise NotImplementedError

    def _rows(self, parts):
        """Feature rows (n_i, F) each -> (sum n_i, F)."""
        raise NotImplementedError

    def _in_head_dtype(self, hidden):
        """`hidden` cast to the head's dtype."""
        raise NotImplementedError

    def _best(self, logits):
        """(slots, V) -> each slot's best row, (slots,) integers."""
        raise NotImplementedError

    def _best_rows(self, logits, width: int) -> tuple[list, list]:
        """(slots, V) logits -> each slot's `width` best rows, read to the host: their
        log-probabilities and their target ids (through draft_ids)."""
        raise NotImplementedError

    def _host_lists(self, *arrays) -> list:
        """Arrays read to the host as nested lists, in one sync."""
        raise NotImplementedError

    # ---- shared ----

    @property
    def context_length(self) -> int:
        """Committed positions whose context K/V are cached or deferred."""
        return self.cache[0].offset + sum(f.shape[0] for f in self._deferred)

    # Features committed since the drafter last drafted, projected into the context in one
    # pass when it next does (_flush), as drafters.paired defers its pairs: a step that drafts
    # nothing costs the drafter nothing, and the step after pays one projection, not one per
    # such step.
    deferred_limit = 32

    def begin(self, prompt, features=None):
        self.cache = self.model.make_cache()
        self._deferred = []
        if self._checked(features):
            self._append(features)

    def _checked(self, features) -> bool:
        """Whether `features` hold a position, after checking their shape (a mismatch is the
        caller's error, raised when committed, not when next drafted)."""
        if features is None:
            raise ValueError(
                "the DFlash drafter needs target hidden states: build the target with "
                "capture_layers=drafter.capture_layers"
            )
        if features.shape[0] == 0:  # a one-token prompt has no context yet
            return False
        width = len(self.capture_layers) * self.args.hidden_size
        if features.ndim != 2 or features.shape[1] != width:
            raise ValueError(
                f"target features have shape {tuple(features.shape)}; the DFlash drafter expects "
                f"(positions, {width}) from layers {list(self.capture_layers)}"
            )
        return True

    def _append(self, features) -> None:
        self.model.append_context(self._as_reference(features), self.cache)

    def _flush(self) -> None:
        """Project the deferred features into the context, all in one pass."""
        if self._deferred:
            parts, self._deferred = self._deferred, []
            self._append(parts[0] if len(parts) == 1 else self._rows(parts))

    def _as_reference(self, features):
        """Apply the target's final norm to the last layer's slice, as transformers does."""
        if not self._normed_slots:
            return features
        H = self.args.hidden_size
        parts = [features[:, i * H : (i + 1) * H] for i in range(len(self.capture_layers))]
        for i in self._normed_slots:
            parts[i] = self.final_norm(parts[i])
        return self._concat(parts)

    def _rewind(self, num_context: int) -> None:
        """Keep exactly `num_context` cached positions (a caller may have rolled back)."""
        self._flush()
        excess = self.context_length - num_context
        if excess < 0:
            raise ValueError(
                f"the DFlash context holds {self.context_length} positions but {num_context} "
                "tokens precede the pending one; commit() must receive every verdict's features"
            )
        for c in self.cache:
            c.trim(excess)

    def block_logits(self, tokens: list[int], num_draft: int):
        """Logits (num_draft, V) for block slots 1..num_draft after `tokens` (pending last), V
        running over the draft vocabulary when there is one."""
        return self._slot_logits(self.block_hidden(tokens, num_draft))[0]

    def block_hidden(self, tokens: list[int], num_draft: int):
        """The drafter's final-normed hidden states (1, 1 + num_draft, H) over the block
        [pending, MASK x num_draft] after `tokens`."""
        self._rewind(len(tokens) - 1)
        block = self._ids([tokens[-1]] + [self.args.mask_token_id] * num_draft)  # (1, L)
        return self.model(self._embed(block), self.cache)

    def _embed(self, blocks):
        """Block token ids (B, L) -> the drafter's input embeddings (B, L, H)."""
        return self.embed_tokens(blocks) * self.args.input_embedding_scale

    def _slot_logits(self, hidden):
        """The drafter's hidden states over whole blocks (B, L, H) -> logits of slots 1.. (B,
        L - 1, V), V the draft vocabulary when there is one."""
        return self.model.compute_logits(self._in_head_dtype(hidden[:, 1:]), self.lm_head)

    def _target_ids(self, best):
        """Best rows of the head -> target token ids (through the draft vocabulary)."""
        return best if self.draft_ids is None else self.draft_ids[best]

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig) -> Draft:
        # Fewer drafts than the block holds shrink the block, as z-lab does near max_tokens.
        num_draft = min(k, self.block_size - 1)
        if num_draft < 1:
            return EMPTY_DRAFT
        if self.tree_budget is not None:
            return self._propose_tree(tokens, num_draft, k)
        return self._block_drafts(self.block_hidden(tokens, num_draft), [tokens[-1]],
                                  [num_draft], [sampling])[0]

    def _block_drafts(self, hidden, pending: list[int], sizes: list[int],
                      samplings: list) -> list[Draft]:
        """Blocks' hidden states (B, L, H) after each row's pending token -> each row's chain
        of its first sizes[i] slots: each slot's argmax (one-hot p, so sampling stays exact
        through the one-hot rule)."""
        best = self._target_ids(self._best(self._slot_logits(hidden)))  # (B, L - 1)
        return [Draft(tokens=best[i, :n]) if n > 0 else EMPTY_DRAFT for i, n in enumerate(sizes)]

    def _propose_tree(self, tokens: list[int], slots: int, budget: int) -> Draft:
        """The block's slots' best tokens, read to the host (the tree's shape depends on their
        probabilities), grown into the `budget` most probable branches (DDTree). Children are
        deterministic (Draft.probs None), which the tree rule keeps lossless when sampling."""
        scores, ids = self._best_rows(self.block_logits(tokens, slots), self.tree_width)
        drafts, shape = best_first_drafts(scores, ids, budget)
        return Draft(tokens=drafts, parents=shape.parents)

    def commit(self, tokens: list[int], verdict: Verdict) -> None:
        if self._checked(verdict.features):
            self._deferred.append(verdict.features)
        if len(self._deferred) >= self.deferred_limit:
            self._flush()  # a long run of plain steps pays as it goes, not in one drafting step


class DFlashDrafter(DFlashDrafting):
    """DFlash on MLX: a chain reads nothing back to the host, and the rows of a batch draft
    their chains in one drafter pass (`propose_together`)."""

    def together(self):
        return None if self.tree_budget is not None else id(self.model)

    @staticmethod
    def propose_together(drafters, tokens, ks, samplings):
        """Every row's block in one pass of the drafter: the rows' blocks right-padded to the
        longest, each attending to its own context (DFlashModel.rows), then one head
        (`_block_drafts`, over every row at once)."""
        first = drafters[0]
        sizes = [max(min(k, d.block_size - 1), 0) for d, k in zip(drafters, ks)]
        if not any(sizes):
            return [EMPTY_DRAFT] * len(drafters)
        for d, t in zip(drafters, tokens):
            d._rewind(len(t) - 1)
        width = 1 + max(sizes)
        mask = first.args.mask_token_id
        blocks = mx.array([[t[-1]] + [mask] * (width - 1) for t in tokens], dtype=mx.int32)
        hidden = first.model.rows(first._embed(blocks), [d.cache for d in drafters],
                                  [1 + n for n in sizes])
        return first._block_drafts(hidden, [t[-1] for t in tokens], sizes, samplings)

    def _ids(self, tokens: list[int]) -> mx.array:
        return mx.array(tokens, dtype=mx.int32)[None]

    def _head_rows(self, head, ids: mx.array):
        return head_rows(head, ids)

    def _concat(self, parts) -> mx.array:
        return mx.concatenate(parts, axis=-1)

    def _rows(self, parts) -> mx.array:
        return mx.concatenate(parts, axis=0)

    def _in_head_dtype(self, hidden: mx.array) -> mx.array:
        return hidden.astype(dtype_of(self.lm_head))

    def _best(self, logits: mx.array) -> mx.array:
        return mx.argmax(logits, axis=-1).astype(mx.int32)

    def _best_rows(self, logits: mx.array, width: int) -> tuple[list, list]:
        return best_rows(nn.log_softmax(logits.astype(mx.float32), axis=-1), width,
                         self.draft_ids)

    def _host_lists(self, *arrays) -> list:
        mx.eval(*arrays)
        return [a.tolist() for a in arrays]


def check_block_size(block_size: int | None, trained: int) -> int:
    if block_size is None:
        return trained
    if not 2 <= block_size <= trained:
        raise ValueError(
            f"DFlash block size must be between 2 and the checkpoint's {trained}, got {block_size}"
        )
    return int(block_size)


def read_checkpoint(path, sizes: TargetSizes, *, block_size: int | None, draft_vocab: bool,
                    tree_budget: int | None, tree_width: int, window: int | None = None,
                    config_class: type = DFlashConfig):
    """A DFlash checkpoint's directory (a Hub repo id resolved through the Hugging Face cache;
    HF_HUB_OFFLINE applies), config, and the drafter's options (block size, tree, the draft
    vocabulary: None without one or when `draft_vocab` is False), each checked, and the config
    against the target's `sizes`, before any weight is read: either backend loader's host side."""
    check_tree(tree_budget, tree_width)
    path = Path(path).expanduser()
    if not path.is_dir():
        from ..converters.hf import resolve_hf_source  # repo ids, through the Hub cache

        path = resolve_hf_source(str(path))
    args = config_class.from_dict(read_config(path))
    check_against_target(args, sizes)
    check_block_size(block_size, args.block_size)
    if check_drafter_window(window) is not None:
        args.context_window = window
    vocab = read_draft_vocab(path, args.vocab_size) if draft_vocab else None
    return path, args, dict(block_size=block_size, draft_vocab=vocab, tree_budget=tree_budget,
                            tree_width=tree_width)


def load_dflash_drafter(path, *, model, tokenizer=None, block_size: int | None = None,
                        dtype=None, draft_vocab: bool = True, tree_budget: int | None = None,
                        tree_width: int = 4, window: int | None = None) -> DFlashDrafter:
    """Load a DFlash checkpoint for target `model`: a directory with config.json and
    *.safetensors, or a Hub repo id (through the Hugging Face cache; HF_HUB_OFFLINE applies).

    Everything is checked before any compute: the config against the target, then every weight
    name and shape against the config. `tokenizer` is accepted for symmetry with other drafters.
    `dtype`: None runs the checkpoint's dtype, "target" the target's, or an mx.Dtype.
    `draft_vocab`: draft from the checkpoint's draft vocabulary (draft_vocab.json) when it has
    one; False ranks the whole vocabulary.
    `tree_budget`: draft a tree of up to this many nodes from each block (DDTree), the
    `tree_width` best tokens of each slot its candidates, instead of a chain.
    `window`: each layer sees at most this many context positions (with the slot's own), its
    own sliding window narrowed, full-attention layers windowed: the drafter's cost stops
    growing with the context (drafts only: the output is the target's either way).
    """
    path, args, options = read_checkpoint(path, target_sizes(model), block_size=block_size,
                                          draft_vocab=draft_vocab, tree_budget=tree_budget,
                                          tree_width=tree_width, window=window)
    drafter_model, parts = load_checked_model(path, args, model, dtype)
    return DFlashDrafter(drafter_model, **parts, **options)


def load_checked_model(path, args, model, dtype, model_class=DFlashModel):
    """A block drafter's model with its weights, checked against `args` (read_checkpoint's),
    in `dtype` (None: as stored; "target": the target's), and the target's parts it drafts
    with: its embedding and head unless the checkpoint has its own, its final norm."""
    weights = read_weights(path)
    drafter_model = check_weights(args, weights, model_class)
    if dtype == "target":  # e.g. a bf16-stored drafter on an fp32 CPU target
        dtype = dtype_of(target_head(model))
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
                   for k, v in weights.items()}
    drafter_model.load_weights(list(weights.items()))
    drafter_model.eval()
    embed = getattr(drafter_model, "embed_tokens", None)
    head = getattr(drafter_model, "lm_head", None)
    if head is None and embed is not None and args.tie_word_embeddings:
        head = embed.as_linear
    return drafter_model, dict(
        embed_tokens=embed if embed is not None else target_embedding(model),
        lm_head=head if head is not None else target_head(model),
        final_norm=target_final_norm(model),
        target_layers=len(decoder_layers(model)),
    )
