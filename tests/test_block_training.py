"""DFlash2 and DSpark training on tiny random targets: the training path is the inference path
(convolutions, Markov bias and confidences included), the losses are what the recipes say, a
fresh DFlash2 drafts as its DFlash backbone, trained checkpoints load in the published layouts
and decode losslessly, resuming is exact, and the CLI runs both."""

import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten
from test_dflash import drafter_config
from tiny_models import tiny_llama

from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.backends.mlx.target_parts import target_embedding, target_final_norm, target_head
from mlxspec.cli.main import main
from mlxspec.drafters.dflash import DFlashDrafter, load_dflash_drafter
from mlxspec.drafters.dflash2 import DFlash2Drafter, load_dflash2_drafter
from mlxspec.drafters.dspark import DSparkDrafter, load_dspark_drafter
from mlxspec.draft_length import ScoredDraftLength
from mlxspec.engine import PlainDecoding, SpecStats, speculative_tokens
from mlxspec.models.dflash import DFlashConfig, DFlashModel
from mlxspec.models.dflash2 import DFlash2Config, DFlash2Model
from mlxspec.models.dspark import DSparkConfig, DSparkModel
from mlxspec.sampling import SamplingConfig
from mlxspec.training.dflash2_trainer import (
    dflash2_config,
    fresh_parts,
    selector_candidates,
    selector_loss,
    train_dflash2,
)
from mlxspec.training.dflash_trainer import block_hidden, block_tokens, train_dflash
from mlxspec.training.dspark_trainer import acceptance, dspark_config, train_dspark
from mlxspec.training.features import target_features

VOCAB = 32
PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7, 3], [5, 9, 11, 5, 9, 11], [3, 8], [20, 21, 22, 23],
           [30, 2, 14], [6, 6, 1, 2]]
TOKENS = [3, 14, 15, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]
SMALL = dict(selector_rank=8, selector_top_k=8)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=VOCAB, hidden=32, layers=4, seed=1, sharpness=3.0)


def _options(**kw):
    options = dict(layers=1, block_size=4, steps=6, anchors=4, max_new_tokens=12, heldout=1,
                   eval_every=0, save_every=3, progress=False, seed=0, lr=3e-3, warmup=1)
    return {**options, **kw}


def _randomised(model, seed):
    """Every parameter random (so convolutions, codebooks and heads all matter)."""
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    weights = []
    for key, (name, p) in zip(keys, params):
        noise = mx.random.normal(p.shape, key=key)
        scale = 0.1 if "norm" in name else (0.3 if "_conv." in name else p.shape[-1] ** -0.5)
        weights.append((name, (1 + noise * scale) if "norm" in name else noise * scale))
    model.load_weights(weights)
    mx.eval(model.parameters())
    return model


def _parts(target):
    return dict(embed_tokens=target_embedding(target), lm_head=target_head(target),
                final_norm=target_final_norm(target), target_layers=4)


def _lossless(target, drafter, prompts=([1, 2, 3], [9, 4, 4, 4, 17]), k=None):
    for prompt in prompts:
        outs = [[t for t, _ in speculative_tokens(
            MLXTarget(target, capture_layers=d.capture_layers, speculative=True), d, prompt,
            sampling=SamplingConfig(), max_tokens=20,
            num_draft=k or max(d.default_num_draft, 1), stats=SpecStats())]
            for d in (PlainDecoding(), drafter)]
        assert outs[1] == outs[0], prompt


def _block(model, target, tokens, anchors):
    feats = target_features(target, tokens, model.args.target_layer_ids)
    tokens, anchors = mx.array(tokens), mx.array(anchors)
    block = block_tokens(tokens, anchors, model.args.block_size, model.args.mask_token_id)
    return block_hidden(model, feats, target_embedding(target)(block), anchors)


# ---- DFlash2 ----------------------------------------------------------------------------------


def _dflash2_model(ids=(1, 3), seed=4):
    config = dflash2_config(drafter_config(vocab=VOCAB, target_layers=4,
                                           target_layer_ids=list(ids)), group_size=8, **{
        "rank": 8, "top_k": 8})
    return _randomised(DFlash2Model(DFlash2Config.from_dict(config)), seed)


