"""`mlxspec serve`: an OpenAI-compatible server whose every request runs the speculative loop.

    from mlxspec.server import make_server
    server = make_server(model, tokenizer, drafter="lookup")   # then uvicorn.run(server.app())

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics. Needs the `server` extra (starlette, uvicorn): pip install 'mlxspec[server]'.

make_server does not bind an address: whoever runs its app beyond loopback calls
check_exposure(host, api_key) first, as `mlxspec serve` does (no key there is refused).
"""

from ..extras import require
from .guards import check_exposure
from .requests import DEFAULT_MAX_NUM_DRAFT

# Registered drafters every server offers: they load nothing. Suffix's history of replies is the
# server's own, shared by every request that drafts from it (its "X+suffix" forms' too).
ALWAYS_OFFERED = ("none", "lookup", "suffix")


def _require_server_extra() -> None:
    require(("starlette", "uvicorn"), "mlxspec serve", "server")


def make_server(model, tokenizer, *, drafter: str = "none", draft_model=None, model_id="model",
                api_key: str | None = None, max_queue: int = 64, render_timeout: float = 10.0,
                max_num_draft: int = DEFAULT_MAX_NUM_DRAFT, max_batch: int = 1,
                prompt_cache_file=None, kv_bits: int | None = None, kv_group_size: int = 64,
                **drafter_options):
    """A Server for `model`: requests may choose "none", "lookup", "suffix", or the server's
    `drafter` (and, for a model drafter, its "+lookup" and "+suffix" forms), loaded once here;
    unknown options fail before it starts.
    A request's num_draft may be at most `max_num_draft` (and the drafter's own maximum caps
    what a step verifies). `max_batch` > 1 serves up to that many requests at once as rows of
    one batch (mlxspec.server.batching), where the backend, model and drafter allow it;
    1 serves them one at a time, continuing kept prompt caches. `prompt_cache_file`: a
    safetensors prompt cache (PromptCache.save) the kept caches start with, where it exists,
    and where the most recently used one is written when the server stops. `kv_bits`: every
    request's target keeps its keys and values quantized (as generate's kv_bits), batched or
    not."""
    _require_server_extra()
    from ..request import check_count, check_kv_settings

    check_count("max_num_draft", max_num_draft)
    check_count("max_batch", max_batch)
    check_kv_settings(kv_bits, kv_group_size)
    from ..drafters import CopyFirstDrafter, load_drafter, registry
    from ..drafters.registry import COPIERS
    from ..backends import backend_for
    from .app import Server

    def build_drafters() -> dict:
        drafters = {name: load_drafter(name, model=model, tokenizer=tokenizer)
                    for name in ALWAYS_OFFERED}
        if drafter not in drafters or drafter_options or draft_model is not None:
            loaded = load_drafter(drafter, draft_model, model=model, tokenizer=tokenizer,
                                  **drafter_options)
            drafters[drafter] = loaded
            base = registry.drafter_kind(drafter).base
            model_drafter = loaded.model_drafter if base is not None else loaded
            if base is not None:  # its model drafter, and its copier as the server's own
                drafters.setdefault(base, model_drafter)
                drafters[loaded.copier.name] = loaded.copier
            if drafter not in ALWAYS_OFFERED:  # the model drafter behind each copier too
                for copier in COPIERS:
                    drafters.setdefault(f"{base or drafter}+{copier}",
                                        CopyFirstDrafter(model_drafter, drafters[copier]))
        return drafters

    parts = backend_for(model)
    if prompt_cache_file is not None and not parts.mlx_lm:
        raise ValueError("prompt cache files hold MLX caches; this model is a "
                         f"{parts.name} model")
    if kv_bits is not None:
        if not parts.mlx_lm:
            raise ValueError(f"kv_bits quantizes MLX caches; this is a {parts.name} model")
        from ..backends.mlx.target import check_kv_group_size

        check_kv_group_size(model, kv_group_size)
    return Server(model, tokenizer, model_id=model_id, build_drafters=build_drafters,
                  default_drafter=drafter, api_key=api_key, max_queue=max_queue,
                  context_length=parts.context_length(model), render_timeout=render_timeout,
                  max_num_draft=max_num_draft, max_batch=max_batch,
                  cache_file=prompt_cache_file,
                  kv_quantization=None if kv_bits is None else (kv_bits, kv_group_size))


__all__ = ["check_exposure", "make_server"]
