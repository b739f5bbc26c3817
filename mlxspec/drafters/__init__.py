"""Drafters: sources of draft tokens, all verified by the one loop in `mlxspec.engine`."""

from ..backends import backend_for
from ..engine import Drafter, PlainDecoding
from .draft_model import DraftModelDrafter
from .hybrid import CopyFirstDrafter, LookupFirstDrafter
from .lookup import PromptLookupDrafter
from .registry import drafter_kind, drafter_names

__all__ = ["CopyFirstDrafter", "DraftModelDrafter", "LookupFirstDrafter", "PromptLookupDrafter", "load_drafter",
           "resolve_drafter"]


def __getattr__(name):
    if name == "DRAFTER_KINDS":  # read when asked: a drafter registered later is in it
        return drafter_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_drafter(kind: str, path: str | None = None, *, model, tokenizer, **options) -> Drafter:
    """Build a drafter for `model`, checking it against the target before any compute.

    kind: "none", "lookup" (options: max_ngram, min_ngram), "draft" (path: a draft model with
    the target's tokenizer, as a converted directory, a .gguf file or a Hugging Face repo id),
    "dflash" (path: a DFlash drafter checkpoint for this target; default: the one shipped for it;
    options: block_size, draft_vocab), "eagle3", "mtp", "medusa" (path: Medusa heads trained
    for this target; default: the ones shipped for it), "layerskip" (no path; option:
    exit_layer), or "X+lookup" / "X+suffix" for a model drafter X drafts by prompt lookup
    (suffix decoding) where it finds a match and by that model elsewhere (path is the model's;
    options are either one's); or any other kind in
    `mlxspec.drafters.registry`.
    A transformers `model` (the torch backend) gets the torch twins of the model drafters.
    """
    entry = drafter_kind(kind)
    backend = backend_for(model).name
    if backend not in entry.factories:
        raise ValueError(f"the {kind} drafter does not run on the {backend} backend")
    checkpoint = entry.checkpoint
    if checkpoint is not None:
        if path is None and checkpoint.shipped is not None:
            path = checkpoint.shipped(model)
            options = {**checkpoint.shipped_options.get(backend, {}), **options}
        if path is None:
            note = f"; {checkpoint.shipped_note}" if checkpoint.shipped_note else ""
            raise ValueError(
                f"the {entry.model_name} drafter needs {checkpoint.what} (--draft-model){note}")
        if checkpoint.check is not None:
            checkpoint.check(path, model)
    return entry.factories[backend](path, model=model, tokenizer=tokenizer, **options)


def resolve_drafter(drafter, *, model, tokenizer) -> Drafter:
    if drafter is None:
        return PlainDecoding()
    if isinstance(drafter, str):
        return load_drafter(drafter, model=model, tokenizer=tokenizer)
    if not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must be a Drafter or a name, got {type(drafter).__name__}")
    owner = getattr(drafter, "backend", None)  # set by the torch drafters
    backend = backend_for(model).name
    if owner is not None and owner != backend:
        raise ValueError(
            f"the {drafter.name} drafter was built for the {owner} backend, the target model is "
            f"a {backend} model"
        )
    return drafter
