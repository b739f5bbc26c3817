"""Write a model directory all at once or not at all.

A conversion writes into a hidden sibling directory and renames it into place
only when everything succeeded. A crash, an exception or Ctrl-C never leaves a
half-written directory under the final name, where `mlx_lm.load` would pick it
up.
"""

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Union


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
    any exception, including ``KeyboardInterrupt``, it is removed.
    """
    out_dir = check_output_dir(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        yield tmp
        _publish(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
