"""One training run for any drafter kind: data, schedule, resumable state, held-out τ.

What every drafter's training shares lives here, written once: the sequences (the target's
answers or real ones, token ids in a `SequenceStore`), the held-out prompts on which τ is measured
by the real verification loop, the loss vocabulary (the most frequent answer tokens), the
per-dimension scale that tames the target features' outlier dimensions, AdamW with warmup and
cosine decay (optionally fitted to a time budget), and the resumable state in `out/train_state/`
(training weights, optimizer moments, RNG, data cursor, log), saved every `save_every` steps.

What differs between drafters is a `Recipe` (DFlash: mlxspec.training.dflash_trainer; EAGLE-3:
mlxspec.training.eagle3_trainer): its config, its fresh weights, what one training example is
cut from a sequence, the tensor math of a step, and the checkpoint it writes.
"""

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..request import check_count
from ..backends.mlx.target_parts import embedding_checksum, target_embedding, target_sizes
from .data import (
    SequenceStore,
    _atomic_save_safetensors,
    _atomic_write_text,
    build_sequences,
    encode_prompt,
    eos_ids,
    fingerprint,
    load_examples,
    split_heldout,
)
from .features import target_features

FIT_HORIZON = 10**9  # the provisional schedule length while a time-fitted run times its warmup
FIT_MIN_STEPS = 4  # steps timed at least before fitting
STATE_DIR = "train_state"


@dataclass
class TrainResult:
    out: Path
    step: int
    losses: list = field(default_factory=list)  # (step, loss) of this call's steps
    taus: list = field(default_factory=list)  # (step, τ)
    block_tokens_per_s: float = 0.0
    loss_vocab_share: float | None = None  # of the answer tokens, with a loss vocabulary
    drafts_from_loss_vocab: bool = False  # the checkpoint drafts from it (else the full one)


class TrainingDiverged(ValueError):
    """The loss or the weights stopped being finite: the run stops, its last good checkpoint
    kept."""


def check_hyperparameters(**values) -> None:
    """Finite positive numbers (lr, grad_clip; weight_decay may be 0), refused before any
    compute: `lr=nan` once trained to all-NaN weights with exit status 0. Names as given."""
    for name, value in values.items():
        least = 0 if name == "weight_decay" else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or (value < 0 if least == 0 else value <= 0):
            bound = ">= 0" if least == 0 else "> 0"
            raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


@dataclass
class RunSettings:
    """The options every drafter's training run takes (see `train_dflash` for their meaning)."""

    out: Path
    prompts: Any
    tokenizer: Any = None
    steps: int | None = None
    resume: bool = False
    lr: float = 6e-4
    warmup: int | None = None
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    batch_size: int = 1
    max_seq_len: int = 1024
    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    num_prompts: int | None = None
    heldout: int = 8
    eval_every: int = 200
    eval_max_tokens: int = 64
    eval_prompts: int | None = None
    save_every: int = 50
    responses: str = "target"
    labels: str = "text"
    data_dir: Any = None
    normalize_features: bool = True
    seed: int = 0
    stop_after: int | None = None
    minutes: float | None = None
    loss_vocab: int | None = None
    backend: str = "mlx"
    generator: Any = None
    generate_batch_size: int = 32
    progress: bool = True

    def __post_init__(self):
        self.out = Path(self.out).expanduser()

    @property
    def state_dir(self) -> Path:
        return self.out / STATE_DIR

    def check_writable(self) -> None:
        """The output directory can be written, before any data or compute: a read-only one
        otherwise failed at the first save with a bare "[Errno 30]"."""
        import tempfile

        try:
            self.out.mkdir(parents=True, exist_ok=True)
            os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=self.out))
        except OSError as err:
            raise OSError(f"cannot write the training output directory {self.out} "
                          f"({err.strerror or err}); choose a writable one") from None

    def check(self) -> None:
        """Refuse bad options before any compute (one-line errors)."""
        check_hyperparameters(lr=self.lr, weight_decay=self.weight_decay,
                              grad_clip=self.grad_clip)
        for name in ("batch_size", "max_seq_len", "save_every"):
            check_count(name, getattr(self, name))
        if self.warmup is not None:
            check_count("warmup", self.warmup, minimum=0)
        if self.labels not in ("text", "target"):
            raise ValueError(f"labels must be 'text' or 'target', got {self.labels!r}")
        if self.minutes is not None and not self.minutes > 0:
            raise ValueError(f"minutes (the training time budget) must be > 0, got {self.minutes}")
        if self.resume and not (self.state_dir / "state.json").is_file():
            raise FileNotFoundError(
                f"{self.out} has no training state to resume ({STATE_DIR}/state.json)")
        if not self.resume and (self.state_dir / "state.json").is_file():
            raise FileExistsError(
                f"{self.out} already holds a training run; pass resume=True to continue it")
        if self.steps is None and self.resume:
            self.steps = json.loads((self.state_dir / "state.json").read_text())["steps"]
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        horizon = self.steps if self.steps is not None else (
            FIT_HORIZON if self.minutes is not None else 1000)
        if self.stop_after is not None and not 0 <= self.stop_after <= horizon:
            raise ValueError(f"stop_after must be within 0..steps ({self.steps}), "
                             f"got {self.stop_after}")
        self.check_writable()


