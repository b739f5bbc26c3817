"""A tree's node budget, chosen by measured throughput."""


class TreeBudget:
    """A tree's node budget (a DraftLengthPolicy) chosen by what each budget yields: committed
    tokens per second of step, a running mean per candidate budget (powers of two below the
    most, and the most). A tree's nodes do not follow a chain's acceptance by position, so no
    acceptance model is fitted.

    Each candidate is tried once (the largest first), then the best is used, and every
    `probe_every` steps a neighbour of it is tried again, so a change in the text or the
    machine moves the choice.

    Args:
        max_k: the largest budget (the most drafts a step may take).
        probe_every: steps between neighbour probes.
        decay: the running mean's weight on older steps.

    Kept: `rate` {budget: running mean of committed tokens per second}, the step count, and
    `current`, the budget last chosen (what `update` credits).
    """

    reads_tokens = False  # next_k() needs only this object's state
    shares_width = False  # a batch verifies trees as their first chain, at their own K

    def __init__(self, max_k: int, probe_every: int = 8, decay: float = 0.7):
        self.budgets = sorted({b for b in (1, 2, 4, 8, 16, 32, 64) if b < max_k} | {max_k})
        self.probe_every, self.decay = probe_every, decay
        self.rate: dict[int, float] = {}
        self.steps, self.current = 0, self.budgets[-1]

    def best(self) -> int:
        return max(self.rate, key=self.rate.get)

    def keep(self, draft) -> int:
        return len(draft)  # the budget was chosen before

    def draft_reach(self, draft) -> list[float] | None:
        return None

    def next_k(self) -> int:
        self.steps += 1
        untried = [b for b in self.budgets if b not in self.rate]
        if untried:
            self.current = untried[-1]
        elif self.steps % self.probe_every == 0:
            i = self.budgets.index(self.best())
            neighbours = self.budgets[max(i - 1, 0) : i] + self.budgets[i + 1 : i + 2]
            self.current = neighbours[(self.steps // self.probe_every) % len(neighbours)] \
                if neighbours else self.best()
        else:
            self.current = self.best()
        return self.current

    def update(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        """Credit the current budget with (accepted + 1) / seconds; an untimed step, or one
        that drafted nothing, teaches nothing."""
        if seconds is None or seconds <= 0 or drafted == 0:
            return
        rate, old = (accepted + 1) / seconds, self.rate.get(self.current)
        self.rate[self.current] = rate if old is None else \
            self.decay * old + (1 - self.decay) * rate
