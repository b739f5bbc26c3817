"""EAGLE-3 drafters: both published layouts, parity with two implementations nobody here wrote,
the chain drafter lossless in the shared loop, and one-line refusals.

scripts/make_eagle3_fixtures.py wrote three tiny random drafters for the random qwen3_5 target of
tests/fixtures/mlx_vlm_hybrid (hidden 32, 4 layers, 96 tokens) and recorded, in separate venvs:
  mlx-vlm 0.7.10: its Eagle3DraftModel driven as its round loop drives it (prefill from target
    features, draft_block, accept_verified_tokens with scripted verdicts): every committed
    forward's hidden states, every chain step's draft logits, its drafts; and its own
    speculative generate_step on the target (tokens, drafted/accepted per round).
  speculators 0.9.0: its Eagle3DraftModel.from_pretrained on the same directory, forward() with
    3 test-time-training steps: the draft logits of every position at every step.
Ours reads the same files unchanged and must compute the same numbers.
"""

import json
import shutil
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlxspec.models.eagle3 import Eagle3Config, Eagle3Model
from test_sampling_exactness import (
    LENGTH,
    PROMPT,
    SAMPLES,
    SAMPLING,
    VOCAB,
    chi_squared_pvalue,
    exact_distribution,
)
from tiny_models import tiny_llama

import mlxspec
from mlxspec.drafters.eagle3 import Eagle3Drafter, load_eagle3_drafter
from mlxspec.drafters.eagle3_loading import (
    check_checkpoint,
    load_eagle3_model,
    read_config,
)
from mlxspec.engine import Drafter, SpecStats, Verdict, speculative_tokens
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.sampling import SamplingConfig

FIXTURES = Path(__file__).parent / "fixtures" / "eagle3"
TARGET = Path(__file__).parent / "fixtures" / "mlx_vlm_hybrid" / "target"
REFERENCE = json.loads((FIXTURES / "reference.json").read_text())
MLX_VLM = [n for n, d in REFERENCE["drafters"].items() if d.get("rounds")]  # what it could run
SPECULATORS = ["speculators", "speculators_qwen3"]
GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def target():
    model, _ = mlxspec.load(TARGET)
    return model


@pytest.fixture(scope="module")
def mlx_vlm_tensors():
    return mx.load(str(FIXTURES / "reference.safetensors"))


@pytest.fixture(scope="module")
def inputs():
    return mx.load(str(FIXTURES / "inputs.safetensors"))


def test_fixtures_are_what_the_peers_produced():
    assert REFERENCE["made_with"]["mlx_vlm"] == "0.7.10"
    assert MLX_VLM == ["speculators", "specforge"]
    # mlx-vlm has no q_norm/k_norm: the qwen3-layer drafter is checked against speculators only.
    assert "q_norm" in REFERENCE["drafters"]["speculators_qwen3"]["why"]
    for name in MLX_VLM:
        cases = REFERENCE["drafters"][name]["generate"]
        for case in cases:  # mlx-vlm's speculative tokens are its plain ones
            assert case["speculative"] == case["plain"]
        accepted = [a for c in cases for a in c["accept_lens"]]
        assert 0 < sum(accepted) and 0 in accepted  # drafts accepted and rolled back
    metadata = mx.load(str(FIXTURES / "reference_speculators.safetensors"), return_metadata=True)[1]
    assert json.loads(metadata["made_with"])["transformers"].startswith("5.")


