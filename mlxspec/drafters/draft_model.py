"""A smaller model with the same tokenizer drafts K tokens autoregressively.

Its cache keeps the longest prefix that is still valid after each verification, so a step feeds
only the tokens the draft model has not seen. Drafting is lazy: the K draft steps and the target's
verification form one graph, evaluated once.

A hybrid draft model (Qwen3.5, Qwen3-Next: recurrent layers beside attention) rolls back with the
target's machinery (mlxspec.rollback): attention caches are cut, recurrent states put back. Its
drafts are fed one position per call, so the recurrent states after each of them are already
there, and kept: a rollback to a kept length selects the states recorded there, computing
nothing. Any other length goes back to the states from before the step's feed and feeds again.

DraftModelDrafting is the host side, for both backends; DraftModelDrafter adds MLX's tensor math,
mlxspec.backends.torch.draft_model.TorchDraftModelDrafter torch's.
"""

import mlx.core as mx

from ..engine import Draft, Drafter, Verdict, common_prefix_length
from ..backends.mlx.target import untrimmable_caches
from ..backends.mlx.window import windowed
from ..backends.mlx.window_cache import make_cache
from ..request import check_drafter_window
from ..rollback import (
    attention_trimmable,
    is_recurrent,
    recurrent_layers,
    restore,
    snapshot,
    trim_attention,
)
from ..sampling import SamplingConfig
from ..backends.mlx.sampling import processed_logprobs
from .paired import MLXArrays


def check_same_tokenizer(target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int):
    """Refuse a draft model whose token ids mean something else, before any compute."""
    if target_vocab != draft_vocab:
        raise ValueError(
            f"vocab size mismatch: the target's output layer has {target_vocab} tokens, the draft "
            f"model's has {draft_vocab}. A draft model must share the target's vocabulary."
        )
    t_vocab, d_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if t_vocab != d_vocab:
        differ = len(set(t_vocab.items()) ^ set(d_vocab.items()))
        raise ValueError(
            f"draft model tokenizer differs from the target's ({len(d_vocab)} vs {len(t_vocab)} "
            f"token strings, {differ} (token, id) pairs differ). A draft model must share the "
            "target's tokenizer."
        )


