"""DFlash training on tiny random targets: the training path is the inference path, a trained
checkpoint loads and decodes losslessly, resuming is exact, and one batch can be overfit."""

import json
import time

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_dflash import drafter_config, random_weights
from tiny_models import tiny_llama

from mlxspec.drafters.dflash import DFlashDrafter, load_dflash_drafter
from mlxspec.engine import Drafter, SpecStats, speculative_tokens
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.models.dflash import DFlashConfig, DFlashModel
from mlxspec.sampling import SamplingConfig
from mlxspec.backends.mlx.target_parts import target_embedding, target_final_norm, target_head
from mlxspec.training.data import SequenceStore, greedy_response, load_examples, split_heldout
from mlxspec.training.dflash_trainer import (
    block_loss,
    drafter_config_for,
    epoch_order,
    grow_drafter,
    growth_donors,
    init_from_target,
    train_dflash,
    training_logits,
)
from mlxspec.training.features import target_features
from mlxspec.models.dflash import block_mask, training_mask

VOCAB = 32
PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7, 3], [5, 9, 11, 5, 9, 11], [3, 8], [20, 21, 22, 23],
           [30, 2, 14], [6, 6, 1, 2]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=VOCAB, hidden=32, layers=4, seed=1, sharpness=3.0)


def _train(target, out, prompts=PROMPTS, **kw):
    options = dict(layers=1, block_size=4, steps=6, anchors=4, max_new_tokens=12, heldout=1,
                   eval_every=0, save_every=3, progress=False, seed=0, lr=3e-3, warmup=1)
    options.update(kw)
    return train_dflash(target, prompts, out, **options)


def _plain_and_spec(target, drafter, prompt, max_tokens=20):
    outs = []
    for d in (Drafter(), drafter):
        t = MLXTarget(target, capture_layers=d.capture_layers, speculative=True)
        stats = SpecStats()
        outs.append([tok for tok, _ in speculative_tokens(
            t, d, prompt, sampling=SamplingConfig(), max_tokens=max_tokens,
            num_draft=max(d.default_num_draft, 1), stats=stats)])
    return outs


def test_end_to_end_checkpoint_loads_and_decodes_losslessly(target, tmp_path):
    result = _train(target, tmp_path / "run", steps=3, eval_every=3, eval_max_tokens=8)
    assert result.step == 3 and len(result.losses) == 3
    assert result.taus and 1.0 <= result.taus[-1][1] <= 4.0  # measured by the real loop
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    assert sorted(p.name for p in (tmp_path / "run").glob("*.safetensors")) == ["model.safetensors"]
    drafter = load_dflash_drafter(tmp_path / "run", model=target)
    assert drafter.capture_layers == (2,)  # T // 2 for one drafter layer
    for prompt in ([1, 2, 3], [9, 4, 4, 4, 17]):
        plain, spec = _plain_and_spec(target, drafter, prompt)
        assert spec == plain


def test_training_mask_matches_block_mask():
    """Row by row, the training mask is inference's block_mask over the visible context."""
    L, bs = 11, 5
    for causal, window in [(False, None), (True, None), (True, 4), (False, 3)]:
        mask = np.array(training_mask(mx.array([0, 3, 9]), bs, L, causal=causal, window=window))
        for n, a in enumerate([0, 3, 9]):
            assert not mask[n, :, a:L].any()  # nothing at or after the anchor, no other block
            ref = block_mask(a, a, bs, causal=causal, window=window)
            ref = np.ones((bs, a + bs), bool) if ref is None else np.array(ref)
            assert (mask[n, :, :a] == ref[:, :a]).all()
            assert (mask[n, :, L:] == ref[:, a:]).all()


@pytest.mark.parametrize("ids", [[1, 3], [2]])
def test_training_path_equals_inference_path(target, ids):
    """Logits of every block from whole-sequence features + mask equal the drafter's in the
    real loop after committing the tokens up to the anchor (sliding + full layers, last layer)."""
    config = drafter_config(vocab=VOCAB, target_layers=4, target_layer_ids=ids)
    model = DFlashModel(DFlashConfig.from_dict(config))
    model.load_weights(list(random_weights(config, seed=4).items()))
    embed, head = target_embedding(target), target_head(target)
    tokens = [3, 14, 15, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]
    anchors = [0, 1, 5, 8, 12]
    feats = target_features(target, tokens, ids)
    train = training_logits(model, feats, mx.array(tokens), mx.array(anchors),
                            embed_tokens=embed, lm_head=head)
    drafter = DFlashDrafter(model, embed_tokens=embed, lm_head=head,
                            final_norm=target_final_norm(target), target_layers=4)
    for n, a in enumerate(anchors):
        committed = tokens[: a + 1]
        drafter.begin(committed, MLXTarget(target, capture_layers=ids).prefill(committed))
        infer = drafter.block_logits(committed, model.args.block_size - 1)
        assert mx.allclose(train[n], infer, atol=1e-4, rtol=1e-4).item(), (ids, a)


