"""Read an EAGLE-3 drafter checkpoint in either published layout and check it against a target.

Layouts (models/eagle3.py reads both configs into one `Eagle3Config`):
  speculators (vLLM, RedHat's *.speculator.eagle3): config.json with transformer_layer_config,
      draft_vocab_size, target_hidden_size, norm_before_residual, norm_before_fc,
      eagle_aux_hidden_state_layer_ids, speculators_config; weights `layers.0.*`.
  SpecForge/SGLang (and EAGLE's own release): a flat Llama config.json with architectures
      LlamaForCausalLMEagle3, draft_vocab_size, eagle_config.eagle_aux_hidden_state_layer_ids;
      weights `midlayer.*` (SGLang also accepts a `model.` prefix).
Both: `fc` (num_aux x H_t -> H, no bias), `norm`, `lm_head` over the draft vocabulary, `d2t`
(target id = draft id + d2t[draft id]); `embed_tokens` optional (the target's when absent);
`t2d`, verifier_* (speculators' training copies of the target's norm and head) and any other
unused tensor are ignored. Only *.safetensors files are read.

Every check raises one line: config against target (`check_against_target`) before the
weights are read, then names and shapes, then d2t against the target's vocabulary.
`read_checkpoint` runs them in that order for either backend, which brings only its tensors
and its model (the torch one: mlxspec.backends.torch.eagle3).
"""

from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..backends import backend_for
from ..checkpoint_checks import check_checkpoint_config
from ..models.dflash import read_weights
from ..models.eagle3 import Eagle3Config, Eagle3Model
from ..backends.mlx.target_parts import dtype_of, target_embedding, target_head, target_sizes
from ..request import check_drafter_window
from ..target_sizes import TargetSizes


def read_config(path: Path) -> Eagle3Config:
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} has no config.json; it is not an EAGLE-3 checkpoint")
    return check_checkpoint_config(config_path, Eagle3Config.from_dict)


def canonical_name(name: str) -> str:
    """A tensor name of either layout in the speculators spelling (`layers.0.*`)."""
    name = name.removeprefix("model.")
    if name.startswith("midlayer."):
        name = "layers.0." + name[len("midlayer."):]
    return name


def canonical_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    out = {}
    for name, value in weights.items():
        key = canonical_name(name)
        if key in out:
            raise ValueError(f"EAGLE-3 checkpoint holds {key} twice (as {name} and another name)")
        out[key] = value
    return out


def spelled(args: Eagle3Config, text: str) -> str:
    """`text` with tensor names in the checkpoint's own spelling (SpecForge: midlayer.*)."""
    return text.replace("layers.0.", "midlayer.") if args.layout == "specforge" else text


def check_weights(args: Eagle3Config, expected: dict[str, tuple], weights: dict,
                  is_integer) -> dict:
    """The (canonical) weights a model with parameter shapes `expected` loads, any backend's
    tensors; one line naming missing or wrong-shaped tensors or a d2t that is not integers
    (`is_integer(tensor)` says). Unused tensors are dropped."""
    expected = dict(expected)
    own_head = "lm_head.weight" in weights
    if args.uses_draft_vocab or "d2t" in weights:
        expected["d2t"] = (args.draft_vocab_size,)
    missing = sorted(set(expected) - set(weights))
    if not own_head and args.uses_draft_vocab:
        missing.append("lm_head.weight")  # the target's head ranks the whole vocabulary
    wrong = [
        f"{n} has shape {tuple(weights[n].shape)}, config.json implies {expected[n]}"
        for n in sorted(set(expected) & set(weights))
        if tuple(weights[n].shape) != expected[n]
    ]
    if args.layout == "specforge":  # name tensors as the checkpoint spells them
        missing = [spelled(args, n) for n in missing]
        wrong = [spelled(args, w) for w in wrong]
    problems = []
    if missing:
        problems.append(f"missing weights: {', '.join(missing)}")
    if wrong:
        problems.append("wrong-shaped weights: " + "; ".join(wrong))
    if "d2t" in weights and not is_integer(weights["d2t"]):
        problems.append(f"d2t has dtype {weights['d2t'].dtype}, not an integer type")
    if problems:
        raise ValueError(
            f"EAGLE-3 checkpoint ({args.layout} layout) does not match its config.json (hidden "
            f"{args.hidden_size}, draft vocab {args.draft_vocab_size} of {args.vocab_size}): "
            + ". ".join(problems)
        )
    return {n: w for n, w in weights.items() if n in expected}


def check_against_target(args: Eagle3Config, sizes: TargetSizes, *,
                         own_embed: bool | None = None, own_head: bool | None = None) -> None:
    """Refuse a drafter trained for another target, naming both sides, before any compute.

    own_embed / own_head: whether the checkpoint carries embed_tokens / lm_head (None: not
    known yet, e.g. before the weights are read; then only what the config implies is checked).
    """
    hidden, vocab, layers = sizes
    problems = []
    if args.target_hidden_size != hidden:
        problems.append(f"hidden size: drafter target_hidden_size {args.target_hidden_size}, "
                        f"target {hidden}")
    if args.vocab_size != vocab:
        problems.append(f"vocab size: drafter {args.vocab_size}, target {vocab}")
    if own_embed is False and args.hidden_size != hidden:
        problems.append(f"embedding: the drafter has no embed_tokens and its hidden size "
                        f"{args.hidden_size} differs from the target's {hidden}")
    if own_head is False and not args.uses_draft_vocab and args.hidden_size != hidden:
        problems.append(f"LM head: the drafter has no lm_head and its hidden size "
                        f"{args.hidden_size} differs from the target's {hidden}")
    capture = args.capture_layers(layers)
    bad = [i for i in capture if not 0 <= i < layers]
    if bad:
        ids = args.aux_layer_ids
        named = (f"eagle_aux_hidden_state_layer_ids {ids}" if ids is not None
                 else f"the default layers for {layers} target layers")
        counting = ("layer outputs" if args.aux_ids_count_outputs or ids is None
                    else "hidden states, 0 = the embedding")
        problems.append(
            f"{named} ({counting}) need target layer outputs {list(capture)}, outside the "
            f"target's {layers} layers (0-{layers - 1})"
        )
    if problems:
        raise ValueError("EAGLE-3 drafter does not fit this target: " + "; ".join(problems))


