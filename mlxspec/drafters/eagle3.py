"""EAGLE-3 drafting for the shared loop: a chain of K autoregressive drafter steps, or a tree.

The drafter's cache holds one pair (token i+1, target features of position i) per committed
position but the pending one's: exactly what the target has processed. Its last output h
already ranks the pending token's successor, so draft 1 costs only the head; drafts 2..K each
run the drafter's layer once more on (previous draft, previous h) at the next position, as the
EAGLE-3 paper's test-time chain (and mlx-vlm's, speculators' TTT steps) does. After
verification those chain positions are cut from the cache and the newly committed pairs are
appended with the target's features. A chain reads nothing back to the host.

Drafts are argmax when greedy (one-hot p); when sampling, each draft is drawn from the drafter's
processed distribution over its draft vocabulary, reported over the target's vocabulary with
zeros outside it, so accept_sampled's rule stays lossless.

With `tree_budget` the drafter proposes EAGLE-2's dynamic tree instead (Li et al., 2024): each
depth expands the `tree_width` most probable nodes at once, in one pass of the layer, and the
`tree_budget` most probable of all candidates are verified. The candidates are read to the
host once (the tree's shape depends on them); their entries are cut from the cache after
verification as a chain's steps are.
"""

import math

import mlx.core as mx

from ..engine import EMPTY_DRAFT, Draft, Drafter, Verdict
from ..generate import check_count
from ..hidden_states import decoder_layers
from ..models.eagle3 import Eagle3Model
from ..sampling import SamplingConfig, processed_logprobs
from .dflash import check_tree