def test_config_reads_both_layouts_into_one_form():
    spec, forge, qwen = (read_config(FIXTURES / n) for n in
                         ("speculators", "specforge", "speculators_qwen3"))
    assert (spec.layout, forge.layout) == ("speculators", "specforge")
    assert (spec.hidden_size, spec.target_hidden_size) == (32, 32)
    assert (forge.hidden_size, forge.target_hidden_size) == (48, 32)
    assert spec.draft_vocab_size == forge.draft_vocab_size == 48
    assert spec.vocab_size == forge.vocab_size == 96
    # Different counting, the same target layers: speculators [1, 2, 4] are hidden states,
    # SpecForge's eagle_config [0, 1, 3] are layer outputs.
    assert spec.aux_layer_ids == [1, 2, 4] and forge.aux_layer_ids == [0, 1, 3]
    assert spec.capture_layers(4) == forge.capture_layers(4) == (0, 1, 3)
    assert qwen.aux_layer_ids is None and qwen.capture_layers(4) == (1, 1, 0)  # [2, L/2, L-3]
    assert qwen.capture_layers(32) == (1, 15, 28)
    assert (spec.norm_before_residual, spec.norm_before_fc) == (True, True)
    assert (forge.norm_before_residual, forge.norm_before_fc) == (False, False)
    assert [c.rope["rope_theta"] for c in (spec, forge, qwen)] == [50000.0, 10000.0, 20000.0]
    assert (spec.qk_norm, qwen.qk_norm) == (False, True)
    assert spec.num_speculative_tokens == 3 and forge.num_speculative_tokens is None


def session_drafter(name, target):
    return load_eagle3_drafter(FIXTURES / name, model=target)


@pytest.mark.parametrize("name", MLX_VLM)
def test_logits_equal_mlx_vlm_step_by_step(name, target, mlx_vlm_tensors, inputs):
    """mlx-vlm's prefill, chain steps (fed its own drafts) and verdicts, replayed through our
    drafter's begin / propose / commit: same hidden states, same logits, same drafts."""
    ref, record = mlx_vlm_tensors, REFERENCE["drafters"][name]
    drafter = session_drafter(name, target)
    assert drafter.capture_layers == tuple(record["capture_layer_ids"]) == (0, 1, 3)
    tokens = inputs["prompt"].tolist()
    drafter.begin(tokens, inputs["features_prefill"])
    close = lambda a, b: mx.allclose(a, b, rtol=1e-5, atol=1e-5).item()
    assert close(drafter._hidden[-1], ref[f"{name}.committed0.hidden"])
    # Every prefill position ranks the token two ahead, as mlx-vlm's head does.
    assert close(drafter.model.logits(drafter._hidden[-1]), ref[f"{name}.prefill.logits"])
    verdict_features = [inputs["features_round1"], inputs["features_round2"]]
    for r, rnd in enumerate(record["rounds"]):
        k = rnd["block"] - 1
        logits = mx.stack(drafter.chain_logits(tokens, k, draft_ids=rnd["drafts"]))
        assert close(logits, ref[f"{name}.round{r}.logits"]), r
        assert rnd["min_top2_margin"] > 1e-3  # so equal drafts are not luck
        assert drafter.propose(tokens, k, GREEDY).tokens.tolist() == rnd["drafts"]
        if "accepted" in rnd:
            a = rnd["accepted"]
            verdict = Verdict(rnd["drafts"], a, rnd["next_token"],
                              features=verdict_features[r][: a + 1])
            tokens = tokens + verdict.committed
            drafter.commit(tokens, verdict)
            drafter._flush()  # committed pairs run when the drafter next drafts; now, to compare
            assert close(drafter._hidden[-1], ref[f"{name}.committed{r + 1}.hidden"]), r


@pytest.mark.parametrize("name", SPECULATORS)
def test_logits_equal_speculators_test_time_training_steps(name, target, inputs):
    """speculators' TTT step s at position q is our chain from q, step s, fed the tokens it
    teacher-forces (the prompt's next ones, 0 past its end)."""
    ref = mx.load(str(FIXTURES / "reference_speculators.safetensors"))
    drafter = session_drafter(name, target)
    prompt, features = inputs["prompt"].tolist(), inputs["features_prefill"]
    T = features.shape[0]
    drafter.begin(prompt, features)
    ours = drafter.model.logits(drafter._hidden[-1])
    assert mx.allclose(ours, ref[f"{name}.ttt0.logits"], atol=2e-5).item()
    padded = prompt + [0] * 3
    for q in range(T):
        drafter.begin(prompt[: q + 2], features[: q + 1])
        chain = drafter.chain_logits(prompt[: q + 2], 3, draft_ids=padded[q + 2 : q + 4])
        for step in (1, 2):
            theirs = ref[f"{name}.ttt{step}.logits"][q]
            assert mx.allclose(chain[step], theirs, atol=2e-5).item(), (q, step)


