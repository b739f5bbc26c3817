"""The K policy package (mlxspec.draft_length): the loop asks policies only through their
protocol, one time model serves one row and a batch, and a policy written against the protocol
alone drives the loop."""

import ast
import inspect
import random

import pytest
from tiny_models import tiny_llama

import mlxspec
import mlxspec.draft_length as draft_length
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.draft_length import AdaptiveDraftLength, StepCost, VerifyBudget
from mlxspec.drafters import PromptLookupDrafter
from mlxspec.engine import Drafter, Loop, SpecStats, speculative_tokens
from mlxspec.sampling import SamplingConfig

GREEDY = SamplingConfig()


# ---- the loop asks, the policy answers ---------------------------------------------------------


def test_the_loop_tests_no_policy_for_its_class():
    """Loop reads a policy only through DraftLengthPolicy: no isinstance at all, and none of the
    package's policy classes named (the batch's width, VerifyBudget, is the loop's own)."""
    source = inspect.getsource(Loop)
    calls = [node for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
    assert not [call for call in calls if call.func.id in ("isinstance", "issubclass")]
    # type() only of a drafter (its propose_together), never of a policy
    assert not [call for call in calls if call.func.id == "type"
                and "policy" in ast.unparse(call.args[0])]
    policies = [name for name in draft_length.__all__
                if name.endswith(("DraftLength", "Budget")) and name != "VerifyBudget"]
    assert policies and not [name for name in policies if name in source]


def test_every_policy_answers_the_whole_protocol():
    members = [name for name in vars(draft_length.DraftLengthPolicy)
               if not name.startswith("_")] + ["reads_tokens", "shares_width"]
    copier = draft_length.MatchLengthDraftLength(8, lambda: 3)
    for policy in (AdaptiveDraftLength(8), draft_length.TreeBudget(8), copier,
                   draft_length.ScoredDraftLength(8, lambda: []),
                   draft_length.ConfidenceDraftLength(8, lambda: []),
                   draft_length.PerSourceDraftLength(lambda: True, copier, AdaptiveDraftLength(8))):
        assert all(hasattr(policy, name) for name in members), type(policy).__name__


# ---- one time model ----------------------------------------------------------------------------


def one_row_and_batch(steps):
    """An adaptive K told `steps` ((K, seconds) each) as the loop tells it, and a batch budget
    told the same steps as the loop times a batch of one row."""
    policy, budget = AdaptiveDraftLength(16), VerifyBudget(16)
    for k, seconds in steps:
        policy.update(k, 0, seconds)
        budget.time_step(1, [k], seconds, chained=False)
    return policy, budget


def _noisy(rng, n, cost):
    return [(k, cost(k) * rng.lognormvariate(0.0, 0.3))
            for k in (rng.choice([0, 0, 1, 2, 3, 4, 5, 8]) for _ in range(n))]


STEPS = {
    "nothing": [],
    "plain only": [(0, 1.0), (0, 1.1)],
    "one K only": [(10, 0.3)],
    "plain and one K": [(0, 1.0), (1, 1.24)],
    "plain and two Ks": [(0, 1.0), (2, 1.5), (3, 1.8), (3, 1.7)],
    "drafted cheaper than plain": [(0, 1.0), (3, 1.05), (4, 1.1), (6, 1.15)],
    "a steep line": [(3, 2.02), (4, 2.98)],
    "noisy, weighted": _noisy(random.Random(0), 300, lambda k: 1.0 + 0.15 * (k > 0) + 0.2 * k),
}


@pytest.mark.parametrize("name", list(STEPS))
def test_one_row_and_a_batch_of_one_row_read_the_same_step_cost(name):
    """For one row positions = K + 1 and drafting rows = [K > 0], so the adaptive K's line
    (plain, intercept, slope) is the batch's plane (a + b, a + b + d, b), step for step."""
    policy, budget = one_row_and_batch(STEPS[name])
    assert policy.step_cost.seconds == budget.step_cost.seconds
    assert policy.step_cost.fit() == budget.cost()
    plain, intercept, slope = policy.time_line()
    assert budget.step_seconds(1, 0, 0) == pytest.approx(plain, rel=1e-12)
    for k in range(1, 17):
        assert budget.step_seconds(1, k, 1) == pytest.approx(intercept + slope * k, rel=1e-12)
    a, b, d = budget.cost()
    assert b > 0 and d >= 0 and a + b > 0


def test_the_step_cost_recovers_a_measured_plane():
    """Steps that cost exactly a + b·positions + d·drafting rows give back (a, b, d), whether
    from one row's K or a batch's rows and widths."""
    one_row, batch = StepCost(), StepCost()
    for k in (0, 1, 3, 6):
        one_row.record(k + 1, 0.010 + 0.002 * (k + 1) + 0.004 * (k > 0), int(k > 0))
    for rows, width, drafting in ((8, 1, 0), (8, 2, 8), (8, 3, 8), (4, 4, 2)):
        batch.record(rows * width, 0.010 + 0.002 * rows * width + 0.004 * drafting, drafting)
    assert one_row.fit() == pytest.approx((0.010, 0.002, 0.004))
    assert batch.fit() == pytest.approx((0.010, 0.002, 0.004))


def test_the_step_cost_keeps_its_robustness_rules():
    """Priors with one size measured (a position 10% of a one-position step), a floor on b (3%
    of it), capped weights (a point timed 40 times outweighs one timed once only 8 to 1), and
    no drafting term below zero (a drafted step is never modelled cheaper than a plain one)."""
    cost = StepCost()
    assert cost.fit() == pytest.approx((0.9, 0.1, 0.0))
    cost.record(1, 2.0)
    assert cost.fit() == pytest.approx((1.8, 0.2, 0.0))
    flat = StepCost()
    for positions in (1, 2, 3):
        flat.record(positions, 1.0, int(positions > 1))
    a, b, d = flat.fit()
    assert a + b == pytest.approx(1.0) and b == pytest.approx(0.03) and d == pytest.approx(0.0)
    weighted, equal = StepCost(), StepCost(weight_cap=1)
    for model in (weighted, equal):
        for _ in range(40):
            model.record(1, 1.0)
            model.record(4, 1.3, 1)
            model.record(5, 1.4, 1)
        model.record(7, 3.0, 1)
    assert weighted.fit()[1] < equal.fit()[1]
    cheaper = StepCost()
    for positions, seconds in ((1, 1.0), (4, 1.05), (5, 1.1), (7, 1.15)):
        cheaper.record(positions, seconds, int(positions > 1))
    assert cheaper.fit()[2] == 0.0
    cheaper.record(3, -1.0, 1)  # a clock that did not move measured nothing
    cheaper.record(3, None, 1)
    assert (3, 1) not in cheaper.seconds


# ---- a policy written against the protocol alone -----------------------------------------------


class Scripted:
    """A DraftLengthPolicy and nothing else: K cycles 0, 1, 3, 5; a step keeps at most 2
    drafts; every update is recorded."""

    reads_tokens = False
    shares_width = False

    def __init__(self):
        self.asked, self.updates, self.kept = 0, [], []

    def next_k(self) -> int:
        self.asked += 1
        return (0, 1, 3, 5)[(self.asked - 1) % 4]

    def keep(self, draft) -> int:
        self.kept.append(min(len(draft), 2))
        return self.kept[-1]

    def draft_reach(self, draft):
        return None

    def update(self, drafted, accepted, seconds=None):
        self.updates.append((drafted, accepted, seconds))


class SharedWidth(Scripted):
    """The same, joining a batch's shared width."""

    shares_width = True


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=16, hidden=32, layers=2, seed=3, sharpness=3.0)