# Run settings a resume must keep: (the value of runs saved before it was recorded, the hint).
KEPT_ON_RESUME = {
    "backend": ("mlx", "that backend (the optimizer state is per backend)"),
    "labels": ("text", "the same labels"),
}


class Recipe:
    """What one drafter kind's training says; `train` runs it. Subclasses fill these in."""

    name = "drafter"
    drafts_from_loss_vocab = False  # a loss vocabulary becomes the checkpoint's draft vocabulary
    # Saved in state.json and, on a resume, required to match (options the optimizer state or
    # the data order depend on), or restored when left unset (None).
    state_keys: tuple[str, ...] = ()

    def config(self, target, tokenizer, run: RunSettings, loss_ids) -> dict:
        """The checkpoint's config.json for a fresh run (a resume reads the saved one);
        `loss_ids`: the loss vocabulary's target ids, or None for the whole vocabulary."""
        raise NotImplementedError

    def feature_layers(self, config: dict, target) -> list[int]:
        """The target layers whose outputs the drafter reads (for the feature scale)."""
        raise NotImplementedError

    def fresh_weights(self, config: dict, target, loss_ids) -> dict:
        raise NotImplementedError

    def adapt(self, config: dict, weights: dict, inv_scale, target, resumed: bool):
        """(config, weights) once the weights and scale are known: a hook for continuing a
        checkpoint (DFlash's --init DIR and layer growth)."""
        return config, weights

    def math(self, target, config: dict, weights: dict, **options):
        """The backend's training math: features_batch, step, weights, save/load_optimizer."""
        raise NotImplementedError

    def example(self, rng: np.random.Generator, tokens: list[int], prompt_len: int):
        """(what the step trains on in this sequence, predictions it makes, first-slot ones)."""
        raise NotImplementedError

    def write(self, out: Path, config: dict, weights: dict, inv_scale, loss_ids) -> None:
        raise NotImplementedError

    def drafter(self, config: dict, weights: dict, inv_scale, target, loss_ids):
        """An inference drafter with these training weights, for held-out τ."""
        raise NotImplementedError

    def eval_draft(self, config: dict) -> int:
        """Drafts per step when held-out τ is measured."""
        raise NotImplementedError

    def state(self) -> dict:
        return {k: getattr(self, k) for k in self.state_keys}


