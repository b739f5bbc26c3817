"""OpenAI request bodies -> a checked GenerationRequest, or an APIError in OpenAI's error shape.

Everything a request can get wrong is found here, before it is queued: a bad request costs no
model time and never reaches the worker. Every field of a body is either honoured or refused with
a 400 naming it: a field this server does not know, or an OpenAI setting it cannot honour (a
penalty, logit_bias, n > 1, a JSON response format, a forced tool choice), is never ignored."""

import functools
import json
import math
from dataclasses import dataclass, field

from ..generate import encode_prompt
from ..request import MAX_LOGPROBS, Request
from ..sampling import SamplingConfig, check_seed

# Fields both endpoints honour: OpenAI's, then mlxspec's own (drafter, num_draft, adaptive, top_k,
# min_p; prediction is OpenAI's predicted outputs, taken by completions too). `user` and `metadata` are
# accepted and have no effect by definition (an end-user id for OpenAI's abuse monitoring, tags
# for stored completions, and nothing is stored); the other OpenAI fields below are accepted only
# at the value that asks for nothing this server would have to do (see DEFAULT_ONLY).
COMMON_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
    "seed", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "user",
    "drafter", "num_draft", "adaptive", "prediction", "top_k", "min_p",
})
CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "response_format", "metadata", "store",
}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"}

# Accepted, type-checked, and without effect (see above).
NO_OPS = {"user": (str, "a string"), "metadata": (dict, "an object")}

# OpenAI fields accepted only at the value that changes nothing: (test, what to say otherwise).
NO_PENALTIES = "presence and frequency penalties are not implemented; send 0 or leave it out"
DEFAULT_ONLY = {
    "presence_penalty": (lambda v: v is None or v == 0, NO_PENALTIES),
    "frequency_penalty": (lambda v: v is None or v == 0, NO_PENALTIES),
    "logit_bias": (lambda v: v is None or v == {}, "logit_bias is not supported"),
    "n": (lambda v: v is None or v == 1, "only n = 1 is supported"),
    "best_of": (lambda v: v is None or v == 1, "only best_of = 1 is supported"),
    "echo": (lambda v: v is None or v is False, "echo is not supported"),
    "suffix": (lambda v: v is None or v == "", "suffix (insertion) is not supported"),
    "store": (lambda v: v is None or v is False, "this server stores no completions"),
    "parallel_tool_calls": (lambda v: v is None or v is True,
                            "parallel_tool_calls = false cannot be enforced (the model may "
                            "call several tools; every call it makes is returned)"),
    "response_format": (lambda v: v is None or v == {"type": "text"},
                        'only response_format {"type": "text"} is supported: json_object and '
                        "json_schema would need constrained decoding, which this server does "
                        "not do, so their promise could not be kept"),
}

DEFAULT_MAX_NUM_DRAFT = 32
"""Drafts per step a request may ask for (mlxspec serve --max-num-draft). A step's verify pass
costs about a prefill of num_draft + 1 tokens, whether the drafts are accepted or not, so the
bound is what one client can make each of its tokens cost the requests queued behind it. 32 is
twice the largest block any drafter here proposes (DFlash's 16) and four times lookup's default:
room for long lookup matches of a predicted output, and 10000000 is refused."""

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound; chat's top_logprobs go to MAX_LOGPROBS (20)


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


@dataclass(frozen=True)
class GenerationRequest:
    """One checked request: what the worker needs to generate and to answer."""

    chat: bool
    prompt: list[int]
    # max_tokens, sampling (with the seed), num_draft and logprobs (None: none; n: each token's,
    # with its n best rivals), as the generation takes them
    generation: Request
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    drafter: str | None = None
    prediction: list[int] | None = None  # token ids of the predicted output, a lookup source
    tools: list[dict] | None = None  # set when the output is parsed for tool calls


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


def _boolean(value, name: str, default: bool = False) -> bool:
    """A JSON true/false: the string "false" is not false, so it is refused, not taken as true."""
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be true or false, got {value!r}", param=name)
    return value


