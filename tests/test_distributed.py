"""A target split across ranks, as users run it: `mlx.launch -n 2 --backend ring` over loopback,
started by the test. Rank 0's output must be the single process's, token for token, greedy and
sampled with a seed; a rank that dies must make the other exit with a clear error, not hang.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mlxspec
from mlxspec.distributed import layer_split, split_model
from mlxspec.distributed.link import BEGIN, END, PASS, SHUTDOWN, TRIM, Settled, decode, encode

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
# One BLAS thread per rank, each rank on a core of its own where there are two: the ranks share
# this machine, and MLX's ring backend polls while it waits for the other rank.
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
PIN = ["bash", "-c", 'exec taskset -c "$((MLX_RANK % $(nproc)))" "$@"', "pin"] \
    if shutil.which("taskset") else []


def free_port() -> int:
    """A base port whose next one is free too (the ring backend listens on one per rank)."""
    for _ in range(20):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two free ports next to each other")


def launch(*command: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """`mlx.launch -n 2 --backend ring -- command` on loopback; no rank outlives it."""
    tag = f"launch-{os.getpid()}-{time.monotonic_ns()}"
    try:
        return subprocess.run(
            [str(BIN / "mlx.launch"), "-n", "2", "--backend", "ring", "--starting-port",
             str(free_port()), "--env", "OPENBLAS_NUM_THREADS=1", "--env",
             "MLXSPEC_TEST_TAG=" + tag, "--", *PIN, *command],
            input=stdin, capture_output=True, text=True, timeout=timeout, env=ENV)
    finally:
        kill_tagged(tag)


def tagged(tag: str, rank: str | None = None) -> list[int]:
    """Processes started with MLXSPEC_TEST_TAG=tag (and MLX_RANK=rank); none without /proc."""
    if not Path("/proc").is_dir():
        return []
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
            and _environ(p).get("MLXSPEC_TEST_TAG") == tag
            and (rank is None or _environ(p).get("MLX_RANK") == rank)]


def kill_tagged(tag: str) -> None:
    for pid in tagged(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def results(stdout: str) -> dict:
    lines = [json.loads(line[len("RESULT "):]) for line in stdout.splitlines()
             if line.startswith("RESULT ")]
    return {r["case"]: r["tokens"] for r in lines}


def job_reference(mode: str) -> dict:
    sys.path.insert(0, str(HERE))
    import distributed_job

    return distributed_job.run(mode)


@pytest.mark.slow  # two ranks under mlx.launch; SmolLM2 (pipeline) or its tokenizer
@pytest.mark.parametrize("mode", ["pipeline", "tensor", "hybrid"])
def test_split_target_generates_what_one_process_does(mode):
    """Pipeline on SmolLM2 (30 layers; its 9 heads do not split two ways), tensor parallel on a
    tiny llama of 4 heads, pipeline on a tiny Qwen3-Next (each rank rolls back its own
    recurrent layers): none, lookup, DFlash (chain and tree), Medusa, drafts rejected at every
    position, sampled with a seed, and a cache kept across two calls."""
    run = launch(sys.executable, str(HERE / "distributed_job.py"), mode, timeout=420)
    got, want = results(run.stdout), job_reference(mode)
    assert got, run.stdout[-2000:] + run.stderr[-3000:]
    if "kept-cache-state" in want:
        # Each layer's kept state, summed: equal to float rounding (a rank that processed
        # the wrong positions is off by whole units).
        assert got.pop("kept-cache-state") == pytest.approx(want.pop("kept-cache-state"),
                                                            rel=1e-4, abs=0.05)
    assert got == want


def _cli(*args):
    return [str(BIN / "mlxspec"), *args]


def test_cli_generate_under_mlx_launch(smollm):
    """Only rank 0 prints, and it prints the single process's text."""
    args = ["generate", "-p", "Write a Python function that adds two numbers.", "-n", "24",
            "--drafter", "dflash+lookup"]
    split = launch(*_cli(*args))
    alone = subprocess.run(_cli(*args), capture_output=True, text=True, env=ENV, timeout=300)
    assert alone.returncode == 0, alone.stderr
    assert split.stdout.strip() == alone.stdout.strip() != ""


@pytest.mark.slow  # two ranks under mlx.launch on SmolLM2, and one process
def test_cli_chat_under_mlx_launch():
    """Two turns on a kept cache, typed into rank 0 (mlx.launch gives every rank the input)."""
    turns = "Name a colour.\nAnd another one?\n/quit\n"
    args = ["chat", "-n", "12", "--drafter", "lookup", "--no-color"]
    split = launch(*_cli(*args), stdin=turns)
    alone = subprocess.run(_cli(*args), input=turns, capture_output=True, text=True, env=ENV,
                           timeout=300)
    assert alone.stdout.count(">> ") == 3
    assert split.stdout == alone.stdout