def predictions_ahead(tokens: list[int], prompt_len: int, depths: int) -> tuple[int, int, int]:
    """A Recipe.example for drafters whose depth s (0-based) predicts from each position the
    token 2 + s ahead (EAGLE-3's TTT steps, Medusa's heads), trained on answer tokens only:
    (the prompt length, the predictions made, the depth-0 ones)."""
    T = len(tokens)
    first = max(T - max(prompt_len, 2), 0)
    trained = sum(max(T - max(prompt_len, 2 + s), 0) for s in range(depths))
    return prompt_len, trained, first


class MLXTraining:
    """The MLX training math every recipe shares: AdamW over the drafter's parameters, one
    clipped step, the optimizer state on disk. A subclass builds `self.model`, calls
    `init_optimizer`, and says what one sequence's loss is (`sequence_loss`)."""

    grad_clip: float = 1.0

    def init_optimizer(self, schedule, weight_decay: float) -> None:
        self.optimizer = optim.AdamW(schedule, weight_decay=weight_decay, bias_correction=True)
        self.optimizer.init(self.model.trainable_parameters())
        self._grad = nn.value_and_grad(self.model, self._loss)

    def sequence_loss(self, features, tokens: list[int], chosen):
        """(sum of weighted losses, sum of weights, correct first predictions) of a sequence."""
        raise NotImplementedError

    def _loss(self, batch):
        total = weight = correct = 0
        for features, tokens, chosen in batch:
            t, w, c = self.sequence_loss(features, tokens, chosen)
            total, weight, correct = total + t, weight + w, correct + c
        return total / mx.maximum(weight, 1e-6), correct

    def step(self, batch) -> tuple[float, int]:
        """One AdamW step: (loss, correct first predictions)."""
        (loss, correct), grads = self._grad(batch)
        if self.grad_clip:
            grads, _ = optim.clip_grad_norm(grads, self.grad_clip)
        self.optimizer.update(self.model, grads)
        mx.eval(loss, correct, self.model.parameters(), self.optimizer.state)
        return loss.item(), int(correct.item())

    def weights(self) -> dict[str, mx.array]:
        return dict(tree_flatten(self.model.parameters()))

    def save_optimizer(self, state_dir: Path) -> None:
        save_tree(state_dir / "optimizer.safetensors", self.optimizer.state, state_dir)

    def load_optimizer(self, state_dir: Path) -> None:
        self.optimizer.state = load_tree(state_dir / "optimizer.safetensors")


# ---- Shared pieces ---------------------------------------------------------------------------


def save_tree(path: Path, tree, tmp_dir: Path) -> None:
    flat = dict(tree_flatten(tree))
    _atomic_save_safetensors(path, flat or {"__empty__": mx.zeros(1)}, tmp_dir=tmp_dir)


def load_tree(path: Path):
    flat = mx.load(str(path))
    flat.pop("__empty__", None)
    return tree_unflatten(list(flat.items()))


class FittedSchedule:
    """Warmup then cosine decay, whose length can be set once the run knows it: a run with a
    time budget and no step count times its warmup steps (which do not depend on the length)
    and then fits the cosine into the time left."""

    def __init__(self, lr: float, warmup: int, steps: int):
        self.lr, self.warmup = lr, warmup
        self.set_length(steps)

    def set_length(self, steps: int) -> None:
        self.steps, self._schedule = steps, schedule(self.lr, self.warmup, steps)

    def __call__(self, step):
        return self._schedule(step)


def schedule(lr: float, warmup: int, steps: int, min_ratio: float = 0.1):
    warmup = max(min(warmup, steps - 1), 0)
    decay = optim.cosine_decay(lr, max(steps - warmup, 1), lr * min_ratio)
    if warmup == 0:
        return decay
    return optim.join_schedules([optim.linear_schedule(lr * 0.01, lr, warmup), decay], [warmup])


def resolve_target(target, tokenizer):
    if target is None or isinstance(target, (str, os.PathLike)):
        from ..loading import load

        model, tok = load(target)
        return model, tokenizer if tokenizer is not None else tok
    return target, tokenizer


