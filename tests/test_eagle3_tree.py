"""EAGLE-2's dynamic tree for the EAGLE-3 drafter: lossless through the one loop, each candidate
scored as a chain down its own path scores it (so the tree's mask and positions are right), the
draft cache holding committed pairs only after a tree step, and the options from the CLI and the
API, refused before any weight loads."""

import json
import math
import re
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from test_eagle3 import FIXTURES, GREEDY, PROMPTS, TARGET, make_drafter_dir, run
from test_eagle3 import llama  # noqa: F401  (a fixture: the tiny llama target, 12 tokens)
from tiny_models import tiny_llama

import mlxspec
from mlxspec.drafters.eagle3 import best_nodes, load_eagle3_drafter
from mlxspec.engine import Drafter, Verdict
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.sampling import SamplingConfig
from mlxspec.backends.mlx.sampling import processed_logprobs
from mlxspec.tree import TreeShape

DRAFT_IDS = [0, 1, 2, 3, 5, 8, 10, 11]  # 8 of the target's 12 tokens, mapped through d2t


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return make_drafter_dir(tmp_path_factory.mktemp("eagle3_tree"), vocab=12,
                            draft_ids=DRAFT_IDS, seed=5)


def begun(path, llama, tokens, **options):
    """A drafter after `begin` on `tokens`, the target's features of all but the last."""
    drafter = load_eagle3_drafter(path, model=llama, **options)
    drafter.begin(tokens, MLXTarget(llama, capture_layers=drafter.capture_layers).prefill(tokens))
    return drafter


def logged_branches(drafter) -> list:
    """Record (the tree's first chain, the committed branch) of each verified tree."""
    log, chains, commit, propose = [], [], drafter.commit, drafter.propose

    def proposing(tokens, k, sampling):
        draft = propose(tokens, k, sampling)
        chains.append(TreeShape(draft.parents).first_chain())
        return draft

    def committing(tokens, verdict):
        if verdict.branch is not None:  # not a plain step
            log.append((chains[-1], verdict.branch))
        commit(tokens, verdict)

    drafter.propose, drafter.commit = proposing, committing
    return log


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("budget", [1, 5, 12])
def test_greedy_tree_output_equals_plain_decoding(llama, drafter_dir, prompt, budget):
    plain, _ = run(llama, Drafter(), prompt, max_tokens=24, k=4)
    drafter = load_eagle3_drafter(drafter_dir, model=llama, tree_budget=budget, tree_width=3)
    assert drafter.drafts_trees and drafter.max_draft == drafter.default_num_draft == budget
    out, stats = run(llama, drafter, prompt, max_tokens=24, k=budget)
    assert out == plain
    assert stats.chain_fallback_steps == 0 and stats.drafted > 0


def test_trees_are_accepted_off_their_first_chain_and_rejected(llama, drafter_dir):
    """Over the prompts some steps commit a branch the chain would not have drafted, some
    commit none of the tree."""
    off_chain = rejected = 0
    for prompt in PROMPTS[:3]:
        drafter = load_eagle3_drafter(drafter_dir, model=llama, tree_budget=8)
        log = logged_branches(drafter)
        run(llama, drafter, prompt, max_tokens=24, k=8)
        off_chain += sum(branch != chain[: len(branch)] for chain, branch in log)
        rejected += sum(branch == [] for _, branch in log)
    assert off_chain > 0 and rejected > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_tree_output_is_valid(llama, drafter_dir, seed):
    """Exactness of the tree rule is tests/test_tree_verification.py's chi-squared test; here
    the EAGLE-3 tree runs through it: whole outputs of target tokens, drafts accepted."""
    mx.random.seed(seed)
    drafter = load_eagle3_drafter(drafter_dir, model=llama, tree_budget=8)
    out, stats = run(llama, drafter, PROMPTS[0], max_tokens=24, k=8,
                     sampling=SamplingConfig(temp=1.0, top_p=0.9))
    assert len(out) == 24 and all(0 <= t < 12 for t in out)
    assert stats.accepted > 0 and stats.chain_fallback_steps == 0


