"""`mlxspec serve` against abuse, on loopback: deep JSON, slow chat templates, handler failures,
exposure without a key, /metrics behind the key, and a seeded fuzz of the request parser."""

import json
import random
import socket
import threading

import pytest
from test_server import MODEL_ID, Running, http, post_json, read_until, reference

from mlxspec.server import check_exposure, make_server
from mlxspec.server.guards import MAX_JSON_DEPTH, RenderSlots, is_loopback, json_too_deep

HELLO = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 2,
         "temperature": 0}


@pytest.fixture(scope="module")
def served(smollm):
    model, tokenizer = smollm
    server = make_server(model, tokenizer, drafter="lookup", model_id=MODEL_ID)
    running = Running(server)
    yield running, server
    running.stop()


def assert_openai_error(reply, status: int, code: str | None = None, param="any") -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert code is None or error["code"] == code, error
    assert param == "any" or error["param"] == param, error
    return error


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# ---- 1. JSON depth ----

def test_depth_scan_counts_brackets_outside_strings_only():
    assert not json_too_deep(nested(MAX_JSON_DEPTH).encode())
    assert json_too_deep(nested(MAX_JSON_DEPTH + 1).encode())
    assert json_too_deep(b"[" * 100_000)  # never closed: json would recurse on it all the same
    assert not json_too_deep(json.dumps({"a": "[{" * 100, "b": ['"]' * 100]}).encode(), 2)
    assert not json_too_deep(b'["\\"[[["]', 1)  # an escaped quote does not end the string
    assert json_too_deep(b'["\\\\", [[]]]', 2)  # an escaped backslash does not escape the quote
    assert not json_too_deep(b'{"a": [{"b": [1]}]}', 4) and json_too_deep(b'{"a": [{"b": [1]}]}', 3)


@pytest.mark.parametrize("body", [b"[" * 100_000, json.dumps({**HELLO, "x": json.loads(
    nested(MAX_JSON_DEPTH))}).encode()], ids=["unclosed", "closed"])
def test_a_deeply_nested_body_is_400_not_a_recursion_error(served, body):
    running, _ = served
    assert_openai_error(post_json(running.url + "/v1/chat/completions", body), 400,
                        "json_too_deep")
    assert post_json(running.url + "/v1/chat/completions", json.dumps(HELLO)).status_code == 200


# ---- 2. rendering off the event loop, under a time limit, in bounded slots ----

class StuckTemplate:
    """The served tokenizer with a chat template that does not return until released: what a
    template with nested range(100000) loops does, without burning a core in the test."""

    def __init__(self, tokenizer):
        self.inner, self.entered, self.release = tokenizer, threading.Event(), threading.Event()

    def apply_chat_template(self, *args, **kwargs):
        self.entered.set()
        self.release.wait(120)
        return self.inner.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_stuck_template_keeps_the_loop_free_and_gets_400_then_its_slot_bounds_the_rest(
        served, monkeypatch):
    running, server = served
    stuck = StuckTemplate(server.tokenizer)
    monkeypatch.setattr(server, "tokenizer", stuck)
    monkeypatch.setattr(server, "render_slots", RenderSlots(slots=1, seconds=1.0))
    result = {}
    asker = threading.Thread(target=lambda: result.update(reply=post_json(
        running.url + "/v1/chat/completions", json.dumps(HELLO))))
    try:
        asker.start()
        assert stuck.entered.wait(60)
        # The loop answers while the render is stuck in its thread (it was stuck on the loop).
        assert http("GET", running.url + "/health", timeout=10).status_code == 200
        asker.join(60)
        assert_openai_error(result["reply"], 400, "render_timeout", "messages")
        # The runaway render still holds the only slot: the next request waits, then gets 429.
        completion = json.dumps({"prompt": "Hi", "max_tokens": 1})
        assert_openai_error(post_json(running.url + "/v1/completions", completion), 429,
                            "render_slots_busy")
    finally:
        stuck.release.set()
    asker.join(60)
    assert post_json(running.url + "/v1/completions", completion).status_code == 200


def test_a_big_body_renders_in_its_own_slot_and_never_holds_up_normal_requests(
        served, monkeypatch):
    running, server = served
    stuck = StuckTemplate(server.tokenizer)
    monkeypatch.setattr(server, "tokenizer", stuck)
    monkeypatch.setattr(server, "render_slots", RenderSlots(slots=1, seconds=5.0))
    big = json.dumps({"messages": [{"role": "user", "content": "word " * 60_000}],
                      "max_tokens": 1})  # 300 KB
    result = {}
    asker = threading.Thread(target=lambda: result.update(reply=post_json(
        running.url + "/v1/chat/completions", big)))
    try:
        asker.start()
        assert stuck.entered.wait(60)
        reply = post_json(running.url + "/v1/completions", json.dumps(
            {"prompt": "Hi", "max_tokens": 1}))  # no chat template: not stuck
        assert reply.status_code == 200, reply.text
    finally:
        stuck.release.set()
    asker.join(60)
    assert result["reply"].status_code == 400


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"),
                    reason="threads are reniced on Linux only")