def test_resume_equals_uninterrupted_run(target, tmp_path):
    _train(target, tmp_path / "whole")
    first = _train(target, tmp_path / "split", stop_after=3)
    assert first.step == 3
    with pytest.raises(FileExistsError):
        _train(target, tmp_path / "split")
    second = _train(target, tmp_path / "split", resume=True)
    assert second.step == 6 and [s for s, _ in second.losses] == [4, 5, 6]
    for name in ("model.safetensors", "train_state/params.safetensors",
                 "train_state/optimizer.safetensors"):
        a, b = mx.load(str(tmp_path / "whole" / name)), mx.load(str(tmp_path / "split" / name))
        assert a.keys() == b.keys()
        for k in a:
            assert mx.array_equal(a[k], b[k]).item(), (name, k)
    log = json.loads((tmp_path / "split" / "train_state" / "state.json").read_text())["log"]
    whole = json.loads((tmp_path / "whole" / "train_state" / "state.json").read_text())["log"]
    assert [e["loss"] for e in log] == [e["loss"] for e in whole]


def test_overfit_one_batch(target):
    prompt = [1, 2, 3, 4, 5]
    tokens = prompt + greedy_response(target, prompt, 24, set())
    config = drafter_config_for(target, layers=1, block_size=4, mask_token_id=VOCAB - 1)
    mx.random.seed(0)
    model = DFlashModel(DFlashConfig.from_dict(config))
    init_from_target(model, target)
    ids = model.args.target_layer_ids
    feats = target_features(target, tokens, ids)
    feats = feats / mx.sqrt((feats**2).mean(axis=0))
    anchors = mx.arange(len(prompt) - 1, len(tokens) - 1)
    embed, head = target_embedding(target), target_head(target)
    tokens = mx.array(tokens)

    def loss_fn():
        total, weight, _ = block_loss(model, feats, tokens, anchors, embed_tokens=embed,
                                      lm_head=head, gamma=4.0)
        return total / weight

    import mlx.nn as nn

    grad_fn = nn.value_and_grad(model, loss_fn)
    opt = optim.AdamW(3e-3, weight_decay=0.0)
    losses = []
    for _ in range(50):
        loss, grads = grad_fn()
        opt.update(model, grads)
        mx.eval(loss, model.parameters(), opt.state)
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0], losses[::10]


def test_resume_keeps_the_runs_gamma_unless_told(target, tmp_path):
    whole = _train(target, tmp_path / "whole", gamma=2.0)
    _train(target, tmp_path / "split", gamma=2.0, stop_after=3)
    split = _train(target, tmp_path / "split", resume=True)
    assert [l for _, l in split.losses] == [l for _, l in whole.losses][3:]
    _train(target, tmp_path / "split", steps=8, resume=True, gamma=5.0)
    state = json.loads((tmp_path / "split" / "train_state" / "state.json").read_text())
    assert state["gamma"] == 5.0


def test_sequence_store_resumes_and_reloads(target, tmp_path):
    examples = load_examples(PROMPTS)
    store = SequenceStore(tmp_path / "s", meta={"x": 1}, shard_size=3)
    for p, _ in examples[:4]:
        store.append(p + [1, 2], len(p))
    store.flush()
    again = SequenceStore(tmp_path / "s", meta={"x": 1})
    assert len(again) == 4 and again[3] == (PROMPTS[3] + [1, 2], len(PROMPTS[3]))
    for p, _ in examples[4:]:
        again.append(p, len(p))
    again.flush()
    third = SequenceStore(tmp_path / "s", meta={"x": 1})
    assert [third[i][0][: len(p)] for i, p in enumerate(PROMPTS)] == PROMPTS
    assert len(third.shards) == 3
    with pytest.raises(ValueError, match="different settings"):
        SequenceStore(tmp_path / "s", meta={"x": 2})
    train, held = split_heldout(list(range(10)), 2, seed=0)
    assert len(train) == 8 and len(held) == 2 and not set(train) & set(held)


