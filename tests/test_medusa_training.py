"""Medusa training on a tiny random target: the loss is the drafter's (head i at position j
against token j+2+i), a trained checkpoint loads in the published layout and decodes
losslessly, resuming is exact, training learns, and the CLI runs it."""

import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from tiny_models import tiny_llama

from mlxspec.cli.main import main
from mlxspec.drafters import load_drafter
from mlxspec.engine import PlainDecoding, SpecStats, speculative_tokens
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.models.medusa import MedusaHeads
from mlxspec.sampling import SamplingConfig
from mlxspec.training.features import target_features
from mlxspec.training.medusa_trainer import heads_loss, train_medusa

VOCAB = 32
PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7, 3], [5, 9, 11, 5, 9, 11], [3, 8], [20, 21, 22, 23],
           [30, 2, 14], [6, 6, 1, 2]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=VOCAB, hidden=32, layers=3, seed=1, sharpness=3.0)


def _train(target, out, **kw):
    options = dict(steps=6, max_new_tokens=12, heldout=1, eval_every=0, save_every=3,
                   progress=False, seed=0, lr=3e-3, warmup=1)
    options.update(kw)
    return train_medusa(target, PROMPTS, out, **options)


def test_the_loss_reads_what_the_drafter_reads(target):
    """Head i's loss at position j is the cross-entropy of the drafter's head-i logits after
    committing t_0..t_j against t_{j+2+i}, with weight 0.8^i."""
    mx.random.seed(2)
    heads = MedusaHeads(2, 1, 32, VOCAB)
    tokens = [1, 5, 9, 2, 7, 3, 3, 8]
    hidden = target_features(target, tokens, [2])  # the last layer, after the final norm
    total, weight, _ = heads_loss(heads, hidden, mx.array(tokens), prompt_len=0)
    want_total, want_weight = 0.0, 0.0
    for i in range(2):
        for j in range(len(tokens) - 2 - i):
            logits = heads.head(i, hidden[j])
            logp = logits - mx.logsumexp(logits)
            want_total += -0.8**i * logp[tokens[j + 2 + i]].item()
            want_weight += 0.8**i
    assert abs(weight.item() - want_weight) < 1e-5
    assert abs(total.item() - want_total) < 1e-3


@pytest.mark.parametrize("own", [False, True])
def test_checkpoint_loads_in_the_published_layout_and_decodes_losslessly(target, tmp_path, own):
    result = _train(target, tmp_path / "run", steps=3, eval_every=3, eval_max_tokens=8,
                    own_projection=own, loss_vocab=20)
    assert result.step == 3 and result.taus and 1.0 <= result.taus[-1][1] <= 4.0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["medusa_num_heads"] == 3 and config["medusa_num_layers"] == 1
    tensors = mx.load(str(tmp_path / "run" / "medusa_lm_head.safetensors"))
    projections = sorted(k for k in tensors if k.endswith(".1.weight"))
    assert projections == (["0.1.weight", "1.1.weight", "2.1.weight"] if own else [])
    if own:  # rows outside the loss vocabulary are the target's head
        trained = set(mx.load(str(tmp_path / "run/train_state/loss_vocab.safetensors"))["ids"]
                      .tolist())
        untrained = [t for t in range(VOCAB) if t not in trained]
        np.testing.assert_array_equal(np.array(tensors["0.1.weight"][untrained]),
                                      np.array(target.lm_head.weight[untrained]))
    drafter = load_drafter("medusa", str(tmp_path / "run"), model=target, tokenizer=None)
    for prompt in ([1, 2, 3], [9, 4, 4, 4, 17]):
        outs = []
        for d in (PlainDecoding(), drafter):
            outs.append([t for t, _ in speculative_tokens(
                MLXTarget(target, capture_layers=d.capture_layers, speculative=True), d, prompt,
                sampling=SamplingConfig(), max_tokens=20, num_draft=3, stats=SpecStats())])
        assert outs[1] == outs[0]


