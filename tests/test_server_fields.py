"""The OpenAI fields of `mlxspec serve`: every field honoured or refused with a 400 naming it,
logprobs (plain and streamed) equal to the target's, and tool calls parsed out of the output.

A tiny random target with SmolLM2's tokenizer keeps each server cheap; the tool-call tests give
that tokenizer a chat template with a tool-call format (Qwen's `<tool_call>` JSON, which mlx-lm
infers as its json_tools parser) and script the model's output by standing in for
stream_request, which the worker calls per request: what is tested is everything after it."""

import json
import shutil
import sys

import mlx.core as mx
import pytest

pytest.importorskip("uvicorn", reason="mlxspec serve needs the server extra")

from test_request_checks import tiny  # noqa: E402,F401  (a fixture: the tiny llama)
from test_server import Running, post_json  # noqa: E402

from mlxspec.generate import GenerationResponse, stream_generate  # noqa: E402
from mlxspec.sampling import SamplingConfig  # noqa: E402
from mlxspec.backends.mlx.sampling import processed_logprobs  # noqa: E402
from mlxspec.server import make_server  # noqa: E402

HI = [{"role": "user", "content": "hi"}]
GENERATE = sys.modules["mlxspec.generate"]  # the module (mlxspec.generate is the function)
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

TOOL_TEMPLATE = """
{%- if tools %}<|im_start|>system
<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>
Call a function as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
{{- "</tool_call>" }}
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def served(tiny):
    model, tokenizer = tiny
    running = Running(make_server(model, tokenizer, drafter="lookup", model_id="tiny",
                                  max_num_draft=8))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def tool_tokenizer(smollm_dir, tmp_path_factory):
    from mlx_lm.utils import load_tokenizer

    out = tmp_path_factory.mktemp("tool_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm_dir / name, out / name)
    (out / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    tokenizer = load_tokenizer(out)
    assert tokenizer.has_tool_calling and tokenizer.tool_call_start == "<tool_call>"
    return tokenizer


@pytest.fixture(scope="module")
def tool_served(tiny, tool_tokenizer):
    model, _ = tiny
    running = Running(make_server(model, tool_tokenizer, model_id="tiny"))
    yield running
    running.stop()


def chat(running, body: dict, *, path="/v1/chat/completions"):
    return post_json(running.url + path, json.dumps(body))


def events(reply) -> list[dict]:
    """The JSON chunks of a server-sent-events reply, [DONE] checked and left out."""
    lines = [line[len("data: "):] for line in reply.text.split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---- refusals: each names its field ----

@pytest.mark.parametrize("path, extra, param, code", [
    ("chat", {"frobnicate": 1}, "frobnicate", None),
    ("chat", {"presence_penalty": 0.5}, "presence_penalty", None),
    ("chat", {"frequency_penalty": -1}, "frequency_penalty", None),
    ("chat", {"logit_bias": {"42": 10}}, "logit_bias", None),
    ("chat", {"n": 3}, "n", None),
    ("chat", {"parallel_tool_calls": False}, "parallel_tool_calls", None),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format", None),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", None),
    ("chat", {"functions": [{"name": "f"}]}, "functions", None),
    ("chat", {"store": True}, "store", None),
    ("chat", {"user": 42}, "user", None),
    ("chat", {"stream": True, "stream_options": {"include_usage": "false"}},
     "stream_options.include_usage", None),
    ("chat", {"seed": -1}, "seed", None),
    ("chat", {"seed": 10**20}, "seed", None),
    ("chat", {"max_tokens": 10**9}, "max_tokens", "context_length_exceeded"),
    ("chat", {"max_completion_tokens": 600}, "max_completion_tokens",
     "context_length_exceeded"),
    ("chat", {"num_draft": 10**7}, "num_draft", None),
    ("chat", {"num_draft": 9}, "num_draft", None),  # over this server's --max-num-draft
    ("chat", {"adaptive": "false"}, "adaptive", None),
    ("chat", {"prediction": {"type": "content", "content": [{"type": "text", "text": 5}]}},
     "prediction.content", None),
    ("chat", {"top_logprobs": 2}, "top_logprobs", None),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    ("chat", {"logprobs": "yes"}, "logprobs", None),
    ("chat", {"tools": [WEATHER]}, "tools", None),  # SmolLM2's template has no tool format
    ("chat", {"tool_choice": "required"}, "tool_choice", None),
    ("chat", {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice", None),
    ("completions", {"logprobs": 6}, "logprobs", None),
    ("completions", {"logprobs": True}, "logprobs", None),
    ("completions", {"echo": True}, "echo", None),
    ("completions", {"best_of": 2}, "best_of", None),
    ("completions", {"suffix": "end"}, "suffix", None),
    ("completions", {"messages": HI}, "messages", None),
])
def test_unsupported_fields_are_refused_by_name(served, path, extra, param, code):
    body = {"messages": HI} if path == "chat" else {"prompt": "hi"}
    reply = chat(served, {**body, "max_tokens": 2, **extra}, path=PATHS[path])
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["code"] == code, error
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_harmless_fields_are_accepted(served):
    """No-ops by definition, and OpenAI's defaults of the refused ones."""
    reply = chat(served, {"messages": HI, "max_tokens": 2, "user": "someone",
                          "metadata": {"k": "v"}, "presence_penalty": 0, "frequency_penalty": 0,
                          "logit_bias": {}, "n": 1, "store": False, "parallel_tool_calls": True,
                          "response_format": {"type": "text"}, "tool_choice": "auto",
                          "seed": 2**64 - 1, "num_draft": 8, "adaptive": False,
                          "stream": True,
                          "stream_options": {"include_usage": False}})
    assert reply.status_code == 200, reply.text
    assert "usage" not in events(reply)[-1]