@pytest.mark.parametrize("name", MLX_VLM)
def test_d2t_maps_draft_rows_to_target_ids(name, target):
    drafter = session_drafter(name, target)
    weights = mx.load(str(FIXTURES / name / "model.safetensors"))
    in_draft_vocab = np.flatnonzero(np.array(weights["t2d"]))  # the checkpoint's own t2d
    assert drafter.hot_ids.tolist() == in_draft_vocab.tolist()
    assert drafter.hot_ids.tolist() == (np.arange(48) + np.array(weights["d2t"])).tolist()
    # Sampled drafts report p over the target's vocabulary, zero outside the draft vocabulary.
    features = mx.random.normal((5, 96), key=mx.random.key(0))
    drafter.begin([1, 2, 3, 4, 5, 6], features)
    draft = drafter.propose([1, 2, 3, 4, 5, 6], 3, SamplingConfig(temp=1.0))
    p = np.array(draft.probs)
    assert p.shape == (3, 96) and np.allclose(p.sum(axis=1), 1, atol=1e-5)
    outside = np.setdiff1d(np.arange(96), in_draft_vocab)
    assert (p[:, outside] == 0).all()
    assert set(draft.tokens.tolist()) <= set(in_draft_vocab.tolist())
    first = mx.softmax(drafter.chain_logits([1, 2, 3, 4, 5, 6], 1)[0], axis=-1)
    assert np.allclose(p[0, in_draft_vocab], np.array(first), atol=1e-6)


def run(model, drafter, prompt, *, max_tokens, k, sampling=GREEDY, commit_log=None):
    if commit_log is not None:
        commit = drafter.commit

        def logged(tokens, verdict):
            commit_log.append((len(verdict.draft_tokens), verdict.accepted))
            commit(tokens, verdict)

        drafter.commit = logged
    target = MLXTarget(model, capture_layers=drafter.capture_layers, speculative=True)
    stats = SpecStats()
    out = speculative_tokens(target, drafter, prompt, sampling=sampling, max_tokens=max_tokens,
                             num_draft=k, stats=stats)
    return [t for t, _ in out], stats


@pytest.mark.parametrize("name", MLX_VLM)
@pytest.mark.parametrize("case", [0, 1])
def test_generation_accepts_what_mlx_vlm_accepted(name, case, target):
    """mlx-vlm's speculative generate_step and our loop on the same target and drafter: the same
    tokens (its plain ones) and, round by round, the same drafted and accepted counts, which
    checks the drafter's cache after every rollback. mlx-vlm's first token comes from its prefill,
    so ours starts from the prompt plus that token; our loop drafts one token less near the end
    and adds one plain step past mlx-vlm's output (as tests/test_mlx_vlm_parity.py explains)."""
    record = REFERENCE["drafters"][name]["generate"][case]
    max_tokens = REFERENCE["max_tokens"]
    drafter = session_drafter(name, target)
    first, rest = record["speculative"][0], record["speculative"][1:]
    rounds = []
    produced, stats = run(target, drafter, record["prompt"] + [first], max_tokens=max_tokens,
                          k=REFERENCE["block"] - 1, commit_log=rounds)
    assert produced[: len(rest)] == rest
    theirs = list(zip(record["draft_lens"], record["accept_lens"]))
    assert rounds[: len(theirs)] == theirs
    assert all(drafted == 0 for drafted, _ in rounds[len(theirs):])
    assert stats.accepted == sum(record["accept_lens"])


# ---- The chain drafter on tiny llama targets ---------------------------------------------------


