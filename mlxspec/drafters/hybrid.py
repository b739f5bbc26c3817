"""Copy first: copy where the text repeats itself, draft with a model everywhere else.

A copier (prompt lookup, or suffix decoding over this and earlier replies) drafts for free, and
where the text it matches appeared before its drafts run long (code reusing its identifiers, an
answer quoting its question, an agent repeating its tool calls); a model drafter guesses fresh
text, which a copier cannot, but a one-layer DFlash drafter cannot follow a copy
(docs/dflash-training.md). So each step takes the copier's draft when it finds one and the
model's otherwise: "X+lookup", "X+suffix". The model drafter still sees every verdict, so its
state (a DFlash context, a draft model's cache) is current whenever it is asked again.
(Snowflake's Arctic Inference likewise combines suffix decoding with a trained speculator.)

Each source keeps its own adaptive-K policy (draft_length.PerSourceDraftLength): their
acceptance by position and their step costs differ (a copy step drafts for nothing), and one
policy fitted to both would suit neither.
"""

from ..draft_length import PerSourceDraftLength
from ..engine import Draft, Drafter, Verdict, requested_drafts
from ..sampling import SamplingConfig
from .lookup import PromptLookupDrafter


class CopyFirstDrafter(Drafter):
    """`copier` (prompt lookup by default; any drafter with `copies(tokens)`) where it drafts,
    `model_drafter` elsewhere."""

    def __init__(self, model_drafter: Drafter, copier: Drafter | None = None):
        self.model_drafter = model_drafter
        self.copier = copier if copier is not None else PromptLookupDrafter()
        self.name = f"{model_drafter.name}+{self.copier.name}"
        self.capture_layers = model_drafter.capture_layers
        self.default_num_draft = max(model_drafter.default_num_draft, self.copier.default_num_draft)
        self.adaptive_num_draft = max(requested_drafts(d, None, adaptive=True)
                                      for d in (model_drafter, self.copier))
        self.max_draft = max(model_drafter.max_draft, self.copier.max_draft)
        self.drafts_trees = model_drafter.drafts_trees or self.copier.drafts_trees
        self.batch_refusal = model_drafter.batch_refusal
        self.remembers = model_drafter.remembers or self.copier.remembers
        if hasattr(model_drafter, "backend"):  # the torch drafters say which backend they need
            self.backend = model_drafter.backend
        self._tokens: list[int] = []
        self._decided: tuple[int, bool] | None = None  # (len(tokens), copies) of this step

    def copies(self, tokens: list[int]) -> bool:
        """Whether the copier drafts the step after `tokens` (pending last): where it weighs its
        drafts (suffix decoding's expected accepted tokens), only when they are worth at least
        what the model's would be, measured by the model's adaptive K, or one token at a fixed
        K (Arctic Inference takes a suffix draft over its speculator's likewise, when it scores
        at least the speculator's draft length)."""
        if self._decided is None or self._decided[0] != len(tokens):  # once per step: the
            policy = self.__dict__.get("_model_policy")  # model's K may change its worth
            worth = policy.expected_accepted() if hasattr(policy, "expected_accepted") else 1.0
            self._decided = len(tokens), self.copier.copies(tokens, worth)
        return self._decided[1]

    def fork(self) -> "CopyFirstDrafter":
        twin = super().fork()
        twin.__dict__.pop("_model_policy", None)
        twin.model_drafter, twin.copier = self.model_drafter.fork(), self.copier.fork()
        return twin

    def forget(self) -> None:
        self.copier.forget()
        self.model_drafter.forget()

    def bind(self, target) -> None:
        self.model_drafter.bind(target)

    def begin(self, prompt, features=None):
        self._decided = None
        self.copier.begin(prompt)
        self.model_drafter.begin(prompt, features)
        self._tokens = prompt

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig) -> Draft:
        if self.copies(tokens):
            copied = self.copier.propose(tokens, k, sampling)
            if len(copied):
                return copied
        return self.model_drafter.propose(tokens, k, sampling)

    def commit(self, tokens: list[int], verdict: Verdict) -> None:
        self.copier.commit(tokens, verdict)
        self.model_drafter.commit(tokens, verdict)
        self._tokens = tokens

    def end(self, tokens: list[int]) -> None:
        self.copier.end(tokens)
        self.model_drafter.end(tokens)

    def draft_policy(self, max_k: int, greedy: bool) -> "PerSourceDraftLength":
        policies = self.__dict__.setdefault("_draft_policies", {})
        key = (max_k, greedy)
        if key not in policies:
            policies[key] = PerSourceDraftLength(
                lambda: self.copies(self._tokens), self.copier.draft_policy(max_k, greedy),
                self.model_drafter.draft_policy(max_k, greedy))
        self._model_policy = policies[key].model  # this generation's
        return policies[key]


LookupFirstDrafter = CopyFirstDrafter  # its name from before suffix decoding could copy too