@pytest.mark.parametrize("ids", [[1, 3], [2]])
def test_dflash2_training_path_equals_inference_path(target, ids):
    """Every block's slot hidden states from whole-sequence features + mask equal the drafter's
    in the real loop after committing the tokens up to the anchor, with random convolutions."""
    model = _dflash2_model(ids)
    anchors = [0, 1, 5, 8, 12]
    train = model.compute_logits(_block(model, target, TOKENS, anchors)[:, 1:], target_head(target))
    drafter = DFlash2Drafter(model, **_parts(target))
    for n, a in enumerate(anchors):
        committed = TOKENS[: a + 1]
        drafter.begin(committed, MLXTarget(target, capture_layers=ids).prefill(committed))
        infer = drafter.block_logits(committed, model.args.block_size - 1)
        assert mx.allclose(train[n], infer, atol=1e-4, rtol=1e-4).item(), (ids, a)


def test_selector_candidates_always_hold_the_label():
    logits = mx.array(np.random.default_rng(0).normal(size=(3, 4, 20)), dtype=mx.float32)
    labels = mx.array([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    labels = mx.where(mx.arange(4)[None] == 0, mx.argmax(logits, axis=-1), labels)
    ids, where = selector_candidates(logits, labels, 5)
    assert (np.take_along_axis(np.array(ids), np.array(where)[..., None], -1)[..., 0]
            == np.array(labels)).all()
    for row in np.array(ids).reshape(-1, 5):
        assert len(set(row.tolist())) == 5
    # the top candidates stay: only the last is replaced, and only when the label is missing
    top = np.argsort(-np.array(logits), axis=-1)[..., :4]
    assert all(set(t) <= set(r) for t, r in zip(top.reshape(-1, 4), np.array(ids).reshape(-1, 5)))


def test_selector_loss_is_the_walks_own_teacher_forced_q(target):
    """Where the label is a candidate, the selector loss is -log q(label) of the walk that
    drew the labels (CandidateSelector.forced_q, the proposal sampling reports)."""
    model = _dflash2_model()
    hidden = _block(model, target, TOKENS, [2, 6])[:, 1:]
    logits = model.compute_logits(hidden, target_head(target)).astype(mx.float32)
    labels = mx.argsort(-logits, axis=-1)[..., 1].astype(mx.int32)  # a candidate, not the top
    anchors = mx.array([TOKENS[2], TOKENS[6]], dtype=mx.int32)
    before = mx.concatenate([anchors[:, None], labels[:, :-1]], axis=1)
    loss = selector_loss(model, hidden, logits, before, labels)
    ids, q = model.candidate_selector.forced_q(hidden, logits, anchors, labels, 1.0)
    at = mx.argmax(ids == labels[..., None], axis=-1)
    want = -mx.log(mx.take_along_axis(q, at[..., None], axis=-1)[..., 0])
    assert mx.allclose(loss, want, atol=1e-5).item()


def test_a_fresh_dflash2_drafts_as_its_dflash_backbone(target):
    """Identity convolutions and a zero successor codebook: the same block logits and the same
    drafts as the DFlash drafter of the same backbone, so training starts from DFlash."""
    base = drafter_config(vocab=VOCAB, target_layers=4, target_layer_ids=[1, 3])
    dflash = _randomised(DFlashModel(DFlashConfig.from_dict(base)), 5)
    model = DFlash2Model(DFlash2Config.from_dict(dflash2_config(base, group_size=8, rank=8,
                                                                top_k=8)))
    fresh_parts(model)
    model.load_weights(list(tree_flatten(dflash.parameters())), strict=False)
    ours, theirs = DFlash2Drafter(model, **_parts(target)), DFlashDrafter(dflash, **_parts(target))
    for committed in (TOKENS[:4], TOKENS[:9]):
        for d in (ours, theirs):
            d.begin(committed, MLXTarget(target, capture_layers=[1, 3]).prefill(committed))
        assert mx.allclose(ours.block_logits(committed, 3), theirs.block_logits(committed, 3),
                           atol=1e-5).item()
        drafts = [d.propose(committed, 3, SamplingConfig()).tokens.tolist() for d in (ours, theirs)]
        assert drafts[0] == drafts[1]


def test_dflash2_checkpoint_loads_in_the_published_layout_and_decodes_losslessly(target,
                                                                                 tmp_path):
    result = train_dflash2(target, PROMPTS, tmp_path / "run", **SMALL, conv_group_size=8,
                           **_options(steps=3, eval_every=3, eval_max_tokens=8))
    assert result.taus and 1.0 <= result.taus[-1][1] <= 4.0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert {k: config["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size",
                                                    "selector_rank", "selector_top_k")} == \
        {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 8}
    names = set(mx.load(str(tmp_path / "run" / "model.safetensors")))
    assert "candidate_selector.predecessor_codebook" in names
    assert "layers.0.attention_conv.kernel_projection.weight" in names
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in names)
    assert not (tmp_path / "run" / "draft_vocab.json").exists()
    drafter = load_dflash2_drafter(tmp_path / "run", model=target)
    _lossless(target, drafter)


def test_dflash2_training_learns(target, tmp_path):
    result = train_dflash2(target, PROMPTS, tmp_path / "run", **SMALL, conv_group_size=8,
                           **_options(steps=40, save_every=40))
    losses = [loss for _, loss in result.losses]
    assert np.mean(losses[-8:]) < 0.6 * np.mean(losses[:4])


def test_dflash2_starts_from_a_dflash_checkpoint(target, tmp_path):
    """`init` a DFlash checkpoint: its backbone (fc with its feature scale, layers, norms)
    carries over; DFlash2's convolutions and selector start fresh."""
    train_dflash(target, PROMPTS, tmp_path / "dflash", **_options(steps=3))
    train_dflash2(target, PROMPTS, tmp_path / "d2", init=str(tmp_path / "dflash"), **SMALL,
                  conv_group_size=8, **_options(steps=1, lr=1e-12, layers=None))
    before = mx.load(str(tmp_path / "dflash" / "model.safetensors"))
    after = mx.load(str(tmp_path / "d2" / "model.safetensors"))
    assert set(before) < set(after)
    for name, w in before.items():
        assert mx.allclose(w, after[name], atol=1e-5, rtol=1e-4).item(), name
    assert mx.array_equal(after["layers.0.mlp_conv.base_kernel"][:, 0],
                          mx.ones_like(after["layers.0.mlp_conv.base_kernel"][:, 0])).item()
    _lossless(target, load_dflash2_drafter(tmp_path / "d2", model=target))


# ---- DSpark ------------------------------------------------------------------------------------


def _dspark_model(confidence=True, seed=6):
    config = dspark_config(drafter_config(vocab=VOCAB, target_layers=4, target_layer_ids=[1, 3]),
                           markov_rank=8, confidence_head=confidence, anchors=4)
    return _randomised(DSparkModel(DSparkConfig.from_dict(config)), seed)


def test_dspark_training_path_equals_the_forced_walk(target):
    """Each block's slot distributions (head + Markov bias of the true token before) and
    confidences from whole-sequence features equal the drafter's walk in the real loop, forced
    along the same tokens, after committing the tokens up to the anchor."""
    model = _dspark_model()
    head, B = target_head(target), model.args.block_size
    anchors = [0, 3, 6]
    hidden = _block(model, target, TOKENS, anchors)
    tokens = mx.array(TOKENS)
    labels = tokens[mx.array(anchors)[:, None] + mx.arange(1, B + 1)[None]]
    before = mx.concatenate([tokens[mx.array(anchors)][:, None], labels[:, :-1]], axis=1)
    logits = model.compute_logits(hidden, head) + model.markov_head(before)
    features = mx.concatenate([hidden, model.markov_head.markov_w1(before)], axis=-1)
    confidence = mx.sigmoid(model.confidence_head.proj(features)[..., 0])
    drafter = DSparkDrafter(model, **_parts(target))
    for n, a in enumerate(anchors):
        committed = TOKENS[: a + 1]
        drafter.begin(committed, MLXTarget(target, capture_layers=[1, 3]).prefill(committed))
        h = drafter.block_hidden(committed, B - 1)
        _, q, c = model.walk(h, model.compute_logits(h, head), mx.array([TOKENS[a]]), [1.0],
                             forced=labels[n : n + 1])
        assert mx.allclose(q[0], mx.softmax(logits[n], axis=-1), atol=1e-5).item(), a
        assert mx.allclose(c[0], confidence[n], atol=1e-5).item(), a


def test_acceptance_is_the_overlap_of_the_two_distributions():
    p = mx.array([[2.0, 0.0, -1.0, 0.5]])
    same_l1, same = acceptance(p, p)
    assert abs(same_l1.item()) < 1e-6 and abs(same.item() - 1) < 1e-6
    q = mx.array([[0.0, 1.0, 3.0, -2.0]])
    l1, accepted = acceptance(p, q)
    want = np.minimum(np.array(mx.softmax(p)), np.array(mx.softmax(q))).sum()
    assert abs(accepted.item() - want) < 1e-6 and abs(l1.item() - 2 * (1 - want)) < 1e-5


def test_dspark_checkpoint_loads_in_deepspecs_layout_and_decodes_losslessly(target, tmp_path):
    result = train_dspark(target, PROMPTS, tmp_path / "run", markov_rank=8,
                          **_options(steps=3, eval_every=3, eval_max_tokens=8))
    assert result.taus and 1.0 <= result.taus[-1][1] <= 5.0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and "dflash_config" not in config
    assert {k: config[k] for k in ("block_size", "markov_rank", "markov_head_type",
                                   "enable_confidence_head", "confidence_head_with_markov")} == \
        {"block_size": 4, "markov_rank": 8, "markov_head_type": "vanilla",
         "enable_confidence_head": True, "confidence_head_with_markov": True}
    assert config["target_layer_ids"] and "mask_token_id" in config
    names = set(mx.load(str(tmp_path / "run" / "model.safetensors")))
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
            "confidence_head.proj.weight", "confidence_head.proj.bias"} <= names
    drafter = load_dspark_drafter(tmp_path / "run", model=target)
    assert isinstance(drafter.draft_policy(4, True), ScoredDraftLength)  # the head picks K
    _lossless(target, drafter)
    adaptive = load_dspark_drafter(tmp_path / "run", model=target, confidence_k=False)
    assert not isinstance(adaptive.draft_policy(4, True), ScoredDraftLength)
    _lossless(target, adaptive)


