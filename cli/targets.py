"""Loading the target from the CLI's flags, and splitting it across the ranks under mlx.launch:
shared by main's commands and serve."""

import sys

import click

from mlxspec.cli.errors import _fail, _user_errors
from mlxspec.cli.options import _backend
from mlxspec.distributed import DistributedError


def load_target(model, dtype, backend, device, shard):
    """The target, split across the ranks when mlx.launch started several (see split_target)."""
    import mlxspec
    from mlxspec.distributed import launched

    if launched() and not _backend(backend).mlx_lm:
        raise click.BadParameter("a target split across ranks runs on mlx only",
                                 param_hint="--backend")
    try:
        return mlxspec.load(model, dtype=dtype, backend=backend, device=device,
                            shard=shard if launched() else None)
    except _user_errors() as err:
        _fail(err)


def split_target(target):
    """Under mlx.launch: the other ranks follow rank 0's passes until it shuts them down, then
    exit here; rank 0 shuts them down when its command ends, however it ends."""
    from mlxspec.distributed import follower, stage_of

    stage = stage_of(target)
    if stage is None:
        return
    if stage.leads:
        click.get_current_context().call_on_close(stage.link.shutdown)
        return
    try:
        follower(target).serve()
    except DistributedError as err:
        _fail(err)
    sys.exit(0)  # the command's work was rank 0's


def _backend_line(target) -> str:
    from mlxspec.backends import backend_for

    return backend_for(target).describe(target)
