"""Load OpenBLAS before MLX on Linux.

The Linux `mlx[cpu]` wheel bundles a slow reference BLAS; a system OpenBLAS loaded into the global
symbol namespace first makes MLX's fp32 matmuls ~16x faster. This must run before `mlx.core` is
imported, so `mlxspec/__init__.py` calls it first. Set MLXSPEC_BLAS=reference to keep the bundled
BLAS (to measure both ways).
"""

import ctypes
import os
import sys
from contextlib import contextmanager

_CANDIDATES = (
    "libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "libopenblas.so",
)

_blas_in_use = None
_openblas = None  # the loaded library, for its thread-count calls


def preload_openblas() -> str:
    """Return a description of the BLAS MLX will use, loading OpenBLAS if possible."""
    global _blas_in_use
    if _blas_in_use is not None:
        return _blas_in_use
    if sys.platform == "darwin":
        _blas_in_use = "Accelerate (macOS)"
    elif os.environ.get("MLXSPEC_BLAS", "").lower() == "reference":
        _blas_in_use = "bundled reference BLAS (MLXSPEC_BLAS=reference)"
    elif "mlx.core" in sys.modules:
        _blas_in_use = "unknown (mlx.core was imported before mlxspec could load OpenBLAS)"
    elif "openblas" in os.environ.get("LD_PRELOAD", ""):
        _blas_in_use = f"OpenBLAS (LD_PRELOAD={os.environ['LD_PRELOAD']})"
    else:
        _blas_in_use = "bundled reference BLAS (OpenBLAS not found: apt-get install libopenblas0-pthread)"
        for name in _CANDIDATES:
            try:
                lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            global _openblas
            _openblas = lib
            _blas_in_use = f"OpenBLAS ({name})"
            break
    return _blas_in_use


def blas_in_use() -> str:
    return preload_openblas()


@contextmanager
def openblas_single_thread():
    """Run torch code with OpenBLAS on one thread. Loaded globally for MLX, OpenBLAS also
    answers some of libtorch's BLAS calls (sgemv); its own threads then spin against torch's
    OpenMP threads: a torch training step ran 3.5x slower (py-spy: sched_yield, libgomp)."""
    if _openblas is None:
        yield
        return
    before = _openblas.openblas_get_num_threads()
    _openblas.openblas_set_num_threads(1)
    try:
        yield
    finally:
        _openblas.openblas_set_num_threads(before)
