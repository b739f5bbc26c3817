"""Suffix decoding (issue #40): the tries' counts and eviction, what a match drafts, the history
shared by forks, and lossless output with wrong continuations planted in that history."""

import json
import random
from pathlib import Path

import mlx.core as mx
import pytest
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
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.drafters.suffix import (
    SuffixDrafter,
    SuffixHistory,
    SuffixTrie,
    draft_from,
    speculate,
)
from mlxspec.engine import Drafter, SpecStats, speculative_tokens
from mlxspec.sampling import SamplingConfig
from mlxspec.tree import TreeShape

GREEDY = SamplingConfig()


def test_a_sequence_removed_leaves_the_trie_as_it_was():
    rnd = random.Random(0)
    trie = SuffixTrie(depth=5)
    kept = [rnd.randrange(4) for _ in range(40)]
    trie.add(kept)
    nodes = trie.nodes
    counts = _counts(trie.root)
    other = [rnd.randrange(4) for _ in range(30)]
    trie.add(other)
    assert trie.nodes > nodes
    trie.remove(other)
    assert trie.nodes == nodes
    assert _counts(trie.root) == counts  # every count as it was (ties may swap places)
    trie.remove(kept)
    assert trie.nodes == 1 and not trie.root.children


def _counts(node, path=()):
    """{path: count} of every node."""
    out = {path: node.count}
    for token, child in node.children.items():
        out.update(_counts(child, path + (token,)))
    return out


def _ordered(node) -> bool:
    """Every node's children are in `order`, most frequent first."""
    counts = [c.count for _, c in node.order]
    return counts == sorted(counts, reverse=True) and all(
        _ordered(c) for c in node.children.values())


def test_windows_are_counted_up_to_the_depth():
    trie = SuffixTrie(depth=3)
    trie.extend([1, 2])
    trie.extend([1, 2, 1])  # grown in two calls: one sequence 1 2 1 2 1
    assert trie.root.count == 5
    assert trie.root.children[1].count == 3
    assert trie.root.children[1].children[2].count == 2
    assert trie.root.children[1].children[2].children[1].count == 2
    assert max(_depths(trie.root)) == 3


def _depths(node):
    yield node.depth
    for child in node.children.values():
        yield from _depths(child)


def test_history_stays_under_its_node_budget_oldest_first():
    rnd = random.Random(1)
    history = SuffixHistory(depth=6, max_nodes=400)
    replies = [[rnd.randrange(50) for _ in range(30)] for _ in range(20)]
    for reply in replies:
        history.add(reply)
        assert history.trie.nodes <= 400
    kept = list(history.replies.values())
    assert kept[-1] == replies[-1] and len(kept) < len(replies)  # the newest are kept
    assert kept == replies[len(replies) - len(kept) :]
    fresh = SuffixTrie(6)
    for reply in kept:
        fresh.add(reply)
    assert fresh.nodes == history.trie.nodes  # what is left counts exactly what is kept
    assert _counts(fresh.root) == _counts(history.trie.root) and _ordered(history.trie.root)


def test_a_reply_being_generated_drafts_for_another_request_at_once():
    history = SuffixHistory()
    a, b = history.start(), history.start()
    history.extend(a, [10, 11, 12, 13])
    history.extend(b, [30, 31])
    history.extend(a, [14])
    assert speculate(history.trie, [0, 11, 12], 8, 1.0, 0.1, False)[0] == [13, 14]
    history.finish(a)
    assert history.trie.find([13, 14, 30]) is None  # replies never run into each other


