"""`mlxspec serve`: the OpenAI-compatible server (mlxspec.server), from the command line."""

from pathlib import Path

import click

from mlxspec.cli.main import (
    DrafterChoice,
    _backend_line,
    _check_backend,
    _check_decoding,
    _drafter_option_flags,
    _fail,
    _options_for,
    _user_errors,
    load_target,
    main,
    model_options,
    shard_option,
    split_target,
)
from mlxspec.cli.train import shared


def _model_id(model: str | None) -> str:
    """The name /v1/models lists and requests give as "model": the directory's name, the repo
    id, or the default model's name."""
    from mlxspec.loading import DEFAULT_MODEL_NAME

    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    return path.name if path.exists() else model


@main.command()
@model_options
@shard_option
@shared([
    click.option("--drafter", type=DrafterChoice(), default="none", show_default=True,
                 help="The drafter of requests that name none (their body's \"drafter\"); "
                      "requests may choose none, lookup, this one or its +lookup form."),
    click.option("--draft-model", "--drafter-model", "draft_model", default=None,
                 help="The checkpoint of a model drafter (as for generate)."),
    *_drafter_option_flags(),
    click.option("--host", default="127.0.0.1", show_default=True,
                 help="Address to listen on: loopback only by default; 0.0.0.0 exposes the "
                      "server to the network (set --api-key then)."),
    click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True),
    click.option("--api-key", default=None, envvar="MLXSPEC_API_KEY",
                 help="Require 'Authorization: Bearer KEY' on every /v1 request "
                      "(or set MLXSPEC_API_KEY)."),
    click.option("--max-queue", type=click.IntRange(min=1), default=64, show_default=True,
                 help="Requests that may wait for the model; more are answered 429."),
])
def serve(model, dtype, backend, device, shard, drafter, draft_model, host, port, api_key,
          max_queue, **drafter_options):
    """Serve the model over an OpenAI-compatible HTTP API (needs: pip install 'mlxspec[server]').

    \b
    curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 64}'
    """
    from mlxspec.server import _require_server_extra, make_server

    _check_decoding(None, 1, drafter, draft_model, drafter_options)
    _check_backend(backend, device)
    try:
        _require_server_extra()
    except _user_errors() as err:
        _fail(err)
    target, tokenizer = load_target(model, dtype, backend, device, shard)
    split_target(target)  # under mlx.launch, ranks other than 0 serve rank 0's passes
    try:
        server = make_server(target, tokenizer, drafter=drafter, draft_model=draft_model,
                             model_id=_model_id(model), api_key=api_key, max_queue=max_queue,
                             **_options_for(drafter, drafter_options))
    except _user_errors() as err:
        _fail(err)
    import uvicorn

    click.echo(f"mlxspec serve: {server.model_id} ({_backend_line(target)}), drafter {drafter}, "
               f"on http://{host}:{port}/v1", err=True)
    uvicorn.run(server.app(), host=host, port=port, log_level="warning",
                timeout_graceful_shutdown=30)


__all__ = ["serve"]  # registered with main by its decorator; main imports this module