def test_background_slots_render_at_the_lowest_cpu_priority():
    import asyncio
    import os

    def priority():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def both():
        return [await RenderSlots(1, 30.0, background=b).run(priority, param="x")
                for b in (True, False)]

    assert asyncio.run(both()) == [19, os.getpriority(os.PRIO_PROCESS, 0)]


def test_render_slots_refuse_nonsense_settings():
    for slots, seconds in ((0, 1.0), (True, 1.0), (2, 0), (2, float("inf")), (2, "10")):
        with pytest.raises(ValueError):
            RenderSlots(slots, seconds)


# ---- 3. any handler failure is a JSON error ----

def test_an_unexpected_handler_failure_is_an_openai_shaped_500(served, monkeypatch):
    running, server = served

    def broken(job):
        raise RuntimeError("boom")

    monkeypatch.setattr(server.worker, "submit", broken)
    error = assert_openai_error(post_json(running.url + "/v1/chat/completions",
                                          json.dumps(HELLO)), 500, "internal_error")
    assert error["type"] == "server_error" and "boom" not in error["message"]
    monkeypatch.undo()
    assert post_json(running.url + "/v1/chat/completions", json.dumps(HELLO)).status_code == 200


# ---- 4. exposure without a key ----

@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"])
def test_loopback_needs_no_key(host):
    assert is_loopback(host) and check_exposure(host, None) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "example.org", ""])
def test_beyond_loopback_without_a_key_is_refused_unless_said_insecure(host):
    with pytest.raises(ValueError, match="--api-key.*--insecure-no-api-key"):
        check_exposure(host, None)
    assert check_exposure(host, "k") is None
    assert check_exposure(host, None, insecure=True).startswith("Warning: serving on")


def test_cli_serve_refuses_an_exposed_host_without_a_key_before_loading(monkeypatch):
    from click.testing import CliRunner

    from mlxspec.cli.main import main

    monkeypatch.delenv("MLXSPEC_API_KEY", raising=False)
    result = CliRunner().invoke(main, ["serve", "--host", "0.0.0.0", "-m", "/nonexistent/model"])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: --host 0.0.0.0 exposes")


# ---- 5. /metrics behind the key ----

def test_metrics_need_the_key_and_health_stays_open(smollm):
    model, tokenizer = smollm
    running = Running(make_server(model, tokenizer, model_id=MODEL_ID, api_key="s3cret"))
    try:
        assert_openai_error(http("GET", running.url + "/metrics"), 401, "invalid_api_key")
        allowed = http("GET", running.url + "/metrics",
                       headers={"Authorization": "Bearer s3cret"})
        assert allowed.status_code == 200 and "mlxspec_requests_total" in allowed.text
        assert http("GET", running.url + "/health").json()["status"] == "ok"
    finally:
        running.stop()


# ---- 6. a seeded fuzz of the request parser ----

FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "seed", "stop", "stream", "stream_options", "drafter",
          "num_draft", "adaptive", "n", "prediction", "logprobs", "top_logprobs", "tools", "tool_choice",
          "response_format", "user", "frequency_penalty", "presence_penalty"]
WEIRD = [None, True, False, 0, -1, 1, 2**63, 10**30, -(10**30), 1e308, -1e308, 0.5, "", "x",
         "false", "\u0000", "\ud7ff\ue000😀" * 20, "é" * 5000, [], {}, [1, "a", None],
         {"type": "content"}, {"include_usage": "false"}, [{"role": "user"}],
         [{"role": "user", "content": 7}], [{"role": 1, "content": "hi"}],
         [{"role": "user", "content": [{"type": "text", "text": 3}]}],
         [{"type": "function", "function": {"name": 5}}], json.loads(nested(40))]
CONTENT_TYPES = ["application/json", "text/plain", "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=x", None]


def valid_body(rng: random.Random, chat: bool) -> dict:
    body = {"max_tokens": rng.choice([1, 2]), "temperature": rng.choice([0, 0.7])}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(["Hi", "Count: 1 2", "é"])}]
    else:
        body["prompt"] = rng.choice(["Hi", "def f(x):", "ü"])
    if rng.random() < 0.3:
        body["stream"] = True
    return body


