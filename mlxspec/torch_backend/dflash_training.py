"""DFlash training steps in torch: the twin of mlxspec.training.dflash_trainer.MLXDFlashTraining.

Same recipe and the same checkpoint (the loop, data, feature scale, reduced loss vocabulary,
held-out τ and checkpoint writing are `train_dflash`'s); only the tensor math is here. On this
2-core CPU torch runs the target's feature pass ~4x and the drafter's forward/backward ~2x
faster than MLX (MLX's CPU exp/softmax are scalar), and it runs on CUDA.
"""

from pathlib import Path

import mlx.core as mx
import numpy as np
import torch
import torch.nn.functional as F

from .._blas import openblas_single_thread
from ..models.dflash import DFlashConfig
from ..training.dflash_trainer import shifted_labels, training_mask
from .dflash import DFlashModel
from .target import capture_layer_outputs, decoder_layers, model_device


def _rotate(rope, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE of x (N, heads, bs, D) at per-block positions (N, bs)."""
    inv_freq = rope.inv_freq.to(x.device)
    angles = (positions.float() * rope.scale)[..., None] * inv_freq  # (N, bs, D/2)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def _attention(attn, x, ctx, anchors, mask, rope):
    """All blocks at once: x (N, bs, H) block inputs, ctx (1, L, H) the fused context, whose
    K/V are computed once and shared (one batched matmul per kv head group)."""
    N, bs, _ = x.shape
    nh, kvh, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    rep, L = nh // kvh, ctx.shape[1]
    ctx_k, ctx_v = attn.keys_values(ctx, rope, 0)  # (1, kvh, L, D)
    positions = anchors[:, None] + torch.arange(bs, device=x.device)[None]
    q = _rotate(rope, attn.q_norm(attn.q_proj(x).view(N, bs, nh, D)).transpose(1, 2), positions)
    k = _rotate(rope, attn.k_norm(attn.k_proj(x).view(N, bs, kvh, D)).transpose(1, 2), positions)
    v = attn.v_proj(x).view(N, bs, kvh, D).transpose(1, 2)
    qg = (q * attn.scale).view(N, kvh, rep, bs, D)
    q_by_group = qg.permute(1, 0, 2, 3, 4).reshape(kvh, N * rep * bs, D)
    ctx_scores = (q_by_group @ ctx_k[0].transpose(-1, -2)).view(kvh, N, rep, bs, L)
    scores = torch.cat([ctx_scores.permute(1, 0, 2, 3, 4), qg @ k[:, :, None].transpose(-1, -2)],
                       dim=-1)  # (N, kvh, rep, bs, L + bs)
    scores = scores.masked_fill(~mask[:, None, None], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(x.dtype)
    ctx_probs = probs[..., :L].permute(1, 0, 2, 3, 4).reshape(kvh, N * rep * bs, L)
    out = (ctx_probs @ ctx_v[0]).view(kvh, N, rep, bs, D).permute(1, 0, 2, 3, 4)
    out = out + probs[..., L:] @ v[:, :, None]
    return attn.o_proj(out.reshape(N, nh, bs, D).transpose(1, 2).reshape(N, bs, -1))


def block_hidden(model: DFlashModel, features, block_embeddings, anchors, masks):
    """Normed drafter hidden states (N, bs, H) of every block (see the MLX `block_hidden`)."""
    ctx = model.hidden_norm(model.fc(features.to(model.dtype)[None]))
    h = block_embeddings.to(model.dtype)
    for layer, mask in zip(model.layers, masks):
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), ctx, anchors, mask,
                           model.rope)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.norm(h)


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
        layers = decoder_layers(target)
        self._deepest = max(args.target_layer_ids)
        self._last = len(layers) - 1

    def _lr(self, step: int) -> float:
        return float(self.schedule(mx.array(step)).item())

    @torch.no_grad()
    @openblas_single_thread()
    def features(self, tokens: list[int]):
        """(features, labels by position) like MLX's `MLXDFlashTraining.features`: features of
        `target_layer_ids` (layers past the deepest skipped, the last layer's output final-normed);
        labels are None (the tokens themselves) or, with labels="target", the target's own
        next-token predictions (then the whole target runs)."""
        inner = self.target.model
        full = inner.layers
        ids = self.args.target_layer_ids
        inputs = torch.tensor([tokens], device=self.device)
        labels = None
        with capture_layer_outputs(self.target, ids) as outputs:
            if self.target_labels:
                predicted = self.target(input_ids=inputs).logits[0].argmax(-1)
                labels = torch.tensor(shifted_labels(tokens, predicted.cpu().numpy()),
                                      device=self.device)
            else:
                inner.layers = full[: self._deepest + 1]
                try:
                    inner(input_ids=inputs)
                finally:
                    inner.layers = full
        parts = [inner.norm(o[0]) if l == self._last else o[0] for o, l in zip(outputs, ids)]
        feats = torch.cat(parts, dim=-1).float()
        return (feats * self.inv_scale if self.inv_scale is not None else feats), labels

    def _sequence_loss(self, features, tokens: list[int], anchors: np.ndarray):
        args, bs, device = self.args, self.args.block_size, self.device
        feats, labels_by_position = features
        toks = torch.tensor(tokens, dtype=torch.long, device=device)
        targets = toks if labels_by_position is None else labels_by_position
        anc = torch.from_numpy(anchors.astype(np.int64)).to(device)
        block = torch.full((len(anchors), bs), args.mask_token_id, dtype=torch.long, device=device)
        block[:, 0] = toks[anc]
        emb = self.embed(block) * args.input_embedding_scale
        by_kind = {}  # one mask per distinct (causal, window): layers mostly share one
        for layer in self.model.layers:
            a = layer.self_attn
            if (a.is_causal, a.window) not in by_kind:
                m = training_mask(mx.array(anchors.astype(np.int32)), bs, len(tokens),
                                  causal=a.is_causal, window=a.window)
                by_kind[a.is_causal, a.window] = _to_torch(m, device)
        masks = [by_kind[layer.self_attn.is_causal, layer.self_attn.window]
                 for layer in self.model.layers]
        hidden = block_hidden(self.model, feats, emb, anc, masks)[:, 1:]
        logits = self.model.compute_logits(hidden, lambda h: h @ self.head.T).float()
        idx = anc[:, None] + torch.arange(1, bs, device=device)[None]
        valid = idx < len(tokens)
        labels = targets[idx.clamp(max=len(tokens) - 1)]
        if self.label_map is not None:
            labels = self.label_map[labels]
            valid = valid & (labels >= 0)
            labels = labels.clamp(min=0)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                             reduction="none").view(labels.shape)
        decay = torch.exp(-torch.arange(bs - 1, device=device, dtype=torch.float32) / self.gamma)
        weights = decay[None] * valid
        correct = ((logits[:, 0].argmax(-1) == labels[:, 0]) & valid[:, 0]).sum()
        return (ce * weights).sum(), weights.sum(), correct

    @openblas_single_thread()
    def step(self, batch) -> tuple[float, int]:
        total = weight = correct = 0
        for feats, tokens, anchors in batch:
            t, w, c = self._sequence_loss(feats, tokens, anchors)
            total, weight, correct = total + t, weight + w, correct + c
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
        from ..training.data import _atomic_save_safetensors

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
