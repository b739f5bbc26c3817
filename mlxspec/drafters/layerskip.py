"""LayerSkip self-speculation (Elhoushi et al., 2024): the target's first E layers draft.

The draft model is the target cut after layer E - 1, with the target's own final norm and head;
it drafts autoregressively in the target's own cache. Verification then reuses that work: the
first E layers' keys and values of [pending, drafts] are already in their caches and their output
is handed to the pass (Draft.early_exit), so it runs only layers E.. over those positions.
A rejection cuts every layer's cache by the same count: both halves hold the same positions.

Drafting costs E/L of a target pass per token, and an untrained model's early layers rank tokens
poorly; models trained with layer dropout and an early-exit loss (Meta's LayerSkip Llama
checkpoints) accept far more. Drafts stay on the device, so a step still reads the host once.
"""

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..backends.mlx.early_exit import early_forward, num_layers
from ..engine import EMPTY_DRAFT, Draft, Drafter
from ..backends.mlx.target import is_recurrent
from ..rollback import snapshot_fields
from ..sampling import SamplingConfig
from ..backends.mlx.sampling import processed_logprobs

# The exit layer as a share of the target's depth when none is given, chosen by measurement on
# the default SmolLM2 target, which was not trained for early exit (docs/benchmarks.md,
# "LayerSkip": exits 6..26 of 30 at 4 drafts; 26 had by far the highest tau and, within noise,
# the best speed). A model trained for early exit drafts well from far earlier layers.
DEFAULT_EXIT_SHARE = 0.87


def default_exit_layer(model) -> int:
    return max(1, min(num_layers(model) - 1, round(DEFAULT_EXIT_SHARE * num_layers(model))))


def why_unavailable(model) -> str | None:
    """Why LayerSkip cannot run on `model` whatever the exit (None when it can): it needs two
    layers or more, all keeping one kind of KV cache (the late half reads the late layers' cache
    where the model builds its mask from the first; a recurrent state would also need restoring,
    which this drafter does not do), all in this process."""
    from ..distributed import stage_of

    if stage_of(model) is not None:
        return ("the layerskip drafter runs the target's early layers on their own; over a "
                "target split across ranks they are another rank's")
    layers = num_layers(model)
    if layers < 2:
        return f"the layerskip drafter needs a target of 2 layers or more; this one has {layers}"
    cache = make_prompt_cache(model)
    kinds = sorted({type(c).__name__ for c in cache})
    if any(is_recurrent(c) for c in cache) or len(kinds) > 1:
        return (f"the layerskip drafter needs a target whose layers all keep one kind of KV "
                f"cache; this one mixes {', '.join(kinds)}")
    if any(snapshot_fields(c) for c in cache):  # its early layers' drafts could not be cut
        return (f"the layerskip drafter needs a target whose KV cache can be cut back; this "
                f"one keeps {kinds[0]}, which forgets as it writes")
    return None


def check_exit_layer(model, exit_layer: int) -> None:
    """One line before any compute: an exit inside the target."""
    layers = num_layers(model)
    if not 1 <= exit_layer < layers:
        raise ValueError(f"--exit-layer must be in 1..{layers - 1} for this {layers}-layer "
                         f"target, got {exit_layer}")


class LayerSkipDrafter(Drafter):
    """Drafts with the target's first `exit_layer` layers, in the target's cache."""

    name = "layerskip"
    default_num_draft = 4
    constraint_refusal = ("its drafts run inside the target's own cache, where no grammar can "
                          "cut them")
    batch_refusal = ("it drafts inside the target's own cache, which holds one sequence; use "
                     "it with generate, chat or one request at a time")

    def __init__(self, model, exit_layer: int | None = None):
        self.model = model
        problem = why_unavailable(model)  # before the default exit, which needs 2 layers
        if problem:
            raise ValueError(problem)
        self.exit_layer = default_exit_layer(model) if exit_layer is None else int(exit_layer)
        check_exit_layer(model, self.exit_layer)
        self.cache = None

    def bind(self, target) -> None:
        if getattr(target, "model", None) is not self.model:
            raise ValueError("the layerskip drafter drafts inside its own target's cache: build "
                             "it for the model being decoded")
        self.cache = target.cache

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig) -> Draft:
        if k < 1:
            return EMPTY_DRAFT
        x = mx.array(tokens[-1:], dtype=mx.int32)[None]
        drafts, probs, states = [], [], []
        for j in range(k + 1):  # the last run only feeds draft k's states to the pass
            logits, hidden = early_forward(self.model, x, self.cache, self.exit_layer)
            states.append(hidden[0])
            if j == k:
                break
            logits = logits[0, -1]
            if sampling.greedy:
                token = mx.argmax(logits)
            else:
                logp = processed_logprobs(logits, sampling)
                token = mx.random.categorical(logp)
                probs.append(mx.exp(logp))
            drafts.append(token)
            x = token.reshape(1, 1).astype(mx.int32)
        return Draft(tokens=mx.stack(drafts).astype(mx.int32),
                     probs=mx.stack(probs) if probs else None,
                     early_exit=(self.exit_layer, mx.concatenate(states, axis=0)))


def load_layerskip_drafter(path=None, *, model, tokenizer=None, exit_layer: int | None = None):
    """LayerSkip for mlx-lm target `model`, exiting after `exit_layer` layers (default: 87% of
    the target's depth, DEFAULT_EXIT_SHARE). Needs no checkpoint: `path` is ignored (the
    registry passes None)."""
    return LayerSkipDrafter(model, exit_layer)
