"""EAGLE-3 drafting for the shared loop: a chain of K autoregressive drafter steps.

The drafter's cache holds one pair (token i+1, target features of position i) per committed
position but the pending one's: exactly what the target has processed. Its last output h
already ranks the pending token's successor, so draft 1 costs only the head; drafts 2..K each
run the drafter's layer once more on (previous draft, previous h) at the next position, as the
EAGLE-3 paper's test-time chain (and mlx-vlm's, speculators' TTT steps) does. After
verification those chain positions are cut from the cache and the newly committed pairs are
appended with the target's features. Nothing here reads a value back to the host.

Drafts are argmax when greedy (one-hot p); when sampling, each draft is drawn from the drafter's
processed distribution over its draft vocabulary, reported over the target's vocabulary with
zeros outside it, so accept_sampled's rule stays lossless.
"""

import mlx.core as mx

from ..engine import EMPTY_DRAFT, Draft, Drafter, Verdict
from ..hidden_states import decoder_layers
from ..models.eagle3 import Eagle3Model
from ..sampling import SamplingConfig, processed_logprobs


class Eagle3Drafter(Drafter):
    name = "eagle3"

    def __init__(self, model: Eagle3Model, *, num_target_layers: int, target_vocab: int):
        self.model = model
        self.args = model.args
        self.capture_layers = tuple(self.args.capture_layers(num_target_layers))
        self.default_num_draft = int(self.args.num_speculative_tokens or 3)
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

    def _over_target_vocab(self, p: mx.array) -> mx.array:
        """(draft_vocab,) probabilities -> (target_vocab,), zero outside the draft vocabulary."""
        if not self.args.uses_draft_vocab and self.model.d2t is None:
            return p
        return mx.zeros((self.target_vocab,), dtype=p.dtype).at[self.hot_ids].add(p)

    def commit(self, tokens: list[int], verdict: Verdict) -> None:
        self._trim_chain()
        self._append(verdict.committed, verdict.features)


def load_eagle3_drafter(path, *, model, tokenizer=None, dtype=None) -> Eagle3Drafter:
    """Load an EAGLE-3 checkpoint directory (speculators or SpecForge/SGLang layout) for target
    `model`, checked against it before any compute (see eagle3_loading.load_eagle3_model).
    `tokenizer` is accepted for symmetry with other drafters."""
    from .dflash import target_sizes
    from .eagle3_loading import load_eagle3_model

    drafter_model = load_eagle3_model(path, model=model, dtype=dtype)
    _, vocab, _ = target_sizes(model)
    return Eagle3Drafter(drafter_model, num_target_layers=len(decoder_layers(model)),
                         target_vocab=vocab)