@pytest.mark.slow  # two ranks under mlx.launch on SmolLM2, twice
def test_cli_refuses_what_a_split_target_cannot_do():
    run = launch(*_cli("generate", "-p", "hi", "-n", "4", "--shard", "tensor"))
    assert "needs sizes it divides; this model has num attention heads 9" in run.stderr
    run = launch(*_cli("bench", "--limit", "1"))
    assert "bench runs in one process" in run.stderr
    assert "Traceback" not in run.stderr


def _start_ranks(args, port):
    """Both ranks as mlx.launch starts them (its environment), each process ours to kill."""
    hostfile = Path(f"/tmp/mlxspec-hosts-{port}.json")
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    return [subprocess.Popen(PIN + _cli(*args), env={**ENV, "MLX_RANK": str(r),
                                                "MLX_HOSTFILE": str(hostfile)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in (0, 1)]


@pytest.mark.slow  # two ranks on SmolLM2
@pytest.mark.parametrize("dies", [1, 0])
def test_a_rank_that_dies_stops_the_other_with_a_clear_error(dies):
    """Rank `dies` is killed mid-generation; the survivor says so in one line and exits 1
    within a bound, whichever of the two it is."""
    args = ["generate", "-p", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "--no-chat-template", "-n",
            "2000", "--drafter", "lookup"]
    ranks = _start_ranks(args, free_port())
    try:
        first = ranks[0].stdout.read(1)  # rank 0 prints once generation runs
        assert first, ranks[0].stderr.read()
        ranks[dies].send_signal(signal.SIGKILL)
        survivor = ranks[1 - dies]
        start = time.monotonic()
        _, err = survivor.communicate(timeout=60)
        assert time.monotonic() - start < 60
        assert survivor.returncode == 1
        assert f"Error: rank {1 - dies}: a distributed operation failed" in err
        assert "another rank has stopped or the connection dropped" in err
        assert "Traceback" not in err
    finally:
        for p in ranks:
            p.kill()
            p.communicate()


@pytest.mark.slow  # two ranks under mlx.launch on SmolLM2
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds rank 1's process in /proc")
def test_mlx_launch_ends_when_a_rank_dies():
    """Under mlx.launch too the job ends (mlx.launch stops the others), bounded in time."""
    port = free_port()
    launcher = subprocess.Popen(
        [str(BIN / "mlx.launch"), "-n", "2", "--backend", "ring", "--starting-port", str(port),
         "--env", "MLXSPEC_TEST_TAG=" + str(port), "--env", "OPENBLAS_NUM_THREADS=1", "--",
         *PIN, *_cli("generate", "-p", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "--no-chat-template", "-n",
               "2000")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        assert launcher.stdout.read(1)
        os.kill(tagged(str(port), rank="1")[0], signal.SIGKILL)
        _, err = launcher.communicate(timeout=60)
        assert "Node with rank 1" in err
    finally:
        launcher.kill()
        launcher.communicate()
        kill_tagged(str(port))


def _environ(proc: Path) -> dict:
    try:
        raw = (proc / "environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0")
                if "=" in item)


# In one process: the parts the launched tests run through.


def test_layer_split_gives_rank_0_the_last_layers():
    assert [layer_split(30, 2, r) for r in (0, 1)] == [(15, 30), (0, 15)]
    assert [layer_split(7, 3, r) for r in (0, 1, 2)] == [(4, 7), (2, 4), (0, 2)]


@pytest.mark.parametrize("message", [
    (PASS, None, [5, 0], [[11], [12, 13, 14, 15]]),
    (PASS, Settled(4, 2), [3, 4], [[11], [12, 13], [0, 1, 1]]),
    (PASS, Settled(6, 3, (1, 4, 6)), [2, 0], [[9], [8]]),
    (PASS, Settled(3, 0, ()), [1, 0], [[7], []]),
    (TRIM, Settled(2, 1), [2], []),
    (END, None, [], []),
    (SHUTDOWN, None, [], []),
    (BEGIN, None, [3, 10, 40, 2], [[4, 9]]),
])
def test_messages_round_trip(message):
    op, settled, fields, parts = message
    got = decode(encode(op, settled, fields, parts).tolist())
    assert got.op == op and got.settled == settled
    if op == PASS:
        assert list(got.tokens) == [t for p in parts[:2] for t in p]
        assert got.parents == (tuple(parts[2]) if len(parts) > 2 else None)
    if op == TRIM:
        assert got.count == 2
    if op == BEGIN:
        assert (got.slot, got.held, got.count, got.capture) == (3, 10, 40, (4, 9))


def test_a_message_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="does not fit a distributed message"):
        encode(PASS, None, [2000, 0], [[1] * 2000])


class _TwoRanks:
    """A group's size and rank, enough for the checks a split makes before any transfer."""

    def size(self):
        return 2

    def rank(self):
        return 0


def test_splits_refuse_what_they_cannot_run(monkeypatch):
    from tiny_models import tiny_llama, tiny_nemotron_h, tiny_qwen3_next

    with pytest.raises(ValueError, match="tensor parallelism over a hybrid target"):
        split_model(tiny_qwen3_next(), "tensor", _TwoRanks())
    # Recurrent layers of a kind no rank can re-run alone (here: none recognised).
    monkeypatch.setattr("mlxspec.backends.mlx.target.state_mixers", lambda model: [])
    with pytest.raises(ValueError, match="must be of a kind mlxspec re-runs alone"):
        split_model(tiny_qwen3_next(), "pipeline", _TwoRanks())
    monkeypatch.undo()
    with pytest.raises(ValueError, match="keeps 3 caches for 4 layers"):
        split_model(tiny_nemotron_h(), "pipeline", _TwoRanks())
    odd = tiny_llama(layers=2)
    odd.args.num_attention_heads = 3
    with pytest.raises(ValueError, match="num attention heads 3: use --shard pipeline"):
        split_model(odd, "tensor", _TwoRanks())
    with pytest.raises(ValueError, match="unknown sharding"):
        mlxspec.load(shard="diagonal")


def test_layerskip_says_it_cannot_run_on_a_split_target():
    from tiny_models import tiny_llama

    from mlxspec.distributed import STAGE
    from mlxspec.drafters.registry import why_unavailable

    model = tiny_llama(layers=4)
    assert why_unavailable("layerskip", model) is None
    object.__setattr__(model, STAGE, object())
    assert "over a target split across ranks" in why_unavailable("layerskip", model)


def _http_json(url: str, body: dict | None = None, timeout: int = 120) -> dict:
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def test_serve_on_two_ranks(smollm):
    """`mlxspec serve` on rank 0 of two (started as mlx.launch starts them): replies equal one
    process's generation (a follow-up turn on the kept cache too), and SIGTERM drains rank 0
    and tells rank 1 to stop, which then exits by itself."""
    pytest.importorskip("uvicorn", reason="mlxspec serve needs the server extra")
    import urllib.error

    model, tokenizer = smollm
    first = [{"role": "user", "content": "Name three colors."}]

    def expected(messages):
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return mlxspec.generate(model, tokenizer, prompt, 16)

    follow = first + [{"role": "assistant", "content": expected(first)},
                      {"role": "user", "content": "And three animals?"}]
    wanted = {"first": expected(first), "follow": expected(follow)}  # before the ranks poll
    port = free_port()
    ranks = _start_ranks(["serve", "--port", str(port), "--drafter", "dflash"], free_port())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if _http_json(url + "/health", timeout=5)["status"] == "ok":
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert all(p.poll() is None for p in ranks) and time.monotonic() < deadline
            time.sleep(0.5)

        def ask(messages, drafter):
            reply = _http_json(url + "/v1/chat/completions", {
                "messages": messages, "max_tokens": 16, "temperature": 0, "drafter": drafter})
            return (reply["choices"][0]["message"]["content"],
                    reply["usage"]["prompt_tokens_details"]["cached_tokens"])

        assert ask(first, "dflash")[0] == wanted["first"]
        assert ask(first, "lookup")[0] == wanted["first"]  # kept: lookup reads no features
        text, cached = ask(follow, "lookup")
        assert text == wanted["follow"] and cached > 0
        ranks[0].send_signal(signal.SIGTERM)
        assert ranks[1].wait(timeout=90) == 0
        _, err = ranks[1].communicate()
        assert "Traceback" not in err
        assert ranks[0].wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        for p in ranks:
            p.kill()
            p.communicate()


def test_a_follower_refuses_a_kept_cache_it_no_longer_holds():
    """Rather than prefill on top of positions it lacks (its kept caches are bounded)."""
    from tiny_models import tiny_llama

    from mlxspec.distributed import DistributedError, Follower

    class Alone:
        rank = 1

    follower = Follower(tiny_llama(layers=2), Alone(), kept=1)
    follower._cache(slot=1, held=0)
    follower._cache(slot=2, held=0)  # slot 1 evicted
    with pytest.raises(DistributedError, match=r"kept cache \(slot 1\) this rank no longer"):
        follower._cache(slot=1, held=5)