def test_dspark_training_learns_and_its_confidence_follows_acceptance(target, tmp_path):
    result = train_dspark(target, PROMPTS, tmp_path / "run", markov_rank=8,
                          **_options(steps=40, save_every=40))
    losses = [loss for _, loss in result.losses]
    assert np.mean(losses[-8:]) < 0.7 * np.mean(losses[:4])


def test_dspark_resume_equals_uninterrupted_run(target, tmp_path):
    options = dict(markov_rank=8, **_options())
    train_dspark(target, PROMPTS, tmp_path / "whole", **options)
    train_dspark(target, PROMPTS, tmp_path / "split", stop_after=3, **options)
    second = train_dspark(target, PROMPTS, tmp_path / "split", resume=True, **options)
    assert [s for s, _ in second.losses] == [4, 5, 6]
    for name in ("model.safetensors", "train_state/optimizer.safetensors"):
        a, b = mx.load(str(tmp_path / "whole" / name)), mx.load(str(tmp_path / "split" / name))
        assert a.keys() == b.keys()
        for k in a:
            assert mx.array_equal(a[k], b[k]).item(), (name, k)


def test_dspark_without_a_confidence_head_keeps_the_adaptive_k(target, tmp_path):
    train_dspark(target, PROMPTS, tmp_path / "run", markov_rank=0, confidence_head=False,
                 **_options(steps=2))
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["markov_rank"] == 0 and config["enable_confidence_head"] is False
    drafter = load_dspark_drafter(tmp_path / "run", model=target)
    assert not isinstance(drafter.draft_policy(4, True), ScoredDraftLength)
    _lossless(target, drafter)


