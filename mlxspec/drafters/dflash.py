"""DFlash drafting for the shared loop: one drafter pass fills a whole block.

Each step the block [pending token, MASK x n] sits at positions len(tokens)-1 ...; its context is
the target features of every earlier position, kept as K/V in the drafter's cache. Drafts are the
argmax of each slot (one-hot p), so sampled acceptance stays lossless through accept_sampled's
one-hot rule; sampling each slot independently makes incoherent blocks (z-lab PR #169).
After verification the features of the newly committed positions extend the cache. A chain
reads nothing back to the host: drafting joins the target's one evaluation per step. A tree
(DDTree, `tree_budget`) reads each slot's best tokens first, since its shape depends on them.
"""

import json
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
from ..sampling import SamplingConfig
from ..tree import best_first_drafts


class DFlashDrafter(Drafter):
    name = "dflash"

    def __init__(
        self,
        model: DFlashModel,
        *,
        embed_tokens,
        lm_head,
        block_size: int | None = None,
        final_norm=None,
        target_layers: int | None = None,
        draft_vocab=None,
        tree_budget: int | None = None,
        tree_width: int = 4,
    ):
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
        self.draft_ids = None if draft_vocab is None else mx.array(draft_vocab, dtype=mx.int32)
        self.lm_head = lm_head if draft_vocab is None else head_rows(lm_head, self.draft_ids)
        # transformers' hidden_states[-1], which z-lab's reference conditions on, is the last
        # layer's output after the final norm; our capture is before it.
        last = None if target_layers is None else target_layers - 1
        self._normed_slots = [i for i, l in enumerate(self.capture_layers) if l == last]
        if self._normed_slots and final_norm is None:
            raise ValueError("the drafter captures the target's last layer: pass its final_norm")
        self.final_norm = final_norm
        self.cache = model.make_cache()

    @property
    def context_length(self) -> int:
        """Committed positions whose context K/V are cached."""
        return self.cache[0].offset

    def begin(self, prompt, features=None):
        self.cache = self.model.make_cache()
        self._append(features)

    def _append(self, features) -> None:
        if features is None:
            raise ValueError(
                "the DFlash drafter needs target hidden states: build the target with "
                "capture_layers=drafter.capture_layers"
            )
        if features.shape[0] == 0:  # a one-token prompt has no context yet
            return
        width = len(self.capture_layers) * self.args.hidden_size
        if features.ndim != 2 or features.shape[1] != width:
            raise ValueError(
                f"target features have shape {tuple(features.shape)}; the DFlash drafter expects "
                f"(positions, {width}) from layers {list(self.capture_layers)}"
            )
        self.model.append_context(self._as_reference(features), self.cache)

    def _as_reference(self, features: mx.array) -> mx.array:
        """Apply the target's final norm to the last layer's slice, as transformers does."""
        if not self._normed_slots:
            return features
        H = self.args.hidden_size
        parts = [features[:, i * H : (i + 1) * H] for i in range(len(self.capture_layers))]
        for i in self._normed_slots:
            parts[i] = self.final_norm(parts[i])
        return mx.concatenate(parts, axis=-1)

    def _rewind(self, num_context: int) -> None:
        """Keep exactly `num_context` cached positions (a caller may have rolled back)."""
        excess = self.context_length - num_context
        if excess < 0:
            raise ValueError(
                f"the DFlash context holds {self.context_length} positions but {num_context} "
                "tokens precede the pending one; commit() must receive every verdict's features"
            )
        for c in self.cache:
            c.trim(excess)

    def block_logits(self, tokens: list[int], num_draft: int) -> mx.array:
        """Logits (num_draft, V) for block slots 1..num_draft after `tokens` (pending last), V
        running over the draft vocabulary when there is one."""
        self._rewind(len(tokens) - 1)
        block = mx.array([[tokens[-1]] + [self.args.mask_token_id] * num_draft], dtype=mx.int32)
        embeddings = self.embed_tokens(block) * self.args.input_embedding_scale  # (1, L, H)
        hidden = self.model(embeddings, self.cache)[:, 1:]
        return self.model.compute_logits(hidden.astype(_dtype_of(self.lm_head)), self.lm_head)[0]

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig) -> Draft:
        # Fewer drafts than the block holds shrink the block, as z-lab does near max_tokens.
        num_draft = min(k, self.block_size - 1)
        if num_draft < 1:
            return EMPTY_DRAFT
        if self.tree_budget is not None:
            return self._propose_tree(tokens, num_draft, k)
        drafts = mx.argmax(self.block_logits(tokens, num_draft), axis=-1)
        if self.draft_ids is not None:
            drafts = self.draft_ids[drafts]
        return Draft(tokens=drafts.astype(mx.int32))

    def _propose_tree(self, tokens: list[int], slots: int, budget: int) -> Draft:
        """The block's slots' best tokens, read to the host (the tree's shape depends on their
        probabilities), grown into the `budget` most probable branches (DDTree)."""
        logprobs = nn.log_softmax(self.block_logits(tokens, slots).astype(mx.float32), axis=-1)
        return best_first_draft(logprobs, self.tree_width, budget, self.draft_ids)

    def commit(self, tokens: list[int], verdict: Verdict) -> None:
        self._append(verdict.features)


