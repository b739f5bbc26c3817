"""Load OpenBLAS before MLX on Linux.

The Linux `mlx[cpu]` wheel bundles a slow reference BLAS; a system OpenBLAS loaded into the global
symbol namespace first makes MLX's fp32 matmuls ~16x faster. This must run before `mlx.core` is
imported (MLX binds its BLAS symbols when it loads), so `mlxspec/__init__.py` calls it first; a
program that imports mlx first gets a SlowBlasWarning. Set MLXSPEC_BLAS=reference to keep the
bundled BLAS (to measure both ways).
"""

import ctypes
import ctypes.util
import os
import sys
import warnings
from contextlib import contextmanager

_CANDIDATES = (
    "libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "libopenblas.so",
)
_REFERENCE = "bundled reference BLAS"
_NOT_FOUND = f"{_REFERENCE} (OpenBLAS not found: apt-get install libopenblas0-pthread)"
_SLOW = "MLX uses its bundled reference BLAS (fp32 matmuls 4-48x slower)"
_NOT_FOUND_WARNING = (f"OpenBLAS not found, so {_SLOW}. Install libopenblas0-pthread, or set "
                      "MLXSPEC_BLAS=reference to keep the bundled BLAS without this warning.")

_blas_in_use = None
_openblas = None  # the loaded library, for its thread-count calls


class SlowBlasWarning(RuntimeWarning):
    """MLX runs on its slow bundled BLAS although the user did not ask for it."""


def preload_openblas() -> str:
    """Return a description of the BLAS MLX will use, loading OpenBLAS if possible (once)."""
    global _blas_in_use
    if _blas_in_use is None:
        _blas_in_use, warning = _choose_blas()
        if warning:
            warnings.warn(warning, SlowBlasWarning, stacklevel=2)
    return _blas_in_use


def blas_in_use() -> str:
    return preload_openblas()


def _choose_blas() -> tuple[str, str | None]:
    """The BLAS description and, when MLX ends up on the slow one unasked, a warning."""
    global _openblas
    if sys.platform == "darwin":
        return "Accelerate (macOS)", None
    if not sys.platform.startswith("linux"):
        return f"MLX's own BLAS ({sys.platform})", None
    loaded = _global_blas()
    if loaded:  # LD_PRELOAD, or the program loaded one with RTLD_GLOBAL: MLX binds to it
        is_openblas = "openblas" in os.path.basename(loaded).lower()
        if is_openblas:
            _openblas = ctypes.CDLL(loaded)
        return f"{'OpenBLAS' if is_openblas else 'BLAS'} ({loaded}, loaded before mlxspec)", None
    if os.environ.get("MLXSPEC_BLAS", "").lower() == "reference":
        return f"{_REFERENCE} (MLXSPEC_BLAS=reference)", None
    if "mlx.core" in sys.modules:  # too late: MLX bound its BLAS symbols when it loaded
        openblas = _openblas_on_disk()
        if openblas is None:
            return _NOT_FOUND, _NOT_FOUND_WARNING
        return f"{_REFERENCE} (mlx.core was imported before mlxspec could load OpenBLAS)", (
            f"mlx.core was imported before mlxspec could load OpenBLAS, so {_SLOW}. Import "
            f"mlxspec before mlx, or preload OpenBLAS: LD_PRELOAD={openblas}")
    for name in _CANDIDATES:
        try:
            _openblas = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        return f"OpenBLAS ({name})", None
    return _NOT_FOUND, _NOT_FOUND_WARNING


def _global_blas() -> str | None:
    """The file of the cblas_sgemm that libraries loaded now bind to, or None: found in the
    global symbol scope (the program, LD_PRELOAD, RTLD_GLOBAL loads), which MLX's lookups
    search before its bundled BLAS."""
    try:
        address = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value
    except AttributeError:
        return None
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            if start <= address < end and len(fields) > 5:
                return fields[5]
    return "an unknown library"


def _openblas_on_disk() -> str | None:
    """An OpenBLAS that could be loaded, found without loading it (it starts threads)."""
    for name in _CANDIDATES:
        if os.path.isabs(name) and os.path.exists(name):
            return name
    return ctypes.util.find_library("openblas")


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
