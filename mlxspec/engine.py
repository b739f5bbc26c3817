"""The speculative decoding loop, written once for every drafter and backend.

Each step a drafter proposes up to K tokens, the target scores [pending token, drafts] in one
forward pass, the backend's acceptance rule keeps a prefix of the drafts and adds the target's own
token, and every cache is cut back to the committed tokens. Plain decoding is the same loop with no
drafts, so "spec output == target-only output" compares one code path with itself minus the drafts.

Only control flow lives here. Tensor math (forward passes, acceptance, cache trimming) lives in a
backend's `Target`; drafters see host token lists and backend arrays.
"""

import copy
import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, NamedTuple, Protocol, Sequence

from .draft_length import (AdaptiveDraftLength, DraftLengthPolicy, TreeBudget, VerifyBudget,
                           conditional_from_reach)
from . import verdict_layout
from .sampling import SamplingConfig
from .tree import TreeShape


@dataclass
class Draft:
    """Up to K proposed tokens. `probs` is the drafter's distribution p per token, (K, V); None
    means the drafter is deterministic (one-hot p).

    A tree of drafts also has `parents` (node i's parent is parents[i - 1]; 0 is the pending
    token), and `probs` then holds, per node 0..K, the distribution its children were drawn
    from, (K + 1, V)."""

    tokens: Any  # list[int] on the host, or a backend array of shape (K,)
    probs: Any = None
    parents: tuple[int, ...] | None = None
    # (E, hidden): the target's own first E layers already ran on [pending, drafts], hidden
    # (K + 1, H) their output, their caches extended (LayerSkip): the pass runs layers E.. only.
    early_exit: tuple[int, Any] | None = None
    # A constrained row's grammar masks (mlxspec.constraint.Matcher.masks): (K + 1, words) int32
    # on the host, the tokens each verified position allows; the target masks its logits with
    # them before acceptance. None: nothing is masked.
    masks: Any = None

    def __len__(self):
        return len(self.tokens) if isinstance(self.tokens, list) else int(self.tokens.shape[0])

    def host_tokens(self) -> list[int]:
        """The tokens as a host list: drafts on the device are read back (a wait)."""
        return self.tokens if isinstance(self.tokens, list) else self.tokens.tolist()

    def prefix(self, n: int) -> "Draft":
        """The chain's first n drafts: what the drafter would have proposed with K = n, for a
        drafter whose drafts do not depend on K (Drafter.free_drafts)."""
        if n >= len(self):
            return self
        return Draft(tokens=self.tokens[:n], probs=None if self.probs is None else self.probs[:n],
                     masks=None if self.masks is None else self.masks[: n + 1])

    def first_chain(self) -> "Draft":
        """The tree's branch of first children as a chain, for a target that cannot verify a
        tree (a recurrent state, a sliding window)."""
        shape = TreeShape(self.parents)
        nodes = shape.first_chain()
        rows = [0] + nodes[:-1]  # each chain token was drawn from its parent's distribution
        if isinstance(self.tokens, list):
            tokens = [self.tokens[n - 1] for n in nodes]
        else:
            tokens = self.tokens[[n - 1 for n in nodes]] if nodes else self.tokens[:0]
        probs = None if self.probs is None or not nodes else self.probs[rows]
        return Draft(tokens=tokens, probs=probs)


EMPTY_DRAFT = Draft(tokens=[])


@dataclass
class Verdict:
    """The outcome of one verification pass, on the host."""

    draft_tokens: list[int]
    accepted: int
    next_token: int
    features: Any = None  # target hidden states of the newly committed positions, if asked for
    branch: list[int] | None = None  # a tree's committed nodes (1-based, root to leaf)
    # If asked for (Target.launch's `logprobs`): per committed token, its log-probability and
    # the n likeliest (token, log-probability) pairs, best first (see stream_generate).
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def committed(self) -> list[int]:
        if self.branch is not None:
            return [self.draft_tokens[n - 1] for n in self.branch] + [self.next_token]
        return self.draft_tokens[: self.accepted] + [self.next_token]


