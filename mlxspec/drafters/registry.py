"""One registry of drafter kinds, read by `load_drafter`, `stream_generate(drafter="...")`, the
CLI's --drafter and bench's --drafters, so that a new drafter is its module plus one `register`.

An entry says how to build the drafter on each backend, which options it takes (each with its
command-line flag), and, for a model drafter, the checkpoint it loads and how that is checked
against the target before any weight loads. Each model drafter also gets "name+lookup" and
"name+suffix" forms, derived here: the copier where it drafts, the model elsewhere
(drafters/hybrid.py).
Torch factories are imported when first called, so the MLX path never imports torch.
"""

import importlib
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from ..backends import BACKENDS, backend_for
from ..engine import Drafter, PlainDecoding
from ..tree import MAX_TREE_BUDGET
from .hybrid import CopyFirstDrafter
from .lookup import PromptLookupDrafter
from .suffix import SuffixDrafter

Factory = Callable[..., Drafter]  # (path, *, model, tokenizer, **options) -> a Drafter


@dataclass(frozen=True)
class DrafterOption:
    """A keyword a drafter's factories take, and the command-line flag that sets it."""

    name: str  # the keyword, e.g. "block_size"
    flags: str  # click's spelling: "--block-size", or a switch "--draft-vocab/--full-vocab"
    help: str
    type: Any = None  # click infers it from `default` when None
    default: Any = None  # what the factory assumes when the keyword is left out
    minimum: int | None = None  # the least value a number may take, checked before loading
    maximum: int | None = None  # the most, likewise (a bound on the work of a step)

    def flag_for(self, value) -> str:
        """The flag a user writes to set `value` (a switch's second flag sets False)."""
        on, _, off = self.flags.partition("/")
        return off if value is False and off else on

    def problem(self, value) -> str | None:
        """What is wrong with `value` (below `minimum`), checked before any loading; None if
        nothing. Callers name the flag their own way (click's param hint, a bench label)."""
        if self.minimum is not None and value is not None and value < self.minimum:
            return f"must be >= {self.minimum}, got {value}"
        if self.maximum is not None and value is not None and value > self.maximum:
            return f"must be <= {self.maximum}, got {value}"
        return None


@dataclass(frozen=True)
class Checkpoint:
    """The files a model drafter loads: --drafter-model on the CLI, `path` in the API."""

    what: str  # said when none is given: "the X drafter needs {what} (--draft-model)"
    # Refuses a checkpoint that does not fit the target, before any weight loads: (path, model).
    check: Callable[[Any, Any], None] | None = None
    # The checkpoint mlxspec ships for this target, used when none is given: model -> path | None.
    shipped: Callable[[Any], Any] | None = None
    shipped_note: str = ""  # added to the message when nothing ships for the target
    shipped_help: str = "the one shipped for the target"  # --help's "(default: ...)"
    shipped_options: Mapping[str, dict] = field(default_factory=dict)  # per backend


@dataclass(frozen=True)
class DrafterKind:
    """A kind of drafter: its factory per backend, its options and the checkpoint it loads."""

    name: str
    factories: Mapping[str, Factory]  # backend ("mlx", "torch") -> factory
    options: tuple[DrafterOption, ...] = ()
    checkpoint: Checkpoint | None = None  # None: the drafter loads no files
    base: str | None = None  # a derived "X+lookup" or "X+suffix" form: X, whose checkpoint it loads
    # Why the drafter cannot run on a target (model -> reason, or None when it can), for a
    # drafter that needs what only some targets have (MTP modules): bench skips it, saying why.
    unavailable: Callable[[Any], str | None] | None = None

    @property
    def model_name(self) -> str:
        """The registered drafter whose checkpoint this one loads (X for "X+lookup")."""
        return self.base or self.name


def lazy(module: str, name: str) -> Factory:
    """A factory imported when first called (a torch one must not import torch on the MLX path)."""

    def factory(*args, **kwargs):
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    factory.__qualname__ = f"{module}.{name}"
    return factory


def host_only(drafter_class: type) -> dict[str, Factory]:
    """Factories for a drafter that reads only token ids: one class for every backend, built from
    its options alone."""

    def build(path, *, model, tokenizer, **options):
        return drafter_class(**options)

    return {backend: build for backend in BACKENDS}