class Perfect(Drafter):
    """Drafts the target's own greedy continuation (known in advance): every draft accepted."""

    name = "perfect"

    def __init__(self, full):
        self.full = full

    def propose(self, tokens, k, sampling):
        from mlxspec.engine import Draft
        return Draft(tokens=self.full[len(tokens) : len(tokens) + k])


def generate(target, drafter, prompt, adaptive, max_tokens=30, k=5):
    stats = SpecStats()
    out = speculative_tokens(MLXTarget(target, speculative=True), drafter, prompt,
                             sampling=GREEDY, max_tokens=max_tokens, num_draft=k, stats=stats,
                             adaptive=adaptive)
    return [t for t, _ in out], stats


def test_a_protocol_only_policy_drives_one_row(target):
    """The loop asks the policy's K, verifies what its keep keeps, and tells it each step:
    K 0, 1, 3, 5 cut to at most 2 drafts, all accepted, the output plain decoding's."""
    prompt = [3, 1, 4, 1, 5]
    plain, _ = generate(target, Drafter(), prompt, adaptive=False)
    policy = Scripted()
    out, stats = generate(target, Perfect(prompt + plain), prompt, adaptive=policy)
    assert out == plain
    assert len(policy.updates) == stats.target_passes and policy.asked == stats.target_passes
    wanted = [(0, 1, 3, 5)[i % 4] for i in range(stats.target_passes)]
    drafted = [d for d, _, _ in policy.updates]
    assert drafted[:-1] == [min(k, 2) for k in wanted][:-1]  # the last step may be capped
    assert all(a == d for d, a, _ in policy.updates)
    assert policy.updates[0][2] is None and all(s > 0 for _, _, s in policy.updates[1:])
    assert len(stats.drafted_per_position) == 2


@pytest.mark.parametrize("policy_class", [Scripted, SharedWidth])
def test_a_protocol_only_policy_drives_a_batch(target, policy_class, monkeypatch):
    """In a batch a row at its own K is asked as alone; a row sharing the width drafts to the
    batch's (VerifyBudget), weighed by the policy's draft_reach, and is told every step either
    way. The output is plain decoding's."""
    from test_api_hardening import tiny_tokenizer

    tokenizer = tiny_tokenizer(16)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 7, 8], [2, 6, 2, 6, 2, 6]]  # none stops early
    plain = mlxspec.batch_generate(target, tokenizer, prompts, 16)
    policies = []

    class Copier(PromptLookupDrafter):
        def draft_policy(self, max_k, greedy):
            policies.append(policy_class())
            return policies[-1]

    widths, width = [], VerifyBudget.width
    monkeypatch.setattr(VerifyBudget, "width", lambda self, acceptance, caps: (
        widths.append(len(caps)) or width(self, acceptance, caps)))
    out = mlxspec.batch_generate(target, tokenizer, prompts, 16, drafter=Copier())
    assert out.token_ids == plain.token_ids
    assert len(policies) == len(prompts)
    for policy, stats in zip(policies, out.stats):
        assert len(policy.updates) == stats.target_passes
        assert sum(d for d, _, _ in policy.updates) >= stats.drafted
        if policy_class is Scripted:  # asked as alone, the batch's width never chosen
            assert policy.asked == stats.target_passes and not widths and stats.drafted > 0
        else:  # the batch's width while rows run together: its own K only once alone
            assert policy.asked < stats.target_passes and max(widths) == len(prompts)
