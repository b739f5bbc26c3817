"""`mlxspec serve` under load: the HTTP overhead on one stream, time to first token, and
throughput and latency with 1, 4 and 16 concurrent clients, with and without a drafter.

The server is a real `mlxspec serve` process on loopback (default SmolLM2-135M-Instruct, fp32,
OpenBLAS); clients are the official `openai` package in threads of this process. First, in this
process with no server running, `mlxspec.stream_generate` on the same prompts gives the
in-process tok/s; then each configuration's server answers the same prompts. One run.

- single stream: each of the prompts once, non-streamed, one after another: tok/s =
  completion tokens / wall seconds of the request; HTTP overhead = in-process tok/s / server
  tok/s - 1, paired per prompt (median and the 95% interval over prompts);
- time to first token: streamed, the first content chunk's arrival;
- C concurrent clients (C = 1, 4, 16) each sending `--per-client` requests: throughput = all
  completion tokens / wall time, latency p50/p95 per request (queueing included).

    .venv/bin/python benchmarks/server_load.py --out docs/results/server-load-cpu.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlxspec
from mlxspec.intervals import ratio_interval
from mlxspec.prompts import humaneval_prompts, mtbench_prompts

MODEL_ID = "SmolLM2-135M-Instruct"


def prompts(limit: int) -> list[str]:
    return humaneval_prompts(limit=limit // 2) + mtbench_prompts(limit=limit - limit // 2)


def in_process(texts, max_tokens, drafter) -> list[float]:
    model, tokenizer = mlxspec.load()
    for _ in mlxspec.stream_generate(model, tokenizer, "Hello", 8, drafter=drafter):
        pass  # warm-up, as the server gets one
    out = []
    for text in texts:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True)
        start, n = time.perf_counter(), 0
        for r in mlxspec.stream_generate(model, tokenizer, prompt, max_tokens, drafter=drafter):
            n = r.generation_tokens
        out.append(n / (time.perf_counter() - start))
    return out


def wait_until_up(url: str, proc, name: str, seconds: float = 300) -> None:
    """Poll `url` until it answers; RuntimeError if `proc` exits or time runs out first."""
    deadline = time.time() + seconds
    while True:
        try:
            urllib.request.urlopen(url, timeout=5)
            return
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{name} did not start") from None
            time.sleep(0.5)


class Served:
    def __init__(self, drafter: str, port: int):
        script = Path(sys.executable).with_name("mlxspec")
        self.proc = subprocess.Popen([str(script), "serve", "--port", str(port), "--drafter",
                                      drafter], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, env=dict(os.environ))
        self.url = f"http://127.0.0.1:{port}"
        wait_until_up(self.url + "/health", self.proc, "the server")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)


def client(url):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=600)


def ask(url, text, max_tokens, drafter) -> tuple[int, float]:
    messages = [{"role": "user", "content": text}]
    start = time.perf_counter()
    reply = client(url).chat.completions.create(model=MODEL_ID, messages=messages,
                                                max_tokens=max_tokens, temperature=0,
                                                extra_body={"drafter": drafter})
    return reply.usage.completion_tokens, time.perf_counter() - start


def first_token(url, text, max_tokens, drafter) -> float:
    start = time.perf_counter()
    stream = client(url).chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
        temperature=0, stream=True, extra_body={"drafter": drafter})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            elapsed = time.perf_counter() - start
            stream.close()
            return elapsed
    return time.perf_counter() - start


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def load(url, texts, max_tokens, drafter, clients, per_client) -> dict:
    latencies, tokens, lock = [], [0], threading.Lock()

    def run(i):
        for j in range(per_client):
            n, seconds = ask(url, texts[(i * per_client + j) % len(texts)], max_tokens, drafter)
            with lock:
                latencies.append(seconds)
                tokens[0] += n

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(run, range(clients)))
    wall = time.perf_counter() - start
    return {"clients": clients, "requests": len(latencies), "throughput_tps": tokens[0] / wall,
            "latency_p50": percentile(latencies, 0.5), "latency_p95": percentile(latencies, 0.95)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--per-client", type=int, default=2)
    parser.add_argument("--port", type=int, default=8123)
    args = parser.parse_args()
    texts = prompts(args.limit)
    report = {"model": MODEL_ID, "blas": mlxspec.blas_in_use(), "max_tokens": args.max_tokens,
              "prompts": len(texts), "configs": []}
    for drafter in ("none", "lookup"):
        direct = in_process(texts, args.max_tokens, drafter)
        served = Served(drafter, args.port)
        try:
            ask(served.url, "Hello", 8, drafter)  # warm-up
            single = [ask(served.url, t, args.max_tokens, drafter) for t in texts]
            server_tps = [n / s for n, s in single]
            overhead = [d / v - 1 for d, v in zip(direct, server_tps)]
            low, high = ratio_interval(direct, server_tps)
            ttft = [first_token(served.url, t, args.max_tokens, drafter) for t in texts]
            loads = [load(served.url, texts, args.max_tokens, drafter, c, args.per_client)
                     for c in (1, 4, 16)]
        finally:
            served.stop()
        config = {"drafter": drafter, "in_process_tps": statistics.mean(direct),
                  "server_tps": statistics.mean(server_tps),
                  "overhead_median": statistics.median(overhead),
                  "overhead_ratio_interval": [low - 1, high - 1],
                  "ttft_median": statistics.median(ttft), "loads": loads}
        report["configs"].append(config)
        print(f"{drafter}: in-process {config['in_process_tps']:.1f} tok/s, server "
              f"{config['server_tps']:.1f} tok/s, overhead {100 * config['overhead_median']:.1f}% "
              f"[{100 * (low - 1):.1f}, {100 * (high - 1):.1f}]%, TTFT "
              f"{1000 * config['ttft_median']:.0f} ms; " + "; ".join(
                  f"{x['clients']} clients: {x['throughput_tps']:.1f} tok/s, p50 "
                  f"{x['latency_p50']:.2f} s, p95 {x['latency_p95']:.2f} s" for x in loads))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
