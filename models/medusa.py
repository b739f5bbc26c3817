"""Medusa-1 heads (Cai et al., 2024): extra output heads on a frozen target, in their published
layout.

Head i reads the target's last hidden state h_t, after its final norm (the reference feeds the
heads `base_model.model(...)[0]`), and ranks token t+2+i: `medusa_num_layers` residual blocks
x + SiLU(W x + b), then its own projection to the vocabulary (no bias). A checkpoint is a
directory with config.json (`medusa_num_heads`, `medusa_num_layers`, as the reference's
MedusaConfig writes it) and the heads' state dict in `medusa_lm_head.safetensors`:
`{i}.{j}.linear.weight/bias` for block j and `{i}.{n}.weight` for the projection (n =
medusa_num_layers), unprefixed as the reference's training saves them or prefixed `medusa_head.`
as its whole-model exports name them. Heads with no projection tensors (the reference's
"version 2" legacy heads) project through the target's own LM head. The reference repeats one
block object `medusa_num_layers` times, so its blocks share weights; its state dict lists each
copy, and loading them as separate blocks computes the same. `.pt` / `.bin` files are pickles:
they are refused, never unpickled.
"""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..checkpoint_checks import check_config
from ..file_checks import read_json_object, safetensors_shapes

WEIGHTS = "medusa_lm_head.safetensors"
PICKLES = ("medusa_lm_head.pt", "medusa_lm_head.bin", "pytorch_model.bin")
PREFIX = "medusa_head."