def prepare_data(target, tokenizer, prompts, data_dir, *, responses="target",
                 max_new_tokens=256, max_prompt_tokens=512, num_prompts=None, heldout=8, seed=0,
                 generator=None, generate_batch_size=32, progress=True):
    """(store, train examples, held-out examples): the training sequences in `data_dir`, made
    (or completed, after an interruption or with more prompts) from `prompts`. Responses come
    from `generator` (default: the target itself; a torch copy of the same weights is faster
    batched on CPU)."""
    examples = load_examples(prompts, num_prompts)
    train_examples, heldout_examples = split_heldout(examples, heldout, seed)
    if not train_examples:
        raise ValueError("no training prompts")
    meta = {
        "target": [target_sizes(target), float(target_embedding(target).weight[:8].sum().item())],
        "source": prompts if isinstance(prompts, str) else fingerprint(examples),
        "responses": responses, "max_new_tokens": max_new_tokens,
        "max_prompt_tokens": max_prompt_tokens, "heldout": heldout, "seed": seed,
    }
    if not isinstance(prompts, str):
        meta["source"] = fingerprint(train_examples[:1])  # stable as the list grows
    store = SequenceStore(data_dir, meta=meta)
    build_sequences(store, generator if generator is not None else target, tokenizer,
                    train_examples, responses=responses, max_new_tokens=max_new_tokens,
                    max_prompt_tokens=max_prompt_tokens, batch_size=generate_batch_size,
                    progress=progress)
    return store, train_examples, heldout_examples


def answer_counts(sequences, vocab_size: int) -> np.ndarray:
    """How often each id occurs in the responses (prompt tokens are never labels)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for tokens, prompt_len in sequences:
        np.add.at(counts, np.asarray(tokens[prompt_len:], dtype=np.int64), 1)
    return counts


def frequent_tokens(sequences, vocab_size: int, count: int, always=()) -> list[int]:
    """The `count` most frequent ids of the responses, plus `always` (end tokens), sorted."""
    counts = answer_counts(sequences, vocab_size)
    keep = set(np.argsort(-counts, kind="stable")[:count].tolist()) | {int(t) for t in always}
    return sorted(keep)


def answer_share(sequences, token_ids, vocab_size: int) -> float:
    """The share of the responses' tokens that are among `token_ids`: what a loss (and draft)
    vocabulary holds of the data, since a token outside it is never learned nor drafted."""
    counts = answer_counts(sequences, vocab_size)
    total = counts.sum()
    return float(counts[np.asarray(token_ids)].sum() / total) if total else 0.0


def trainable_ids(store, max_seq_len: int) -> list[int]:
    """Store ids of the sequences with a response to learn from once cut at `max_seq_len`
    (at least two answer positions); an epoch's order indexes this list."""
    return [i for i in range(len(store))
            if min(len(store[i][0]), max_seq_len) - max(store[i][1] - 1, 0) >= 2]


def epoch_order(seed: int, epoch: int, sizes: list[int]) -> np.ndarray:
    """The order in which an epoch visits training sequences 0..sizes[-1]-1: a shuffle of the
    first sizes[0], then a shuffle of each block added while the epoch ran (`sizes` grows when
    a run resumes on a larger store). Reshuffling the grown store instead would reorder the
    rest of the epoch and revisit sequences it had already trained on."""
    parts, start = [], 0
    for k, size in enumerate(sizes):
        key = [seed, epoch] if k == 0 else [seed, epoch, k]
        parts.append(start + np.random.default_rng(key).permutation(size - start))
        start = size
    return np.concatenate(parts)