def drafter_config(*, vocab, draft_vocab, hidden=32, target_hidden=32, ids=(1, 2, 4)) -> dict:
    """A speculators-layout config.json, small enough for a test."""
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {
            "model_type": "llama", "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "rms_norm_eps": 1e-5, "vocab_size": vocab,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": target_hidden,
        "eagle_aux_hidden_state_layer_ids": list(ids),
        "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": 4}]},
    }


def make_drafter_dir(path: Path, *, vocab, draft_ids, seed=0, own_embed=False, **options):
    config = drafter_config(vocab=vocab, draft_vocab=len(draft_ids), **options)
    args = Eagle3Config.from_dict(config)
    rng = np.random.default_rng(seed)
    model = Eagle3Model(args, own_embed=own_embed, own_head=True)
    weights = {}
    for name, p in sorted(tree_flatten(model.parameters())):
        shape = tuple(p.shape)
        noise = rng.standard_normal(shape).astype(np.float32)
        w = 1 + 0.1 * noise if name.endswith("norm.weight") else noise * shape[-1] ** -0.5
        weights[name] = mx.array(w.astype(np.float32))
    weights["d2t"] = mx.array(np.array(draft_ids) - np.arange(len(draft_ids)))
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(vocab=12, hidden=32, layers=4, seed=1, sharpness=3.0)


@pytest.fixture(scope="module")
def llama_drafter_dir(tmp_path_factory):
    return make_drafter_dir(tmp_path_factory.mktemp("eagle3"), vocab=12,
                            draft_ids=[0, 1, 2, 3, 5, 8, 10, 11], seed=3)


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7, 7], [5, 9, 11, 5, 9, 11, 5, 9, 2, 3, 4, 6], [3]]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_output_equals_plain_decoding(llama, llama_drafter_dir, prompt, k):
    plain, _ = run(llama, Drafter(), prompt, max_tokens=24, k=k)
    drafter = load_eagle3_drafter(llama_drafter_dir, model=llama)
    assert drafter.default_num_draft == 4  # speculators_config's speculative_tokens
    out, stats = run(llama, drafter, prompt, max_tokens=24, k=k)
    assert out == plain
    assert stats.accepted + stats.target_passes == stats.generated == 24


def test_drafts_are_lazy_target_ids(llama, llama_drafter_dir):
    drafter = load_eagle3_drafter(llama_drafter_dir, model=llama)
    features = MLXTarget(llama, capture_layers=drafter.capture_layers).prefill([1, 2, 3, 4])
    drafter.begin([1, 2, 3, 4], features)
    draft = drafter.propose([1, 2, 3, 4], 5, GREEDY)
    assert isinstance(draft.tokens, mx.array) and draft.probs is None and len(draft) == 5
    assert set(draft.tokens.tolist()) <= {0, 1, 2, 3, 5, 8, 10, 11}
    assert drafter.cache[0].offset == 3 + 4  # the pairs, then 4 chain steps
    drafter.begin([1], mx.zeros((0, 0)))  # a one-token prompt: no pair, no draft
    assert len(drafter.propose([1], 3, GREEDY)) == 0


def test_cache_after_generation_equals_fresh_build(llama, llama_drafter_dir):
    drafter = load_eagle3_drafter(llama_drafter_dir, model=llama)
    for p in PROMPTS[1:]:  # earlier sequences must leave no trace after begin()
        run(llama, drafter, p, max_tokens=20, k=3)
    out, _ = run(llama, drafter, PROMPTS[0], max_tokens=30, k=3)
    committed = PROMPTS[0] + out
    assert drafter.context_length == len(committed) - 1
    fresh_features = MLXTarget(llama, capture_layers=drafter.capture_layers).prefill(committed)
    fresh = load_eagle3_drafter(llama_drafter_dir, model=llama)
    fresh.begin(committed, fresh_features)
    drafter._rewind(len(committed) - 1)  # as the next proposal does: deferred pairs run
    for ours, theirs in zip(drafter.cache[0].keys_and_values(), fresh.cache[0].keys_and_values()):
        assert ours.shape == theirs.shape
        assert mx.allclose(ours, theirs, atol=1e-4).item()
    assert mx.allclose(drafter._hidden[-1][-1], fresh._hidden[-1][-1], atol=1e-4).item()


