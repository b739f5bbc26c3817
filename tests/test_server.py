"""`mlxspec serve` against real clients on loopback: the official `openai` package and plain
HTTP. The server runs in this process on a free port (uvicorn in a thread); greedy replies are
compared with `mlxspec.stream_generate` on the same prompt, for none, lookup and dflash."""

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai", reason="the client tests need openai (pip install .[test])")
uvicorn = pytest.importorskip("uvicorn", reason="mlxspec serve needs the server extra")

import mlxspec  # noqa: E402
from mlxspec.server import make_server  # noqa: E402

MODEL_ID = "SmolLM2-135M-Instruct"
QUESTION = "Write a Python function that returns the square of a number."
CODE = '''def area(width, height):
    """Return the area of a rectangle."""
    return width * height


def perimeter(width, height):
    """Return the perimeter of a rectangle."""
    return 2 * (width + height)
'''


class Reply:
    """A plain HTTP reply (urllib: no client library between the test and the server)."""

    def __init__(self, status: int, body: bytes):
        self.status_code, self.text = status, body.decode()

    def json(self):
        return json.loads(self.text)


def http(method: str, url: str, body: bytes | None = None, headers=None, timeout=120) -> Reply:
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return Reply(response.status, response.read())
    except urllib.error.HTTPError as err:
        return Reply(err.code, err.read())


def post_json(url: str, content: bytes | str, timeout=120) -> Reply:
    data = content.encode() if isinstance(content, str) else content
    return http("POST", url, data, {"content-type": "application/json"}, timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """A server in a thread, stopped (and its worker joined) when the test module ends."""

    def __init__(self, server):
        self.port = free_port()
        config = uvicorn.Config(server.app(), host="127.0.0.1", port=self.port, log_level="error")
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.uvicorn.started:
            if time.time() > deadline:
                raise RuntimeError("the server did not start in 30 s")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def served(smollm):
    model, tokenizer = smollm
    server = make_server(model, tokenizer, drafter="dflash", model_id=MODEL_ID)
    running = Running(server)
    yield running, server
    running.stop()


@pytest.fixture(scope="module")
def client(served):
    running, _ = served
    return openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def reference(smollm, messages, max_tokens, drafter=None):
    model, tokenizer = smollm
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return "".join(r.text for r in mlxspec.stream_generate(model, tokenizer, prompt, max_tokens,
                                                           drafter=drafter))


@pytest.mark.parametrize("drafter", ["none", "lookup", "dflash"])
def test_greedy_chat_equals_generate(client, smollm, drafter):
    messages = [{"role": "user", "content": QUESTION}]
    reply = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=32,
                                           temperature=0, extra_body={"drafter": drafter})
    assert reply.choices[0].message.content == reference(smollm, messages, 32)
    assert reply.choices[0].finish_reason in ("length", "stop")
    usage = reply.usage
    assert usage.completion_tokens == 32 or reply.choices[0].finish_reason == "stop"
    assert usage.prompt_tokens > 10
    extra = usage.model_extra["mlxspec"]
    assert extra["drafter"] == drafter and extra["target_passes"] >= 1
    details = usage.completion_tokens_details
    if drafter == "none":
        assert details.accepted_prediction_tokens == details.rejected_prediction_tokens == 0


def test_streaming_chat_chunks_add_up_and_carry_usage(client, smollm):
    messages = [{"role": "user", "content": QUESTION}]
    stream = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=24,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference(smollm, messages, 24)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_completions_plain_and_streamed(client, smollm):
    model, tokenizer = smollm
    prompt = "def fibonacci(n):"
    want = "".join(r.text for r in mlxspec.stream_generate(model, tokenizer, prompt, 20))
    whole = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=20, temperature=0)
    assert whole.choices[0].text == want and whole.usage.completion_tokens == 20
    pieces = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=20,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in pieces) == want


def test_stop_strings_end_the_reply_before_them(client, smollm):
    messages = [{"role": "user", "content": QUESTION}]
    full = reference(smollm, messages, 48)
    cut = full.index("(")  # a stop inside the text, likely inside an accepted block
    stop = full[cut : cut + 3]
    for stream in (False, True):
        reply = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=48,
                                               temperature=0, stop=[stop, "\x00never"],
                                               stream=stream)
        if stream:
            chunks = list(reply)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            text, reason = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert text == full[:cut] and reason == "stop"


