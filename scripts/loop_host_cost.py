"""The loop's own host cost per token, with a target that does no tensor work.

`speculative_tokens` over a target whose passes are host lists already "read": what remains is
the loop's Python (drafting calls, bookkeeping, statistics, the adaptive K). CPU seconds by
`time.process_time`, so other processes' load does not count; best of 5 runs of 20,000 tokens.

    .venv/bin/python scripts/loop_host_cost.py
"""

import time

from mlxspec.engine import Draft, Drafter, Pass, PlainDecoding, SpecStats, speculative_tokens
from mlxspec.verdict_layout import HostInts
from mlxspec.sampling import SamplingConfig


class NullTarget:
    """Accepts 0, 1 or 2 of the drafts in turn; computes nothing."""

    context_length = None

    def __init__(self):
        self.passes = 0

    def prefill(self, tokens):
        return None

    def launch(self, pending, draft, sampling, logprobs=None):
        self.passes += 1
        k = len(draft)
        drafts = list(draft.tokens) if k else []
        return Pass(num_draft=k, packed=HostInts([*drafts, min(k, self.passes % 3), 5]),  # verdict_layout's
                    next_token=None, features=None)

    def trim(self, n):
        pass

    def settle(self, verdict):
        pass

    def holds_trees(self):
        return False

    def rollback_room(self):
        return None


class ThreeDrafts(Drafter):
    name, default_num_draft = "three", 3

    def propose(self, tokens, k, sampling):
        return Draft(tokens=[1, 2, 3][:k])


def microseconds_per_token(drafter: Drafter, tokens: int = 20000) -> float:
    start = time.process_time()
    for _ in speculative_tokens(NullTarget(), drafter, [1, 2, 3], sampling=SamplingConfig(),
                                max_tokens=tokens, num_draft=3, stats=SpecStats(),
                                adaptive=True):
        pass
    return (time.process_time() - start) / tokens * 1e6


if __name__ == "__main__":
    for name, make in (("plain", PlainDecoding), ("three drafts a step", ThreeDrafts)):
        best = min(microseconds_per_token(make()) for _ in range(5))
        print(f"{name}: {best:.2f} µs of host CPU per token")