def feature_scale(raw_features, sequences) -> mx.array:
    """1 / the per-dimension RMS of the target features over `sequences`: target features have
    outlier dimensions (SmolLM2: RMS ~1590 against a median of 5-16), which an fc layer would
    otherwise have to learn around; being linear, the scale folds into fc on export."""
    sq, count = 0.0, 0
    for tokens in sequences:
        f = raw_features(tokens)
        sq = sq + (f.astype(mx.float32) ** 2).sum(axis=0)
        count += f.shape[0]
    inv_scale = 1.0 / mx.maximum(mx.sqrt(sq / count), 1e-3)
    mx.eval(inv_scale)
    return inv_scale


def fold_feature_scale(weights: dict, inv_scale: mx.array | None) -> dict[str, mx.array]:
    """Checkpoint tensors from training weights: the feature scale folded into fc (x/s then W
    == W/s then x), so a checkpoint reads the target's raw features."""
    weights = {k: mx.array(v) for k, v in weights.items()}
    if inv_scale is not None:
        fc = weights["fc.weight"]
        weights["fc.weight"] = fc * inv_scale[None].astype(fc.dtype)
    return weights


def write_checkpoint_files(out: Path, config: dict, tensors: dict[str, mx.array],
                           weights_file: str = "model.safetensors") -> None:
    """config.json + the tensors (model.safetensors, or Medusa's file name) in `out`, each
    written atomically (the temporary file in train_state/, never beside config.json, where a
    loader could pick it up)."""
    out.mkdir(parents=True, exist_ok=True)
    state = out / STATE_DIR
    state.mkdir(exist_ok=True)
    _atomic_save_safetensors(out / weights_file, tensors, tmp_dir=state)
    _atomic_write_text(out / "config.json", json.dumps(config, indent=2) + "\n")


def package_drafter(run_dir, dest, target, *, kind: str = "dflash", dtype=mx.bfloat16,
                    notes: dict | None = None, weights_file: str = "model.safetensors") -> Path:
    """Copy a trained checkpoint into `dest` as a shippable drafter: config.json, the floating
    weights in `dtype` (bf16 halves the size; loading casts to the target's dtype; integer and
    boolean tensors such as EAGLE-3's d2t/t2d stay as they are), a DFlash draft vocabulary if
    any, and target.json, which names the drafter kind and the target it was trained for (sizes
    and embedding checksum) so that `--drafter KIND` finds it for that target only.
    `weights_file`: the checkpoint's tensors (Medusa's are medusa_lm_head.safetensors)."""
    from ..models.dflash import DRAFT_VOCAB_FILE

    run_dir, dest = Path(run_dir), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in mx.load(str(run_dir / weights_file)).items()}
    _atomic_save_safetensors(dest / weights_file, weights)
    config = json.loads((run_dir / "config.json").read_text())
    config["torch_dtype"] = {mx.bfloat16: "bfloat16", mx.float16: "float16"}.get(dtype, "float32")
    _atomic_write_text(dest / "config.json", json.dumps(config, indent=2) + "\n")
    vocab_file = run_dir / DRAFT_VOCAB_FILE
    if vocab_file.is_file():
        _atomic_write_text(dest / DRAFT_VOCAB_FILE, vocab_file.read_text())
    else:  # a drafter trained on the full vocabulary drafts from all of it
        (dest / DRAFT_VOCAB_FILE).unlink(missing_ok=True)
    hidden, vocab, layers = target_sizes(target)
    _atomic_write_text(dest / "target.json", json.dumps({
        "drafter": kind, "hidden_size": hidden, "vocab_size": vocab, "num_layers": layers,
        "embedding_checksum": embedding_checksum(target), **(notes or {}),
    }, indent=2) + "\n")
    return dest


