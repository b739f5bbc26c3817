"""`mlxspec serve`: the OpenAI-compatible server (mlxspec.server), from the command line."""

from pathlib import Path

import click

from mlxspec.cli.errors import _fail, _user_errors
from mlxspec.cli.options import (
    DrafterChoice,
    _check_backend,
    _check_drafter,
    _check_kv_bits,
    _drafter_option_flags,
    _options_for,
    kv_cache_options,
    model_options,
    shard_option,
    shared,
)
from mlxspec.cli.prompt_cache_files import PROMPT_CACHE_FILE, check_prompt_cache_file
from mlxspec.cli.targets import _backend_line, load_target, split_target
from mlxspec.request import check_kv_settings
from mlxspec.server.requests import DEFAULT_MAX_NUM_DRAFT


def _model_id(model: str | None) -> str:
    """The name /v1/models lists and requests give as "model": the directory's name, the repo
    id, or the default model's name."""
    from mlxspec.loading import DEFAULT_MODEL_NAME

    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    return path.name if path.exists() else model


@click.command()
@model_options
@shard_option
@shared([
    click.option("--drafter", type=DrafterChoice(), default="none", show_default=True,
                 help="The drafter of requests that name none (their body's \"drafter\"); "
                      "requests may choose none, lookup, suffix, this one or its +lookup and "
                      "+suffix forms."),
    click.option("--draft-model", "--drafter-model", "draft_model", default=None,
                 help="The checkpoint of a model drafter (as for generate)."),
    *_drafter_option_flags(),
    click.option("--host", default="127.0.0.1", show_default=True,
                 help="Address to listen on: loopback only by default; 0.0.0.0 exposes the "
                      "server to the network, which needs --api-key (or "
                      "--insecure-no-api-key)."),
    click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True),
    click.option("--api-key", default=None, envvar="MLXSPEC_API_KEY",
                 help="Require 'Authorization: Bearer KEY' on every /v1 request "
                      "(or set MLXSPEC_API_KEY)."),
    click.option("--insecure-no-api-key", is_flag=True,
                 help="Serve a --host beyond loopback without --api-key: anyone who can reach "
                      "it may use the model (a warning is printed)."),
    click.option("--render-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0,
                 show_default=True,
                 help="Seconds a request's chat template and tokenisation may take; longer "
                      "ones are answered 400."),
    click.option("--max-queue", type=click.IntRange(min=1), default=64, show_default=True,
                 help="Requests that may wait for the model; more are answered 429."),
    click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True,
                 help="Requests generated at once, as rows of one batch verified together "
                      "(continuous batching: they join and leave between steps). 1 serves one "
                      "at a time, reusing prompt caches across requests; batching is off "
                      "where it cannot run (torch backend, split target, LayerSkip)."),
    click.option("--max-num-draft", type=click.IntRange(min=1), default=DEFAULT_MAX_NUM_DRAFT,
                 show_default=True,
                 help="The most drafts per step a request may ask for (its \"num_draft\"); "
                      "more are answered 400. Each step verifies up to this many + 1 tokens."),
    *kv_cache_options(),
])
@PROMPT_CACHE_FILE
def serve(model, dtype, backend, device, shard, drafter, draft_model, host, port, api_key,
          insecure_no_api_key, render_timeout, max_queue, max_batch, max_num_draft, kv_bits,
          kv_group_size, prompt_cache_file, **drafter_options):
    """Serve the model over an OpenAI-compatible HTTP API (needs: pip install 'mlxspec[server]').

    \b
    curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 64}'
    """
    from mlxspec.server import _require_server_extra, check_exposure, make_server

    try:
        warning = check_exposure(host, api_key, insecure=insecure_no_api_key)
    except ValueError as err:
        _fail(err)
    if warning:
        click.echo(warning, err=True)
    _check_drafter(drafter, draft_model, drafter_options)
    _check_backend(backend, device)
    _check_kv_bits(kv_bits, backend)
    try:
        check_kv_settings(kv_bits, kv_group_size)
    except ValueError as err:  # names kv_bits or kv_group_size
        raise click.BadParameter(str(err), param_hint="--" + str(err).split()[0].replace(
            "_", "-")) from None
    check_prompt_cache_file(prompt_cache_file, backend)
    try:
        _require_server_extra()
    except _user_errors() as err:
        _fail(err)
    target, tokenizer = load_target(model, dtype, backend, device, shard)
    split_target(target)  # under mlx.launch, ranks other than 0 serve rank 0's passes
    try:
        server = make_server(target, tokenizer, drafter=drafter, draft_model=draft_model,
                             model_id=_model_id(model), api_key=api_key, max_queue=max_queue,
                             render_timeout=render_timeout,
                             max_num_draft=max_num_draft, max_batch=max_batch,
                             kv_bits=kv_bits, kv_group_size=kv_group_size,
                             prompt_cache_file=prompt_cache_file,
                             **_options_for(drafter, drafter_options))
    except _user_errors() as err:
        _fail(err)
    import uvicorn

    click.echo(f"mlxspec serve: {server.model_id} ({_backend_line(target)}), drafter {drafter}, "
               f"{server.worker.describe()}, on http://{host}:{port}/v1", err=True)
    uvicorn.run(server.app(), host=host, port=port, log_level="warning",
                timeout_graceful_shutdown=30)


__all__ = ["serve"]  # main registers it (main.add_command)
