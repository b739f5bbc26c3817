"""One generation at a time per model, so the API is safe to call from several threads.

A generation is not read-only on its model: drafters that read target features wrap the model's
decoder layers for each pass (hidden_states.capture_layer_outputs), and MLX gives each thread its
own default stream. Two threads decoding one model at once therefore recorded into each other's
passes: a `concatenate` shape error, "There is no Stream(cpu, 2) in current thread", or a crash
(SIGSEGV, or SIGABRT "terminate called without an active exception") when one thread's lazy
arrays were evaluated on another's stream. A lock per model, held for the whole life of a
generation (released when the generator finishes, is closed, or is garbage collected), makes
concurrent calls take turns instead.

Separately, MLX keeps per-thread state (the thread's streams) whose C++ destructors run after
a worker thread's Python state is gone; at interpreter exit they could race finalization and
abort the process ("terminate called without an active exception"; ml-explore/mlx#3126). MLX's
advice is to call `mx.clear_streams()` at the end of a thread, which a library cannot do for
its caller, so a generation on a worker thread leaves a thread-local object whose finalizer
does it when the thread's Python state is cleared, while the interpreter still runs.
"""

import functools
import threading

import mlx.core as mx

_ATTRIBUTE = "_mlxspec_generation_lock"
_CREATING = threading.Lock()  # two threads must not each attach a lock to the same model


class GenerationLock:
    """A lock that knows which thread holds it, so the holder starting a second generation gets
    an error instead of waiting for itself forever."""

    def __init__(self):
        self._lock = threading.Lock()  # not an RLock: a generator may be closed from any thread
        self._owner: int | None = None

    def __enter__(self):
        if self._owner == threading.get_ident():
            raise RuntimeError(
                "a generation on this model is still open in this thread: finish it or close "
                "its generator (.close()) before starting another on the same model")
        self._lock.acquire()
        self._owner = threading.get_ident()
        return self

    def __exit__(self, *exc) -> None:
        self._owner = None
        self._lock.release()


def generation_lock(model) -> GenerationLock:
    """`model`'s lock, attached to it on first use (mlx-lm and torch modules alike)."""
    with _CREATING:
        lock = getattr(model, _ATTRIBUTE, None)
        if lock is None:
            lock = GenerationLock()
            object.__setattr__(model, _ATTRIBUTE, lock)  # not a parameter or submodule
        return lock


class _ClearStreamsAtThreadExit:
    def __del__(self):
        mx.synchronize()
        mx.clear_streams()


_THIS_THREAD = threading.local()


def clear_streams_at_thread_exit() -> None:
    """On a worker thread: clear its MLX streams when it ends (see the module's docstring)."""
    if threading.current_thread() is not threading.main_thread() and \
            not hasattr(_THIS_THREAD, "streams"):
        _THIS_THREAD.streams = _ClearStreamsAtThreadExit()


def one_generation_per_model(stream):
    """Wrap a generator function taking the model first: its whole run holds the model's lock,
    taken when the caller asks for the first item."""

    @functools.wraps(stream)
    def locked(model, *args, **kwargs):
        with generation_lock(model):
            clear_streams_at_thread_exit()
            yield from stream(model, *args, **kwargs)

    return locked
