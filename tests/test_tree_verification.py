"""Trees of drafts through the one loop on MLX: one target pass scores every node with its
ancestors only, the committed branch's keys and values are kept in order, the output is plain
decoding's (greedy) or the target's distribution (sampled, chi-squared), and a cache that cannot
hold a tree verifies the tree's first chain instead."""

import itertools
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from scipy import stats as scipy_stats
from tiny_models import tiny_llama, tiny_qwen3_next

from mlxspec.engine import Draft, Drafter, SpecStats, speculative_tokens
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.sampling import SamplingConfig
from mlxspec.backends.mlx.sampling import processed_logprobs
from mlxspec.tree import TreeShape
from mlxspec.backends.mlx.tree_pass import attention_modules, tree_pass

VOCAB, N = 24, 14
SHAPE = TreeShape((0, 0, 0, 1, 1, 4, 2, 6))  # 3 children at the root, depth 4 under the first


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=VOCAB, seed=21, sharpness=8.0)


def paths(shape: TreeShape) -> list[list[int]]:
    """Nodes from the root to each node (the root's own path is empty)."""
    out = [[]]
    for node, parent in enumerate(shape.parents, start=1):
        out.append(out[parent] + [node])
    return out


def test_each_node_is_scored_after_its_own_branch(target):
    """A node's logits in the tree pass are the target's after context + the node's branch."""
    context = [3, 1, 4, 1, 5, 9, 2]
    tokens = [7, 8, 9, 10, 11, 12, 13, 14]
    cache = make_prompt_cache(target)
    target(mx.array(context[:-1])[None], cache=cache)
    with tree_pass(attention_modules(target), cache, SHAPE) as view:
        logits = target(mx.array([context[-1]] + tokens)[None], cache=view)[0]
    for node, branch in enumerate(paths(SHAPE)):
        sequence = context + [tokens[n - 1] for n in branch]
        alone = target(mx.array(sequence)[None])[0, -1]
        assert mx.allclose(logits[node], alone, atol=1e-4).item(), node


def greedy_reference(model, prompt, n=N):
    ids, out = list(prompt), []
    for _ in range(n):
        out.append(int(mx.argmax(model(mx.array(ids)[None])[0, -1]).item()))
        ids.append(out[-1])
    return out


class PlantedTreeDrafter(Drafter):
    """A tree of SHAPE whose branch through `branch_leaf` holds the true continuation with the
    token at depth `wrong` (1-based) made wrong, every other node a wrong token."""

    name = "planted-tree"

    def __init__(self, full, branch_leaf: int, wrong: int | None):
        self.full, self.leaf, self.wrong = full, branch_leaf, wrong

    def propose(self, tokens, k, sampling):
        shape = TreeShape(SHAPE.parents[:k])  # the first k nodes: still a tree
        on_branch = set(paths(SHAPE)[self.leaf])
        drafts = []
        for node in range(1, shape.size + 1):
            depth = shape.depth[node]
            true = self.full[len(tokens) + depth - 1] if len(tokens) + depth - 1 < len(
                self.full) else 0
            right = node in on_branch and depth != self.wrong
            drafts.append(true if right else (true + 1 + node) % VOCAB)
        return Draft(tokens=drafts, parents=shape.parents)


@pytest.mark.parametrize("leaf", [5, 8, 3])
@pytest.mark.parametrize("wrong", [None, 1, 2, 3])
def test_greedy_output_is_plain_decoding_and_the_cache_holds_the_branch(target, leaf, wrong):
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    reference = greedy_reference(target, prompt)
    full = prompt + reference
    model_target = MLXTarget(target, speculative=True)
    stats = SpecStats()
    out = [t for t, _ in speculative_tokens(
        model_target, PlantedTreeDrafter(full, leaf, wrong), prompt, sampling=SamplingConfig(),
        max_tokens=N, num_draft=SHAPE.size, stats=stats)]
    assert out == reference
    depth = SHAPE.depth[leaf]
    want = depth if wrong is None else min(depth, wrong - 1)
    assert stats.accepted >= want and stats.chain_fallback_steps == 0
    committed = prompt + out
    fresh = make_prompt_cache(target)
    target(mx.array(committed[:-1])[None], cache=fresh)
    for ours, theirs in zip(model_target.cache, fresh):
        held = theirs.offset
        assert ours.offset == held == len(committed) - 1
        assert mx.allclose(ours.keys[..., :held, :], theirs.keys[..., :held, :], atol=1e-4).item()
        assert mx.allclose(ours.values[..., :held, :], theirs.values[..., :held, :],
                           atol=1e-4).item()


def test_a_hybrid_target_verifies_the_first_chain_and_says_so():
    model = tiny_qwen3_next(vocab=VOCAB, seed=3)
    prompt = [1, 2, 3, 4, 5]
    reference = greedy_reference(model, prompt)
    stats = SpecStats()
    out = [t for t, _ in speculative_tokens(
        MLXTarget(model, speculative=True), PlantedTreeDrafter(prompt + reference, 5, None),
        prompt, sampling=SamplingConfig(), max_tokens=N, num_draft=SHAPE.size, stats=stats)]
    assert out == reference
    assert stats.chain_fallback_steps > 0 and stats.accepted > 0