# ---- both, with a loss vocabulary -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dflash2", "dspark"])
def test_a_loss_vocabulary_of_every_token_gives_the_full_loss(target, kind):
    """Rows in another order but every token: the same loss (the selector's successors, the
    Markov rows and the target's distribution all read through the row -> token map)."""
    from mlxspec.training.dflash2_trainer import MLXDFlash2Training
    from mlxspec.training.dspark_trainer import MLXDSparkTraining

    model = _dflash2_model() if kind == "dflash2" else _dspark_model()
    weights = dict(tree_flatten(model.parameters()))
    extra = {"selector_weight": 1.0} if kind == "dflash2" else {
        "loss_weights": dict(ce_weight=0.1, l1_weight=0.9, confidence_weight=1.0)}
    math = MLXDFlash2Training if kind == "dflash2" else MLXDSparkTraining
    losses = []
    for loss_ids in (None, np.random.default_rng(3).permutation(VOCAB).tolist()):
        m = math(target, model.args, weights, schedule=1e-3, weight_decay=0.0, grad_clip=1.0,
                 gamma=4.0, loss_ids=loss_ids, inv_scale=None, model_class=type(model), **extra)
        total, weight, _ = m.sequence_loss(m.features(TOKENS), TOKENS, [1, 4, 7])
        losses.append(total.item() / weight.item())
    assert abs(losses[0] - losses[1]) < 1e-4 * abs(losses[0]), losses


