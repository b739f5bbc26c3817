"""Structured output under speculation (mlxspec.constraint): greedy output equals constrained
decoding without speculation token for token, with drafts right, wrong, or forced by the
grammar; replies validate against their schemas; a batch mixes constrained and free rows; a
schema that cannot compile is refused in one line.

The fast tests run a tiny random llama over a byte-level tokenizer (256 bytes and an end token):
llguidance reads it as it reads a real one. The reference decodes one token per full forward
pass, masked by its own llguidance matcher: no cache, no drafts, no mlxspec loop."""

import json
import time

import jsonschema
import numpy as np
import pytest

import mlxspec
import mlx.core as mx
from mlxspec import Constraint
from mlxspec.drafters import DraftModelDrafter
from mlxspec.engine import Draft, Drafter

VOCAB = 257  # 256 bytes, then the end token
EOS = 256

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "address": {"type": "object", "properties": {
            "city": {"enum": ["Paris", "Oslo", "Lima"]},
            "zip": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "bc", "def"]}, "minItems": 1,
                 "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "boolean"}, {"type": "integer", "minimum": -9,
                                                   "maximum": 99}]},
        "score": {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 10}},
        "required": ["value", "score"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "kind": {"enum": ["x", "y"]}},
        "required": ["code", "kind"], "additionalProperties": False},
}


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges (token b is byte b) and an end token 256."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(),
                      key=lambda ch: _byte_of(ch))
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tokenizer,
                                                    eos_token="<eos>"))


def _byte_of(ch: str) -> int:
    """The byte GPT-2's byte-level alphabet shows as `ch`."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    if ord(ch) in printable:
        return ord(ch)
    others = [b for b in range(256) if b not in printable]
    return others[ord(ch) - 256]


@pytest.fixture(scope="module")
def tokenizer():
    tok = byte_tokenizer()
    assert tok.encode('{"a": 1}') == list(b'{"a": 1}') and tok.eos_token_id == EOS
    return tok


@pytest.fixture(scope="module")
def model():
    from tiny_models import tiny_llama

    return tiny_llama(vocab=VOCAB, hidden=32, layers=2, seed=3, sharpness=4.0)


@pytest.fixture(scope="module")
def draft_model():
    from tiny_models import tiny_llama

    return tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=4, sharpness=4.0)


PROMPT = list(b"Reply in JSON: ")


def reference(model, tokenizer, constraint, prompt, max_tokens):
    """Constrained greedy decoding without speculation: a full forward pass per token, its
    last logits masked by a matcher of the test's own."""
    from llguidance import LLMatcher
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    from mlxspec.constraint import ll_tokenizer

    matcher = LLMatcher(ll_tokenizer(tokenizer, VOCAB), constraint.grammar)
    bitmask = allocate_token_bitmask(1, VOCAB)
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        logits = np.array(model(mx.array([tokens]))[0, -1].astype(mx.float32))
        fill_next_token_bitmask(matcher, bitmask)
        allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:VOCAB].astype(bool)
        if not allowed.any():
            allowed[EOS] = True
        token = int(np.argmax(np.where(allowed, logits, -np.inf)))
        out.append(token)
        if token == EOS:
            break
        assert matcher.consume_token(token)
        tokens.append(token)
    return out


class ScriptedDrafter(Drafter):
    """Drafts the reference's own tokens for its first `right` drafts, then tokens the grammar
    allows that the reference did not choose: wrong at every later position, never cut."""

    name = "scripted"
    drafts_from_tokens = True
    max_draft = 8
    default_num_draft = 4

    def __init__(self, constraint, tokenizer, prompt, expected, right=0):
        from mlxspec.constraint import ll_tokenizer

        self.constraint, self.prompt, self.expected, self.right = \
            constraint, len(prompt), expected, right
        self.tokenizer = ll_tokenizer(tokenizer, VOCAB)

    def propose(self, tokens, k, sampling):
        from llguidance import LLMatcher
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        matcher = LLMatcher(self.tokenizer, self.constraint.grammar)
        assert matcher.consume_tokens(tokens[self.prompt:])
        drafts, at = [], len(tokens) - self.prompt
        bitmask = allocate_token_bitmask(1, VOCAB)
        for i in range(k):
            fill_next_token_bitmask(matcher, bitmask)
            allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8),
                                                   bitorder="little")[:VOCAB])
            expected = self.expected[at + i] if at + i < len(self.expected) else None
            if i < self.right and expected is not None:
                token = expected
            else:
                others = [int(t) for t in allowed if t != expected and t != EOS]
                if not others:
                    break
                token = others[0]
            drafts.append(token)
            if token == EOS or not matcher.consume_token(token):
                break
        return Draft(tokens=drafts)


