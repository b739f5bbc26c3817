"""DSpark in the shared loop, on tiny random targets and random drafters in the published layouts:
DeepSpec's Qwen3DSparkModel (flat keys, its own embed_tokens and lm_head) and LiquidAI's LFM2.5
Lfm2DSparkDraftModel (keys under dflash_config, interleaved RoPE, the target's embedding and
head, the confidence head's input read from its width).

Greedy output must equal plain decoding, sampled output must follow the target's distribution
with the walk's true q (and must not with a wrong one), the context cache must be a fresh
build's after rollbacks, and where the checkpoint has a confidence head it sets the draft length.
"""

import re

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_dflash import GREEDY, PROMPTS, drafter_config, run, save_drafter, target  # noqa: F401
from block_drafters import (
    assert_context_is_a_fresh_build,
    forks_begun,
    assert_cli_api_batch_and_server_are_plain,
    assert_loads_exactly_its_weights,
    sampled_pvalue,
    started,
)
from test_sampling_exactness import VOCAB
from tiny_models import tiny_llama

import mlxspec
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.drafters import load_drafter
from mlxspec.drafters.dflash import load_dflash_drafter
from mlxspec.drafters.dspark import DSparkDrafter, load_dspark_drafter
from mlxspec.draft_length import AdaptiveDraftLength, ScoredDraftLength
from mlxspec.engine import Drafter, SpecStats, speculative_tokens
from mlxspec.models.dspark import DSparkConfig, DSparkModel
from mlxspec.sampling import SamplingConfig

BLOCK = 5


def deepspec_config(*, vocab=12, hidden=32, target_layers=4, confidence=True, layers=2,
                    **overrides):
    """DeepSpec's flat Qwen3DSparkModel config.json (every layer full attention)."""
    config = drafter_config(vocab=vocab, hidden=hidden, target_layers=target_layers,
                            num_hidden_layers=layers, layer_types=["full_attention"] * layers,
                            **overrides)
    draft = config.pop("dflash_config")
    config.update(architectures=["Qwen3DSparkModel"], block_size=BLOCK, num_anchors=512,
                  markov_rank=8, markov_head_type="vanilla", enable_confidence_head=confidence,
                  **draft)
    config.pop("use_sliding_window"), config.pop("sliding_window")
    if confidence:
        config["confidence_head_with_markov"] = True
    return config


def lfm_config(*, vocab=12, hidden=32, target_layers=4, **overrides):
    """LiquidAI's LFM2.5 layout: mask, target layers and their count under dflash_config, no
    confidence_head_with_markov, interleaved RoPE."""
    config = deepspec_config(vocab=vocab, hidden=hidden, target_layers=target_layers, **overrides)
    config["architectures"] = ["Lfm2DSparkDraftModel"]
    config["dflash_config"] = {k: config.pop(k) for k in
                               ("mask_token_id", "target_layer_ids", "num_target_layers")}
    for key in ("confidence_head_with_markov", "num_anchors"):
        config.pop(key)
    config["rope_is_neox_style"] = False
    return config


def dspark_weights(config: dict, seed: int = 0, *, own_vocab: bool, with_markov=True) -> dict:
    args = DSparkConfig.from_dict(config)
    if args.enable_confidence_head and args.confidence_head_with_markov is None:
        args.confidence_head_with_markov = with_markov
    model = DSparkModel(args, own_embed=own_vocab, own_head=own_vocab)
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    weights = {}
    for key, (name, p) in zip(keys, params):
        noise = mx.random.normal(p.shape, key=key)
        if name.endswith("norm.weight"):
            weights[name] = 1 + 0.1 * noise
        elif name.startswith("markov_head"):
            weights[name] = 1.5 * noise * p.shape[-1] ** -0.25  # a bias that rivals the logits
        else:
            weights[name] = noise * p.shape[-1] ** -0.5
    return weights