COPIERS = ("lookup", "suffix")  # the drafters a model drafter can stand behind: "X+lookup"


def copy_first(kind: DrafterKind, copier: DrafterKind) -> DrafterKind:
    """"name+lookup", "name+suffix": the model drafter `kind` behind the copier (a
    CopyFirstDrafter), with both one's options and the model's path."""

    def wrap(build: Factory, build_copier: Factory) -> Factory:
        def factory(path, *, model, tokenizer, **options):
            own = {o.name for o in copier.options}
            copier_options = {n: v for n, v in options.items() if n in own}
            model_options = {n: v for n, v in options.items() if n not in own}
            return CopyFirstDrafter(
                build(path, model=model, tokenizer=tokenizer, **model_options),
                build_copier(None, model=model, tokenizer=tokenizer, **copier_options))
        return factory

    factories = {backend: wrap(build, copier.factories[backend])
                 for backend, build in kind.factories.items() if backend in copier.factories}
    return replace(kind, name=f"{kind.name}+{copier.name}", factories=factories,
                   options=kind.options + copier.options, base=kind.name)


_REGISTERED: dict[str, DrafterKind] = {}


def register(kind: DrafterKind) -> DrafterKind:
    if not re.fullmatch(r"\w+", kind.name):
        raise ValueError(f"drafter name {kind.name!r}: letters, digits and _ only (+, @ and , "
                         "mean something in --drafter and bench's --drafters)")
    if kind.name in _REGISTERED:
        raise ValueError(f"a drafter named {kind.name!r} is already registered")
    unknown = set(kind.factories) - set(BACKENDS)
    if unknown:
        raise ValueError(f"drafter {kind.name!r}: unknown backends {sorted(unknown)}")
    _REGISTERED[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    del _REGISTERED[name]


def drafter_kinds() -> dict[str, DrafterKind]:
    """Every drafter by name: the registered kinds, then each model drafter's copy-first forms
    (X+lookup, X+suffix)."""
    derived = [copy_first(kind, _REGISTERED[copier]) for copier in COPIERS
               if copier in _REGISTERED for kind in model_drafters()]
    return {**_REGISTERED, **{k.name: k for k in derived}}


def drafter_names() -> tuple[str, ...]:
    return tuple(drafter_kinds())


def drafter_kind(name: str) -> DrafterKind:
    kinds = drafter_kinds()
    if name not in kinds:
        raise ValueError(f"unknown drafter {name!r}; choose from {', '.join(kinds)}")
    return kinds[name]


def drafter_options() -> tuple[DrafterOption, ...]:
    """The options of all registered drafters, each once (drafters may share one)."""
    return tuple({o.name: o for k in _REGISTERED.values() for o in k.options}.values())


def parse_label(label: str) -> tuple[str, dict]:
    """A bench label -> (drafter name, its own options): "name[:flag=value|:switch]...[@K]",
    flags spelled as on the command line without "--", e.g. "dflash:tree-budget=16",
    "lookup:lookup-branches=3", "dflash:full-vocab@8". One run can then pair a drafter's chain
    with its tree. ValueError, naming the label, for what does not parse."""
    name, *settings = label.split("@", 1)[0].split(":")
    kind = drafter_kind(name)
    spelled = {}
    for option in kind.options:
        on, _, off = option.flags.partition("/")
        spelled[on.lstrip("-")] = (option, True if off else None)
        if off:
            spelled[off.lstrip("-")] = (option, False)
    options = {}
    for setting in settings:
        flag, has_value, value = setting.partition("=")
        if flag not in spelled:
            takes = ", ".join(spelled) or "no options"
            raise ValueError(f"drafter label {label!r}: {name} takes no option {flag!r} ({takes})")
        option, switch = spelled[flag]
        if (switch is None) != bool(has_value):
            form = f"{flag}=VALUE" if switch is None else flag
            raise ValueError(f"drafter label {label!r}: write {form}")
        try:
            options[option.name] = switch if switch is not None else (option.type or str)(value)
        except ValueError:
            raise ValueError(f"drafter label {label!r}: {flag} takes a {option.type.__name__}, "
                             f"got {value!r}") from None
        problem = option.problem(options[option.name])
        if problem:
            raise ValueError(f"{option.flag_for(options[option.name])} {problem}")
    return name, options


def why_unavailable(name: str, model) -> str | None:
    """Why drafter `name` cannot run on target `model` (None when it can, or cannot tell)."""
    kind = drafter_kind(name)
    return kind.unavailable(model) if kind.unavailable is not None else None


def takers(option: DrafterOption) -> list[str]:
    """The registered drafters that take `option` (their copy-first forms take it too)."""
    return [k.name for k in _REGISTERED.values() if option in k.options]


def model_drafters() -> list[DrafterKind]:
    """The registered drafters that load a checkpoint."""
    return [k for k in _REGISTERED.values() if k.checkpoint is not None]


# ---- The factories and checks that have no module of their own ----------------------------------


def load_draft_model_drafter(path, *, model, tokenizer, window: int | None = None, **options):
    """A smaller model with the target's tokenizer (a converted directory, a .gguf file or a Hugging
    Face repo id); `options` go to `mlxspec.load`; `window`: --drafter-window."""
    from ..backends.mlx.target import vocab_size
    from ..loading import load
    from .draft_model import DraftModelDrafter, check_same_tokenizer

    draft_model, draft_tokenizer = load(path, **options)
    check_same_tokenizer(tokenizer, draft_tokenizer, vocab_size(model), vocab_size(draft_model))
    return DraftModelDrafter(draft_model, window)


def load_torch_draft_model_drafter(path, *, model, tokenizer, window: int | None = None,
                                   **options):
    """The draft-model drafter for a transformers target `model`: a model with the target's
    tokenizer, on the target's device and in its dtype."""
    from ..backends.torch import TorchDraftModelDrafter, load, model_device, vocab_size
    from ..loading import check_model_dir, resolve_model_dir
    from .draft_model import check_same_tokenizer

    draft_dir = resolve_model_dir(path, **options)
    check_model_dir(draft_dir)
    draft_model, draft_tokenizer = load(draft_dir, device=model_device(model), dtype=model.dtype)
    check_same_tokenizer(tokenizer, draft_tokenizer, vocab_size(model), vocab_size(draft_model))
    return TorchDraftModelDrafter(draft_model, window)


def sizes_and_checksum(model):
    """(TargetSizes, a function computing the embedding checksum) of a target on any backend:
    what a checkpoint is checked against and a shipped drafter found by."""
    backend = backend_for(model)
    return backend.target_sizes(model), lambda: backend.embedding_checksum(model)


def block_checkpoint_check(module: str, config_class: str) -> Callable[[Any, Any], None]:
    """(path, model) -> None: a block drafter's config (DFlash's layout; `config_class` of
    `module` reads it) against the target, on either backend, naming both sides."""

    def check(path, model) -> None:
        from ..converters.hf import resolve_hf_source
        from ..models.dflash import read_config
        from ..target_sizes import check_against_target

        reader = getattr(importlib.import_module(module), config_class)
        sizes, _ = sizes_and_checksum(model)
        check_against_target(reader.from_dict(read_config(resolve_hf_source(path))), sizes)

    return check


check_dflash_checkpoint = block_checkpoint_check("mlxspec.models.dflash", "DFlashConfig")


def shipped(kind: str) -> Callable[[Any], Any]:
    """model -> the trained `kind` drafter shipped for this target (MLX or transformers), or
    None (drafters/trained/*/target.json says which kind and target each one is)."""

    def find(model):
        from .shipped import find_shipped_drafter

        return find_shipped_drafter(*sizes_and_checksum(model), kind)

    return find


# ---- The drafters -------------------------------------------------------------------------------

TREE_BUDGET = DrafterOption(
    "tree_budget", "--tree-budget", type=int, minimum=1, maximum=MAX_TREE_BUDGET,
    help="Draft a tree of up to N nodes each step, verified in one pass, instead of a chain "
         "(DFlash and Medusa: DDTree, grown best-first from each block slot's or head's best "
         "tokens; DFlash2: the same over its candidates, each ranked by its pair score after "
         "its parent; EAGLE-3 and MTP: EAGLE-2's dynamic tree); the budget used is chosen by "
         "measured throughput.")
TREE_WIDTH = DrafterOption(
    "tree_width", "--tree-width", type=int, default=4, minimum=1,
    help="With --tree-budget: the most children a tree node may have (DFlash, Medusa: the best "
         "tokens of each block slot or head; DFlash2: of its slot's candidates; EAGLE-3, MTP: each expanded node's best tokens, and nodes "
         "expanded per depth).")
BLOCK_SIZE = DrafterOption(
    "block_size", "--block-size", type=int,
    help="DFlash, DFlash2: block size (2 .. the checkpoint's; default: the checkpoint's).")
DRAFTER_WINDOW = DrafterOption(
    "window", "--drafter-window", type=int, minimum=2,
    help="DFlash, DFlash2, DSpark, EAGLE-3, MTP, draft: the drafter sees at most the last N context positions "
         "(DFlash, DFlash2, DSpark: every layer, narrowing the checkpoint's own sliding window; EAGLE-3, MTP: "
         "their layers' caches; a draft model: every attention layer): its cost stops "
         "growing with a long context. Output is the same either way.")

register(DrafterKind("none", host_only(PlainDecoding)))
register(DrafterKind(
    "lookup", host_only(PromptLookupDrafter),  # also max_ngram, min_ngram through the API
    options=(DrafterOption(
        "branches", "--lookup-branches", type=int, default=1, minimum=1,
        help="Prompt lookup: propose the continuations of up to N earlier matches as one tree "
             "(shared prefixes merged), verified in one pass."),),
))
register(DrafterKind(
    "suffix", host_only(SuffixDrafter),  # also max_nodes and a shared history through the API
    options=(
        DrafterOption(
            "depth", "--suffix-depth", type=int, default=24, minimum=2, maximum=256,
            help="Suffix decoding: the longest token window counted (a match and its draft "
                 "together)."),
        DrafterOption(
            "spec_factor", "--suffix-spec-factor", type=float, default=1.0,
            help="Suffix decoding: draft at most this many tokens per matched token."),
        DrafterOption(
            "min_prob", "--suffix-min-prob", type=float, default=0.1, minimum=0, maximum=1,
            help="Suffix decoding: draft a path only while its frequency is at least this."),
        DrafterOption(
            "tree", "--suffix-tree/--suffix-chain", default=False,
            help="Suffix decoding: draft the likeliest continuations as one tree (default: "
                 "the likeliest chain)."),
    ),
))
register(DrafterKind(
    "draft",
    {"mlx": load_draft_model_drafter,
     "torch": load_torch_draft_model_drafter},
    options=(DRAFTER_WINDOW,),
    checkpoint=Checkpoint("a draft model path"),
))
register(DrafterKind(
    "dflash",
    {"mlx": lazy("mlxspec.drafters.dflash", "load_dflash_drafter"),
     "torch": lazy("mlxspec.backends.torch.dflash", "load_dflash_drafter")},
    options=(
        BLOCK_SIZE,
        DrafterOption(
            "draft_vocab", "--draft-vocab/--full-vocab", default=True,
            help="DFlash: draft from the checkpoint's draft vocabulary (draft_vocab.json, the "
                 "tokens it was trained to rank) when it has one, or from the full vocabulary. "
                 "Output is the same either way."),
        TREE_BUDGET,
        TREE_WIDTH,
        DRAFTER_WINDOW,
    ),
    checkpoint=Checkpoint(
        "a drafter checkpoint trained for this target",
        check=check_dflash_checkpoint,
        shipped=shipped("dflash"),
        shipped_note="mlxspec ships one only for the default SmolLM2-135M-Instruct",
        shipped_options={"mlx": {"dtype": "target"}},  # stored in bf16 to keep the package small
    ),
))
register(DrafterKind(
    "dflash2",
    {"mlx": lazy("mlxspec.drafters.dflash2", "load_dflash2_drafter"),
     "torch": lazy("mlxspec.backends.torch.dflash2", "load_dflash2_drafter")},
    options=(
        BLOCK_SIZE,
        TREE_BUDGET,
        TREE_WIDTH,
        DRAFTER_WINDOW,
    ),
    checkpoint=Checkpoint(
        "a DFlash2 drafter checkpoint trained for this target (z-lab's DFlash2DraftModel "
        "layout)",
        check=block_checkpoint_check("mlxspec.models.dflash2", "DFlash2Config"),
    ),
))
register(DrafterKind(
    "dspark",
    {"mlx": lazy("mlxspec.drafters.dspark", "load_dspark_drafter"),
     "torch": lazy("mlxspec.backends.torch.dspark", "load_dspark_drafter")},
    options=(
        DRAFTER_WINDOW,
        DrafterOption(
            "confidence_k", "--confidence-k/--adaptive-k", default=True,
            help="DSpark: where the checkpoint has a confidence head, it chooses K each step "
                 "(and each sequence's share of a batch), or the adaptive K does as for "
                 "DFlash. Output is the same either way."),
    ),
    checkpoint=Checkpoint(
        "a DSpark drafter checkpoint trained for this target (DeepSpec's Qwen3DSparkModel or "
        "LiquidAI's LFM2.5 layout)",
        check=block_checkpoint_check("mlxspec.models.dspark", "DSparkConfig"),
    ),
))
register(DrafterKind(
    "eagle3",
    {"mlx": lazy("mlxspec.drafters.eagle3", "load_eagle3_drafter"),
     "torch": lazy("mlxspec.backends.torch.eagle3", "load_eagle3_drafter")},
    options=(TREE_BUDGET, TREE_WIDTH, DRAFTER_WINDOW),
    checkpoint=Checkpoint(
        "an EAGLE-3 drafter checkpoint trained for this target (speculators or SpecForge/SGLang "
        "layout)",
        check=lazy("mlxspec.drafters.eagle3_loading", "check_checkpoint"),
        shipped=shipped("eagle3"),
        shipped_note="mlxspec ships one only for the default SmolLM2-135M-Instruct",
        shipped_options={"mlx": {"dtype": "target"}},  # stored in bf16 to keep the package small
    ),
))
register(DrafterKind(
    "mtp",
    {"mlx": lazy("mlxspec.drafters.mtp", "load_mtp_drafter"),
     "torch": lazy("mlxspec.backends.torch.mtp", "load_mtp_drafter")},
    options=(TREE_BUDGET, TREE_WIDTH, DRAFTER_WINDOW),
    checkpoint=Checkpoint(
        "the target's own checkpoint directory, with the multi-token-prediction weights it ships",
        check=lazy("mlxspec.drafters.mtp", "check_mtp_source"),
        shipped=lazy("mlxspec.drafters.mtp", "source_dir"),
        shipped_note="a model loaded by mlxspec.load finds its own",
        shipped_help="the directory the target was loaded from",
    ),
    unavailable=lazy("mlxspec.drafters.mtp", "why_unavailable"),
))
register(DrafterKind(
    "layerskip",
    {"mlx": lazy("mlxspec.drafters.layerskip", "load_layerskip_drafter")},
    options=(DrafterOption(
        "exit_layer", "--exit-layer", type=int, minimum=1,
        help="LayerSkip: draft with the target's first N layers, then its final norm and head "
             "(default: 87% of its depth, measured best on SmolLM2). Any model works untrained, "
             "but only its late layers rank tokens well; checkpoints trained with layer dropout "
             "and an early-exit loss (Meta's layerskip-llama3.2-1B, layerskip-llama2-7B, "
             "layerskip-codellama-7B) accept far more from early layers, e.g. 4 of 32."),),
    unavailable=lazy("mlxspec.drafters.layerskip", "why_unavailable"),
))
register(DrafterKind(
    "medusa",
    {"mlx": lazy("mlxspec.drafters.medusa", "load_medusa_drafter")},
    options=(TREE_BUDGET, TREE_WIDTH),
    checkpoint=Checkpoint(
        "Medusa heads trained for this target (a directory with config.json and "
        "medusa_lm_head.safetensors, as `mlxspec train medusa` writes and Medusa publishes)",
        check=lazy("mlxspec.drafters.medusa", "check_medusa_checkpoint"),
        shipped=shipped("medusa"),
        shipped_note="mlxspec ships one only for the default SmolLM2-135M-Instruct",
    ),
))