def best_first_draft(logprobs: mx.array, width: int, budget: int, ids=None) -> Draft:
    """A DDTree draft from independent per-depth distributions, logprobs (depth, rows): each
    depth's `width` best rows (target ids through `ids`, a draft vocabulary's, when given) read
    to the host once, grown into the `budget` most probable branches. Children are
    deterministic (Draft.probs None), which the tree rule keeps lossless when sampling too."""
    best = mx.argsort(-logprobs, axis=-1)[:, :width]
    scores = mx.take_along_axis(logprobs, best, axis=-1)
    ids = best if ids is None else ids[best]
    mx.eval(scores, ids)
    drafts, shape = best_first_drafts(scores.tolist(), ids.tolist(), budget)
    return Draft(tokens=drafts, parents=shape.parents)


MAX_TREE_BUDGET = 256  # nodes verified in one pass; measured budgets that pay are 4 to 64


def check_tree(budget: int | None, width: int) -> tuple[int | None, int]:
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                               or budget < 1):
        raise ValueError(f"tree budget must be a positive integer (draft nodes), got {budget!r}")
    if budget is not None and budget > MAX_TREE_BUDGET:
        raise ValueError(f"tree budget must be at most {MAX_TREE_BUDGET} nodes, got {budget}")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"tree width must be a positive integer, got {width!r}")
    return budget, width


def check_block_size(block_size: int | None, trained: int) -> int:
    if block_size is None:
        return trained
    if not 2 <= block_size <= trained:
        raise ValueError(
            f"DFlash block size must be between 2 and the checkpoint's {trained}, got {block_size}"
        )
    return int(block_size)


def head_rows(head, ids: mx.array) -> nn.Module:
    """A linear layer computing `head`'s logits for `ids` only: rows of a Linear, of a tied
    Embedding (its `as_linear`) or of their quantized forms (packed rows slice exactly)."""
    owner = getattr(head, "__self__", head)
    if "scales" in owner:
        rows = nn.QuantizedLinear(owner.group_size, 1, bias=False, group_size=owner.group_size,
                                  bits=owner.bits, mode=getattr(owner, "mode", "affine"))
        rows.scales = owner["scales"][ids]
        if "biases" in owner:
            rows.biases = owner["biases"][ids]
        elif "biases" in rows:
            del rows["biases"]
    else:
        rows = nn.Linear(1, 1, bias=False)
    rows.weight = owner["weight"][ids]
    if "bias" in owner:
        rows.bias = owner["bias"][ids]
    mx.eval(rows.parameters())
    return rows


def _dtype_of(module) -> mx.Dtype:
    owner = getattr(module, "__self__", module)  # Embedding.as_linear is a bound method
    scales = getattr(owner, "scales", None)  # quantized layers compute in their scales' dtype
    return (scales if scales is not None else owner.weight).dtype


def _target_inner(model):
    """The module holding embed_tokens and the final norm (model, model.model, language_model...)."""
    for outer in (model, getattr(model, "language_model", None)):
        for inner in (outer, getattr(outer, "model", None)):
            if inner is not None and hasattr(inner, "embed_tokens"):
                return inner
    raise ValueError(f"cannot find the token embedding of {type(model).__module__}")


def target_embedding(model):
    return _target_inner(model).embed_tokens


def target_head(model):
    """The target's LM head module, or its tied embedding used as one."""
    for inner in (model, getattr(model, "language_model", None)):
        head = getattr(inner, "lm_head", None) if inner is not None else None
        if head is not None:
            return head
    return target_embedding(model).as_linear


def target_final_norm(model):
    return getattr(_target_inner(model), "norm", None)


def target_sizes(model) -> tuple[int, int, int]:
    """(hidden size, vocab size, decoder layers) of an mlx-lm model."""
    embed = target_embedding(model)
    hidden = getattr(getattr(model, "args", None), "hidden_size", None) or embed.weight.shape[1]
    return int(hidden), int(embed.weight.shape[0]), len(decoder_layers(model))