@dataclass
class Pass:
    """One verification pass queued on the device and not yet read: [pending, drafts] through
    the target and the acceptance rule. `verdict()` is its one host sync."""

    num_draft: int
    packed: Any  # device ints laid out as mlxspec.verdict_layout says
    next_token: Any  # device scalar: the pending token of a plain pass queued right after this
    features: Any  # device (num_draft + 1, H * layers), or None
    path_slots: int | None = None  # a tree's: nodes from the root, left-padded with the root
    # Log-probabilities, if asked for: device floats laid out as mlxspec.verdict_layout says,
    # evaluated with `packed`.
    scores: Any = None
    top_n: int = 0

    def verdict(self) -> Verdict:
        host = self.packed.tolist()  # waits for the pass: its one host sync (MLX or torch alike)
        row = verdict_layout.read(host, self.num_draft, self.path_slots)
        branch, rows = None, slice(0, row.accepted + 1)
        if row.path is not None:
            branch = row.path[len(row.path) - row.accepted :] if row.accepted else []
            rows = [0] + branch
        features = self.features[rows] if self.features is not None else None
        verdict = Verdict(draft_tokens=row.drafts, accepted=row.accepted,
                          next_token=row.next_token, features=features, branch=branch)
        if self.scores is not None:
            self._read_scores(verdict, row.top_ids)
        return verdict

    def _read_scores(self, verdict: Verdict, top_ids: list[int]) -> None:
        """The committed tokens' log-probabilities: committed token j is scored by the row of
        the node before it (0, then the branch's nodes). Evaluated with `packed`: no second wait."""
        drafts, next_value, top_values = verdict_layout.read_scores(self.scores.tolist(),
                                                                    self.num_draft)
        n = self.top_n
        nodes = verdict.branch
        if nodes is None:  # a chain: its accepted drafts, node i scored by row i - 1
            nodes = list(range(1, verdict.accepted + 1))
        verdict.logprobs = [drafts[node - 1] for node in nodes] + [next_value]
        # A token the processing gives probability 0 (-inf) is no candidate: it is left out.
        verdict.top_logprobs = [
            [(top_ids[r * n + i], top_values[r * n + i]) for i in range(n)
             if top_values[r * n + i] > float("-inf")]
            for r in [0] + nodes
        ]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share: what a cache built for `a` can keep for `b`."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Target(Protocol):
    """One sequence's target on a backend (MLXTarget, the torch target, a split target's rank
    0): what `OneRow` presents to the loop as a batch of one row (`Rows`)."""

    context_length: int | None

    def prefill(self, tokens: Sequence[int]) -> Any: ...

    def launch(self, pending: "int | Pass", draft: Draft, sampling: SamplingConfig,
               logprobs: int | None = None) -> Pass:
        """Queue one pass over [pending, drafts] and return without waiting for it; `pending`
        may be a queued plain pass, whose next token is then read on the device. With
        `logprobs` n, the pass also scores the tokens it may commit and each row's n likeliest
        in `reported_logprobs`'s distribution, read with its verdict (Verdict.logprobs)."""
        ...

    def trim(self, n: int) -> None:
        """Drop the last n positions of the cache (a queued pass's drafts)."""
        ...

    def settle(self, verdict: Verdict) -> None:
        """Keep what a pass committed: the accepted drafts of a chain, the branch of a tree."""
        ...

    def holds_trees(self) -> bool:
        """Whether a pass may verify a tree of drafts (else the loop sends its first chain)."""
        ...

    def rollback_room(self) -> int | None:
        """How many positions a pass may add to the cache and still be cut back exactly (None:
        any number), e.g. what a sliding window holds before it starts to overwrite."""
        ...


class RowPasses(Protocol):
    """A pass over every row, queued on the device and not yet read."""

    num_drafts: list[int]  # per row, in the rows' order

    def verdicts(self) -> list["Verdict"]:
        """Every row's verdict (mlxspec.verdict_layout, decoded per row): the step's one wait."""
        ...


class Rows(Protocol):
    """The rows protocol: what `Loop` drives. A batched target (MLXBatchTarget) implements it
    for many rows; `OneRow` for one sequence's `Target`. Rows are numbered 0..rows-1 in the
    order they joined; joining rows are named by tickets until they are ready."""

    context_length: int | None
    rows: int  # rows held, ready and generating

    def bind(self, drafter: "Drafter") -> None:
        """A row's drafter, before its row is added; ValueError (one line) where this target
        cannot verify its drafts (a drafter drafting inside the target's own cache, a model
        whose recurrent states a row's rollback cannot reach)."""
        ...

    def add(self, prompts: list[list[int]], starts: list | None = None,
            kept: list[bool] | None = None) -> list[int]:
        """Rows start joining (prefilled later, by `fill`): starts[i] an engine.Start (a kept
        prompt cache holding a prefix of prompts[i]) or None, kept[i] whether row i's caches
        are copied out when it leaves. Returns a ticket per row."""
        ...

    def fill(self, budget: int | None = None) -> list[tuple[int, Any]]:
        """Prefill joining rows by about `budget` tokens (None: to their ends); the rows now
        ready join at the end, in the order added. Returns (ticket, captured features or
        None) per ready row."""
        ...

    def drop(self, ticket: int) -> None:
        """A joining row leaves before it is ready."""
        ...

    def remove(self, rows: list[int]) -> None:
        """These rows leave; the others keep their order, renumbered from 0."""
        ...

    def row_cache(self, row: int) -> tuple[Any, int | None, Any]:
        """Row `row`'s caches as one sequence's (to keep), the positions they hold, and its
        recurrent states at the end of its prompt where recorded."""
        ...

    def launch(self, pending: "list[int] | RowPasses", drafts: list["Draft"],
               samplings: list[SamplingConfig], logprobs: list[int | None]) -> RowPasses:
        """Queue one pass over every row's [pending, drafts] (a queued plain pass: its next
        tokens, still on the device) and return without waiting for it."""
        ...

    def settle(self, verdicts: list["Verdict"]) -> None:
        """Keep what each row committed of the last pass; its rejected drafts leave the
        caches."""
        ...

    def trim(self, counts: list[int]) -> None:
        """Drop the last counts[i] positions row i holds of the last pass (a queued pass's
        drafts, when the loop stops early)."""
        ...

    def holds_trees(self) -> bool:
        """Whether a pass may verify trees (else the loop sends each tree's first chain)."""
        ...

    def rollback_room(self) -> int | None:
        """How many positions a pass may write and still roll back (None: any number)."""
        ...


