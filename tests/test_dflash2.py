"""DFlash2 in the shared loop, on tiny random targets and random drafters in z-lab's released
layout (DFlash2DraftModel: convolutions in every layer, a candidate selector whose codebooks
are named without `.weight`).

A random drafter drafts badly, which is the point: greedy output must equal plain decoding,
sampled output must follow the target's distribution with the walk's true q (and must not with
a wrong one), and the context cache must be what the committed tokens' features give afresh.
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

from mlxspec.drafters import load_drafter
from mlxspec.drafters.dflash import load_dflash_drafter
from mlxspec.drafters.dflash2 import DFlash2Drafter, load_dflash2_drafter
from mlxspec.engine import Drafter, Verdict
from mlxspec.models import dflash2 as dflash2_model
from mlxspec.models.dflash2 import DFlash2Config, DFlash2Model, grouped_convolve
from mlxspec.sampling import SamplingConfig
from mlxspec.tree import TreeShape


def dflash2_config(*, vocab=12, hidden=32, target_layers=4, top_k=4, **overrides) -> dict:
    """z-lab's DFlash2 config.json keys, small: non-causal layers (is_causal false, as the
    released config), one of them windowed."""
    config = drafter_config(vocab=vocab, hidden=hidden, target_layers=target_layers, **overrides)
    config["architectures"] = ["DFlash2DraftModel"]
    config["is_causal"] = False
    config["rms_norm_eps"] = 1e-5
    config["dflash_config"].update(
        conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=top_k,
        output_multiplier=1.25, final_logit_softcapping=20.0)
    return config


def dflash2_weights(config: dict, seed: int = 0) -> dict:
    """Random weights by the released names: taps that move the block, codebooks whose pair
    scores rival the logits (so the walk differs from each slot's argmax)."""
    model = DFlash2Model(DFlash2Config.from_dict(config))
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    weights = {}
    for key, (name, p) in zip(keys, params):
        noise = mx.random.normal(p.shape, key=key)
        if name.endswith("norm.weight"):
            weights[name] = 1 + 0.1 * noise
        elif name.endswith("base_kernel"):
            weights[name] = 0.3 * noise + mx.array([[1.0], [0.0]])[None] * (name[-1] != "x")
        elif name.endswith("codebook"):
            weights[name] = 1.5 * noise * p.shape[-1] ** -0.25
        else:
            weights[name] = noise * p.shape[-1] ** -0.5
    return weights


def make_dflash2_dir(path, seed=0, **options):
    config = dflash2_config(**options)
    return save_drafter(path, config, dflash2_weights(config, seed))


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return make_dflash2_dir(tmp_path_factory.mktemp("dflash2"), seed=3)


# ---- the layout ---------------------------------------------------------------------------------


def test_the_released_layout_loads_exactly_its_weights(target, drafter_dir):
    drafter = load_drafter("dflash2", str(drafter_dir), model=target, tokenizer=None)
    assert isinstance(drafter, DFlash2Drafter) and drafter.name == "dflash2"
    stored = assert_loads_exactly_its_weights(drafter, drafter_dir)
    assert "candidate_selector.predecessor_codebook" in stored  # z-lab's name, no `.weight`


@pytest.mark.parametrize("problem,words", [
    ("missing", "missing weights: layers.0.mlp_conv.base_kernel"),
    ("shape", "candidate_selector.successor_codebook has shape (12, 4)"),
    ("extra", "unexpected weights: layers.0.extra_conv.base_kernel"),
])
def test_weight_problems_are_one_line_before_any_compute(target, tmp_path, problem, words):
    config = dflash2_config()
    weights = dflash2_weights(config)
    if problem == "missing":
        del weights["layers.0.mlp_conv.base_kernel"]
    elif problem == "shape":
        weights["candidate_selector.successor_codebook"] = mx.zeros((12, 4))
    else:
        weights["layers.0.extra_conv.base_kernel"] = mx.zeros((2, 2, 32))
    save_drafter(tmp_path, config, weights)
    with pytest.raises(ValueError, match=re.escape(words)) as err:
        load_dflash2_drafter(tmp_path, model=target)
    assert "DFlash2 checkpoint does not match" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("edit,words", [
    (lambda c: c["dflash_config"].pop("selector_top_k"), "lacks dflash_config.selector_top_k"),
    (lambda c: c["dflash_config"].update(conv_group_size=5), "does not divide hidden_size 32"),
    (lambda c: c["dflash_config"].update(selector_top_k=13), "exceeds the vocabulary of 12"),
    (lambda c: c["dflash_config"].update(conv_kernel_size=0), "positive integer, got 0"),
])
def test_bad_configs_are_refused(target, tmp_path, edit, words):
    config = dflash2_config()
    weights = dflash2_weights(config)
    edit(config)
    save_drafter(tmp_path, config, weights)
    with pytest.raises(ValueError, match=words):
        load_dflash2_drafter(tmp_path, model=target)


def test_each_block_drafter_names_the_drafter_its_checkpoint_needs(target, drafter_dir, tmp_path):
    with pytest.raises(ValueError, match="DFlash2DraftModel.*--drafter dflash2"):
        load_dflash_drafter(drafter_dir, model=target)
    from test_dflash import make_drafter_dir

    with pytest.raises(ValueError, match="DFlashDraftModel.*--drafter dflash$"):
        load_dflash2_drafter(make_drafter_dir(tmp_path / "v1"), model=target)


def test_convert_checks_casts_and_keeps_the_layout(target, drafter_dir, tmp_path):
    from mlxspec.converters import convert

    out = convert(str(drafter_dir), tmp_path / "out", dtype="bfloat16")
    stored = mx.load(str(out / "model.safetensors"))
    assert stored["candidate_selector.successor_codebook"].dtype == mx.bfloat16
    drafter = load_dflash2_drafter(out, model=target, dtype="target")
    assert drafter.model.candidate_selector.successor_codebook.dtype == mx.float32
    assert run(target, drafter, PROMPTS[0])[0] == run(target, Drafter(), PROMPTS[0])[0]


# ---- the math -----------------------------------------------------------------------------------


def test_the_convolution_is_a_grouped_dynamic_causal_one():
    """Against its definition, written out with numpy: out[t, c] = sum_k (base[k, c] +
    dyn[t, k, c // g]) * y[t - k, c], nothing before slot 0 (blocks shorter than the kernel)."""
    rng = np.random.default_rng(0)
    for L in (1, 2, 5):
        y = rng.normal(size=(2, L, 8)).astype(np.float32)
        dyn = rng.normal(size=(2, L, 3, 2)).astype(np.float32)
        base = rng.normal(size=(3, 8)).astype(np.float32)
        want = np.zeros_like(y)
        for t in range(L):
            for k in range(3):
                if t - k >= 0:
                    want[:, t] += (base[k] + np.repeat(dyn[:, t, k], 4, axis=-1)) * y[:, t - k]
        got = grouped_convolve(mx.array(y), mx.array(dyn), mx.array(base), 4)
        np.testing.assert_allclose(np.array(got), want, atol=1e-5)


def test_the_greedy_walk_takes_each_steps_best_pair_score(target, drafter_dir):
    drafter = load_dflash2_drafter(drafter_dir, model=target)
    prompt = PROMPTS[2]
    started(drafter, target, prompt)
    draft = drafter.propose(prompt, 5, GREEDY)
    assert isinstance(draft.tokens, mx.array) and draft.probs is None
    hidden = drafter.block_hidden(prompt, 5)[0, 1:]
    logits = np.array(drafter.model.compute_logits(hidden, drafter.lm_head))
    selector = drafter.model.candidate_selector
    A, B = np.array(selector.predecessor_codebook), np.array(selector.successor_codebook)
    projected = np.array(selector.hidden_projection(hidden))
    before, walked, argmaxes = prompt[-1], [], logits.argmax(-1).tolist()
    for t in range(5):
        top = np.argsort(-logits[t])[: selector.top_k]
        scores = logits[t, top] + (A[before] * projected[t]) @ B[top].T
        before = int(top[scores.argmax()])
        walked.append(before)
    assert draft.tokens.tolist() == walked
    assert walked != argmaxes  # the pair scores matter for these weights


def test_a_sampled_draft_carries_its_walks_q(target, drafter_dir):
    """Draft.probs: each step's softmax(S / T) over its candidates, zero elsewhere, given the
    tokens drafted before; the drafted token is one of the candidates."""
    drafter = load_dflash2_drafter(drafter_dir, model=target)
    prompt = PROMPTS[0]
    started(drafter, target, prompt)
    mx.random.seed(3)
    sampling = SamplingConfig(temp=0.7)
    draft = drafter.propose(prompt, 5, sampling)
    probs = np.array(draft.probs)
    assert probs.shape == (5, 12)
    np.testing.assert_allclose(probs.sum(-1), 1, atol=1e-5)
    hidden = drafter.block_hidden(prompt, 5)[:, 1:]
    logits = drafter.model.compute_logits(hidden, drafter.lm_head)
    ids, q = drafter.model.candidate_selector.forced_q(
        hidden, logits, mx.array([prompt[-1]]), draft.tokens[None], 0.7)
    want = np.zeros((5, 12), np.float32)
    np.put_along_axis(want, np.array(ids[0]), np.array(q[0]), axis=-1)
    np.testing.assert_allclose(probs, want, atol=1e-6)
    tokens = draft.tokens.tolist()
    assert all(probs[t, tokens[t]] > 0 for t in range(5))
    assert all((probs[t] > 0).sum() <= drafter.model.candidate_selector.top_k for t in range(5))


# ---- trees over the candidates -------------------------------------------------------------------


def tree_paths(draft) -> set[tuple[int, ...]]:
    """Every node of a tree draft as the token path from the root to it."""
    paths = [()]
    for token, parent in zip(draft.tokens, draft.parents):
        paths.append(paths[parent] + (int(token),))
    return set(paths[1:])


def best_paths_by_hand(drafter, prompt, slots, width, budget) -> set[tuple[int, ...]]:
    """The `budget` most probable prefix-closed paths, every one enumerated in numpy: a node's
    children its slot's `width` candidates best by log softmax of the pair scores after it."""
    hidden = drafter.block_hidden(prompt, slots)[0, 1:]
    logits = np.array(drafter.model.compute_logits(hidden, drafter.lm_head))
    selector = drafter.model.candidate_selector
    A, B = np.array(selector.predecessor_codebook), np.array(selector.successor_codebook)
    projected = np.array(selector.hidden_projection(hidden))
    scored, frontier = {}, [((), 0.0, prompt[-1])]
    for t in range(slots):
        top = np.argsort(-logits[t])[: selector.top_k]
        grown = []
        for path, score, before in frontier:
            pair = logits[t, top] + (A[before] * projected[t]) @ B[top].T
            logprobs = pair - np.log(np.exp(pair - pair.max()).sum()) - pair.max()
            for j in np.argsort(-logprobs)[:width]:
                child = (path + (int(top[j]),), score + float(logprobs[j]), int(top[j]))
                scored[child[0]] = child[1]
                grown.append(child)
        frontier = grown
    return set(sorted(scored, key=scored.get, reverse=True)[:budget])


@pytest.mark.parametrize("budget,width", [(12, 3), (30, 2), (5, 4)])
def test_a_tree_holds_the_most_probable_branches_by_pair_score(target, drafter_dir, budget,
                                                               width):
    """--tree-budget: the tree is the `budget` most probable branches, each step scored by
    the pair scores after its parent's token, not the slot's own logits; its first chain is
    the greedy walk."""
    chain = load_dflash2_drafter(drafter_dir, model=target)
    tree = load_dflash2_drafter(drafter_dir, model=target, tree_budget=budget, tree_width=width)
    assert tree.max_draft == tree.default_num_draft == budget
    prompt = PROMPTS[2]
    started(chain, target, prompt)
    started(tree, target, prompt)
    slots = min(budget, tree.block_size - 1)
    draft = tree.propose(prompt, budget, GREEDY)
    assert draft.probs is None and len(draft.tokens) == budget
    assert tree_paths(draft) == best_paths_by_hand(tree, prompt, slots, width, budget)
    walk = tuple(chain.propose(prompt, slots, GREEDY).tokens.tolist())
    first = tuple(draft.tokens[n - 1] for n in TreeShape(draft.parents).first_chain())
    assert len(first) > 1 and first == walk[: len(first)]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("budget", [1, 6, 20])
def test_tree_drafts_are_lossless(target, drafter_dir, prompt, budget):
    plain, _ = run(target, Drafter(), prompt)
    drafter = load_dflash2_drafter(drafter_dir, model=target, tree_budget=budget, tree_width=3)
    out, stats = run(target, drafter, prompt, k=budget)
    assert out == plain
    assert stats.drafted > 0 and stats.chain_fallback_steps == 0


# ---- lossless -----------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("block_size,k", [(None, 5), (3, 5), (None, 2)])
def test_greedy_identity(target, drafter_dir, prompt, block_size, k):
    plain, _ = run(target, Drafter(), prompt)
    drafter = load_dflash2_drafter(drafter_dir, model=target, block_size=block_size)
    out, stats = run(target, drafter, prompt, k=k)
    assert out == plain
    assert stats.accepted + stats.target_passes == stats.generated == 24


def test_greedy_identity_when_every_draft_is_rejected(target, drafter_dir, monkeypatch):
    """Drafts replaced by a token the target never picks next: a rollback at every position."""
    plain, _ = run(target, Drafter(), PROMPTS[0])
    drafter = load_dflash2_drafter(drafter_dir, model=target)
    walk = DFlash2Drafter._block_drafts

    def wrong(self, *args):
        drafts = walk(self, *args)
        return [type(d)(tokens=(d.tokens + 1) % 12) if len(d) else d for d in drafts]

    monkeypatch.setattr(DFlash2Drafter, "_block_drafts", wrong)
    out, stats = run(target, drafter, PROMPTS[0])
    assert out == plain
    assert stats.drafted > 0 and stats.accepted < stats.drafted // 4


def test_context_cache_equals_fresh_build(target, drafter_dir):
    drafter = load_dflash2_drafter(drafter_dir, model=target)
    out, _ = run(target, drafter, PROMPTS[0], max_tokens=30)
    assert_context_is_a_fresh_build(drafter, target, PROMPTS[0] + out)


def test_rolled_back_context_drafts_as_before(target, drafter_dir):
    drafter = load_dflash2_drafter(drafter_dir, model=target)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    features = started(drafter, target, tokens)
    before = drafter.propose(tokens, 4, GREEDY).tokens.tolist()
    drafter.propose(tokens[:4], 3, GREEDY)  # a caller rolled back three tokens
    drafter.commit(tokens, Verdict([5, 6], 2, 7, features=features[3:]))
    assert drafter.propose(tokens, 4, GREEDY).tokens.tolist() == before


def test_a_drafter_window_narrows_every_layer_and_changes_no_output(target, drafter_dir):
    windows = lambda d: [layer.self_attn.window for layer in d.model.layers]  # noqa: E731
    assert windows(load_dflash2_drafter(drafter_dir, model=target)) == [4, None]
    narrow = load_dflash2_drafter(drafter_dir, model=target, window=2)
    assert windows(narrow) == [2, 2]
    for prompt in PROMPTS:
        assert run(target, narrow, prompt)[0] == run(target, Drafter(), prompt)[0]


@pytest.mark.parametrize("sampled", [False, True])
def test_rows_of_a_batch_draft_in_one_pass_as_each_alone(target, drafter_dir, sampled):
    drafter = load_dflash2_drafter(drafter_dir, model=target)
    prompts = [PROMPTS[2], PROMPTS[3], PROMPTS[0], PROMPTS[1]]
    ks = [5, 2, 9, 1]
    samplings = [SamplingConfig(temp=0.7) if sampled and i % 2 else GREEDY for i in range(4)]
    forks, alone = forks_begun(drafter, target, prompts)
    together = DFlash2Drafter.propose_together(forks, prompts, ks, samplings)
    for prompt, draft, k, a, s in zip(prompts, together, ks, alone, samplings):
        assert len(draft) == min(k, drafter.block_size - 1)
        if s.temp == 0:
            assert draft.probs is None
            assert draft.tokens.tolist() == a.propose(prompt, k, s).tokens.tolist()
            continue
        # the draws differ from a lone row's; the q of the path drawn is the lone row's q
        hidden = a.block_hidden(prompt, len(draft))[:, 1:]
        logits = a.model.compute_logits(hidden, a.lm_head)
        ids, q = a.model.candidate_selector.forced_q(
            hidden, logits, mx.array([prompt[-1]]), draft.tokens[None], s.temp)
        want = np.zeros((len(draft), 12), np.float32)
        np.put_along_axis(want, np.array(ids[0]), np.array(q[0]), axis=-1)
        np.testing.assert_allclose(np.array(draft.probs), want, atol=1e-5)


def make_smollm_dflash2(path):
    """A random 1-layer DFlash2 that fits the default SmolLM2 (real text to draft for)."""
    config = dflash2_config(vocab=49152, hidden=576, target_layers=30, num_hidden_layers=1,
                            layer_types=["full_attention"], target_layer_ids=[1, 27],
                            mask_token_id=0, intermediate_size=64)
    config["dflash_config"]["conv_group_size"] = 64
    return save_drafter(path, config, dflash2_weights(config))


@pytest.fixture(scope="module")
def smollm_dflash2(smollm_dir, tmp_path_factory):
    return make_smollm_dflash2(tmp_path_factory.mktemp("smollm_dflash2"))


def test_cli_api_and_server_give_plain_decodings_text(smollm_dir, smollm, smollm_dflash2):
    assert_cli_api_batch_and_server_are_plain("dflash2", smollm_dir, smollm, smollm_dflash2)


def test_cli_trees_give_plain_decodings_text(smollm_dir, smollm_dflash2):
    from test_cli import gen, ok

    flags = ("--model", str(smollm_dir), "--temp", "0", "--max-tokens", "12")
    plain = ok(gen(*flags))
    tree = ok(gen(*flags, "--drafter", "dflash2", "--drafter-model", str(smollm_dflash2),
                  "--tree-budget", "8", "--tree-width", "2", "--verbose"))
    assert tree.stdout == plain.stdout and plain.stdout.strip()
    assert "Drafter: dflash2" in tree.stderr


@pytest.fixture(scope="module")
def small_vocab_target():
    return tiny_llama(vocab=VOCAB, seed=11, sharpness=2.5)


def sampling_drafter(model, tmp_path, **options):
    path = make_dflash2_dir(tmp_path, seed=5, vocab=VOCAB, target_layers=2,
                            target_layer_ids=[0, 1], top_k=3)
    return load_dflash2_drafter(path, model=model, **options)


@pytest.mark.slow  # χ²: thousands of sampled generations
@pytest.mark.parametrize("options", [{}, dict(tree_budget=4, tree_width=2)], ids=["chain", "tree"])
def test_sampled_output_follows_target_distribution(small_vocab_target, tmp_path, options):
    drafter = sampling_drafter(small_vocab_target, tmp_path, **options)
    pvalue = sampled_pvalue(small_vocab_target, drafter)
    assert pvalue > 0.001, f"p = {pvalue:.2g}"


@pytest.mark.slow
def test_a_wrong_q_is_caught(small_vocab_target, tmp_path, monkeypatch):
    """The walk's q reported as uniform over its candidates (the pair scores forgotten) while
    the drafts are drawn from the true q: χ² must reject it, so the test above can fail."""
    drafter = sampling_drafter(small_vocab_target, tmp_path)
    true_probs = dflash2_model.proposal_probs

    def uniform(ids, q, vocab_size):
        return true_probs(ids, mx.full(q.shape, 1.0 / q.shape[-1]), vocab_size)

    monkeypatch.setattr("mlxspec.drafters.dflash2.proposal_probs", uniform)
    pvalue = sampled_pvalue(small_vocab_target, drafter, both_ways=False)
    assert pvalue < 0.001, f"p = {pvalue:.2g}"