def test_first_chain_is_the_chain_drafters_greedy_drafts(llama, drafter_dir):
    tokens = PROMPTS[2]
    tree = begun(drafter_dir, llama, tokens, tree_budget=16).propose(tokens, 16, GREEDY)
    first = [tree.tokens[n - 1] for n in TreeShape(tree.parents).first_chain()]
    assert len(first) >= 2
    chain = begun(drafter_dir, llama, tokens).propose(tokens, len(first), GREEDY)
    assert first == chain.tokens.tolist()


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temp=0.7)], ids=["greedy", "temp"])
def test_every_candidate_scores_its_path_as_a_chain_does(llama, drafter_dir, sampling):
    """A candidate's score is its path's log-probability, summed over the layer outputs of its
    ancestors, which the tree computed together depth by depth; a chain run down the same path
    computes them one at a time, seeing only that path. Equal scores: each tree entry saw its
    ancestors only, at its depth's position."""
    tokens = PROMPTS[0]
    drafter = begun(drafter_dir, llama, tokens, tree_budget=16, tree_width=3)
    scores, ids, parents = drafter.tree_candidates(tokens, 16, sampling)
    assert len(scores) == 3 + 5 * 9  # depth 6: the root's 3 best, then 3 x 3 per depth
    row = {t: r for r, t in enumerate(DRAFT_IDS)}  # target id -> draft-vocabulary row
    for c in range(len(scores)):
        path = candidate_path(ids, parents, c)
        score = chain_score(drafter, tokens, path, sampling, row)
        assert math.isclose(scores[c], score, abs_tol=1e-4), (c, path)


def candidate_path(ids: list, parents: list, c: int) -> list:
    """Candidate c's tokens from the root down, in tree_candidates' numbering."""
    path, node = [], c + 1
    while node:
        path.insert(0, ids[node - 1])
        node = parents[node - 1]
    return path


def chain_score(drafter, tokens, path, sampling, row=None) -> float:
    """The path's log-probability as the drafter's chain scores it, one step at a time;
    `row` maps a target id to the row the drafter ranks (a draft vocabulary's)."""
    steps = drafter.chain_logits(tokens, len(path), draft_ids=path[:-1])
    return sum(_logprobs(logits, sampling)[row[t] if row else t].item()
               for logits, t in zip(steps, path))


def _logprobs(logits, sampling):
    logits = logits.astype(mx.float32)
    if sampling.greedy:
        return logits - mx.logsumexp(logits)
    return processed_logprobs(logits, sampling)


def test_kept_nodes_are_the_best_and_form_a_tree():
    scores = [-0.1, -0.5, -math.inf, -0.3, -0.1, -2.0]  # candidates 1..6
    parents = [0, 0, 0, 1, 1, 2]
    assert best_nodes(scores, parents, 4) == [0, 4, 3, 1]  # ties: the one listed first
    assert best_nodes(scores, parents, 10) == [0, 4, 3, 1, 5]  # -inf: ruled out


def test_draft_cache_after_a_tree_step_holds_the_committed_pairs_only(llama, drafter_dir):
    drafter = load_eagle3_drafter(drafter_dir, model=llama, tree_budget=12, tree_width=3)
    log = logged_branches(drafter)
    out, _ = run(llama, drafter, PROMPTS[0], max_tokens=20, k=12)
    assert any(len(branch) > 1 for _, branch in log)
    committed = PROMPTS[0] + out
    tokens = committed[:-3]  # one more tree step past these, as propose leaves it
    drafter._rewind(len(tokens) - 1)
    drafter.propose(tokens, 12, GREEDY)
    assert drafter.cache[0].offset == len(tokens) - 1 + 5 * 3  # depths 1..5 went through
    features = MLXTarget(llama, capture_layers=drafter.capture_layers).prefill(committed)
    drafter.commit(committed, _verdict(committed, len(tokens), features))
    drafter._rewind(len(committed) - 1)  # as the next proposal does: the commit's pairs run
    fresh = begun(drafter_dir, llama, committed)
    assert drafter.cache[0].offset == fresh.cache[0].offset == len(committed) - 1
    for ours, theirs in zip(drafter.cache[0].keys_and_values(), fresh.cache[0].keys_and_values()):
        assert ours.shape == theirs.shape and mx.allclose(ours, theirs, atol=1e-4).item()
    assert mx.allclose(drafter._hidden[-1][-1], fresh._hidden[-1][-1], atol=1e-4).item()