def test_split_survives_a_growing_prompt_list():
    small_train, small_held = split_heldout(list(range(40)), 4, seed=0)
    big_train, big_held = split_heldout(list(range(400)), 4, seed=0)
    assert small_held == big_held and big_train[: len(small_train)] == small_train


def test_epoch_order_keeps_its_promise_when_the_store_grows():
    before = epoch_order(0, 3, [40])
    grown = epoch_order(0, 3, [40, 100])
    assert sorted(before.tolist()) == list(range(40))
    assert grown[:40].tolist() == before.tolist() and sorted(grown.tolist()) == list(range(100))
    assert epoch_order(0, 4, [40]).tolist() != before.tolist()


def test_resume_on_a_grown_store_visits_each_sequence_once(target, tmp_path):
    first = _train(target, tmp_path / "run", prompts=PROMPTS[:5], steps=6, stop_after=2)
    assert first.step == 2
    _train(target, tmp_path / "run", steps=6, resume=True)
    state = json.loads((tmp_path / "run" / "train_state" / "state.json").read_text())
    visited = [i for entry in state["log"] for i in entry["sequences"]]
    assert sorted(visited) == list(range(6))  # 4 sequences, then 6 once the store grew
    assert state["epoch"] == 1 and state["cursor"] == 0 and state["epoch_sizes"] == [6]


def test_batched_greedy_responses_equal_single_stream(target):
    from mlxspec.training.data import greedy_responses

    eos = {3}
    single = [greedy_response(target, p, 10, eos) for p in PROMPTS]
    assert greedy_responses(target, PROMPTS, 10, eos, batch_size=3) == single


def test_answer_share():
    from mlxspec.training.dflash_trainer import answer_share

    seqs = [([9, 9, 1, 1, 1, 2, 2, 5], 2), ([9, 4, 1, 2], 1)]  # answers: 1 1 1 2 2 5 | 4 1 2
    assert answer_share(seqs, [1, 2], VOCAB) == pytest.approx(7 / 9)
    assert answer_share(seqs, [31], VOCAB) == 0.0
    assert answer_share(seqs, [1, 2, 4, 5], VOCAB) == 1.0


def test_reduced_loss_vocabulary(target):
    """The loss vocabulary is the most frequent response tokens plus the end tokens; labels
    outside it carry no weight, labels inside get the full head's logits restricted to it."""
    from mlxspec.training.dflash_trainer import SubsetHead, frequent_tokens

    seqs = [([9, 9, 1, 1, 1, 2, 2, 5], 2), ([9, 4, 1, 2], 1)]  # responses: 1 x4, 2 x3, 5, 4
    assert frequent_tokens(seqs, VOCAB, 2, always=[31]) == [1, 2, 31]
    head = target_head(target)
    sub = SubsetHead(head, [1, 2, 31], VOCAB)
    h = mx.random.normal((3, 32))
    assert mx.allclose(sub(h), head(h)[:, mx.array([1, 2, 31])], atol=1e-5)
    assert sub.label_map[mx.array([1, 2, 31, 5])].tolist() == [0, 1, 2, -1]
    config = drafter_config_for(target, layers=1, block_size=4, mask_token_id=VOCAB - 1)
    model = DFlashModel(DFlashConfig.from_dict(config))
    tokens = mx.array([1, 2, 1, 5, 2, 1, 1, 2], dtype=mx.int32)
    feats = target_features(target, tokens.tolist(), model.args.target_layer_ids)
    anchors = mx.array([1, 2, 3], dtype=mx.int32)
    kw = dict(embed_tokens=target_embedding(target), gamma=7.0)
    _, full_weight, _ = block_loss(model, feats, tokens, anchors, lm_head=head, **kw)
    _, sub_weight, _ = block_loss(model, feats, tokens, anchors, lm_head=sub, **kw)
    # labels at positions 2..6; the single 5 (position 3) is seen by anchors 1 and 2
    decay = np.exp(-np.arange(3) / 7.0)
    assert abs(float(full_weight) - float(sub_weight) - (decay[1] + decay[0])) < 1e-5


