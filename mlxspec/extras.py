"""Optional dependencies (the package's extras): a missing one is an error naming its install
command, raised before any work that needs it."""

import importlib.util


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency is not installed; the message says which extra installs it."""


def require(modules: tuple[str, ...], needed_by: str, extra: str) -> None:
    """MissingExtraError for the first of `modules` not installed: "{needed_by} needs {name}"."""
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a broken install, or a finder that refuses it
            found = False
        if not found:
            raise MissingExtraError(
                f"{needed_by} needs {name}, which is not installed: pip install 'mlxspec[{extra}]'",
                name=name,
            )