def check_d2t(args: Eagle3Config, d2t, vocab: int) -> None:
    """The target ids d2t (either backend's tensor) maps the draft vocabulary to lie in the
    target's vocabulary, once each."""
    if d2t is None:
        return
    ids = np.arange(args.draft_vocab_size) + np.array(d2t.tolist(), dtype=np.int64)
    outside = np.flatnonzero((ids < 0) | (ids >= vocab))
    if outside.size:
        bad = int(outside[0])
        raise ValueError(
            f"EAGLE-3 d2t maps draft id {bad} to target id {int(ids[bad])}, outside the "
            f"target's vocabulary of {vocab} ({outside.size} draft ids do)"
        )
    values, counts = np.unique(ids, return_counts=True)
    if counts.max() > 1:
        twice = int(values[np.argmax(counts)])
        raise ValueError(f"EAGLE-3 d2t maps {int(counts.max())} draft ids to target id {twice}")


def resolve(path) -> Path:
    """A checkpoint directory, or a Hub repo id through the Hugging Face cache."""
    path = Path(path).expanduser()
    if path.is_dir():
        return path
    from ..converters.hf import resolve_hf_source  # HF_HUB_OFFLINE applies

    return Path(resolve_hf_source(str(path)))


def check_checkpoint(path, model) -> None:
    """The checkpoint's config.json against the target (MLX or transformers), before any weight
    is read (what a drafter registry entry's checkpoint check runs)."""
    check_against_target(read_config(resolve(path)), sizes_of(model))


def sizes_of(model) -> TargetSizes:
    """The sizes check_against_target reads, of an mlx-lm or a transformers target."""
    return backend_for(model).target_sizes(model)


def read_checkpoint(path, sizes: TargetSizes, *, read_tensors, build, is_integer,
                    window: int | None = None):
    """Every check of a checkpoint for a target of these `sizes`, in order, with the backend's
    tensors: config.json against the target (sizes, aux layers) before any weight is read, then
    names and shapes (of the model `build(args, own_embed, own_head)` returns with its
    parameter shapes), then d2t against the target's vocabulary.
    `window`: the drafter window (--drafter-window), checked first and kept in the config.
    Returns (config, that model, the weights it loads, d2t or None)."""
    check_drafter_window(window)
    path = resolve(path)
    args = read_config(path)
    args.context_window = window
    check_against_target(args, sizes)
    weights = canonical_weights(read_tensors(path))
    own_embed, own_head = "embed_tokens.weight" in weights, "lm_head.weight" in weights
    model, expected = build(args, own_embed, own_head)
    weights = check_weights(args, expected, weights, is_integer)
    check_against_target(args, sizes, own_embed=own_embed, own_head=own_head)
    d2t = weights.pop("d2t", None)
    check_d2t(args, d2t, sizes.vocab_size)
    return args, model, weights, d2t


def use_target_parts(args: Eagle3Config, drafter, *, own_embed: bool, own_head: bool,
                     embedding, head, as_head) -> None:
    """What the checkpoint lacks, the drafter takes from the target (either backend's modules):
    its `embedding`, and its `head`, or with SGLang's tie_word_embeddings an embedding (the
    drafter's own, else the target's) used as one through `as_head(embedding)`. Without
    lm_head the draft vocabulary is the target's (check_weights refuses it otherwise)."""
    if not own_embed:
        drafter.use_embedding(embedding)
    if not own_head:
        if args.tie_word_embeddings:
            drafter.use_head(as_head(drafter.embed_tokens if own_embed else embedding))
        else:
            drafter.use_head(head)


def _mlx_model(args: Eagle3Config, own_embed: bool, own_head: bool):
    model = Eagle3Model(args, own_embed=own_embed, own_head=own_head)
    return model, {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}


def load_eagle3_model(path, *, model, dtype=None, window: int | None = None) -> Eagle3Model:
    """Read, check against target `model` and load an EAGLE-3 checkpoint directory.

    Order: config.json against the target (sizes, aux layers), then the weights' names and
    shapes, then d2t against the target's vocabulary; nothing runs before all pass. The
    returned model embeds with the target's embedding and ranks with the target's head when
    the checkpoint carries none. `dtype`: None keeps the checkpoint's, "target" the target's,
    or an mx.Dtype.
    """
    args, drafter, weights, d2t = read_checkpoint(
        path, target_sizes(model), read_tensors=read_weights, build=_mlx_model,
        is_integer=lambda a: mx.issubdtype(a.dtype, mx.integer), window=window)
    own_embed, own_head = "embed_tokens.weight" in weights, "lm_head.weight" in weights
    if dtype == "target":
        dtype = dtype_of(target_head(model))
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
                   for k, v in weights.items()}
    drafter.load_weights(list(weights.items()))
    drafter.set_d2t(d2t)
    use_target_parts(args, drafter, own_embed=own_embed, own_head=own_head,
                     embedding=target_embedding(model), head=target_head(model),
                     as_head=lambda embedding: embedding.as_linear)
    mx.eval(drafter.parameters())
    drafter.eval()
    return drafter