class Eagle3Drafter(Drafter):
    name = "eagle3"

    def __init__(self, model: Eagle3Model, *, num_target_layers: int, target_vocab: int,
                 tree_budget: int | None = None, tree_width: int = 4, tree_depth: int = 6):
        self.model = model
        self.args = model.args
        self.capture_layers = tuple(self.args.capture_layers(num_target_layers))
        self.default_num_draft = int(self.args.num_speculative_tokens or 3)
        # EAGLE-2's dynamic tree of up to `tree_budget` nodes, `tree_width` children per node
        # and `tree_depth` levels (fewer when the budget is smaller), instead of a chain.
        self.tree_budget, self.tree_width = check_tree_options(tree_budget, tree_width, tree_depth)
        self.tree_depth = tree_depth
        if self.tree_budget is not None:
            self.default_num_draft = self.max_draft = self.tree_budget
            self.drafts_trees = True
        self.target_vocab = int(target_vocab)
        self.hot_ids = model.target_ids()  # target id of each draft-vocabulary row
        self.cache = model.make_cache()
        self._hidden: list[mx.array] = []  # the layer's outputs per committed pair, in chunks
        self._committed = 0  # pairs in the cache (the cache may hold chain steps beyond)

    @property
    def context_length(self) -> int:
        """Committed positions whose pairs are cached (all committed tokens but the pending)."""
        return self._committed

    def begin(self, prompt, features=None):
        self.cache = self.model.make_cache()
        self._hidden, self._committed = [], 0
        self._append(list(prompt[1:]), features)

    def _append(self, tokens: list[int], features) -> None:
        """Pairs (tokens[j], features[j]): the token that follows each featured position."""
        if features is None:
            raise ValueError(
                "the EAGLE-3 drafter needs target hidden states: build the target with "
                "capture_layers=drafter.capture_layers"
            )
        if features.shape[0] == 0:  # a one-token prompt has no pair yet
            return
        width = self.args.num_aux_layers * self.args.target_hidden_size
        if features.ndim != 2 or features.shape[1] != width:
            raise ValueError(
                f"target features have shape {tuple(features.shape)}; the EAGLE-3 drafter "
                f"expects (positions, {width}) from layers {list(self.capture_layers)}"
            )
        if features.shape[0] != len(tokens):
            raise ValueError(f"{features.shape[0]} feature rows for {len(tokens)} tokens")
        self._trim_chain()
        ids = mx.array(tokens, dtype=mx.int32)[None]
        h = self.model(ids, self.model.project(features[None]), self.cache)
        self._hidden.append(h[0])
        self._committed += len(tokens)

    def _trim_chain(self) -> None:
        """Drop the chain steps of the last proposal from the cache."""
        excess = self.cache[0].offset - self._committed
        if excess > 0:
            for c in self.cache:
                c.trim(excess)

    def _rewind(self, num_pairs: int) -> None:
        """Keep exactly `num_pairs` committed pairs (a caller may have rolled back)."""
        if num_pairs > self._committed:
            raise ValueError(
                f"the EAGLE-3 context holds {self._committed} positions but {num_pairs} tokens "
                "precede the pending one; commit() must receive every verdict's features"
            )
        self._trim_chain()
        drop = self._committed - num_pairs
        if drop:
            for c in self.cache:
                c.trim(drop)
            kept, total = [], 0
            for chunk in self._hidden:
                if total + chunk.shape[0] > num_pairs:
                    chunk = chunk[: num_pairs - total]
                if chunk.shape[0]:
                    kept.append(chunk)
                total += chunk.shape[0]
            self._hidden, self._committed = kept, num_pairs

    def chain_logits(self, tokens: list[int], k: int, draft_ids=None) -> list[mx.array]:
        """Draft-vocabulary logits of k chain steps after `tokens` (pending last). Step j+1
        feeds draft j: `draft_ids[j]` (target ids) when given, else step j's argmax."""
        self._rewind(len(tokens) - 1)
        if not self._committed:
            raise ValueError("no committed pair yet: a one-token prompt conditions no draft")
        h = self._hidden[-1][-1:][None]  # (1, 1, H): the last committed pair's output
        out = []
        for j in range(k):
            logits = self.model.logits(h)[0, -1]
            out.append(logits)
            if j + 1 < k:
                token = (mx.array(draft_ids[j], dtype=mx.int32) if draft_ids is not None
                         else self.hot_ids[mx.argmax(logits)])
                h = self.model(token.reshape(1, 1), h, self.cache)
        return out

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig) -> Draft:
        self._rewind(len(tokens) - 1)
        if k < 1 or not self._committed:
            return EMPTY_DRAFT  # no pair yet: nothing conditions a draft
        if self.tree_budget is not None:
            return self._propose_tree(tokens, k, sampling)
        h = self._hidden[-1][-1:][None]
        drafts, probs = [], []
        for j in range(k):
            logits = self.model.logits(h)[0, -1]
            if sampling.greedy:
                row = mx.argmax(logits)
            else:
                logp = processed_logprobs(logits, sampling)
                row = mx.random.categorical(logp)
                probs.append(self._over_target_vocab(mx.exp(logp)))
            token = self.hot_ids[row]
            drafts.append(token)
            if j + 1 < k:
                h = self.model(token.reshape(1, 1), h, self.cache)
        return Draft(tokens=mx.stack(drafts).astype(mx.int32),
                     probs=mx.stack(probs) if probs else None)

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
        width = min(self.tree_width, budget, self.args.draft_vocab_size)
        root = self._hidden[-1][-1:]  # (1, H): the last committed pair's output
        scores, ids = self._best_children(root, width, sampling)
        levels = [(scores[0], ids[0], mx.zeros((width,), dtype=mx.int32))]
        frontier = mx.arange(1, width + 1)  # candidate numbers of the nodes to expand
        scores, ids, hidden = scores[0], ids[0], mx.repeat(root, width, axis=0)
        seen = mx.zeros((width, 0), dtype=mx.bool_)  # their ancestors among the tree's entries
        context = mx.ones((width, self._committed), dtype=mx.bool_)
        numbered = width
        for depth in range(1, min(self.tree_depth, budget)):
            seen = mx.concatenate([seen, mx.eye(width, dtype=mx.bool_)], axis=1)
            positions = mx.full((width,), self._committed + depth, dtype=mx.int32)
            out = self.model(ids[None], hidden[None], self.cache,
                             mask=mx.concatenate([context, seen], axis=1), positions=positions)[0]
            child_scores, child_ids = self._best_children(out, width, sampling)  # (W, W)
            child_scores = (scores[:, None] + child_scores).reshape(-1)
            child_ids = child_ids.reshape(-1)
            levels.append((child_scores, child_ids, mx.repeat(frontier, width)))
            best = mx.argsort(-child_scores)[:width]  # the next depth's nodes to expand
            frontier, numbered = numbered + 1 + best, numbered + width * width
            scores, ids = child_scores[best], child_ids[best]
            hidden, seen = out[best // width], seen[best // width]
        columns = [mx.concatenate(list(column)) for column in zip(*levels)]
        mx.eval(columns)  # the proposal's one host read
        return tuple(column.tolist() for column in columns)

    def _best_children(self, hidden: mx.array, width: int, sampling: SamplingConfig):
        """Layer outputs (n, H) -> the `width` best next tokens of each, (n, width): their
        log-probabilities (never above 0, so a path's score only falls) and target ids."""
        logits = self.model.logits(hidden).astype(mx.float32)
        if sampling.greedy:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        else:
            logprobs = processed_logprobs(logits, sampling)
        rows = mx.argsort(-logprobs, axis=-1)[:, :width]
        best = mx.minimum(mx.take_along_axis(logprobs, rows, axis=-1), 0.0)
        return best, self.hot_ids[rows]

    def _over_target_vocab(self, p: mx.array) -> mx.array:
        """(draft_vocab,) probabilities -> (target_vocab,), zero outside the draft vocabulary."""
        if not self.args.uses_draft_vocab and self.model.d2t is None:
            return p
        return mx.zeros((self.target_vocab,), dtype=p.dtype).at[self.hot_ids].add(p)

    def commit(self, tokens: list[int], verdict: Verdict) -> None:
        self._trim_chain()
        self._append(verdict.committed, verdict.features)


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


def load_eagle3_drafter(path, *, model, tokenizer=None, dtype=None, tree_budget: int | None = None,
                        tree_width: int = 4, tree_depth: int = 6) -> Eagle3Drafter:
    """Load an EAGLE-3 checkpoint directory (speculators or SpecForge/SGLang layout) for target
    `model`, checked against it before any compute (see eagle3_loading.load_eagle3_model).
    `tokenizer` is accepted for symmetry with other drafters.
    `tree_budget`: draft EAGLE-2's dynamic tree of up to this many nodes, `tree_width` children
    per node and `tree_depth` levels, instead of a chain."""
    from .dflash import target_sizes
    from .eagle3_loading import load_eagle3_model

    check_tree_options(tree_budget, tree_width, tree_depth)
    drafter_model = load_eagle3_model(path, model=model, dtype=dtype)
    _, vocab, _ = target_sizes(model)
    return Eagle3Drafter(drafter_model, num_target_layers=len(decoder_layers(model)),
                         target_vocab=vocab, tree_budget=tree_budget, tree_width=tree_width,
                         tree_depth=tree_depth)