def test_plain_steps_pairs_run_at_the_next_draft_in_one_pass(llama, llama_drafter_dir):
    """Steps that draft nothing (an adaptive K at 0) leave the drafter idle: their pairs run
    when it next drafts, in one pass, and draft what running each at once drafts."""
    sequence = PROMPTS[2]
    drafter = load_eagle3_drafter(llama_drafter_dir, model=llama)
    features = MLXTarget(llama, capture_layers=drafter.capture_layers).prefill(sequence)
    passes = []
    extend = drafter._extend
    drafter._extend = lambda ids, f: passes.append(ids.shape[1]) or extend(ids, f)
    drafter.begin(sequence[:4], features[:3])
    for i in range(4, len(sequence)):  # one plain step per token: no draft, one pair each
        drafter.commit(sequence[: i + 1], Verdict([], 0, sequence[i], features=features[i - 1 : i]))
    assert passes == [3] and drafter.context_length == len(sequence) - 1  # nothing ran yet
    ours = mx.stack(drafter.chain_logits(sequence, 3))
    assert passes == [3, len(sequence) - 4]  # the plain steps' pairs, in one pass
    fresh = load_eagle3_drafter(llama_drafter_dir, model=llama)
    fresh.begin(sequence, features)
    assert mx.allclose(ours, mx.stack(fresh.chain_logits(sequence, 3)), atol=1e-4).item()
    for _ in range(drafter.deferred_limit):  # a long run of them pays as it goes
        drafter.commit(sequence, Verdict([], 0, sequence[-1], features=features[-1:]))
    assert passes[-1] == drafter.deferred_limit and not drafter._deferred


def test_rolled_back_tokens_trim_the_context(llama, llama_drafter_dir):
    drafter = load_eagle3_drafter(llama_drafter_dir, model=llama)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    features = MLXTarget(llama, capture_layers=drafter.capture_layers).prefill(tokens)
    drafter.begin(tokens, features)
    before = mx.stack(drafter.chain_logits(tokens, 3))
    drafter.chain_logits(tokens[:4], 2)  # a caller rolled back three tokens
    assert drafter.context_length == 3
    with pytest.raises(ValueError, match="commit"):
        drafter.chain_logits(tokens, 3)  # the pairs of positions 3..5 are gone now
    drafter.commit(tokens, Verdict([5, 6], 2, 7, features=features[3:]))
    assert drafter.context_length == 6
    assert mx.allclose(mx.stack(drafter.chain_logits(tokens, 3)), before, atol=1e-5).item()


def test_a_drafter_window_bounds_what_an_entry_attends_to(llama, llama_drafter_dir):
    """--drafter-window W: a chain step attends to its own entry and the W - 1 before it, so it
    equals the same step over a cache holding only those (RoPE sees differences only); the
    prefill's last pair likewise sees only the last W pairs."""
    window, tokens = 3, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    windowed = load_eagle3_drafter(llama_drafter_dir, model=llama, window=window)
    free = load_eagle3_drafter(llama_drafter_dir, model=llama)
    features = MLXTarget(llama, capture_layers=free.capture_layers).prefill(tokens)
    windowed.begin(tokens, features)
    free.begin(tokens[-window - 1 :], features[-window:])  # only the last W pairs
    assert mx.allclose(windowed._hidden[-1][-1], free._hidden[-1][-1], atol=1e-5).item()
    free.begin(tokens[-window:], features[-(window - 1) :])  # only the last W - 1 pairs
    model = windowed.model
    step = (mx.array([[4]]), mx.ones((1, 1, model.args.hidden_size)))  # a chain step's input
    reference = free.model(*step, free.cache)
    assert mx.allclose(model(*step, windowed.cache), reference, atol=1e-5).item()
    windowed.cache[0].trim(1)
    model.args.context_window = None  # the same step without the window sees more, and differs
    assert not mx.allclose(model(*step, windowed.cache), reference, atol=1e-3).item()


