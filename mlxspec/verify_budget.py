"""How many drafts a batch verifies each step, chosen for the batch as a whole.

A batched pass right-pads every row to the longest row's [pending, drafts], so its cost follows
rows x width, not what each row drafted: on a CPU (or a GPU past its free width) a pass of B rows
and width S costs about a + b·B·S, and drafting adds to it. A row's own adaptive K would draft
as if its extra drafts cost what they cost alone, and a batch of rows each drafting a little
pays for the widest. So the loop asks one question per step: which width S (1 = plain batched
decoding) gives the most committed tokens per second, with each row's expected tokens at that
width from its own live acceptance per position (its AdaptiveDraftLength's estimates) and the
cost from a line fitted to the batch's measured steps. Plain decoding is one of the choices and
the model is measured, so speculation stops where it would make the batch slower than plain
batched decoding; while plain wins, one width-2 step is still tried every `probe_every` steps,
so drafts that become good again are noticed.
"""


class VerifyBudget:
    """The batch's pass width each step, from measured (rows x width, seconds) pairs and each
    row's acceptance estimates."""

    def __init__(self, max_k: int, probe_every: int = 8, prior_token_cost: float = 0.1,
                 min_token_cost: float = 0.03, decay: float = 0.7):
        self.max_k, self.probe_every, self.decay = max_k, probe_every, decay
        self.prior_token_cost = prior_token_cost  # a token's verify cost, x a one-row plain step
        # Verifying is never free, whatever timing noise says: a position costs at least this
        # much of a pass's fixed part (as AdaptiveDraftLength's floor for one sequence).
        self.min_token_cost = min_token_cost
        self.seconds: dict[int, float] = {}  # tokens in a pass (rows x width) -> running mean
        self.idle_steps = 0

    def record(self, tokens: int, seconds: float) -> None:
        """A step that verified `tokens` positions (rows x width, padding included) took
        `seconds`, drafting included."""
        if seconds <= 0:
            return
        old = self.seconds.get(tokens)
        self.seconds[tokens] = seconds if old is None else \
            self.decay * old + (1 - self.decay) * seconds

    def cost(self) -> tuple[float, float]:
        """(intercept, seconds per verified position) of a line through the measured steps;
        with fewer than two sizes measured, the one known point and a prior slope."""
        points = sorted(self.seconds.items())
        if len(points) >= 2:
            n = len(points)
            mean_x = sum(x for x, _ in points) / n
            mean_y = sum(y for _, y in points) / n
            var = sum((x - mean_x) ** 2 for x, _ in points)
            slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var
            intercept = max(mean_y - max(slope, 0.0) * mean_x, 1e-9)
        elif points:
            (x, y), = points
            slope = self.prior_token_cost * y / x
            intercept = max(y - slope * x, 1e-9)
        else:
            intercept, slope = 1.0, self.prior_token_cost
        return intercept, max(slope, self.min_token_cost * intercept)

    def width(self, acceptance: list[list[float]], caps: list[int]) -> int:
        """The drafts per row this step (the pass's width - 1): `acceptance[i]` is row i's
        estimated P(draft j accepted | draft j-1 accepted) per position, `caps[i]` the most it
        may draft now (its budget, the context, what its drafter can propose)."""
        rows = len(acceptance)
        intercept, slope = self.cost()
        reach = [_expected(c, cap) for c, cap in zip(acceptance, caps)]
        best_k, best_rate = 0, rows / (intercept + slope * rows)
        for k in range(1, min(self.max_k, max(caps, default=0)) + 1):
            tokens = sum(r[min(k, len(r) - 1)] for r in reach)
            rate = tokens / (intercept + slope * rows * (k + 1))
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0 and max(caps, default=0) > 0:
            self.idle_steps += 1
            if self.idle_steps >= self.probe_every:
                self.idle_steps, best_k = 0, 1
        return best_k


def _expected(conditional: list[float], cap: int) -> list[float]:
    """Expected committed tokens with 0..cap drafts: 1 + the chance of reaching each draft."""
    expected, reach, total = [1.0], 1.0, 1.0
    for rate in conditional[:cap]:
        reach *= rate
        total += reach
        expected.append(total)
    return expected
