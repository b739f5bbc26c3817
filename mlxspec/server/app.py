"""The OpenAI-compatible HTTP API over mlxspec's loop: a Starlette (ASGI) app served by uvicorn.

Starlette and uvicorn are what FastAPI-based servers of this field (vLLM's OpenAI server,
mlx-omni-server, LM Studio-like local servers) stand on: a maintained HTTP/1.1 parser, server-sent
events by a streaming response, graceful shutdown on SIGINT/SIGTERM (in-flight requests drain)
and a client's disconnect seen as a cancelled stream; none of it is hand-written here.
"""

import asyncio
import contextlib
import json
import secrets

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .guards import MAX_JSON_DEPTH, RenderSlots, json_too_deep
from .logprobs import TokenNames, chat_logprobs, completion_logprobs
from .batching import BatchWorker
from .metrics import Metrics
from .requests import APIError, GenerationRequest, parse_request
from .worker import Delta, Job, Outcome, QueueFull, Worker

MAX_BODY_BYTES = 4 * 1024 * 1024
BIG_BODY_BYTES = 256 * 1024  # far over a normal request; tokenising 4 MB takes seconds


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def usage(outcome: Outcome) -> dict:
    """OpenAI's usage, with its fields for predicted outputs holding the drafts verification
    accepted and rejected (for every drafter: speculation is prediction), plus mlxspec's own."""
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": outcome.accepted,
            "rejected_prediction_tokens": outcome.drafted - outcome.accepted,
        },
        "mlxspec": {"drafter": outcome.drafter, "target_passes": outcome.target_passes,
                    "tau": round(outcome.tau, 4)},
    }