def heldout_tau(target, drafter, prompts: list[list[int]], *, tokenizer=None,
                max_tokens: int = 64, num_draft: int | None = None) -> float:
    """Tokens per target pass over all held-out prompts, by the real loop (greedy, a fixed
    `num_draft`, default the drafter's own: a DFlash drafter's full block).

    With a tokenizer this is `mlxspec.stream_generate` (stops at eos); without one the engine's
    `speculative_tokens` with an `MLXTarget`, the loop stream_generate wraps.
    """
    from ..engine import SpecStats, speculative_tokens
    from ..generate import stream_generate
    from ..backends.mlx.target import MLXTarget
    from ..sampling import SamplingConfig

    num_draft = num_draft or drafter.default_num_draft
    generated = passes = 0
    for ids in prompts:
        if tokenizer is not None:
            last = None
            for last in stream_generate(target, tokenizer, ids, max_tokens, drafter=drafter,
                                        num_draft=num_draft, adaptive=False):
                pass
            generated += last.tau * last.target_passes
            passes += last.target_passes
        else:
            stats = SpecStats()
            for _ in speculative_tokens(
                MLXTarget(target, capture_layers=drafter.capture_layers, speculative=True),
                drafter, ids, sampling=SamplingConfig(), max_tokens=max_tokens,
                num_draft=num_draft, stats=stats,
            ):
                pass
            generated += stats.generated
            passes += stats.target_passes
    return generated / passes if passes else 0.0


# ---- The run ---------------------------------------------------------------------------------