class TreeScripted(ScriptedDrafter):
    """ScriptedDrafter's chain as a tree's branch of first children, with a sibling of the
    first node that the grammar may not allow: verified as its first chain."""

    name = "tree-scripted"
    drafts_trees = True

    def propose(self, tokens, k, sampling):
        chain = super().propose(tokens, max(k - 1, 0), sampling).tokens
        if not chain:
            return Draft(tokens=[])
        parents = tuple(range(len(chain))) + (0,)
        return Draft(tokens=chain + [0], parents=parents)


def run(model, tokenizer, constraint, drafter, max_tokens=120, **options):
    responses = list(mlxspec.stream_generate(model, tokenizer, PROMPT, max_tokens,
                                             drafter=drafter, constraint=constraint, **options))
    tokens = [r.token for r in responses]
    return tokens, responses[-1]


@pytest.mark.parametrize("name", SCHEMAS)
def test_greedy_equals_constrained_decoding_without_speculation(model, draft_model, tokenizer,
                                                                name):
    """Token for token, with lookup, with no drafter (forced drafts only), with a draft model
    (drafts on the device, cut by the grammar, not asked after forced drafts), with drafts
    wrong at every position, and with drafts right at two positions then wrong; the reply ends
    at the end token and validates against its schema."""
    schema = SCHEMAS[name]
    constraint = Constraint.json_schema(schema)
    expected = reference(model, tokenizer, constraint, PROMPT, 120)
    assert expected[-1] == EOS, "the reference reply should finish within the budget"
    for drafter in ["lookup", None, DraftModelDrafter(draft_model),
                    ScriptedDrafter(constraint, tokenizer, PROMPT, expected, right=0),
                    ScriptedDrafter(constraint, tokenizer, PROMPT, expected, right=2)]:
        tokens, last = run(model, tokenizer, constraint, drafter)
        assert tokens == expected, getattr(drafter, "name", drafter)
        assert last.finish_reason == "stop"
        jsonschema.validate(json.loads(bytes(tokens[:-1]).decode()), schema)
        assert last.forced > 0 and last.forced_accepted <= last.forced
        if isinstance(drafter, ScriptedDrafter) and drafter.right == 0:
            assert last.drafted > 0 and last.accepted == 0  # wrong drafts were verified
        if isinstance(drafter, ScriptedDrafter) and drafter.right == 2:
            assert last.accepted > 0


def test_a_constrained_tree_is_verified_as_its_first_chain(model, tokenizer):
    """A target that holds trees still gets a constrained row's first chain (the masks follow
    one path), counted as a chain fallback; the output is the reference's."""
    from mlxspec.backends.mlx.target import MLXTarget
    from mlxspec.engine import SpecStats, speculative_tokens
    from mlxspec.sampling import SamplingConfig

    constraint = Constraint.json_schema(SCHEMAS["array"])
    expected = reference(model, tokenizer, constraint, PROMPT, 120)
    target = MLXTarget(model, speculative=True)
    assert target.holds_trees()
    stats = SpecStats()
    out = speculative_tokens(target, TreeScripted(constraint, tokenizer, PROMPT, expected, 2),
                             PROMPT, sampling=SamplingConfig(), max_tokens=120, num_draft=4,
                             stats=stats, stop_tokens={EOS},
                             matcher=constraint.matcher(tokenizer, VOCAB))
    assert [t for t, _ in out] == expected
    assert stats.chain_fallback_steps > 0 and stats.accepted > 0


