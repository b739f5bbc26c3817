"""The speculative decoding loop, written once for every drafter and backend.

Each step a drafter proposes up to K tokens, the target scores [pending token, drafts] in one
forward pass, the backend's acceptance rule keeps a prefix of the drafts and adds the target's own
token, and every cache is cut back to the committed tokens. Plain decoding is the same loop with no
drafts, so "spec output == target-only output" compares one code path with itself minus the drafts.

Only control flow lives here. Tensor math (forward passes, acceptance, cache trimming) lives in a
backend's `Target`; drafters see host token lists and backend arrays.
"""

import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, Sequence

from .sampling import SamplingConfig


@dataclass
class Draft:
    """Up to K proposed tokens. `probs` is the drafter's distribution p per token, (K, V); None
    means the drafter is deterministic (one-hot p)."""

    tokens: Any  # list[int] on the host, or a backend array of shape (K,)
    probs: Any = None

    def __len__(self):
        return len(self.tokens) if isinstance(self.tokens, list) else int(self.tokens.shape[0])


EMPTY_DRAFT = Draft(tokens=[])


@dataclass
class Verdict:
    """The outcome of one verification pass, on the host."""

    draft_tokens: list[int]
    accepted: int
    next_token: int
    features: Any = None  # target hidden states of the newly committed positions, if asked for

    @property
    def committed(self) -> list[int]:
        return self.draft_tokens[: self.accepted] + [self.next_token]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share: what a cache built for `a` can keep for `b`."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Target(Protocol):
    """What the loop needs from a backend's target model."""

    context_length: int | None

    def prefill(self, tokens: Sequence[int]) -> Any: ...

    def verify(self, pending: int, draft: Draft, sampling: SamplingConfig) -> Verdict: ...

    def trim(self, n: int) -> None: ...

    def can_trim(self) -> bool: ...


class Drafter:
    """A source of drafts. Subclasses override `propose`; the rest is optional bookkeeping."""

    name = "none"
    # Target layers whose outputs the drafter conditions on (DFlash, EAGLE); empty for most.
    capture_layers: tuple[int, ...] = ()
    default_num_draft = 1

    def begin(self, prompt: list[int], features: Any = None) -> None:
        """A new sequence starts: `prompt` is in the target cache except its last token."""

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig) -> Draft:
        """Propose up to k tokens to follow `tokens` (all committed tokens, pending last)."""
        return EMPTY_DRAFT

    def commit(self, tokens: list[int], verdict: Verdict) -> None:
        """`verdict` was appended; `tokens` is the new committed list (pending last)."""

    def draft_policy(self, max_k: int, greedy: bool) -> "AdaptiveDraftLength":
        """The adaptive-K policy for this drafter, kept across generations: acceptance per
        position and step timings carry over from one prompt (or chat turn) to the next, so a
        short generation does not pay the exploration again (greedy and sampled apart)."""
        policies = self.__dict__.setdefault("_draft_policies", {})
        key = (max_k, greedy)
        if key not in policies:
            policies[key] = AdaptiveDraftLength(max_k)
        return policies[key]


@dataclass
class SpecStats:
    target_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    plain_fallback_steps: int = 0  # steps run without drafts because a cache could not be trimmed

    def record(self, num_drafted: int, num_accepted: int, num_emitted: int) -> None:
        self.target_passes += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.generated += num_emitted
        grow = num_drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < num_accepted

    @property
    def tau(self) -> float:
        """Mean tokens committed per target forward pass (1.0 for plain decoding)."""
        return self.generated / self.target_passes if self.target_passes else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d for a, d in zip(self.accepted_per_position, self.drafted_per_position)]


