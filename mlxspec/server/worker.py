"""One generation at a time on one model, fed by a bounded FIFO queue.

MLX evaluates one graph at a time on a device, and a drafter holds per-sequence state (its
caches), so this worker serves requests in arrival order on one thread, each with the whole
model (and a kept prompt cache to continue). It serves `mlxspec serve --max-batch 1`, and
wherever rows cannot share a pass (the torch backend, a split target, LayerSkip);
batching.BatchWorker serves concurrent requests as rows of one batch instead. The HTTP side
never blocks on the model: it queues a job and reads the job's events as the worker produces
them.
"""

import asyncio
import queue
import sys
import threading
import traceback
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..drafters import CopyFirstDrafter, PromptLookupDrafter
from ..engine import Drafter, PlainDecoding
from .logprobs import TokenLogprob, TokenTrail
from .requests import GenerationRequest
from .stops import StopText
from .tools import ToolCallText


@dataclass
class Job:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def emit(self, kind: str, value=None) -> None:
        """Hand an event to the request's handler (from the worker thread)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def fail(self, err: Exception) -> None:
        """The client gets the error in one line; the server's log gets where it came from."""
        report_failure(err)
        self.emit("error", f"{type(err).__name__}: {err}")


def report_failure(err: Exception) -> None:
    """A failure inside generation is the server's bug, not the client's: its traceback goes
    to stderr so that it can be found, while the client sees one line."""
    print("mlxspec serve: a generation failed:", file=sys.stderr)
    traceback.print_exception(err, file=sys.stderr)


@dataclass
class Outcome:
    """What a finished generation reports besides its text."""

    finish_reason: str
    prompt_tokens: int
    cached_tokens: int  # prompt tokens a kept cache held: not prefilled again
    completion_tokens: int
    drafter: str
    target_passes: int
    drafted: int
    accepted: int
    tau: float
    seconds_to_first_token: float
    tokens_per_second: float


@dataclass
class Delta:
    """A piece of the answer: content text, the tool calls it completed, and the logprobs of the
    tokens whose text it completed (when the request asked for them)."""

    text: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.text or self.tool_calls or self.logprobs)


class Answer:
    """Turns a generation's responses into Deltas: stop strings cut the text (StopText), the
    tokens' logprobs follow the text returned (TokenTrail) and tool calls are parsed out of it
    (ToolCallText), each only when the request asks for it."""

    def __init__(self, request: GenerationRequest, tokenizer):
        self.stops = StopText(request.stop)
        self.tokens = TokenTrail() if request.generation.logprobs is not None else None
        self.calls = ToolCallText(tokenizer, request.tools) if request.tools else None
        self.returned = 0  # characters of output text returned so far

    @property
    def stopped(self) -> bool:
        return self.stops.stopped

    @property
    def made_call(self) -> bool:
        return self.calls is not None and self.calls.made_call

    def feed(self, response) -> Delta:
        if self.tokens is not None:
            self.tokens.add(response)
        text = self.stops.feed(response.text)
        self.returned += len(text)
        logprobs = self.tokens.release(self.returned) if self.tokens is not None else []
        return self._delta(text, logprobs)

    def finish(self) -> Delta:
        text = self.stops.flush()
        self.returned += len(text)
        logprobs = self.tokens.finish(self.returned) if self.tokens is not None else []
        delta = self._delta(text, logprobs)
        if self.calls is not None:
            rest, calls = self.calls.finish()
            delta.text += rest
            delta.tool_calls += calls
        return delta

    def _delta(self, text: str, logprobs: list[TokenLogprob]) -> Delta:
        if self.calls is None:
            return Delta(text, [], logprobs)
        content, calls = self.calls.feed(text)
        return Delta(content, calls, logprobs)


class QueueFull(Exception):
    pass


NOTHING = object()  # Worker._take: no job waits


