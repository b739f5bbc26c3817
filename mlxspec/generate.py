"""Text generation API shaped like mlx-lm's: token loop -> response stream -> collected text."""

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator, Sequence

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .backends import Backend, backend_for
from .backends.mlx.target import PromptCache
from .constraint import Constraint
from .distributed import follow_generation, leading
from .engine import Drafter, SpecStats, draft_limit, requested_drafts, speculative_tokens
from .generation_lock import one_generation_per_model
from .request import Request
from .sampling import SamplingConfig, is_integer


@dataclass
class GenerationResponse:
    """One streamed piece of output; the last one has `finish_reason` set and final stats.

    Each response carries one token. The last one's is part of the output when `finish_reason`
    is "length"; when it is "stop", `token` is the end-of-sequence token that stopped the
    generation, which is not part of the output: it adds no text of its own (`text` holds only
    what the detokenizer still held back) and `generation_tokens` does not count it. Its
    `logprob` and `top_logprobs` are still the target's at that position (the chance of
    stopping there), so a caller that lists the output's tokens leaves that last one out.
    """

    text: str
    token: int
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None
    target_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    tau: float = 0.0
    acceptance_rate: float = 0.0
    acceptance_per_position: list[float] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    drafter: str = "none"
    num_draft: int = 0
    # Under a constraint: drafts its grammar forced (counted apart from `drafted`), accepted.
    forced: int = 0
    forced_accepted: int = 0
    # Seconds the loop spent queuing passes (drafting, building and dispatching their graphs)
    # and waiting for their results; the rest of the time was host work between them.
    launch_seconds: float = 0.0
    wait_seconds: float = 0.0
    # With the request's `logprobs` n: `token`'s log-probability and the n likeliest tokens
    # with theirs, best first (tokens of probability 0 left out); None and [] without.
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


def encode_prompt(tokenizer: TokenizerWrapper, prompt: str | Sequence[int]) -> list[int]:
    """Tokens of the prompt as given; a BOS is added unless the text already starts with one."""
    if isinstance(prompt, str):
        check_utf8(prompt, "the prompt")
        bos = tokenizer.bos_token
        add_special = bos is None or not prompt.startswith(bos)
        return tokenizer.encode(prompt, add_special_tokens=add_special)
    if isinstance(prompt, mx.array):
        prompt = prompt.tolist()
    bad = next((t for t in prompt if not is_integer(t)), None)
    if bad is not None:
        raise TypeError(f"prompt token ids must be integers, got {bad!r} ({type(bad).__name__})")
    return [int(t) for t in prompt]