def test_packaged_drafter_is_found_for_its_target_only(target, tmp_path, monkeypatch):
    """package_drafter writes a bf16 drafter + target.json; `load_drafter("dflash")` without a
    path finds it for that target (and decodes losslessly), and refuses a same-shaped other."""
    import mlxspec
    import mlxspec.drafters.shipped as shipped_module
    from mlxspec.training.dflash_trainer import package_drafter

    _train(target, tmp_path / "run", steps=2)
    dest = package_drafter(tmp_path / "run", tmp_path / "trained" / "tiny", target)
    assert mx.load(str(dest / "model.safetensors"))["fc.weight"].dtype == mx.bfloat16
    monkeypatch.setattr(shipped_module, "TRAINED_DIR", tmp_path / "trained")
    drafter = mlxspec.load_drafter("dflash", model=target, tokenizer=None)
    assert drafter.model.fc.weight.dtype == mx.float32  # cast to the target's dtype
    plain, spec = _plain_and_spec(target, drafter, [1, 2, 3])
    assert spec == plain
    other = tiny_llama(vocab=VOCAB, hidden=32, layers=4, seed=7, sharpness=3.0)
    with pytest.raises(ValueError, match="ships one only"):
        mlxspec.load_drafter("dflash", model=other, tokenizer=None)


def test_loss_vocabulary_becomes_the_draft_vocabulary(target, tmp_path):
    """A run with a loss vocabulary writes it as the checkpoint's draft vocabulary (the rows the
    drafter learned to rank), measures τ drafting from it, and packaging carries it; a run
    without one leaves none behind."""
    from mlxspec.training.dflash_trainer import package_drafter

    result = _train(target, tmp_path / "run", steps=2, loss_vocab=8, eval_every=2,
                    eval_max_tokens=8)
    loss_ids = mx.load(str(tmp_path / "run" / "train_state" / "loss_vocab.safetensors"))["ids"]
    drafter = load_dflash_drafter(tmp_path / "run", model=target)
    assert drafter.draft_ids.tolist() == loss_ids.tolist() and len(loss_ids) >= 8
    assert result.taus and 1.0 <= result.taus[-1][1]
    store = SequenceStore(tmp_path / "run" / "data")
    answers = [t for i in range(len(store)) for t in store[i][0][store[i][1]:]]
    share = sum(t in set(loss_ids.tolist()) for t in answers) / len(answers)
    assert 0 < share < 1 and result.loss_vocab_share == pytest.approx(share)
    for prompt in ([1, 2, 3], [9, 4, 4, 4, 17]):
        plain, spec = _plain_and_spec(target, drafter, prompt)
        assert spec == plain
    dest = package_drafter(tmp_path / "run", tmp_path / "trained", target)
    assert load_dflash_drafter(dest, model=target).draft_ids.tolist() == loss_ids.tolist()
    _train(target, tmp_path / "full", steps=1)
    assert not (tmp_path / "full" / "draft_vocab.json").exists()
    package_drafter(tmp_path / "full", dest, target)
    assert load_dflash_drafter(dest, model=target).draft_ids is None


def test_training_continues_from_a_checkpoint(target, tmp_path):
    """--init DIR starts from a trained drafter (its config, its weights with the feature scale
    unfolded): before any step the new run's checkpoint is the old one."""
    _train(target, tmp_path / "first", steps=3)
    _train(target, tmp_path / "second", steps=3, stop_after=0, init=str(tmp_path / "first"))
    a = mx.load(str(tmp_path / "first" / "model.safetensors"))
    b = mx.load(str(tmp_path / "second" / "model.safetensors"))
    assert set(a) == set(b) and max(float(mx.abs(a[k] - b[k]).max()) for k in a) < 1e-5
    with pytest.raises(ValueError, match="checkpoint directory"):
        _train(target, tmp_path / "third", init=str(tmp_path / "nothing"))


def _drafter_outputs(config, weights, features, block):
    model = DFlashModel(DFlashConfig.from_dict(config))
    model.load_weights(list(weights.items()))
    cache = model.make_cache()
    model.append_context(features, cache)
    return model(block, cache)


