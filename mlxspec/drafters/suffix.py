"""Suffix decoding (SuffixDecoding, arXiv 2411.04975, as Snowflake's Arctic Inference runs it):
drafts from how often each continuation followed the current suffix, in this request and in the
replies of others. No model call.

Two counts of token windows are kept, each a suffix trie cut at `depth` tokens (every window of
up to `depth` tokens, how often it occurred and which tokens followed it): one per request (its
prompt and what it generates, extended as tokens are committed), and one shared by a drafter's
requests (SuffixHistory: the replies of a server's requests, a chat's turns, an API caller's kept
drafter, counted as they are generated, bounded by a node budget, oldest replies forgotten
first). Each step every suffix of the sequence (up to depth - 1 tokens) found in a trie drafts
from its node: a chain of each node's most frequent child, or with `tree` a best-first tree of
the likeliest paths, while a path's frequency (the product of each step's count over its
parent's) stays at least `min_prob` and its length at most `spec_factor` x the suffix's (a long
match is trusted further). The draft with the most expected accepted tokens (the sum of its
nodes' path frequencies) wins, the longer match on a tie, the request's own on a tie between
the two tries.

Drafts are deterministic (one-hot p): greedy and sampled acceptance stay exact, through the
chain or tree rule.
"""

import heapq
import itertools
import struct

from ..draft_length import ScoredDraftLength
from ..engine import EMPTY_DRAFT, Draft, Drafter, Verdict
from ..sampling import SamplingConfig


class _Node:
    __slots__ = ("children", "order", "count", "depth")

    def __init__(self, depth: int):
        self.children: dict[int, "_Node"] = {}
        self.order: list[tuple[int, "_Node"]] = []  # (token, child), most frequent first
        self.count = 0
        self.depth = depth


class SuffixTrie:
    """Occurrence counts of every window of up to `depth` tokens of the sequences it holds.

    Several sequences may grow at once (by id: a server's requests). A node's children stay
    ordered by count, ties kept in the order Arctic Inference's suffix tree keeps them (a child
    whose count rises joins the front of its new count's group if it led its old one, else the
    back), so the same history drafts the same tokens."""

    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError(f"the suffix depth must be at least 2, got {depth}")
        self.depth = depth
        self.root = _Node(0)
        self.nodes = 1
        self._open: dict = {}  # sequence id -> its windows still growing (their end nodes)

    def extend(self, tokens, sequence=0) -> None:
        """Append tokens to sequence `sequence`: every window ending at each is counted."""
        grown_before = self._open.get(sequence, [])
        for token in tokens:
            self.root.count += 1
            grown = []
            for node in [self.root] + grown_before:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node(node.depth + 1)
                    if node is not self.root:  # nothing drafts from the root: no order
                        node.order.append((token, child))
                    self.nodes += 1
                    child.count = 1
                elif node is self.root:
                    child.count += 1
                else:
                    _increment(node, token, child)
                if child.depth < self.depth:
                    grown.append(child)
            grown_before = grown
        self._open[sequence] = grown_before

    def close(self, sequence=0) -> None:
        """Sequence `sequence` grows no more: a later `extend` of that id starts a new one."""
        self._open.pop(sequence, None)

    def add(self, tokens, sequence=0) -> None:
        """A whole sequence of its own."""
        self.close(sequence)
        self.extend(tokens, sequence)
        self.close(sequence)

    def remove(self, tokens) -> None:
        """Forget a sequence added before: its windows' counts, and nodes left with none."""
        for start in range(len(tokens)):
            self.root.count -= 1
            node = self.root
            for token in tokens[start : start + self.depth]:
                child = node.children[token]
                if node is self.root:
                    child.count -= 1
                else:
                    _decrement(node, token, child)
                if child.count == 0:
                    del node.children[token]
                    if node is not self.root:
                        node.order.remove((token, child))
                    self.nodes -= _size(child)
                    break
                node = child

    def find(self, suffix) -> "_Node | None":
        node = self.root
        for token in suffix:
            node = node.children.get(token)
            if node is None:
                return None
        return node


def _increment(parent: _Node, token: int, child: _Node) -> None:
    order = parent.order
    i = order.index((token, child))
    if i and order[i - 1][1].count <= child.count + 1:
        head = i - 1  # move before the first child of the previous one's count
        while head and order[head - 1][1].count == order[i - 1][1].count:
            head -= 1
        del order[i]
        order.insert(head, (token, child))
    child.count += 1