class Drafter:
    """A source of drafts. Subclasses override `propose`; the rest is optional bookkeeping."""

    name = "none"
    # The most drafts one step may take, so a huge num_draft never means unbounded work: a chain
    # drafted one model call per token (a draft model, EAGLE-3, MTP, LayerSkip) gains nothing
    # past this, its acceptance decaying with each position; lookup copies up to 64; a DFlash
    # block's size - 1, Medusa's heads, a tree's node budget; 0 for plain decoding. A larger
    # num_draft is capped to it, as the most drafts per step it is.
    max_draft: int = 32
    # Target layers whose outputs the drafter conditions on (DFlash, EAGLE); empty for most.
    capture_layers: tuple[int, ...] = ()
    default_num_draft = 1
    # The most drafts an adaptive K may try when the caller sets none (None: default_num_draft).
    # A fixed default is a safe K; the adaptive K measures, so its ceiling must reach past it to
    # find a better one (the Qwen2.5-Coder pair: best fixed K 8, the draft model's default 4).
    adaptive_num_draft: int | None = None
    # Proposes trees: K is then a node budget, chosen by measured throughput (TreeBudget), not
    # by the chain model of acceptance by position, which a tree's nodes do not follow.
    drafts_trees = False

    def draft_trees(self, budget: int | None) -> None:
        """Propose trees of up to `budget` nodes instead of chains (None keeps chains): the
        budget becomes the most drafts a step takes and the default."""
        if budget is not None:
            self.default_num_draft = self.max_draft = budget
            self.drafts_trees = True

    # Proposing costs no model pass and keeps no state, and a shorter K would give a prefix of
    # the same draft (prompt lookup): a batch proposes each such row's most, then chooses the
    # shared width knowing which rows found drafts, and how long (VerifyBudget).
    free_drafts = False

    # Its drafts depend only on the token list `propose` is given (prompt lookup, suffix
    # decoding), so it can draft after tokens not yet committed: a grammar's forced tokens.
    drafts_from_tokens = False
    # Why it cannot draft under a grammar (None: it can), e.g. drafts already run in the
    # target's own cache, which no grammar can then cut.
    constraint_refusal: str | None = None

    def check_constrainable(self) -> None:
        """A ValueError saying why, for a drafter that cannot draft under a constraint."""
        if self.constraint_refusal is not None:
            raise ValueError(f"the {self.name} drafter cannot draft under a constraint: "
                             f"{self.constraint_refusal}")

    # Whether it can draft for a row of a batch (a drafter that drafts inside the target's own
    # cache, LayerSkip, cannot: it says why in `batch_refusal`).
    batch_refusal: str | None = None

    def check_batchable(self) -> None:
        """A ValueError saying why, for a drafter that cannot draft for a row of a batch."""
        if self.batch_refusal is not None:
            raise ValueError(f"the {self.name} drafter cannot run in a batch: "
                             f"{self.batch_refusal}")

    def fork(self) -> "Drafter":
        """A drafter of the same kind and weights with a state of its own (begin() starts it),
        for another sequence drafted at the same time: a row of a batch."""
        twin = copy.copy(self)
        twin.__dict__.pop("_draft_policies", None)  # a row's acceptance is its own
        return twin

    def bind(self, target: "Target") -> None:
        """The target this drafter drafts for, before `begin`: a drafter that runs part of the
        target itself (LayerSkip) keeps it; the rest need only tokens and features."""

    def begin(self, prompt: list[int], features: Any = None) -> None:
        """A new sequence starts: `prompt` is in the target cache except its last token."""

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig) -> Draft:
        """Propose up to k tokens to follow `tokens` (all committed tokens, pending last)."""
        return EMPTY_DRAFT

    def together(self):
        """A key shared by the forks that can draft in one call (`propose_together`), e.g.
        their one drafter model: a batch's rows then draft in one pass of it, its weights read
        once, not once per row. None: this drafter proposes alone."""
        return None

    @staticmethod
    def propose_together(drafters: list["Drafter"], tokens: list[list[int]], ks: list[int],
                         samplings: list[SamplingConfig]) -> list[Draft]:
        """Each of `drafters` (forks with one `together` key) proposes as its `propose` would,
        all in one call."""
        return [d.propose(t, k, s) for d, t, k, s in zip(drafters, tokens, ks, samplings)]

    def commit(self, tokens: list[int], verdict: Verdict) -> None:
        """`verdict` was appended; `tokens` is the new committed list (pending last)."""

    # Learns from one sequence for the next (suffix decoding's history): a benchmark gives each
    # of its configurations its own, and `forget`s between its suites.
    remembers = False

    def forget(self) -> None:
        """Drop what was learnt from earlier sequences (a benchmark's fresh start)."""

    def end(self, tokens: list[int]) -> None:
        """The sequence is over (it stopped, ran out of tokens, was cancelled, or its caller
        stopped reading): `tokens` is all it committed. A drafter that learns from one sequence
        for the next (suffix decoding's shared history) keeps what it wants of it."""

    def draft_policy(self, max_k: int, greedy: bool) -> DraftLengthPolicy:
        """The adaptive-K policy for this drafter (draft_length: AdaptiveDraftLength for
        chains, TreeBudget for trees), kept across generations: acceptance per position and
        step timings carry over from one prompt (or chat turn) to the next, so a short
        generation does not pay the exploration again (greedy and sampled apart)."""
        policies = self.__dict__.setdefault("_draft_policies", {})
        key = (max_k, greedy)
        if key not in policies:
            policies[key] = (TreeBudget if self.drafts_trees else AdaptiveDraftLength)(max_k)
        return policies[key]


