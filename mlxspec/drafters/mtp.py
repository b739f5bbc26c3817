"""MTP drafting: the multi-token-prediction modules a target ships, chained into K drafts.

No training and no second model: module 1 reads the target's own normed last hidden state and
the next token, as in pre-training. Pairs (token p+1, target hidden of position p) of every
committed position are kept in each module's KV cache (drafters/paired.py's bookkeeping, shared
with EAGLE-3), so draft 1 costs only the output head; draft j+1 runs module j mod n (n shipped:
a single module is reused for every depth, as DeepSeek's and mtplx's serving do) on (draft j,
the previous depth's hidden) at the next position. Chain entries are cut after verification and
the committed pairs appended with the target's verified hidden states, to every module (a
second module's own input at a committed position would be the first's output there; like
mtplx, each module is fed the target's instead, one pass per module per step). Sampled drafts report the
module's processed distribution as p, so acceptance is the exact min(1, q/p) rule.
"""

from pathlib import Path

from ..backends import backend_for
from ..backends.mlx.hidden_states import decoder_layers
from ..file_checks import read_json_object, safetensors_names
from ..loading import SOURCE
from ..request import check_drafter_window
from ..models.mtp import (
    MTP_WEIGHTS,
    SHIPPING,
    build_mtp_model,
    family_of,
    mtp_count,
    read_mtp_tensors,
    text_config,
)
from .paired import MLXPairedDrafting, PairedDrafting, check_tree_options

# Model types whose MTP layout the torch backend builds (backends/torch/mtp.py): DeepSeek-V3's,
# which GLM-4.5 ships too. transformers has no MTP for the Qwen families or MiMo.
TORCH_MODEL_TYPES = ("deepseek_v3", "glm4_moe")
# The backends that build only some layouts, by name (the MLX backend builds every family's).
MODEL_TYPES_BY_BACKEND = {"torch": TORCH_MODEL_TYPES}


class MTPDrafting(PairedDrafting):
    """PairedDrafting over a target's MTP modules, for both backends: the target's last layer
    is captured (its final norm is applied by the model's `project`), each committed pair runs
    through every module, and the chain picks its module by depth."""

    name = "mtp"

    def __init__(self, model, *, num_target_layers: int, hidden_size: int, target_vocab: int,
                 **tree_options):
        super().__init__(model, capture_layers=(num_target_layers - 1,),
                         feature_width=hidden_size, target_vocab=target_vocab,
                         default_num_draft=3, **tree_options)
        self.num_modules = len(model.mtp)

    def _extend(self, ids, features):
        hidden = self.model.project(features)
        outputs = [self.model.run(i, ids, hidden, self.cache) for i in range(self.num_modules)]
        return outputs[0]  # module 1's output ranks the pending token's successor

    def _chain(self, k: int, choose) -> None:
        x, module = self._last_output()[None], 0  # (1, 1, H)
        for j in range(k):
            token = choose(j, self.model.logits(x, module)[0, -1])
            if j + 1 < k:
                hidden = self.model.chained(x, module)
                module = (j + 1) % self.num_modules
                x = self.model.run(module, token.reshape(1, 1), hidden, self.cache)


class MTPDrafter(MTPDrafting, MLXPairedDrafting):
    """MTP on MLX: one KV cache list per module; a chain step extends only its module's."""

    def _cache_length(self) -> int:
        return max(c[0].offset for c in self.cache)

    def _cut(self, n: int) -> None:
        keep = self._cache_length() - n  # modules a chain skipped hold fewer entries
        for module_cache in self.cache:
            for c in module_cache:
                c.trim(max(c.offset - keep, 0))


def source_dir(model) -> Path | None:
    """The directory an mlxspec-loaded target came from (None for a model built otherwise)."""
    return getattr(model, SOURCE, None)


def why_unavailable(model) -> str | None:
    """Why `model` has no MTP modules to draft with, in check_mtp_source's words; None when it
    has them, or when it was not loaded from a directory (an explicit path may still come)."""
    path = source_dir(model)
    if path is None:
        return None
    try:
        check_mtp_source(path, model)
    except ValueError as err:
        return str(err)
    return None


def read_model_config(path) -> dict:
    return read_json_object(Path(path) / "config.json")


def check_mtp_source(path, model) -> None:
    """Refuse, in one line and before any weight loads, a target that ships no MTP modules or a
    directory that lost them (mlx-lm's conversion drops them)."""
    path = Path(path)
    config = read_model_config(path)
    model_type = config.get("model_type")
    family = family_of(model_type)
    if family is None:
        raise ValueError(
            f"the mtp drafter needs a target that ships multi-token-prediction layers "
            f"({SHIPPING}); {path} is a {model_type} model, which has none")
    backend = backend_for(model).name
    covered = MODEL_TYPES_BY_BACKEND.get(backend)
    if covered is not None and model_type not in covered:
        raise ValueError(
            f"the {backend} backend's mtp drafter covers {', '.join(covered)} (DeepSeek-V3, "
            f"GLM-4.5); {path} is a {model_type} model: use the MLX backend")
    if mtp_count(config) < 1:
        raise ValueError(
            f"{path}/config.json declares no MTP layers ({family.count_key} is "
            f"{text_config(config).get(family.count_key)!r}): this checkpoint ships none")
    if not (path / MTP_WEIGHTS).is_file() and not any(
            family.owns(k, config) for k in _shard_keys(path)):
        raise ValueError(
            f"{path} holds no MTP weights: it was converted without them (mlx-lm's conversion "
            f"drops them); convert the Hugging Face checkpoint again with `mlxspec convert`, "
            f"which keeps them in {MTP_WEIGHTS}")


def _shard_keys(path: Path) -> list[str]:
    """Tensor names in a directory's safetensors, read from the index or the files' headers."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return list(read_json_object(index).get("weight_map", {}))
    return [k for shard in sorted(path.glob("*.safetensors")) for k in safetensors_names(shard)]


def load_mtp_drafter(path, *, model, tokenizer=None, tree_budget: int | None = None,
                     tree_width: int = 4, tree_depth: int = 6,
                     window: int | None = None) -> MTPDrafter:
    """The MTP drafter of mlx-lm target `model` from its checkpoint directory `path` (by default
    the directory mlxspec.load read it from): the modules declared by its config, with the
    weights kept by `mlxspec convert` or inside a Hugging Face checkpoint. `tokenizer` is
    accepted for symmetry with other drafters. `tree_budget`: EAGLE-2's dynamic tree of up to
    this many nodes (`tree_width` children per node, `tree_depth` levels) grown by module 1,
    instead of a chain. `window`: each module entry sees at most this many of its cache's
    (--drafter-window)."""
    tree_options = dict(tree_budget=tree_budget, tree_width=tree_width, tree_depth=tree_depth)
    check_tree_options(tree_budget, tree_width, tree_depth)
    check_drafter_window(window)
    path = Path(path)
    check_mtp_source(path, model)
    config = read_model_config(path)
    tensors, published = read_mtp_tensors(path, config)
    mtp = build_mtp_model(model, config, tensors, published=published)
    mtp.context_window = window
    settings = text_config(config)
    return MTPDrafter(mtp, num_target_layers=len(decoder_layers(model)),
                      hidden_size=int(settings["hidden_size"]),
                      target_vocab=int(settings["vocab_size"]), **tree_options)


__all__ = ["MTPDrafter", "MTPDrafting", "check_mtp_source", "load_mtp_drafter"]
