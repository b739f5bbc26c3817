"""`mlxspec serve --max-batch N`: concurrent requests served as rows of one batch (issue #39).

Each request must get what it gets alone (greedy: the same text, usage and logprobs as the
one-at-a-time Worker), whatever joins or leaves the batch around it. A tiny random llama and a
word-level tokenizer keep every server cheap; to make the requests really share the batch, the
test holds the model's generation lock while they queue (the worker waits for it), so they join
together when it is let go. One slow test repeats the check on SmolLM2."""

from http.client import HTTPConnection
import json
import threading
import time

import mlx.core as mx
import pytest

pytest.importorskip("uvicorn", reason="mlxspec serve needs the server extra")

from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import ChunkedKVCache  # noqa: E402

from test_api_hardening import tiny_tokenizer  # noqa: E402
from test_server import Running, http, post_json  # noqa: E402

from mlxspec.generation_lock import generation_lock  # noqa: E402
from mlxspec.server import make_server  # noqa: E402
from mlxspec.server.batching import BatchWorker  # noqa: E402
from mlxspec.server.worker import Worker  # noqa: E402

VOCAB = 64
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def tiny_model(context: int = 4096):
    """A random llama with sharp distributions (its greedy text repeats itself, so lookup
    drafts get accepted) and a long context, for streams long enough to be left midway."""
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
        max_position_embeddings=context, tie_word_embeddings=False))
    model.lm_head.weight = model.lm_head.weight * 4.0
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def tiny():
    tokenizer = tiny_tokenizer(VOCAB)
    tokenizer._tokenizer.chat_template = CHAT_TEMPLATE
    return tiny_model(), tokenizer


@pytest.fixture(scope="module")
def servers(tiny):
    """The same model served batched (4 rows at most) and one request at a time."""
    model, tokenizer = tiny
    batched = make_server(model, tokenizer, drafter="lookup", model_id="tiny", max_batch=4)
    alone = make_server(model, tokenizer, drafter="lookup", model_id="tiny", max_batch=1)
    assert isinstance(batched.worker, BatchWorker) and batched.worker.refusal is None
    assert type(alone.worker) is Worker
    running = Running(batched), Running(alone)
    yield (running[0], batched), (running[1], alone)
    for r in running:
        r.stop()