class PlainDecoding(Drafter):
    """Drafts nothing: plain decoding through the same loop, each pass queued on the device
    before the last one is read."""

    max_draft = 0


@dataclass
class SpecStats:
    target_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    # Under a constraint: the drafts the grammar forced (verified like any draft, at no
    # drafter's cost) and those accepted; `drafted` and `accepted` count the drafter's alone.
    forced: int = 0
    forced_accepted: int = 0
    plain_fallback_steps: int = 0  # steps run without drafts: the cache could not roll them back
    chain_fallback_steps: int = 0  # trees verified as their first chain: the cache holds no tree
    # Where the loop's time went: queuing passes (drafting, building and dispatching graphs) and
    # waiting for their results; the rest is the loop's and its caller's own host work.
    launch_seconds: float = 0.0
    wait_seconds: float = 0.0

    def record(self, num_drafted: int, num_accepted: int, num_emitted: int) -> None:
        self.target_passes += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.generated += num_emitted
        grow = num_drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < num_accepted

    @property
    def tau(self) -> float:
        """Mean tokens committed per target forward pass (1.0 for plain decoding)."""
        return self.generated / self.target_passes if self.target_passes else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d for a, d in zip(self.accepted_per_position, self.drafted_per_position)]


def requested_drafts(drafter: Drafter, num_draft: int | None, adaptive: bool) -> int:
    """The drafts per step a caller asked for, or else the drafter's default: an adaptive K's
    ceiling (adaptive_num_draft) when K adapts, its fixed default when not."""
    if num_draft:
        return num_draft
    if adaptive and drafter.adaptive_num_draft is not None:
        return drafter.adaptive_num_draft
    return drafter.default_num_draft


def draft_limit(drafter: Drafter, num_draft: int) -> int:
    """The most drafts a step verifies: `num_draft`, capped by what the drafter can propose (a
    drafter that sets no maximum gets the default one: work per step is always bounded)."""
    cap = Drafter.max_draft if drafter.max_draft is None else drafter.max_draft
    return min(num_draft, cap)


def emitted_counts(verdict: Verdict, emitted: int) -> tuple[int, int]:
    """(drafted, accepted) of a step of which only `emitted` committed tokens were emitted (a
    stop token came first): a step that stopped inside its accepted drafts counts as the draft
    cut at the stop token, all of it accepted; otherwise it counts as it was verified."""
    if emitted <= verdict.accepted:
        return emitted, emitted
    return len(verdict.draft_tokens), verdict.accepted


class Start(NamedTuple):
    """A kept prompt cache a row starts from: its caches hold the prompt's first `length`
    tokens (so only the rest is prefilled), with their target `features` for a drafter that
    reads them (None: none kept)."""

    caches: Any
    length: int
    features: Any = None


@dataclass(eq=False)
class Row:
    """One sequence in the loop, with everything that is its own: its tokens (prompt, then
    each committed one; the last is pending), drafter and its state, draft length (its most
    drafts per step and its K policy, a draft_length.DraftLengthPolicy; None for a fixed K),
    sampling settings, stop tokens, token budget, logprobs, and statistics. Rows are compared
    by identity."""

    drafter: Drafter
    tokens: list[int]
    sampling: SamplingConfig
    max_tokens: int
    max_k: int
    policy: DraftLengthPolicy | None = None
    stop_tokens: frozenset = frozenset()
    logprobs: int | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    # A kept prompt cache to start from (Start), and who takes the row's caches when it leaves
    # (to keep them), with `prompt_features`: its prompt's target features, where it has both.
    start: "Start | None" = None
    on_leave: Any = None
    prompt_features: Any = None
    produced: int = 0
    finished: bool = False  # it stopped, ran out of tokens or was cancelled: it leaves
    # Its constraint's grammar state (mlxspec.constraint.Matcher), None for a free row; per
    # step, how many of its drafts the grammar forced and, where the grammar cut them, the
    # drafter's whole draft (the drafter hears of its own draft as verified).
    matcher: Any = None
    forced: int = 0
    proposed: list[int] | None = None
    # When its last step ended, for the policy's step times; None until its first step has
    # run, which is not timed: it carries one-off work (a draft model prefilling the prompt,
    # first-call allocations) that, recorded at the K in use, made that K look several times
    # slower than it is, and the policy carries it from prompt to prompt.
    clock: float | None = None

    @property
    def k_ahead(self) -> bool:
        """Whether its next K is known before its latest pass is read."""
        return self.policy is None or not self.policy.reads_tokens

    @property
    def shares_width(self) -> bool:
        """Whether, in a batch of several rows, it drafts to the batch's shared width (its
        policy says: DraftLengthPolicy.shares_width); a fixed K never does."""
        return self.policy is not None and self.policy.shares_width