@pytest.mark.parametrize("kind", ["dflash2", "dspark"])
def test_trained_on_a_loss_vocabulary_it_drafts_over_the_full_one(target, tmp_path, kind):
    train = train_dflash2 if kind == "dflash2" else train_dspark
    extra = dict(SMALL, conv_group_size=8) if kind == "dflash2" else dict(markov_rank=8)
    result = train(target, PROMPTS, tmp_path / "run", loss_vocab=12, **extra,
                   **_options(steps=3, eval_every=3, eval_max_tokens=8))
    assert result.loss_vocab_share is not None and result.taus
    assert not (tmp_path / "run" / "draft_vocab.json").exists()
    loader = load_dflash2_drafter if kind == "dflash2" else load_dspark_drafter
    _lossless(target, loader(tmp_path / "run", model=target))


# ---- the CLI -------------------------------------------------------------------------------


def test_cli_refuses_bad_options_in_one_line(tmp_path):
    runner = CliRunner()
    for args, line in [
        (["dflash2", "--selector-weight", "-1"],
         "Error: Invalid value for --selector-weight: must be >= 0, got -1.0"),
        (["dspark", "--markov-rank", "-2"],
         "Error: Invalid value for --markov-rank: must be >= 0, got -2"),
        (["dspark", "--loss-vocab", "0"],
         "Error: Invalid value for --loss-vocab: must be >= 1, got 0"),
        (["dspark", "--ce-weight", "0", "--l1-weight", "0"],  # options together, before loading
         "Error: --ce-weight and --l1-weight cannot both be 0: nothing would train the drafts"),
    ]:
        result = runner.invoke(main, ["train", *args, "--prompts", "sharegpt", "--out",
                                      str(tmp_path / "x")])
        assert result.exit_code != 0
        assert result.output.strip().splitlines()[-1] == line, result.output
        assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("kind,extra,loader", [
    ("dflash2", ["--selector-rank", "8", "--conv-group-size", "8"], load_dflash2_drafter),
    ("dspark", ["--markov-rank", "8"], load_dspark_drafter),
])
def test_cli_trains_a_checkpoint_that_generate_runs(tmp_path, smollm_dir, kind, extra, loader):
    from test_cli import tiny_llama as tiny_llama_dir

    model_dir = tiny_llama_dir(tmp_path / "model", smollm_dir, 49152, layers=2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                               ["Hello there", "Write a poem", "What is 2+2?", "Tell me more"]))
    out = tmp_path / "run"
    runner = CliRunner()
    result = runner.invoke(main, ["train", kind, "-m", str(model_dir), "--prompts", str(prompts),
                                  "--out", str(out), "--steps", "2", "--heldout", "1",
                                  "--max-new-tokens", "8", "--eval-every", "0", "--anchors", "4",
                                  "--block-size", "4", "--loss-vocab", "512", *extra])
    assert result.exit_code == 0, result.output
    assert f"step 2: checkpoint in {out}" in result.output
    assert "never learned (drafting reads the full vocabulary)" in result.output
    plain = runner.invoke(main, ["generate", "-m", str(model_dir), "-p", "Hi", "-n", "12",
                                 "--drafter", "none"])
    spec = runner.invoke(main, ["generate", "-m", str(model_dir), "-p", "Hi", "-n", "12",
                                "--drafter", kind, "--drafter-model", str(out)])
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    first = lambda text: text.strip().splitlines()[0]  # noqa: E731  (the reply, before stats)
    assert first(spec.output) == first(plain.output)
    if kind == "dspark":  # the confidence head's K, or the adaptive one: the same reply
        adaptive = runner.invoke(main, ["generate", "-m", str(model_dir), "-p", "Hi", "-n", "12",
                                        "--drafter", kind, "--drafter-model", str(out),
                                        "--adaptive-k"])
        assert adaptive.exit_code == 0, adaptive.output
        assert first(adaptive.output) == first(plain.output)
