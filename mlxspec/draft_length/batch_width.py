"""How many drafts a batch verifies each step, chosen for the batch as a whole.

A batched pass right-pads every row to the longest row's [pending, drafts], so its cost follows
rows x width, not what each row drafted (StepCost's positions), and a drafter that runs a model
pass per row adds a cost per drafting row whatever the width (StepCost's d). A row's own
adaptive K would draft as if its extra drafts cost what they cost alone, and a batch of rows
each drafting a little pays for the widest. So the loop asks one question per step for the rows
whose policy `shares_width`: which width (0 = plain batched decoding) gives the most committed
tokens per second. Plain decoding is one of the choices and the cost is measured, so speculation
stops where it would make the batch slower than plain batched decoding. Why each rule, and what
it was measured against: docs/draft-length.md ("A batch's shared width").
"""

import weakref

from .curve import FIRST_PRIOR, expected_tokens
from .step_cost import StepCost


class VerifyBudget:
    """The batch's drafts per row each step, from measured steps (a StepCost) and the rows'
    acceptance estimates.

    - Acceptance: each row's own decayed (hits, tries) per position, shrunk toward its
      drafter's, pooled from every row's steps (`observe`, `acceptance`): a new batch leaves
      its prior in a step or two, and a row that copies well still stands out.
    - Cost: a StepCost of (rows x width positions, drafting rows, seconds) steps (`time_step`).
      The batch's first step is plain: the baseline every width is weighed against.
    - Probes: while plain wins, a one-draft step (pass width 2) is still tried after
      `probe_every` plain steps at the least, and only once the plain steps since the last
      probe outweigh what it is expected to lose 1 / `probe_share` times over.

    Args:
        max_k: the most drafts per row any row may take.
        probe_every, probe_share: the probes' spacing (above).
        prior_token_cost, min_token_cost: the StepCost's prior and floor (x a one-position step).
        decay: the acceptance counts' decay per step, and the step times' running mean.

    Kept (for the loop's life, rows leaving with their own counts): the StepCost, the pooled
    and per-row acceptance counts, the plain steps since the last probe, and the plain passes
    queued ahead whose seconds are still being summed (`time_step`).
    """

    def __init__(self, max_k: int, probe_every: int = 8, prior_token_cost: float = 0.1,
                 min_token_cost: float = 0.03, decay: float = 0.7, probe_share: float = 0.02):
        self.max_k, self.probe_every, self.decay = max_k, probe_every, decay
        self.probe_share = probe_share
        self.step_cost = StepCost(prior_token_cost, min_token_cost, decay)
        self.idle_steps = 0
        self.first = True  # the batch's first step is plain: what every width is compared with
        # P(draft j accepted | draft j-1 accepted) as decayed (hits, tries) per position: per
        # drafter from every row's steps, and per row (left with the row).
        self.pooled: dict[str, list[list[float]]] = {}
        self.own: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.chained = (0, 0.0)  # plain passes read since the last step recorded, their seconds

    def acceptance(self, row, drafter: str) -> list[float]:
        """`row`'s estimate per draft position: its own tries, with its drafter's estimate
        counted as two more (itself with a prior as one try: FIRST_PRIOR at the first position,
        the estimate of the position before at a deeper one, as AcceptanceCurve's)."""
        pooled, prior = [], FIRST_PRIOR
        for hits, tries in self._counts(self.pooled, drafter):
            prior = (hits + prior) / (tries + 1)
            pooled.append(prior)
        return [(h + 2 * p) / (n + 2) for (h, n), p in zip(self._counts(self.own, row), pooled)]

    def observe(self, row, drafter: str, drafted: int, accepted: int) -> None:
        """`row` (of `drafter`) had `accepted` of its `drafted` drafts accepted (a position
        counts only if every one before it was)."""
        for counts in (self._counts(self.pooled, drafter), self._counts(self.own, row)):
            for i in range(min(drafted, accepted + 1, len(counts))):
                hits, tries = counts[i]
                counts[i] = [self.decay * hits + (i < accepted), self.decay * tries + 1]

    def _counts(self, table, key) -> list[list[float]]:
        if key not in table:
            table[key] = [[0.0, 0.0] for _ in range(self.max_k)]
        return table[key]

    def record(self, tokens: int, seconds: float, drafting: int = 0) -> None:
        """A step that verified `tokens` positions (rows x width, padding included), `drafting`
        of its rows with drafts, took `seconds`, drafting included."""
        self.step_cost.record(tokens, seconds, drafting)

    def time_step(self, rows: int, num_drafts: list[int], seconds: float, chained: bool) -> None:
        """A pass over `rows` rows, each with num_drafts[i] drafts, was read `seconds` after the
        last one. A plain pass queued ahead is launched before the current one is read, and a
        launch may compute (MLX on a CPU), so a chain of them (`chained`: the next is queued
        already) is timed as one: its seconds shared among its passes (all plain, over the same
        rows), recorded when the chain ends."""
        passes, total = self.chained
        passes, total = passes + 1, total + seconds
        if chained:
            self.chained = (passes, total)
            return
        self.chained = (0, 0.0)
        self.record(rows * (1 + max(num_drafts)), total / passes,
                    sum(1 for k in num_drafts if k))

    def cost(self) -> tuple[float, float, float]:
        """(a, b, d): a step verifying P positions with D drafting rows costs a + b·P + d·D
        seconds (StepCost.fit)."""
        return self.step_cost.fit()

    def best(self, acceptance: list[list[float]], caps: list[int]) -> int:
        """The drafts per row (the pass's width - 1) with the most expected tokens per second:
        `acceptance[i]` is row i's estimated P(draft j accepted | draft j-1 accepted) per
        position, `caps[i]` the most it may draft now (its budget, the context, what its drafter
        can propose or proposed)."""
        rates = self._rates(acceptance, caps)
        return max(range(len(rates)), key=lambda k: (rates[k], -k))

    def width(self, acceptance: list[list[float]], caps: list[int]) -> int:
        """`best`, or a width-2 probe when plain decoding has won long enough (see the class's
        docstring); counts the step."""
        rates = self._rates(acceptance, caps)
        if len(rates) < 2:
            return 0  # no row can draft: nothing to choose
        if self.first and not self.step_cost.seconds:
            self.first = False
            return 0
        k = max(range(len(rates)), key=lambda k: (rates[k], -k))
        if k:
            self.idle_steps = 0
            return k
        self.idle_steps += 1
        if self.idle_steps >= self.probe_every and \
                self._probe_loss(acceptance, caps) <= self.probe_share * self.idle_steps:
            self.idle_steps = 0
            return 1
        return 0

    def plain_ahead(self, acceptance: list[list[float]], caps: list[int]) -> bool:
        """Whether the next step is plain whatever drafts the rows find (each drafts at most
        caps[i]), so it may be queued before they are known: then it counts as a plain step."""
        if self.first and not self.step_cost.seconds:
            return False  # the first step is chosen (plain) when it is launched
        if self.best(acceptance, caps) or self.idle_steps + 1 >= self.probe_every and \
                self._probe_loss(acceptance, caps) <= self.probe_share * (self.idle_steps + 1):
            return False
        if max(caps, default=0) > 0:
            self.idle_steps += 1
        return True

    def step_seconds(self, rows: int, k: int, drafting: int,
                     fitted: tuple[float, float, float] | None = None) -> float:
        """The modelled seconds of a step of `rows` rows, `drafting` of them drafting up to k."""
        return self.step_cost.step_seconds(rows * (k + 1), drafting, fitted)

    def _rates(self, acceptance: list[list[float]], caps: list[int]) -> list[float]:
        """Expected tokens per second at each width 0..min(max_k, largest cap)."""
        rows, fitted = len(acceptance), self.cost()
        reach = [expected_tokens(c, cap) for c, cap in zip(acceptance, caps)]
        rates = []
        for k in range(min(self.max_k, max(caps, default=0)) + 1):
            tokens = sum(r[min(k, len(r) - 1)] for r in reach)
            drafting = sum(1 for cap in caps if min(k, cap) > 0)
            rates.append(tokens / self.step_seconds(rows, k, drafting, fitted))
        return rates

    def _probe_loss(self, acceptance: list[list[float]], caps: list[int]) -> float:
        """What a width-2 step is expected to lose against plain decoding, in plain steps:
        its extra time less the time plain decoding would take for its extra tokens."""
        rows, fitted = len(acceptance), self.cost()
        plain = self.step_seconds(rows, 0, 0, fitted)
        drafting = sum(1 for cap in caps if cap > 0)
        tokens = sum(expected_tokens(c, cap)[min(1, cap)] for c, cap in zip(acceptance, caps))
        return max(self.step_seconds(rows, 1, drafting, fitted) / plain - tokens / rows, 0.0)