class OneRow:
    """A one-sequence `Target` as `Rows` of one row: how a single generation runs through the
    loop (either backend, trees, a split target, LayerSkip), its passes untouched."""

    def __init__(self, target: Target):
        self.target = target
        self.context_length = target.context_length
        self.rows = 0
        self.prompts: list[list[int]] = []  # added, not yet prefilled

    def bind(self, drafter: Drafter) -> None:
        drafter.bind(self.target)

    def add(self, prompts: list[list[int]], starts: list | None = None,
            kept: list[bool] | None = None) -> list[int]:
        # kept: the target records its own prompt's end (MLXTarget.prompt_state) for a cache
        if self.rows + len(self.prompts) + len(prompts) > 1:
            raise ValueError("this target holds one sequence")
        if starts and any(starts):
            raise ValueError("a one-sequence target keeps its own prompt cache")
        self.prompts += prompts
        return list(range(len(prompts)))

    def fill(self, budget: int | None = None) -> list[tuple[int, Any]]:
        """The prompt prefilled whole (the target chunks it itself)."""
        prompts, self.prompts = self.prompts, []
        self.rows += len(prompts)
        return [(0, self.target.prefill(prompt)) for prompt in prompts]

    def drop(self, ticket: int) -> None:
        self.prompts = []

    def remove(self, rows: list[int]) -> None:
        self.rows -= len(rows)

    def row_cache(self, row: int):
        raise ValueError("a one-sequence target keeps its own prompt cache (PromptCache)")

    def launch(self, pending, drafts: list[Draft], samplings: list[SamplingConfig],
               logprobs: list[int | None]) -> "Passes":
        pending = pending.passes[0] if isinstance(pending, Passes) else pending[0]
        return Passes([self.target.launch(pending, drafts[0], samplings[0], logprobs=logprobs[0])])

    def settle(self, verdicts: list[Verdict]) -> None:
        self.target.settle(verdicts[0])

    def trim(self, counts: list[int]) -> None:
        self.target.trim(counts[0])

    def holds_trees(self) -> bool:
        return self.target.holds_trees()

    def rollback_room(self) -> int | None:
        return self.target.rollback_room()


@dataclass
class Passes:
    """Single passes read as one batch pass (OneRow's)."""

    passes: list[Pass]

    @property
    def num_drafts(self) -> list[int]:
        return [p.num_draft for p in self.passes]

    def verdicts(self) -> list[Verdict]:
        return [p.verdict() for p in self.passes]