def test_a_longer_match_drafts_further_and_rare_paths_are_not_drafted():
    drafter = SuffixDrafter()
    drafter.history.add([5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    drafter.begin([0])
    assert drafter.propose([0, 0, 6], 16, GREEDY).tokens == [7]  # matched 1: drafts 1
    assert drafter.propose([0, 5, 6, 7], 16, GREEDY).tokens == [8, 9, 10]  # matched 3
    assert drafter.propose([0, 5, 6, 7], 2, GREEDY).tokens == [8, 9]  # K caps it
    trie = SuffixTrie(depth=8)
    for tail in [[1, 2]] * 9 + [[1, 3]]:
        trie.add([9] + tail)
    tokens, _, probs = draft_from(trie.find([9]), 8, min_prob=0.2, tree=True)
    assert tokens == [1, 2]  # 3 follows 1 one time in ten: under min_prob
    assert probs == pytest.approx([1.0, 0.9])


def test_a_tree_s_first_chain_is_the_chain():
    rnd = random.Random(2)
    trie = SuffixTrie(depth=10)
    for _ in range(30):
        trie.add([7] + [rnd.randrange(3) for _ in range(8)])
    node = trie.find([7])
    chain, _, _ = draft_from(node, 6, min_prob=0.0, tree=False)
    tokens, parents, _ = draft_from(node, 12, min_prob=0.0, tree=True)
    first = TreeShape(tuple(parents)).first_chain()
    assert [tokens[n - 1] for n in first] == chain[: len(first)]
    assert len(set(parents)) > 1 and len(tokens) == 12


def test_forks_share_the_history_and_keep_their_own_request():
    drafter = SuffixDrafter()
    a, b = drafter.fork(), drafter.fork()
    a.begin([1, 2])
    b.begin([8, 9])
    a.commit([1, 2, 40, 41, 42, 43], None)
    assert b.propose([8, 9, 40, 41], 8, GREEDY).tokens == [42, 43]
    a.end([1, 2, 40, 41, 42, 43])
    assert drafter.history is a.history is b.history
    assert a._request is None and b._request is not None


def run(model, drafter, prompt, k=6, adaptive=False, max_tokens=24):
    stats = SpecStats()
    target = MLXTarget(model, speculative=True)
    out = speculative_tokens(target, drafter, prompt, sampling=GREEDY, max_tokens=max_tokens,
                             num_draft=k, stats=stats, adaptive=adaptive)
    return [t for t, _ in out], stats


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=16, hidden=32, layers=2, seed=3, sharpness=3.0)


@pytest.mark.parametrize("tree", [False, True])
def test_wrong_continuations_in_the_history_change_nothing(target, tree):
    """The history holds the target's own continuations with one token changed at a place that
    moves, so drafts are accepted up to a point and rejected there: output equals plain."""
    rnd = random.Random(3)
    prompts = [[rnd.randrange(16) for _ in range(n)] for n in (3, 6, 9)]
    drafter = SuffixDrafter(tree=tree, min_prob=0.0)
    for prompt in prompts:
        plain, _ = run(target, Drafter(), prompt)
        for at in range(0, 24, 5):
            spoiled = list(plain)
            spoiled[at] = (spoiled[at] + 1) % 16
            drafter.history.add(prompt[-2:] + spoiled)
        out, stats = run(target, drafter, prompt)
        assert out == plain
        assert stats.drafted > 0 and stats.accepted > 0
        assert 0 < stats.accepted < stats.drafted  # some drafts right, some rejected


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_model_drafter_behind_suffix_drafts_where_no_reply_matches(target, adaptive):
    """draft+suffix: wrong continuations planted for one prompt; the suffix copier drafts where
    the history matches and the draft model elsewhere, and the output equals plain."""
    from mlxspec.overhead import tiny_drafter

    drafter = tiny_drafter("draft+suffix", target)
    assert drafter.name == "draft+suffix" and drafter.remembers
    drafted = {"copier": 0, "model": 0}
    for part, key in ((drafter.copier, "copier"), (drafter.model_drafter, "model")):
        def counted(*args, _propose=part.propose, _key=key):
            draft = _propose(*args)
            drafted[_key] += len(draft.tokens)
            return draft
        part.propose = counted
    rnd = random.Random(5)
    prompts = [[rnd.randrange(16) for _ in range(n)] for n in (4, 7)]
    plain, _ = run(target, Drafter(), prompts[0])
    for at in (4, 11, 18):
        spoiled = list(plain)
        spoiled[at] = (spoiled[at] + 1) % 16
        drafter.copier.history.add(prompts[0][-2:] + spoiled)
    for prompt in prompts:
        out, stats = run(target, drafter, prompt, adaptive=adaptive)
        assert out == run(target, Drafter(), prompt)[0]
        if not adaptive:  # an adaptive K follows measured step times: its counts vary
            assert 0 < stats.accepted < stats.drafted
    assert drafted["copier"] > 0, drafted
    assert adaptive or drafted["model"] > 0, drafted  # at a fixed K a copy must expect 1 token


def test_a_finished_generation_teaches_the_next(target):
    """The same prompt twice through the API: the first reply, kept in the drafter's history,
    drafts the second, which then needs half the target passes or fewer; both equal plain."""
    prompt = [3, 1, 4, 1, 5]
    plain, _ = run(target, Drafter(), prompt, max_tokens=40)
    drafter = SuffixDrafter()
    first, first_stats = run(target, drafter, prompt, max_tokens=40)
    second, second_stats = run(target, drafter, prompt, max_tokens=40)
    assert first == second == plain
    assert second_stats.accepted == second_stats.drafted > 0  # its own reply: always right
    assert second_stats.target_passes <= first_stats.target_passes / 2


def test_batch_rows_share_the_history(target):
    from test_api_hardening import tiny_tokenizer

    tokenizer = tiny_tokenizer(16)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [5] * 11, [3]]
    plain = mlxspec.batch_generate(target, tokenizer, prompts, 16)
    drafter = mlxspec.load_drafter("suffix", model=target, tokenizer=tokenizer)
    for _ in range(2):  # the second batch drafts from the first's replies
        out = mlxspec.batch_generate(target, tokenizer, prompts, 16, drafter=drafter)
        assert out.token_ids == plain.token_ids
    assert sum(s.accepted for s in out.stats) > 0
    assert len(drafter.history.replies) == 2 * len(prompts)
    assert all(reply for reply in drafter.history.replies.values())