def test_prediction_raises_acceptance_and_leaves_the_output_alone(client, smollm):
    """Predicted outputs (an edit of a file the client sends as the prediction): the same
    reply, with more drafts accepted than without it."""
    messages = [{"role": "user", "content": "Repeat this code exactly, with no comment:\n\n" + CODE}]
    plain = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=64,
                                           temperature=0, extra_body={"drafter": "none"})
    predicted = client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=64, temperature=0,
        prediction={"type": "content", "content": CODE}, extra_body={"drafter": "none"})
    assert predicted.choices[0].message.content == plain.choices[0].message.content
    accepted = predicted.usage.completion_tokens_details.accepted_prediction_tokens
    assert accepted > 10
    assert predicted.usage.model_extra["mlxspec"]["target_passes"] < \
        plain.usage.model_extra["mlxspec"]["target_passes"]


def test_a_follow_up_turn_prefills_only_its_new_tokens(client, smollm):
    """The kept cache of the conversation's first turn serves its second: the prompt tokens it
    held are reported as cached (OpenAI's prompt_tokens_details) and the reply is unchanged."""
    first = [{"role": "user", "content": "Name three colors."}]
    one = client.chat.completions.create(model=MODEL_ID, messages=first, max_tokens=16,
                                         temperature=0, extra_body={"drafter": "lookup"})
    follow = first + [{"role": "assistant", "content": one.choices[0].message.content},
                      {"role": "user", "content": "And three animals?"}]
    two = client.chat.completions.create(model=MODEL_ID, messages=follow, max_tokens=16,
                                         temperature=0, extra_body={"drafter": "lookup"})
    assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens - 1
    assert two.choices[0].message.content == reference(smollm, follow, 16)


