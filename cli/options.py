"""The click options, parameter types and flag checks that more than one command shares
(main's generate/chat/bench, serve): the target's flags, --shard, --drafter and the drafters' own
flags, and their checks before anything loads.

Imported by mlxspec.cli.main after it has loaded OpenBLAS (as `import mlxspec` does first anyway):
the drafter registry below imports mlx."""

import click

from mlxspec.backends import BACKENDS
from mlxspec.cli.errors import _fail, _user_errors
from mlxspec.drafters import registry


class DrafterChoice(click.Choice):
    """--drafter's choices, read from the drafter registry when a command runs (a drafter
    registered after this module was imported is offered too)."""

    def __init__(self):
        self.case_sensitive = True

    @property
    def choices(self):
        return registry.drafter_names()


def model_options(f):
    f = click.option("--device", default=None,
                     help="torch device for --backend torch (default: cuda when available, "
                          "else cpu; bfloat16 on CUDA, float32 on the CPU).")(f)
    f = click.option("--backend", type=click.Choice(BACKENDS), default="mlx",
                     show_default=True,
                     help="Run on MLX, or on torch (transformers models, for NVIDIA machines).")(f)
    f = click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]),
                     default="float32", show_default=True,
                     help="Weights dtype when converting a .gguf or HF model on first use.")(f)
    f = click.option("--model", "-m", default=None,
                     help="Model directory, .gguf file or HF repo id. Default: the embedded "
                          "SmolLM2-135M-Instruct.")(f)
    return f


def shard_option(f):
    return click.option(
        "--shard", type=click.Choice(["pipeline", "tensor"]), default="pipeline",
        show_default=True,
        help="Under mlx.launch (two or more ranks): split the target by layers across the ranks "
             "(pipeline), or split every layer (tensor; the head counts must divide).")(f)


def _drafter_option_flags() -> list:
    """A flag per option the registered drafters take (--block-size, --full-vocab, ...)."""
    return [click.option(o.flags, o.name, type=o.type, default=o.default,
                         show_default=o.default is not None, help=o.help)
            for o in registry.drafter_options()]


def shared(options):
    """Apply click options (listed top to bottom) to a command."""
    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command
    return decorate


def _check_drafter(drafter, draft_model, options):
    """The drafter flags checked before a model loads; `options` are the drafter options'
    flags (block_size=..., draft_vocab=...)."""
    kind = registry.drafter_kind(drafter)
    checkpoint = kind.checkpoint
    if checkpoint is not None and checkpoint.shipped is None and not draft_model:
        raise click.BadParameter(f"--drafter {drafter} needs --draft-model",
                                 param_hint="--draft-model")
    if draft_model and checkpoint is None:
        raise click.BadParameter(f"does not apply to --drafter {drafter}", param_hint="--draft-model")
    for option in registry.drafter_options():
        value = options.get(option.name, option.default)
        problem = option.problem(value)
        if problem:
            raise click.BadParameter(problem, param_hint=option.flag_for(value))
        if value != option.default and option not in kind.options:
            takers = " or ".join(registry.takers(option))
            raise click.BadParameter(f"only applies to --drafter {takers}",
                                     param_hint=option.flag_for(value))


def _options_for(drafter: str, values: dict) -> dict:
    """load_drafter options for `drafter` from the flags' values: the ones it takes, the
    defaults left out."""
    return {o.name: values[o.name] for o in registry.drafter_kind(drafter).options
            if values.get(o.name, o.default) != o.default}


def _backend(name):
    """The backend --backend names; a missing extra is one Error: line."""
    from mlxspec.backends import backend_named

    try:
        return backend_named(name)
    except _user_errors() as err:
        _fail(err)


def _check_backend(backend, device):
    if device is not None and not _backend(backend).devices:
        raise click.BadParameter("applies to --backend torch only", param_hint="--device")


def kv_cache_options() -> list:
    """--kv-bits and --kv-group-size (generate, chat, serve)."""
    return [
        click.option("--kv-bits", type=int, default=None,
                     help="Quantize the target's KV cache to this many bits (2-6, 8) once the "
                          "prompt is prefilled: less memory for long contexts; output is the "
                          "target's with that cache, with or without a drafter."),
        click.option("--kv-group-size", type=int, default=64, show_default=True,
                     help="With --kv-bits: values quantized per group (32, 64, 128)."),
    ]


def _check_kv_bits(kv_bits, backend) -> None:
    from mlxspec.backends import backend_named

    if kv_bits is not None and not backend_named(backend).mlx_lm:
        raise click.BadParameter("quantizes MLX caches; use --backend mlx", param_hint="--kv-bits")


def constraint_options() -> list:
    """--json-schema, --json, --regex, --grammar: what the reply must match (at most one)."""
    return [
        click.option("--json-schema", "json_schema", type=click.File("r"), default=None,
                     help="A JSON Schema file: the reply is JSON that follows it."),
        click.option("--json", "json_object", is_flag=True,
                     help="The reply is a JSON object (any)."),
        click.option("--regex", default=None, help="The reply matches this regular expression."),
        click.option("--grammar", type=click.File("r"), default=None,
                     help="A Lark grammar file (llguidance's dialect): the reply is in its "
                          "language."),
    ]


def _constraint(json_schema=None, json_object=False, regex=None, grammar=None):
    """The reply's constraint from its flags (None: none), compiled before a model loads; a
    refused one names its flag."""
    from mlxspec.constraint import Constraint

    given = {"--json-schema": json_schema, "--json": json_object or None, "--regex": regex,
             "--grammar": grammar}
    given = {flag: value for flag, value in given.items() if value is not None}
    if len(given) > 1:
        raise click.UsageError(f"give one of {', '.join(given)}, not several")
    if not given:
        return None
    (flag, value), = given.items()
    try:
        if flag == "--json-schema":
            return Constraint.json_schema(value.read())
        if flag == "--json":
            return Constraint.json_object()
        if flag == "--regex":
            return Constraint.regex(value)
        return Constraint.lark(value.read())
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint=flag) from None