def _check_fields(body: dict, chat: bool) -> None:
    """Every field is one this endpoint honours, at a value it can honour."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name in body:
        if name not in known:
            raise APIError(400, f"{name!r} is not a field this server accepts on "
                                f"{'/v1/chat/completions' if chat else '/v1/completions'} "
                                f"(it accepts: {', '.join(sorted(known))})", param=name)
        if name in NO_OPS and body[name] is not None:
            kind, words = NO_OPS[name]
            if not isinstance(body[name], kind):
                raise APIError(400, f"{name} must be {words}", param=name)
        if name in DEFAULT_ONLY:
            fine, why = DEFAULT_ONLY[name]
            if not fine(body[name]):
                raise APIError(400, f"{why}; got {name} = {body[name]!r}", param=name)


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > 4:
        raise APIError(400, "stop must be a string or a list of up to 4 strings", param="stop")
    return stops


def _include_usage(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", param="stream_options")
    if not stream:
        raise APIError(400, "stream_options is only allowed when stream is true",
                       param="stream_options")
    unknown = next((key for key in options if key != "include_usage"), None)
    if unknown is not None:
        raise APIError(400, f"stream_options.{unknown} is not supported (only include_usage)",
                       param=f"stream_options.{unknown}")
    return _boolean(options.get("include_usage"), "stream_options.include_usage")


def _chat_messages(messages) -> list[dict]:
    """The messages as the chat template takes them: text content (parts joined), and the tool
    fields passed through (an assistant's tool_calls, their arguments as objects as templates
    index them; a tool message's tool_call_id and name)."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    return [_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def _message(message, where: str) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise APIError(400, f"{where} must be an object with a role", param=where)
    content = message.get("content")
    if isinstance(content, list):  # content parts: the text ones, joined
        if not all(isinstance(p, dict) and p.get("type") == "text" and
                   isinstance(p.get("text"), str) for p in content):
            raise APIError(400, f'{where}.content parts must be text parts ({{"type": "text", '
                                f'"text": ...}}); this server takes no images or audio',
                           param=f"{where}.content")
        content = "".join(p["text"] for p in content)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise APIError(400, f"{where}.content must be a string or a list of parts",
                       param=f"{where}.content")
    out = {"role": message["role"], "content": content}
    for name in ("tool_call_id", "name"):
        if message.get(name) is not None:
            if not isinstance(message[name], str):
                raise APIError(400, f"{where}.{name} must be a string", param=f"{where}.{name}")
            out[name] = message[name]
    if message.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
    return out


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise APIError(400, f"{where} must be a list", param=where)
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(400, f'{where}[{j}] must be {{"type": "function", "function": '
                                f'{{"name": ..., "arguments": ...}}}}', param=f"{where}[{j}]")
        arguments = function.get("arguments") or "{}"
        if isinstance(arguments, str):  # OpenAI sends a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise APIError(400, f"{where}[{j}].function.arguments is not valid JSON",
                               param=f"{where}[{j}].function.arguments") from None
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def _tools(tools, tokenizer) -> list[dict] | None:
    """The request's function tools, or None when it sends none. A model whose chat template
    has no tool-call format mlx-lm knows (TokenizerWrapper.has_tool_calling) is refused: its
    calls could not be parsed out of the output."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list of function tools", param="tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or \
                not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(400, f'tools[{i}] must be {{"type": "function", "function": '
                                f'{{"name": ..., "parameters": ...}}}}', param=f"tools[{i}]")
    if not getattr(tokenizer, "has_tool_calling", False):
        raise APIError(400, "this model's chat template has no tool-call format mlx-lm "
                            "recognises, so its tool calls could not be parsed; send no tools",
                       param="tools")
    return tools


def _tool_choice(choice) -> str:
    """"auto" (the default) or "none". "required" and a named function are refused: forcing a
    call needs constrained decoding, and a model left free may answer in text instead."""
    if choice is None or choice in ("auto", "none"):
        return choice or "auto"
    if choice == "required" or isinstance(choice, dict):
        raise APIError(400, 'tool_choice "required" or a named function cannot be enforced '
                            '(that needs constrained decoding); use "auto" or "none"',
                       param="tool_choice")
    raise APIError(400, f'tool_choice must be "auto" or "none", got {choice!r}',
                   param="tool_choice")


def _prediction(body: dict, encode) -> list[int] | None:
    """The predicted output's tokens. Its failures are the prediction's (a content part whose
    text is not a string used to be blamed on the messages)."""
    prediction = body.get("prediction")
    if prediction is None:
        return None
    if not isinstance(prediction, dict) or prediction.get("type") != "content":
        raise APIError(400, 'prediction must be {"type": "content", "content": ...}',
                       param="prediction")
    content = prediction.get("content")
    if isinstance(content, list):
        texts = [p.get("text") if isinstance(p, dict) else None for p in content]
        if not all(isinstance(t, str) for t in texts):
            raise APIError(400, "prediction.content parts must be {\"type\": \"text\", "
                                "\"text\": a string}", param="prediction.content")
        content = "".join(texts)
    if not isinstance(content, str):
        raise APIError(400, "prediction.content must be a string or a list of text parts",
                       param="prediction.content")
    try:
        return encode(content) if content else None
    except Exception as err:  # noqa: BLE001  (text the tokenizer refuses: lone surrogates)
        raise APIError(400, f"prediction.content cannot be tokenised: {type(err).__name__}: "
                            f"{err}", param="prediction.content") from None


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many rivals each token's logprob comes with, or None when logprobs are off. Chat:
    logprobs true/false and top_logprobs 0..20; completions: logprobs 0..5 (OpenAI's ranges)."""
    if not chat:
        return _number(body, "logprobs", None, low=0, high=MAX_COMPLETION_LOGPROBS, integer=True)
    wanted = _boolean(body.get("logprobs"), "logprobs")
    top = _number(body, "top_logprobs", None, low=0, high=MAX_LOGPROBS, integer=True)
    if top is not None and not wanted:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if wanted else None


