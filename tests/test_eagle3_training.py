"""EAGLE-3 training on tiny random targets: the training-time-test path is the inference
chain, a trained checkpoint loads (speculators layout) and decodes losslessly, resuming is
exact, training learns, and the CLI runs it."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from tiny_models import tiny_llama

from mlxspec.drafters import load_drafter
from mlxspec.engine import Drafter, SpecStats, speculative_tokens
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.models.eagle3 import Eagle3Config, Eagle3Model
from mlxspec.sampling import SamplingConfig
from mlxspec.training.features import target_features
from mlxspec.training.eagle3_trainer import (
    drafter_from,
    eagle3_config_for,
    label_map_of,
    train_eagle3,
    ttt_loss,
    ttt_outputs,
)

VOCAB = 32
PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7, 3], [5, 9, 11, 5, 9, 11], [3, 8], [20, 21, 22, 23],
           [30, 2, 14], [6, 6, 1, 2]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=VOCAB, hidden=32, layers=6, seed=1, sharpness=3.0)


def random_weights(config: dict, seed: int) -> dict:
    model = Eagle3Model(Eagle3Config.from_dict(config), own_embed=False, own_head=True)
    rng = np.random.default_rng(seed)
    weights = {}
    for name, p in tree_flatten(model.parameters()):
        noise = rng.standard_normal(p.shape).astype(np.float32)
        weights[name] = mx.array(1 + 0.1 * noise if name.endswith("norm.weight")
                                 else noise * p.shape[-1] ** -0.5)
    return weights


def _train(target, out, **kw):
    options = dict(steps=6, ttt_steps=3, max_new_tokens=12, heldout=1, eval_every=0,
                   save_every=3, progress=False, seed=0, lr=3e-3, warmup=1, loss_vocab=20)
    options.update(kw)
    return train_eagle3(target, PROMPTS, out, **options)


@pytest.mark.parametrize("draft_vocab", [None, [0, 2, 3, 5, 7, 9, 11, 14, 20, 31]])
def test_training_steps_equal_the_inference_chain(target, draft_vocab):
    """Step s of training-time test at row i gives the logits the inference drafter gives at
    chain step s after committing t_0..t_{i+1}, with the true tokens as its drafts."""
    vocab_size = len(draft_vocab) if draft_vocab else VOCAB
    config = eagle3_config_for(target, draft_vocab_size=vocab_size)
    weights = random_weights(config, seed=3)
    drafter = drafter_from(config, weights, None, target, draft_vocab)
    tokens = [3, 14, 15, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]
    steps = 3
    feats = target_features(target, tokens, list(drafter.capture_layers))
    outs = ttt_outputs(drafter.model, drafter.model.project(feats[: len(tokens) - 1][None]),
                       mx.array(tokens), steps)
    for i in (0, 1, 4, 9):
        committed = tokens[: i + 2]
        drafter.begin(committed, MLXTarget(target, capture_layers=drafter.capture_layers)
                      .prefill(committed))
        chain = drafter.chain_logits(committed, steps, draft_ids=tokens[i + 2 : i + 2 + steps])
        for s in range(steps):
            train_logits = drafter.model.logits(outs[s][i])
            assert mx.allclose(train_logits, chain[s], atol=1e-4, rtol=1e-4).item(), (i, s)


def test_loss_counts_answer_labels_inside_the_draft_vocabulary(target):
    config = eagle3_config_for(target, draft_vocab_size=4)
    model = Eagle3Model(Eagle3Config.from_dict(config), own_embed=False, own_head=True)
    model.load_weights(list(random_weights(config, 0).items()))
    model.use_embedding(target.model.embed_tokens)
    tokens = mx.array([1, 2, 3, 4, 5, 6, 7, 8])
    feats = target_features(target, tokens.tolist(), [1, 2, 3])
    # labels 5 and 7 are in the draft vocabulary; answer from position 4; steps 0 and 1
    _, weight, _ = ttt_loss(model, feats, tokens, 4, steps=2, decay=0.5,
                            label_map=label_map_of([0, 5, 7, 9], VOCAB))
    # step 0 ranks positions 2..7: answer ones 4..7 with labels 5,6,7,8 -> 5 and 7 count (1 each)
    # step 1 ranks 3..7: answer ones 4..7 -> 5 and 7 count (0.5 each)
    assert weight.item() == pytest.approx(3.0)


def test_end_to_end_checkpoint_loads_and_decodes_losslessly(target, tmp_path):
    result = _train(target, tmp_path / "run", steps=3, eval_every=3, eval_max_tokens=8)
    assert result.step == 3 and result.taus and 1.0 <= result.taus[-1][1] <= 5.0
    assert 0 < result.loss_vocab_share <= 1
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["architectures"] == ["Eagle3Speculator"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]  # [2, L/2, L-3] of L = 6
    weights = mx.load(str(tmp_path / "run" / "model.safetensors"))
    assert "embed_tokens.weight" not in weights and weights["t2d"].sum().item() == len(
        weights["d2t"])
    drafter = load_drafter("eagle3", tmp_path / "run", model=target, tokenizer=None)
    assert drafter.capture_layers == (1, 2, 2)
    for prompt in ([1, 2, 3], [9, 4, 4, 4, 17]):
        outs = []
        for d in (Drafter(), drafter):
            stats = SpecStats()
            outs.append([t for t, _ in speculative_tokens(
                MLXTarget(target, capture_layers=d.capture_layers, speculative=True), d, prompt,
                sampling=SamplingConfig(), max_tokens=20, num_draft=4, stats=stats)])
        assert outs[1] == outs[0]


def test_resume_equals_uninterrupted_run(target, tmp_path):
    _train(target, tmp_path / "whole")
    _train(target, tmp_path / "split", stop_after=3)
    state = json.loads((tmp_path / "split" / "train_state" / "state.json").read_text())
    assert state["step"] == 3 and state["ttt_steps"] == 3
    resumed = _train(target, tmp_path / "split", resume=True, ttt_steps=None)
    assert resumed.step == 6
    a = mx.load(str(tmp_path / "whole" / "model.safetensors"))
    b = mx.load(str(tmp_path / "split" / "model.safetensors"))
    assert max(float(mx.abs(a[k].astype(mx.float32) - b[k].astype(mx.float32)).max())
               for k in a) < 1e-6


def test_training_learns(target, tmp_path):
    """On a handful of sequences, many steps bring the loss well down and step-0 accuracy up."""
    result = _train(target, tmp_path / "run", steps=60, save_every=60, lr=1e-2, warmup=5,
                    eval_every=60, eval_max_tokens=12)
    losses = [loss for _, loss in result.losses]
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:5])
    log = json.loads((tmp_path / "run" / "train_state" / "state.json").read_text())["log"]
    assert np.mean([e["slot1_acc"] for e in log[-10:]]) > np.mean([e["slot1_acc"] for e in log[:5]])
    assert result.taus[-1][1] > 1.2


def test_bad_options_refused_before_compute(target, tmp_path):
    with pytest.raises(ValueError, match="ttt_steps must be >= 1"):
        _train(target, tmp_path / "a", ttt_steps=0)
    with pytest.raises(ValueError, match="aux layer ids \\[9\\]"):
        _train(target, tmp_path / "b", aux_layer_ids=[1, 2, 9])
    with pytest.raises(ValueError, match="MLX backend only"):
        _train(target, tmp_path / "c", backend="torch")


@pytest.mark.parametrize("labels", ["text", "target"])
def test_torch_features_train_as_mlx_features(target, tmp_path, labels):
    """feature_pass (the torch copy of the target computing the features and labels) gives the
    run the MLX target gives: same losses, same checkpoint, within float32 rounding."""
    pytest.importorskip("torch")
    from test_torch_backend import torch_twin

    from mlxspec.backends.torch.dflash_training import TorchTraining

    twin = torch_twin(target, tmp_path / "twin")
    torch_features = {"feature_pass": TorchTraining(twin).features}
    runs = [_train(target, tmp_path / name, steps=4, labels=labels, data_dir=tmp_path / "data",
                   **extra)
            for name, extra in (("mlx", {}), ("torch", torch_features))]
    losses = np.array([[a for _, a in r.losses] for r in runs])
    assert np.abs(losses[0] - losses[1]).max() < 1e-4, losses
    a, b = (mx.load(str(tmp_path / n / "model.safetensors")) for n in ("mlx", "torch"))
    assert max(float(mx.abs(a[k].astype(mx.float32) - b[k].astype(mx.float32)).max())
               for k in a) < 1e-4


def test_packaged_eagle3_drafter_is_found_for_its_target_and_kind_only(target, tmp_path,
                                                                       monkeypatch):
    """package_drafter(kind="eagle3"): bf16 weights with d2t/t2d kept exact, target.json naming
    the kind; `load_drafter("eagle3")` without a path finds it (and decodes losslessly), the
    DFlash lookup does not, nor does another target of the same shape."""
    import mlxspec
    import mlxspec.drafters.shipped as shipped_module
    from mlxspec.training.run import package_drafter

    _train(target, tmp_path / "run", steps=2)
    dest = package_drafter(tmp_path / "run", tmp_path / "trained" / "tiny", target, kind="eagle3")
    weights = mx.load(str(dest / "model.safetensors"))
    assert weights["fc.weight"].dtype == mx.bfloat16 and weights["d2t"].dtype == mx.int64
    assert weights["t2d"].dtype == mx.bool_
    assert json.loads((dest / "target.json").read_text())["drafter"] == "eagle3"
    monkeypatch.setattr(shipped_module, "TRAINED_DIR", tmp_path / "trained")
    drafter = mlxspec.load_drafter("eagle3", model=target, tokenizer=None)
    assert drafter.model.fc.weight.dtype == mx.float32  # cast to the target's dtype
    for prompt in ([1, 2, 3], [9, 4, 4, 4, 17]):
        outs = []
        for d in (Drafter(), drafter):
            outs.append([t for t, _ in speculative_tokens(
                MLXTarget(target, capture_layers=d.capture_layers, speculative=True), d, prompt,
                sampling=SamplingConfig(), max_tokens=16, num_draft=4, stats=SpecStats())])
        assert outs[1] == outs[0]
    with pytest.raises(ValueError, match="ships one only"):
        mlxspec.load_drafter("dflash", model=target, tokenizer=None)
    other = tiny_llama(vocab=VOCAB, hidden=32, layers=6, seed=7, sharpness=3.0)
    with pytest.raises(ValueError, match="ships one only"):
        mlxspec.load_drafter("eagle3", model=other, tokenizer=None)