def ask(running, body: dict) -> dict:
    """One request; a streamed reply is put back together into the plain reply's shape."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    reply = post_json(running.url + path, json.dumps(body))
    assert reply.status_code == 200, reply.text
    if not body.get("stream"):
        out = reply.json()
        choice = out["choices"][0]
        text = choice["message"]["content"] if "messages" in body else choice["text"]
        return {"text": text, "finish": choice["finish_reason"], "usage": out["usage"],
                "logprobs": choice["logprobs"]}
    lines = [line[len("data: "):] for line in reply.text.split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    text, finish, usage, logprobs = "", None, None, None
    for chunk in map(json.loads, lines[:-1]):
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk["choices"]:
            text += choice.get("text") or choice.get("delta", {}).get("content") or ""
            finish = choice["finish_reason"] or finish
            if choice.get("logprobs"):  # chat's {"content": [...]}, completions' lists
                logprobs = logprobs or {key: [] for key in choice["logprobs"]}
                for key, values in choice["logprobs"].items():
                    logprobs[key] += values
    return {"text": text, "finish": finish, "usage": usage, "logprobs": logprobs}


def together(running, server, bodies: list[dict]) -> list[dict]:
    """Send every body at once and let the worker start only when all of them wait in its
    queue, so they share the batch (as many as fit)."""
    out: list = [None] * len(bodies)

    def one(i):
        out[i] = ask(running, bodies[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    with generation_lock(server.worker.model):
        for t in threads:
            t.start()
        deadline = time.time() + 30
        while server.worker.queue_length < len(bodies):
            assert time.time() < deadline, "the requests did not reach the queue"
            time.sleep(0.01)
    for t in threads:
        t.join(timeout=120)
    return out


def most_rows(server, seeded: list | None = None):
    """Record how many rows were generating as each request finished (in `seeded` too for a
    request with a seed)."""
    seen = []

    def record(job, outcome):
        rows = len(server.worker.replies) + 1
        seen.append(rows)
        if seeded is not None and job.request.generation.sampling.seed is not None:
            seeded.append(rows)
        finished(job, outcome)

    finished = server.worker.on_finish
    server.worker.on_finish = record
    return seen


def prompt(i: int) -> str:
    return " ".join(f"t{(7 * i + j) % (VOCAB - 1)}" for j in range(3 + i % 4))


BODIES = [
    {"prompt": prompt(0), "max_tokens": 40, "drafter": "lookup"},
    {"prompt": prompt(1), "max_tokens": 7, "drafter": "none", "stream": True},
    {"prompt": prompt(2), "max_tokens": 30, "drafter": "lookup", "stop": ["t29", "t14"]},
    {"messages": [{"role": "user", "content": prompt(3)}], "max_tokens": 25, "stream": True,
     "stream_options": {"include_usage": True}},
    {"prompt": prompt(4), "max_tokens": 1, "drafter": "lookup"},
    {"prompt": prompt(5), "max_tokens": 20, "drafter": "none", "logprobs": 2},
    {"messages": [{"role": "user", "content": prompt(6)}], "max_tokens": 33, "num_draft": 3,
     "stop": ["t50"]},
    {"prompt": prompt(7), "max_tokens": 12, "logprobs": 1, "stream": True,
     "stream_options": {"include_usage": True}},
]


def same_reply(got: dict, want: dict) -> None:
    assert got["text"] == want["text"] and got["finish"] == want["finish"]
    if want["usage"] is not None:
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert got["usage"][key] == want["usage"][key]
        assert got["usage"]["mlxspec"]["drafter"] == want["usage"]["mlxspec"]["drafter"]
    assert rounded(got["logprobs"]) == rounded(want["logprobs"])


def rounded(value):
    """Logprobs to 3 decimals: a batched pass may differ from a lone one in the last bits."""
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def test_concurrent_requests_each_get_what_they_get_alone(servers):
    """8 greedy requests at once into a batch of 4 (the rest join as rows leave): different
    max_tokens, drafters, num_draft, stop strings, chat and completions, streamed or not, with
    logprobs: each reply equals the one-at-a-time server's, and rows really shared passes."""
    (batched, server), (alone, _) = servers
    bodies = [{**b, "temperature": 0} for b in BODIES]
    want = [ask(alone, b) for b in bodies]
    assert any(w["finish"] == "stop" for w in want)  # a stop string cut one reply
    seen = most_rows(server)
    got = together(batched, server, bodies)
    for g, w in zip(got, want):
        same_reply(g, w)
    assert max(seen) == 4  # four at once: the batch was full
    assert [ask(batched, b)["text"] for b in bodies[:3]] == [w["text"] for w in want[:3]]
    assert server.worker.rows == 0 and not server.worker.replies


def test_a_client_that_leaves_mid_stream_leaves_the_batch(servers):
    """A stream of 4000 tokens dropped after its first chunks leaves the batch at once
    ("cancelled"); the requests sharing the batch with it finish with their own replies."""
    (batched, server), (alone, _) = servers
    others = [{**b, "temperature": 0} for b in BODIES[:3]]
    want = [ask(alone, b) for b in others]
    outcomes = []
    finished = server.worker.on_finish
    server.worker.on_finish = lambda job, outcome: (outcomes.append(outcome),
                                                    finished(job, outcome))
    long = {"prompt": prompt(9), "max_tokens": 4000, "temperature": 0, "stream": True}
    got: list = [None] * len(others)

    def leaver():
        conn = HTTPConnection("127.0.0.1", batched.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(long),
                     {"content-type": "application/json"})
        response = conn.getresponse()
        response.read1(64)
        response.read1(64)
        conn.close()  # gone midway

    def one(i):
        got[i] = ask(batched, others[i])

    threads = [threading.Thread(target=leaver)]
    threads += [threading.Thread(target=one, args=(i,)) for i in range(len(others))]
    try:
        with generation_lock(server.worker.model):
            for t in threads:
                t.start()
            deadline = time.time() + 30
            while server.worker.queue_length < len(threads):
                assert time.time() < deadline
                time.sleep(0.01)
        for t in threads:
            t.join(timeout=60)
        deadline = time.time() + 20
        while len(outcomes) < len(threads):
            assert time.time() < deadline, "the dropped stream did not leave the batch"
            time.sleep(0.05)
    finally:
        server.worker.on_finish = finished
    for g, w in zip(got, want):
        same_reply(g, w)
    cancelled = [o for o in outcomes if o.finish_reason == "cancelled"]
    assert len(cancelled) == 1 and cancelled[0].completion_tokens < 4000
    assert not server.worker.busy or http("GET", batched.url + "/health").json()["rows"] == 0


