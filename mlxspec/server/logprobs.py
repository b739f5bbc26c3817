"""Logprobs of the returned tokens, kept in step with the returned text, in OpenAI's two shapes.

The engine gives each generated token its logprob and its n best rivals (stream_generate's
`logprobs`): the target's distribution after the request's processing (temperature, top-p, top-k,
min-p), its raw log-softmax when greedy. The server returns text that may lag the tokens (a tail
that could start a stop string is held back) or end inside one (a stop string cuts it), so each
token is kept with the span of output text it produced, and returned with the chunk that returns
the end of that span. When a stop string cuts the output, the tokens whose text was returned at
least in part are returned, and the rest (all of whose text was cut) are not: the logprobs
describe exactly the tokens of the text the client got.
"""

import re
from collections import deque
from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    start: int = 0  # its text's span in the output text
    end: int = 0


class TokenTrail:
    """The tokens of one output whose logprobs are not yet returned, with their text spans."""

    def __init__(self):
        self._pending: deque[TokenLogprob] = deque()
        self._length = 0  # characters of output text so far
        self._counted = 0  # tokens seen

    def add(self, response) -> None:
        """A GenerationResponse: a new token (unless it is the end-of-sequence token, which
        is not output) and the text it brought."""
        if response.generation_tokens > self._counted:
            self._counted = response.generation_tokens
            self._pending.append(TokenLogprob(response.token, response.logprob,
                                              list(response.top_logprobs or []),
                                              self._length, self._length))
        self._length += len(response.text)
        if self._pending:
            self._pending[-1].end = self._length

    def release(self, returned: int) -> list[TokenLogprob]:
        """The tokens whose whole text lies in the first `returned` characters of output."""
        out = []
        while self._pending and self._pending[0].end <= returned:
            out.append(self._pending.popleft())
        return out

    def finish(self, returned: int) -> list[TokenLogprob]:
        """At the end: the tokens whose text was returned at least in part (all of them unless
        a stop string cut the text); the others' text was never returned."""
        out = [t for t in self._pending if t.start < returned or t.end <= returned]
        self._pending.clear()
        return out


_SPM_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces


class TokenNames:
    """A token id's text and bytes, as OpenAI's logprobs show them: the token's own bytes, read
    from its vocabulary entry the way mlx-lm's streaming detokenizers read it (byte-level BPE's
    byte alphabet, SentencePiece's "▁" and <0xNN> pieces), so a token that is part of a UTF-8
    character has its true bytes; its text is those bytes decoded (with replacement)."""

    def __init__(self, tokenizer):
        from mlx_lm.tokenizer_utils import (
            BPEStreamingDetokenizer,
            SPMStreamingDetokenizer,
            _byte_decoder,
        )

        self.tokenizer = tokenizer
        detokenizer = getattr(tokenizer, "detokenizer", None)
        self._byte_level = _byte_decoder() if isinstance(detokenizer, BPEStreamingDetokenizer) \
            else None
        self._sentencepiece = isinstance(detokenizer, SPMStreamingDetokenizer)
        self._known: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        if token not in self._known:
            raw = self._bytes(token)
            self._known[token] = (raw.decode("utf-8", errors="replace"), list(raw))
        return self._known[token]

    def _bytes(self, token: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if isinstance(piece, str):
            if self._byte_level is not None and all(c in self._byte_level for c in piece):
                return bytes(self._byte_level[c] for c in piece)
            if self._sentencepiece:
                byte = _SPM_BYTE.fullmatch(piece)
                return bytes([int(byte[1], 16)]) if byte else \
                    piece.replace("\u2581", " ").encode()
        return self.tokenizer.decode([token]).encode("utf-8")


def chat_logprobs(tokens: list[TokenLogprob], names: TokenNames) -> dict:
    """Chat completions' choices[].logprobs: {"content": [{token, logprob, bytes,
    top_logprobs}]}."""
    def entry(token: int, logprob: float) -> dict:
        text, raw = names(token)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {"content": [{**entry(t.token, t.logprob),
                         "top_logprobs": [entry(i, lp) for i, lp in t.top]} for t in tokens]}


def completion_logprobs(tokens: list[TokenLogprob], names: TokenNames) -> dict:
    """Completions' choices[].logprobs: tokens, token_logprobs, top_logprobs (token -> logprob,
    best first) and text_offset (where each token's text starts in the completion)."""
    def top(pairs) -> dict:
        best: dict[str, float] = {}
        for token, logprob in pairs:
            best.setdefault(names(token)[0], logprob)  # two ids of one text: the likelier
        return best

    return {"tokens": [names(t.token)[0] for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [top(t.top) for t in tokens],
            "text_offset": [t.start for t in tokens]}


__all__ = ["TokenLogprob", "TokenNames", "TokenTrail", "chat_logprobs", "completion_logprobs"]