def _verdict(committed, start, features):
    """A verdict committing committed[start:] after committed[:start], with the features of the
    pending token and the accepted drafts: all a drafter reads of a tree's verdict too."""
    new = committed[start:]
    return Verdict(draft_tokens=new[:-1], accepted=len(new) - 1, next_token=new[-1],
                   features=features[start - 1 : len(committed) - 1])


def test_tree_tau_is_at_least_the_chains(llama, tmp_path):
    """With the whole vocabulary to draft from, a tree of 8 nodes commits at least as much per
    target pass as a chain of 8 drafts on every prompt."""
    path = make_drafter_dir(tmp_path, vocab=12, draft_ids=list(range(12)), seed=5)
    for prompt in PROMPTS:
        _, chain = run(llama, load_eagle3_drafter(path, model=llama), prompt, max_tokens=24, k=8)
        _, tree = run(llama, load_eagle3_drafter(path, model=llama, tree_budget=8), prompt,
                      max_tokens=24, k=8)
        assert tree.tau >= chain.tau, prompt


# ---- Options from the API and the CLI -----------------------------------------------------------


@pytest.mark.parametrize("options,words", [
    (dict(tree_budget=0), "tree budget must be a positive integer"),
    (dict(tree_budget=4, tree_width=0), "tree width must be a positive integer"),
    (dict(tree_budget=4, tree_depth=0), "tree_depth must be >= 1"),
])
def test_bad_tree_options_refused_before_the_weights(llama, drafter_dir, tmp_path, options,
                                                     words):
    broken = Path(shutil.copytree(drafter_dir, tmp_path / "broken"))
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")  # never read
    with pytest.raises(ValueError, match=words):
        mlxspec.drafters.load_drafter("eagle3", broken, model=llama, tokenizer=None, **options)


def test_the_api_takes_tree_options(llama, drafter_dir):
    drafter = mlxspec.drafters.load_drafter("eagle3", drafter_dir, model=llama, tokenizer=None,
                                            tree_budget=8, tree_width=2)
    assert drafter.drafts_trees and (drafter.tree_budget, drafter.tree_width) == (8, 2)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny llama the EAGLE-3 fixtures fit (hidden 32, 96 tokens, 4 layers), whose cache can
    hold a tree (the fixtures' own qwen3_5 target has recurrent layers), with its tokenizer."""
    path = tmp_path_factory.mktemp("llama96")
    model = tiny_llama(vocab=96, hidden=32, layers=4, seed=2, sharpness=3.0)
    config = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 4,
              "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-5, "vocab_size": 96, "max_position_embeddings": 256,
              "tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TARGET / name, path / name)
    return path


def cli(*options):
    from click.testing import CliRunner

    from mlxspec.cli.main import main

    return CliRunner().invoke(main, ["generate", "-p", "abcabcab", "-n", "16",
                                     "--no-chat-template", *options])


def test_tree_from_the_cli_is_lossless(llama_dir):
    plain = cli("--model", str(llama_dir))
    assert plain.exit_code == 0, plain.output
    tree = cli("--model", str(llama_dir), "--drafter", "eagle3", "--drafter-model",
               str(FIXTURES / "speculators"), "--tree-budget", "6", "--tree-width", "3",
               "--verbose")
    assert tree.exit_code == 0, tree.output
    assert tree.stdout == plain.stdout and tree.stdout.strip()
    assert int(re.search(r"drafted: (\d+)", tree.stderr)[1]) > 0, tree.stderr


def test_bad_tree_budget_from_the_cli_is_one_line():
    result = cli("--drafter", "eagle3", "--drafter-model", str(FIXTURES / "speculators"),
                 "--tree-budget", "0")
    errors = [line for line in result.output.splitlines() if "Error" in line]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert "--tree-budget" in errors[0] and "must be >= 1" in errors[0]
    assert "Traceback" not in result.output