class Loop:
    """The speculative decoding loop, for one sequence or many at once (`target` holds the rows:
    a batched target, or a one-sequence Target as `OneRow`).

    Each step every row's drafter proposes up to its K, one pass verifies every row's
    [pending, drafts], and one host sync reads every row's verdict; each row then keeps its
    accepted drafts and the target's next token, and its caches are cut back to them. Rows join
    (`join`) and leave (stop token, `max_tokens`, `cancel`) at step boundaries.

    Host and device overlap: the next pass is queued before this one's tokens go to the caller
    (their detokenising runs while the device computes), and when every row drafts nothing, a
    plain pass is queued before the current one is even read, its pending tokens still on the
    device (as mlx-lm's generate_step). A pass queued in vain loses its drafts from the caches.
    `overlap=False` queues each pass only when the caller asks for more (to measure the host).
    """

    def __init__(self, target: Rows, *, overlap: bool = True, prefill_chunk: int = 512):
        self.target, self.overlap = target, overlap
        # Prompt tokens prefilled between two passes while rows generate: a long prompt joins
        # over several steps instead of stalling every running row for all of its prefill.
        self.prefill_chunk = prefill_chunk
        self.rows: list[Row] = []  # in the target's order
        self.joining: list[Row] = []  # to be added to the target at the next step boundary
        self.filling: dict[int, Row] = {}  # added, being prefilled: by the target's ticket
        self.step = None  # the pass queued and not yet read, over every row in self.rows
        # Several rows whose policies share the width: the batch's pass width, chosen for all
        # of them, and the step times it is chosen by.
        self.budget: VerifyBudget | None = None
        self.clock = 0.0  # when the last pass was read
        # Shared rows whose width waits for their free drafts (Drafter.free_drafts), with their
        # caps: set by _next_ks for the next _launch.
        self.width_after_drafts: dict[Row, int] | None = None
        self.cancelled: set[Row] = set()

    def join(self, row: Row) -> None:
        """`row` starts at the next step boundary: its prompt is prefilled from then on."""
        self.joining.append(row)

    def cancel(self, row: Row) -> None:
        """`row` yields nothing more and leaves at the next step boundary."""
        row.finished = True
        if row in self.joining:
            self.joining.remove(row)
        elif row in self.filling.values():
            ticket = next(t for t, r in self.filling.items() if r is row)
            self.target.drop(ticket)
            del self.filling[ticket]
        elif row in self.rows:
            self.cancelled.add(row)  # until it leaves: a long-lived loop keeps no row for good

    def _admit(self) -> None:
        """Rows that finished leave the target (handing their caches to `on_leave`), and
        joining rows are prefilled, a chunk at a time while others generate (all at once when
        none does): only between passes (no pass queued over the old rows)."""
        gone = [i for i, row in enumerate(self.rows) if row.finished]
        for i in gone:
            self.rows[i].drafter.end(self.rows[i].tokens)
            if self.rows[i].on_leave is not None:
                self.rows[i].on_leave(self.target.row_cache(i))
        if gone:
            self.target.remove(gone)
            self.cancelled.difference_update(self.rows[i] for i in gone)
            self.rows = [row for row in self.rows if not row.finished]
        if self.joining:
            new, self.joining = self.joining, []
            for row in new:
                self.target.bind(row.drafter)
            tickets = self.target.add([row.tokens for row in new], [row.start for row in new],
                                      [row.on_leave is not None for row in new])
            self.filling.update(zip(tickets, new))
        if self.filling:
            for ticket, features in self.target.fill(self.prefill_chunk if self.rows else None):
                row = self.filling.pop(ticket)
                row.start = None  # the batch holds a copy
                if row.on_leave is not None:
                    row.prompt_features = features
                row.drafter.begin(row.tokens, features)
                self.rows.append(row)
            self.clock = time.perf_counter()  # a step's time leaves the prefill out

    def _choose_k(self, row: Row, produced: int, length: int, wanted: int | None = None) -> int:
        # Drafts past max_tokens or the context window would be wasted work; what the cache can
        # roll back is known before proposing, so no drafter holds drafts it never hears about.
        if wanted is None:
            wanted = row.policy.next_k() if row.policy is not None else row.max_k
        wanted = min(wanted, row.max_tokens - produced - 1)
        k = min(wanted, self._room(row, produced, length, rolled_back=False))
        room = self._room(row, produced, length)
        if k > room:
            k = room
            row.stats.plain_fallback_steps += k <= 0 < wanted
        return max(k, 0)

    def _room(self, row: Row, produced: int, length: int, rolled_back: bool = True) -> int:
        """The most drafts `row`'s next pass may verify: within its max_tokens, the context
        window and (`rolled_back`) what the cache can roll back."""
        k = row.max_tokens - produced - 1
        if self.target.context_length is not None:
            k = min(k, self.target.context_length - length)
        room = self.target.rollback_room() if rolled_back else None
        if room is not None:
            k = min(k, room - 1)  # the pending token takes one position
        return k

    def _propose_constrained(self, row: Row, k: int) -> Draft:
        """A constrained row's draft, on the host: the tokens its grammar forces first (no
        drafter asked), then the drafter's up to k (a drafter that drafts from tokens alone
        drafts after the forced ones; any other only where none are forced), cut at the first
        the grammar forbids, with one mask per verified position. A tree is verified as its
        first chain: the grammar's masks follow one path. Drafts a drafter keeps on the device
        are read to the host here (the masks need them)."""
        limit = self._room(row, row.produced, len(row.tokens))
        forced = row.matcher.forced(limit)
        if forced and not row.drafter.drafts_from_tokens:
            k = 0
        k = min(k, limit - len(forced))
        draft = row.drafter.propose(row.tokens + forced, k, row.sampling) if k > 0 \
            else EMPTY_DRAFT
        if row.policy is not None and len(draft):
            kept = row.policy.keep(draft)
            draft = draft.prefix(kept) if kept else EMPTY_DRAFT
        if draft.parents is not None:
            draft = draft.first_chain()
            row.stats.chain_fallback_steps += 1
        own = draft.host_tokens()
        probs = draft.probs
        if forced and probs is not None:  # forced drafts are one-hot; a drafter's p is not
            own, probs = [], None
        allowed = row.matcher.allowed(forced + own) - len(forced)
        row.forced = len(forced)
        row.proposed = forced + own if allowed < len(own) else None
        own = own[:allowed]
        if probs is not None:
            probs = probs[:allowed] if allowed else None
        tokens = forced + own
        return Draft(tokens=tokens, probs=probs, masks=row.matcher.masks(tokens))

    def _propose(self, row: Row, k: int, whole: bool = False) -> Draft:
        """`row`'s draft of up to k tokens, the part its policy keeps; `whole`: all of it (a
        batch's free draft: the row's policy weighs drafts as if they cost what they cost
        alone, while the batch's width cuts it, its padding paid anyway)."""
        if row.matcher is not None:
            return self._propose_constrained(row, k)
        draft = row.drafter.propose(row.tokens, k, row.sampling) if k > 0 else EMPTY_DRAFT
        if row.policy is not None and not whole:
            kept = row.policy.keep(draft)
            if kept < len(draft):
                draft = draft.prefix(kept) if kept else EMPTY_DRAFT
        return self._as_verified(row, draft)

    def _acceptance(self, row: Row, draft: Draft | None) -> list[float]:
        """`row`'s P(draft j accepted | draft j-1 accepted) for the batch's width: from its
        draft's own scores where its policy reads them, else the budget's estimate."""
        reach = row.policy.draft_reach(draft) if draft is not None else None
        if reach is None:
            return self.budget.acceptance(row, row.drafter.name)
        return conditional_from_reach(reach)

    def _as_verified(self, row: Row, draft: Draft) -> Draft:
        if draft.parents is not None and not self.target.holds_trees():
            draft = draft.first_chain()
            row.stats.chain_fallback_steps += 1
        return draft

    def _propose_rows(self, ks: dict[Row, int]) -> dict[Row, Draft]:
        """Each row's draft of up to ks[row] tokens; rows whose drafters share a `together`
        key propose in one call."""
        groups: dict = {}
        for row, k in ks.items():
            key = row.drafter.together() if k > 0 and row.matcher is None else None
            groups.setdefault(id(row) if key is None else ("together", key), []).append(row)
        drafts = {}
        for rows in groups.values():
            if len(rows) == 1:
                drafts[rows[0]] = self._propose(rows[0], ks[rows[0]])
                continue
            proposed = type(rows[0].drafter).propose_together(
                [r.drafter for r in rows], [r.tokens for r in rows], [ks[r] for r in rows],
                [r.sampling for r in rows])
            drafts.update((r, self._as_verified(r, d)) for r, d in zip(rows, proposed))
        return drafts

    def _launch(self, ks: list[int], pending=None):
        start = time.perf_counter()
        found = {}
        caps, self.width_after_drafts = self.width_after_drafts, None
        if caps:  # free drafts first: the batch's width follows what they found
            found = {row: self._propose(row, cap, whole=True) for row, cap in caps.items()
                     if row.drafter.free_drafts and row.matcher is None}
            width = self.budget.width([self._acceptance(row, found.get(row)) for row in caps],
                                      [len(found[row]) if row in found else cap
                                       for row, cap in caps.items()])
            found = {row: draft.prefix(width) for row, draft in found.items()}
            ks = [min(width, caps[row]) if row in caps else k for row, k in zip(self.rows, ks)]
        found.update(self._propose_rows({row: k for row, k in zip(self.rows, ks)
                                         if row not in found}))
        drafts = [found[row] for row in self.rows]
        if pending is None:
            pending = [row.tokens[-1] for row in self.rows]
        queued = self.target.launch(pending, drafts, [row.sampling for row in self.rows],
                                    [row.logprobs for row in self.rows])
        seconds = time.perf_counter() - start
        for row in self.rows:
            row.stats.launch_seconds += seconds
        return queued

    def _next_ks(self, ahead: bool = False, known: dict | None = None) -> list[int] | None:
        """Each row's K for its next pass (`known`: those chosen already); `ahead`: for a pass
        queued before this one is read, which is then plain, so its own token still to come
        counts (None: not known before the rows' free drafts are)."""
        known = known or {}
        shared = [row for row in self.rows if row not in known and row.shares_width] \
            if len(self.rows) > 1 else []
        if shared:  # rows whose policies share the width draft to one, chosen together
            caps = {row: self._choose_k(row, row.produced + ahead, len(row.tokens) + ahead,
                                        row.max_k) for row in shared}
            if self.budget is None:
                self.budget = VerifyBudget(max(row.max_k for row in self.rows))
            acceptance = [self.budget.acceptance(row, row.drafter.name) for row in shared]
            if any(row.drafter.free_drafts for row in shared):
                if ahead:  # only a step that stays plain whatever they find is queued ahead
                    if not self.budget.plain_ahead(acceptance, list(caps.values())):
                        return None
                    caps = dict.fromkeys(caps, 0)
                else:  # _launch chooses the width once they are drafted
                    self.width_after_drafts = caps
                known = {**known, **caps}
            else:
                width = self.budget.width(acceptance, list(caps.values()))
                known = {**known, **{row: min(width, cap) for row, cap in caps.items()}}
        return [known[row] if row in known else
                self._choose_k(row, row.produced + ahead, len(row.tokens) + ahead)
                for row in self.rows]

    def _queue_ahead(self):
        """A plain pass queued before the current one is read, when every row's current pass
        is plain, every row's next K is known, is 0 and leaves room, and no row is waiting to
        join or leave. A constrained row's next mask waits for its next token: it queues none."""
        if not (self.overlap and self.rows and not self.joining and not self.filling
                and all(r.matcher is None for r in self.rows)
                and not any(self.step.num_drafts)
                and all(r.k_ahead and not r.finished and r.produced + 1 < r.max_tokens
                        for r in self.rows)):
            return None, None
        ks = self._next_ks(ahead=True)
        if ks is None:
            return None, None
        if any(ks):
            return None, dict(zip(self.rows, ks))
        return self._launch(ks, pending=self.step), None

    def __iter__(self) -> Iterator[tuple]:
        """Yield (row, token, from_draft) per token, or with the row's `logprobs` n (row, token,
        from_draft, logprob, top_logprobs), scored by the target in the pass that committed the
        token, until every row has finished. A row's last token is its stop token or its
        max_tokens-th."""
        try:
            while True:
                if self.step is None:
                    self._admit()
                    if not self.rows:
                        return
                    self.step = self._launch(self._next_ks())
                queued, ks = self._queue_ahead()
                waited = time.perf_counter()
                verdicts = self.step.verdicts()  # the step's one host sync
                now = time.perf_counter()
                if self.budget is not None and len(self.rows) > 1:
                    self.budget.time_step(len(self.rows), self.step.num_drafts,
                                          now - self.clock, chained=queued is not None)
                self.clock = now
                self.target.settle(verdicts)
                self.step = queued
                events = []
                for row, verdict in zip(self.rows, verdicts):
                    row.stats.wait_seconds += now - waited
                    if not row.finished:
                        events += self._commit(row, verdict, now)
                if self.step is not None and all(row.finished for row in self.rows):
                    self.step = None  # a plain pass queued in vain holds only committed tokens
                if self.step is None and self.overlap:
                    self._admit()
                    if self.rows:
                        self.step = self._launch(self._next_ks(known=ks))
                for event in events:
                    if event[0] not in self.cancelled:
                        yield event
        finally:  # the caller stopped early: drafts of a queued pass leave the caches
            if self.step is not None:
                self.target.trim(self.step.num_drafts)
                self.step = None
            for row in self.rows:  # rows that left ended then; these end now
                row.drafter.end(row.tokens)

    def _commit(self, row: Row, verdict: Verdict, now: float) -> list[tuple]:
        """Keep what `verdict` committed for `row`; its events, up to a stop token or its
        max_tokens (then it is finished)."""
        new = verdict.committed[: row.max_tokens - row.produced]
        stop = next((i for i, t in enumerate(new) if t in row.stop_tokens), None)
        new = new if stop is None else new[: stop + 1]
        row.tokens += verdict.committed
        row.drafter.commit(row.tokens, verdict if row.proposed is None else replace(
            verdict, draft_tokens=row.proposed))  # cut by the grammar: as if rejected there
        drafted, accepted = emitted_counts(verdict, len(new))
        seconds = None if row.clock is None else now - row.clock
        # The drafter's share of the step: what follows the forced drafts, tested only where
        # they were all accepted. A step with forced drafts times no K of the drafter's.
        forced, own, own_accepted = row.forced, len(verdict.draft_tokens), verdict.accepted
        if row.matcher is not None:
            row.matcher.advance(new)
            row.stats.forced += min(forced, drafted)
            row.stats.forced_accepted += min(forced, accepted)
            tested = verdict.accepted >= forced
            drafted, accepted = (drafted - min(forced, drafted), accepted - min(forced, accepted)) \
                if tested else (0, 0)
            own, own_accepted = (own - forced, own_accepted - forced) if tested else (0, 0)
            seconds = None if forced else seconds
            row.forced, row.proposed = 0, None
        row.stats.record(drafted, accepted, len(new))
        if row.policy is not None and (own or not forced):
            row.policy.update(own, own_accepted, seconds)
        if self.budget is not None and row.shares_width and (own or not forced):
            self.budget.observe(row, row.drafter.name, own, own_accepted)
        row.produced, row.clock = row.produced + len(new), now
        row.finished = stop is not None or row.produced >= row.max_tokens
        if row.logprobs is None:
            return [(row, token, i < verdict.accepted) for i, token in enumerate(new)]
        return [(row, token, i < verdict.accepted, verdict.logprobs[i], verdict.top_logprobs[i])
                for i, token in enumerate(new)]


