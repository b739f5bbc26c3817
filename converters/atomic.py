"""Write a model directory all at once or not at all.

A conversion writes into a hidden sibling directory and renames it into place
only when everything succeeded. A crash, an exception or Ctrl-C never leaves a
half-written directory under the final name, where `mlx_lm.load` would pick it
up. A process killed outright (SIGKILL, power loss) cannot clean up after
itself: its scratch directory carries its pid and host, and the next writer
into the same directory removes those whose process is gone.
"""

import contextlib
import errno
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterator, Union

from ..checkpoint_checks import CODE_SUFFIXES

OUTPUT_FIX = "choose another output directory (-o)"
# MLX's writers raise RuntimeError, not OSError, when a file cannot be opened or written.
_MLX_WRITE_ERRORS = ("[write] ", "[save] Failed to open", "[save_safetensors] Failed to open")


def check_output_dir(out_dir: Union[str, Path], overwrite: bool = False) -> Path:
    """Fail early, before any work, if ``out_dir`` is taken."""
    out_dir = Path(out_dir).expanduser()
    if out_dir.exists() and not overwrite:
        raise FileExistsError(
            f"Output directory {out_dir} already exists. Pass overwrite=True "
            "(--overwrite) to replace it, or choose another path."
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"Output path {out_dir} exists and is not a directory.")
    return out_dir


@contextlib.contextmanager
def atomic_output_dir(
    out_dir: Union[str, Path], overwrite: bool = False
) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``out_dir`` on success.

    The temporary directory lives next to ``out_dir`` (same filesystem, so the
    final rename is atomic) under a hidden name, ``.{name}.partial-XXXX``. On
    any exception, including ``KeyboardInterrupt``, it is removed. A directory
    that cannot be written and a disk that fills up raise an OSError naming
    the directory and what to do, not a bare errno.
    """
    out_dir = check_output_dir(out_dir, overwrite)
    tmp = temp_dir_in(out_dir.parent, f".{out_dir.name}.partial-", OUTPUT_FIX)
    try:
        yield tmp
        _remove_code_files(tmp)
        _publish(tmp, out_dir, overwrite)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if _disk_full(err):
            raise (type(err) if isinstance(err, OSError) else OSError)(
                f"writing {out_dir} failed ({err}): check the free space in {out_dir.parent} or "
                "write elsewhere (-o; MLXSPEC_CACHE for the model cache)"
            ) from err
        raise


def temp_dir_in(directory: Path, prefix: str, fix: str) -> Path:
    """mkdtemp in `directory` (created if missing); an OSError naming it and `fix` if it fails.

    A read-only or full disk, a file where a directory should be, or missing permissions would
    otherwise surface as a bare errno from deep inside a conversion. The name carries this
    process's pid and host (`{prefix}{pid}@{host}-XXXXXXXX`), and scratch directories left in
    `directory` by dead processes are removed first (`remove_stale_temp_dirs`).
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_dirs(directory)
        return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}@{_host()}-", dir=directory))
    except OSError as err:
        raise _unwritable_dir_error(directory, err, fix) from err


# The scratch directories temp_dir_in makes: a conversion's output (.partial-), a requantized
# GGUF's dense copy (.dense-) and the cache's write test. Not .old-: between _publish's two
# renames it holds the only copy of the directory being replaced.
_SCRATCH = re.compile(
    r"^\.(?:.+\.(?:partial|dense)|write-test)-(?P<pid>\d{1,10})@(?P<host>[\w.-]+)-\w{8}$")


def _host() -> str:
    return re.sub(r"[^\w.-]", "_", socket.gethostname()) or "localhost"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process; not a pid of ours
        return True
    return True


def remove_stale_temp_dirs(directory: Path) -> list[Path]:
    """Remove the scratch directories of writers on this host whose process has ended (killed
    mid-write); returns them. A live writer's, or another host's (a shared disk, where a pid
    says nothing), is left alone, so concurrent conversions into one directory are safe."""
    stale = []
    for entry in directory.iterdir():
        match = _SCRATCH.match(entry.name)
        if (match and match["host"] == _host() and not _process_alive(int(match["pid"]))
                and entry.is_dir() and not entry.is_symlink()):
            shutil.rmtree(entry, ignore_errors=True)
            stale.append(entry)
    return stale


def _remove_code_files(directory: Path) -> None:
    """A converted model holds weights, configs and tokenizer files, never code (a tokenizer's
    save_pretrained copies its custom .py files)."""
    for path in directory.rglob("*"):
        if path.suffix.lower() in CODE_SUFFIXES and (path.is_file() or path.is_symlink()):
            path.unlink()


def _unwritable_dir_error(directory: Path, err: OSError, fix: str) -> OSError:
    """The same kind of OSError as `err`, saying which directory cannot be written and `fix`."""
    blocker = next((p for p in (directory, *directory.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        return NotADirectoryError(f"cannot write into {directory} ({blocker} is a file): {fix}")
    reason = err.strerror or str(err)
    return type(err)(f"cannot write into {directory} ({reason}): {fix}")


def _disk_full(err: BaseException) -> bool:
    """A write that failed for want of space (OSError), or any failed MLX write (RuntimeError)."""
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(err, RuntimeError) and str(err).startswith(_MLX_WRITE_ERRORS)


def _publish(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    # mkdtemp makes 0700 directories; give the result the usual permissions.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    if not out_dir.exists():
        # os.rename would silently replace an empty directory created meanwhile,
        # so the check above is repeated here, right before the rename.
        os.rename(tmp, out_dir)
        return
    if not overwrite:
        raise FileExistsError(f"Output directory {out_dir} appeared during the conversion.")
    # Move the old directory aside first, so out_dir is never missing its files
    # for longer than two renames.
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    os.rename(out_dir, old / out_dir.name)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(old / out_dir.name, out_dir)
        shutil.rmtree(old, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