# ---- sampled: the target's distribution, exactly ----------------------------------------------

SMALL_VOCAB, LENGTH, PROMPT, SAMPLES = 5, 3, [0, 1], 2000
SAMPLING = SamplingConfig(temp=0.8, top_p=0.95)
BINARY = TreeShape((0, 0, 1, 1, 2, 2))


class TableTreeDrafter(Drafter):
    """Trees of BINARY from a fixed distribution p: children drawn from it independently
    (sampled) or its top tokens in order (deterministic)."""

    def __init__(self, sampled: bool):
        self.sampled = sampled
        logits = np.random.default_rng(5).normal(size=SMALL_VOCAB)
        self.p = np.exp(logits) / np.exp(logits).sum()
        self.rng = np.random.default_rng(6)

    def propose(self, tokens, k, sampling):
        shape = TreeShape(BINARY.parents[:k])  # the first k nodes: still a tree
        order = list(np.argsort(-self.p))
        drafts = [int(self.rng.choice(SMALL_VOCAB, p=self.p)) if self.sampled
                  else int(order[shape.children[parent].index(node)])
                  for node, parent in enumerate(shape.parents, start=1)]
        probs = mx.array(np.tile(self.p, (shape.size + 1, 1)), dtype=mx.float32)
        return Draft(tokens=drafts, parents=shape.parents, probs=probs if self.sampled else None)


@pytest.fixture(scope="module")
def small_target():
    return tiny_llama(vocab=SMALL_VOCAB, seed=11, sharpness=2.5)


def exact_distribution(model):
    probs = {}
    for seq in itertools.product(range(SMALL_VOCAB), repeat=LENGTH):
        logq = processed_logprobs(model(mx.array(PROMPT + list(seq))[None])[0], SAMPLING)
        probs[seq] = float(np.exp(sum(logq[len(PROMPT) - 1 + i, seq[i]].item()
                                      for i in range(LENGTH))))
    return probs


def tree_pvalue(small_target, sampled):
    mx.random.seed(99)
    drafter, counts = TableTreeDrafter(sampled), Counter()
    stats = SpecStats()
    for _ in range(SAMPLES):  # generations long enough for the first pass to verify all BINARY
        out = speculative_tokens(MLXTarget(small_target, speculative=True), drafter, PROMPT,
                                 sampling=SAMPLING, max_tokens=BINARY.size + 1,
                                 num_draft=BINARY.size, stats=stats)
        counts[tuple(t for t, _ in out)[:LENGTH]] += 1
    assert stats.drafted >= SAMPLES * BINARY.size and stats.accepted > 0
    exact = exact_distribution(small_target)
    expected = np.array([exact[s] for s in exact])
    expected = expected / expected.sum() * SAMPLES
    observed = np.array([counts.get(s, 0) for s in exact])
    big = expected >= 5
    return scipy_stats.chisquare(np.append(observed[big], observed[~big].sum()),
                                   np.append(expected[big], expected[~big].sum())).pvalue


@pytest.mark.slow  # χ²: thousands of sampled generations
@pytest.mark.parametrize("sampled", [False, True], ids=["top-k", "sampled"])
def test_sampled_trees_keep_the_target_distribution(small_target, sampled):
    assert tree_pvalue(small_target, sampled) > 1e-3


@pytest.mark.slow  # χ²: thousands of sampled generations
def test_a_biased_tree_rule_fails_the_same_test(small_target, monkeypatch):
    """The engine-level test has power: a rule that draws the next token from the target's q
    where the branch ends, not from what the rejections left of it, is caught."""
    import mlxspec.backends.mlx.target as mlx_backend
    from test_tree_acceptance import wrong_rule

    monkeypatch.setattr(mlx_backend, "accept_tree_sampled", wrong_rule)
    assert tree_pvalue(small_target, sampled=False) < 1e-4


def test_lookup_branches_merge_into_one_tree():
    """Runs that followed different earlier matches share their common prefix; the first run is
    the first chain; the budget caps the nodes, filled depth by depth."""
    from mlxspec.drafters.lookup import merged_tree

    draft = merged_tree([[5, 6, 7], [5, 8], [9]], budget=10)
    assert draft.tokens == [5, 9, 6, 8, 7] and draft.parents == (0, 0, 1, 1, 3)
    assert TreeShape(draft.parents).first_chain() == [1, 3, 5]
    assert merged_tree([[5, 6, 7], [5, 8], [9]], budget=3).tokens == [5, 9, 6]