def check_against_target(args: DFlashConfig, model) -> None:
    """Refuse a drafter trained for another target, naming both sides, before any compute."""
    hidden, vocab, layers = target_sizes(model)
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


TRAINED_DIR = Path(__file__).parent / "trained"


def embedding_checksum(model) -> float:
    """Sum of the first 8 embedding rows (dequantized): tells targets of equal shape apart."""
    embed = target_embedding(model)
    rows = embed.weight[:8]
    if hasattr(embed, "scales"):
        rows = mx.dequantize(rows, embed.scales[:8], embed.get("biases")[:8] if "biases" in embed
                             else None, group_size=embed.group_size, bits=embed.bits)
    return float(rows.astype(mx.float32).sum().item())


def find_shipped_drafter(sizes: tuple[int, int, int], checksum, kind: str = "dflash") -> Path | None:
    """The `kind` drafter that ships with mlxspec for a target, if any: a directory under
    drafters/trained/ whose target.json names the drafter kind ("dflash" when it names none) and
    holds the target's (hidden, vocab, layers) and the sum of its first 8 embedding rows
    (`checksum()`, called only when the sizes match)."""
    value = None
    for folder, want in shipped_candidates(sizes, kind):
        value = checksum() if value is None else value
        if abs(value - want["embedding_checksum"]) <= 1e-3 * max(1.0, abs(value)):
            return folder
    return None


def shipped_candidates(sizes: tuple, kind: str = "dflash"):
    """(directory, its target.json) of each `kind` drafter shipped for a target of these
    (hidden, vocab, layers) sizes: read before the target loads (its weights tell which)."""
    for target_file in sorted(TRAINED_DIR.glob("*/target.json")):
        want = json.loads(target_file.read_text())
        if want.get("drafter", "dflash") == kind and \
                (want["hidden_size"], want["vocab_size"], want["num_layers"]) == tuple(sizes):
            yield target_file.parent, want


def shipped_drafter_for(model, kind: str = "dflash") -> Path | None:
    return find_shipped_drafter(target_sizes(model), lambda: embedding_checksum(model), kind)


def load_dflash_drafter(path, *, model, tokenizer=None, block_size: int | None = None,
                        dtype=None, draft_vocab: bool = True, tree_budget: int | None = None,
                        tree_width: int = 4) -> DFlashDrafter:
    """Load a DFlash checkpoint for target `model`: a directory with config.json and
    *.safetensors, or a Hub repo id (through the Hugging Face cache; HF_HUB_OFFLINE applies).

    Everything is checked before any compute: the config against the target, then every weight
    name and shape against the config. `tokenizer` is accepted for symmetry with other drafters.
    `dtype`: None runs the checkpoint's dtype, "target" the target's, or an mx.Dtype.
    `draft_vocab`: draft from the checkpoint's draft vocabulary (draft_vocab.json) when it has
    one; False ranks the whole vocabulary.
    `tree_budget`: draft a tree of up to this many nodes from each block (DDTree), the
    `tree_width` best tokens of each slot its candidates, instead of a chain.
    """
    check_tree(tree_budget, tree_width)
    path = Path(path).expanduser()
    if not path.is_dir():
        from ..converters.hf import resolve_hf_source  # repo ids, through the Hub cache

        path = resolve_hf_source(str(path))
    args = DFlashConfig.from_dict(read_config(path))
    check_against_target(args, model)
    check_block_size(block_size, args.block_size)
    vocab = read_draft_vocab(path, args.vocab_size) if draft_vocab else None
    weights = read_weights(path)
    drafter_model = check_weights(args, weights)
    if dtype == "target":  # e.g. a bf16-stored drafter on an fp32 CPU target
        dtype = _dtype_of(target_head(model))
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
                   for k, v in weights.items()}
    drafter_model.load_weights(list(weights.items()))
    drafter_model.eval()
    embed = getattr(drafter_model, "embed_tokens", None)
    head = getattr(drafter_model, "lm_head", None)
    if head is None and embed is not None and args.tie_word_embeddings:
        head = embed.as_linear
    return DFlashDrafter(
        drafter_model,
        embed_tokens=embed if embed is not None else target_embedding(model),
        lm_head=head if head is not None else target_head(model),
        block_size=block_size,
        final_norm=target_final_norm(model),
        target_layers=len(decoder_layers(model)),
        draft_vocab=vocab,
        tree_budget=tree_budget,
        tree_width=tree_width,
    )