@pytest.mark.parametrize("options", [{}, {"tree_budget": 8, "tree_width": 3}],
                         ids=["chain", "tree"])
def test_a_drafter_window_changes_no_output(llama, llama_drafter_dir, options):
    """The narrowest window still gives plain decoding's output; one wider than any context
    drafts exactly as no window."""
    k = options.get("tree_budget", 4)
    for prompt in PROMPTS:
        plain, _ = run(llama, Drafter(), prompt, max_tokens=24, k=k)
        narrow = load_eagle3_drafter(llama_drafter_dir, model=llama, window=2, **options)
        assert run(llama, narrow, prompt, max_tokens=24, k=k)[0] == plain
        wide, wide_stats = run(llama, load_eagle3_drafter(llama_drafter_dir, model=llama,
                                                          window=1000, **options),
                               prompt, max_tokens=24, k=k)
        _, free_stats = run(llama, load_eagle3_drafter(llama_drafter_dir, model=llama,
                                                       **options), prompt, max_tokens=24, k=k)
        assert wide == plain
        assert (wide_stats.drafted_per_position, wide_stats.accepted_per_position) == (
            free_stats.drafted_per_position, free_stats.accepted_per_position)
    with pytest.raises(ValueError, match="drafter window must be an integer >= 2, got 1"):
        load_eagle3_drafter(llama_drafter_dir, model=llama, window=1)


@pytest.mark.slow  # χ²: thousands of sampled generations
def test_sampled_output_follows_target_distribution(tmp_path):
    """Chi-squared against the exact distribution (tests/test_sampling_exactness.py), drafting
    from 3 of the 5 tokens: p is zero for the other two, which the target still produces."""
    model = tiny_llama(vocab=VOCAB, seed=11, sharpness=2.5)
    path = make_drafter_dir(tmp_path, vocab=VOCAB, draft_ids=[0, 1, 3], seed=5, ids=(1, 1, 2))
    drafter = load_eagle3_drafter(path, model=model)
    mx.random.seed(1234)
    counts, stats = Counter(), SpecStats()
    for _ in range(SAMPLES):
        target = MLXTarget(model, capture_layers=drafter.capture_layers, speculative=True)
        out = speculative_tokens(target, drafter, PROMPT, sampling=SAMPLING, max_tokens=LENGTH,
                                 num_draft=2, stats=stats)
        counts[tuple(t for t, _ in out)] += 1
    assert 0 < stats.accepted < stats.drafted
    assert any(2 in seq or 4 in seq for seq in counts)  # tokens outside the draft vocabulary
    pvalue = chi_squared_pvalue(counts, exact_distribution(model, SAMPLING))
    assert pvalue > 0.001, f"p = {pvalue:.2g}"


def test_own_embedding_and_a_wider_drafter(tmp_path):
    """target_hidden_size != hidden_size (fc 96 -> 48) needs the checkpoint's embed_tokens;
    without it the target's 32-wide embedding cannot feed a 48-wide drafter: refused."""
    model = tiny_llama(vocab=12, hidden=32, layers=4, seed=1, sharpness=3.0)
    wide = make_drafter_dir(tmp_path / "own", vocab=12, draft_ids=list(range(12)), hidden=48,
                            own_embed=True)
    plain, _ = run(model, Drafter(), [1, 2, 3], max_tokens=12, k=3)
    out, _ = run(model, load_eagle3_drafter(wide, model=model), [1, 2, 3], max_tokens=12, k=3)
    assert out == plain
    bare = make_drafter_dir(tmp_path / "bare", vocab=12, draft_ids=list(range(12)), hidden=48)
    with pytest.raises(ValueError, match="no embed_tokens and its hidden size 48 differs"):
        load_eagle3_drafter(bare, model=model)


# ---- One-line refusals --------------------------------------------------------------------------


def copy_fixture(name, tmp_path) -> Path:
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def rewrite_weights(path: Path, change) -> None:
    weights = dict(mx.load(str(path / "model.safetensors")))
    change(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights)


