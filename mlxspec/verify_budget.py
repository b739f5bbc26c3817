"""How many drafts a batch verifies each step, chosen for the batch as a whole.

A batched pass right-pads every row to the longest row's [pending, drafts], so its cost follows
rows x width, not what each row drafted: on a CPU (or a GPU past its free width) a pass of B rows
and width S costs about a + b·B·S, and a drafter that runs a model pass per row (DFlash) adds
d per drafting row, whatever the width. A row's own adaptive K would draft as if its extra
drafts cost what they cost alone, and a batch of rows each drafting a little pays for the
widest. So the loop asks one question per step: which width S (1 = plain batched decoding)
gives the most committed tokens per second, with each row's expected tokens at that width from
its own live acceptance per position shrunk toward its drafter's, learnt from every row's steps
(`observe`: a new batch leaves its prior in a step or two, not a row's own dozen, and a row that
copies well still stands out from one that does not), capped by what the row may
draft or (prompt lookup) found, and the cost from
a + b·positions + d·drafting rows fitted to the batch's measured steps (the first step is
plain, the baseline every width is weighed against). Plain decoding is one of the choices and
the model is measured, so speculation stops where it would make the batch
slower than plain batched decoding. While plain wins, one width-2 step is still tried now and
then, so drafts that become good again are noticed: after `probe_every` plain steps at the
least, and only once the plain steps since the last probe outweigh what the probe is expected
to lose `1 / probe_share` times over (a probe that costs a third of a step waits ~17 steps).
"""

import weakref

from .acceptance import FIRST_PRIOR


class VerifyBudget:
    """The batch's pass width each step, from measured (positions, drafting rows, seconds)
    steps and the rows' acceptance estimates."""

    def __init__(self, max_k: int, probe_every: int = 8, prior_token_cost: float = 0.1,
                 min_token_cost: float = 0.03, decay: float = 0.7, probe_share: float = 0.02):
        self.max_k, self.probe_every, self.decay = max_k, probe_every, decay
        self.prior_token_cost = prior_token_cost  # a token's verify cost, x a pass's fixed part
        # Verifying is never free, whatever timing noise says: a position costs at least this
        # much of a pass's fixed part (as AdaptiveDraftLength's floor for one sequence).
        self.min_token_cost = min_token_cost
        self.probe_share = probe_share  # the most of the plain steps' time probes may lose
        # (positions in a pass = rows x width, rows that drafted) -> running mean of seconds
        self.seconds: dict[tuple[int, int], float] = {}
        self.idle_steps = 0
        self.first = True  # the batch's first step is plain: what every width is compared with
        # P(draft j accepted | draft j-1 accepted) as decayed (hits, tries) per position: per
        # drafter from every row's steps, and per row (left with the row).
        self.pooled: dict[str, list[list[float]]] = {}
        self.own: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def acceptance(self, row, drafter: str) -> list[float]:
        """`row`'s estimate per draft position: its own tries, with its drafter's estimate
        counted as two more (itself with a prior as one try: FIRST_PRIOR at the first position,
        the estimate of the position before at a deeper one, as acceptance.py says why)."""
        pooled, prior = [], FIRST_PRIOR
        for hits, tries in self._counts(self.pooled, drafter):
            prior = (hits + prior) / (tries + 1)
            pooled.append(prior)
        return [(h + 2 * p) / (n + 2) for (h, n), p in zip(self._counts(self.own, row), pooled)]

    def observe(self, row, drafter: str, drafted: int, accepted: int) -> None:
        """`row` (of `drafter`) had `accepted` of its `drafted` drafts accepted (as
        AdaptiveDraftLength.update: a position counts only if every one before it was)."""
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
        if seconds <= 0:
            return
        key = (tokens, drafting)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else \
            self.decay * old + (1 - self.decay) * seconds

    def cost(self) -> tuple[float, float, float]:
        """(a, b, d): a step verifying P positions with D drafting rows costs a + b·P + d·D
        seconds. Fitted to the measured steps once plain and drafted steps, and three kinds of
        step, are known. Before that: with plain and drafted steps, a and b from the plain
        ones (one size: the prior slope) and d what the drafted ones cost beyond, so a probe's
        cost is the one measured; with one kind only, a line through positions (d = 0)."""
        points = [(p, d, y) for (p, d), y in self.seconds.items()]
        fitted = _fit_plane(points)
        if fitted is not None:
            a, b, d = fitted
        elif any(z == 0 for _, z, _ in points) and any(z > 0 for _, z, _ in points):
            a, b = _fit_line([(p, y) for p, z, y in points if z == 0], self.prior_token_cost)
            drafted = [(y - a - max(b, 0.0) * p) / z for p, z, y in points if z > 0]
            d = sum(drafted) / len(drafted)
        else:
            a, b = _fit_line([(p, y) for p, _, y in points], self.prior_token_cost)
            d = 0.0
        return a, max(b, self.min_token_cost * a), max(d, 0.0)

    def best(self, acceptance: list[list[float]], caps: list[int]) -> int:
        """The drafts per row (the pass's width - 1) with the most expected tokens per second:
        `acceptance[i]` is row i's estimated P(draft j accepted | draft j-1 accepted) per
        position, `caps[i]` the most it may draft now (its budget, the context, what its drafter
        can propose or proposed)."""
        rates = self._rates(acceptance, caps)
        return max(range(len(rates)), key=lambda k: (rates[k], -k))

    def width(self, acceptance: list[list[float]], caps: list[int]) -> int:
        """`best`, or a width-2 probe when plain decoding has won long enough (see the module's
        docstring); counts the step."""
        rates = self._rates(acceptance, caps)
        if len(rates) < 2:
            return 0  # no row can draft: nothing to choose
        if self.first and not self.seconds:
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
        if self.first and not self.seconds:
            return False  # the first step is chosen (plain) when it is launched
        if self.best(acceptance, caps) or self.idle_steps + 1 >= self.probe_every and \
                self._probe_loss(acceptance, caps) <= self.probe_share * (self.idle_steps + 1):
            return False
        if max(caps, default=0) > 0:
            self.idle_steps += 1
        return True

    def step_seconds(self, rows: int, k: int, drafting: int) -> float:
        """The modelled seconds of a step of `rows` rows, `drafting` of them drafting up to k."""
        a, b, d = self.cost()
        return a + b * rows * (k + 1) + d * drafting

    def _rates(self, acceptance: list[list[float]], caps: list[int]) -> list[float]:
        """Expected tokens per second at each width 0..min(max_k, largest cap)."""
        rows = len(acceptance)
        reach = [_expected(c, cap) for c, cap in zip(acceptance, caps)]
        rates = []
        for k in range(min(self.max_k, max(caps, default=0)) + 1):
            tokens = sum(r[min(k, len(r) - 1)] for r in reach)
            drafting = sum(1 for cap in caps if min(k, cap) > 0)
            rates.append(tokens / self.step_seconds(rows, k, drafting))
        return rates

    def _probe_loss(self, acceptance: list[list[float]], caps: list[int]) -> float:
        """What a width-2 step is expected to lose against plain decoding, in plain steps:
        its extra time less the time plain decoding would take for its extra tokens."""
        rows = len(acceptance)
        plain = self.step_seconds(rows, 0, 0)
        drafting = sum(1 for cap in caps if cap > 0)
        tokens = sum(_expected(c, cap)[min(1, cap)] for c, cap in zip(acceptance, caps))
        return max(self.step_seconds(rows, 1, drafting) / plain - tokens / rows, 0.0)