def test_grown_drafter_drafts_as_before_until_trained():
    """Appended layers start as the identity (output projections zeroed): the grown drafter's
    block outputs equal the original's; once a new layer's output projection moves, they
    differ (the new layer is in the path)."""
    config = drafter_config(num_hidden_layers=1, layer_types=["sliding_attention"])
    weights = random_weights(config, seed=4)
    grown_config, grown = grow_drafter(config, weights, 3)
    assert grown_config["num_hidden_layers"] == 3 and len(grown_config["layer_types"]) == 3
    assert config["num_hidden_layers"] == 1  # the caller's config is left alone
    assert float(mx.abs(grown["layers.2.self_attn.q_proj.weight"]
                        - weights["layers.0.self_attn.q_proj.weight"]).max()) == 0
    features = mx.random.normal((7, 2 * 32), key=mx.random.key(1))
    block = mx.random.normal((1, 6, 32), key=mx.random.key(2))
    before = _drafter_outputs(config, weights, features, block)
    after = _drafter_outputs(grown_config, grown, features, block)
    assert float(mx.abs(before - after).max()) < 1e-6
    grown["layers.1.self_attn.o_proj.weight"] = weights["layers.0.self_attn.o_proj.weight"]
    moved = _drafter_outputs(grown_config, grown, features, block)
    assert float(mx.abs(before - moved).max()) > 1e-3
    with pytest.raises(ValueError, match="not removed"):
        grow_drafter(grown_config, grown, 2)


def test_grown_layers_start_from_target_layers_below_the_last(target):
    """With donors (what training passes: target layer T-1-i for new layer i) a new layer takes
    the target layer's weights where they fit, output projections still zeroed, so it still
    drafts as before (a copy of the trained layer would compute what that layer already
    feeds the stream)."""
    config = drafter_config(num_hidden_layers=1, layer_types=["full_attention"], vocab=VOCAB)
    weights = random_weights(config, seed=5)
    donors = growth_donors(target, 1, 3)
    t_layers = [dict(tree_flatten(layer.parameters())) for layer in target.model.layers]
    assert len(donors) == 2
    assert mx.array_equal(donors[0]["self_attn.q_proj.weight"], t_layers[2]["self_attn.q_proj.weight"])
    assert mx.array_equal(donors[1]["self_attn.q_proj.weight"], t_layers[1]["self_attn.q_proj.weight"])
    grown_config, grown = grow_drafter(config, weights, 3, donors)
    for i, t in ((1, 2), (2, 1)):
        for name in ("self_attn.q_proj.weight", "self_attn.v_proj.weight", "mlp.up_proj.weight",
                     "input_layernorm.weight"):
            assert mx.array_equal(grown[f"layers.{i}.{name}"], t_layers[t][name]), (i, name)
        assert float(mx.abs(grown[f"layers.{i}.self_attn.o_proj.weight"]).max()) == 0
    # names the target's layers lack (Qwen3's q_norm) come from the drafter's last layer
    assert mx.array_equal(grown["layers.1.self_attn.q_norm.weight"],
                          weights["layers.0.self_attn.q_norm.weight"])
    features = mx.random.normal((7, 2 * 32), key=mx.random.key(1))
    block = mx.random.normal((1, 6, 32), key=mx.random.key(2))
    assert float(mx.abs(_drafter_outputs(config, weights, features, block)
                        - _drafter_outputs(grown_config, grown, features, block)).max()) < 1e-6


def test_time_budget_stops_saved_and_resumes_as_one_run(target, tmp_path):
    """minutes= (a machine lent for a fixed time): the run stops after the step that ends past
    the budget, saved though not at a save_every step, on the full schedule; resumed, it ends
    where an uninterrupted run does. A budget that is not positive is refused before any work."""
    _train(target, tmp_path / "whole")
    first = _train(target, tmp_path / "split", minutes=1e-9)  # out of time after one step
    assert first.step == 1
    state = json.loads((tmp_path / "split" / "train_state" / "state.json").read_text())
    assert state["step"] == 1 and state["steps"] == 6
    second = _train(target, tmp_path / "split", resume=True)
    assert second.step == 6 and [s for s, _ in second.losses] == [2, 3, 4, 5, 6]
    a = mx.load(str(tmp_path / "whole" / "model.safetensors"))
    b = mx.load(str(tmp_path / "split" / "model.safetensors"))
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    with pytest.raises(ValueError, match="minutes"):
        _train(target, tmp_path / "refused", minutes=0)
    assert not (tmp_path / "refused").exists()


