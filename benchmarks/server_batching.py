"""`mlxspec serve` batching concurrent requests against `mlx_lm server` on the same weights.

Both servers are real processes on loopback with OpenBLAS preloaded (LD_PRELOAD, so mlx_lm's
process binds MLX to it as mlxspec's does); clients are threads of this process sending plain
HTTP (urllib). Each of C concurrent clients (C = 1, 4, 8, 16) sends `--per-client` greedy chat
requests of `--max-tokens` tokens, one after another: throughput = all completion tokens / wall
time, latency p50/p95 per request (queueing included). "same text" counts replies equal to the
same prompt's reply at 1 client (greedy: batching should not change a reply). One run.

mlxspec serve runs with --max-batch 16 (every client a row of the batch) and drafter none or
lookup; mlx_lm server with its defaults (decode concurrency 32, prompt concurrency 8).

    .venv/bin/python benchmarks/server_batching.py --out docs/results/server-batching-cpu.json
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlxspec
from mlxspec.loading import resolve_model_dir

sys.path.insert(0, str(Path(__file__).parent))
from server_load import percentile, prompts, wait_until_up  # noqa: E402

OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"


class Process:
    """A server process on loopback, stopped with SIGTERM."""

    def __init__(self, argv: list[str], port: int):
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        if Path(OPENBLAS).exists():
            env["LD_PRELOAD"] = OPENBLAS
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, env=env)
        self.url = f"http://127.0.0.1:{port}"
        wait_until_up(self.url + "/v1/models", self.proc, argv[0])

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)


def ask(url, body: dict, text: str, max_tokens: int) -> tuple[str, int, float]:
    data = json.dumps({**body, "messages": [{"role": "user", "content": text}],
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=data,
                                     headers={"content-type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=900) as response:
        reply = json.loads(response.read())
    seconds = time.perf_counter() - start
    return (reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"],
            seconds)


def load(url, body, texts, max_tokens, clients, per_client, alone: dict) -> dict:
    latencies, tokens, same, lock = [], [0], [0], threading.Lock()

    def run(i):
        for j in range(per_client):
            text = texts[(i * per_client + j) % len(texts)]
            reply, n, seconds = ask(url, body, text, max_tokens)
            with lock:
                latencies.append(seconds)
                tokens[0] += n
                alone.setdefault(text, reply)  # the first run (1 client) sets the reference
                same[0] += alone[text] == reply

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(run, range(clients)))
    wall = time.perf_counter() - start
    return {"clients": clients, "requests": len(latencies), "tokens": tokens[0],
            "throughput_tps": tokens[0] / wall, "latency_p50": percentile(latencies, 0.5),
            "latency_p95": percentile(latencies, 0.95), "same_text": same[0]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--per-client", type=int, default=2)
    parser.add_argument("--clients", default="1,4,8,16")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--port", type=int, default=8124)
    args = parser.parse_args()
    texts = prompts(args.limit)
    model_dir = str(resolve_model_dir(None))
    bin_dir = Path(sys.executable).parent
    servers = [
        ("mlxspec serve, none", [str(bin_dir / "mlxspec"), "serve", "--drafter", "none",
                                 "--max-batch", str(args.max_batch), "--port", str(args.port)],
         {"drafter": "none"}),
        ("mlxspec serve, lookup", [str(bin_dir / "mlxspec"), "serve", "--drafter", "lookup",
                                   "--max-batch", str(args.max_batch), "--port",
                                   str(args.port)], {"drafter": "lookup"}),
        ("mlx_lm server", [sys.executable, "-m", "mlx_lm", "server", "--model", model_dir,
                           "--port", str(args.port), "--log-level", "ERROR"],
         {"model": model_dir}),
    ]
    report = {"model": Path(model_dir).name, "blas": mlxspec.blas_in_use(),
              "max_tokens": args.max_tokens, "per_client": args.per_client,
              "prompts": len(texts), "max_batch": args.max_batch, "servers": []}
    for name, argv, body in servers:
        served = Process(argv, args.port)
        try:
            ask(served.url, body, "Hello", 8)  # warm-up
            alone: dict = {}
            loads = [load(served.url, body, texts, args.max_tokens, int(c), args.per_client,
                          alone) for c in args.clients.split(",")]
        finally:
            served.stop()
        report["servers"].append({"server": name, "loads": loads})
        print(f"{name}: " + "; ".join(
            f"{x['clients']} clients: {x['throughput_tps']:.1f} tok/s, p50 "
            f"{x['latency_p50']:.2f} s, p95 {x['latency_p95']:.2f} s, same text "
            f"{x['same_text']}/{x['requests']}" for x in loads), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