def mutated(rng: random.Random, chat: bool) -> bytes:
    """One fuzz body: a valid body with a field set to a weird value, or its bytes damaged."""
    body = valid_body(rng, chat)
    kind = rng.randrange(7)
    if kind <= 2:
        for _ in range(rng.randint(1, 3)):
            body[rng.choice(FIELDS)] = rng.choice(WEIRD)
        if "max_tokens" not in body or rng.random() < 0.5:
            body["max_tokens"] = 1  # keep generations tiny; weird values above still land
    if kind == 3:  # a number literal of up to 5000 digits (json refuses over 4300)
        body[rng.choice(FIELDS + ["max_tokens"] * 5)] = "NUMBER"
    raw = json.dumps(body, ensure_ascii=rng.random() < 0.5).encode()
    if kind == 4:  # truncated, a byte flipped, bytes inserted
        cut = rng.randrange(len(raw))
        raw = raw[:cut] + bytes([rng.randrange(256)]) * rng.randint(0, 3) + raw[cut + 1:]
    if kind == 5:
        raw = rng.choice([b"", b"null", b"[]", b"42", b'"s"', b"{", b"\xff\xfe", b"NaN",
                          b"[" * 100_000, b'{"messages": ' * 70, nested(65).encode(),
                          b'{"prompt": "x", "max_tokens": 1e999}', b"{}" * 3,
                          b'{"prompt": "\\ud800", "max_tokens": 1}'])
    if kind == 3:
        raw = raw.replace(b'"NUMBER"', b"9" * rng.randint(10, 5000) + rng.choice([b"", b".5e3"]))
    return raw


def post_raw(port: int, path: str, raw: bytes, content_type) -> tuple[int, bytes]:
    """POST by hand: any content type (or none), the reply (a stream too) read to its end."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        headers = {"Content-Type": content_type} if content_type else {}
        connection.request("POST", path, body=raw, headers=headers)
        reply = connection.getresponse()
        return reply.status, reply.read()
    finally:
        connection.close()


def check_reply(status: int, payload: bytes, raw: bytes) -> None:
    context = raw[:300]
    assert status in (200, 400, 404, 413, 429), (status, payload[:300], context)
    if status != 200:
        error = json.loads(payload)["error"]
        assert set(error) == {"message", "type", "param", "code"}, (error, context)
        assert isinstance(error["message"], str) and error["message"], context
        assert status != 404 or error["code"] == "model_not_found", (error, context)
        return
    if payload.startswith(b"data: "):  # a stream: chunks to [DONE], no error among them
        events = [line[6:] for line in payload.split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]", (payload[-300:], context)
        assert all("error" not in json.loads(event) for event in events[:-1]), context
    else:
        assert json.loads(payload)["choices"], context


def test_fuzzed_bodies_get_only_openai_shaped_answers_and_the_server_lives(served, smollm):
    running, _ = served
    rng = random.Random(37)
    failures = []
    for i in range(300):
        chat = i % 2 == 0
        raw = mutated(rng, chat)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        status, payload = post_raw(running.port, path, raw, rng.choice(CONTENT_TYPES))
        try:
            check_reply(status, payload, raw)
        except (AssertionError, ValueError, KeyError) as err:  # all of them, then one report
            failures.append(f"{path}: {err}")
    assert not failures, f"{len(failures)} of 300 bodies:\n" + "\n".join(failures[:20])
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    after = post_json(running.url + "/v1/chat/completions", json.dumps(
        {"messages": messages, "max_tokens": 8, "temperature": 0}))
    assert after.json()["choices"][0]["message"]["content"] == reference(smollm, messages, 8)


def test_an_oversized_body_without_content_length_is_413(served):
    """Chunked transfer: the size is found while reading, not from a header."""
    running, _ = served
    with socket.create_connection(("127.0.0.1", running.port), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 65536
        for _ in range(70):  # 4.4 MB
            try:
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except (BrokenPipeError, ConnectionResetError):
                break  # the server answered and closed
        reply = read_until(s, b"body_too_large")
    assert reply.startswith(b"HTTP/1.1 413") and b"body_too_large" in reply


def test_an_empty_completion_prompt_is_400_naming_prompt(served):
    """"" tokenises to nothing with SmolLM2 (no BOS is added): the worker used to answer 500."""
    running, _ = served
    reply = post_json(running.url + "/v1/completions", json.dumps({"prompt": "", "max_tokens": 2}))
    error = assert_openai_error(reply, 400, param="prompt")
    assert error["message"].startswith("the prompt is empty")
