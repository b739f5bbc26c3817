"""Drafters fed (token, target feature) pairs: EAGLE-3, and MTP modules, written once.

The drafter's cache holds one pair (token i+1, target features of position i) per committed
position but the pending one's: exactly what the target has processed. Its last output h
already ranks the pending token's successor, so draft 1 costs only the head; drafts 2..K each
run the drafter once more on (previous draft, previous h) at the next position (EAGLE-3's
test-time chain; an MTP module chained on its own output). After verification those chain
positions are cut from the cache and the newly committed pairs are appended with the target's
features. A chain reads nothing back to the host.

Drafts are argmax when greedy (one-hot p); when sampling, each draft is drawn from the drafter's
processed distribution, reported over the target's vocabulary (zeros outside a draft
vocabulary), so accept_sampled's min(1, q/p) rule stays lossless.

With `tree_budget` the drafter proposes EAGLE-2's dynamic tree instead (Li et al., 2024): each
depth expands the `tree_width` most probable nodes at once, in one pass of the layer, and the
`tree_budget` most probable of all candidates are verified. The candidates are read to the
host once (the tree's shape depends on them); their entries are cut from the cache after
verification as a chain's steps are.

PairedDrafting is the host side, for both backends; MLXPairedDrafting adds MLX's tensor math,
mlxspec.backends.torch.eagle3's TorchPairedDrafting torch's.
"""

import math

import mlx.core as mx

from ..engine import EMPTY_DRAFT, Draft, Drafter, Verdict
from ..request import check_count
from ..sampling import SamplingConfig
from ..backends.mlx.sampling import processed_logprobs
from ..tree import check_tree