def test_sixteen_openai_clients_with_disconnects(servers):
    """16 concurrent clients through the official openai package (loopback, bounded: one
    request each, timeouts), 4 of them dropping their stream after its first chunks, into a
    batch of 4 with the rest queued: every reply that finishes is the one-at-a-time server's,
    and the batch is empty afterwards."""
    openai = pytest.importorskip("openai")
    (batched, server), (alone, _) = servers
    bodies = [{"prompt": prompt(i), "max_tokens": 8 + 3 * (i % 5), "temperature": 0,
               "drafter": ("lookup", "none")[i % 2]} for i in range(16)]
    want = [ask(alone, b)["text"] for b in bodies]
    client = openai.OpenAI(base_url=batched.url + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    got: list = [None] * len(bodies)

    def one(i):
        body = dict(bodies[i])
        extra = {"drafter": body.pop("drafter")}
        if i % 4 == 3:  # leaves midway
            stream = client.completions.create(model="tiny", stream=True, extra_body=extra,
                                               **{**body, "max_tokens": 2000})
            next(iter(stream))
            stream.close()
            return
        reply = client.completions.create(model="tiny", extra_body=extra, **body)
        got[i] = reply.choices[0].text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    for i, (g, w) in enumerate(zip(got, want)):
        if i % 4 != 3:
            assert g == w, i
    deadline = time.time() + 20
    while server.worker.replies or server.worker.queue_length:
        assert time.time() < deadline, "the dropped streams did not leave the batch"
        time.sleep(0.05)


def test_a_seeded_request_runs_alone_and_repeats_its_text(servers):
    """A sampled request with a seed waits for the batch to empty and runs by itself, so it
    gives the same text each time, whatever runs around it; unseeded requests around it still
    get their greedy replies. (No drafts: an adaptive K follows step timings, and how many
    drafts a step verifies changes the draws, alone as well as in a batch.)"""
    (batched, server), (alone, _) = servers
    seeded = {"prompt": prompt(3), "max_tokens": 30, "temperature": 1.0, "seed": 1234,
              "drafter": "none"}
    greedy = [{**b, "temperature": 0} for b in BODIES[:3]]
    want = [ask(alone, b) for b in greedy]
    by_itself = ask(batched, seeded)["text"]
    for order in ([greedy[0], seeded, greedy[1], greedy[2]],
                  [seeded, greedy[2], greedy[0], greedy[1]]):
        alone_rows: list = []
        seen = most_rows(server, alone_rows)
        got = together(batched, server, order)
        assert got[order.index(seeded)]["text"] == by_itself
        for body, reply in zip(order, got):
            if body is not seeded:
                same_reply(reply, want[greedy.index(body)])
        assert alone_rows == [1] and max(seen) >= 2  # it ran alone, others together
    sampled = {**seeded, "seed": None}
    assert len({ask(batched, sampled)["text"] for _ in range(3)}) > 1  # it does sample


def test_prompt_caches_are_kept_per_request(servers):
    """A row keeps its caches when it leaves: the same prompt again, and the conversation's
    next turn, prefill only what no kept cache holds, while other rows run beside them, and
    get the one-at-a-time server's replies."""
    (batched, server), (alone, _) = servers
    user = {"role": "user", "content": prompt(11) + " t3 t9"}
    first = {"messages": [user], "max_tokens": 12, "temperature": 0}
    want = ask(alone, first)
    same_reply(ask(batched, first), want)
    again = ask(batched, first)
    same_reply(again, want)
    prompt_tokens = want["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_tokens - 1
    turn = {"messages": [user, {"role": "assistant", "content": want["text"]},
                         {"role": "user", "content": prompt(12)}],
            "max_tokens": 10, "temperature": 0}
    others = [{**b, "temperature": 0} for b in BODIES[:3]]
    want_turn, want_others = ask(alone, turn), [ask(alone, b) for b in others]
    got = together(batched, server, [turn] + others)
    for g, w in zip(got, [want_turn] + want_others):
        same_reply(g, w)
    assert got[0]["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens
    assert server.worker.caches.held_tokens() > 0


def test_the_pool_lends_features_only_from_caches_that_kept_them():
    """A DFlash or EAGLE-3 row starts only from a kept cache that holds its tokens' target
    features at the layers its drafter reads; a cache without them that extends one with them
    does not push it out, nor does one with other layers' features."""
    from mlxspec.backends.mlx.target import MLXTarget, PromptCache
    from mlxspec.server.cache_pool import PromptCachePool

    model = tiny_model()

    def kept(tokens, layers=()):
        target = MLXTarget(model)
        target.prefill(tokens + [0])
        cache = PromptCache()
        cache.check_model(model)
        cache.cache, cache.tokens = target.cache, list(tokens)
        if layers:
            cache.features, cache.feature_layers = mx.zeros((len(tokens), 4)), layers
        return cache

    pool = PromptCachePool(PromptCache, slots=4)
    featured, plain = kept([1, 2, 3], (0, 1)), kept([1, 2, 3, 4, 5])
    pool.keep(featured)
    pool.keep(plain)
    assert pool.caches == [featured, plain]
    assert pool.longest([1, 2, 3, 4, 5, 6]) == (plain, 5)
    assert pool.longest([1, 2, 3, 4, 5, 6], (0, 1)) == (featured, 3)
    assert pool.longest([1, 2, 3, 4, 5, 6], (1, 0)) == (None, 0)  # other layers' order
    assert pool.longest([9, 9], (0, 1)) == (None, 0)
    other = kept([1, 2, 3, 4], (1, 2))
    pool.keep(other)  # it extends the one with (0, 1) features but cannot serve its rows
    assert pool.caches == [plain, featured, other]  # longest() made featured the latest
    again = kept([1, 2, 3, 4], (0, 1))
    pool.keep(again)  # it extends the one with the same features, which goes
    assert pool.caches == [plain, other, again]


def test_metrics_and_health_show_the_batch(servers):
    (batched, _), (alone, _) = servers
    metrics = http("GET", batched.url + "/metrics").text
    assert "mlxspec_batch_rows 0" in metrics and "mlxspec_batch_max_rows 4" in metrics
    health = http("GET", alone.url + "/health").json()
    assert health["max_batch"] == 1 and health["rows"] == 0


def test_batching_is_off_where_rows_cannot_share_a_pass(tiny):
    """LayerSkip drafts inside the target's own cache, and a cache kind mlxspec cannot cut
    back per row (llama4's chunked attention): such servers serve one request at a time, say
    why, and still answer."""
    model, tokenizer = tiny
    server = make_server(model, tokenizer, drafter="layerskip", model_id="tiny", max_batch=4)
    assert "layerskip" in server.worker.refusal and server.worker.max_batch == 1
    assert server.worker.describe().startswith("one request at a time")
    server.worker.stop()

    chunked = tiny_model()
    chunked.make_cache = lambda: [ChunkedKVCache(8) for _ in chunked.layers]
    server = make_server(chunked, tokenizer, model_id="tiny", max_batch=4)
    assert "ChunkedKVCache" in server.worker.refusal
    running = Running(server)
    try:
        reply = ask(running, {"prompt": "t1 t2 t3", "max_tokens": 5, "temperature": 0})
        assert reply["usage"]["completion_tokens"] == 5
    finally:
        running.stop()


def test_a_sliding_window_model_batches_past_its_window(tiny):
    """A Gemma 3 with a 4-position window, served batched: concurrent requests whose prompts
    are many windows long, with lookup, get the one-at-a-time server's replies, and a next
    turn starts from its kept cache."""
    from tiny_models import tiny_gemma3

    _, tokenizer = tiny
    model = tiny_gemma3(vocab=VOCAB, window=4)
    servers = [make_server(model, tokenizer, drafter="lookup", model_id="tiny", max_batch=n)
               for n in (4, 1)]
    assert servers[0].worker.refusal is None
    (batched, alone) = running = [Running(server) for server in servers]
    try:
        bodies = [{"prompt": " ".join([prompt(i)] * 6), "max_tokens": 16, "temperature": 0}
                  for i in range(4)]
        want = [ask(alone, b) for b in bodies]
        for g, w in zip(together(batched, servers[0], bodies), want):
            same_reply(g, w)
        user = {"role": "user", "content": " ".join([prompt(5)] * 5)}
        first = {"messages": [user], "max_tokens": 12, "temperature": 0}
        same_reply(ask(batched, first), ask(alone, first))
        turn = {"messages": [user, {"role": "assistant", "content": ask(alone, first)["text"]},
                             {"role": "user", "content": prompt(6)}],
                "max_tokens": 10, "temperature": 0}
        got = ask(batched, turn)
        same_reply(got, ask(alone, turn))
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        for r in running:
            r.stop()


def test_make_server_checks_max_batch(tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        make_server(model, tokenizer, max_batch=0)


@pytest.fixture(scope="module")
def smollm_servers(smollm):
    model, tokenizer = smollm
    batched = make_server(model, tokenizer, drafter="lookup", model_id="m", max_batch=4)
    alone = make_server(model, tokenizer, drafter="lookup", model_id="m", max_batch=1)
    running = Running(batched), Running(alone)
    yield (running[0], batched), (running[1], alone)
    for r in running:
        r.stop()


def test_real_model_concurrent_lookup_requests_equal_each_alone(smollm_servers):
    """SmolLM2: 4 greedy chat requests with lookup at once equal each sent alone."""
    (batched, server), (alone, _) = smollm_servers
    questions = ["Write a Python function that returns the square of a number.",
                 "List three colours.", "What is 2 + 2?",
                 "Repeat after me: the cat sat on the mat, the cat sat on the mat."]
    bodies = [{"messages": [{"role": "user", "content": q}], "max_tokens": 24 + 8 * i,
               "temperature": 0, "stream": i % 2 == 1} for i, q in enumerate(questions)]
    want = [ask(alone, b) for b in bodies]
    seen = most_rows(server)
    got = together(batched, server, bodies)
    for g, w in zip(got, want):
        same_reply(g, w)
    assert max(seen) == 4


@pytest.mark.parametrize("max_batch", [4, 1])
def test_suffix_requests_draft_from_earlier_replies(tiny, max_batch):
    """`--drafter suffix` in the server: the forks of the server's one drafter share its
    history, so a request asked again drafts from the first reply (most drafts accepted), and
    gets the same text; batched and one at a time."""
    model, tokenizer = tiny
    server = make_server(model, tokenizer, drafter="suffix", model_id="tiny",
                         max_batch=max_batch)
    running = Running(server)
    try:
        # a fixed K, so the passes counted depend on the drafts alone, not on step times
        body = {"messages": [{"role": "user", "content": prompt(21)}], "max_tokens": 24,
                "temperature": 0, "num_draft": 4, "adaptive": False}
        first, again = ask(running, body), ask(running, body)
        same_reply(again, first)
        details = again["usage"]["completion_tokens_details"]
        accepted, rejected = (details[f"{k}_prediction_tokens"] for k in ("accepted", "rejected"))
        assert accepted >= 8 and accepted >= 3 * rejected
        assert again["usage"]["mlxspec"]["target_passes"] < \
            first["usage"]["mlxspec"]["target_passes"]
    finally:
        running.stop()


def test_a_failed_pass_is_one_line_to_its_client_and_a_traceback_in_the_log(servers, capsys,
                                                                           monkeypatch):
    """A generation that fails inside the batch is the server's bug: its client gets a 500 in
    one line, the log gets the traceback (the agentic bench's ZeroDivisionError came with
    neither a file nor a line), and the next request is served by a fresh batch as it would
    be alone."""
    (batched, server), (alone, _) = servers
    from mlxspec.engine import Loop

    def broken(self, ks):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(Loop, "_launch", broken)
    body = {"messages": [{"role": "user", "content": "a b c"}], "max_tokens": 4, "temperature": 0}
    reply = post_json(batched.url + "/v1/chat/completions", json.dumps(body))
    assert reply.status_code == 500 and "ZeroDivisionError" in reply.text
    log = capsys.readouterr().err
    assert "a generation failed" in log and "Traceback" in log and "in broken" in log
    monkeypatch.undo()
    assert ask(batched, body)["text"] == ask(alone, body)["text"]