def _fit_line(points: list[tuple[float, float]], prior_slope: float) -> tuple[float, float]:
    """(intercept, slope) of a least-squares line; one point: a prior slope (x its intercept)
    through it; none: (1, prior_slope)."""
    if len({x for x, _ in points}) >= 2:
        n = len(points)
        mean_x = sum(x for x, _ in points) / n
        mean_y = sum(y for _, y in points) / n
        var = sum((x - mean_x) ** 2 for x, _ in points)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var
        return max(mean_y - max(slope, 0.0) * mean_x, 1e-9), slope
    if points:
        x, y = points[0]
        intercept = y / (1 + prior_slope * x)
        return intercept, prior_slope * intercept
    return 1.0, prior_slope


def _fit_plane(points: list[tuple[float, float, float]]) -> tuple[float, float, float] | None:
    """(a, b, d) of the least-squares y = a + b·x + d·z, or None unless plain steps (z = 0) and
    drafted ones are both measured and x varies among them (else a, b and d are not told
    apart: with every row drafting, z follows x's rows)."""
    plain = [p for p in points if p[1] == 0]
    drafted = [p for p in points if p[1] > 0]
    if not plain or not drafted or len(points) < 3 or len({(x, z) for x, z, _ in points}) < 3:
        return None
    # Normal equations of [1, x, z] · (a, b, d) = y.
    cols = [[1.0] * len(points), [p[0] for p in points], [p[1] for p in points]]
    ys = [p[2] for p in points]
    m = [[sum(u * v for u, v in zip(ci, cj)) for cj in cols] for ci in cols]
    r = [sum(u * y for u, y in zip(ci, ys)) for ci in cols]
    det = _det3(m)
    if abs(det) < 1e-9 * m[0][0] * m[1][1] * m[2][2]:
        return None
    solution = []
    for i in range(3):
        mi = [row[:i] + [r[j]] + row[i + 1 :] for j, row in enumerate(m)]
        solution.append(_det3(mi) / det)
    a, b, d = solution
    return (a, b, d) if a > 0 else None


def _det3(m: list[list[float]]) -> float:
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))


def conditional_from_reach(reach: list[float]) -> list[float]:
    """P(draft j accepted | draft j-1 accepted) from the chance of reaching each draft."""
    conditional, before = [], 1.0
    for r in reach:
        conditional.append(min(r / before, 1.0) if before > 0 else 0.0)
        before = r
    return conditional


def _expected(conditional: list[float], cap: int) -> list[float]:
    """Expected committed tokens with 0..cap drafts: 1 + the chance of reaching each draft."""
    expected, reach, total = [1.0], 1.0, 1.0
    for rate in conditional[:cap]:
        reach *= rate
        total += reach
        expected.append(total)
    return expected
