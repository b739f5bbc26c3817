"""Live metrics in Prometheus' text format (GET /metrics): requests by endpoint and status,
tokens, target passes, drafted and accepted tokens per drafter, τ, the queue, the requests
generating now (rows of the batch) and the most at once, and histograms of time to first token
and tokens per second."""

import threading
from collections import defaultdict

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500)


class Histogram:
    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        self.sum, self.count = self.sum + value, self.count + 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}",
                      f"{name}_count {self.count}"]


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests = defaultdict(int)  # (endpoint, status) -> count
        self.per_drafter = defaultdict(lambda: defaultdict(int))  # drafter -> counter -> value
        self.ttft, self.tps = Histogram(TTFT_BUCKETS), Histogram(TPS_BUCKETS)
        self.queue_length = lambda: 0
        self.batch_rows = lambda: (0, 1)  # (requests generating now, the most at once)

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[endpoint, status] += 1

    def finished(self, outcome) -> None:
        with self._lock:
            counters = self.per_drafter[outcome.drafter]
            counters["generations"] += 1
            counters["prompt_tokens"] += outcome.prompt_tokens
            counters["completion_tokens"] += outcome.completion_tokens
            counters["target_passes"] += outcome.target_passes
            counters["drafted_tokens"] += outcome.drafted
            counters["accepted_tokens"] += outcome.accepted
            self.ttft.observe(outcome.seconds_to_first_token)
            if outcome.completion_tokens:
                self.tps.observe(outcome.tokens_per_second)

    def render(self) -> str:
        rows, max_rows = self.batch_rows()
        with self._lock:
            lines = ["# TYPE mlxspec_requests_total counter"]
            lines += [f'mlxspec_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                      for (e, s), n in sorted(self.requests.items())]
            for name in ("generations", "prompt_tokens", "completion_tokens", "target_passes",
                         "drafted_tokens", "accepted_tokens"):
                lines.append(f"# TYPE mlxspec_{name}_total counter")
                lines += [f'mlxspec_{name}_total{{drafter="{d}"}} {c[name]}'
                          for d, c in sorted(self.per_drafter.items())]
            lines.append("# TYPE mlxspec_tau gauge")  # committed tokens per target pass, so far
            lines += [f'mlxspec_tau{{drafter="{d}"}} '
                      f'{c["completion_tokens"] / c["target_passes"]:.4f}'
                      for d, c in sorted(self.per_drafter.items()) if c["target_passes"]]
            lines += ["# TYPE mlxspec_queue_length gauge",
                      f"mlxspec_queue_length {self.queue_length()}",
                      "# TYPE mlxspec_batch_rows gauge",
                      f"mlxspec_batch_rows {rows}",
                      "# TYPE mlxspec_batch_max_rows gauge",
                      f"mlxspec_batch_max_rows {max_rows}",
                      "# TYPE mlxspec_time_to_first_token_seconds histogram",
                      *self.ttft.lines("mlxspec_time_to_first_token_seconds"),
                      "# TYPE mlxspec_tokens_per_second histogram",
                      *self.tps.lines("mlxspec_tokens_per_second")]
        return "\n".join(lines) + "\n"