def check_utf8(text: str, what: str) -> str:
    """`text` if it is valid UTF-8; else a ValueError naming the first bad byte (argv and stdin
    carry undecodable bytes as surrogates, which no tokenizer takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        char = ord(text[err.start])
        byte = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"U+{char:04X}"
        raise ValueError(f"{what} is not valid UTF-8 text ({byte} at character {err.start}); "
                         "re-encode it as UTF-8") from None
    return text


def check_request(parts: Backend, model, prompt_tokens: list[int], max_tokens: int) -> None:
    """Reject requests that cannot succeed, before any compute: an out-of-vocabulary id would
    read past the embedding table (a crash, or silent garbage)."""
    if not prompt_tokens:
        raise ValueError("the prompt is empty")
    vocab = parts.vocab_size(model)
    bad = next((t for t in prompt_tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(
            f"prompt token id {bad} is outside the model's vocabulary of {vocab} tokens "
            f"(valid ids: 0 to {vocab - 1})"
        )
    limit = parts.context_length(model)
    if limit is not None and len(prompt_tokens) + max_tokens > limit:
        raise ValueError(
            f"prompt ({len(prompt_tokens)} tokens) + max_tokens ({max_tokens}) exceeds the "
            f"model's context window of {limit} tokens"
        )


def _as_wrapper(tokenizer) -> TokenizerWrapper:
    return tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)


def stream_generate(
    model, tokenizer, prompt: str | Sequence[int], max_tokens: int = 256, *,
    drafter: Drafter | str | None = None, num_draft: int | None = None, adaptive: bool = True,
    temp: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
    seed: int | None = None, prompt_cache: PromptCache | None = None, backend: str | None = None,
    overlap: bool = True, logprobs: int | None = None, kv_bits: int | None = None,
    kv_group_size: int = 64, constraint: Constraint | None = None,
) -> Iterator[GenerationResponse]:
    """Stream the continuation of `prompt` (a string or token ids, used as given).

    With `drafter` (a Drafter, or the name of one that needs no files: "lookup") tokens are
    produced speculatively; the output is the same as without it (greedy: token for token;
    sampled: in distribution). The other options make a `Request` (mlxspec.request says what
    each means: max_tokens, num_draft, adaptive, temp, top_p, top_k, min_p, seed, logprobs,
    overlap, kv_bits, kv_group_size, constraint), checked before any work; `stream_request`
    takes one already built. `constraint` (Constraint.json_schema, .json_object, .regex,
    .lark) makes the reply match it, with any drafter.
    A `PromptCache` carries the target's KV cache across calls (chat turns), so only the part of
    the prompt not already in it is prefilled (a drafter that reads target features continues
    the prompt whose features it kept); `PromptCache.save`/`load` keep it in a file.
    The backend follows the model: an mlx-lm model runs on MLX, a transformers model (from
    `mlxspec.load(..., backend="torch")`) on torch, with a `TorchPromptCache` for `prompt_cache`;
    `backend` ("mlx" or "torch") only checks that the model is of that kind.
    """
    sampling = SamplingConfig(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    request = Request(max_tokens, sampling, num_draft=num_draft, adaptive=adaptive,
                      logprobs=logprobs, overlap=overlap, kv_bits=kv_bits,
                      kv_group_size=kv_group_size, constraint=constraint)
    yield from stream_request(model, tokenizer, prompt, request, drafter=drafter,
                              prompt_cache=prompt_cache, backend=backend)


@one_generation_per_model  # safe from several threads: they take turns
def stream_request(model, tokenizer, prompt: str | Sequence[int], request: Request, *,
                   drafter: Drafter | str | None = None, prompt_cache=None,
                   backend: str | None = None) -> Iterator[GenerationResponse]:
    """`stream_generate` for a `Request` already built (the CLI's, a server's, bench's): the
    prompt is checked, the drafter and the target are set up (on a split target, on rank 0: the
    other ranks follow its passes), then each token is streamed with one host sync per step."""
    parts = backend_for(model, backend)
    check_prompt_cache(parts, prompt_cache)
    tokenizer = _as_wrapper(tokenizer)
    prompt_tokens = encode_prompt(tokenizer, prompt)
    check_request(parts, model, prompt_tokens, request.max_tokens)
    if request.kv_bits is not None and not parts.mlx_lm:
        raise ValueError(f"kv_bits quantizes MLX caches; this is a {parts.name} model")
    matcher = request_matcher(request, tokenizer, parts.vocab_size(model))
    if follow_generation(model):  # another rank of a split target ran its share of the passes
        return
    opening = partial(open_session, model=model, tokenizer=tokenizer, drafter=drafter,
                      request=request, prompt_tokens=prompt_tokens, prompt_cache=prompt_cache)
    with leading(model, parts.target, opening) as session:
        if request.sampling.seed is not None:
            parts.seed(request.sampling.seed)
        stats, eos = SpecStats(), frozenset(tokenizer.eos_token_ids)
        steps = speculative_tokens(
            session.target, session.drafter, prompt_tokens, sampling=request.sampling,
            max_tokens=request.max_tokens, num_draft=session.num_draft, stats=stats,
            adaptive=request.adaptive, stop_tokens=eos, overlap=request.overlap,
            logprobs=request.logprobs, matcher=matcher)
        detokenizer = tokenizer.detokenizer
        respond = Responses(detokenizer, len(prompt_tokens), stats, session,
                            partial(parts.peak_memory_gb, model))
        n, token, from_draft, scores, finish_reason = 0, None, False, (), "length"
        output = []
        try:
            for token, from_draft, *scores in parts.run_steps(steps):  # scores: (logprob, top)
                output.append(token)
                if n == 0:
                    respond.first_token()
                if token in eos:
                    finish_reason = "stop"
                    break
                n += 1
                detokenizer.add_token(token)
                if n == request.max_tokens:
                    break
                yield respond(token, from_draft, scores, n)
            detokenizer.finalize()
            yield respond(token, from_draft, scores, n, finish_reason)
        finally:  # also when the caller stops early (Ctrl-C in chat): the cache stays consistent
            steps.close()  # the loop drops the drafts of a pass it had queued
            if session.kept is not None and session.drafter.capture_layers:
                session.kept.remember_prompt(
                    prompt_tokens, getattr(session.target, "prompt_features", None),
                    session.drafter.capture_layers, getattr(session.target, "prompt_state", None))
            elif session.kept is not None:
                session.kept.remember(prompt_tokens + output)


def request_matcher(request: Request, tokenizer, vocab_size: int):
    """The request's constraint as a fresh grammar state over `tokenizer` (None without one)."""
    if request.constraint is None:
        return None
    return request.constraint.matcher(tokenizer, vocab_size)


def check_prompt_cache(parts: Backend, prompt_cache) -> None:
    if prompt_cache is not None and not isinstance(prompt_cache, parts.prompt_cache):
        cache_class = parts.prompt_cache
        raise TypeError(
            f"a {type(prompt_cache).__name__} cannot hold a {parts.name} model's cache; use "
            f"{cache_class.__module__}.{cache_class.__name__}"
        )


@dataclass
class Session:
    """What one generation runs on: its drafter, the drafts per step asked for and the most a
    step verifies, the target, and the kept cache the target continues (None: a fresh one)."""

    drafter: Drafter
    num_draft: int
    max_draft: int
    target: object
    kept: object | None


def open_session(make_target, *, model, tokenizer, drafter, request: Request, prompt_tokens,
                 prompt_cache) -> Session:
    """The drafter resolved and its drafts per step limited; the target, built by
    `make_target` on the prompt cache (for a drafter that reads target features, on the part
    whose features it kept, else on a fresh one)."""
    from .drafters import resolve_drafter

    drafter = resolve_drafter(drafter, model=model, tokenizer=tokenizer)
    num_draft = requested_drafts(drafter, request.num_draft, request.adaptive)
    # What a step can verify: --num-draft 1000 with a 16-token DFlash block drafts up to 15.
    max_draft = draft_limit(drafter, num_draft)
    layers = drafter.capture_layers
    kept, options = prompt_cache, {}
    if layers and not getattr(make_target, "keeps_prompt_features", False):
        kept = None  # a target that cannot start from kept features (torch, a split target)
    cache = None if kept is None else kept.take(model, prompt_tokens, layers)
    if layers and kept is not None and kept.has_features(layers) and kept.tokens:
        options["held_features"] = kept.features  # of the prefix the cache holds
    if request.kv_bits is not None:
        options.update(kv_bits=request.kv_bits, kv_group_size=request.kv_group_size)
    target = make_target(model, capture_layers=drafter.capture_layers, speculative=max_draft > 0,
                         cache=cache, **options)
    return Session(drafter, num_draft, max_draft, target, kept)


class Responses:
    """Each GenerationResponse of one generation: the text the detokenizer let go of, the speed
    so far (from the first token on; prefill is timed to it, as mlx-lm does) and the loop's
    statistics."""

    def __init__(self, detokenizer, prompt_tokens: int, stats: SpecStats, session: Session,
                 peak_memory_gb: Callable[[], float]):
        detokenizer.reset()
        self.detokenizer, self.prompt_tokens, self.stats = detokenizer, prompt_tokens, stats
        self.drafter, self.num_draft = session.drafter.name, session.max_draft
        self.peak_memory_gb = peak_memory_gb
        self.start = self.gen_start = time.perf_counter()
        self.prompt_tps = 0.0

    def first_token(self) -> None:
        """Time to the first token is prefill plus one verify pass, as in mlx-lm."""
        self.gen_start = time.perf_counter()
        self.prompt_tps = self.prompt_tokens / (self.gen_start - self.start)

    def __call__(self, token, from_draft, scores, n, finish_reason=None) -> GenerationResponse:
        logprob, top = scores if scores else (None, [])
        elapsed = time.perf_counter() - self.gen_start
        stats = self.stats
        return GenerationResponse(
            text=self.detokenizer.last_segment,
            token=token,
            from_draft=from_draft,
            prompt_tokens=self.prompt_tokens,
            prompt_tps=self.prompt_tps,
            generation_tokens=n,
            generation_tps=n / elapsed if elapsed > 0 else 0.0,
            peak_memory=self.peak_memory_gb(),
            finish_reason=finish_reason,
            target_passes=stats.target_passes,
            drafted=stats.drafted,
            accepted=stats.accepted,
            tau=stats.tau,
            acceptance_rate=stats.acceptance_rate,
            acceptance_per_position=stats.acceptance_per_position,
            drafted_per_position=list(stats.drafted_per_position),
            accepted_per_position=list(stats.accepted_per_position),
            drafter=self.drafter,
            num_draft=self.num_draft,
            forced=stats.forced,
            forced_accepted=stats.forced_accepted,
            launch_seconds=stats.launch_seconds,
            wait_seconds=stats.wait_seconds,
            logprob=logprob,
            top_logprobs=top,
        )


def generate(model, tokenizer, prompt, max_tokens: int = 256, *, verbose: bool = False, **kwargs):
    """Return the whole generated text (see `stream_generate` for the options)."""
    text, last = "", None
    for last in stream_generate(model, tokenizer, prompt, max_tokens, **kwargs):
        text += last.text
        if verbose:
            print(last.text, end="", flush=True)
    if verbose:
        print()
        if last is not None:
            print(format_stats(last))
    return text


def format_stats(r: GenerationResponse) -> str:
    lines = [
        f"Prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.1f} tokens-per-sec",
        f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.2f} tokens-per-sec",
        f"Peak memory: {r.peak_memory:.3f} GB",
    ]
    if r.forced:
        lines.append(f"Forced by the grammar: {r.forced} drafts, {r.forced_accepted} accepted")
    if r.drafter != "none":
        per_position = " ".join(f"{a:.2f}" for a in r.acceptance_per_position)
        lines += [
            f"Drafter: {r.drafter} (up to {r.num_draft} drafts per step)",
            f"Target passes: {r.target_passes}, drafted: {r.drafted}, accepted: {r.accepted} "
            f"({100 * r.acceptance_rate:.1f}%), tau: {r.tau:.2f} tokens per pass",
            f"Acceptance per position: {per_position}",
        ]
    return "\n".join(lines)