@pytest.mark.parametrize("prompt", [[1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 4, 1, 2], [7, 7, 7], [3]])
def test_lookup_with_branches_is_lossless(target, prompt):
    from mlxspec.drafters.lookup import PromptLookupDrafter

    reference = greedy_reference(target, prompt, 20)
    stats = SpecStats()
    out = [t for t, _ in speculative_tokens(
        MLXTarget(target, speculative=True), PromptLookupDrafter(branches=3), prompt,
        sampling=SamplingConfig(), max_tokens=20, num_draft=8, stats=stats)]
    assert out == reference


# ---- from the CLI and the API --------------------------------------------------------------------


def cli(*args):
    from click.testing import CliRunner

    from mlxspec.cli.main import main

    result = CliRunner().invoke(main, ["generate", "--no-chat-template", "-n", "24", "-p",
                                       "def add(a, b):\n    return a + b\n\ndef add(a, b):",
                                       *args])
    assert result.exit_code == 0, result.output
    return result


@pytest.mark.slow
def test_trees_from_the_cli_are_lossless_on_the_default_model():
    """DDTree on the shipped DFlash drafter and branched prompt lookup: the plain output, with
    drafts accepted."""
    import re

    plain = cli()
    for options in (["--drafter", "dflash", "--tree-budget", "12"],
                    ["--drafter", "lookup", "--lookup-branches", "3"],
                    ["--drafter", "dflash+lookup", "--tree-budget", "8", "--tree-width", "2"]):
        spec = cli(*options, "--verbose")
        assert spec.stdout == plain.stdout, options
        assert int(re.search(r"accepted: (\d+)", spec.stderr)[1]) > 0, spec.stderr


def test_tree_options_are_checked_before_the_model_loads():
    from click.testing import CliRunner

    from mlxspec.cli.main import main

    for options, words in ((["--drafter", "lookup", "--tree-budget", "4"], "only applies to"),
                           (["--drafter", "dflash", "--lookup-branches", "2"], "only applies to"),
                           (["--drafter", "dflash", "--tree-budget", "0"], "must be >= 1"),
                           (["--drafter", "lookup", "--lookup-branches", "0"], "must be >= 1")):
        result = CliRunner().invoke(main, ["generate", "-p", "hi", "-n", "2", *options])
        assert result.exit_code != 0 and words in result.output, result.output
        assert "Traceback" not in result.output


def test_the_api_takes_tree_options():
    import mlxspec

    model, tokenizer = mlxspec.load(None)
    prompt = "one two three one two three one two"
    plain = mlxspec.generate(model, tokenizer, prompt, max_tokens=12)
    drafter = mlxspec.drafters.load_drafter("lookup", model=model, tokenizer=tokenizer,
                                            branches=2)
    assert mlxspec.generate(model, tokenizer, prompt, max_tokens=12, drafter=drafter) == plain
    dflash = mlxspec.drafters.load_drafter("dflash", model=model, tokenizer=tokenizer,
                                           tree_budget=6)
    assert mlxspec.generate(model, tokenizer, prompt, max_tokens=12, drafter=dflash) == plain


def test_a_tree_budget_is_chosen_by_throughput(target):
    """The adaptive K models a chain's acceptance by position; a tree drafter's node budget is
    chosen by the committed tokens per second each budget yields instead."""
    from mlxspec.drafters.hybrid import LookupFirstDrafter
    from mlxspec.drafters.lookup import PromptLookupDrafter
    from mlxspec.draft_length import AdaptiveDraftLength, TreeBudget

    tree = PromptLookupDrafter(branches=3)
    assert isinstance(tree.draft_policy(8, True), TreeBudget)
    both = LookupFirstDrafter(PromptLookupDrafter(), PromptLookupDrafter(branches=2))
    policy = both.draft_policy(8, True)
    assert isinstance(policy.copier, TreeBudget) and isinstance(policy.model, AdaptiveDraftLength)
    assert not PromptLookupDrafter().drafts_trees
    stats = SpecStats()
    out = [t for t, _ in speculative_tokens(
        MLXTarget(target, speculative=True), tree, [1, 2, 3, 1, 2, 4, 1, 2],
        sampling=SamplingConfig(), max_tokens=12, num_draft=8, stats=stats, adaptive=True)]
    assert out == greedy_reference(target, [1, 2, 3, 1, 2, 4, 1, 2], 12)


def test_tree_budget_settles_on_the_best_rate_and_keeps_probing_its_neighbours():
    from mlxspec.draft_length import TreeBudget

    policy = TreeBudget(32, probe_every=4)
    assert policy.budgets == [1, 2, 4, 8, 16, 32]
    rate = {1: 10.0, 2: 14.0, 4: 20.0, 8: 16.0, 16: 9.0, 32: 5.0}  # tokens per second
    chosen = []
    for _ in range(60):
        k = policy.next_k()
        chosen.append(k)
        policy.update(k, 1, 2 / rate[k])  # 2 tokens committed in 2 / rate seconds
    assert chosen[:6] == [32, 16, 8, 4, 2, 1]  # each tried once, the largest first
    settled = chosen[6:]
    assert settled.count(4) > 0.7 * len(settled) and set(settled) <= {2, 4, 8}
