"""What keeps one request, or one client, from stalling or exposing the server: a bound on a body's
JSON nesting, request rendering off the event loop under a time limit, and the rule for binding
beyond loopback without an API key."""

import asyncio
import contextlib
import ipaddress
import os
import sys
import threading

import numpy as np

from .requests import APIError

MAX_JSON_DEPTH = 64
"""Nesting levels a request body may have. OpenAI bodies nest about 5 deep (messages, a message,
its content parts, a part) and tool schemas a few levels more; 64 leaves room for deep schemas and
stays far below Python's recursion limit (1000), which json, Jinja's `tojson` and every recursive
walk of the body would otherwise hit (a 100000-'[' body raised RecursionError, a plain-text 500)."""

_QUOTE, _BACKSLASH = ord('"'), ord("\\")


def json_too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `raw` nests more than `limit` arrays/objects outside its strings, found before any
    parser recurses. Vectorised over at most 4 MB (numpy releases the GIL; a regex over a body of
    quotes and backslashes held it for a second): a quote ends or starts a string unless an odd
    run of backslashes precedes it; the deepest running count of brackets outside strings is the
    depth. Unclosed brackets count (a body of 100000 '[' is too deep); a stray closer only lowers
    the count, and json stops at it anyway."""
    if raw.count(b"[") + raw.count(b"{") <= limit:  # most bodies: too few to nest that deep
        return False
    text = np.frombuffer(raw, dtype=np.uint8)
    index = np.arange(text.size, dtype=np.int32)
    backslash = text == _BACKSLASH
    last_plain = np.maximum.accumulate(np.where(backslash, -1, index))
    run_before = np.zeros(text.size, dtype=np.int32)  # backslashes just before each byte
    run_before[1:] = index[:-1] - last_plain[:-1]
    quote = (text == _QUOTE) & (run_before % 2 == 0)
    outside = np.cumsum(quote, dtype=np.int32) % 2 == 0
    opens = outside & ((text == ord("[")) | (text == ord("{")))
    closes = outside & ((text == ord("]")) | (text == ord("}")))
    depth = np.cumsum(opens.astype(np.int32) - closes)
    return bool(depth.max(initial=0) > limit)


class RenderSlots:
    """Runs a request's parsing (JSON, chat template, tokenisation) in a thread, at most `slots`
    at once, each answered within `seconds`: a 4 MB body takes seconds to tokenise and a chat
    template may loop for hours, and neither may stall the event loop (/health, other streams).

    A thread cannot be stopped. A render past the limit gets its 400 at once but runs on, holding
    its slot, until it ends by itself; so runaway renders never number more than `slots` threads.
    Once all slots are held, a request waits up to `seconds` for one, then gets 429. The threads
    are daemons: a runaway render does not keep the process from exiting. `background` renders
    at the lowest CPU priority (Linux), taking only the CPU the model and other requests leave."""

    def __init__(self, slots: int = 2, seconds: float = 10.0, *, background: bool = False):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"render slots must be a positive integer, got {slots!r}")
        if not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
            raise ValueError(f"the render time limit must be a positive number of seconds, "
                             f"got {seconds!r}")
        self.slots, self.seconds, self.background = slots, float(seconds), background
        self._free: asyncio.Semaphore | None = None  # made in the serving loop, on first use

    async def run(self, work, *, param: str):
        """work()'s result, or its exception; APIError 429 when no slot frees in time, 400
        naming `param` when the render takes longer than the limit."""
        loop = asyncio.get_running_loop()
        if self._free is None:
            self._free = asyncio.Semaphore(self.slots)
        try:
            await asyncio.wait_for(self._free.acquire(), self.seconds)
        except asyncio.TimeoutError:
            raise APIError(429, f"all {self.slots} request-rendering slots are busy with slow "
                                f"requests; retry later", kind="rate_limit_error",
                           code="render_slots_busy") from None
        done = loop.create_future()

        def settle(ok: bool, value):  # in the loop: free the slot, answer whoever still waits
            self._free.release()
            if done.done():  # the request timed out or went away
                return
            if ok:
                done.set_result(value)
            else:
                done.set_exception(value)

        def render():
            if self.background:
                lower_priority_of_this_thread()
            try:
                outcome = (True, work())
            except Exception as err:  # noqa: BLE001  (handed to the request, in the loop)
                outcome = (False, err)
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
                loop.call_soon_threadsafe(settle, *outcome)

        try:
            threading.Thread(target=render, name="mlxspec-render", daemon=True).start()
        except RuntimeError:  # the system has no thread to give: the slot was never used
            self._free.release()
            raise
        try:
            return await asyncio.wait_for(done, self.seconds)
        except asyncio.TimeoutError:
            raise APIError(400, f"rendering and tokenising the request took over "
                                f"{self.seconds:g} s, the server's limit (--render-timeout); "
                                f"send a shorter request", param=param,
                           code="render_timeout") from None


def lower_priority_of_this_thread() -> None:
    """Linux schedules each thread as a task of its own: renicing this thread's id lowers only
    it. Elsewhere (macOS) a thread id is no process id, so nothing is done."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine: localhost, 127.0.0.0/8, ::1."""
    host = host.strip().strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # another host name: it may resolve to any interface
        return False


def check_exposure(host: str, api_key: str | None, *, insecure: bool = False) -> str | None:
    """The rule for binding a server: beyond loopback it needs an API key, or `insecure` said
    explicitly. Returns the warning to print when it is allowed without a key, None when all is
    well; raises ValueError when refused. make_server does not bind: whoever runs its app on an
    address calls this (`mlxspec serve` does)."""
    if api_key or is_loopback(host):
        return None
    if not insecure:
        raise ValueError(f"--host {host} exposes the server beyond this machine without an API "
                         f"key: set --api-key (or MLXSPEC_API_KEY), or pass "
                         f"--insecure-no-api-key to serve anyone who can reach {host}")
    return (f"Warning: serving on {host} with no API key (--insecure-no-api-key): anyone who "
            f"can reach this address can use the model")


__all__ = ["MAX_JSON_DEPTH", "RenderSlots", "check_exposure", "is_loopback", "json_too_deep"]
