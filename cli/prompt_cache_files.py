"""--prompt-cache-file for generate, chat and serve: a prompt cache read from a file before the
first generation and written back after, so a long prompt (an agent's system prompt and tools)
is prefilled once across processes. Shared by main's commands and serve."""

from pathlib import Path

import click

from mlxspec.cli.errors import _fail, _user_errors

PROMPT_CACHE_FILE = click.option(
    "--prompt-cache-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
    help="A safetensors file holding the target's prompt cache: read before generating when it "
         "exists (only the part of the prompt it does not hold is prefilled), written after. "
         "Another model's file, or a damaged one, is refused.")


def check_prompt_cache_file(path: Path | None, backend: str) -> None:
    """What can be refused before the model loads: another backend, a file that is not one."""
    if path is None:
        return
    from mlxspec.backends import backend_named

    if not backend_named(backend).mlx_lm:
        raise click.BadParameter("prompt cache files hold MLX caches; use --backend mlx",
                                 param_hint="--prompt-cache-file")
    if path.exists():
        from mlxspec.backends.mlx.prompt_cache_file import check_file

        try:
            check_file(path)
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--prompt-cache-file") from None
    elif not path.parent.is_dir():
        raise click.BadParameter(f"the folder {path.parent} does not exist",
                                 param_hint="--prompt-cache-file")


def open_prompt_cache(path: Path | None, target):
    """The file's prompt cache for `target` (checked against it), a new one where the file does
    not exist yet; None without --prompt-cache-file."""
    if path is None:
        return None
    import mlxspec

    if not path.exists():
        return mlxspec.PromptCache()
    try:
        return mlxspec.PromptCache.load(path, target)
    except _user_errors() as err:
        _fail(err)


def save_prompt_cache(cache, path: Path | None) -> None:
    """Write the cache back (whole or not at all) when it holds something."""
    if path is None or cache is None or not cache.tokens:
        return
    try:
        cache.save(path)
    except _user_errors() as err:
        _fail(err)