def test_time_budget_without_steps_fits_the_schedule(target, tmp_path):
    """minutes= and no steps: the warmup steps are timed, the cosine is fitted into the time
    left (the state records the fitted length), and a resume without steps keeps that length
    and ends there."""
    from mlxspec.training.dflash_trainer import FIT_HORIZON

    started = time.monotonic()
    first = _train(target, tmp_path / "run", steps=None, minutes=0.05, warmup=3)
    elapsed = time.monotonic() - started
    fitted = json.loads((tmp_path / "run" / "train_state" / "state.json").read_text())["steps"]
    assert 4 < fitted < FIT_HORIZON and 4 <= first.step <= fitted
    assert elapsed < 60  # the budget (3 s) and one run's set-up, not the provisional schedule
    resumed = _train(target, tmp_path / "run", steps=None, resume=True)
    assert resumed.step == fitted
    short = _train(target, tmp_path / "short", steps=None, minutes=1e-9, warmup=3)
    state = json.loads((tmp_path / "short" / "train_state" / "state.json").read_text())
    assert short.step == state["steps"] == 1  # out of time in the warmup: the schedule ends there


def test_a_run_resumed_with_more_layers_grows_its_drafter(target, tmp_path):
    """--resume --layers 2 on a one-layer run: same log, data cursor and schedule, a two-layer
    checkpoint that decodes losslessly; fewer layers than the run has is refused before any
    work."""
    run = tmp_path / "run"
    _train(target, run, steps=6, stop_after=3)
    grown = _train(target, run, steps=6, resume=True, layers=2)
    assert grown.step == 6
    state = json.loads((run / "train_state" / "state.json").read_text())
    assert [e["step"] for e in state["log"]] == [1, 2, 3, 4, 5, 6]
    assert json.loads((run / "config.json").read_text())["num_hidden_layers"] == 2
    weights = mx.load(str(run / "model.safetensors"))
    assert float(mx.abs(weights["layers.1.self_attn.o_proj.weight"]).max()) > 0  # it trained
    drafter = load_dflash_drafter(run, model=target)
    for prompt in ([1, 2, 3], [9, 4, 4, 4, 17]):
        plain, spec = _plain_and_spec(target, drafter, prompt)
        assert spec == plain
    with pytest.raises(ValueError, match="not removed"):
        _train(target, run, steps=8, resume=True, layers=1)
    assert json.loads((run / "train_state" / "state.json").read_text())["step"] == 6
    assert _train(target, run, steps=7, resume=True, layers=None).step == 7  # keeps its 2


def test_target_labels_are_the_targets_own_predictions(target, tmp_path):
    """labels="target": position j learns the target's greedy prediction after positions < j.
    On text the target did not write they differ from the text (checked against the target run
    on each prefix); on the target's own greedy answer they are the answer, so a run with either
    labels is the same run."""
    from mlxspec.training.dflash_trainer import MLXDFlashTraining, _schedule

    config = DFlashConfig.from_dict(drafter_config_for(target, layers=1, block_size=4,
                                                       mask_token_id=VOCAB - 1))
    model = DFlashModel(config)
    math = MLXDFlashTraining(target, config, dict(tree_flatten(model.parameters())),
                             schedule=_schedule(1e-3, 1, 2), weight_decay=0.0, grad_clip=0.0,
                             gamma=4.0, loss_ids=None, inv_scale=None, labels="target")
    text = [int(t) for t in np.random.default_rng(3).integers(0, VOCAB, 20)]
    feats, labels = math.features(text)
    labels = labels.tolist()
    assert feats.shape[0] == len(text) and len(labels) == len(text)
    for j in range(1, len(text)):
        assert labels[j] == int(mx.argmax(target(mx.array([text[:j]]))[0, -1]))
    assert labels[1:] != text[1:]

    prompt = [1, 2, 3, 4, 5]
    answer = greedy_response(target, prompt, 16, set())
    assert math.features(prompt + answer)[1].tolist()[len(prompt):] == answer

    by_text = _train(target, tmp_path / "text", steps=3)
    by_target = _train(target, tmp_path / "target", steps=3, labels="target")
    assert np.allclose([l for _, l in by_text.losses], [l for _, l in by_target.losses],
                       atol=1e-6)
    with pytest.raises(ValueError, match="same labels"):
        _train(target, tmp_path / "target", steps=4, resume=True)


def test_bad_training_options_fail_before_any_work(tmp_path):
    """Checked before the target is resolved or data is made (target=None would load SmolLM2)."""
    for options, message in ((dict(stop_after=7), "stop_after must be within 0..steps"),
                             (dict(labels="gold"), "labels must be"),
                             (dict(gamma=0.0), "gamma .* must be > 0"),
                             (dict(layers=0), "layers must be >= 1"),
                             (dict(backend="jax"), "backend must be")):
        with pytest.raises(ValueError, match=message):
            train_dflash(None, PROMPTS, tmp_path / "run", steps=6, progress=False, **options)
    assert not (tmp_path / "run").exists()
