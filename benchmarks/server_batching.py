"""Servers batching concurrent clients: `mlxspec serve` (drafter none, lookup, dflash) against
`mlx_lm server` and mlx-vlm's server on the same weights, through the official `openai` client.

Every server is a real process on loopback (127.0.0.1, a free port), started in turn on the same
converted model directory (default: the embedded SmolLM2-135M-Instruct, fp32), with OpenBLAS
preloaded (LD_PRELOAD), so every process binds MLX to it as mlxspec's does; this process imports
mlxspec before mlx.core for the same reason.

  mlxspec-none, mlxspec-lookup, mlxspec-dflash   `mlxspec serve --max-batch 16 --drafter D`
                                                 (dflash: the drafter shipped for the model)
  mlx_lm                                         `python -m mlx_lm server` with its defaults
  mlx_vlm                                        `python -m mlx_vlm server --max-num-seqs 16`,
                                                 from its own venv (--mlx-vlm-python); skipped,
                                                 with the reason in the JSON, where it is absent
                                                 or cannot serve the model

Two workloads: `chat` (HumanEval and MT-Bench prompts, half each; 64 tokens) and `copy`
(HumanEval's reference solutions to be rewritten with one rename, mlxspec.prompts.copy_prompts:
most of the answer repeats the prompt; 128 tokens). At each level C (1, 2, 4, 8, 16) C clients
(threads, closed loop) each send --per-client greedy chat requests, one after another; request
k = client * per_client + j asks prompt k mod --limit. Replies are streamed (time to first token
= the first content chunk) with usage in the last chunk. Per level: throughput = completion
tokens / wall time; latency and time to first token p50 and p95 over requests (queueing
included); "same text": replies equal to the first reply this server gave the same prompt in
this workload (greedy: batching must not change a reply; the first is the 1-client one for the
prompts level 1 asks), out of the replies that had one to compare with; prompt tokens the
server reported as cached (a prompt asked again can hit a server's prompt cache: mlx_lm's
does; --distinct with --limit 62 asks every prompt once). Each server's first replies are kept
as hashes, so servers can be compared with each other. One run; the JSON is rewritten after
every workload of every server.

Time: level 16 alone (32 requests) took 100 s (chat) + 121 s (copy) for mlxspec-none and
63 + 106 s for mlx_lm on the 2-core machine under other load (load average 4.5); levels 1-8
add about 1.8x that, so all five servers at the defaults are an estimated 30 min on an idle
machine and about twice that under such load; --per-client 1 about halves it.

    .venv/bin/python benchmarks/server_batching.py --out docs/results/server-batching-cpu.json
    .venv/bin/python benchmarks/server_batching.py --servers mlxspec-none,mlx_lm \\
        --workloads copy --clients 1,2 --per-client 1 --limit 2 --max-tokens 16   # a smoke run
"""

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlxspec  # before anything imports mlx.core: binds MLX to OpenBLAS
from mlxspec.loading import resolve_model_dir
from mlxspec.prompts import copy_prompts

sys.path.insert(0, str(Path(__file__).parent))
from server_load import percentile, prompts as chat_prompts, wait_until_up  # noqa: E402

OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
MLX_VLM_PYTHON = "/work/venvs/mlxvlm/bin/python"
SERVERS = ("mlxspec-none", "mlxspec-lookup", "mlxspec-dflash", "mlx_lm", "mlx_vlm")
WORKLOADS = {"chat": 64, "copy": 128}  # workload: default max_tokens
WARM_UP = "Hello"


@dataclass
class Server:
    name: str
    argv: list[str]  # with "{port}" where the port goes
    model: str | None  # the request's "model"; None: the first id /v1/models lists
    version: str | None = None


