"""The one time model of a verification step, for one row and for a batch.

A step's seconds are modelled as

    a + b·positions + d·drafting_rows

`positions`: every [pending, drafts] position the pass verified, padding included (one row at K
drafts: K + 1; a batch of R rows at width S: R·S). `drafting_rows`: rows that drafted this step
(one row: 1 if K > 0). For one row the plane is a line in K:

    plain step (K = 0)            a + b
    drafting step at K > 0        (a + b + d) + b·K      (intercept a + b + d, slope b)

so the adaptive K (AdaptiveDraftLength.time_line) and the batch's width (VerifyBudget) read the
same fit of the same kind of measurement. How it came to be one model, and what changed in the
numbers when the two were merged: docs/draft-length.md ("One time model").
"""


class StepCost:
    """A step's seconds as a + b·positions + d·drafting_rows, fitted to measured steps.

    Args:
        prior_token_cost: while the data cannot tell the slope b (steps of one size only), a
            position costs this x a one-position step (a + b: one row, plain).
        min_token_cost: the floor of b, x a one-position step: verifying is never free,
            whatever timing noise says. A floored b keeps a + b (the line turns about one
            position).
        decay: each (positions, drafting rows) point is a running mean of its steps' seconds,
            a new step weighing 1 - decay.
        weight_cap: in the fit a point weighs by how many steps were timed at it, up to this,
            so one noisy probe does not tilt the fit as much as a size timed every step.

    Kept: `seconds` {(positions, drafting rows): running mean of seconds} and `count` {same key:
    steps timed}, only through `record`. The fit constrains b >= 0 and d >= 0 (a drafting step
    never costs less than the plain step of the same positions) and a + b > 0.
    """

    def __init__(self, prior_token_cost: float = 0.1, min_token_cost: float = 0.03,
                 decay: float = 0.7, weight_cap: int = 8):
        self.prior_token_cost, self.min_token_cost = prior_token_cost, min_token_cost
        self.decay, self.weight_cap = decay, weight_cap
        self.seconds: dict[tuple[int, int], float] = {}
        self.count: dict[tuple[int, int], int] = {}

    def record(self, positions: int, seconds: float | None, drafting: int = 0) -> None:
        """A step verified `positions` positions, `drafting` of its rows with drafts, and took
        `seconds` (drafting included). None or a clock that did not move measured nothing."""
        if seconds is None or seconds <= 0:
            return
        key = (positions, drafting)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else \
            self.decay * old + (1 - self.decay) * seconds
        self.count[key] = self.count.get(key, 0) + 1

    def fit(self) -> tuple[float, float, float]:
        """(a, b, d) from the measured steps.

        - plain steps and drafted ones, three kinds of step (three (positions, drafting) points)
          told apart: the weighted least-squares plane, with b >= 0 and d >= 0 (where the free
          fit breaks one, the best fit with it at 0);
        - plain and drafted steps not told apart: a and b from the plain steps (one size: the
          prior slope through it), d what the drafted ones cost beyond per drafting row, so a
          drafted step's cost is the one measured; where they cost less than that, no d and a
          line through all of them;
        - one kind of step: a line through positions (d = 0); one size: the prior slope through
          it; nothing measured: a one-position step of 1 second.
        Then b's floor (min_token_cost).
        """
        points = [(p, z, y, min(self.count.get((p, z), 1), self.weight_cap))
                  for (p, z), y in self.seconds.items()]
        plain = [point for point in points if point[1] == 0]
        drafted = [point for point in points if point[1] > 0]
        fitted = _plane(points) if plain and drafted else None
        if fitted is None and plain and drafted:
            a, b = self._line(plain)
            d = sum(w * (y - a - b * p) / z for p, z, y, w in drafted) / \
                sum(w for *_, w in drafted)
            fitted = (a, b, d) if d >= 0 else (*self._line(points), 0.0)
        if fitted is None:
            fitted = (*self._line(points), 0.0)
        a, b, d = fitted
        one = a + b  # a one-position plain step
        if b < self.min_token_cost * one:
            b = self.min_token_cost * one
            a = one - b
        return a, b, d

    def step_seconds(self, positions: int, drafting: int,
                     fitted: tuple[float, float, float] | None = None) -> float:
        """The modelled seconds of a step (`fitted`: a fit already made, else `fit()`)."""
        a, b, d = fitted or self.fit()
        return a + b * positions + d * drafting

    def _line(self, points) -> tuple[float, float]:
        """(a, b) of the weighted least-squares line through (positions, seconds), b >= 0; one
        size of step, or a line whose one-position step is not positive: the prior slope
        through the point of fewest positions; no points: a one-position step of 1 second."""
        if len({p for p, *_ in points}) >= 2:
            n = sum(w for *_, w in points)
            mean_p = sum(w * p for p, _, _, w in points) / n
            mean_y = sum(w * y for _, _, y, w in points) / n
            var = sum(w * (p - mean_p) ** 2 for p, _, _, w in points)
            b = max(sum(w * (p - mean_p) * (y - mean_y) for p, _, y, w in points) / var, 0.0)
            a = mean_y - b * mean_p
            if a + b > 0:
                return a, b
        one = 1.0
        if points:
            p, _, y, _ = min(points)
            one = y / (1 + self.prior_token_cost * (p - 1))
        return one * (1 - self.prior_token_cost), one * self.prior_token_cost


def _plane(points) -> tuple[float, float, float] | None:
    """(a, b, d) of the weighted least-squares y = a + b·p + d·z with b, d >= 0 and a + b > 0,
    or None unless three (p, z) points are measured and tell a, b and d apart (with every row
    drafting, z follows p's rows)."""
    if len({(p, z) for p, z, *_ in points}) < 3:
        return None
    full = _least_squares(points, (0, 1, 2))
    if full is None:
        return None
    if _feasible(full):
        return full
    best, best_error = None, 0.0
    for free in ((0, 2), (0, 1), (0,)):  # b = 0, d = 0, both: the best fit on the boundary
        solution = _least_squares(points, free)
        if solution is None or not _feasible(solution):
            continue
        a, b, d = solution
        error = sum(w * (y - a - b * p - d * z) ** 2 for p, z, y, w in points)
        if best is None or error < best_error:
            best, best_error = solution, error
    return best


def _feasible(solution: tuple[float, float, float]) -> bool:
    a, b, d = solution
    return b >= 0 and d >= 0 and a + b > 0


def _least_squares(points, free: tuple[int, ...]) -> tuple[float, float, float] | None:
    """The weighted least-squares coefficients of [1, p, z] over the columns in `free` (the
    others 0), by the normal equations; None where they are (nearly) singular."""
    rows = [((1.0, float(p), float(z)), y, w) for p, z, y, w in points]
    m = [[sum(w * x[i] * x[j] for x, _, w in rows) for j in free] for i in free]
    r = [sum(w * x[i] * y for x, y, w in rows) for i in free]
    det = _det(m)
    scale = 1.0
    for i in range(len(free)):
        scale *= m[i][i]
    if abs(det) < 1e-9 * scale:
        return None
    solution = [0.0, 0.0, 0.0]
    for i, column in enumerate(free):  # Cramer's rule
        replaced = [row[:i] + [r[j]] + row[i + 1 :] for j, row in enumerate(m)]
        solution[column] = _det(replaced) / det
    return solution[0], solution[1], solution[2]


def _det(m: list[list[float]]) -> float:
    if len(m) == 1:
        return m[0][0]
    if len(m) == 2:
        return m[0][0] * m[1][1] - m[0][1] * m[1][0]
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))