# ---- logprobs ----

def reference_logprobs(model, prompt: list[int], tokens: list[int], sampling: SamplingConfig):
    """The target's log-probabilities at each generated position: raw log-softmax when greedy,
    the processed distribution otherwise."""
    logits = model(mx.array([prompt + tokens]))[0, len(prompt) - 1 : -1].astype(mx.float32)
    if sampling.greedy:
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return processed_logprobs(logits, sampling)


def generated_tokens(model, tokenizer, prompt, max_tokens, **options) -> list[int]:
    """The tokens mlxspec.stream_generate emits (not the end-of-sequence token)."""
    tokens, counted = [], 0
    for r in stream_generate(model, tokenizer, prompt, max_tokens, **options):
        if r.generation_tokens > counted:
            tokens.append(r.token)
            counted = r.generation_tokens
    return tokens


@pytest.mark.parametrize("options", [{"temperature": 0}, {"temperature": 0.8, "top_k": 50,
                                                          "seed": 3}])
def test_chat_logprobs_are_the_targets(served, tiny, options):
    model, tokenizer = tiny
    body = {"messages": HI, "max_tokens": 8, "logprobs": True, "top_logprobs": 3,
            "drafter": "none", **options}
    whole = chat(served, body)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == whole.json()["usage"]["completion_tokens"]
    raw = bytes(b for e in content for b in e["bytes"])  # the detokenizer drops a leading space
    assert raw.decode(errors="replace").lstrip() == choice["message"]["content"].lstrip()
    prompt = list(tokenizer.apply_chat_template(HI, add_generation_prompt=True))
    sampling = SamplingConfig(temp=options["temperature"], top_k=options.get("top_k", 0))
    ids = generated_tokens(model, tokenizer, prompt, 8, temp=sampling.temp,
                           top_k=sampling.top_k, seed=options.get("seed"))
    assert len(ids) == len(content)
    want = reference_logprobs(model, prompt, ids, sampling)
    got = mx.array([e["logprob"] for e in content])
    assert mx.allclose(got, want[mx.arange(len(ids)), mx.array(ids)], atol=1e-4).item()
    best = mx.sort(want, axis=-1)[:, ::-1][:, :3]
    tops = mx.array([[t["logprob"] for t in e["top_logprobs"]] for e in content])
    assert mx.allclose(tops, best, atol=1e-4).item()

    streamed = chat(served, {**body, "stream": True})
    chunks = [c["choices"][0] for c in events(streamed) if c["choices"]]
    pieces = [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]]
    assert pieces == content  # the same tokens, each in the chunk that returned its text


def test_token_bytes_are_the_tokens_own(tiny):
    """An emoji split across byte-level tokens: each token has its own bytes, which add up to
    the character's (decoding a token alone would give U+FFFD's bytes)."""
    from mlxspec.server.logprobs import TokenNames

    _, tokenizer = tiny
    names = TokenNames(tokenizer)
    ids = tokenizer.encode(" h\u00e9llo \U0001F600", add_special_tokens=False)
    raw = b"".join(bytes(names(i)[1]) for i in ids)
    assert raw == " h\u00e9llo \U0001F600".encode() and len(ids) > 4


def test_completion_logprobs_shape_and_offsets(served, tiny):
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    whole = chat(served, body, path="/v1/completions")
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 6
    assert all(len(top) <= 2 and max(top.values()) >= lp - 1e-6
               for top, lp in zip(logprobs["top_logprobs"], logprobs["token_logprobs"]))
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(
        logprobs["text_offset"])
    streamed = chat(served, {**body, "stream": True}, path="/v1/completions")
    chunks = [c["choices"][0] for c in events(streamed)]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    assert [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]] == \
        logprobs["tokens"]
    assert [t for c in chunks if c["logprobs"] for t in c["logprobs"]["text_offset"]] == \
        logprobs["text_offset"]


def test_logprobs_follow_the_text_a_stop_string_cuts(served):
    """The tokens whose text was returned, at least in part, and none after."""
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "logprobs": 0}
    full = chat(served, body, path="/v1/completions").json()["choices"][0]
    text, offsets = full["text"], full["logprobs"]["text_offset"]
    # A stop string across two tokens' texts: the first's last character, the next's first.
    cut = next(o for o in offsets[1:] if o > 0 and text.find(text[o - 1 : o + 1]) == o - 1)
    stop = text[cut - 1 : cut + 1]
    returned = cut - 1
    ends = offsets[1:] + [len(text)]
    wanted = [o for o, end in zip(offsets, ends) if o < returned or end <= returned]
    for stream in (False, True):
        reply = chat(served, {**body, "stop": stop, "stream": stream}, path="/v1/completions")
        chunks = [c["choices"][0] for c in events(reply)] if stream else \
            [reply.json()["choices"][0]]
        got = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
        assert "".join(c["text"] for c in chunks) == text[:returned]
        assert got == wanted and len(got) < len(offsets)


