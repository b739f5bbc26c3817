"""DFlash training steps in torch: the twin of mlxspec.training.dflash_trainer.MLXDFlashTraining,
and the torch target's feature pass, which feeds any trainer's MLX steps (`TorchTraining`).

Same recipe and the same checkpoint (the loop, data, feature scale, reduced loss vocabulary,
held-out τ and checkpoint writing are `train_dflash`'s); only the tensor math is here. On this
2-core CPU torch runs the target's feature pass ~4x and the drafter's forward/backward ~2x
faster than MLX (MLX's CPU exp/softmax are scalar), and it runs on CUDA.
"""

from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
import torch
import torch.nn.functional as F

from ..._blas import openblas_single_thread
from ...models.dflash import DFlashConfig, training_mask
from .dflash import DFlashModel
from .target import capture_layer_outputs, decoder_layers, model_device


def _rotate(rope, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE of x (..., heads, bs, D) at per-block positions (..., bs)."""
    inv_freq = rope.inv_freq.to(x.device)
    angles = (positions.float() * rope.scale)[..., None] * inv_freq  # (..., bs, D/2)
    cos, sin = angles.cos().unsqueeze(-3), angles.sin().unsqueeze(-3)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def _attention(attn, x, ctx, anchors, mask, rope):
    """All blocks of B sequences at once: x (B, N, bs, H) block inputs, ctx (B, L, H) each
    sequence's fused context, whose K/V are computed once per sequence and shared by its blocks;
    mask (B, N, bs, L + bs) what each slot sees (`training_mask`, padded)."""
    B, N, bs, _ = x.shape
    nh, kvh, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    rep, L = nh // kvh, ctx.shape[1]
    ctx_k, ctx_v = attn.keys_values(ctx, rope, 0)  # (B, kvh, L, D)
    positions = anchors[..., None] + torch.arange(bs, device=x.device)  # (B, N, bs)
    q = attn.q_norm(attn.q_proj(x).view(B, N, bs, nh, D)).transpose(2, 3)
    k = attn.k_norm(attn.k_proj(x).view(B, N, bs, kvh, D)).transpose(2, 3)
    v = attn.v_proj(x).view(B, N, bs, kvh, D).transpose(2, 3)  # (B, N, kvh, bs, D)
    q, k = _rotate(rope, q, positions), _rotate(rope, k, positions)
    qg = (q * attn.scale).view(B, N, kvh, rep, bs, D)
    scores = torch.cat([torch.einsum("bngrsd,bgld->bngrsl", qg, ctx_k),
                        torch.einsum("bngrsd,bngtd->bngrst", qg, k)], dim=-1)
    scores = scores.masked_fill(~mask[:, :, None, None], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(x.dtype)  # (B, N, kvh, rep, bs, L + bs)
    out = (torch.einsum("bngrsl,bgld->bngrsd", probs[..., :L], ctx_v)
           + torch.einsum("bngrst,bngtd->bngrsd", probs[..., L:], v))
    return attn.o_proj(out.reshape(B, N, nh, bs, D).transpose(2, 3).reshape(B, N, bs, -1))


def block_hidden(model: DFlashModel, features, block_embeddings, anchors, masks):
    """Normed drafter hidden states (B, N, bs, H) of every block of B sequences (see the MLX
    `block_hidden`): features (B, L, F), block_embeddings (B, N, bs, H), anchors (B, N)."""
    ctx = model.hidden_norm(model.fc(features.to(model.dtype)))
    h = block_embeddings.to(model.dtype)
    for layer, mask in zip(model.layers, masks):
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), ctx, anchors, mask,
                           model.rope)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.norm(h)


@torch.no_grad()
@openblas_single_thread()
def target_features_batch(target, sequences: list[list[int]], layer_ids, *,
                          predictions: bool = False):
    """(features (L, len(ids)*H) float32, greedy predictions (L,) or None) of the torch target
    over each sequence (two lists), as mlxspec.training.features.target_features: layers past
    the deepest id are skipped unless the predictions need the whole model; the last layer's
    output is final-normed. One padded pass: padding sits after each sequence, where a causal
    model never looks back from, so it needs no mask."""
    inner, device = target.model, model_device(target)
    full = inner.layers
    last = len(decoder_layers(target)) - 1
    width = max(len(t) for t in sequences)
    inputs = torch.tensor([list(t) + [0] * (width - len(t)) for t in sequences], device=device)
    predicted = None
    with capture_layer_outputs(target, layer_ids) as outputs:
        if predictions:
            predicted = target(input_ids=inputs).logits.argmax(-1)
        else:
            inner.layers = full[: max(layer_ids) + 1]
            try:
                inner(input_ids=inputs)
            finally:
                inner.layers = full
    parts = [inner.norm(o) if l == last else o for o, l in zip(outputs, layer_ids)]
    feats = torch.cat(parts, dim=-1).float()  # (B, width, len(ids)*H)
    lengths = [len(t) for t in sequences]
    return ([feats[b, :n] for b, n in enumerate(lengths)],
            None if predicted is None else [predicted[b, :n] for b, n in enumerate(lengths)])


class TorchTraining:
    """The torch backend's part in a training run, handed to a trainer by the caller that chose
    torch: the frozen target's feature pass (a trainer's `feature_pass`, see
    mlxspec.training.features) and DFlash's training steps. `target`: a transformers model
    (float32, `mlxspec.load(..., backend="torch")`); `device`: where the steps run (default the
    target's)."""

    def __init__(self, target, device=None):
        self.target, self.device = target, device

    def features(self, sequences: list[list[int]], layer_ids, *, predictions: bool = False):
        """(per sequence: features (L, len(ids)*H), predictions (L,) or None) as host arrays."""
        feats, predicted = target_features_batch(self.target, sequences, layer_ids,
                                                 predictions=predictions)
        return ([f.cpu().numpy() for f in feats],
                None if predicted is None else [p.cpu().numpy() for p in predicted])

    def dflash_steps(self, args: DFlashConfig, weights: dict, **options) -> "TorchDFlashTraining":
        return TorchDFlashTraining(self.target, args, weights, device=self.device, **options)


@contextmanager
def tf32_matmuls(device: torch.device):
    """TF32 matmuls on CUDA (~8x float32's rate on Hopper) for the target's feature pass and
    the drafter's step, whose LM head dominates; restored after. TF32's ~1e-3 relative error in
    products is accepted for training (features and labels); drafters are judged in float32."""
    if device.type != "cuda":
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _to_torch(a, device) -> torch.Tensor:
    return torch.from_numpy(np.array(a)).to(device)


class TorchDFlashTraining:
    """Features, one optimizer step and optimizer state, in torch, for `train_dflash`.

    `target`: the target as a transformers model (frozen). `weights`: the initial (or resumed)
    drafter weights by z-lab name, numpy/MLX arrays. The learning-rate `schedule` is MLX's
    (a function of the step), applied by hand so both backends follow the same curve.
    """

    def __init__(self, target, args: DFlashConfig, weights: dict, *, schedule, weight_decay,
                 grad_clip, gamma, loss_ids, inv_scale, labels="text", device=None):
        self.target, self.args, self.gamma, self.grad_clip = target, args, gamma, grad_clip
        self.target_labels = labels == "target"
        self.schedule = schedule
        self.device = torch.device(device) if device is not None else model_device(target)
        target.requires_grad_(False)
        self.model = DFlashModel(args).to(self.device)
        self.model.load_state_dict({k: _to_torch(v, self.device).float()
                                    for k, v in weights.items()})
        self.inv_scale = None if inv_scale is None else _to_torch(inv_scale, self.device)
        self.embed = target.get_input_embeddings()
        head = target.get_output_embeddings().weight.detach()
        self.label_map = None
        if loss_ids is not None:
            ids = torch.tensor(loss_ids, dtype=torch.long, device=self.device)
            head = head[ids]
            self.label_map = torch.full((args.vocab_size,), -1, dtype=torch.long,
                                        device=self.device)
            self.label_map[ids] = torch.arange(len(loss_ids), device=self.device)
        self.head = head.float().contiguous()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self._lr(0),
                                           betas=(0.9, 0.999), eps=1e-8,
                                           weight_decay=weight_decay)
        self.steps_done = 0

    def _lr(self, step: int) -> float:
        return float(self.schedule(mx.array(step)).item())

    def features(self, tokens: list[int]):
        """(features, labels by position) like MLX's `MLXDFlashTraining.features`: the scaled
        features of `target_layer_ids`; labels are None (the tokens themselves) or, with
        labels="target", the target's own next-token predictions (then the whole target runs)."""
        return self.features_batch([tokens])[0]

    def features_batch(self, sequences: list[list[int]]) -> list[tuple]:
        """`features` of each sequence, from one padded target pass."""
        with tf32_matmuls(self.device):
            feats, predicted = target_features_batch(self.target, sequences,
                                                     self.args.target_layer_ids,
                                                     predictions=self.target_labels)
        if predicted is not None:  # shifted as `shifted_labels`, on the device: no host copy
            firsts = torch.tensor([t[0] for t in sequences], device=self.device)
        out = []
        for b, f in enumerate(feats):
            f = f.to(self.device)
            labels = None
            if predicted is not None:
                labels = torch.cat([firsts[b : b + 1], predicted[b][:-1].to(self.device)])
            out.append((f * self.inv_scale if self.inv_scale is not None else f, labels))
        return out

    def _batch_loss(self, batch):
        """(weighted CE sum, weight sum, slot-1 hits) over B sequences' blocks in one pass:
        features and labels padded to the longest sequence, blocks to the most anchors; padded
        blocks and slots past a sequence's end carry no weight."""
        args, bs, device = self.args, self.args.block_size, self.device
        B = len(batch)
        host_lengths, host_counts = [len(t) for _, t, _ in batch], [len(a) for _, _, a in batch]
        L, N = max(host_lengths), max(host_counts)  # from the host: no device sync
        lengths = torch.tensor(host_lengths, device=device)
        counts = torch.tensor(host_counts, device=device)
        pad = torch.nn.utils.rnn.pad_sequence
        toks = pad([torch.tensor(t, dtype=torch.long, device=device) for _, t, _ in batch],
                   batch_first=True)  # (B, L)
        feats = pad([f for (f, _), _, _ in batch], batch_first=True)  # (B, L, F)
        targets = pad([toks[b, : len(t)] if lab is None else lab
                       for b, ((_, lab), t, _) in enumerate(batch)], batch_first=True)
        padded = np.zeros((B, N), dtype=np.int64)
        for b, (_, _, a) in enumerate(batch):
            padded[b, : len(a)] = a
        anc = torch.from_numpy(padded).to(device)
        real = torch.arange(N, device=device)[None] < counts[:, None]  # (B, N)
        block = torch.full((B, N, bs), args.mask_token_id, dtype=torch.long, device=device)
        block[..., 0] = toks.gather(1, anc)
        emb = self.embed(block) * args.input_embedding_scale
        by_kind = {}  # one mask per distinct (causal, window): layers mostly share one
        for layer in self.model.layers:
            a = layer.self_attn
            if (a.is_causal, a.window) not in by_kind:
                m = np.stack([np.array(training_mask(mx.array(row.astype(np.int32)), bs, L,
                                                     causal=a.is_causal, window=a.window))
                              for row in padded])
                by_kind[a.is_causal, a.window] = torch.from_numpy(m).to(device)
        masks = [by_kind[layer.self_attn.is_causal, layer.self_attn.window]
                 for layer in self.model.layers]
        hidden = block_hidden(self.model, feats, emb, anc, masks)[:, :, 1:]
        logits = self.model.compute_logits(hidden, lambda h: h @ self.head.T).float()
        idx = anc[..., None] + torch.arange(1, bs, device=device)  # (B, N, bs-1)
        valid = (idx < lengths[:, None, None]) & real[..., None]
        labels = targets.gather(1, idx.clamp(max=L - 1).view(B, -1)).view(idx.shape)
        if self.label_map is not None:
            labels = self.label_map[labels]
            valid = valid & (labels >= 0)
            labels = labels.clamp(min=0)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                             reduction="none").view(labels.shape)
        decay = torch.exp(-torch.arange(bs - 1, device=device, dtype=torch.float32) / self.gamma)
        weights = decay * valid
        correct = ((logits[..., 0, :].argmax(-1) == labels[..., 0]) & valid[..., 0]).sum()
        return (ce * weights).sum(), weights.sum(), correct

    @openblas_single_thread()
    def step(self, batch) -> tuple[float, int]:
        with tf32_matmuls(self.device):
            total, weight, correct = self._batch_loss(batch)
            loss = total / weight
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr(self.steps_done)
        self.optimizer.step()
        self.steps_done += 1
        return float(loss.item()), int(correct.item())

    def weights(self) -> dict[str, mx.array]:
        return {k: mx.array(v.detach().float().cpu().numpy())
                for k, v in self.model.state_dict().items()}

    def save_optimizer(self, state_dir: Path) -> None:
        """AdamW moments by parameter name, as safetensors (never a pickle)."""
        from ...training.data import _atomic_save_safetensors

        arrays = {"__steps__": mx.array([self.steps_done])}
        for name, p in self.model.named_parameters():
            st = self.optimizer.state.get(p)
            if st:
                arrays[f"{name}.exp_avg"] = mx.array(st["exp_avg"].cpu().numpy())
                arrays[f"{name}.exp_avg_sq"] = mx.array(st["exp_avg_sq"].cpu().numpy())
                arrays[f"{name}.step"] = mx.array([float(st["step"])])
        _atomic_save_safetensors(Path(state_dir) / "optimizer_torch.safetensors", arrays)

    def load_optimizer(self, state_dir: Path) -> None:
        saved = mx.load(str(Path(state_dir) / "optimizer_torch.safetensors"))
        self.steps_done = int(saved["__steps__"].item())
        for name, p in self.model.named_parameters():
            if f"{name}.exp_avg" in saved:
                self.optimizer.state[p] = {
                    "step": torch.tensor(float(saved[f"{name}.step"].item())),
                    "exp_avg": _to_torch(saved[f"{name}.exp_avg"], self.device),
                    "exp_avg_sq": _to_torch(saved[f"{name}.exp_avg_sq"], self.device),
                }