def make_dir(path, layout="deepspec", seed=0, with_markov=True, **options):
    config = (deepspec_config if layout == "deepspec" else lfm_config)(**options)
    weights = dspark_weights(config, seed, own_vocab=layout == "deepspec", with_markov=with_markov)
    return save_drafter(path, config, weights)


@pytest.fixture(scope="module", params=["deepspec", "lfm"])
def drafter_dir(request, tmp_path_factory):
    return make_dir(tmp_path_factory.mktemp(request.param), request.param, seed=3)


# ---- layouts ------------------------------------------------------------------------------------


def test_each_layout_loads_exactly_its_weights(target, drafter_dir):
    drafter = load_drafter("dspark", str(drafter_dir), model=target, tokenizer=None)
    assert isinstance(drafter, DSparkDrafter) and drafter.max_draft == BLOCK
    stored = assert_loads_exactly_its_weights(drafter, drafter_dir)
    lfm = "lm_head.weight" not in stored
    assert drafter.model.rope.traditional == lfm  # LFM2.5's interleaved RoPE
    assert (drafter.lm_head is getattr(drafter.model, "lm_head", None)) != lfm  # DeepSpec's own


@pytest.mark.parametrize("with_markov", [True, False])
def test_lfm_configs_confidence_input_is_read_from_its_width(target, tmp_path, with_markov):
    path = make_dir(tmp_path, "lfm", with_markov=with_markov)
    drafter = load_dspark_drafter(path, model=target)
    assert drafter.model.args.confidence_head_with_markov is with_markov
    assert drafter.model.confidence_head.proj.weight.shape == (1, 32 + 8 * with_markov)


@pytest.mark.parametrize("problem,words", [
    ("missing", "missing weights: markov_head.markov_w2.weight"),
    ("shape", "confidence_head.proj.weight has shape (1, 32), config.json implies (1, 40)"),
    ("extra", "unexpected weights: markov_head.gate_proj.weight"),
])
def test_weight_problems_are_one_line(target, tmp_path, problem, words):
    config = deepspec_config()
    weights = dspark_weights(config, own_vocab=True)
    if problem == "missing":
        del weights["markov_head.markov_w2.weight"]
    elif problem == "shape":
        weights["confidence_head.proj.weight"] = mx.zeros((1, 32))
    else:
        weights["markov_head.gate_proj.weight"] = mx.zeros((8, 40))
    save_drafter(tmp_path, config, weights)
    with pytest.raises(ValueError, match=re.escape(words)) as err:
        load_dspark_drafter(tmp_path, model=target)
    assert "\n" not in str(err.value) and "DSpark checkpoint does not match" in str(err.value)


@pytest.mark.parametrize("edit,words", [
    (lambda c: c.update(markov_head_type="gated"), "markov_head_type 'gated' is not supported"),
    (lambda c: c.update(markov_rank=-1), "markov_rank must be an integer >= 0"),
    (lambda c: c.update(markov_rank=0), "confidence_head_with_markov needs a Markov head"),
])
def test_bad_configs_are_refused(target, tmp_path, edit, words):
    config = deepspec_config()
    weights = dspark_weights(config, own_vocab=True)
    edit(config)
    save_drafter(tmp_path, config, weights)
    with pytest.raises(ValueError, match=words):
        load_dspark_drafter(tmp_path, model=target)


def test_dflash_and_dspark_name_the_drafter_a_checkpoint_needs(target, drafter_dir, tmp_path):
    with pytest.raises(ValueError, match=r"DSpark.*--drafter dspark$"):
        load_dflash_drafter(drafter_dir, model=target)
    from test_dflash import make_drafter_dir

    with pytest.raises(ValueError, match="DFlashDraftModel.*--drafter dflash$"):
        load_dspark_drafter(make_drafter_dir(tmp_path / "v1"), model=target)