def test_forced_drafts_cost_no_pass_of_their_own(model, tokenizer):
    """No drafter: the grammar's forced tokens are verified with the step's own token, so a
    schema full of fixed keys takes fewer passes than tokens; counted apart from `drafted`."""
    constraint = Constraint.json_schema(SCHEMAS["nested"])
    tokens, last = run(model, tokenizer, constraint, None)
    assert last.drafted == 0 and last.forced_accepted >= len('{"name": "')
    assert last.target_passes + last.forced_accepted == len(tokens)


def test_a_prompt_cache_carries_a_constrained_conversation(model, tokenizer):
    """The second turn from a kept cache equals the same prompt from scratch: the grammar
    state is the reply's own, whatever the cache holds."""
    constraint = Constraint.json_schema(SCHEMAS["pattern"])
    cache = mlxspec.PromptCache()
    first, _ = run(model, tokenizer, constraint, "lookup", prompt_cache=cache)
    turn = PROMPT + first[:-1] + list(b" Again: ")
    kept = [r.token for r in mlxspec.stream_generate(model, tokenizer, turn, 60, drafter="lookup",
                                                     constraint=constraint, prompt_cache=cache)]
    fresh = [r.token for r in mlxspec.stream_generate(model, tokenizer, turn, 60,
                                                      drafter="lookup", constraint=constraint)]
    assert kept == fresh and kept[-1] == EOS


def test_mixed_batch_rows_equal_their_lone_generations(model, tokenizer):
    """Constrained and free rows in one batch: each constrained row equals its lone
    constrained generation (and validates), the free row its lone free generation."""
    schemas = [SCHEMAS["nested"], None, SCHEMAS["pattern"], SCHEMAS["array"]]
    constraints = [None if s is None else Constraint.json_schema(s) for s in schemas]
    prompts = [PROMPT, list(b"Free text: "), list(b"Code: "), PROMPT]
    out = mlxspec.batch_generate(model, tokenizer, prompts, 80, drafter="lookup",
                                 constraint=constraints)
    for i, (prompt, constraint, schema) in enumerate(zip(prompts, constraints, schemas)):
        alone = list(mlxspec.stream_generate(model, tokenizer, prompt, 80, drafter="lookup",
                                             constraint=constraint))
        tokens = [r.token for r in alone]
        if alone[-1].finish_reason == "stop":
            tokens = tokens[:-1]
        assert out.token_ids[i] == tokens, i
        if schema is not None:
            assert out.finish_reasons[i] == "stop"
            jsonschema.validate(json.loads(out.texts[i]), schema)
            assert out.stats[i].forced > 0
        else:
            assert out.stats[i].forced == 0


def test_one_constraint_for_every_row_and_a_regex(model, tokenizer):
    constraint = Constraint.regex(r"[a-c]{3}-[0-9]{2}")
    out = mlxspec.batch_generate(model, tokenizer, [PROMPT, list(b"x: ")], 20,
                                 constraint=constraint)
    import re

    for text, reason in zip(out.texts, out.finish_reasons):
        assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", text) and reason == "stop"


def test_json_object_and_lark(model, tokenizer):
    tokens, last = run(model, tokenizer, Constraint.json_object(), "lookup", 200)
    assert last.finish_reason == "stop"
    assert isinstance(json.loads(bytes(tokens[:-1]).decode()), dict)
    grammar = 'start: "yes" | "no" | "n/a " NUMBER\nNUMBER: /[0-9]{1,2}/\n'
    text = mlxspec.generate(model, tokenizer, PROMPT, 20, constraint=Constraint.lark(grammar))
    assert text in ("yes", "no") or (text.startswith("n/a ") and text[4:].isdigit())


def test_sampled_rows_stay_in_the_grammar(model, draft_model, tokenizer):
    """Sampling at temperature 1.5 with lookup and with a draft model (drafts with their own
    distribution p, cut by the grammar): every reply still validates."""
    schema = SCHEMAS["any_of"]
    for drafter in ["lookup", DraftModelDrafter(draft_model)]:
        for seed in range(3):
            tokens, last = run(model, tokenizer, Constraint.json_schema(schema), drafter,
                               temp=1.5, seed=seed)
            assert last.finish_reason == "stop"
            jsonschema.validate(json.loads(bytes(tokens[:-1]).decode()), schema)