def _decrement(parent: _Node, token: int, child: _Node) -> None:
    order = parent.order
    i = order.index((token, child))
    child.count -= 1
    after = i + 1
    if after < len(order) and order[after][1].count == child.count + 1:
        # it leaves its group: to the front of the next group of a lower count (or the end)
        end = after
        while end < len(order) and order[end][1].count == child.count + 1:
            end += 1
        order.insert(end, (token, child))
        del order[i]


def _size(node: _Node) -> int:
    return 1 + sum(_size(c) for c in node.children.values())


def draft_from(node: _Node, limit: int, min_prob: float, tree: bool
               ) -> tuple[list[int], list[int], list[float]]:
    """Up to `limit` tokens following `node`: (tokens, their parents as Draft.parents has them,
    their path frequencies; their sum is the draft's expected accepted tokens, its score). A
    path's frequency is the product of each step's count over its parent's; paths under
    `min_prob` are not drafted. A chain follows each node's most frequent child; a tree takes
    the likeliest path left, node by node, so each node's likeliest child comes first and the
    tree's first chain is the chain."""
    tokens, parents, probs = [], [], []
    frontier: list = []  # (-path frequency, order, parent's draft index, token, node)
    order = itertools.count()

    def offer(at: _Node, index: int, prob: float) -> None:
        for token, child in at.order if tree else at.order[:1]:
            # float32, in Arctic's order of operations: its ties break the same way
            p = _f32(_f32(prob * child.count) / at.count) if tree else \
                _f32(prob * _f32(child.count / at.count))
            if p < _f32(min_prob):
                break
            heapq.heappush(frontier, (-p, next(order), index, token, child))

    offer(node, 0, 1.0)
    while frontier and len(tokens) < limit:
        neg_p, _, parent, token, child = heapq.heappop(frontier)
        tokens.append(token)
        parents.append(parent)
        probs.append(-neg_p)
        offer(child, len(tokens), -neg_p)
    return tokens, parents, probs


def speculate(trie: SuffixTrie, context: list[int], k: int, spec_factor: float,
              min_prob: float, tree: bool) -> tuple[list[int], list[int], list[float]]:
    """The best draft (draft_from's) over every suffix of `context` (its last depth - 1 tokens
    at most) found in `trie`: each matched suffix of m tokens drafts at most spec_factor x m
    tokens, and the highest score wins (a longer match on a tie)."""
    best, best_score = ([], [], []), 0.0
    context = context[-trie.depth :]
    for length in range(1, len(context)):
        node = trie.find(context[len(context) - length :])
        if node is None:
            break
        limit = min(k, int(length * spec_factor + 1e-6))
        if limit > 0:
            found = draft_from(node, limit, min_prob, tree)
            if score(found[2]) >= best_score:
                best, best_score = found, score(found[2])
    return best


def score(probs: list[float]) -> float:
    """A draft's expected accepted tokens, summed in float32 as Arctic sums it."""
    total = 0.0
    for p in probs:
        total = _f32(total + p)
    return total


def _f32(x: float) -> float:
    return _FLOAT32.unpack(_FLOAT32.pack(x))[0]


_FLOAT32 = struct.Struct("f")


class SuffixHistory:
    """The replies of a drafter's requests, shared by its forks, counted while they are
    generated (a concurrent request drafts from them at once, as Arctic Inference's global tree
    does) and kept after: one SuffixTrie kept under `max_nodes` nodes (~150 bytes each) by
    forgetting the oldest replies first, finished or not."""

    def __init__(self, depth: int = 24, max_nodes: int = 1_000_000):
        if max_nodes < 1:
            raise ValueError(f"the suffix history needs at least one node, got {max_nodes}")
        self.trie = SuffixTrie(depth)
        self.max_nodes = max_nodes
        self.replies: dict[int, list[int]] = {}  # by sequence id, oldest first
        self._ids = itertools.count()

    def start(self) -> int:
        """A new reply's id."""
        sequence = next(self._ids)
        self.replies[sequence] = []
        return sequence

    def extend(self, sequence: int, tokens: list[int]) -> None:
        if sequence not in self.replies:  # it was forgotten: what follows starts afresh
            self.replies[sequence] = []
            self.trie.close(sequence)
        self.replies[sequence] += tokens
        self.trie.extend(tokens, sequence)
        while self.trie.nodes > self.max_nodes and self.replies:
            oldest = next(iter(self.replies))
            self.trie.remove(self.replies.pop(oldest))
            self.trie.close(oldest)

    def finish(self, sequence: int) -> None:
        """The reply is complete; it stays until forgotten."""
        self.trie.close(sequence)
        if not self.replies.get(sequence, True):
            del self.replies[sequence]

    def add(self, reply: list[int]) -> None:
        """A whole reply at once (e.g. one from an earlier session)."""
        sequence = self.start()
        self.extend(sequence, list(reply))
        self.finish(sequence)


