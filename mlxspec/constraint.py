"""Structured output: what a reply must match (a JSON schema, any JSON object, a regex, a Lark
grammar), compiled by llguidance into a grammar, and a per-row `Matcher` that the loop asks, on
the host, which tokens the grammar forces next, how many drafts it allows, and one token mask
per verified position. The masks are the grammar's state after the tokens before each position,
so the target's distribution at every position is masked as constrained decoding without
speculation masks it (per-position masking, as every peer does; not the distribution of
sequences conditioned on the grammar)."""

import json
import subprocess
import sys
import weakref
from dataclasses import dataclass

import numpy as np

# Bounds on what a request may ask the grammar compiler and the mask computation to do, so a
# hostile schema is refused (or stops its row) instead of stalling the process.
MAX_SPEC_CHARS = 1 << 20
LIMITS = dict(max_items_in_row=2000, initial_lexer_fuel=100_000, step_lexer_fuel=200_000,
              step_max_items=50_000, max_lexer_states=50_000, max_grammar_size=200_000,
              verbose_errors=False)
# JSON on one line with a space after ':' and ',', and no other whitespace: the grammar then
# forces the keys' quotes and punctuation, drafts that cost nothing.
JSON_OPTIONS = dict(item_separator=", ", key_separator=": ", whitespace_flexible=False)
KINDS = ("json_schema", "json_object", "regex", "lark")
# llguidance's own limits do not bound every check (an allOf of many patterns intersects their
# regexes past any fuel): a grammar is first checked in a child process, given this long.
COMPILE_SECONDS = 10.0
_CHECK = """
import json, sys
from llguidance import LLMatcher, LLParserLimits
job = json.load(sys.stdin)
failed, messages = LLMatcher.validate_grammar_with_warnings(
    job["grammar"], limits=LLParserLimits(**job["limits"]))
json.dump(messages[0] if failed else "", sys.stdout)
"""
_CHECKED: dict[str, str] = {}  # grammar -> error ("": none), the latest few


def _limits():
    from llguidance import LLParserLimits

    return LLParserLimits(**LIMITS)