def test_resume_equals_uninterrupted_run(target, tmp_path):
    _train(target, tmp_path / "whole", num_heads=2)
    _train(target, tmp_path / "split", num_heads=2, stop_after=3)
    state = json.loads((tmp_path / "split" / "train_state" / "state.json").read_text())
    assert state["step"] == 3 and state["num_heads"] == 2 and state["own_projection"] is False
    resumed = _train(target, tmp_path / "split", resume=True)
    assert resumed.step == 6
    a = mx.load(str(tmp_path / "whole" / "medusa_lm_head.safetensors"))
    b = mx.load(str(tmp_path / "split" / "medusa_lm_head.safetensors"))
    assert sorted(a) == sorted(b)
    assert max(float(mx.abs(a[k] - b[k]).max()) for k in a) < 1e-6


def test_training_learns(target, tmp_path):
    """On a handful of sequences, many steps bring the loss well down and head-0 accuracy up."""
    result = _train(target, tmp_path / "run", steps=60, save_every=60, lr=1e-2, warmup=5,
                    eval_every=60, eval_max_tokens=12)
    losses = [loss for _, loss in result.losses]
    assert np.mean(losses[-10:]) < 0.7 * np.mean(losses[:5])
    log = json.loads((tmp_path / "run" / "train_state" / "state.json").read_text())["log"]
    assert np.mean([e["slot1_acc"] for e in log[-10:]]) > np.mean([e["slot1_acc"] for e in log[:5]])
    assert result.taus[-1][1] > 1.1


def test_cli_refuses_bad_options_in_one_line(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["train", "medusa", "--prompts", "sharegpt", "--out",
                                  str(tmp_path / "x"), "--heads", "0"])
    assert result.exit_code != 0
    assert result.output.strip().splitlines()[-1] == \
        "Error: Invalid value for --heads: must be >= 1, got 0"
    assert not (tmp_path / "x").exists()


def test_packaged_heads_are_found_for_their_target_and_kind_only(target, tmp_path, monkeypatch):
    """package_drafter(kind="medusa", weights_file=...): bf16 heads and target.json naming the
    kind; `load_drafter("medusa")` without a path finds them (cast to the target's dtype, and
    decoding losslessly), the other kinds' lookups do not, nor does another target."""
    import mlxspec
    import mlxspec.drafters.shipped as shipped_module
    from mlxspec.training.run import package_drafter

    _train(target, tmp_path / "run", steps=2)
    dest = package_drafter(tmp_path / "run", tmp_path / "trained" / "tiny", target, kind="medusa",
                           weights_file="medusa_lm_head.safetensors")
    assert mx.load(str(dest / "medusa_lm_head.safetensors"))["0.0.linear.weight"].dtype == \
        mx.bfloat16
    assert json.loads((dest / "target.json").read_text())["drafter"] == "medusa"
    monkeypatch.setattr(shipped_module, "TRAINED_DIR", tmp_path / "trained")
    drafter = mlxspec.load_drafter("medusa", model=target, tokenizer=None)
    assert drafter.heads.dtype == mx.float32
    outs = [[t for t, _ in speculative_tokens(
        MLXTarget(target, capture_layers=d.capture_layers, speculative=True), d, [9, 4, 4, 17],
        sampling=SamplingConfig(), max_tokens=16, num_draft=3, stats=SpecStats())]
        for d in (PlainDecoding(), drafter)]
    assert outs[1] == outs[0]
    with pytest.raises(ValueError, match="ships one only"):
        mlxspec.load_drafter("eagle3", model=target, tokenizer=None)
    other = tiny_llama(vocab=VOCAB, hidden=32, layers=3, seed=7, sharpness=3.0)
    with pytest.raises(ValueError, match="ships one only"):
        mlxspec.load_drafter("medusa", model=other, tokenizer=None)
