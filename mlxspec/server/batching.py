"""Concurrent requests as rows of one batch (issue #39): continuous batching over the loop.

One thread owns one engine.Loop over the backend's batched target (MLXBatchTarget). A request
joins as a row at the next step boundary (up to `max_batch` rows; the rest wait in the Worker's
bounded FIFO) and leaves at its stop token, its max_tokens, a stop string or its client's
disconnect, while the other rows run on. Each row has its own drafter fork, detokenizer and
Answer, so each request gets the Deltas and Outcome the one-at-a-time Worker would give it
(greedy: the same text).

Prompt caches are kept as the Worker keeps them, in a pool of the same bound: a request starts
from a copy of the longest prefix of its prompt any kept cache holds (its conversation's last
turn, a shared system prompt), so only the rest is prefilled, and its row's caches are kept when
it leaves. A row whose drafter reads the prompt's target features (DFlash, EAGLE-3) starts only
from a cache that kept them too: such a row leaves its prompt's caches and features (its
reply's features went to its drafter), so the same prompt again, or a longer one starting with
it, prefills only the rest.

One thing does not carry over: rows draw from one shared random stream, so a request with a
seed runs as a batch of its own: it waits for the running rows to finish, no row joins it, and
batching resumes after it.
"""

import time

from ..batch import keep_row, kept_start, model_refusal, request_row
from ..engine import Loop, Row
from ..generate import Responses, Session, _as_wrapper, check_request
from ..generation_lock import clear_streams_at_thread_exit, generation_lock
from .worker import NOTHING, Answer, Job, Outcome, Worker, report_failure


def batch_refusal(model, drafters: dict) -> str | None:
    """Why requests to `model` with these drafters cannot be rows of one batch (None: they
    can); the model's own refusal (a sliding window...) comes when its batch target is built."""
    refusal = model_refusal(model)
    if refusal is not None:
        return refusal
    for name, drafter in drafters.items():
        if drafter.batch_refusal is not None:
            return f"the {name} drafter cannot draft for a row: {drafter.batch_refusal}"
    if len({d.capture_layers for d in drafters.values() if d.capture_layers}) > 1:
        return "the drafters read different target layers"  # one batch target captures one set
    return None


class RowReply:
    """One request as a row of the batch: the row's tokens become the responses stream_request
    would have streamed for it (its own detokenizer: mlx-lm hands out a fresh copy of its
    streaming detokenizer on each access of `tokenizer.detokenizer`), and those become Deltas
    and an Outcome exactly as in Worker._generate."""

    def __init__(self, job: Job, row: Row, tokenizer, eos: frozenset, peak_memory_gb,
                 cached: int = 0):
        self.job, self.row, self.eos, self.cached = job, row, eos, cached
        self.answer = Answer(job.request, tokenizer)
        self.detokenizer = tokenizer.detokenizer
        session = Session(row.drafter, row.max_k, row.max_k, target=None, kept=None)
        self.respond = Responses(self.detokenizer, len(row.tokens), row.stats, session,
                                 peak_memory_gb)
        self.start = time.perf_counter()
        self.first: float | None = None  # seconds from joining to the first token
        self.n, self.produced, self.last, self.finish = 0, 0, None, "length"

    def take(self, token: int, from_draft: bool, scores: list) -> bool:
        """The row's next token (scores: [] or [logprob, top_logprobs]); True when the request
        is over (stream_request's loop, one token at a time)."""
        if self.first is None:
            self.first = time.perf_counter() - self.start
            self.respond.first_token()
        if token in self.eos:
            return self._last(token, from_draft, scores, "stop")
        self.n += 1
        self.detokenizer.add_token(token)
        if self.n == self.row.max_tokens:
            return self._last(token, from_draft, scores, "length")
        return self._feed(self.respond(token, from_draft, scores, self.n))

    def _last(self, token, from_draft, scores, reason: str) -> bool:
        self.detokenizer.finalize()
        self._feed(self.respond(token, from_draft, scores, self.n, reason))
        return True

    def _feed(self, response) -> bool:
        self.last = response
        if delta := self.answer.feed(response):
            self.job.emit("delta", delta)
        self.produced = response.generation_tokens
        if self.answer.stopped:  # a stop string: the row leaves the batch
            self.finish = "stop"
            return True
        if response.finish_reason is not None:
            self.finish = response.finish_reason
            return True
        return False

    def close(self, finish: str | None = None) -> Outcome:
        """Hand over what the Answer still holds; the request's Outcome (`finish`: why it
        ended when its tokens did not say, "cancelled")."""
        self.finish = finish or self.finish
        if delta := self.answer.finish():
            self.job.emit("delta", delta)
        if self.finish == "stop" and self.answer.made_call:
            self.finish = "tool_calls"
        last = self.last
        elapsed = time.perf_counter() - self.start - (self.first or 0.0)
        return Outcome(
            finish_reason=self.finish, prompt_tokens=len(self.job.request.prompt),
            cached_tokens=self.cached, completion_tokens=self.produced,
            drafter=last.drafter if last else self.row.drafter.name,
            target_passes=last.target_passes if last else 0,
            drafted=last.drafted if last else 0, accepted=last.accepted if last else 0,
            tau=last.tau if last else 0.0, seconds_to_first_token=self.first or 0.0,
            tokens_per_second=self.produced / elapsed if elapsed > 0 else 0.0)