def _one_line(message: str) -> str:
    """llguidance's error, one line: its first line and the line naming the error, without
    the source excerpt and caret it draws below."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    named = [line for line in lines[1:] if line.startswith("error:")]
    return "; ".join(lines[:1] + named)


@dataclass(frozen=True)
class Constraint:
    """What a reply must match: `kind` (one of KINDS) and its `spec` (the schema as JSON text,
    the pattern, the Lark grammar). Built by a constructor, which compiles and checks the
    grammar (ValueError, one line, naming what it cannot compile) before any model work."""

    kind: str
    spec: str
    grammar: str

    @classmethod
    def json_schema(cls, schema: "dict | str") -> "Constraint":
        """A JSON value following `schema` (a dict, or its JSON text)."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        _check_size("JSON schema", text)
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"the JSON schema is not valid JSON ({err})") from None
        if not isinstance(parsed, (dict, bool)):
            raise ValueError(f"a JSON schema is an object, got {type(parsed).__name__}")
        return cls._compiled("json_schema", text, parsed)

    @classmethod
    def json_object(cls) -> "Constraint":
        """Any JSON object (OpenAI's response_format json_object)."""
        return cls._compiled("json_object", "", {"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        """Text matching `pattern` whole (Rust regex syntax)."""
        if not isinstance(pattern, str):
            raise TypeError(f"a regex is a string, got {type(pattern).__name__}")
        _check_size("regex", pattern)
        return cls._compiled("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> "Constraint":
        """Text in the language of a Lark grammar (llguidance's dialect: `start` first)."""
        if not isinstance(grammar, str):
            raise TypeError(f"a Lark grammar is a string, got {type(grammar).__name__}")
        _check_size("Lark grammar", grammar)
        return cls._compiled("lark", grammar)

    @classmethod
    def _compiled(cls, kind: str, spec: str, schema=None) -> "Constraint":
        from llguidance import LLMatcher

        what = {"json_schema": "JSON schema", "json_object": "JSON schema", "regex": "regex",
                "lark": "Lark grammar"}[kind]
        try:
            if schema is not None:
                grammar = LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
            elif kind == "regex":
                grammar = LLMatcher.grammar_from_regex(spec)
            else:
                grammar = LLMatcher.grammar_from_lark(spec)
        except ValueError as err:
            raise ValueError(f"the {what} cannot be compiled: {_one_line(str(err))}") from None
        error = _grammar_error(grammar, what)
        if error:
            raise ValueError(f"the {what} cannot be compiled: {_one_line(error)}")
        return cls(kind, spec, grammar)

    def matcher(self, tokenizer, vocab_size: int) -> "Matcher":
        """A fresh matcher of this constraint over `tokenizer` (mlx-lm's TokenizerWrapper, a
        transformers fast tokenizer, or an llguidance LLTokenizer) for a model whose logits
        have `vocab_size` entries."""
        return Matcher(self, ll_tokenizer(tokenizer, vocab_size), vocab_size)


def _grammar_error(grammar: str, what: str) -> str:
    """llguidance's error for `grammar` ("": none), checked in a child process that is stopped
    after COMPILE_SECONDS; the latest answers are kept."""
    if grammar not in _CHECKED:
        job = json.dumps({"grammar": grammar, "limits": LIMITS})
        try:
            done = subprocess.run([sys.executable, "-c", _CHECK], input=job, text=True,
                                  capture_output=True, timeout=COMPILE_SECONDS)
        except subprocess.TimeoutExpired:
            raise ValueError(f"the {what} takes more than {COMPILE_SECONDS:g} s to compile; "
                             "simplify it") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise ValueError(f"the {what} cannot be compiled: {last}")
        if len(_CHECKED) >= 256:
            _CHECKED.pop(next(iter(_CHECKED)))
        _CHECKED[grammar] = json.loads(done.stdout)
    return _CHECKED[grammar]


def _check_size(what: str, text: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"the {what} is {len(text)} characters; at most {MAX_SPEC_CHARS} are "
                         "compiled")


def check_constraint(value) -> None:
    """A request's `constraint`: None or a Constraint (built by one of its constructors)."""
    if value is not None and not isinstance(value, Constraint):
        raise TypeError(f"constraint must be an mlxspec.Constraint (Constraint.json_schema, "
                        f".json_object, .regex or .lark) or None, got {type(value).__name__}")


_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of `tokenizer` with `vocab_size` entries (what the model's logits
    hold) and its end-of-sequence tokens, built once per tokenizer (about a second for a real
    vocabulary)."""
    from llguidance import LLTokenizer

    if isinstance(tokenizer, LLTokenizer):
        return tokenizer
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper holds it
    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
    key = (vocab_size, tuple(eos))
    try:
        built = _TOKENIZERS.setdefault(hf, {})
    except TypeError:  # not weakly referenceable: built every time
        built = {}
    if key not in built:
        import llguidance.hf

        try:
            built[key] = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
        except ValueError as err:
            raise ValueError(f"constraints need a fast (tokenizers) tokenizer: {err}") from None
    return built[key]


class Matcher:
    """One row's grammar state. It advances only on committed tokens (`advance`); `masks`
    looks ahead over a step's drafts and rolls back."""

    def __init__(self, constraint: Constraint, tokenizer, vocab_size: int):
        from llguidance import LLMatcher

        self.constraint = constraint
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.eos = list(tokenizer.eos_tokens)
        self._matcher = LLMatcher(tokenizer, constraint.grammar, log_level=0, limits=_limits())
        self._check()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise ValueError(f"the {self.constraint.kind} constraint failed: "
                             f"{_one_line(self._matcher.get_error())}")

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar allows as the only continuation."""
        if limit <= 0 or self._matcher.is_stopped():
            return []
        return self._matcher.compute_ff_tokens()[:limit]

    def allowed(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar allows from here."""
        return self._matcher.validate_tokens(tokens) if tokens else 0

    def masks(self, drafts: list[int]) -> np.ndarray:
        """(len(drafts) + 1, words) int32 bit masks, bit t of word t // 32 set where token t is
        allowed: the state now, then after each draft (all allowed: see `allowed`). A state that
        allows nothing, or follows an end-of-sequence draft (the row ends there; llguidance
        does not roll one back), allows the end-of-sequence tokens."""
        from llguidance.numpy import fill_next_token_bitmask

        masks = np.zeros((len(drafts) + 1, self.words), dtype=np.int32)
        consumed = 0
        try:
            for i in range(len(drafts) + 1):
                fill_next_token_bitmask(self._matcher, masks, i)
                if i == len(drafts) or drafts[i] in self.eos:
                    break
                if not self._matcher.consume_token(drafts[i]):
                    self._check()
                consumed += 1
        finally:
            self._matcher.rollback(consumed)
        self._check()
        bits = masks.view(np.uint32)
        for row in np.flatnonzero(~masks.any(axis=1)):
            for token in self.eos:
                bits[row, token // 32] |= np.uint32(1 << (token % 32))
        return masks

    def advance(self, tokens: list[int]) -> None:
        """Committed tokens: the grammar's state moves past them, up to an end-of-sequence
        token (the row ends there; a grammar that has stopped takes no token, not even it)."""
        end = next((i for i, t in enumerate(tokens) if t in self.eos), len(tokens))
        if end and not self._matcher.consume_tokens(tokens[:end]):
            self._check()
            raise RuntimeError(f"a committed token the grammar forbids: {tokens}")

    def is_stopped(self) -> bool:
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()