@pytest.mark.slow  # χ²: thousands of sampled generations
def test_sampled_suffix_drafts_follow_the_target_distribution():
    """Sampled decoding with suffix drafts (a history of sequences the target often disagrees
    with, and the request's own) reproduces the target's exact 3-token distribution."""
    model = tiny_llama(vocab=VOCAB, seed=11, sharpness=2.5)
    exact = exact_distribution(model, SAMPLING)
    drafter = SuffixDrafter(min_prob=0.0)
    rnd = random.Random(4)
    for _ in range(40):
        drafter.history.add(PROMPT + [rnd.randrange(VOCAB) for _ in range(LENGTH)])
    drafter.end = lambda tokens: None  # a fixed history: every sample drafts from the same
    mx.random.seed(1234)
    counts, drafted = {}, 0
    for _ in range(SAMPLES):
        stats = SpecStats()
        out = speculative_tokens(MLXTarget(model, speculative=True), drafter, PROMPT,
                                 sampling=SAMPLING, max_tokens=LENGTH, num_draft=2, stats=stats)
        seq = tuple(t for t, _ in out)
        counts[seq] = counts.get(seq, 0) + 1
        drafted += stats.drafted
    assert drafted > SAMPLES
    assert chi_squared_pvalue(counts, exact) > 0.001


@pytest.mark.slow  # the real model through the CLI
def test_cli_generate_with_suffix_is_the_plain_text():
    from test_cli import QUESTION, N, invoke, ok

    plain = ok(invoke("generate", "--prompt", QUESTION, "--max-tokens", N))
    for options in ([], ["--suffix-tree", "--suffix-depth", "8", "--suffix-min-prob", "0.2"]):
        r = ok(invoke("generate", "--prompt", QUESTION, "--max-tokens", N, "--drafter", "suffix",
                      "--verbose", *options))
        assert r.stdout == plain.stdout
        assert "Drafter: suffix" in r.stderr


FIXTURES = Path(__file__).parent / "fixtures" / "suffix" / "arctic.json"


def test_the_same_drafts_as_arctic_inference_from_the_same_requests():
    """Arctic Inference's suffix tree (scripts/suffix_parity_fixtures.py) and ours, fed the same
    overlapping requests: every chain is the same, and every tree has the same nodes' path
    frequencies and score; equally likely branches may come in another order (Arctic's
    std::priority_queue breaks ties its own way), which leaves most trees identical too."""
    fixtures = json.loads(FIXTURES.read_text())
    chains = trees = same_trees = 0
    for case in fixtures["cases"]:
        for run_ in case["runs"]:
            k, factor, min_prob, tree = run_["setting"]
            drafter = SuffixDrafter(depth=fixtures["depth"], spec_factor=factor,
                                    min_prob=min_prob, tree=tree)
            forks, replied = {}, {}
            for (i, j), want in zip(run_["schedule"], run_["drafts"]):
                request = case["requests"][i]
                if i not in forks:
                    forks[i] = drafter.fork()
                    forks[i].begin(list(request["prompt"]))
                replied[i] = min(j + 2, len(request["reply"]))
                tokens = request["prompt"] + request["reply"][: replied[i]]
                forks[i].commit(tokens, None)
                drafted, parents, probs = forks[i].speculate(tokens, k)
                where = (case["seed"], run_["setting"], i, replied[i])
                assert sum(probs) == pytest.approx(want["score"], abs=1e-5), where
                assert sorted(probs) == pytest.approx(sorted(want["probs"]), abs=1e-5), where
                if not tree:
                    assert drafted == want["tokens"], where
                    chains += bool(drafted)
                elif drafted:
                    trees += 1
                    same_trees += (drafted, parents) == \
                        (want["tokens"], [p + 1 for p in want["parents"]])
                if replied[i] == len(request["reply"]):
                    forks[i].end(tokens)
    assert chains > 300 and trees > 300
    print(f"\nchains {chains}, trees {trees}, identical trees {same_trees}")
    assert same_trees >= 0.95 * trees, (same_trees, trees)