class PairedDrafting(Drafter):
    """The host side of a drafter fed (token, target feature) pairs, one for both backends:
    which pairs are committed, when chain or tree entries are cut, how a chain is drawn and a
    tree grown and numbered. A backend's subclass brings the tensor math: its model (called as
    models.eagle3.Eagle3Model is), `xp` (the few array primitives below use), its cache's
    length and cut, one draw from a step's logits, and a node's best children."""

    xp = None  # the backend's array primitives: MLXArrays, or the torch backend's
    deferred_limit = 32  # verdicts kept deferred at most (_deferred)

    def __init__(self, model, *, capture_layers, feature_width: int, target_vocab: int,
                 default_num_draft: int, hot_ids=None, draft_rows: int | None = None,
                 tree_budget: int | None = None, tree_width: int = 4, tree_depth: int = 6):
        self.model = model
        self.capture_layers = tuple(capture_layers)
        self.feature_width = int(feature_width)  # columns of a feature row
        self.default_num_draft = int(default_num_draft)
        # A dynamic tree of up to `tree_budget` nodes, `tree_width` children per node and
        # `tree_depth` levels (fewer when the budget is smaller), instead of a chain.
        self.tree_budget, self.tree_width = check_tree_options(tree_budget, tree_width, tree_depth)
        self.tree_depth = tree_depth
        self.draft_trees(self.tree_budget)
        self.target_vocab = int(target_vocab)
        # The target id of each row the drafter ranks (a draft vocabulary), None: the same ids.
        self.hot_ids = hot_ids
        self.draft_rows = int(draft_rows if draft_rows is not None else target_vocab)
        self.cache = model.make_cache()
        self._hidden: list = []  # the layer's outputs per committed pair, in chunks
        self._committed = 0  # pairs in the cache (the cache may hold chain steps beyond)
        # Pairs committed since the drafter last drafted, run into the cache in one pass when it
        # next does (_flush): steps that draft nothing (an adaptive K at 0) cost it nothing, and
        # the step after pays one pass, not one per such step (lazily queued, they ran one by
        # one there, so a drafting step looked dearer by the plain steps before it).
        self._deferred: list[tuple[list[int], object]] = []

    # ---- the backend's tensor math ----

    def _cache_length(self) -> int:
        """Entries in the draft cache: committed pairs, then the last proposal's."""
        raise NotImplementedError

    def _cut(self, n: int) -> None:
        """Drop the cache's last n entries."""
        raise NotImplementedError

    def _draw(self, logits, sampling: SamplingConfig):
        """A chain step's draft-vocabulary row, and (sampling) its distribution p over the
        target's vocabulary, zero outside the draft vocabulary; None when greedy (one-hot)."""
        raise NotImplementedError

    def _best_children(self, hidden, width: int, sampling: SamplingConfig):
        """Layer outputs (n, H) -> the `width` best next tokens of each, (n, width): their
        log-probabilities (never above 0, so a path's score only falls) and target ids."""
        raise NotImplementedError

    # ---- shared ----

    @property
    def context_length(self) -> int:
        """Committed positions whose pairs are cached or deferred (all committed tokens but the
        pending)."""
        return self._committed + sum(len(tokens) for tokens, _ in self._deferred)

    def begin(self, prompt, features=None):
        self.cache = self.model.make_cache()
        self._hidden, self._committed, self._deferred = [], 0, []
        if self._checked(list(prompt[1:]), features):
            self._append(list(prompt[1:]), features)

    def _checked(self, tokens: list[int], features) -> bool:
        """Whether (tokens, features) hold a pair, after checking they match; a mismatch is the
        caller's error, raised when committed, not when next drafted."""
        if features is None:
            raise ValueError(
                f"the {self.name} drafter needs target hidden states: build the target with "
                "capture_layers=drafter.capture_layers"
            )
        if features.shape[0] == 0:  # a one-token prompt has no pair yet
            return False
        width = self.feature_width
        if features.ndim != 2 or features.shape[1] != width:
            raise ValueError(
                f"target features have shape {tuple(features.shape)}; the {self.name} drafter "
                f"expects (positions, {width}) from layers {list(self.capture_layers)}"
            )
        if features.shape[0] != len(tokens):
            raise ValueError(f"{features.shape[0]} feature rows for {len(tokens)} tokens")
        return True

    def _append(self, tokens: list[int], features) -> None:
        """Run pairs (tokens[j], features[j]), the token that follows each featured position,
        into the cache."""
        self._trim_chain()
        self._hidden.append(self._extend(self.xp.ids(tokens), features[None])[0])
        self._committed += len(tokens)

    def _extend(self, ids, features):
        """Run committed pairs (ids (1, n), features (1, n, width)) into the cache; their
        outputs, (1, n, H)."""
        return self.model(ids, self.model.project(features), self.cache)

    def _target_id(self, rows):
        """Rows the drafter ranks -> target token ids."""
        return rows if self.hot_ids is None else self.hot_ids[rows]

    def _trim_chain(self) -> None:
        """Drop the chain steps (or tree entries) of the last proposal from the cache."""
        excess = self._cache_length() - self._committed
        if excess > 0:
            self._cut(excess)

    def _rewind(self, num_pairs: int) -> None:
        """Keep exactly `num_pairs` committed pairs (a caller may have rolled back)."""
        self._flush()
        if num_pairs > self._committed:
            raise ValueError(
                f"the {self.name} context holds {self._committed} positions but {num_pairs} tokens "
                "precede the pending one; commit() must receive every verdict's features"
            )
        self._trim_chain()
        drop = self._committed - num_pairs
        if drop:
            self._cut(drop)
            kept, total = [], 0
            for chunk in self._hidden:
                if total + chunk.shape[0] > num_pairs:
                    chunk = chunk[: num_pairs - total]
                if chunk.shape[0]:
                    kept.append(chunk)
                total += chunk.shape[0]
            self._hidden, self._committed = kept, num_pairs

    def _flush(self) -> None:
        """Run the deferred pairs into the cache, all in one pass."""
        if not self._deferred:
            return
        pairs, self._deferred = self._deferred, []
        tokens = [t for chunk, _ in pairs for t in chunk]
        features = pairs[0][1] if len(pairs) == 1 else self.xp.cat([f for _, f in pairs])
        self._append(tokens, features)

    def _last_output(self):
        """(1, H): the last committed pair's output, which ranks the pending token's successor."""
        return self._hidden[-1][-1:]

    def _chain(self, k: int, choose) -> None:
        """k chain steps from the last committed pair: step j's logits go to `choose(j,
        logits)`, whose token (target id; read only when a step follows) step j+1 embeds."""
        h = self._last_output()[None]  # (1, 1, H)
        for j in range(k):
            token = choose(j, self.model.logits(h)[0, -1])
            if j + 1 < k:
                h = self.model(token.reshape(1, 1), h, self.cache)

    def chain_logits(self, tokens: list[int], k: int, draft_ids=None) -> list:
        """Draft-vocabulary logits of k chain steps after `tokens` (pending last). Step j+1
        feeds draft j: `draft_ids[j]` (target ids) when given, else step j's argmax."""
        self._rewind(len(tokens) - 1)
        if not self._committed:
            raise ValueError("no committed pair yet: a one-token prompt conditions no draft")
        out = []

        def record(j, logits):
            out.append(logits)
            if draft_ids is not None:
                return self.xp.ids(draft_ids[j : j + 1])  # empty past the last, never read
            return self._target_id(self.xp.argmax(logits))

        self._chain(k, record)
        return out

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig) -> Draft:
        self._rewind(len(tokens) - 1)
        if k < 1 or not self._committed:
            return EMPTY_DRAFT  # no pair yet: nothing conditions a draft
        if self.tree_budget is not None:
            return self._propose_tree(tokens, k, sampling)
        drafts, probs = [], []

        def draw(j, logits):
            row, p = self._draw(logits, sampling)
            drafts.append(self._target_id(row))
            if p is not None:
                probs.append(p)
            return drafts[-1]

        self._chain(k, draw)
        return Draft(tokens=self.xp.stack(drafts), probs=self.xp.stack(probs) if probs else None)

    def _propose_tree(self, tokens: list[int], budget: int, sampling: SamplingConfig) -> Draft:
        """The `budget` candidates of highest path log-probability (EAGLE-2's re-ranking),
        numbered best first: an ancestor scores at least as high and was found earlier, so
        parents come before children, each node's children are ordered best first and the
        first chain is the greedy chain. Children are deterministic (the top ones of the
        drafter's processed distribution when sampling, Draft.probs None): the tree rule with
        one-hot p keeps any deterministic children lossless."""
        scores, ids, parents = self.tree_candidates(tokens, budget, sampling)
        kept, numbers = best_nodes(scores, parents, budget), {0: 0}
        for node, candidate in enumerate(kept, start=1):
            numbers[candidate + 1] = node
        return Draft(tokens=[ids[c] for c in kept],
                     parents=tuple(numbers[parents[c]] for c in kept))

    def tree_candidates(self, tokens: list[int], budget: int, sampling: SamplingConfig):
        """EAGLE-2's expansion after `tokens` (pending last): the root's `width` best tokens
        are depth 1; at each depth the `width` candidates of highest path log-probability go
        through the layer together (each its token and its parent's output, at the position
        of its depth, seeing the committed pairs and its ancestors' entries), and each one's
        `width` best tokens are the next depth's candidates. Device work only until the end,
        then one read of every candidate (width + (depth - 1) * width^2 of them): lists of
        path log-probabilities, target ids and parents (candidate numbers, 1-based in the
        order listed, depth by depth; 0 the pending token)."""
        self._rewind(len(tokens) - 1)
        xp, width = self.xp, min(self.tree_width, budget, self.draft_rows)
        root = self._last_output()
        scores, ids = self._best_children(root, width, sampling)
        scores, ids, hidden = scores[0], ids[0], xp.cat([root] * width)
        columns, expanded = [(scores, ids)], []
        seen = xp.ones(width, self._committed)  # entries each node sees: pairs, its ancestors
        for depth in range(1, min(self.tree_depth, budget)):
            seen = xp.cat([seen, xp.eye(width)], axis=1)
            positions = xp.full(width, self._committed + depth)
            out = self.model(ids[None], hidden[None], self.cache, mask=seen,
                             positions=positions)[0]
            child_scores, child_ids = self._best_children(out, width, sampling)  # (W, W)
            child_scores = (scores[:, None] + child_scores).reshape(-1)
            child_ids = child_ids.reshape(-1)
            columns.append((child_scores, child_ids))
            best = xp.top(child_scores, width)  # the next depth's nodes to expand
            expanded.append(best)
            scores, ids = child_scores[best], child_ids[best]
            hidden, seen = out[best // width], seen[best // width]
        host = xp.read([xp.cat(list(column)) for column in zip(*columns)] + expanded)
        return host[0], host[1], candidate_parents(width, host[2:])

    def commit(self, tokens: list[int], verdict: Verdict) -> None:
        if self._checked(verdict.committed, verdict.features):
            self._deferred.append((list(verdict.committed), verdict.features))
        if len(self._deferred) >= self.deferred_limit:
            self._flush()  # a long run of plain steps pays as it goes, not in one drafting step


class MLXArrays:
    """The array primitives PairedDrafting and DraftModelDrafting use, in MLX."""

    @staticmethod
    def ids(tokens: list[int]) -> mx.array:
        return mx.array(tokens, dtype=mx.int32)[None]

    argmax = staticmethod(mx.argmax)
    stack = staticmethod(mx.stack)

    @staticmethod
    def cat(arrays, axis: int = 0) -> mx.array:
        return mx.concatenate(arrays, axis=axis)

    @staticmethod
    def eye(n: int) -> mx.array:
        return mx.eye(n, dtype=mx.bool_)

    @staticmethod
    def ones(rows: int, columns: int) -> mx.array:
        return mx.ones((rows, columns), dtype=mx.bool_)

    @staticmethod
    def full(n: int, value: int) -> mx.array:
        return mx.full((n,), value, dtype=mx.int32)

    @staticmethod
    def top(x: mx.array, k: int) -> mx.array:
        return mx.argsort(-x)[:k]

    @staticmethod
    def read(arrays) -> list[list]:
        mx.eval(arrays)  # the proposal's one host read
        return [a.tolist() for a in arrays]


class MLXPairedDrafting(PairedDrafting):
    """PairedDrafting's tensor math in MLX: a chain reads nothing back to the host."""

    xp = MLXArrays

    def _cache_length(self) -> int:
        return self.cache[0].offset

    def _cut(self, n: int) -> None:
        for c in self.cache:
            c.trim(n)

    def _draw(self, logits: mx.array, sampling: SamplingConfig):
        if sampling.greedy:
            return mx.argmax(logits), None
        logp = processed_logprobs(logits, sampling)
        return mx.random.categorical(logp), self._over_target_vocab(mx.exp(logp))

    def _best_children(self, hidden: mx.array, width: int, sampling: SamplingConfig):
        logits = self.model.logits(hidden).astype(mx.float32)
        if sampling.greedy:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        else:
            logprobs = processed_logprobs(logits, sampling)
        rows = mx.argsort(-logprobs, axis=-1)[:, :width]
        best = mx.minimum(mx.take_along_axis(logprobs, rows, axis=-1), 0.0)
        return best, self._target_id(rows)

    def _over_target_vocab(self, p: mx.array) -> mx.array:
        """(draft_vocab,) probabilities -> (target_vocab,), zero outside the draft vocabulary."""
        if self.hot_ids is None:
            return p
        return mx.zeros((self.target_vocab,), dtype=p.dtype).at[self.hot_ids].add(p)


def candidate_parents(width: int, expanded: list[list[int]]) -> list[int]:
    """Each tree candidate's parent, in tree_candidates' numbering (1-based; 0 the pending
    token): the root's `width` children, then per depth `width` children of each node expanded
    there, `expanded[d]` giving those nodes' indices among the previous depth's candidates
    (depth 1 expands every root child)."""
    parents, frontier, numbered = [0] * width, range(1, width + 1), width
    for best in expanded:
        parents += [node for node in frontier for _ in range(width)]
        frontier = [numbered + 1 + i for i in best]
        numbered += width * width
    return parents


def best_nodes(scores: list[float], parents: list[int], budget: int) -> list[int]:
    """Indices of the `budget` candidates of highest score, best first (ties: the one listed
    first), leaving out those a truncated distribution ruled out (-inf). A candidate's parent
    (1-based; 0 the root) is listed before it and scores at least as high, so it is kept too."""
    finite = [i for i, s in enumerate(scores) if s > -math.inf]
    return sorted(finite, key=lambda i: -scores[i])[:budget]


def check_tree_options(budget: int | None, width: int, depth: int) -> tuple[int | None, int]:
    """DFlash's tree checks, and the depth's; before any weight loads."""
    check_count("tree_depth", depth)
    return check_tree(budget, width)