def refusal(path, model) -> str:
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        load_eagle3_drafter(path, model=model)
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_missing_tensor_named_in_the_layouts_spelling(target, tmp_path):
    spec = copy_fixture("speculators", tmp_path)
    rewrite_weights(spec, lambda w: w.pop("lm_head.weight"))
    assert "missing weights: lm_head.weight" in refusal(spec, target)
    forge = copy_fixture("specforge", tmp_path)
    rewrite_weights(forge, lambda w: w.pop("midlayer.mlp.up_proj.weight"))
    assert "missing weights: midlayer.mlp.up_proj.weight" in refusal(forge, target)
    rewrite_weights(spec, lambda w: w.update({"lm_head.weight": mx.zeros((48, 32))}))
    rewrite_weights(spec, lambda w: w.pop("d2t"))  # 48 of 96 tokens need the mapping
    assert "missing weights: d2t" in refusal(spec, target)


def test_wrong_shape_named(target, tmp_path):
    spec = copy_fixture("speculators", tmp_path)
    rewrite_weights(spec, lambda w: w.update({"fc.weight": mx.zeros((32, 95))}))
    message = refusal(spec, target)
    assert "fc.weight has shape (32, 95), config.json implies (32, 96)" in message
    forge = copy_fixture("specforge", tmp_path)
    rewrite_weights(forge, lambda w: w.update({"midlayer.self_attn.q_proj.weight":
                                               mx.zeros((32, 48))}))
    assert "midlayer.self_attn.q_proj.weight has shape (32, 48), config.json implies (32, 96)" \
        in refusal(forge, target)


def test_unused_tensors_are_ignored(target, tmp_path):
    spec = copy_fixture("speculators", tmp_path)
    rewrite_weights(spec, lambda w: w.update({"verifier_lm_head.weight": mx.zeros((48, 32)),
                                              "something.else": mx.zeros((3,))}))
    load_eagle3_drafter(spec, model=target)  # t2d, verifier_norm and these ride along


@pytest.mark.parametrize("sizes,words", [
    ({"vocab": 96, "hidden": 16, "layers": 4},
     "hidden size: drafter target_hidden_size 32, target 16"),
    ({"vocab": 64, "hidden": 32, "layers": 4}, "vocab size: drafter 96, target 64"),
    ({"vocab": 96, "hidden": 32, "layers": 2},
     ("eagle_aux_hidden_state_layer_ids [1, 2, 4] (hidden states, 0 = the embedding) need "
      "target layer outputs [0, 1, 3], outside the target's 2 layers")),
])
def test_target_mismatch_refused_naming_both_sides_before_the_weights(tmp_path, sizes, words):
    other = tiny_llama(**sizes)
    spec = copy_fixture("speculators", tmp_path)
    (spec / "model.safetensors").write_bytes(b"not a safetensors file")  # never read
    message = refusal(spec, other)
    assert message.startswith("EAGLE-3 drafter does not fit this target: ") and words in message
    with pytest.raises(ValueError, match="does not fit"):
        check_checkpoint(spec, other)  # the registry's config-only check


def test_specforge_layer_ids_count_outputs(tmp_path):
    forge = copy_fixture("specforge", tmp_path)
    message = refusal(forge, tiny_llama(vocab=96, hidden=32, layers=3))
    assert "eagle_aux_hidden_state_layer_ids [0, 1, 3] (layer outputs) need target layer " \
           "outputs [0, 1, 3], outside the target's 3 layers" in message


@pytest.mark.parametrize("d2t_change,words", [
    (lambda d: d.at[47].add(200), "maps draft id 47 to target id"),
    (lambda d: mx.concatenate([d[:1], d[:1] - 1, d[2:]]), "maps 2 draft ids to target id"),
])
def test_bad_d2t_refused(target, tmp_path, d2t_change, words):
    spec = copy_fixture("speculators", tmp_path)
    rewrite_weights(spec, lambda w: w.update({"d2t": d2t_change(w["d2t"])}))
    assert words in refusal(spec, target)