def test_convert_checks_and_casts_either_layout(target, drafter_dir, tmp_path):
    from mlxspec.converters import convert

    out = convert(str(drafter_dir), tmp_path / "out", dtype="bfloat16")
    assert mx.load(str(out / "model.safetensors"))["markov_head.markov_w1.weight"].dtype == \
        mx.bfloat16
    drafter = load_dspark_drafter(out, model=target, dtype="target")
    assert run(target, drafter, PROMPTS[0])[0] == run(target, Drafter(), PROMPTS[0])[0]


# ---- the walk -----------------------------------------------------------------------------------


def reference_walk(drafter, prompt, temp=None, drafts=None):
    """numpy: every slot's logits plus the Markov bias of the token before it (the anchor for
    slot 0); greedy argmaxes, or with `drafts` each step's softmax((l + bias) / temp)."""
    hidden = drafter.block_hidden(prompt, BLOCK - 1)[0]  # all B slots
    logits = np.array(drafter.model.compute_logits(hidden, drafter.lm_head))
    W1 = np.array(drafter.model.markov_head.markov_w1.weight)
    W2 = np.array(drafter.model.markov_head.markov_w2.weight)
    before, out = prompt[-1], []
    for k in range(BLOCK):
        step = logits[k] + W2 @ W1[before]
        if drafts is None:
            before = int(step.argmax())
            out.append(before)
        else:
            e = np.exp((step - step.max()) / temp)
            out.append(e / e.sum())
            before = drafts[k]
    return out


def test_the_greedy_walk_drafts_every_slot_with_its_bigram(target, drafter_dir):
    drafter = load_dspark_drafter(drafter_dir, model=target)
    prompt = PROMPTS[2]
    started(drafter, target, prompt)
    draft = drafter.propose(prompt, 9, GREEDY)
    assert draft.probs is None and len(draft) == BLOCK  # the anchor's slot drafts too
    want = reference_walk(drafter, prompt)
    assert draft.tokens.tolist() == want
    # a shorter K is the same block's walk cut short, as `free_drafts` promises
    assert drafter.propose(prompt, 2, GREEDY).tokens.tolist() == want[:2]


def test_a_sampled_draft_carries_its_walks_q(target, drafter_dir):
    drafter = load_dspark_drafter(drafter_dir, model=target)
    prompt = PROMPTS[0]
    started(drafter, target, prompt)
    mx.random.seed(5)
    draft = drafter.propose(prompt, BLOCK, SamplingConfig(temp=0.7))
    tokens = draft.tokens.tolist()
    want = np.stack(reference_walk(drafter, prompt, temp=0.7, drafts=tokens))
    np.testing.assert_allclose(np.array(draft.probs), want, atol=1e-5)


# ---- lossless -----------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("k", [BLOCK, 2])
def test_greedy_identity(target, drafter_dir, prompt, k):
    plain, _ = run(target, Drafter(), prompt)
    out, stats = run(target, load_dspark_drafter(drafter_dir, model=target), prompt, k=k)
    assert out == plain
    assert stats.accepted + stats.target_passes == stats.generated == 24


def test_greedy_identity_when_every_draft_is_rejected(target, drafter_dir, monkeypatch):
    plain, _ = run(target, Drafter(), PROMPTS[0])
    drafts = DSparkDrafter._block_drafts

    def wrong(self, *args):
        return [type(d)(tokens=(d.tokens + 1) % 12) if len(d) else d for d in drafts(self, *args)]

    monkeypatch.setattr(DSparkDrafter, "_block_drafts", wrong)
    out, stats = run(target, load_dspark_drafter(drafter_dir, model=target), PROMPTS[0])
    assert out == plain and stats.drafted > 0 and stats.accepted < stats.drafted // 4


def test_context_cache_equals_fresh_build(target, drafter_dir):
    drafter = load_dspark_drafter(drafter_dir, model=target)
    out, _ = run(target, drafter, PROMPTS[0], max_tokens=30)
    assert_context_is_a_fresh_build(drafter, target, PROMPTS[0] + out)