REFUSED = {
    "format": ({"type": "string", "format": "no-such-format"}, "no-such-format"),
    "ref": ({"$ref": "#/$defs/missing"}, "missing"),
    "not-json": ('{"type": ', "not valid JSON"),
}


@pytest.mark.parametrize("schema,named", REFUSED.values(), ids=REFUSED)
def test_a_schema_that_cannot_compile_is_refused_in_one_line(schema, named):
    with pytest.raises(ValueError) as err:
        Constraint.json_schema(schema)
    message = str(err.value)
    assert "\n" not in message and named in message and "JSON schema" in message


def test_a_bad_regex_and_grammar_are_refused_in_one_line():
    for make, spec, named in [(Constraint.regex, "a(b", "unclosed group"),
                              (Constraint.lark, "start: missing_rule", "missing_rule")]:
        with pytest.raises(ValueError) as err:
            make(spec)
        assert "\n" not in str(err.value) and named in str(err.value)


def test_a_schema_too_costly_to_compile_is_refused_in_time(monkeypatch):
    """An allOf of many patterns intersects their regexes past llguidance's own fuel: the
    check in a child process is stopped instead."""
    import mlxspec.constraint as constraint

    monkeypatch.setattr(constraint, "COMPILE_SECONDS", 2.0)
    hostile = {"allOf": [{"type": "string", "pattern": f"^.*a{i}.*$"} for i in range(40)]}
    start = time.perf_counter()
    with pytest.raises(ValueError, match="takes more than 2 s to compile"):
        Constraint.json_schema(hostile)
    assert time.perf_counter() - start < 10


def test_a_request_checks_its_constraint_and_drafters_that_cannot_follow_it(model, tokenizer):
    with pytest.raises(TypeError, match="mlxspec.Constraint"):
        mlxspec.Request(constraint={"type": "object"})
    with pytest.raises(ValueError, match="constraint has 1 values for 2 prompts"):
        mlxspec.batch_generate(model, tokenizer, [PROMPT, PROMPT], 4,
                               constraint=[Constraint.json_object()])

    class InTarget(Drafter):
        name = "in-target"
        max_draft = 4
        constraint_refusal = "its drafts run inside the target's own cache"

    with pytest.raises(ValueError, match="cannot draft under a constraint"):
        run(model, tokenizer, Constraint.json_object(), InTarget(), 4)


CHI_REGEX = r"x[ab]{1,2}c?"  # 'x' forced; then a short, enumerable set of replies
CHI_SAMPLES = 1500


class GrammarBlindDrafter(Drafter):
    """Deterministic drafts 'a', 'c', 'b', ...: often allowed, often rejected, sometimes cut."""

    name = "blind"
    drafts_from_tokens = True
    max_draft = 3

    def propose(self, tokens, k, sampling):
        return Draft(tokens=[ord("acb"[i % 3]) for i in range(k)])


def constrained_distribution(model, tokenizer, constraint, sampling):
    """P(reply) of constrained sampling without speculation: at every position the target's
    processed distribution over the tokens the grammar allows there, enumerated over the
    grammar's replies (each ends with the end token)."""
    from mlxspec.backends.mlx.sampling import allowed_logits, processed_logprobs

    matcher = constraint.matcher(tokenizer, VOCAB)
    probs = {}

    def walk(reply, p):
        logits = model(mx.array([PROMPT + reply]))[0, -1:]
        masked = allowed_logits(logits, matcher.masks([]))
        q = np.exp(np.array(processed_logprobs(masked, sampling)[0]))
        for token in np.flatnonzero(q > 0):
            if token == EOS:
                probs[tuple(reply)] = p * q[token]
                continue
            matcher.advance([int(token)])
            walk(reply + [int(token)], p * q[token])
            matcher._matcher.rollback(1)

    walk([], 1.0)
    return probs


