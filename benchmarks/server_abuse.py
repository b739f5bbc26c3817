"""`mlxspec serve` under abuse: do normal requests keep their latency while other clients send
what the server must refuse or cut short?

A real `mlxspec serve` process on loopback (SmolLM2-135M-Instruct, drafter lookup) answers the
same normal requests twice: a clean run (only them), then an abusive run, where `--abusers`
clients send, in turn and without pause, until the normal requests are done:

- oversized num_draft (10^7 drafts a step: 400 by --max-num-draft);
- a huge body (a 3.8 MB message, parsed and tokenised in a render slot: 400, too long);
- a body over the 4 MB limit (413 from its Content-Length);
- a deep body (100000 '[': 400 before any parser recurses);
- malformed JSON (400);
- a stream of 256 tokens dropped after its first chunks (the model stops at its next step);
- with --slow-render, a message that takes the chat template's slow branch (the served model is
  a copy of SmolLM2 whose template loops --slow-render-loops^2 times on a marker): 400 at
  --render-timeout, its thread runs on in its slot.

Normal requests: `--requests` chat requests of `--max-tokens` tokens, greedy, from `--clients`
concurrent clients. Reported: their p50/p95 latency in both runs, the ratio, and whether every one
was answered, whole and with the clean run's text (none lost). The goal (issue 37): abusive p95
within 1.2x of the clean p95. Every abusive answer's status is counted: a 500 among them is a bug.

    .venv/bin/python benchmarks/server_abuse.py --out docs/results/server-abuse.json
    .venv/bin/python benchmarks/server_abuse.py --requests 4 --max-tokens 8 --out /tmp/a.json
"""

import argparse
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SLOW_MARKER = "SLOW-RENDER"
QUESTIONS = ["Name three colors.", "What is 2 + 2?", "Say hello in French.",
             "Write a haiku about rain.", "What is the capital of Italy?",
             "Write a Python function that adds two numbers."]


def slow_template_model(source: Path, loops: int, into: Path) -> Path:
    """A copy of the model (weights linked) whose chat template, on a message holding the marker,
    loops loops^2 times: a template that is slow for some inputs, as a checkpoint's may be."""
    for f in source.iterdir():
        (into / f.name).symlink_to(f.resolve())
    template = (source / "chat_template.jinja").read_text()
    slow = (f"{{% for message in messages %}}{{% if '{SLOW_MARKER}' in message['content'] %}}"
            f"{{% for i in range({loops}) %}}{{% for j in range({loops}) %}}{{% endfor %}}"
            f"{{% endfor %}}{{% endif %}}{{% endfor %}}")
    (into / "chat_template.jinja").unlink()
    (into / "chat_template.jinja").write_text(slow + template)
    return into


class Served:
    """`mlxspec serve` on 127.0.0.1 (never another address), stopped by SIGTERM."""

    def __init__(self, model: Path, port: int, render_timeout: float):
        script = Path(sys.executable).with_name("mlxspec")
        self.port = port
        self.proc = subprocess.Popen(
            [str(script), "serve", "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
             "--drafter", "lookup", "--render-timeout", str(render_timeout)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ))
        deadline = time.time() + 300
        while True:
            try:
                if request(port, "GET", "/health", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            if time.time() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the server did not start: " + self.stop())
            time.sleep(0.5)

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.stderr.read().decode(errors="replace")


def request(port: int, method: str, path: str, body: bytes | None = None, *, timeout=600,
            headers=None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request(method, path, body=body,
                           headers=headers or {"Content-Type": "application/json"})
        reply = connection.getresponse()
        return reply.status, reply.read()
    finally:
        connection.close()


def chat_body(content: str, max_tokens: int, **extra) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "temperature": 0, **extra}).encode()


def normal_run(port: int, n: int, clients: int, max_tokens: int) -> list[dict]:
    def one(i: int) -> dict:
        start = time.perf_counter()
        status, payload = request(port, "POST", "/v1/chat/completions",
                                  chat_body(QUESTIONS[i % len(QUESTIONS)], max_tokens))
        seconds = time.perf_counter() - start
        reply = json.loads(payload) if status == 200 else {}
        return {"i": i, "status": status, "seconds": seconds,
                "text": reply["choices"][0]["message"]["content"] if reply else None,
                "tokens": reply["usage"]["completion_tokens"] if reply else 0,
                "finish": reply["choices"][0]["finish_reason"] if reply else None}

    with ThreadPoolExecutor(max_workers=clients) as pool:
        return list(pool.map(one, range(n)))