class Server:
    """The app's state: the served model, its worker, the metrics and the API key."""

    def __init__(self, model, tokenizer, *, model_id: str, build_drafters, default_drafter: str,
                 api_key: str | None = None, max_queue: int = 64, context_length=None,
                 render_timeout: float = 10.0, render_slots: int = 2,
                 max_num_draft: int | None = None, max_batch: int = 1, cache_file=None,
                 kv_quantization: tuple[int, int] | None = None):
        self.model_id, self.api_key = model_id, api_key
        self.max_num_draft, self.kv_quantization = max_num_draft, kv_quantization
        self.token_names = TokenNames(tokenizer)
        self.render_slots = RenderSlots(render_slots, render_timeout)
        self.big_render_slots = RenderSlots(1, render_timeout, background=True)
        self.tokenizer, self.context_length = tokenizer, context_length
        self.metrics = Metrics()
        on_finish = lambda job, outcome: self.metrics.finished(outcome)  # noqa: E731
        if max_batch > 1:  # rows of one batch, where the model and drafters allow it
            self.worker = BatchWorker(model, tokenizer, build_drafters, default_drafter,
                                      max_queue=max_queue, on_finish=on_finish,
                                      max_batch=max_batch, cache_file=cache_file,
                                      kv_quantization=kv_quantization)
        else:
            self.worker = Worker(model, tokenizer, build_drafters, default_drafter,
                                 max_queue=max_queue, on_finish=on_finish, cache_file=cache_file)
        self.metrics.queue_length = lambda: self.worker.queue_length
        self.metrics.batch_rows = lambda: (self.worker.rows, self.worker.max_batch)
        self.drafter_names = tuple(self.worker.drafters)

    def app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self.completions(chat=True), methods=["POST"]),
            Route("/v1/completions", self.completions(chat=False), methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ]
        return Starlette(routes=routes, lifespan=self.lifespan,
                         exception_handlers={404: self.not_found, 405: self.not_allowed,
                                             Exception: self.server_error})

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        yield
        self.worker.stop()  # after uvicorn drained the in-flight requests

    # ---- plain endpoints ----

    async def models(self, request: Request) -> Response:
        if (denied := self.check_key(request)) is not None:
            return denied
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": 0, "owned_by": "mlxspec",
             "drafters": list(self.drafter_names)}]})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "queue": self.worker.queue_length,
                             "busy": self.worker.busy, "rows": self.worker.rows,
                             "max_batch": self.worker.max_batch})

    async def prometheus(self, request: Request) -> Response:
        if (denied := self.check_key(request)) is not None:  # /health stays open for probes
            return denied
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def not_found(self, request: Request, exc) -> Response:
        return error_response(APIError(404, f"no route {request.method} {request.url.path}",
                                       code="not_found"))

    async def not_allowed(self, request: Request, exc) -> Response:
        return error_response(APIError(405, f"{request.method} is not allowed on "
                                            f"{request.url.path}", code="method_not_allowed"))

    async def server_error(self, request: Request, exc: Exception) -> Response:
        """A failure no handler expected: still OpenAI's error shape, never a plain-text 500
        (Starlette logs the traceback for the operator)."""
        return error_response(APIError(500, f"internal error: {type(exc).__name__}",
                                       kind="server_error", code="internal_error"))

    def check_key(self, request: Request) -> Response | None:
        if self.api_key is None:
            return None
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            return error_response(APIError(401, "missing or wrong API key (Authorization: "
                                                "Bearer ...)", kind="authentication_error",
                                           code="invalid_api_key"))
        return None

    # ---- generation ----

    def completions(self, *, chat: bool):
        endpoint = "chat.completions" if chat else "completions"

        async def handle(request: Request) -> Response:
            response = await self.respond(request, chat)
            self.metrics.request(endpoint, response.status_code)
            return response

        return handle

    async def respond(self, request: Request, chat: bool) -> Response:
        if (denied := self.check_key(request)) is not None:
            return denied
        try:
            parsed = await self.read(request, chat)
        except APIError as err:
            return error_response(err)
        job = Job(parsed, asyncio.get_running_loop())
        try:
            self.worker.submit(job)
        except QueueFull:
            return error_response(APIError(429, "the server's queue is full; retry later",
                                           kind="rate_limit_error", code="queue_full"))
        if parsed.stream:
            return StreamingResponse(self.stream(job, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self.whole(job, chat)

    async def read(self, request: Request, chat: bool) -> GenerationRequest:
        """The body, read here; parsed, rendered and tokenised in a render slot (a thread).
        Bodies over BIG_BODY_BYTES take turns in a slot of their own: a client sending 4 MB
        bodies keeps one thread busy, never the slots of normal requests."""
        too_large = APIError(413, f"the body is over {MAX_BODY_BYTES} bytes",
                             code="body_too_large")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise too_large
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise too_large
        slots = self.big_render_slots if len(raw) > BIG_BODY_BYTES else self.render_slots
        return await slots.run(lambda: self.parse(bytes(raw), chat),
                               param="messages" if chat else "prompt")

    def parse(self, raw: bytes, chat: bool) -> GenerationRequest:
        """JSON, chat template and tokenisation: seconds for a big body, so off the event loop."""
        if json_too_deep(raw):
            raise APIError(400, f"the body nests deeper than {MAX_JSON_DEPTH} levels",
                           code="json_too_deep")
        try:
            body = json.loads(raw)
        except ValueError as err:  # bad JSON or UTF-8, an integer of over 4300 digits
            raise APIError(400, f"the body is not valid JSON: {err}") from None
        if isinstance(body, dict) and body.get("model") not in (None, self.model_id):
            raise APIError(404, f"the model {body.get('model')!r} does not exist; this server "
                                f"serves {self.model_id!r}", param="model",
                           code="model_not_found")
        try:
            return parse_request(body, chat=chat, tokenizer=self.tokenizer,
                                 max_num_draft=self.max_num_draft,
                                 context_length=self.context_length,
                                 drafters=self.drafter_names,
                                 kv_quantization=self.kv_quantization)
        except APIError:
            raise
        except Exception as err:  # noqa: BLE001  (a chat template that refuses the messages)
            raise APIError(400, f"the request cannot be rendered for this model: "
                                f"{type(err).__name__}: {err}",
                           param="messages" if chat else "prompt") from None

    def envelope(self, job: Job, chat: bool) -> dict:
        return {"id": ("chatcmpl-" if chat else "cmpl-") + job.id,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": job.created, "model": self.model_id}

    def logprobs(self, job: Job, chat: bool, delta: Delta):
        """A choice's logprobs: None unless the request asked for them."""
        if job.request.generation.logprobs is None:
            return None
        return (chat_logprobs if chat else completion_logprobs)(delta.logprobs, self.token_names)

    async def whole(self, job: Job, chat: bool) -> Response:
        answer = Delta()
        while True:
            kind, value = await job.events.get()
            if kind == "delta":
                answer.text += value.text
                answer.tool_calls += value.tool_calls
                answer.logprobs += value.logprobs
            elif kind == "error":
                return error_response(APIError(500, value, kind="server_error"))
            else:
                break
        outcome = value
        choice = {"index": 0, "finish_reason": finish(outcome),
                  "logprobs": self.logprobs(job, chat, answer)}
        if chat:
            choice["message"] = {"role": "assistant", "content": answer.text}
            if answer.tool_calls:
                choice["message"].update(content=answer.text or None,
                                         tool_calls=answer.tool_calls)
        else:
            choice["text"] = answer.text
        body = {**self.envelope(job, chat), "choices": [choice], "usage": usage(outcome)}
        body["object"] = "chat.completion" if chat else "text_completion"
        return JSONResponse(body)

    async def stream(self, job: Job, chat: bool):
        """Server-sent events in OpenAI's chunk format; a disconnect cancels the job. A chunk
        carries the logprobs of the tokens whose text it completes, and each tool call whole."""
        head = self.envelope(job, chat)
        calls_sent = 0

        def chunk(delta: Delta, reason: str | None = None) -> str:
            nonlocal calls_sent
            choice = {"index": 0, "finish_reason": reason,
                      "logprobs": self.logprobs(job, chat, delta)}
            if chat:
                choice["delta"] = {"content": delta.text} if delta.text else {}
                if delta.tool_calls:
                    choice["delta"]["tool_calls"] = [
                        {"index": calls_sent + i, **call}
                        for i, call in enumerate(delta.tool_calls)]
                    calls_sent += len(delta.tool_calls)
            else:
                choice["text"] = delta.text
            return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

        try:
            if chat:
                role = {**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                   "content": ""},
                                             "logprobs": None, "finish_reason": None}]}
                yield f"data: {json.dumps(role)}\n\n"
            while True:
                kind, value = await job.events.get()
                if kind == "delta":
                    yield chunk(value)
                elif kind == "error":
                    error = APIError(500, value, kind="server_error").body()
                    yield f"data: {json.dumps(error)}\n\n"
                    break
                else:
                    yield chunk(Delta(), finish(value))
                    if job.request.include_usage:
                        last = {**head, "choices": [], "usage": usage(value)}
                        yield f"data: {json.dumps(last)}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or the stream ended): the worker stops at its next step
            job.cancelled.set()


def finish(outcome: Outcome) -> str:
    """OpenAI's finish_reason: "length", "tool_calls" (the answer called a tool), or "stop" (a
    stop string, the end-of-sequence token)."""
    return outcome.finish_reason if outcome.finish_reason in ("length", "tool_calls") else "stop"


__all__ = ["Server"]