def test_models_health_and_metrics(served, client):
    running, _ = served
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    health = http("GET", running.url + "/health").json()
    assert health["status"] == "ok"
    metrics = http("GET", running.url + "/metrics").text
    assert 'mlxspec_requests_total{endpoint="chat.completions",status="200"}' in metrics
    assert "mlxspec_time_to_first_token_seconds_bucket" in metrics
    assert 'mlxspec_accepted_tokens_total{drafter="dflash"}' in metrics


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "drafter": "medusa"}), 400,
     "drafter"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}), 400,
     "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400,
     "temperature"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 2}), 400, "n"),
    (json.dumps({"messages": []}), 400, "messages"),
    (json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}), 404,
     "model"),
    (json.dumps({"messages": [{"role": "user", "content": "hi " * 9000}]}), 400, "messages"),
])
def test_refused_inputs_get_openai_errors_and_the_server_lives(served, body, status, param):
    running, _ = served
    response = post_json(running.url + "/v1/chat/completions", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    ok = post_json(running.url + "/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
    assert ok.status_code == 200


def test_unknown_route_and_oversized_body(served):
    running, _ = served
    missing = http("GET", running.url + "/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    # A body over the limit is refused from its Content-Length, before it is read.
    with socket.create_connection(("127.0.0.1", running.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 5242880\r\n\r\n{")
        reply = read_until(s, b"body_too_large")
    assert reply.startswith(b"HTTP/1.1 413") and b"body_too_large" in reply


def read_until(sock, marker: bytes) -> bytes:
    """What a raw socket receives until `marker` arrives or the server closes: headers and body
    may come in separate reads."""
    reply = b""
    while marker not in reply:
        data = sock.recv(4096)
        if not data:
            break
        reply += data
    return reply


def test_api_key_is_required_when_set(smollm):
    model, tokenizer = smollm
    running = Running(make_server(model, tokenizer, model_id=MODEL_ID, api_key="s3cret"))
    try:
        denied = http("GET", running.url + "/v1/models")
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        allowed = openai.OpenAI(base_url=running.url + "/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in allowed.models.list().data] == [MODEL_ID]
    finally:
        running.stop()


@pytest.mark.slow  # `mlxspec serve` on SmolLM2, as a process
def test_cli_serve_answers_curl_like_requests_and_drains_on_sigterm():
    """`mlxspec serve` as a process: loopback by default; a request in flight when SIGTERM
    arrives still gets its whole reply; then the process ends, by the signal uvicorn raises
    again once it has shut down (so a supervisor sees why it stopped), with no traceback."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).with_name("mlxspec")
    if not script.exists():
        pytest.skip(f"console script not installed at {script}")
    port = free_port()
    proc = subprocess.Popen([str(script), "serve", "--port", str(port), "--drafter", "lookup"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while True:
            try:
                if http("GET", url + "/health", timeout=5).status_code == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()
            time.sleep(0.5)
        result = {}

        def ask():
            result["reply"] = post_json(url + "/v1/completions", json.dumps(
                {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0}))

        asker = threading.Thread(target=ask)
        asker.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        asker.join(timeout=120)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        reply = result["reply"]
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 48
        stderr = proc.stderr.read().decode()
        assert f"on http://127.0.0.1:{port}/v1" in stderr and "Traceback" not in stderr
    finally:
        if proc.poll() is None:
            proc.kill()


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="needs /proc")
def test_bounded_load_every_request_served_and_the_server_healthy_after(served, client, smollm):
    """32 requests from 16 concurrent clients, streamed and not, a third of the streams dropped
    after two chunks: every finished reply is the greedy reference, none is lost, the queue
    drains, the server answers afterwards and memory returns near where it started."""
    from concurrent.futures import ThreadPoolExecutor

    running, _ = served
    questions = ["Name three colors.", "What is 2 + 2?", "Say hello in French.",
                 "Write a haiku about rain."]
    wanted = {q: reference(smollm, [{"role": "user", "content": q}], 16) for q in questions}
    before = rss_mb()

    def one(i: int):
        question = questions[i % len(questions)]
        messages = [{"role": "user", "content": question}]
        local = openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0,
                              timeout=300)
        mode = i % 3
        if mode == 0:
            reply = local.chat.completions.create(model=MODEL_ID, messages=messages,
                                                  max_tokens=16, temperature=0)
            return "whole", question, reply.choices[0].message.content
        stream = local.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=16,
                                               temperature=0, stream=True)
        if mode == 1:
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            return "stream", question, text
        for n, _ in enumerate(stream):  # a client that leaves early
            if n == 1:
                break
        stream.close()
        return "dropped", question, None

    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(one, range(32)))
    finished = [(q, text) for kind, q, text in results if kind != "dropped"]
    assert len(finished) == 22 and all(text == wanted[q] for q, text in finished)
    deadline = time.time() + 60
    while http("GET", running.url + "/health").json()["queue"] or \
            http("GET", running.url + "/health").json()["busy"]:
        assert time.time() < deadline, "the queue did not drain"
        time.sleep(0.2)
    after = client.chat.completions.create(model=MODEL_ID, messages=[
        {"role": "user", "content": questions[0]}], max_tokens=16, temperature=0)
    assert after.choices[0].message.content == wanted[questions[0]]
    assert rss_mb() - before < 300, (before, rss_mb())


def test_bench_targets_a_running_server(served, tmp_path):
    """`bench --server URL` runs each drafter label through the server as the engine "mlxspec
    serve", beside the in-process rows; labels the server cannot run are skipped, saying why;
    no server at the URL is one line before any model loads."""
    from click.testing import CliRunner

    from mlxspec.cli.main import main

    running, _ = served
    out = tmp_path / "report.json"
    result = CliRunner().invoke(main, [
        "bench", "--drafters", "none,lookup,dflash:tree-budget=4", "--suite", "humaneval",
        "--limit", "1", "--max-tokens", "6", "--temp", "0", "--no-mlx-lm", "--no-llama-cpp",
        "--server", running.url, "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    rows = {(r["engine"], r["drafter"]): r for r in report["results"]}
    for drafter in ("none", "lookup"):
        served_row, own = rows["mlxspec serve", drafter], rows["mlxspec", drafter]
        assert served_row["tokens"] == own["tokens"] > 0  # the same greedy tokens, timed apart
        # Passes may differ: the server's drafter carries its adaptive K from earlier requests.
        assert 0 < served_row["target_passes"] <= served_row["tokens"] + 1
    skipped = {s["engine"]: s["reason"] for s in report["skipped"]}
    assert "own options" in skipped["mlxspec serve dflash:tree-budget=4"]
    refused = CliRunner().invoke(main, ["bench", "--server", f"http://127.0.0.1:{free_port()}"])
    assert refused.exit_code != 0 and "no mlxspec server answers" in refused.output
    assert "Traceback" not in refused.output


def test_a_client_that_leaves_mid_stream_frees_the_model_at_once(served):
    """A 2000-token stream dropped after its first chunks stops at the next step (the whole
    reply would take minutes here), and the next request is served."""
    import openai as client_lib

    running, _ = served
    local = client_lib.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0,
                              timeout=120)
    stream = local.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Tell a very long story."}],
        max_tokens=2000, temperature=0, stream=True, extra_body={"drafter": "none"})
    for n, _ in enumerate(stream):
        if n == 2:
            break
    stream.close()
    left = time.time()
    while http("GET", running.url + "/health").json()["busy"]:
        assert time.time() - left < 15, "the generation went on after its client left"
        time.sleep(0.1)
    after = local.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=2, temperature=0)
    assert after.usage.completion_tokens == 2
