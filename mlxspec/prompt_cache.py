"""A target cache kept across calls (chat turns), written once for both backends: which prefix
of a new prompt it can keep is host bookkeeping; only making, measuring and cutting the cache are
the backend's."""

import weakref
from typing import Sequence

from .engine import common_prefix_length


class KeptCache:
    """Each new prompt reuses the longest prefix it shares with what the cache holds, so a turn
    prefills only the new tokens. A cache that cannot be cut back (a hybrid's recurrent layers,
    a sliding window past its edge) is kept when the new prompt extends all it holds, as the next
    chat turn does, else rebuilt. Subclasses say how the backend's cache is made and cut."""

    def __init__(self):
        self.cache = None
        self.tokens: list[int] = []  # the tokens whose keys and values (or states) it holds
        # The target features of those tokens (n, H * layers), where a row whose drafter reads
        # them (DFlash, EAGLE-3) left the cache: such a row can start from it too. Else None.
        self.features = None
        # The target layers those features were captured at: a drafter reading other layers
        # (EAGLE-3 after DFlash, in a chat or a server offering both) must not start from them.
        self.feature_layers: tuple[int, ...] = ()
        self._model = None  # a weak reference to the model whose cache it holds

    def check_model(self, model) -> None:
        """Refuse another model's cache before touching it (its layers would not fit, or worse,
        fit and be wrong); the cache stays as it was. A model gone (collected) frees it."""
        held = self._model() if self._model is not None else None
        if held is not None and held is not model:
            raise ValueError("this prompt cache holds another model's cache: use one prompt cache "
                             "per model")
        if held is None:
            self._model, self.cache, self.tokens = weakref.ref(model), None, []
            self.features = None

    def _new(self, model): ...

    def _held(self) -> int | None:
        """Positions the cache holds; None when no layer counts them."""
        ...

    def _can_cut(self) -> bool: ...

    def _cut(self, n: int) -> None: ...

    def has_features(self, layers: Sequence[int]) -> bool:
        """Whether it holds the target features of `layers` for the tokens it holds."""
        return self.features is not None and self.feature_layers == tuple(layers)

    def shared(self, prompt: Sequence[int], layers: Sequence[int] = ()) -> int:
        """How many of `prompt`'s tokens (never the last) this cache could start it with,
        left as it is (see `prefix`); `layers`: with their target features at those layers
        too (a drafter's capture layers; none: no features needed)."""
        if self.cache is None or (layers and not self.has_features(layers)):
            return 0
        keep = common_prefix_length(self.tokens, prompt[:-1])
        return keep if keep == len(self.tokens) or self._can_cut() else 0

    def prefix(self, n: int):
        """Caches holding this one's first n positions, without cutting or copying this one
        (its arrays shared): a start for a row of a batch, which copies what it reads."""
        raise NotImplementedError

    def take(self, model, prompt: Sequence[int], layers: Sequence[int] = ()):
        """The cache cut back to the longest prefix it shares with `prompt` (never all of it: the
        last prompt token is the loop's pending token); `layers`: with their target features at
        those layers (`self.features`), or else a fresh cache."""
        self.check_model(model)
        keep = common_prefix_length(self.tokens, prompt[:-1]) if self.cache is not None else 0
        if self.cache is None or (keep < len(self.tokens) and not self._can_cut()) or (
                layers and not self.has_features(layers)):
            self.cache, self.tokens, keep = self._new(model), [], 0
            self.features = None
        self._trim_to(keep)
        return self.cache

    def remember_prompt(self, prompt: Sequence[int], features, layers: Sequence[int],
                        prompt_state=None) -> None:
        """After a generation whose drafter read target features: keep the prompt (but its
        pending last token) with `features`, the prompt's at `layers`, the reply's having gone
        to the drafter. A cache that cannot be cut back to it (a hybrid's recurrent layers) is
        rewound to `prompt_state`, the target's record of it at the end of the prompt (else,
        see `remember`)."""
        self.features, self.feature_layers = features, tuple(layers)
        if prompt_state is not None and self.cache is not None:
            self._rewind(prompt_state, len(prompt) - 1)
        self.remember(prompt[:-1])

    def _rewind(self, prompt_state, n: int) -> None:
        """Put the cache back to its first n positions, using `prompt_state`."""
        raise NotImplementedError

    def remember(self, tokens: Sequence[int]) -> None:
        """After a generation: `tokens` (prompt + output) begins with what the cache now holds;
        anything it holds past them (drafts of a stopped reply) is cut back, or where it cannot
        be (or no layer counts positions), the next call starts afresh."""
        held = self._held() if self.cache is not None else 0
        if held is None or (held > len(tokens) and not self._can_cut()):
            self.cache, self.tokens, self.features = None, [], None
            return
        self.tokens = list(tokens[:held])
        self._trim_to(len(self.tokens))
        if self.features is not None and self.features.shape[0] < len(self.tokens):
            self.features = None  # a generation that kept none (one sequence's) went past them

    def _trim_to(self, keep: int) -> None:
        held = self._held() or 0
        if held > keep:
            self._cut(held - keep)
        self.tokens = self.tokens[:keep]
        if self.features is not None:
            self.features = self.features[:keep]
