"""Many prompts at once, shaped like mlx-lm's batch_generate: every prompt is a row of the one
loop (mlxspec.engine.Loop), verified together in one pass per step by a batched target, each
with its own drafter state, K, sampling settings and stop."""

import time
from dataclasses import dataclass, field
from typing import Sequence

from .backends import backend_for
from .backends.mlx.target import stage_of
from .engine import Drafter, Loop, Row, SpecStats, Start, draft_limit, requested_drafts
from .generate import (_as_wrapper, check_prompt_cache, check_request, encode_prompt,
                       request_matcher)
from .generation_lock import clear_streams_at_thread_exit, generation_lock
from .request import Request, check_count
from .sampling import SamplingConfig


@dataclass
class BatchResponse:
    """What `batch_generate` returns, per prompt in the order given: the text, the token ids
    (without the stop token, as the text), why it ended ("stop" or "length"), and the loop's
    statistics; and for the whole batch its token counts, speed and peak memory."""

    texts: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str]
    stats: list[SpecStats]
    cached_tokens: list[int] = field(default_factory=list)  # per prompt: from its prompt cache
    prompt_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tokens: int = 0
    generation_tps: float = 0.0
    peak_memory: float = 0.0
    drafter: str = "none"


def batch_generate(model, tokenizer, prompts: Sequence, max_tokens: "int | Sequence[int]" = 256,
                   *, drafter=None, num_draft: int | None = None, adaptive: bool = True,
                   temp: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                   seed: int | None = None, overlap: bool = True,
                   prompt_caches: "Sequence | None" = None, kv_bits: int | None = None,
                   kv_group_size: int = 64, constraint=None,
                   verbose: bool = False) -> BatchResponse:
    """Generate a continuation of every prompt (strings or token ids, used as given) together.

    Each prompt is a row: the rows' [pending, drafts] go through the target in one batched pass
    per step, and each row keeps what its own acceptance rule says, so every output is the same
    as that prompt's alone (greedy: token for token; sampled: in distribution). `max_tokens` is
    one number or one per prompt; `drafter` (a Drafter or a name, as stream_generate's) is
    forked per row, each fork with its own state and adaptive K. `seed` seeds the one random
    stream the rows draw from (a row's draws depend on the others', unlike a lone generation's).
    `prompt_caches`: one `PromptCache` (or None) per prompt, as stream_generate's: a row starts
    from the longest prefix of its prompt its cache holds and prefills only the rest, and the
    cache holds the row's prompt and reply afterwards (a conversation's next turn reuses it);
    with a drafter that reads target features (DFlash, EAGLE-3), its prompt and their features.
    `kv_bits`, `kv_group_size`: every row's keys and values are kept quantized, as
    stream_generate's (each row's output is then that prompt's alone with the same kv_bits).
    `constraint`: one Constraint (or None) for every prompt, or a sequence of one per prompt
    (None for a free row): each constrained row has its own grammar state.
    """
    parts = backend_for(model)
    refusal = model_refusal(model)
    if refusal is not None:
        raise ValueError(refusal)
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts")
    budgets = _budgets(max_tokens, len(prompts))
    sampling = SamplingConfig(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    requests = [Request(n, sampling, num_draft=num_draft, adaptive=adaptive, overlap=overlap,
                        kv_bits=kv_bits, kv_group_size=kv_group_size, constraint=c)
                for n, c in zip(budgets, _constraints(constraint, len(prompts)))]
    caches = _prompt_caches(parts, prompt_caches, len(prompts))
    tokenizer = _as_wrapper(tokenizer)
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    for tokens, request in zip(encoded, requests):
        check_request(parts, model, tokens, request.max_tokens)
    matchers = [request_matcher(r, tokenizer, parts.vocab_size(model)) for r in requests]

    from .drafters import resolve_drafter

    prototype = resolve_drafter(drafter, model=model, tokenizer=tokenizer)
    prototype.check_batchable()  # before the batch target is even built
    if any(m is not None for m in matchers):
        prototype.check_constrainable()
    target = parts.batch_target(model, capture_layers=prototype.capture_layers,
                                kv_bits=kv_bits, kv_group_size=kv_group_size)
    if seed is not None:
        parts.seed(seed)
    eos = frozenset(tokenizer.eos_token_ids)
    loop = Loop(target, overlap=overlap)
    rows = [request_row(prototype, tokens, request, eos, matcher)
            for tokens, request, matcher in zip(encoded, requests, matchers)]
    cached = [0] * len(rows)
    for i, (row, cache) in enumerate(zip(rows, caches)):
        if cache is not None:
            cached[i] = start_from(row, cache, model)
    for row in rows:
        loop.join(row)

    outputs = {id(row): [] for row in rows}
    clear_streams_at_thread_exit()
    with generation_lock(model):  # safe from several threads: they take turns
        start, first = time.perf_counter(), None
        for row, token, *_ in loop:
            if first is None:
                first = time.perf_counter()  # prefill is timed to the first token, as mlx-lm
            outputs[id(row)].append(token)
        end = time.perf_counter()
    first = first or end
    return _response(tokenizer, parts, model, prototype, rows, outputs, eos, cached,
                     prompt_tokens=sum(len(t) for t in encoded), prefill_seconds=first - start,
                     decode_seconds=end - first, verbose=verbose)


def model_refusal(model) -> str | None:
    """Why `model` cannot verify rows of a batch (None: it can), before anything is built; a
    model whose caches cannot be cut back per row is refused by its batch target."""
    parts = backend_for(model)
    if parts.batch_target is None:
        return f"the {parts.name} backend runs one sequence at a time; batches run on MLX"
    if stage_of(model) is not None:
        return "a target split across processes runs one sequence at a time"
    return None


def request_row(drafter: Drafter, prompt: list[int], request: Request,
                stop_tokens: frozenset, matcher=None) -> Row:
    """A request as a row of the loop: a fork of `drafter` (its own state and adaptive K),
    drafting at most what the request asks and the drafter can propose; `matcher`: its
    constraint's grammar state (generate.request_matcher), which a constrained request needs."""
    drafter.check_batchable()
    if (request.constraint is None) != (matcher is None):
        raise ValueError("a constrained request's row needs its matcher, and only it")
    fork = drafter.fork()
    max_k = draft_limit(fork, requested_drafts(fork, request.num_draft, request.adaptive))
    greedy = request.sampling.greedy
    policy = fork.draft_policy(max_k, greedy) if request.adaptive and max_k else None
    return Row(fork, list(prompt), request.sampling, request.max_tokens, max_k, policy,
               stop_tokens, request.logprobs, matcher=matcher)


def start_from(row: Row, cache, model) -> int:
    """`row` starts from the longest prefix of its prompt `cache` (a KeptCache) holds, and
    hands its caches back to it when it leaves; returns how many prompt tokens it skips."""
    cache.check_model(model)
    prompt_length = len(row.tokens)
    layers = row.drafter.capture_layers
    row.start = kept_start(cache, cache.shared(row.tokens, layers), layers)
    row.on_leave = lambda left: keep_row(cache, row, *left, prompt_length=prompt_length)
    return row.start.length if row.start else 0


def kept_start(cache, n: int, layers) -> Start | None:
    """A row's Start from the first n tokens `cache` (a KeptCache) holds (n from its
    `shared`), None for none; `layers`: those whose target features the row's drafter reads,
    which `shared` found the cache holds too."""
    if not n:
        return None
    return Start(cache.prefix(n), n, cache.features[:n] if layers else None)


def keep_row(cache, row: Row, caches: list, held: int | None, prompt_state=None, *,
             prompt_length: int) -> None:
    """A leaving row's caches (copied out of the batch) into `cache`, cut back to the tokens
    it committed; for a drafter that reads target features, to its prompt (but the pending
    last token), whose features the row kept (those of its reply went to its drafter), a
    hybrid's recurrent layers rewound to `prompt_state`."""
    cache.cache = caches
    if row.drafter.capture_layers:
        cache.remember_prompt(row.tokens[:prompt_length], row.prompt_features,
                              row.drafter.capture_layers, prompt_state)
    else:
        cache.features = None
        cache.remember(row.tokens)


def _prompt_caches(parts, caches, n: int) -> list:
    if caches is None:
        return [None] * n
    caches = list(caches)
    if len(caches) != n:
        raise ValueError(f"prompt_caches has {len(caches)} caches for {n} prompts")
    for cache in caches:
        check_prompt_cache(parts, cache)
    return caches


def _constraints(constraint, n: int) -> list:
    """A constraint per prompt: one (or None) for all, or a sequence of one per prompt."""
    if constraint is None or not isinstance(constraint, Sequence):
        return [constraint] * n
    constraints = list(constraint)
    if len(constraints) != n:
        raise ValueError(f"constraint has {len(constraints)} values for {n} prompts")
    return constraints


def _budgets(max_tokens, n: int) -> list[int]:
    """max_tokens per prompt: one number for all, or a sequence of one per prompt."""
    if isinstance(max_tokens, Sequence):
        budgets = list(max_tokens)
        if len(budgets) != n:
            raise ValueError(f"max_tokens has {len(budgets)} values for {n} prompts")
    else:
        budgets = [max_tokens] * n
    for value in budgets:
        check_count("max_tokens", value)
    return budgets


def _response(tokenizer, parts, model, prototype, rows, outputs, eos, cached, *,
              prompt_tokens: int, prefill_seconds: float, decode_seconds: float,
              verbose: bool) -> BatchResponse:
    texts, ids, reasons = [], [], []
    for i, row in enumerate(rows):
        tokens = outputs[id(row)]
        stopped = bool(tokens) and tokens[-1] in eos
        tokens = tokens[:-1] if stopped else tokens
        ids.append(tokens)
        texts.append(tokenizer.decode(tokens))
        reasons.append("stop" if stopped else "length")
        if verbose:
            print(f"[{i}] {texts[-1]}")
    generated = sum(len(t) for t in ids)
    return BatchResponse(
        texts=texts, token_ids=ids, finish_reasons=reasons, stats=[row.stats for row in rows],
        cached_tokens=cached, prompt_tokens=prompt_tokens,
        prompt_tps=prompt_tokens / prefill_seconds if prefill_seconds > 0 else 0.0,
        generation_tokens=generated,
        generation_tps=generated / decode_seconds if decode_seconds > 0 else 0.0,
        peak_memory=parts.peak_memory_gb(model), drafter=prototype.name)


def format_batch_stats(r: BatchResponse) -> str:
    """The batch's speed and, with a drafter, each row's acceptance, for --verbose."""
    lines = [
        f"Prompts: {len(r.texts)}, {r.prompt_tokens} tokens, {r.prompt_tps:.1f} tokens-per-sec",
        f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.2f} tokens-per-sec "
        "(all rows)",
        f"Peak memory: {r.peak_memory:.3f} GB",
    ]
    if r.drafter != "none":
        lines.append(f"Drafter: {r.drafter}")
        lines += [f"[{i}] target passes: {s.target_passes}, drafted: {s.drafted}, accepted: "
                  f"{s.accepted} ({100 * s.acceptance_rate:.1f}%), tau: {s.tau:.2f}"
                  for i, s in enumerate(r.stats)]
    return "\n".join(lines)
