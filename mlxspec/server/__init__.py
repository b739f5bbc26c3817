"""`mlxspec serve`: an OpenAI-compatible server whose every request runs the speculative loop.

    from mlxspec.server import make_server
    server = make_server(model, tokenizer, drafter="lookup")   # then uvicorn.run(server.app())

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics. Needs the `server` extra (starlette, uvicorn): pip install 'mlxspec[server]'.
"""

from ..loading import MissingExtraError


def _require_server_extra() -> None:
    import importlib.util

    for name in ("starlette", "uvicorn"):
        if importlib.util.find_spec(name) is None:
            raise MissingExtraError(f"mlxspec serve needs {name}, which is not installed: "
                                    "pip install 'mlxspec[server]'", name=name)


def make_server(model, tokenizer, *, drafter: str = "none", draft_model=None, model_id="model",
                api_key: str | None = None, max_queue: int = 64, **drafter_options):
    """A Server for `model`: requests may choose "none", "lookup", or the server's `drafter`
    (and its "+lookup" form), loaded once here; unknown options fail before it starts."""
    _require_server_extra()
    from ..drafters import LookupFirstDrafter, PromptLookupDrafter, load_drafter
    from ..engine import PlainDecoding
    from ..generate import BACKEND_PARTS, resolve_backend
    from .app import Server

    def build_drafters() -> dict:
        drafters = {"none": PlainDecoding(), "lookup": PromptLookupDrafter()}
        if drafter not in drafters or drafter_options or draft_model is not None:
            loaded = load_drafter(drafter, draft_model, model=model, tokenizer=tokenizer,
                                  **drafter_options)
            drafters[drafter] = loaded
            if isinstance(loaded, LookupFirstDrafter):
                drafters.setdefault(drafter.removesuffix("+lookup"), loaded.model_drafter)
            elif drafter not in ("none", "lookup"):
                drafters[f"{drafter}+lookup"] = LookupFirstDrafter(loaded)
        return drafters

    parts = BACKEND_PARTS[resolve_backend(model, None)]()
    return Server(model, tokenizer, model_id=model_id, build_drafters=build_drafters,
                  default_drafter=drafter, api_key=api_key, max_queue=max_queue,
                  context_length=parts.context_length(model))


__all__ = ["make_server"]
