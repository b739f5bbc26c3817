"""Acceptance of draft trees: greedy picks the branch greedy decoding takes; sampled acceptance
(multi-candidate rejection sampling) reproduces the target's distribution exactly (chi-squared,
with trees of 2+ children per node and depth 2+), and a wrong rule fails the same test.

The target and the drafter are tables: a random distribution over a 4-token vocabulary for every
context, so the exact probability of every 3-token continuation is a product of table entries.
"""

import itertools
import zlib
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats as scipy_stats

from mlxspec.sampling import SamplingConfig
from mlxspec.tree import TreeShape, best_first_tree
from mlxspec.backends.mlx.tree_acceptance import accept_tree_greedy, accept_tree_sampled

VOCAB, LENGTH, SAMPLES = 4, 3, 3000
SAMPLING = SamplingConfig(temp=1.0)
# Depth 2, two children per node: the pending token's children 1, 2; theirs 3, 4 and 5, 6.
BINARY = TreeShape((0, 0, 1, 1, 2, 2))
# Uneven: three children at the root, a chain of three under the first.
UNEVEN = TreeShape((0, 0, 0, 1, 4, 5))


def table(context: tuple, salt: str, sharpness: float) -> np.ndarray:
    """A fixed random distribution for each context."""
    seed = zlib.crc32(repr((salt, context)).encode())
    logits = np.random.default_rng(seed).normal(size=VOCAB) * sharpness
    probs = np.exp(logits - logits.max())
    return probs / probs.sum()


def target_q(context):
    return table(tuple(context), "target", 1.5)


def drafter_p(context):
    return table(tuple(context), "drafter", 1.0)


def build_tree(context, shape: TreeShape, sampled: bool, rng):
    """Draft tokens for `shape` after `context`: each node's children are its drafter
    distribution's top tokens (deterministic) or independent draws from it (sampled); returns
    tokens (N,), the target's logits at nodes 0..N and the drafter's rows at nodes 0..N."""
    tokens, paths = [], [()]
    for node, parent in enumerate(shape.parents, start=1):
        p = drafter_p(list(context) + list(paths[parent]))
        rank = shape.children[parent].index(node)
        token = int(rng.choice(VOCAB, p=p)) if sampled else int(np.argsort(-p)[rank])
        tokens.append(token)
        paths.append(paths[parent] + (token,))
    logits = np.log([target_q(list(context) + list(path)) for path in paths])
    probs = np.array([drafter_p(list(context) + list(path)) for path in paths])
    return mx.array(tokens, dtype=mx.int32), mx.array(logits), mx.array(probs)


def sample_sequences(shape, sampled, samples=SAMPLES, rule=accept_tree_sampled):
    mx.random.seed(7)
    rng = np.random.default_rng(8)
    counts = Counter()
    for _ in range(samples):
        out = []
        while len(out) < LENGTH:
            tokens, logits, probs = build_tree(out, shape, sampled, rng)
            accepted, next_token, path = rule(logits, tokens, shape,
                                              probs if sampled else None, SAMPLING)
            accepted, next_token, path = int(accepted), int(next_token), path.tolist()
            branch = path[len(path) - accepted :] if accepted else []
            out += [int(tokens[node - 1]) for node in branch] + [next_token]
        counts[tuple(out[:LENGTH])] += 1
    return counts


def chi_squared_pvalue(counts):
    exact = {seq: np.prod([target_q(list(seq[:i]))[seq[i]] for i in range(LENGTH)])
             for seq in itertools.product(range(VOCAB), repeat=LENGTH)}
    observed = [counts.get(seq, 0) for seq in exact]
    expected = np.array(list(exact.values())) * sum(observed)
    big = expected >= 5
    observed = np.array(observed)
    pooled_obs = np.append(observed[big], observed[~big].sum())
    pooled_exp = np.append(expected[big], expected[~big].sum())
    return scipy_stats.chisquare(pooled_obs, pooled_exp).pvalue


