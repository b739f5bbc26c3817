"""OpenAI request bodies -> a checked GenerationRequest, or an APIError in OpenAI's error shape.

Everything a request can get wrong is found here, before it is queued: a bad request costs no
model time and never reaches the worker."""

import math
from dataclasses import dataclass, field

from ..generate import encode_prompt
from ..sampling import SamplingConfig


class APIError(Exception):
    """An error as OpenAI's API returns it: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status, message, param, code, kind)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass
class GenerationRequest:
    """One checked request: what the worker needs to generate and to answer."""

    chat: bool
    prompt: list[int]
    max_tokens: int
    temp: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    drafter: str | None = None
    num_draft: int | None = None
    prediction: list[int] | None = None  # token ids of the predicted output, a lookup source


def _number(body: dict, name: str, default, *, low=None, high=None, integer=False):
    value = body.get(name, default)
    if value is None:
        return default
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise APIError(400, f"{name} must be {'an integer' if integer else 'a number'}, "
                            f"got {value!r}", param=name)
    if not math.isfinite(value):
        raise APIError(400, f"{name} must be finite, got {value!r}", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        raise APIError(400, f"{name} must be {bounds}, got {value!r}", param=name)
    return value


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > 4:
        raise APIError(400, "stop must be a string or a list of up to 4 strings", param="stop")
    return stops


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a role",
                           param=f"messages[{i}]")
        content = message.get("content")
        if isinstance(content, list):  # content parts: the text ones, joined
            if not all(isinstance(p, dict) for p in content):
                raise APIError(400, f"messages[{i}].content parts must be objects",
                               param=f"messages[{i}].content")
            content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of parts",
                           param=f"messages[{i}].content")
        out.append({"role": message["role"], "content": content})
    return out


def _prediction(body: dict, encode) -> list[int] | None:
    prediction = body.get("prediction")
    if prediction is None:
        return None
    if not isinstance(prediction, dict) or prediction.get("type") != "content":
        raise APIError(400, 'prediction must be {"type": "content", "content": ...}',
                       param="prediction")
    content = prediction.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str):
        raise APIError(400, "prediction.content must be a string or a list of text parts",
                       param="prediction.content")
    return encode(content) if content else None


def parse_request(body, *, chat: bool, tokenizer, context_length: int | None,
                  drafters: tuple[str, ...]) -> GenerationRequest:
    """Check an OpenAI chat-completions (`chat`) or completions body for the served model."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    n = _number(body, "n", 1, integer=True)
    if n != 1:
        raise APIError(400, f"only n = 1 is supported, got {n}", param="n")
    if chat:
        prompt = tokenizer.apply_chat_template(_messages(body), add_generation_prompt=True)
    else:
        text = body.get("prompt")
        if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
            text = text[0]
        if not isinstance(text, str):
            raise APIError(400, "prompt must be a string", param="prompt")
        prompt = encode_prompt(tokenizer, text)
    default_max = 256 if context_length is None else max(context_length - len(prompt), 1)
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    given = next((name for name in names if body.get(name) is not None), names[-1])
    max_tokens = _number(body, given, min(default_max, 4096), low=1, integer=True)
    if context_length is not None and len(prompt) + 1 > context_length:
        raise APIError(400, f"the prompt is {len(prompt)} tokens; this model's context window "
                            f"is {context_length}", param="messages" if chat else "prompt",
                       code="context_length_exceeded")
    drafter = body.get("drafter")
    if drafter is not None and drafter not in drafters:
        raise APIError(400, f"unknown drafter {drafter!r}; this server offers "
                            f"{', '.join(drafters)}", param="drafter")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise APIError(400, "stream_options must be an object", param="stream_options")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "stream must be true or false", param="stream")
    request = GenerationRequest(
        chat=chat, prompt=list(prompt), max_tokens=max_tokens,
        temp=_number(body, "temperature", 1.0, low=0, high=2),
        top_p=_number(body, "top_p", 1.0),  # their ranges are the sampler's, checked below
        top_k=_number(body, "top_k", 0, integer=True),
        min_p=_number(body, "min_p", 0.0),
        seed=_number(body, "seed", None, integer=True),
        stop=_stops(body), stream=stream,
        include_usage=bool(stream_options.get("include_usage", False)),
        drafter=drafter, num_draft=_number(body, "num_draft", None, low=1, integer=True),
        prediction=_prediction(body, lambda text: tokenizer.encode(text, add_special_tokens=False)),
    )
    try:  # the sampler's own checks (top_p in (0, 1], ...), in its words
        SamplingConfig(temp=request.temp, top_p=request.top_p, top_k=request.top_k,
                       min_p=request.min_p)
    except (TypeError, ValueError) as err:
        raise APIError(400, str(err), param=str(err).split(" ")[0]) from None
    return request