def speculative_tokens(
    target: Target,
    drafter: Drafter,
    prompt: Sequence[int],
    *,
    sampling: SamplingConfig,
    max_tokens: int,
    num_draft: int,
    stats: SpecStats,
    adaptive: "bool | DraftLengthPolicy" = False,
    stop_tokens: "set[int] | frozenset[int]" = frozenset(),
    overlap: bool = True,
    logprobs: int | None = None,
    matcher=None,
) -> Iterator[tuple]:
    """One sequence through the loop (a batch of one row): yield (token, from_draft) until
    max_tokens are produced or a stop token is (yielded last); with `logprobs` n, (token,
    from_draft, logprob, top_logprobs) scored by the target in the pass that committed the
    token (Verdict.logprobs), at no extra sync. The target cache always holds every committed
    token but the last ("pending") one, so each pass starts from it and yields at least one new
    token. `adaptive`: True for the drafter's own K policy (Drafter.draft_policy, kept across
    its generations), a DraftLengthPolicy to use that one, False for a fixed K; `overlap`: see
    Loop. `matcher`: the reply's constraint (mlxspec.constraint.Matcher), None for none."""
    if num_draft < 1:
        raise ValueError(f"num_draft must be >= 1, got {num_draft}")
    max_k = draft_limit(drafter, num_draft)
    if isinstance(adaptive, bool):  # the drafter's own policy, or a fixed K
        policy = drafter.draft_policy(max_k, sampling.temp == 0) if adaptive and max_k else None
    else:  # a DraftLengthPolicy given (or None: a fixed K)
        policy = adaptive
    if matcher is not None:
        drafter.check_constrainable()
    loop = Loop(OneRow(target), overlap=overlap)
    loop.join(Row(drafter, list(prompt), sampling, max_tokens, max_k, policy,
                  frozenset(stop_tokens), logprobs, stats, matcher=matcher))
    for event in loop:
        yield event[1:]