@pytest.mark.slow
def test_sampled_constrained_rows_follow_constrained_sampling(tokenizer):
    """χ² of replies sampled with forced and blind drafts against the per-position masked
    distribution, enumerated."""
    from scipy import stats as scipy_stats
    from tiny_models import tiny_llama

    from mlxspec.backends.mlx.target import MLXTarget
    from mlxspec.engine import SpecStats, speculative_tokens
    from mlxspec.sampling import SamplingConfig

    model = tiny_llama(vocab=VOCAB, hidden=32, layers=2, seed=7, sharpness=1.5)
    sampling = SamplingConfig(temp=1.0)
    constraint = Constraint.regex(CHI_REGEX)
    exact = constrained_distribution(model, tokenizer, constraint, sampling)
    assert abs(sum(exact.values()) - 1) < 1e-4 and max(exact.values()) < 0.6
    mx.random.seed(99)
    counts, stats = {}, SpecStats()
    for _ in range(CHI_SAMPLES):
        out = speculative_tokens(MLXTarget(model, speculative=True), GrammarBlindDrafter(),
                                 PROMPT, sampling=sampling, max_tokens=6, num_draft=3,
                                 stats=stats, stop_tokens={EOS},
                                 matcher=constraint.matcher(tokenizer, VOCAB))
        reply = tuple(t for t, _ in out)
        assert reply[-1] == EOS
        counts[reply[:-1]] = counts.get(reply[:-1], 0) + 1
    assert stats.forced_accepted >= CHI_SAMPLES and stats.drafted > 0 and stats.accepted > 0
    assert set(counts) <= set(exact)
    big = [r for r, p in exact.items() if p * CHI_SAMPLES >= 5]
    observed = [counts.get(r, 0) for r in big]
    wanted = [float(exact[r]) for r in big]
    if len(big) < len(exact):  # the rare replies pooled into one cell
        observed.append(CHI_SAMPLES - sum(observed))
        wanted.append(1 - sum(wanted))
    assert len(observed) >= 4
    wanted = np.array(wanted, dtype=np.float64)
    wanted = wanted * (CHI_SAMPLES / wanted.sum())
    assert scipy_stats.chisquare(observed, wanted).pvalue > 1e-3


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["friend", "colleague"]}, "maxItems": 2}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


def test_cli_json_schema_on_the_default_model(tmp_path):
    """`mlxspec generate --json-schema FILE --drafter lookup` on SmolLM2 prints JSON that
    validates; a schema that cannot compile, or two constraints, are refused in one line."""
    from test_cli import assert_clean_error, invoke, ok

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(PERSON))
    result = ok(invoke("generate", "--prompt", "Alice is 31 and a colleague of mine. As JSON:",
                       "--json-schema", str(schema), "--drafter", "lookup", "-n", "120",
                       "--verbose"))
    jsonschema.validate(json.loads(result.stdout), PERSON)
    assert "Forced by the grammar" in result.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "string", "format": "no-such-format"}')
    assert_clean_error(invoke("generate", "--prompt", "x", "--json-schema", str(bad)),
                       "--json-schema", "no-such-format")
    assert_clean_error(invoke("generate", "--prompt", "x", "--json", "--regex", "a+"),
                       "--json, --regex")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Alice is 31 and a friend. As JSON:\nBob is 40, a colleague. As JSON:\n")
    batch = ok(invoke("generate", "--prompts", str(prompts), "--json-schema", str(schema),
                      "--drafter", "lookup", "-n", "120"))
    replies = [json.loads(line) for line in batch.stdout.splitlines()]
    assert len(replies) == 2
    for reply in replies:
        assert reply["finish_reason"] == "stop"
        jsonschema.validate(json.loads(reply["text"]), PERSON)
    chat = ok(invoke("chat", "--regex", "(yes|no)", "--drafter", "lookup",
                     input="Is the sea blue?\n/quit\n"))
    assert any(line.removeprefix(">> ") in ("yes", "no") for line in chat.stdout.splitlines())


def test_the_torch_backend_masks_as_mlx_does(model, tokenizer, tmp_path, one_torch_thread):
    """The same weights in transformers: the torch target applies the same masks, so its
    constrained replies equal MLX's, with lookup and with forced drafts alone."""
    from test_torch_backend import torch_twin

    twin = torch_twin(model, tmp_path / "twin")
    constraint = Constraint.json_schema(SCHEMAS["nested"])
    on_mlx, _ = run(model, tokenizer, constraint, "lookup")
    for drafter in ["lookup", None]:
        tokens, last = run(twin, tokenizer, constraint, drafter)
        assert tokens == on_mlx and last.finish_reason == "stop" and last.forced > 0
