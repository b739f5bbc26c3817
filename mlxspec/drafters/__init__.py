"""Drafters: sources of draft tokens, all verified by the one loop in `mlxspec.engine`."""

from ..engine import Drafter, PlainDecoding
from ..loading import backend_of
from ..mlx_backend import vocab_size
from .draft_model import DraftModelDrafter, check_same_tokenizer
from .hybrid import LookupFirstDrafter
from .lookup import PromptLookupDrafter

DRAFTER_KINDS = ("none", "lookup", "draft", "dflash", "draft+lookup", "dflash+lookup")


def load_drafter(kind: str, path: str | None = None, *, model, tokenizer, **options) -> Drafter:
    """Build a drafter for `model`, checking it against the target before any compute.

    kind: "none", "lookup" (options: max_ngram, min_ngram), "draft" (path: a draft model with
    the target's tokenizer, as a converted directory, a .gguf file or a Hugging Face repo id),
    "dflash" (path: a DFlash drafter checkpoint for this target; option: block_size), or
    "draft+lookup" and "dflash+lookup" draft by prompt lookup where it finds a match and by that
    model elsewhere (path and options are the model's).
    A transformers `model` (the torch backend) gets the torch twins of "draft" and "dflash".
    """
    if kind not in DRAFTER_KINDS:
        raise ValueError(f"unknown drafter {kind!r}; choose from {', '.join(DRAFTER_KINDS)}")
    if kind == "none":
        return PlainDecoding()
    if kind == "lookup":
        return PromptLookupDrafter(**options)
    if kind.endswith("+lookup"):
        model_kind = kind.removesuffix("+lookup")
        return LookupFirstDrafter(load_drafter(model_kind, path, model=model, tokenizer=tokenizer,
                                               **options))
    if kind == "dflash" and path is None:
        path = shipped_drafter_path(model)
        if backend_of(model) == "mlx":
            options.setdefault("dtype", "target")  # stored in bf16 to keep the package small
        if path is None:
            raise ValueError(
                "the dflash drafter needs a drafter checkpoint trained for this target "
                "(--draft-model); mlxspec ships one only for the default SmolLM2-135M-Instruct"
            )
    if path is not None and backend_of(model) == "torch":
        from .. import torch_backend

        return torch_backend.load_drafter(kind, path, model=model, tokenizer=tokenizer, **options)
    if kind == "dflash":
        from .dflash import load_dflash_drafter

        return load_dflash_drafter(path, model=model, tokenizer=tokenizer, **options)
    if path is None:
        raise ValueError("the draft drafter needs a draft model path (--draft-model)")
    from ..loading import load

    draft_model, draft_tokenizer = load(path, **options)
    check_same_tokenizer(tokenizer, draft_tokenizer, vocab_size(model), vocab_size(draft_model))
    return DraftModelDrafter(draft_model)


def shipped_drafter_path(model):
    """The trained DFlash drafter shipped for this target (MLX or transformers), or None."""
    from .dflash import find_shipped_drafter, shipped_drafter_for

    if backend_of(model) == "mlx":
        return shipped_drafter_for(model)
    config = model.config
    sizes = (config.hidden_size, config.vocab_size, config.num_hidden_layers)
    weight = model.get_input_embeddings().weight
    return find_shipped_drafter(sizes, lambda: float(weight[:8].float().sum().item()))


def resolve_drafter(drafter, *, model, tokenizer) -> Drafter:
    if drafter is None:
        return PlainDecoding()
    if isinstance(drafter, str):
        return load_drafter(drafter, model=model, tokenizer=tokenizer)
    if not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must be a Drafter or a name, got {type(drafter).__name__}")
    owner = getattr(drafter, "backend", None)  # set by the torch drafters
    if owner is not None and owner != backend_of(model):
        raise ValueError(
            f"the {drafter.name} drafter was built for the {owner} backend, the target model is "
            f"a {backend_of(model)} model"
        )
    return drafter