def dropped_stream(port: int) -> int:
    """A 256-token stream read for two chunks, then the connection closed."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        connection.request("POST", "/v1/chat/completions",
                           body=chat_body("Tell a very long story.", 256, stream=True),
                           headers={"Content-Type": "application/json"})
        reply = connection.getresponse()
        for _ in range(2):
            reply.readline()
        return reply.status
    finally:
        connection.close()


def abuses(slow_render: bool) -> list:
    huge = chat_body("word " * 760_000, 4)  # 3.8 MB
    return [
        ("num_draft", lambda port: request(port, "POST", "/v1/chat/completions",
                                           chat_body("Hi", 4, num_draft=10_000_000))[0]),
        ("huge body", lambda port: request(port, "POST", "/v1/chat/completions", huge)[0]),
        ("over 4 MB", lambda port: request(port, "POST", "/v1/chat/completions",
                                           b"[" + b" " * (4 * 1024 * 1024 + 16) + b"]")[0]),
        ("deep body", lambda port: request(port, "POST", "/v1/chat/completions",
                                           b"[" * 100_000)[0]),
        ("malformed JSON", lambda port: request(port, "POST", "/v1/completions",
                                                b'{"prompt": "x", "max_tokens": 4,')[0]),
        ("dropped stream", dropped_stream),
    ] + ([("slow render", lambda port: request(port, "POST", "/v1/chat/completions",
                                                chat_body(SLOW_MARKER, 4))[0])]
         if slow_render else [])


def abuse(port: int, kinds: list, stop: threading.Event, limit: int, seen: Counter,
          lock: threading.Lock, offset: int) -> None:
    for n in range(limit):
        if stop.is_set():
            return
        name, send = kinds[(n + offset) % len(kinds)]
        try:
            status = send(port)
        except OSError as err:  # the server closed a connection it refused (413 mid-send)
            status = type(err).__name__
        with lock:
            seen[f"{name}: {status}"] += 1


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(rows: list[dict], clean: list[dict] | None, max_tokens: int) -> dict:
    seconds = [r["seconds"] for r in rows]
    whole = [r for r in rows if r["status"] == 200 and
             (r["tokens"] == max_tokens or r["finish"] == "stop")]
    same = clean is None or all(r["text"] == c["text"] for r, c in zip(rows, clean))
    return {"requests": len(rows), "answered_whole": len(whole), "same_text_as_clean": same,
            "p50_s": percentile(seconds, 0.5), "p95_s": percentile(seconds, 0.95)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/results/server-abuse.json")
    parser.add_argument("--requests", type=int, default=12, help="normal requests per run")
    parser.add_argument("--clients", type=int, default=2, help="concurrent normal clients")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--abusers", type=int, default=2, help="concurrent abusive clients")
    parser.add_argument("--max-abuse", type=int, default=500,
                        help="abusive requests per abuser at most")
    parser.add_argument("--slow-render", action="store_true",
                        help="also send messages that take the template's slow branch")
    parser.add_argument("--slow-render-loops", type=int, default=3000)
    parser.add_argument("--render-timeout", type=float, default=10.0)
    parser.add_argument("--port", type=int, default=8124)
    args = parser.parse_args()

    from mlxspec.loading import resolve_model_dir

    workdir = Path(tempfile.mkdtemp(prefix="mlxspec-abuse-"))
    model = resolve_model_dir(None)
    if args.slow_render:
        model = slow_template_model(model, args.slow_render_loops, workdir)
    served = Served(model, args.port, args.render_timeout)
    try:
        normal_run(served.port, min(2, args.requests), 1, 8)  # warm-up
        clean = normal_run(served.port, args.requests, args.clients, args.max_tokens)
        stop, lock, seen = threading.Event(), threading.Lock(), Counter()
        kinds = abuses(args.slow_render)
        abusers = [threading.Thread(target=abuse, args=(served.port, kinds, stop, args.max_abuse,
                                                        seen, lock, i * 3))
                   for i in range(args.abusers)]
        for thread in abusers:
            thread.start()
        time.sleep(1.0)  # the abuse is under way before the first normal request
        abused = normal_run(served.port, args.requests, args.clients, args.max_tokens)
        stop.set()
        for thread in abusers:
            thread.join()
        health = request(served.port, "GET", "/health", timeout=30)
    finally:
        log = served.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    report = {
        "model": "SmolLM2-135M-Instruct", "drafter": "lookup", "max_tokens": args.max_tokens,
        "clients": args.clients, "abusers": args.abusers, "slow_render": args.slow_render,
        "render_timeout_s": args.render_timeout, "cpu_count": os.cpu_count(),
        "clean": summary(clean, None, args.max_tokens),
        "abusive": summary(abused, clean, args.max_tokens),
        "abusive_answers": dict(sorted(seen.items())),
        "health_after": health[0], "server_tracebacks": log.count("Traceback"),
    }
    report["p95_ratio"] = report["abusive"]["p95_s"] / report["clean"]["p95_s"]
    report["p50_ratio"] = report["abusive"]["p50_s"] / report["clean"]["p50_s"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))


def table(report: dict) -> str:
    rows = ["| run | requests | answered whole | p50 s | p95 s |", "|---|---|---|---|---|"]
    for run in ("clean", "abusive"):
        r = report[run]
        rows.append(f"| {run} | {r['requests']} | {r['answered_whole']} | {r['p50_s']:.2f} | "
                    f"{r['p95_s']:.2f} |")
    lost = report["clean"]["requests"] - report["abusive"]["answered_whole"]
    rows.append(f"\np95 ratio {report['p95_ratio']:.2f} (goal <= 1.2), p50 ratio "
                f"{report['p50_ratio']:.2f}; lost {lost}; same text as clean: "
                f"{report['abusive']['same_text_as_clean']}; abusive answers: "
                + ", ".join(f"{k} x{v}" for k, v in report["abusive_answers"].items()))
    return "\n".join(rows)


if __name__ == "__main__":
    main()