class AdaptiveDraftLength:
    """Choose K each step to maximise expected tokens per second, from live measurements.

    Two running estimates: P(draft i accepted | draft i-1 accepted) per position, and the wall
    time of a step as a function of K (a line through per-K averages; on a CPU verifying 9 tokens
    costs far more than 1, on a GPU nearly the same). K = argmax (1 + sum of reach probabilities)
    / time(K), so useless drafts stop costing verify work on any machine. When K = 0 wins, one
    draft is still tried every `probe_every` steps to notice when drafts become good again.
    """

    def __init__(self, max_k: int, decay: float = 0.7, probe_every: int = 8,
                 prior_token_cost: float = 0.1, min_token_cost: float = 0.03):
        self.max_k, self.decay, self.probe_every = max_k, decay, probe_every
        self.prior_token_cost = prior_token_cost  # extra verify time per draft, x a plain step
        self.min_token_cost = min_token_cost  # verifying is never free, whatever timing noise says
        # A middling prior: a few drafts at first, more as soon as they are accepted.
        self.conditional = [0.6] * max_k
        self.step_time: dict[int, float] = {}  # K -> running mean of step seconds
        self.idle_steps = 0

    def _time_model(self) -> tuple[float, float, float]:
        """(plain step time, drafting step intercept, seconds per draft token)."""
        drafted = sorted((k, t) for k, t in self.step_time.items() if k > 0)
        plain = self.step_time.get(0)
        if len(drafted) >= 2:
            n = len(drafted)
            mean_k = sum(k for k, _ in drafted) / n
            mean_t = sum(t for _, t in drafted) / n
            var = sum((k - mean_k) ** 2 for k, _ in drafted)
            slope = max(sum((k - mean_k) * (t - mean_t) for k, t in drafted) / var, 0.0)
            intercept = mean_t - slope * mean_k
        elif drafted:
            (k1, t1), = drafted
            slope = self.prior_token_cost * (plain or t1)
            intercept = t1 - slope * k1
        else:
            plain = plain or 1.0
            slope, intercept = self.prior_token_cost * plain, plain
        plain = plain if plain is not None else intercept
        return plain, max(intercept, 1e-6), max(slope, self.min_token_cost * plain)

    def next_k(self) -> int:
        plain, intercept, slope = self._time_model()
        best_k, best_rate = 0, 1.0 / plain
        expected, reach = 1.0, 1.0
        for k, rate in enumerate(self.conditional, start=1):
            reach *= rate
            expected += reach
            speed = expected / (intercept + slope * k)
            if speed > best_rate:
                best_k, best_rate = k, speed
        if best_k == 0:
            self.idle_steps += 1
            if self.idle_steps >= self.probe_every:
                self.idle_steps, best_k = 0, 1
        return best_k

    def update(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        # Position i was "reached" if all before it were accepted; it counts only then.
        for i in range(min(drafted, accepted + 1)):
            hit = 1.0 if i < accepted else 0.0
            self.conditional[i] = self.decay * self.conditional[i] + (1 - self.decay) * hit
        if seconds is not None:
            old = self.step_time.get(drafted)
            self.step_time[drafted] = seconds if old is None else 0.7 * old + 0.3 * seconds


def speculative_tokens(
    target: Target,
    drafter: Drafter,
    prompt: Sequence[int],
    *,
    sampling: SamplingConfig,
    max_tokens: int,
    num_draft: int,
    stats: SpecStats,
    adaptive: "bool | AdaptiveDraftLength" = False,
) -> Iterator[tuple[int, bool]]:
    """Yield (token, from_draft) until max_tokens are produced; the caller handles stop tokens.

    The target cache always holds every committed token but the last ("pending") one, so each
    verification pass starts from the pending token and yields at least one new token.
    """
    if num_draft < 1:
        raise ValueError(f"num_draft must be >= 1, got {num_draft}")
    tokens = list(prompt)
    drafter.begin(tokens, target.prefill(tokens))
    if isinstance(adaptive, AdaptiveDraftLength):
        policy = adaptive
    else:
        policy = drafter.draft_policy(num_draft, sampling.temp == 0) if adaptive else None
    produced = 0
    while produced < max_tokens:
        step_start = time.perf_counter()
        # Drafts past max_tokens or the context window would be wasted work.
        budget = min(policy.next_k() if policy else num_draft, max_tokens - produced - 1)
        if target.context_length is not None:
            budget = min(budget, target.context_length - len(tokens))
        draft = drafter.propose(tokens, budget, sampling) if budget > 0 else EMPTY_DRAFT
        if len(draft) and not target.can_trim():
            stats.plain_fallback_steps += 1
            draft = EMPTY_DRAFT
        verdict = target.verify(tokens[-1], draft, sampling)
        target.trim(len(verdict.draft_tokens) - verdict.accepted)
        new = verdict.committed[: max_tokens - produced]
        tokens += verdict.committed
        drafter.commit(tokens, verdict)
        stats.record(len(verdict.draft_tokens), verdict.accepted, len(new))
        if policy:
            seconds = time.perf_counter() - step_start
            policy.update(len(verdict.draft_tokens), verdict.accepted, seconds)
        for i, token in enumerate(new):
            yield token, i < verdict.accepted
        produced += len(new)