def _seed(body: dict) -> int | None:
    seed = _number(body, "seed", None, integer=True)
    if seed is not None:
        try:
            check_seed(seed)
        except ValueError as err:
            raise APIError(400, str(err), param="seed") from None
    return seed


def _max_tokens(body: dict, chat: bool, prompt: list[int], context_length: int | None) -> int:
    """max_tokens (or chat's max_completion_tokens), within the context window with the prompt."""
    where = "messages" if chat else "prompt"
    if context_length is not None and len(prompt) + 1 > context_length:
        raise APIError(400, f"the prompt is {len(prompt)} tokens; this model's context window "
                            f"is {context_length}", param=where, code="context_length_exceeded")
    default_max = 256 if context_length is None else context_length - len(prompt)
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    given = next((name for name in names if body.get(name) is not None), names[-1])
    max_tokens = _number(body, given, min(default_max, 4096), low=1, integer=True)
    if context_length is not None and len(prompt) + max_tokens > context_length:
        raise APIError(400, f"the prompt ({len(prompt)} tokens) + {given} ({max_tokens}) is "
                            f"over this model's context window of {context_length} tokens; "
                            f"ask for at most {context_length - len(prompt)}", param=given,
                       code="context_length_exceeded")
    return max_tokens


def _num_draft(body: dict, max_num_draft: int | None) -> int | None:
    num_draft = _number(body, "num_draft", None, low=1, integer=True)
    if num_draft is not None and max_num_draft is not None and num_draft > max_num_draft:
        raise APIError(400, f"num_draft must be at most {max_num_draft} on this server "
                            f"(mlxspec serve --max-num-draft), got {num_draft}",
                       param="num_draft")
    return num_draft


@functools.lru_cache(maxsize=8)
def longest_token_bytes(tokenizer) -> int:
    """An upper bound on the bytes one token covers: its vocabulary string's UTF-8 length (a
    byte-level BPE or SentencePiece string spells each byte in one or more characters)."""
    return max((len(piece.encode("utf-8", "surrogatepass")) for piece in tokenizer.get_vocab()),
               default=1)