def test_forget_starts_an_empty_history():
    drafter = SuffixDrafter()
    drafter.history.add([1, 2, 3, 4])
    fork = drafter.fork()
    drafter.forget()
    assert drafter.history.trie.nodes == 1 and fork.history is not drafter.history
    assert drafter.fork().history is drafter.history


@pytest.mark.slow  # loads the real model through the CLI
def test_bench_gives_each_suffix_label_its_own_history(monkeypatch):
    """`bench --drafters suffix,suffix@4`: one label's replies must not draft the other's (the
    same prompt runs under both), unlike drafters that keep nothing across requests."""
    import mlxspec.bench
    from test_cli import invoke

    seen = {}

    def fake_run_benchmark(*args, drafters, **kwargs):
        seen.update(drafters)
        raise SystemExit(0)

    monkeypatch.setattr(mlxspec.bench, "run_benchmark", fake_run_benchmark)
    invoke("bench", "--drafters", "suffix,suffix@4,lookup,lookup@4", "--no-mlx-lm",
           "--suite", "copy", "--limit", "1")
    assert seen["suffix"] is not seen["suffix@4"]
    assert seen["suffix"].history is not seen["suffix@4"].history
    assert seen["lookup"] is seen["lookup@4"]


def test_copiers_choose_k_by_the_length_of_their_match():
    """Long matches accepted in full, one-token matches never: the policy drafts the most K in
    the first case and at most one in the second, from one shared time model."""
    from mlxspec.draft_length import MatchLengthDraftLength, bucket_of

    assert [bucket_of(n) for n in (0, 1, 2, 3, 4, 7, 8, 15, 16, 40)] == \
        [0, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    match = [20]
    policy = MatchLengthDraftLength(8, lambda: match[0])
    for _ in range(20):
        for length, accepted in ((20, 8), (1, 0)):
            match[0] = length
            k = policy.next_k()
            policy.update(k, min(accepted, k), 1.0 + 0.05 * k)
    match[0] = 20
    assert policy.next_k() == 8
    match[0] = 1
    assert policy.next_k() <= 1
    assert set(policy.curves) == {bucket_of(20), bucket_of(1)}


def test_lookup_and_suffix_measure_their_current_match():
    from mlxspec.drafters import PromptLookupDrafter

    text = [5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8]  # 5 6 7 8 again: a 4-token match
    lookup = PromptLookupDrafter()
    lookup.begin(text)
    assert lookup.match_length(text) == 4
    assert lookup.match_length(text + [2]) == 1  # only "2" appeared before, after a 1
    fresh = PromptLookupDrafter()
    fresh.begin([1, 2, 3])
    assert fresh.match_length([1, 2, 3]) == 0
    suffix = SuffixDrafter()
    suffix.begin(text)
    assert suffix.match_length(text) == 4
    suffix.history.add([1, 9, 9, 3, 4, 5, 6, 7, 8, 2])
    assert suffix.match_length(text) == 6  # "3 4 5 6 7 8" then 2, in an earlier reply


def test_suffix_keeps_the_part_of_its_draft_worth_verifying():
    """ScoredDraftLength: the drafter drafts what its own rules allow; the step keeps the prefix
    whose path frequencies pay for its verify time (sure tokens kept, rare ones dropped when a
    draft token costs a fifth of a step), and where predicted tokens keep being rejected the
    frequencies are trusted less, down to a probe draft now and then."""
    from mlxspec.draft_length import ScoredDraftLength
    from mlxspec.engine import Draft

    probs = [1.0, 1.0, 1.0, 0.9, 0.15, 0.12]
    policy = ScoredDraftLength(16, lambda: probs)
    assert policy.next_k() == 16
    for k in (0, 1, 4):  # a step costs 1 + 0.2 K plain steps
        policy.update(k, k, 1.0 + 0.2 * k)
    draft = Draft(tokens=[1, 2, 3, 4, 5, 6])
    assert policy.keep(draft) == 4
    probs[:] = [1.0] * 6
    assert policy.keep(draft) == 6
    for _ in range(30):  # every predicted token wrong
        kept = policy.keep(draft)
        policy.update(kept, 0, 1.0 + 0.2 * kept)
    assert policy.calibration < 0.2
    kept = [policy.keep(draft) for _ in range(policy.probe_every)]
    assert kept.count(0) == policy.probe_every - 1 and kept.count(1) == 1
    tree = Draft(tokens=[1, 2], parents=(0, 0))
    assert policy.keep(tree) == 2  # kept whole: a tree's budget is TreeBudget's


def test_one_long_timed_draft_and_no_plain_step_give_a_positive_step_time():
    """The agentic bench's server failed at 4 clients with a division by zero: a suffix row's
    first timed step drafted 10 tokens and no plain step was timed yet, and the time line's
    prior put the plain step at t (1 - 0.1 x 10) = 0. The one point now implies its plain step
    (t / (1 + 0.1 K)), as VerifyBudget's does, for any K; a clock that did not move is no
    sample."""
    from mlxspec.draft_length import ScoredDraftLength
    from mlxspec.engine import Draft

    for k in (10, 12, 16):
        policy = ScoredDraftLength(16, lambda: [1.0] * 16)
        policy.update(k, k, 0.3)
        policy.update(0, 0, 0.0)  # measured nothing: ignored
        plain, intercept, slope = policy.time_line()
        assert 0.0 not in policy.step_cost.seconds.values()
        assert plain == pytest.approx(0.3 / (1 + 0.1 * k)) and intercept == pytest.approx(plain)
        assert slope == pytest.approx(0.1 * plain)
        assert policy.keep(Draft(tokens=list(range(k)))) == k  # sure drafts kept whole


def test_the_loop_verifies_what_the_row_s_policy_keeps_of_a_draft(target):
    """The loop verifies the part of a draft the row's policy keeps (its `keep`): a policy
    keeping one token gets one-token steps; at a fixed K (no policy) every draft suffix
    proposes from its own earlier reply is verified whole. Both give plain's output."""
    prompt = [3, 1, 4, 1, 5]
    plain, _ = run(target, Drafter(), prompt, max_tokens=40)
    for adaptive in (False, True):
        drafter = SuffixDrafter()
        run(target, drafter, prompt, max_tokens=40)  # its reply: the next run's drafts
        drafter.draft_policy(6, True).keep = lambda draft: min(len(draft), 1)
        proposed, propose = [], drafter.propose
        drafter.propose = lambda *args: proposed.append(propose(*args)) or proposed[-1]
        out, stats = run(target, drafter, prompt, max_tokens=40, adaptive=adaptive)
        assert out == plain
        assert max(map(len, proposed)) == 6
        if adaptive:
            assert len(stats.drafted_per_position) == 1 and stats.drafted > 0
        else:
            assert stats.drafted == sum(map(len, proposed))


def test_a_batch_weighs_suffix_drafts_by_their_own_frequencies(target, monkeypatch):
    """In a batch a suffix row's draft is not cut by its own policy, which weighs drafts as if
    they cost what they cost alone (the batch pays for its widest row anyway): the shared width
    is chosen from each draft's calibrated path frequencies, and the output is plain's."""
    from test_api_hardening import tiny_tokenizer

    from mlxspec.draft_length import ScoredDraftLength, VerifyBudget

    tokenizer = tiny_tokenizer(16)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [5] * 11, [3]]
    plain = mlxspec.batch_generate(target, tokenizer, prompts, 16)
    drafter = mlxspec.load_drafter("suffix", model=target, tokenizer=tokenizer)
    mlxspec.batch_generate(target, tokenizer, prompts, 16, drafter=drafter)  # the history
    monkeypatch.setattr(ScoredDraftLength, "keep", lambda self, draft: 0)
    seen, width = [], VerifyBudget.width
    monkeypatch.setattr(VerifyBudget, "width", lambda self, acceptance, caps: (
        seen.append(acceptance) or width(self, acceptance, caps)))
    out = mlxspec.batch_generate(target, tokenizer, prompts, 16, drafter=drafter)
    assert out.token_ids == plain.token_ids
    assert sum(s.accepted for s in out.stats) > 0  # drafts no row's own policy kept
    # read from a draft: one estimate per drafted token (the budget's own lists all 16)
    from_drafts = [row for acceptance in seen for row in acceptance if len(row) < 16]
    assert from_drafts and all(0 <= c <= 1 for row in from_drafts for c in row)