# ---- tool calls ----

def scripted(text: str):
    """A stand-in for stream_request that "generates" `text` then the end-of-sequence token,
    with the responses stream_request gives (one per token, text through the detokenizer)."""
    def generate(model, tokenizer, prompt, request, **options):
        max_tokens = request.max_tokens
        ids = tokenizer.encode(text, add_special_tokens=False)
        detokenizer = tokenizer.detokenizer
        detokenizer.reset()

        def response(token, n, reason=None):
            return GenerationResponse(text=detokenizer.last_segment, token=token,
                                      from_draft=False, prompt_tokens=len(prompt), prompt_tps=0,
                                      generation_tokens=n, generation_tps=0, peak_memory=0,
                                      finish_reason=reason)

        for n, token in enumerate(ids[:max_tokens], 1):
            detokenizer.add_token(token)
            yield response(token, n)
        detokenizer.finalize()
        yield response(next(iter(tokenizer.eos_token_ids)), min(len(ids), max_tokens), "stop")

    return generate


CALL_OUTPUT = ('Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
               '</tool_call>')


def test_tool_calls_are_parsed_whole_and_streamed(tool_served, tool_tokenizer, monkeypatch):
    prompts = []
    real = scripted(CALL_OUTPUT)

    def generate(model, tokenizer, prompt, request, **options):
        prompts.append(tokenizer.decode(prompt))
        yield from real(model, tokenizer, prompt, request, **options)

    monkeypatch.setattr(GENERATE, "stream_request", generate)
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
            "max_tokens": 64}
    whole = chat(tool_served, body)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert '"name": "get_weather"' in prompts[0] and "<tools>" in prompts[0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}

    streamed = events(chat(tool_served, {**body, "stream": True}))
    deltas = [c["choices"][0] for c in streamed if c["choices"]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Let me look."
    calls = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
    assert [(t["index"], t["function"]["name"], json.loads(t["function"]["arguments"]))
            for t in calls] == [(0, "get_weather", {"city": "Paris"})]
    assert deltas[-1]["finish_reason"] == "tool_calls"

    # tool_choice "none": no tools rendered, nothing parsed (the text stays text).
    none = chat(tool_served, {**body, "tool_choice": "none"}).json()["choices"][0]
    assert "<tools>" not in prompts[-1]
    assert none["message"]["content"] == CALL_OUTPUT and none["finish_reason"] == "stop"


def test_a_call_that_does_not_parse_is_returned_as_text(tool_served, monkeypatch):
    broken = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": '
    monkeypatch.setattr(GENERATE, "stream_request", scripted(broken))
    reply = chat(tool_served, {"messages": HI, "tools": [WEATHER], "max_tokens": 64})
    choice = reply.json()["choices"][0]
    assert choice["message"]["content"] == broken and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


def test_tool_results_and_earlier_calls_reach_the_template(tool_served, monkeypatch):
    prompts = []

    def generate(model, tokenizer, prompt, request, **options):
        prompts.append(tokenizer.decode(prompt))
        yield from scripted("It is sunny.")(model, tokenizer, prompt, request)

    monkeypatch.setattr(GENERATE, "stream_request", generate)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    reply = chat(tool_served, {"messages": messages, "tools": [WEATHER], "max_tokens": 64})
    assert reply.json()["choices"][0]["message"] == {"role": "assistant",
                                                     "content": "It is sunny."}
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' \
        in prompts[0]
    assert "<tool_response>sunny, 21 C</tool_response>" in prompts[0]
    bad = chat(tool_served, {"messages": [messages[0], {**messages[1], "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}],
        "tools": [WEATHER]})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


def test_serve_refuses_a_bad_max_num_draft(tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="max_num_draft must be >= 1"):
        make_server(model, tokenizer, max_num_draft=0)


def test_cli_max_num_draft_is_checked_before_the_model_loads():
    from click.testing import CliRunner

    from mlxspec.cli.main import main

    result = CliRunner().invoke(main, ["serve", "--max-num-draft", "0"])
    assert result.exit_code == 2 and "--max-num-draft" in result.output and "x>=1" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("flags, words", [
    (["--kv-bits", "7"], "kv_bits must be one of"),
    (["--kv-bits", "4", "--kv-group-size", "48"], "kv_group_size must be one of"),
    (["--kv-bits", "4", "--backend", "torch"], "quantizes MLX caches"),
])
def test_cli_kv_bits_is_checked_before_the_model_loads(flags, words):
    from click.testing import CliRunner

    from mlxspec.cli.main import main

    result = CliRunner().invoke(main, ["serve", *flags])
    assert result.exit_code == 2 and words in result.output, result.output
    assert "Traceback" not in result.output