def _surely_too_long(texts: list[str], tokenizer, context_length: int | None, where: str):
    """Refuse text that must exceed the context window before it is tokenised (a 3.8 MB message
    took seconds of CPU to find that out): it holds at least bytes / longest_token_bytes tokens."""
    if context_length is None:
        return
    size = sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)
    at_least = -(-size // longest_token_bytes(tokenizer))
    if at_least > context_length:
        raise APIError(400, f"the {where} is {size} bytes, at least {at_least} tokens; this "
                            f"model's context window is {context_length}", param=where,
                       code="context_length_exceeded")


def _prompt(body: dict, chat: bool, tokenizer, tools: list | None,
            context_length: int | None) -> list[int]:
    if chat:
        messages = _chat_messages(body.get("messages"))
        _surely_too_long([m["content"] for m in messages], tokenizer, context_length, "messages")
        if tools is None:
            return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        return list(tokenizer.apply_chat_template(messages, tools=tools,
                                                  add_generation_prompt=True))
    text = body.get("prompt")
    if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
        text = text[0]
    if not isinstance(text, str):
        raise APIError(400, "prompt must be a string", param="prompt")
    _surely_too_long([text], tokenizer, context_length, "prompt")
    tokens = encode_prompt(tokenizer, text)
    if not tokens:  # "" with a tokenizer that adds no BOS: nothing to continue
        raise APIError(400, "the prompt is empty: send at least one character", param="prompt")
    return tokens


def _rendered_tools(body: dict, chat: bool, tokenizer) -> list[dict] | None:
    """The tools to render into the prompt and parse out of the output, or None. tool_choice
    "none" renders none and parses none: the model is told of no tool, so a call is unlikely,
    and any it still writes is returned as text (nothing can forbid it without constrained
    decoding)."""
    if not chat:
        return None
    tools = _tools(body.get("tools"), tokenizer)
    if _tool_choice(body.get("tool_choice")) == "none":
        return None
    return tools


def parse_request(body, *, chat: bool, tokenizer, context_length: int | None,
                  drafters: tuple[str, ...], max_num_draft: int | None = None,
                  kv_quantization: tuple[int, int] | None = None) -> GenerationRequest:
    """Check an OpenAI chat-completions (`chat`) or completions body for the served model;
    `kv_quantization` (bits, group size) is the server's (serve --kv-bits)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_fields(body, chat)
    _number(body, "n", 1, integer=True)
    drafter = body.get("drafter")
    if drafter is not None and drafter not in drafters:
        raise APIError(400, f"unknown drafter {drafter!r}; this server offers "
                            f"{', '.join(drafters)}", param="drafter")
    stream = _boolean(body.get("stream"), "stream")
    # The cheap checks first; the prompt is rendered last.
    sampling = dict(temp=_number(body, "temperature", 1.0, low=0, high=2),
                    top_p=_number(body, "top_p", 1.0),  # their ranges are the sampler's, below
                    top_k=_number(body, "top_k", 0, integer=True),
                    min_p=_number(body, "min_p", 0.0), seed=_seed(body))
    stop, include_usage = _stops(body), _include_usage(body, stream)
    num_draft, logprobs = _num_draft(body, max_num_draft), _logprobs(body, chat)
    # false: every step drafts num_draft (a fixed K), as `mlxspec generate --fixed-k`
    adaptive = _boolean(body.get("adaptive"), "adaptive", default=True)
    try:  # the sampler's own checks (top_p in (0, 1], ...), in its words
        sampling = SamplingConfig(**sampling)
    except (TypeError, ValueError) as err:
        raise APIError(400, str(err), param=str(err).split(" ")[0]) from None
    tools = _rendered_tools(body, chat, tokenizer)
    prompt = _prompt(body, chat, tokenizer, tools, context_length)
    max_tokens = _max_tokens(body, chat, prompt, context_length)
    prediction = _prediction(body, lambda text: tokenizer.encode(text, add_special_tokens=False))
    bits, group_size = kv_quantization or (None, 64)
    generation = Request(max_tokens, sampling, num_draft=num_draft, adaptive=adaptive,
                         logprobs=logprobs, kv_bits=bits, kv_group_size=group_size)
    return GenerationRequest(chat=chat, prompt=prompt, generation=generation, stop=stop,
                             stream=stream, include_usage=include_usage, drafter=drafter,
                             prediction=prediction, tools=tools)