class SuffixDrafter(Drafter):
    """Suffix decoding: this request's own windows and the shared history's (SuffixHistory),
    whichever drafts more expected tokens. Forks share the history."""

    name = "suffix"
    default_num_draft = 16
    max_draft = 64  # drafting costs no model call, but each draft is verified
    remembers = True

    def __init__(self, depth: int = 24, spec_factor: float = 1.0, min_prob: float = 0.1,
                 tree: bool = False, max_nodes: int = 1_000_000,
                 history: SuffixHistory | None = None):
        if not spec_factor > 0:
            raise ValueError(f"the suffix spec factor must be positive, got {spec_factor}")
        if not 0 <= min_prob <= 1:
            raise ValueError(f"the suffix min probability must be in [0, 1], got {min_prob}")
        self.history = history if history is not None else SuffixHistory(depth, max_nodes)
        self.depth = self.history.trie.depth
        self.spec_factor, self.min_prob = spec_factor, min_prob
        self.drafts_trees = bool(tree)
        # A chain with fewer drafts is a prefix of the same chain: a batch proposes first and
        # chooses its width knowing what was found (Drafter.free_drafts). A tree is not.
        self.free_drafts = not self.drafts_trees
        self.drafts_from_tokens = True  # a match of the tokens' tail, whatever they are
        self._request: SuffixTrie | None = None
        self._reply: int | None = None  # this request's id in the history
        self._held = 0

    def forget(self) -> None:
        """A new, empty history (forks made from now on share it)."""
        self.history = SuffixHistory(self.depth, self.history.max_nodes)

    def fork(self) -> "SuffixDrafter":
        twin = super().fork()
        twin._request = twin._reply = None  # its own request; the history stays shared
        return twin

    def begin(self, prompt, features=None):
        if self._reply is not None:  # the last request never ended (no loop told it)
            self.history.finish(self._reply)
        self._request = SuffixTrie(self.depth)
        self._request.extend(prompt)
        self._reply = self.history.start()
        self._held = len(prompt)


    def commit(self, tokens: list[int], verdict: Verdict) -> None:
        new = tokens[self._held :]
        self._request.extend(new)
        self.history.extend(self._reply, new)
        self._held = len(tokens)

    def end(self, tokens: list[int]) -> None:
        if self._reply is not None:
            self.history.finish(self._reply)
            self._request = self._reply = None

    def match_length(self, tokens: list[int]) -> int:
        """The longest suffix of `tokens` (up to the depth) that was followed by something in
        this request or in the history; 0 where none was."""
        context, longest = tokens[-self.depth :], 0
        for trie in (self._request, self.history.trie):
            if trie is None:
                continue
            for length in range(1, len(context)):
                node = trie.find(context[len(context) - length :])
                if node is None:
                    break
                if node.children:
                    longest = max(longest, length)
        return longest

    def draft_policy(self, max_k: int, greedy: bool):
        """A chain's K from its own path frequencies and step times (ScoredDraftLength: a
        suffix draft says how far it expects to be right, which acceptance by match length
        only guessed); trees by their budget."""
        if self.drafts_trees:
            return super().draft_policy(max_k, greedy)
        policies = self.__dict__.setdefault("_draft_policies", {})
        if (max_k, greedy) not in policies:
            policies[max_k, greedy] = ScoredDraftLength(max_k, lambda: self.last_probs)
        return policies[max_k, greedy]

    def copies(self, tokens: list[int], worth: float = 0.0) -> bool:
        """Whether it drafts the step after `tokens` (a copier in front of a model drafter),
        its draft expecting more than `worth` accepted tokens (at least one draft)."""
        drafted, _, probs = self.speculate(tokens, self.max_draft)
        return bool(drafted) and score(probs) >= worth

    last_probs: list[float] = []  # the last draft's path frequencies (for ScoredDraftLength)

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig) -> Draft:
        drafted, parents, self.last_probs = self.speculate(tokens, k)
        if not drafted:
            return EMPTY_DRAFT
        return Draft(tokens=drafted, parents=tuple(parents) if self.drafts_trees else None)

    def speculate(self, tokens: list[int], k: int) -> tuple[list[int], list[int], list[float]]:
        """draft_from's draft: the request's, unless the history's scores higher (Arctic's
        rule)."""
        best, best_score = ([], [], []), 0.0
        for trie in (self._request, self.history.trie):
            if trie is not None:
                found = speculate(trie, tokens, k, self.spec_factor, self.min_prob,
                                  self.drafts_trees)
                if score(found[2]) > best_score:
                    best, best_score = found, score(found[2])
        return best
