"""Lookup first: copy where the text repeats itself, draft with a model everywhere else.

Prompt lookup drafts for free, and where the suffix's n-gram appeared before its drafts run long
(code reusing its identifiers, an answer quoting its question); a model drafter guesses fresh text,
which lookup cannot, but a one-layer DFlash drafter cannot follow a copy (docs/dflash-training.md).
So each step takes lookup's draft when it finds a match and the model's otherwise. The model
drafter still sees every verdict, so its state (a DFlash context, a draft model's cache) is
current whenever it is asked again. (Snowflake's Arctic Inference likewise combines suffix
decoding with a trained speculator.)

Each source keeps its own adaptive-K policy: their acceptance by position and their step costs
differ (a lookup step drafts for nothing), and one policy fitted to both would suit neither.
"""

from ..engine import Draft, Drafter, Verdict
from ..sampling import SamplingConfig
from .lookup import PromptLookupDrafter


class LookupFirstDrafter(Drafter):
    def __init__(self, model_drafter: Drafter, lookup: PromptLookupDrafter | None = None):
        self.model_drafter = model_drafter
        self.lookup = lookup if lookup is not None else PromptLookupDrafter()
        self.name = f"{model_drafter.name}+lookup"
        self.capture_layers = model_drafter.capture_layers
        self.default_num_draft = max(model_drafter.default_num_draft, self.lookup.default_num_draft)
        self.max_draft = max(model_drafter.max_draft, self.lookup.max_draft)
        self.drafts_trees = model_drafter.drafts_trees or self.lookup.drafts_trees
        self.batch_refusal = model_drafter.batch_refusal
        if hasattr(model_drafter, "backend"):  # the torch drafters say which backend they need
            self.backend = model_drafter.backend
        self._tokens: list[int] = []

    def copies(self, tokens: list[int]) -> bool:
        """Whether lookup drafts the step after `tokens` (pending last)."""
        return bool(self.lookup.continuation(tokens, 1))

    def fork(self) -> "LookupFirstDrafter":
        twin = super().fork()
        twin.model_drafter, twin.lookup = self.model_drafter.fork(), self.lookup.fork()
        return twin

    def bind(self, target) -> None:
        self.model_drafter.bind(target)

    def begin(self, prompt, features=None):
        self.lookup.begin(prompt)
        self.model_drafter.begin(prompt, features)
        self._tokens = prompt

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig) -> Draft:
        copied = self.lookup.propose(tokens, k, sampling)
        if len(copied):
            return copied
        return self.model_drafter.propose(tokens, k, sampling)

    def commit(self, tokens: list[int], verdict: Verdict) -> None:
        self.lookup.commit(tokens, verdict)
        self.model_drafter.commit(tokens, verdict)
        self._tokens = tokens

    def end(self, tokens: list[int]) -> None:
        self.lookup.end(tokens)
        self.model_drafter.end(tokens)

    def draft_policy(self, max_k: int, greedy: bool) -> "PerSourceDraftLength":
        policies = self.__dict__.setdefault("_draft_policies", {})
        key = (max_k, greedy)
        if key not in policies:
            policies[key] = PerSourceDraftLength(
                lambda: self.copies(self._tokens), self.lookup.draft_policy(max_k, greedy),
                self.model_drafter.draft_policy(max_k, greedy))
        return policies[key]


class PerSourceDraftLength:
    """Two adaptive-K policies, one per source; `copies()` says which source drafts next, so
    each policy chooses K for, and learns from, its own steps only."""

    reads_tokens = True  # which source drafts next depends on the latest committed tokens

    def __init__(self, copies, lookup_policy, model_policy):
        self.copies = copies
        self.lookup, self.model = lookup_policy, model_policy  # each source's own (a tree's too)
        self._current = self.model

    def next_k(self) -> int:
        self._current = self.lookup if self.copies() else self.model
        return self._current.next_k()

    def update(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        self._current.update(drafted, accepted, seconds)