def servers(args, model_dir: str) -> list[Server]:
    mlxspec_bin = str(Path(sys.executable).with_name("mlxspec"))
    out = [Server(f"mlxspec-{drafter}",
                  [mlxspec_bin, "serve", "--model", model_dir, "--drafter", drafter,
                   "--max-batch", str(args.max_batch), "--port", "{port}"],
                  None, version("mlxspec"))
           for drafter in ("none", "lookup", "dflash")]
    out.append(Server("mlx_lm", [sys.executable, "-m", "mlx_lm", "server", "--model", model_dir,
                                 "--host", "127.0.0.1", "--port", "{port}", "--log-level",
                                 "ERROR"], "default_model", version("mlx-lm")))
    out.append(Server("mlx_vlm", [args.mlx_vlm_python, "-m", "mlx_vlm", "server", "--model",
                                  model_dir, "--host", "127.0.0.1", "--port", "{port}",
                                  "--max-num-seqs", str(args.max_batch), "--log-level",
                                  "WARNING"], model_dir, peer_version(args.mlx_vlm_python)))
    return out


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def peer_version(python: str) -> str | None:
    """mlx-vlm's version in its own venv, or None where that venv is missing or broken."""
    if not Path(python).exists():
        return None
    probe = subprocess.run([python, "-c", "import importlib.metadata as m; "
                            "print(m.version('mlx-vlm'), m.version('mlx'))"],
                           capture_output=True, text=True, timeout=60)
    return probe.stdout.strip().replace(" ", ", mlx ") if probe.returncode == 0 else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A server on loopback with OpenBLAS preloaded; its output goes to a log file, whose tail
    is the error when it does not start. Stopped with SIGTERM (SIGKILL after 60 s)."""

    def __init__(self, argv: list[str], start_seconds: float):
        port = free_port()
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        if Path(OPENBLAS).exists():
            env["LD_PRELOAD"] = OPENBLAS
        self.log = tempfile.NamedTemporaryFile("w+", prefix="server-", suffix=".log")
        self.proc = subprocess.Popen([a.replace("{port}", str(port)) for a in argv],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{port}"
        try:
            wait_until_up(self.url + "/v1/models", self.proc, Path(argv[0]).name, start_seconds)
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(f"{e}: {self.tail()}") from None

    def tail(self, lines: int = 5) -> str:
        self.log.seek(0)
        return " | ".join(self.log.read().strip().splitlines()[-lines:])

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def client(url: str, timeout: float):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=timeout)


@dataclass
class Reply:
    text: str
    tokens: int
    cached_tokens: int | None
    seconds: float
    first_token: float | None  # seconds to the first content chunk (streamed only)


def ask(api, server: Server, text: str, max_tokens: int, stream: bool) -> Reply:
    kwargs = dict(model=server.model, messages=[{"role": "user", "content": text}],
                  max_tokens=max_tokens, temperature=0)
    start = time.perf_counter()
    if not stream:
        reply = api.chat.completions.create(**kwargs)
        usage = reply.usage
        return Reply(reply.choices[0].message.content or "", usage.completion_tokens,
                     cached(usage), time.perf_counter() - start, None)
    parts, first, usage = [], None, None
    with api.chat.completions.create(**kwargs, stream=True,
                                     stream_options={"include_usage": True}) as chunks:
        for chunk in chunks:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.perf_counter() - start
                parts.append(chunk.choices[0].delta.content)
    if usage is None:
        raise RuntimeError("the stream ended without usage")
    return Reply("".join(parts), usage.completion_tokens, cached(usage),
                 time.perf_counter() - start, first)


def cached(usage) -> int | None:
    details = getattr(usage, "prompt_tokens_details", None)
    return getattr(details, "cached_tokens", None)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load(api, server: Server, texts: list[str], max_tokens: int, clients: int, per_client: int,
         stream: bool, first: dict, offset: int = 0) -> dict:
    """C closed-loop clients; request k asks prompt offset + k (mod the prompts); `first` maps
    a prompt's index to its first reply's hash."""
    replies, errors, lock = [], [], threading.Lock()

    def run(i):
        for j in range(per_client):
            index = (offset + i * per_client + j) % len(texts)
            try:
                reply = ask(api, server, texts[index], max_tokens, stream)
            except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
                with lock:
                    errors.append(f"{type(e).__name__}: {e}"[:300])
                continue
            with lock:
                had = index in first
                first.setdefault(index, digest(reply.text))
                replies.append((reply, had and first[index] == digest(reply.text), had))

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(run, range(clients)))
    wall = time.perf_counter() - start
    done = [r for r, _, _ in replies]
    latencies = [r.seconds for r in done]
    firsts = [r.first_token for r in done if r.first_token is not None]
    tokens = sum(r.tokens for r in done)
    reported = [r.cached_tokens for r in done if r.cached_tokens is not None]
    return {
        "clients": clients, "requests": len(done), "errors": len(errors),
        "first_error": errors[0] if errors else None, "tokens": tokens, "wall_s": wall,
        "throughput_tps": tokens / wall,
        "latency_p50": percentile(latencies, 0.5) if done else None,
        "latency_p95": percentile(latencies, 0.95) if done else None,
        "ttft_p50": percentile(firsts, 0.5) if firsts else None,
        "ttft_p95": percentile(firsts, 0.95) if firsts else None,
        "same_text": sum(same for _, same, _ in replies),
        "compared": sum(had for _, _, had in replies),
        "cached_prompt_tokens": sum(reported) if reported else None,
    }


def summary(name: str, workload: str, loads: list[dict]) -> str:
    def seconds(x):
        return "-" if x is None else f"{x:.2f} s"

    return f"{name} / {workload}: " + "; ".join(
        f"{x['clients']} clients: {x['throughput_tps']:.1f} tok/s, p50 {seconds(x['latency_p50'])}"
        f", p95 {seconds(x['latency_p95'])}, TTFT p50 {seconds(x['ttft_p50'])}, same text "
        f"{x['same_text']}/{x['compared']}" + (f", {x['errors']} errors" if x["errors"] else "")
        for x in loads)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON, rewritten after every workload")
    parser.add_argument("--model", default=None, help="a converted model directory (default: "
                        "the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--servers", default=",".join(SERVERS), help=f"of {', '.join(SERVERS)}")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="chat, copy")
    parser.add_argument("--clients", default="1,2,4,8,16", help="concurrency levels")
    parser.add_argument("--per-client", type=int, default=2, help="requests per client")
    parser.add_argument("--limit", type=int, default=8, help="prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="per request (default: chat 64, copy 128)")
    parser.add_argument("--max-batch", type=int, default=16,
                        help="mlxspec --max-batch and mlx-vlm --max-num-seqs")
    parser.add_argument("--distinct", action="store_true",
                        help="no prompt asked twice in a workload while --limit lasts (no "
                        "prompt-cache hits; same text is then checked across servers only)")
    parser.add_argument("--no-stream", dest="stream", action="store_false",
                        help="plain replies (no time to first token)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per request")
    parser.add_argument("--start-timeout", type=float, default=300,
                        help="seconds a server may take to answer /v1/models")
    parser.add_argument("--mlx-vlm-python", default=MLX_VLM_PYTHON,
                        help="the python of a venv with mlx-vlm (never mlxspec's own)")
    args = parser.parse_args()
    names = args.servers.split(",")
    workloads = args.workloads.split(",")
    levels = [int(c) for c in args.clients.split(",")]
    for bad, known in ((set(names) - set(SERVERS), SERVERS), (set(workloads) - set(WORKLOADS),
                                                               WORKLOADS)):
        if bad:
            parser.error(f"unknown {', '.join(sorted(bad))} (known: {', '.join(known)})")
    model_dir = str(resolve_model_dir(args.model))
    texts = {"chat": chat_prompts(args.limit), "copy": copy_prompts(args.limit)}
    tokens = {w: args.max_tokens or WORKLOADS[w] for w in workloads}
    report = {
        "model": Path(model_dir).name, "blas": mlxspec.blas_in_use(),
        "versions": {"python": platform.python_version(), "mlx": version("mlx"),
                     "mlx-lm": version("mlx-lm"), "mlxspec": version("mlxspec"),
                     "openai": version("openai")},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "options": vars(args),
        "workloads": {w: {"prompts": len(texts[w]), "max_tokens": tokens[w]} for w in workloads},
        "servers": [],
    }

    def save():
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")

    for server in (s for s in servers(args, model_dir) if s.name in names):
        entry = {"server": server.name, "version": server.version, "argv": server.argv,
                 "workloads": {}}
        report["servers"].append(entry)
        if server.name == "mlx_vlm" and server.version is None:
            entry["skipped"] = (f"no mlx-vlm at {args.mlx_vlm_python} (python3 -m venv DIR && "
                                "DIR/bin/pip install mlx-vlm==0.7.10 'mlx[cpu]')")
            print(f"{server.name}: skipped: {entry['skipped']}", flush=True)
            save()
            continue
        try:
            served = Process(server.argv, args.start_timeout)
        except RuntimeError as e:
            entry["skipped"] = str(e)
            print(f"{server.name}: skipped: {e}", flush=True)
            save()
            continue
        try:
            api = client(served.url, args.timeout)
            if server.model is None:
                server.model = api.models.list().data[0].id
            ask(api, server, WARM_UP, 8, args.stream)
            for workload in workloads:
                first: dict = {}
                started = time.perf_counter()
                offsets = [args.per_client * sum(levels[:n]) if args.distinct else 0
                           for n in range(len(levels))]
                loads = [load(api, server, texts[workload], tokens[workload], c,
                              args.per_client, args.stream, first, offset)
                         for c, offset in zip(levels, offsets)]
                entry["workloads"][workload] = {
                    "loads": loads, "seconds": time.perf_counter() - started,
                    "replies": {str(i): first[i] for i in sorted(first)}}
                print(summary(server.name, workload, loads), flush=True)
                save()
        finally:
            served.stop()
    reference = {}
    for entry in report["servers"]:
        for workload, result in entry["workloads"].items():
            mine = result["replies"]
            theirs = reference.setdefault(workload, (entry["server"], mine))
            if theirs[1] is not mine:
                common = set(mine) & set(theirs[1])
                result["same_as"] = {"server": theirs[0], "same": sum(
                    mine[i] == theirs[1][i] for i in common), "compared": len(common)}
                print(f"{entry['server']} / {workload}: first replies equal {theirs[0]}'s: "
                      f"{result['same_as']['same']}/{len(common)}", flush=True)
    save()


if __name__ == "__main__":
    main()