class Worker:
    """Runs jobs one after another on a thread of its own; `submit` refuses past `max_queue`
    waiting jobs (the caller answers 429).

    The drafters are built on that thread too (`build_drafters`), before it takes a job: MLX
    keeps a stream per thread, and an array a drafter computed lazily at load time belongs to
    the thread that built it. A failure there is raised here, before the server starts."""

    def __init__(self, model, tokenizer, build_drafters: Callable[[], dict[str, Drafter]],
                 default_drafter: str, *, max_queue: int = 64, on_finish=None,
                 cache_slots: int = 4, cache_file=None):
        from ..backends import backend_for
        from .cache_pool import PromptCachePool

        self.model, self.tokenizer = model, tokenizer
        self.cache_file = cache_file  # read into the pool at start, its latest cache written at stop
        make_cache = backend_for(model).prompt_cache
        self.caches = PromptCachePool(make_cache, slots=cache_slots) if cache_slots else None
        self.default_drafter = default_drafter
        self.max_queue, self.on_finish = max_queue, on_finish
        self._jobs: queue.Queue = queue.Queue()
        self._waiting = 0
        self._lock = threading.Lock()
        self.busy = False
        self.drafters: dict[str, Drafter] = {}
        built: list = []
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(build_drafters, built, ready),
                                        name="mlxspec-worker", daemon=True)
        self._thread.start()
        ready.wait()
        if built and isinstance(built[0], BaseException):
            raise built[0]

    @property
    def queue_length(self) -> int:
        return self._waiting

    @property
    def rows(self) -> int:
        """Requests generating now (this worker runs one at a time)."""
        return int(self.busy)

    max_batch = 1  # the most requests generating at once

    def describe(self) -> str:
        """How it serves requests, for the startup line."""
        return "one request at a time"

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._waiting >= self.max_queue:
                raise QueueFull
            self._waiting += 1
        self._jobs.put(job)

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _run(self, build_drafters, built: list, ready: threading.Event) -> None:
        try:
            self.drafters = build_drafters()
            self._read_cache_file()
            self._prepare()
        except BaseException as err:  # noqa: BLE001  (raised again in __init__)
            built.append(err)
            return
        finally:
            ready.set()
        self._serve()
        self._write_cache_file()

    def _read_cache_file(self) -> None:
        """The --prompt-cache-file's cache joins the pool (on this thread, whose stream its
        arrays then belong to); a file another model made, or a damaged one, stops the start."""
        if self.cache_file is None or self.caches is None or not Path(self.cache_file).exists():
            return
        self.caches.keep(self.caches.make().load(self.cache_file, self.model))

    def _write_cache_file(self) -> None:
        """At stop, the most recently used kept cache goes to the file, whole or not at all."""
        if self.cache_file is None or self.caches is None:
            return
        held = [c for c in self.caches.caches if c.tokens and c.cache is not None]
        if held:
            held[-1].save(self.cache_file)

    def _prepare(self) -> None:
        """What the serving loop needs besides the drafters, set up on the worker's thread."""

    def _take(self, block: bool = True):
        """The next job in the FIFO (None: stop; NOTHING: none waits and `block` is False)."""
        try:
            job = self._jobs.get(block=block)
        except queue.Empty:
            return NOTHING
        if job is not None:
            with self._lock:
                self._waiting -= 1
        return job

    def _serve(self) -> None:
        """Jobs one after another, in arrival order, until stop()."""
        while True:
            job = self._take()
            if job is None:
                _release_other_ranks(self.model)
                return
            if job.cancelled.is_set():  # the client left while it waited
                continue
            self.busy = True
            try:
                outcome = self._generate(job)
                if self.on_finish is not None:  # metrics count it before its client hears
                    self.on_finish(job, outcome)
                job.emit("done", outcome)
            except Exception as err:  # noqa: BLE001  (reported to the client, the server lives)
                job.fail(err)
            finally:
                self.busy = False

    def drafter_for(self, request: GenerationRequest) -> Drafter:
        """The request's drafter; a predicted output becomes a lookup source in front of it
        (with the settings of the lookup the drafter already has, if any, and in its place)."""
        drafter = self.drafters[request.drafter or self.default_drafter]
        if request.prediction is None:
            return drafter
        copier = drafter if isinstance(drafter, PromptLookupDrafter) else \
            getattr(drafter, "copier", None)
        own = copier if isinstance(copier, PromptLookupDrafter) else PromptLookupDrafter()
        lookup = PromptLookupDrafter(max_ngram=own.max_ngram, min_ngram=own.min_ngram,
                                     branches=own.branches, reference=request.prediction)
        if isinstance(drafter, (PlainDecoding, PromptLookupDrafter)):
            return lookup
        if copier is own:  # X+lookup: the reference's lookup replaces its own
            drafter = drafter.model_drafter
        return CopyFirstDrafter(drafter, lookup)

    def _generate(self, job: Job) -> Outcome:
        from ..generate import stream_request

        request = job.request
        answer = Answer(request, self.tokenizer)
        start = time.perf_counter()
        first, last, produced, finish = None, None, 0, "length"
        drafter = self.drafter_for(request)
        cache, cached = None, 0
        if self.caches is not None:  # a feature drafter's: where it kept their features
            cache = self.caches.checkout(request.prompt)
            cache.take(self.model, request.prompt, drafter.capture_layers)
            cached = len(cache.tokens)
        responses = stream_request(self.model, self.tokenizer, request.prompt,
                                   request.generation, drafter=drafter, prompt_cache=cache)
        try:
            for last in responses:
                if job.cancelled.is_set():
                    finish = "cancelled"
                    break
                if first is None:
                    first = time.perf_counter() - start
                if delta := answer.feed(last):
                    job.emit("delta", delta)
                produced = last.generation_tokens
                if answer.stopped:
                    finish = "stop"
                    break
                if last.finish_reason is not None:
                    finish = last.finish_reason
            if delta := answer.finish():
                job.emit("delta", delta)
        finally:
            responses.close()
        if finish == "stop" and answer.made_call:
            finish = "tool_calls"
        elapsed = time.perf_counter() - start - (first or 0.0)
        return Outcome(
            finish_reason=finish, prompt_tokens=len(request.prompt), cached_tokens=cached,
            completion_tokens=produced,
            drafter=last.drafter if last else "none",
            target_passes=last.target_passes if last else 0,
            drafted=last.drafted if last else 0, accepted=last.accepted if last else 0,
            tau=last.tau if last else 0.0, seconds_to_first_token=first or 0.0,
            tokens_per_second=produced / elapsed if elapsed > 0 else 0.0)


def _release_other_ranks(model) -> None:
    """A target split across ranks (mlx.launch): the others stop following once the last
    generation is over, from the thread that ran the generations (so after it, in order)."""
    from ..distributed import stage_of

    stage = stage_of(model)
    if stage is not None and stage.leads:
        stage.link.shutdown()