@pytest.mark.slow  # χ²: thousands of sampled generations
@pytest.mark.parametrize("shape", [BINARY, UNEVEN], ids=["binary", "uneven"])
@pytest.mark.parametrize("sampled", [False, True], ids=["top-k", "sampled"])
def test_sampled_tree_acceptance_is_exact(shape, sampled):
    counts = sample_sequences(shape, sampled)
    assert chi_squared_pvalue(counts) > 1e-3


def wrong_rule(logits, tokens, shape, draft_probs, sampling):
    """The right acceptance, but the next token drawn from the target's q where the branch ends
    instead of what the rejections left of it: biased towards the drafted tokens."""
    accepted, _, path = accept_tree_sampled(logits, tokens, shape, draft_probs, sampling)
    return accepted, mx.random.categorical(logits[path[-1]] / sampling.temp), path


@pytest.mark.slow  # χ²: thousands of sampled generations
@pytest.mark.parametrize("sampled", [False, True], ids=["top-k", "sampled"])
def test_a_rule_without_the_residual_fails_the_same_test(sampled):
    """The chi-squared test must catch a biased rule, or it proves nothing."""
    counts = sample_sequences(BINARY, sampled, rule=wrong_rule)
    assert chi_squared_pvalue(counts) < 1e-4


def test_greedy_takes_the_branch_greedy_decoding_takes():
    """Every node's tokens are tried; the committed branch is the longest one along which each
    draft is the target's argmax after its parent, and the next token the argmax after it."""
    rng = np.random.default_rng(3)
    for context in ([], [1], [2, 3], [0, 0, 1]):
        for shape in (BINARY, UNEVEN, TreeShape.chain(4), TreeShape(())):
            tokens, logits, _ = build_tree(context, shape, sampled=True, rng=rng)
            accepted, next_token, path = accept_tree_greedy(logits, tokens, shape)
            accepted, next_token, path = int(accepted), int(next_token), path.tolist()
            greedy, node = [], 0
            while True:  # walk down: the child holding the target's argmax, if any
                want = int(np.argmax(logits[node]))
                match = [c for c in shape.children[node] if int(tokens[c - 1]) == want]
                if not match:
                    break
                node = match[0]
                greedy.append(node)
            assert accepted == len(greedy)
            assert path[len(path) - accepted :] == greedy if accepted else True
            assert next_token == int(np.argmax(logits[node]))


def test_a_tree_shape_lists_parents_before_children():
    with pytest.raises(ValueError, match=r"\[2\]"):
        TreeShape((0, 2))
    shape = TreeShape((0, 0, 1))
    assert shape.depth == (0, 1, 1, 2) and shape.children == ((1, 2), (3,), (), ())
    assert TreeShape.chain(3).parents == (0, 1, 2)


def test_best_first_tree_grows_the_most_probable_branches():
    """By hand: the argmax chain first, then the best sibling; and on random candidates the
    nodes kept are exactly the `budget` branches of highest log-probability (every branch's
    score falls along it, so those form a tree)."""
    ranks, shape = best_first_tree([[-0.1, -2.5], [-0.2, -1.0], [-0.3]], budget=4)
    assert ranks == [0, 0, 0, 1] and shape.parents == (0, 1, 2, 1)
    assert shape.first_chain() == [1, 2, 3]
    rng = np.random.default_rng(0)
    for budget in (1, 5, 12, 39, 60):
        logprobs = [sorted(np.log(rng.dirichlet(np.ones(3)))[::-1].tolist(), reverse=True)
                    for _ in range(3)]
        ranks, shape = best_first_tree(logprobs, budget)
        branches = [()]
        for node, (parent, rank) in enumerate(zip(shape.parents, ranks), start=1):
            branches.append(branches[parent] + (rank,))
        every = [b for d in (1, 2, 3) for b in itertools.product(range(3), repeat=d)]
        score = {b: sum(logprobs[d][r] for d, r in enumerate(b)) for b in every}
        best = sorted(every, key=lambda b: -score[b])[: min(budget, len(every))]
        assert sorted(branches[1:]) == sorted(best)