@pytest.mark.parametrize("config_change,words", [
    (lambda c: (c.clear(), c.update(architectures=["DFlashDraftModel"], model_type="qwen3")),
     "not an EAGLE-3 drafter config"),
    (lambda c: c.pop("transformer_layer_config"),
     "speculators config.json lacks transformer_layer_config"),
    (lambda c: c["transformer_layer_config"].update(num_hidden_layers=2),
     "with 2 decoder layers are not supported, only 1"),
    (lambda c: c.update(fc_norm=True), "fc_norm=true (Eagle 3.1) is not supported"),
    (lambda c: c["transformer_layer_config"].update(model_type="mistral"),
     "decoder layer type 'mistral' is not supported"),
    (lambda c: c["transformer_layer_config"].pop("hidden_size"),
     "transformer_layer_config lacks hidden_size"),
])
def test_unsupported_configs_refused(target, tmp_path, config_change, words):
    spec = copy_fixture("speculators", tmp_path)
    config = json.loads((spec / "config.json").read_text())
    config_change(config)
    (spec / "config.json").write_text(json.dumps(config))
    assert words in refusal(spec, target)


def test_pickle_only_checkpoint_refused(target, tmp_path):
    spec = copy_fixture("speculators", tmp_path)
    (spec / "model.safetensors").unlink()
    (spec / "pytorch_model.bin").write_bytes(b"\x80\x04")
    assert "no *.safetensors weights (found pytorch_model.bin: pickle checkpoints are never " \
           "loaded)" in refusal(spec, target)


def test_model_level_api(target, inputs):
    """The model alone: project target features, run pairs, rank the draft vocabulary."""
    model = load_eagle3_model(FIXTURES / "specforge", model=target)
    assert isinstance(model, Eagle3Model) and "embed_tokens" in model
    cache = model.make_cache()
    tokens = mx.array(inputs["prompt"][1:])[None]
    h = model(tokens, model.project(inputs["features_prefill"][None]), cache)
    assert h.shape == (1, 8, 48) and cache[0].offset == 8
    assert model.logits(h).shape == (1, 8, 48)
    assert isinstance(Eagle3Drafter(model, num_target_layers=4, target_vocab=96).capture_layers,
                      tuple)


def test_eagle3_from_the_cli_is_lossless(tmp_path):
    """`--drafter eagle3 --draft-model DIR` on the hybrid qwen3_5 target the fixtures were made
    for: plain decoding's text, with drafts accepted."""
    import re

    from click.testing import CliRunner

    from mlxspec.cli.main import main

    target = FIXTURES.parent / "mlx_vlm_hybrid" / "target"

    def run(*options):
        result = CliRunner().invoke(main, ["generate", "--model", str(target), "-p", "abcabcab",
                                           "-n", "16", "--no-chat-template", *options])
        assert result.exit_code == 0, result.output
        return result

    plain = run()
    for layout in ("speculators", "specforge"):
        spec = run("--drafter", "eagle3", "--draft-model", str(FIXTURES / layout), "--verbose")
        assert spec.stdout == plain.stdout
        assert int(re.search(r"drafted: (\d+)", spec.stderr)[1]) > 0, spec.stderr
    windowed = run("--drafter", "eagle3", "--draft-model", str(FIXTURES / "speculators"),
                   "--drafter-window", "2")
    assert windowed.stdout == plain.stdout
    for options in (["eagle3", "--draft-model", str(FIXTURES / "speculators"),
                     "--drafter-window", "1"],  # too narrow
                    ["lookup", "--drafter-window", "8"]):  # lookup has no view to bound
        refused = CliRunner().invoke(main, ["generate", "--model", str(target), "-p", "ab",
                                            "--drafter", *options])
        assert refused.exit_code != 0 and "window" in refused.output, refused.output
        assert "Traceback" not in refused.output
    refused = CliRunner().invoke(main, ["generate", "--model", str(target), "-p", "ab", "-n", "2",
                                        "--drafter", "eagle3"])
    assert refused.exit_code != 0 and "--draft-model" in refused.output