def test_rows_of_a_batch_draft_in_one_pass_as_each_alone(target, drafter_dir):
    drafter = load_dspark_drafter(drafter_dir, model=target)
    prompts = [PROMPTS[2], PROMPTS[3], PROMPTS[0], PROMPTS[1]]
    ks = [5, 2, 9, 1]
    samplings = [GREEDY, SamplingConfig(temp=0.7), GREEDY, SamplingConfig(temp=1.0)]
    forks, alone = forks_begun(drafter, target, prompts)
    together = DSparkDrafter.propose_together(forks, prompts, ks, samplings)
    for prompt, draft, k, a, s in zip(prompts, together, ks, alone, samplings):
        assert len(draft) == min(k, BLOCK)
        if s.temp == 0:
            assert draft.tokens.tolist() == a.propose(prompt, k, s).tokens.tolist()
            continue
        tokens = draft.tokens.tolist()
        want = np.stack(reference_walk(a, prompt, temp=s.temp, drafts=tokens + [0] * BLOCK))
        np.testing.assert_allclose(np.array(draft.probs), want[: len(tokens)], atol=1e-5)


def test_batch_generate_gives_each_prompt_its_plain_decoding(target, drafter_dir):
    from test_api_hardening import tiny_tokenizer

    tokenizer = tiny_tokenizer(12)
    drafter = load_dspark_drafter(drafter_dir, model=target)
    plain = mlxspec.batch_generate(target, tokenizer, PROMPTS, 16)
    assert mlxspec.batch_generate(target, tokenizer, PROMPTS, 16,
                                  drafter=drafter).token_ids == plain.token_ids


def make_smollm_dspark(path):
    """A random 1-layer LFM2.5-layout DSpark that fits the default SmolLM2 (its embedding and
    head are the target's)."""
    return make_dir(path, "lfm", vocab=49152, hidden=576, target_layers=30, layers=1,
                    target_layer_ids=[1, 27], mask_token_id=0, intermediate_size=64)


@pytest.fixture(scope="module")
def smollm_dspark(smollm_dir, tmp_path_factory):
    return make_smollm_dspark(tmp_path_factory.mktemp("smollm_dspark"))


def test_cli_api_and_server_give_plain_decodings_text(smollm_dir, smollm, smollm_dspark):
    assert_cli_api_batch_and_server_are_plain("dspark", smollm_dir, smollm, smollm_dspark)


def test_the_cli_names_the_drafter_a_block_checkpoint_needs(smollm_dir, smollm_dspark):
    from test_cli import assert_clean_error, gen

    flags = ("--model", str(smollm_dir), "--drafter-model", str(smollm_dspark))
    assert_clean_error(gen(*flags, "--drafter", "dflash"), "Lfm2DSparkDraftModel",
                       "--drafter dspark")
    assert_clean_error(gen(*flags, "--drafter", "dflash2"), "--drafter dspark")


# ---- the confidence head sets K -----------------------------------------------------------------


def test_the_confidence_head_is_what_sets_the_draft_length(target, drafter_dir, monkeypatch):
    """With a confidence head the adaptive K is ScoredDraftLength over its prefix survival:
    confidences that collapse after two slots keep at most two drafts a step (a step of K
    drafts timed at 1 + 0.1 K plain steps, so that a draft is worth its chance alone)."""
    drafter = load_dspark_drafter(drafter_dir, model=target)
    assert isinstance(drafter.draft_policy(BLOCK, True), ScoredDraftLength)
    monkeypatch.setattr(ScoredDraftLength, "time_line", lambda self: (1.0, 1.0, 0.1))
    monkeypatch.setattr(DSparkDrafter, "confidence_reach",
                        lambda self: [0.99, 0.98, 1e-4, 1e-8, 1e-12][: len(self._confidence)])
    stats = SpecStats()
    target_ = MLXTarget(target, capture_layers=drafter.capture_layers, speculative=True)
    out = [t for t, _ in speculative_tokens(target_, drafter, PROMPTS[0], sampling=GREEDY,
                                            max_tokens=30, num_draft=BLOCK, stats=stats,
                                            adaptive=True)]
    assert out == run(target, Drafter(), PROMPTS[0], max_tokens=30)[0]
    assert 1 <= len(stats.drafted_per_position) <= 2 and stats.drafted_per_position[0] > 0

    no_head = load_dspark_drafter(make_dir(drafter_dir.parent / "no_head", confidence=False),
                                  model=target)
    policy = no_head.draft_policy(BLOCK, True)
    assert type(policy) is AdaptiveDraftLength