class ResBlock(nn.Module):
    """x + SiLU(W x + b): a head's block, the identity when W and b are zero (its init)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def __call__(self, x):
        return x + nn.silu(self.linear(x))


class MedusaHead(nn.Module):
    """One head: residual blocks, then a projection (None: the target's head projects)."""

    def __init__(self, num_layers: int, hidden: int, vocab: int, own_projection: bool):
        super().__init__()
        self.blocks = [ResBlock(hidden) for _ in range(num_layers)]
        if own_projection:
            self.projection = nn.Linear(hidden, vocab, bias=False)


class MedusaHeads(nn.Module):
    """`num_heads` heads of `num_layers` ResBlocks and a projection. Heads without projections
    of their own (`own_projection=False`: the reference's "version 2" legacy heads, and
    mlxspec's trainer with a shared head) project through the target's LM head, given by
    `use_target_head`. Parameters are named heads.{i}.blocks.{j} / heads.{i}.projection;
    `published_names` maps the checkpoint's to them (MLX's nested lists do not load)."""

    def __init__(self, num_heads: int, num_layers: int, hidden: int, vocab: int,
                 own_projection: bool = True):
        super().__init__()
        self.num_heads, self.num_layers = num_heads, num_layers
        self.own_projection = own_projection
        self.heads = [MedusaHead(num_layers, hidden, vocab, own_projection)
                      for _ in range(num_heads)]
        self._target_head = None

    def use_target_head(self, head) -> None:
        """The target's LM head (a module or a tied embedding's as_linear), for heads without
        projections; kept outside the parameters (it is the target's, and frozen)."""
        self._target_head = lambda x: head(x)

    @property
    def dtype(self):
        return self.heads[0].blocks[0].linear.weight.dtype if self.num_layers else \
            self.heads[0].projection.weight.dtype

    def head(self, i: int, hidden: mx.array) -> mx.array:
        """Head i's logits for normed hidden states (..., H): it ranks the token i+2 ahead."""
        head = self.heads[i]
        for block in head.blocks:
            hidden = block(hidden)
        return head.projection(hidden) if self.own_projection else self._target_head(hidden)

    def __call__(self, hidden: mx.array, count: int | None = None) -> mx.array:
        """The first `count` heads' logits (all by default), stacked: (count, ..., V)."""
        return mx.stack([self.head(i, hidden) for i in range(count or self.num_heads)])


def parameter_name(published: str, num_layers: int) -> str:
    """`medusa_head.{i}.{j}.linear.weight` -> heads.{i}.blocks.{j}.linear.weight, and
    `medusa_head.{i}.{num_layers}.weight` -> heads.{i}.projection.weight."""
    i, j, rest = published[len(PREFIX):].split(".", 2)
    if int(j) == num_layers:
        return f"heads.{i}.projection.{rest}"
    return f"heads.{i}.blocks.{j}.{rest}"


def published_weights(heads: MedusaHeads) -> dict[str, mx.array]:
    """The heads' tensors under their published names (prefixed, as whole-model exports)."""
    from mlx.utils import tree_flatten

    out = {}
    for name, value in tree_flatten(heads.parameters()):
        _, i, part, rest = name.split(".", 3)
        j = rest.split(".", 1)[0] if part == "blocks" else str(heads.num_layers)
        tail = rest.split(".", 1)[1] if part == "blocks" else rest
        out[f"{PREFIX}{i}.{j}.{tail}"] = value
    return out


def read_config(path: Path) -> dict:
    """config.json's Medusa settings, checked: {num_heads, num_layers}; one-line errors."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} has no config.json: a Medusa checkpoint is a directory with "
                         f"config.json (medusa_num_heads, medusa_num_layers) and {WEIGHTS}")
    config = read_json_object(config_file)
    check_config(config, config_file)
    settings = config.get("medusa_config", config)  # Medusa-2 exports nest them
    counts = {}
    for key, least in (("medusa_num_heads", 1), ("medusa_num_layers", 0)):
        value = settings.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{config_file}: {key} must be an integer >= {least}, "
                             f"got {value!r}")
        counts[key] = value
    return {"num_heads": counts["medusa_num_heads"], "num_layers": counts["medusa_num_layers"]}


def weights_file(path: Path) -> Path:
    """The heads' safetensors, or a one-line refusal naming a pickle that holds them instead."""
    found = path / WEIGHTS
    if found.is_file():
        return found
    pickle = next((path / name for name in PICKLES if (path / name).is_file()), None)
    if pickle is not None:
        raise ValueError(
            f"{pickle} is a pickle, which mlxspec never loads (unpickling runs code); convert it "
            f"to {WEIGHTS} where you trust it: torch.load it and save_file(state_dict, ...) from "
            "safetensors.torch")
    raise ValueError(f"{path} has no {WEIGHTS}")


def published_name(name: str) -> str:
    """A tensor's name with the `medusa_head.` prefix (a state dict of the head list alone
    lacks it)."""
    return name if name.startswith(PREFIX) else PREFIX + name


def expected_shapes(num_heads: int, num_layers: int, hidden: int, vocab: int,
                    own_projection: bool = True) -> dict:
    shapes = {}
    for i in range(num_heads):
        for j in range(num_layers):
            shapes[f"{PREFIX}{i}.{j}.linear.weight"] = (hidden, hidden)
            shapes[f"{PREFIX}{i}.{j}.linear.bias"] = (hidden,)
        if own_projection:
            shapes[f"{PREFIX}{i}.{num_layers}.weight"] = (vocab, hidden)
    return shapes


def check_checkpoint(path: Path, hidden: int, vocab: int) -> dict:
    """Refuse, from config.json and the safetensors header alone, a checkpoint whose tensors are
    missing, extra, or sized for another target (naming both sides); returns its settings, with
    `own_projection`: whether the heads hold projections (else they use the target's head)."""
    settings = read_config(path)
    file = weights_file(path)
    shapes = {published_name(n): s for n, s in safetensors_shapes(file).items()}
    heads, layers = settings["num_heads"], settings["num_layers"]
    _check_counts_against_file(path / "config.json", file, shapes, heads, layers)
    own = any(name.endswith(f".{layers}.weight") for name in shapes)
    wanted = expected_shapes(heads, layers, hidden, vocab, own)
    missing, extra = sorted(set(wanted) - set(shapes)), sorted(set(shapes) - set(wanted))
    if missing or extra:
        what = "; ".join(([f"missing {missing[:3]}"] if missing else []) +
                         ([f"unexpected {extra[:3]}"] if extra else []))
        raise ValueError(f"{file} does not match its config.json ({heads} heads of {layers} "
                         f"blocks): {what}")
    wrong = next((n for n in wanted if shapes[n] != wanted[n]), None)
    if wrong is not None:
        raise ValueError(
            f"{file}: {wrong} has shape {shapes[wrong]}, this target (hidden size {hidden}, "
            f"vocabulary {vocab}) needs {wanted[wrong]}: the heads were trained for another model")
    return {**settings, "own_projection": own}


def _check_counts_against_file(config_file: Path, file: Path, shapes: dict, heads: int,
                               layers: int) -> None:
    """No more heads or blocks than the file holds, checked before a name is listed for each
    (a config's count, not the file, would size that list)."""
    parts = [name[len(PREFIX):].split(".")[:2] for name in shapes]
    held_heads = len({part[0] for part in parts})
    held_layers = max((int(part[1]) + 1 for part in parts if part[1:] and part[1].isdigit()),
                      default=0)
    for key, count, held in (("medusa_num_heads", heads, held_heads),
                             ("medusa_num_layers", layers, held_layers)):
        if count > held:
            raise ValueError(f"{config_file}: {key} is {count}, but {file} holds {held}; fix "
                             "the config or use the checkpoint it belongs to")


def load_heads(path: Path, hidden: int, vocab: int, target_head=None, dtype=None) -> MedusaHeads:
    """The heads of checkpoint directory `path`, checked against the target's sizes;
    `target_head` projects heads that have no projection of their own; `dtype`: cast to it."""
    path = Path(path)
    settings = check_checkpoint(path, hidden, vocab)
    tensors = {published_name(k): v if dtype is None else v.astype(dtype)
               for k, v in mx.load(str(weights_file(path))).items()}
    heads = MedusaHeads(settings["num_heads"], settings["num_layers"], hidden, vocab,
                        settings["own_projection"])
    layers = settings["num_layers"]
    heads.load_weights([(parameter_name(k, layers), v) for k, v in tensors.items()])
    if not settings["own_projection"]:
        heads.use_target_head(target_head)
    mx.eval(heads.parameters())
    return heads