class BatchWorker(Worker):
    """The Worker's surface (submit, stop, queue_length, busy, drafters built on its thread),
    serving up to `max_batch` requests at once as rows of one Loop over the batched target.

    Where rows cannot share a pass (see batch_refusal, or a model its batch target refuses) it
    serves one request at a time as the Worker does, and `refusal` says why."""

    def __init__(self, *args, max_batch: int = 8, cache_slots: int = 4,
                 kv_quantization: tuple[int, int] | None = None, **kwargs):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch, self.refusal = max_batch, None
        self.kv_quantization = kv_quantization  # (bits, group size): serve --kv-bits
        # as many kept caches as rows, at least: every row's conversation may come back
        kwargs["cache_slots"] = max(cache_slots, max_batch) if cache_slots else 0
        self.replies: dict[Row, RowReply] = {}  # the requests generating now, by their row
        self._held = None  # a seeded job taken from the FIFO, waiting for the batch to empty
        self._solo = False  # a seeded job runs: no other joins it
        self._stopping = False
        super().__init__(*args, **kwargs)

    @property
    def queue_length(self) -> int:
        return self._waiting + (self._held is not None)

    @property
    def rows(self) -> int:
        return len(self.replies) if self.refusal is None else int(self.busy)

    def describe(self) -> str:
        if self.refusal is not None:
            return f"one request at a time ({self.refusal})"
        return f"batches of up to {self.max_batch} requests"

    def _prepare(self) -> None:
        from ..backends import backend_for

        self.parts = backend_for(self.model)
        self.tokenizer = _as_wrapper(self.tokenizer)
        self.eos = frozenset(self.tokenizer.eos_token_ids)
        self.refusal = batch_refusal(self.model, self.drafters)
        if self.refusal is None:
            try:
                self.target = self._new_target()
            except ValueError as err:  # a model whose caches cannot be cut back per row
                self.refusal = str(err)
            else:
                self.refusal = next(filter(None, map(self.target.drafting_refusal,
                                                     self.drafters.values())), None)
        if self.refusal is not None:
            self.max_batch = 1

    def _new_target(self):
        layers = next((d.capture_layers for d in self.drafters.values() if d.capture_layers), ())
        bits, group_size = self.kv_quantization or (None, 64)
        return self.parts.batch_target(self.model, capture_layers=layers, kv_bits=bits,
                                       kv_group_size=group_size)

    def _serve(self) -> None:
        if self.refusal is not None:
            return super()._serve()
        clear_streams_at_thread_exit()
        self.loop = Loop(self.target)
        while not self._stopping:
            if self._held is None:
                job = self._take()  # idle: wait for a request
                if job is None:
                    return
                self._held = job
            with generation_lock(self.model):  # another user of the model in this process waits
                self._batch_runs()
        if self._held is not None:
            self._held.emit("error", "the server is shutting down")

    def _batch_runs(self) -> None:
        """Runs of the loop while requests come: each run ends when its last row leaves."""
        while True:
            self._solo = False
            self._admit(idle=True)
            if not self.replies:
                return
            self.busy = True
            try:
                for row, token, from_draft, *scores in self.loop:
                    self._event(row, token, from_draft, scores)
                    self._admit(idle=False)
            except Exception as err:  # noqa: BLE001  (reported to its clients, the server lives)
                self._fail(err)
            finally:
                self.busy = False

    def _admit(self, idle: bool) -> None:
        """Jobs join as rows while there is room, in FIFO order; a job with a seed only when
        the loop is idle (no pass in flight: `idle`) and empty, and then alone."""
        while not self._solo and not self._stopping and len(self.replies) < self.max_batch:
            job = self._held if self._held is not None else self._take(block=False)
            self._held = None
            if job is NOTHING:
                return
            if job is None:
                self._stopping = True
                return
            if job.cancelled.is_set():  # the client left while it waited
                continue
            seed = job.request.generation.sampling.seed
            if seed is not None:
                if not idle or self.replies:
                    self._held = job
                    return
                self.parts.seed(seed)
                self._solo = True
            self._join(job)

    def _join(self, job: Job) -> None:
        """The job's row, with a fork of its drafter (own state and adaptive K), joins the
        loop at its next step boundary; a request that cannot run gets its error here."""
        request, generation = job.request, job.request.generation
        try:
            check_request(self.parts, self.model, request.prompt, generation.max_tokens)
            drafter = self.drafter_for(request)
            row = request_row(drafter, request.prompt, generation, self.eos)
            cached = 0
            if self.caches is not None:
                layers = row.drafter.capture_layers
                kept, cached = self.caches.longest(request.prompt, layers)
                row.start = kept_start(kept, cached, layers)
                row.on_leave = lambda left, row=row, n=len(request.prompt): \
                    self._keep(row, n, *left)
            reply = RowReply(job, row, self.tokenizer, self.eos,
                             lambda: self.parts.peak_memory_gb(self.model), cached)
        except Exception as err:  # noqa: BLE001  (this request's failure only)
            job.fail(err)
            return
        self.replies[row] = reply
        self.loop.join(row)

    def _keep(self, row: Row, prompt_length: int, caches: list, held: int | None,
              prompt_state=None) -> None:
        """A leaving row's caches (copied out of the batch) kept for its conversation's next
        turn: as a generation's are remembered, cut back to the tokens it committed."""
        kept = self.parts.prompt_cache()
        kept.check_model(self.model)
        keep_row(kept, row, caches, held, prompt_state, prompt_length=prompt_length)
        if kept.tokens:
            self.caches.keep(kept)

    def _event(self, row: Row, token: int, from_draft: bool, scores: list) -> None:
        reply = self.replies.get(row)
        if reply is None:  # over already (a stop string), its step's later tokens unwanted
            return
        if reply.job.cancelled.is_set():
            self._end(reply, "cancelled")
        elif reply.take(token, from_draft, scores):
            self._end(reply)

    def _end(self, reply: RowReply, finish: str | None = None) -> None:
        """The request is over: its row leaves the batch (now, if its tokens did not end it)."""
        del self.replies[reply.row]
        if not reply.row.finished:
            self.loop.cancel(reply.row)
        outcome = reply.close(finish)
        if self.on_finish is not None:  # metrics count it before its client hears
            self.on_finish(reply.job, outcome)
        reply.job.emit("done", outcome)

    def _fail(self, err: Exception) -> None:
        """A pass failed: every row's request gets the error, and a fresh batch starts."""
        report_failure(err)
        message = f"{type(err).__name__}: {err}"
        for reply in self.replies.values():
            reply.job.emit("error", message)
        self.replies.clear()
        self.target = self._new_target()
        self.loop = Loop(self.target)