class DraftModelDrafting(Drafter):
    """The host side of a draft model, one for both backends: which tokens its cache holds,
    how far back a step rewinds it, the K-step chain and its draws. A backend's subclass brings
    the tensor math: `xp` (ids, stack), a fresh cache, cutting it, one model step and one draw;
    a cache with recurrent layers also says which lengths it can reach and keeps their states.
    `window` (--drafter-window): each position attends to its last `window` positions only,
    so a long context stops making every draft step dearer."""

    name = "draft"
    default_num_draft = 4
    adaptive_num_draft = 12  # a close draft model's best K can be 8 or more (engine.Drafter)
    xp = None  # the backend's array primitives: MLXArrays, or the torch backend's

    def __init__(self, model, window: int | None = None):
        self.model, self.window = model, check_drafter_window(window)
        self._fresh_cache()
        self._fed_drafts = 0  # drafts fed to the cache this step, known after verification

    # ---- the backend's tensor math ----

    def _make_cache(self):
        """A fresh, empty cache for the model."""
        raise NotImplementedError

    def _cut(self, drop: int, keep: int) -> bool:
        """Drop the cache's last `drop` positions, leaving `keep`; False if it cannot now."""
        raise NotImplementedError

    def _step(self, ids):
        """Feed ids (1, n) to the model through the cache; the last position's logits."""
        raise NotImplementedError

    def _draw(self, logits, sampling: SamplingConfig):
        """A draft token from a step's logits, and (sampling) its distribution p; None when
        greedy (one-hot)."""
        raise NotImplementedError

    def _reachable(self, keep: int) -> int:
        """The longest length up to `keep` the cache can be cut back to (-1: none)."""
        return keep

    def _remember_states(self, length: int, *, anew: bool = False) -> None:
        """After a step, when the cache holds `length` positions: keep what a cut back to here
        needs (`anew`: forgetting what was kept before)."""

    # ---- shared ----

    def _fresh_cache(self) -> None:
        self.cache = self._make_cache()
        self._seen: list[int] = []  # tokens the cache holds (host values)

    def begin(self, prompt, features=None):
        self._fresh_cache()

    def _rewind_to(self, tokens: list[int]) -> int:
        """Cut the cache back to the longest prefix shared with `tokens` that it can reach (for a
        recurrent layer, a length whose states it kept); return that length."""
        keep = common_prefix_length(self._seen, tokens)
        keep = min(keep, len(tokens) - 1)  # always re-feed at least the last token
        keep = self._reachable(keep)
        drop = len(self._seen) - keep
        if drop > 0 and (keep < 0 or not self._cut(drop, keep)):
            self._fresh_cache()
            return 0
        self._seen = self._seen[:keep]
        return keep

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig) -> Draft:
        keep = self._rewind_to(tokens)
        self._remember_states(keep, anew=True)  # the fallback: feed again from here
        inputs = self.xp.ids(tokens[keep:])
        drafted, probs = [], []
        for i in range(k):
            logits = self._step(inputs)
            self._remember_states(len(tokens) + i)  # tokens, then the first i drafts
            token, p = self._draw(logits, sampling)
            drafted.append(token)
            if p is not None:
                probs.append(p)
            inputs = token.reshape(1, 1)
        self._seen = list(tokens)  # plus drafts[:-1], known on the host after verification
        self._fed_drafts = k - 1
        return Draft(tokens=self.xp.stack(drafted),
                     probs=self.xp.stack(probs) if probs else None)

    def commit(self, tokens: list[int], verdict: Verdict) -> None:
        self._seen += verdict.draft_tokens[: max(self._fed_drafts, 0)]
        self._fed_drafts = 0


# A sliding-window layer of a draft model keeps this many positions past its window, so that
# cutting back a step's drafts (one position written at a time) stays exact; a longer cut
# starts the cache afresh.
CUT_SLACK = 32


class DraftModelDrafter(DraftModelDrafting):
    """A draft model on MLX (an mlx-lm model); hybrids roll back through mlxspec.rollback."""

    xp = MLXArrays

    def __init__(self, model, window: int | None = None):
        super().__init__(model, window)
        bad = untrimmable_caches([c for c in self.cache if not is_recurrent(c)])
        if bad:
            raise ValueError(f"draft model cache {', '.join(bad)} cannot roll back")

    def _make_cache(self):
        return make_cache(self.model, slack=CUT_SLACK)

    def _fresh_cache(self) -> None:
        super()._fresh_cache()
        self._recurrent = recurrent_layers(self.cache)
        # Length -> the recurrent layers' states when the cache held that many of `_seen`: the
        # lengths a rollback can reach without feeding (none needed without recurrent layers).
        self._states = {0: snapshot(self._recurrent)}

    def _reachable(self, keep: int) -> int:
        if not self._recurrent:
            return keep
        return max((n for n in self._states if n <= keep), default=-1)

    def _remember_states(self, length: int, *, anew: bool = False) -> None:
        if anew:
            self._states = {}
        if self._recurrent:
            self._states[length] = snapshot(self._recurrent)

    def _cut(self, drop: int, keep: int) -> bool:
        if not attention_trimmable(self.cache, drop):
            return False
        trim_attention(self.cache, drop)
        if self._recurrent:
            restore(self._recurrent, self._states[keep])
        return True

    def _step(self, ids: mx.array) -> mx.array:
        return self.model(ids, cache=windowed(self.cache, self.window))[0, -1]

    def _draw(self, logits: mx.array, sampling: SamplingConfig):
        if sampling.greedy:
            return mx.argmax(logits, axis=-1).astype(mx.int32), None
        logp = processed_logprobs(logits, sampling)
        return mx.random.categorical(logp).astype(mx.int32), mx.exp(logp)