def test_a_confidence_cut_to_nothing_rests_the_drafter(monkeypatch):
    """Confidences too low to pay: the step drafts nothing, and the next probe_every steps skip
    the drafter's pass (K = 0) before the head is asked again with a whole block."""
    from mlxspec.draft_length import ConfidenceDraftLength
    from mlxspec.engine import Draft

    reach = [1e-6, 1e-7]
    policy = ConfidenceDraftLength(BLOCK, lambda: reach, probe_every=3)
    monkeypatch.setattr(ConfidenceDraftLength, "time_line", lambda self: (1.0, 1.0, 0.1))
    draft = Draft(tokens=mx.array([1, 2]))
    assert policy.next_k() == BLOCK
    assert policy.keep(draft) == 0
    assert [policy.next_k() for _ in range(3)] == [0, 0, 0]
    assert policy.next_k() == BLOCK  # asked again
    reach[:] = [0.99, 0.98]
    assert policy.keep(draft) == 2 and policy.next_k() == BLOCK  # drafts that pay: no rest


def test_confidences_are_each_rows_own_in_a_batch(target, drafter_dir):
    drafter = load_dspark_drafter(drafter_dir, model=target)
    forks = [drafter.fork() for _ in PROMPTS[:3]]
    for prompt, f in zip(PROMPTS, forks):
        started(f, target, prompt)
    DSparkDrafter.propose_together(forks, PROMPTS[:3], [5, 3, 1], [GREEDY] * 3)
    for prompt, f, k in zip(PROMPTS, forks, [5, 3, 1]):
        alone = load_dspark_drafter(drafter_dir, model=target)
        started(alone, target, prompt)
        alone.propose(prompt, k, GREEDY)
        np.testing.assert_allclose(f.confidence_reach(), alone.confidence_reach(), atol=1e-5)
        assert len(f.confidence_reach()) == k


# ---- sampled ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab_target():
    return tiny_llama(vocab=VOCAB, seed=11, sharpness=2.5)


def sampling_drafter(model, tmp_path):
    path = make_dir(tmp_path, "lfm", seed=5, vocab=VOCAB, target_layers=2,
                    target_layer_ids=[0, 1])
    return load_dspark_drafter(path, model=model)


@pytest.mark.slow  # χ²: thousands of sampled generations
def test_sampled_output_follows_target_distribution(small_vocab_target, tmp_path):
    pvalue = sampled_pvalue(small_vocab_target, sampling_drafter(small_vocab_target, tmp_path))
    assert pvalue > 0.001, f"p = {pvalue:.2g}"


@pytest.mark.slow
def test_a_wrong_q_is_caught(small_vocab_target, tmp_path, monkeypatch):
    """q reported as uniform while the drafts are drawn from the walk's q: χ² must reject."""
    drafter = sampling_drafter(small_vocab_target, tmp_path)
    drafts = DSparkDrafter._block_drafts

    def uniform(self, *args):
        return [type(d)(tokens=d.tokens, probs=mx.full(d.probs.shape, 1.0 / d.probs.shape[-1]))
                if d.probs is not None else d for d in drafts(self, *args)]

    monkeypatch.setattr(DSparkDrafter, "_block_drafts", uniform)
    pvalue = sampled_pvalue(small_vocab_target, drafter, both_ways=False)
    assert pvalue < 0.001, f"p = {pvalue:.2g}"