def train(recipe: Recipe, target, run: RunSettings, *, raw_features=None) -> TrainResult:
    """Train (or with `run.resume`, continue) `recipe`'s drafter for the MLX `target`.
    `raw_features(tokens, layers)`: the target features the feature scale is measured on, when
    the training steps run elsewhere (torch); default the MLX target's."""
    run.check()
    out, state_dir, steps = run.out, run.state_dir, run.steps
    fit_to_time = steps is None and run.minutes is not None
    if steps is None:
        steps = FIT_HORIZON if fit_to_time else 1000
    target, tokenizer = resolve_target(target, run.tokenizer)

    # -- data: held-out prompts for τ, training sequences in the store
    store, _, heldout_examples = prepare_data(
        target, tokenizer, run.prompts, run.data_dir or out / "data", responses=run.responses,
        max_new_tokens=run.max_new_tokens, max_prompt_tokens=run.max_prompt_tokens,
        num_prompts=run.num_prompts, heldout=run.heldout, seed=run.seed,
        generator=run.generator, generate_batch_size=run.generate_batch_size,
        progress=run.progress)
    _, vocab, _ = target_sizes(target)
    train_ids = trainable_ids(store, run.max_seq_len)
    if not train_ids:
        raise ValueError("no training sequence has a response to learn from")
    heldout_prompts = [encode_prompt(tokenizer, p)[-run.max_prompt_tokens:]
                       for p, _ in heldout_examples[: run.eval_prompts]]

    # -- configuration, weights, optimizer
    warmup = run.warmup if run.warmup is not None else min(100, steps // 10)
    sched = FittedSchedule(run.lr, warmup, steps)
    vocab_file = state_dir / "loss_vocab.safetensors"
    scale_file = state_dir / "feature_scale.safetensors"
    if run.resume:
        config = json.loads((out / "config.json").read_text())
        state = json.loads((state_dir / "state.json").read_text())
        for key, (before, hint) in KEPT_ON_RESUME.items():
            saved = state.get(key, before)
            if saved != getattr(run, key):
                raise ValueError(f"{out} was trained with {key}={saved!r}; resume it with {hint}")
        for key in recipe.state_keys:
            if getattr(recipe, key) is None:
                setattr(recipe, key, state.get(key))
        weights = dict(mx.load(str(state_dir / "params.safetensors")))
        loss_ids = mx.load(str(vocab_file))["ids"].tolist() if vocab_file.is_file() else None
        inv_scale = mx.load(str(scale_file)).get("inv_scale")
        rng = np.random.default_rng()
        rng.bit_generator.state = state["rng"]
        step, epoch, cursor = state["step"], state["epoch"], state["cursor"]
        epoch_sizes = state.get("epoch_sizes", [len(train_ids)])  # older states: no growth
        if len(train_ids) < epoch_sizes[-1]:
            raise ValueError(f"{out} was training on {epoch_sizes[-1]} sequences and the data "
                             f"now holds {len(train_ids)}; resume with at least as many prompts")
        if len(train_ids) > epoch_sizes[-1]:  # the store grew: new sequences join this epoch
            epoch_sizes = epoch_sizes + [len(train_ids)]
    else:
        loss_ids = None
        if run.loss_vocab and run.loss_vocab < vocab:
            loss_ids = frequent_tokens((store[i] for i in train_ids), vocab, run.loss_vocab,
                                       always=eos_ids(tokenizer))
        config = recipe.config(target, tokenizer, run, loss_ids)
        mx.random.seed(run.seed)
        weights = recipe.fresh_weights(config, target, loss_ids)
        inv_scale = None
        if run.normalize_features:
            layers = recipe.feature_layers(config, target)
            features_of = raw_features or (lambda t, ids: target_features(target, t, ids))
            inv_scale = feature_scale(lambda tokens: features_of(tokens, layers),
                                      [store[i][0][: run.max_seq_len] for i in train_ids[:16]])
        rng = np.random.default_rng(run.seed)
        step, epoch, cursor = 0, 0, 0
        epoch_sizes = [len(train_ids)]
        state = {"log": []}
    config, weights = recipe.adapt(config, weights, inv_scale, target, run.resume)
    math = recipe.math(target, config, weights, schedule=sched,
                       weight_decay=run.weight_decay, grad_clip=run.grad_clip,
                       loss_ids=loss_ids, inv_scale=inv_scale, labels=run.labels)
    if run.resume:
        math.load_optimizer(state_dir)

    saved_step = step if run.resume else None  # the step of the checkpoint on disk

    def save():
        nonlocal saved_step
        current = math.weights()
        if not all(mx.isfinite(w).all().item() for w in current.values()):
            stop(f"the weights after step {step} are not finite")
        state_dir.mkdir(parents=True, exist_ok=True)
        recipe.write(out, config, current, inv_scale, loss_ids)
        _atomic_save_safetensors(state_dir / "params.safetensors", current, tmp_dir=state_dir)
        math.save_optimizer(state_dir)
        _atomic_write_text(state_dir / "state.json", json.dumps({
            "step": step, "epoch": epoch, "cursor": cursor, "epoch_sizes": epoch_sizes,
            "rng": rng.bit_generator.state,
            "steps": sched.steps, "seed": run.seed, "batch_size": run.batch_size,
            "lr": run.lr, "backend": run.backend, "loss_vocab": run.loss_vocab,
            "max_seq_len": run.max_seq_len, "labels": run.labels, **recipe.state(),
            "log": state["log"],
        }, indent=1))
        saved_step = step

    def stop(problem: str):
        kept = (f"the checkpoint in {out} is the last good one (step {saved_step})"
                if saved_step is not None else "nothing was saved")
        raise TrainingDiverged(f"training stopped: {problem}; {kept}. Lower the learning rate "
                               "(lr) or check the data")

    def next_sequence():
        nonlocal epoch, cursor, epoch_sizes
        order = epoch_order(run.seed, epoch, epoch_sizes)
        i = train_ids[int(order[cursor])]
        cursor += 1
        if cursor == len(order):
            epoch, cursor, epoch_sizes = epoch + 1, 0, [len(train_ids)]
        return i

    def make_batch():
        sequences, chosen, used, units, firsts = [], [], [], 0, 0
        for _ in range(run.batch_size):
            used.append(next_sequence())
            tokens, prompt_len = store[used[-1]]
            sequences.append(tokens[: run.max_seq_len])
            example, n, first = recipe.example(rng, sequences[-1], prompt_len)
            chosen.append(example)
            units, firsts = units + n, firsts + first
        batch = list(zip(math.features_batch(sequences), sequences, chosen))
        return batch, units, firsts, used

    result = TrainResult(out=out, step=step)
    if loss_ids is not None:
        result.loss_vocab_share = answer_share((store[i] for i in train_ids), loss_ids, vocab)
        result.drafts_from_loss_vocab = recipe.drafts_from_loss_vocab
    last_tau = next((e["tau"] for e in reversed(state["log"]) if "tau" in e), None)
    end = min(steps, run.stop_after) if run.stop_after is not None else steps
    bar = None
    if run.progress:
        from tqdm import tqdm

        bar = tqdm(total=steps, initial=step, desc=f"train {recipe.name}", unit="step")
    timed_tokens, step_seconds = 0, []
    deadline = None if run.minutes is None else time.monotonic() + 60 * run.minutes
    fit_at = step + max(warmup, FIT_MIN_STEPS)  # the step after which the cosine is fitted
    try:
        if not run.resume:  # the loss vocabulary and feature scale are fixed for the whole run
            state_dir.mkdir(parents=True, exist_ok=True)
            if loss_ids is not None:
                _atomic_save_safetensors(vocab_file, {"ids": mx.array(loss_ids, dtype=mx.int32)})
            _atomic_save_safetensors(scale_file, {"inv_scale": inv_scale} if inv_scale is not None
                                     else {"__none__": mx.zeros(1)})
            save()
        while step < end:
            t0 = time.perf_counter()
            batch, n_tokens, n_first, used = make_batch()
            loss, correct = math.step(batch)
            seconds = time.perf_counter() - t0
            step += 1
            if not np.isfinite(loss):
                stop(f"the loss at step {step} is {loss}")
            timed_tokens += n_tokens
            step_seconds.append(seconds)
            if fit_to_time and step == fit_at:  # the warmup is timed: fit the rest into the time
                per_step = float(np.median(step_seconds[len(step_seconds) // 2:]))
                left = max(deadline - time.monotonic(), 0.0)
                sched.set_length(step + max(int(left / per_step), 1))
                end = min(sched.steps, run.stop_after) if run.stop_after is not None \
                    else sched.steps
                fit_to_time = False
                if bar:
                    bar.total = sched.steps
            entry = {"step": step, "sequences": used, "loss": round(loss, 5),
                     "seconds": round(seconds, 3),
                     "block_tokens_per_s": round(n_tokens / seconds, 1),
                     "slot1_acc": round(correct / max(n_first, 1), 4),
                     "trained_blocks": (state["log"][-1]["trained_blocks"] if state["log"] else 0)
                     + n_first}
            result.losses.append((step, loss))
            if run.eval_every and heldout_prompts and (step % run.eval_every == 0 or step == end):
                evaluated = time.perf_counter()
                drafter = recipe.drafter(config, math.weights(), inv_scale, target, loss_ids)
                last_tau = heldout_tau(target, drafter, heldout_prompts, tokenizer=tokenizer,
                                       max_tokens=run.eval_max_tokens,
                                       num_draft=recipe.eval_draft(config))
                entry["tau"] = round(last_tau, 4)
                entry["eval_seconds"] = round(time.perf_counter() - evaluated, 1)
                result.taus.append((step, last_tau))
            state["log"].append(entry)
            if bar:
                postfix = {"loss": f"{loss:.3f}", "tok/s": f"{n_tokens / seconds:.0f}"}
                if last_tau is not None:
                    postfix["tau"] = f"{last_tau:.2f}"
                bar.set_postfix(postfix)
                bar.update(1)
            out_of_time = deadline is not None and time.monotonic() > deadline
            if out_of_time and fit_to_time:  # the time ran out within the warmup: it ends here
                sched.set_length(step)
            if step % run.save_every == 0 or step == end or out_of_time:
                save()
            if out_of_time:
                break
    finally:
        if bar:
            bar.close()
    result.step = step
    result.block_tokens_per_s = timed_tokens / sum(step_seconds) if step_seconds else 0.0
    return result
