"""How the CLI turns a user's error into one `Error:` line (click's ClickException), for every
command module."""

import click

from mlxspec.distributed import DistributedError


def _fail(err: Exception):
    raise click.ClickException(str(err)) from None


def _user_errors() -> tuple:
    """What bad input files, a missing extra or the disk (full, read-only) raise while loading or
    converting: one line each from the CLI. OSError covers permissions and disk space."""
    from mlxspec.extras import MissingExtraError

    return (ValueError, OSError, MissingExtraError, DistributedError)
