"""Sliding-window targets past their window (issue #64): WindowKVCache and RaggedKVCache's
window compute what mlx-lm's RotatingKVCache does, roll back exactly at any context length,
alone, in a batch and in trees, and speculation keeps drafting there, losslessly.

Tiny Gemma 3 and gpt-oss models with windows of 2-4 positions: every prompt here is past them.
`spare` (the positions let pile up before old ones are forgotten) is forced small where the
forgetting itself is under test.
"""

import itertools
import json
import random
import re
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from test_api_hardening import tiny_tokenizer
from test_batch_target import drafts_for, greedy_continuation, relative_diff
from test_sampling_exactness import chi_squared_pvalue
from tiny_models import tiny_gemma3, tiny_gpt_oss, tiny_llama

import mlxspec
import mlxspec.backends.mlx.ragged_cache as ragged_module
import mlxspec.backends.mlx.window_cache as window_module
from mlxspec.backends.mlx.batch_target import MLXBatchTarget
from mlxspec.backends.mlx.sampling import processed_logprobs
from mlxspec.backends.mlx.target import MLXTarget, PromptCache
from mlxspec.backends.mlx.window_cache import WindowKVCache, make_cache
from mlxspec.drafters import DraftModelDrafter, PromptLookupDrafter
from mlxspec.engine import Draft, Drafter, Loop, Row, Start
from mlxspec.sampling import SamplingConfig
from mlxspec.tree import TreeShape

VOCAB = 64
GREEDY = SamplingConfig()
TOLERANCE = 2e-5  # relative to the logits' scale: sums in another order (OpenBLAS, masks)
MODELS = {
    "gemma3": lambda **kw: tiny_gemma3(vocab=VOCAB, window=4, **kw),
    "gpt_oss": lambda **kw: tiny_gpt_oss(vocab=VOCAB, window=4, sharpness=4.0, **kw),
}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer(VOCAB)


@pytest.fixture
def small_spare(monkeypatch):
    """Old positions forgotten after 1 spare, so short runs forget many times."""
    monkeypatch.setattr(window_module, "default_spare", lambda window: 1)
    monkeypatch.setattr(ragged_module, "default_spare", lambda window: 1)


def mlx_lm_tokens(model, prompt, n):
    """mlx-lm's own greedy decoding (its RotatingKVCache), the reference."""
    steps = generate_step(mx.array(prompt), model, max_tokens=n)
    return [int(t) for t, _ in steps]


def repeating(n, period=7, seed=0):
    """A prompt of n tokens repeating a random period, so lookup finds drafts."""
    rnd = random.Random(seed)
    base = [rnd.randrange(1, VOCAB - 1) for _ in range(period)]
    return (base * (n // period + 1))[:n]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("spare", [1, None])
def test_window_cache_computes_mlx_lm_s_rotating_cache_under_rollbacks(name, spare,
                                                                        monkeypatch):
    """Passes of 1-6 positions, each keeping a random part: the logits of every kept position
    equal mlx-lm's (prefill, then one token at a time over its RotatingKVCache)."""
    if spare is not None:
        monkeypatch.setattr(window_module, "default_spare", lambda window: spare)
    model = MODELS[name]()
    rnd = random.Random(0)
    tokens = [rnd.randrange(VOCAB) for _ in range(120)]
    ref_cache = make_prompt_cache(model)
    want = [model(mx.array([tokens[:9]]), cache=ref_cache)[0]]
    want += [model(mx.array([[t]]), cache=ref_cache)[0] for t in tokens[9:]]
    cache = make_cache(model)
    assert any(isinstance(c, WindowKVCache) for c in cache)
    got, at = [model(mx.array([tokens[:9]]), cache=cache)[0]], 9
    while at < len(tokens):
        width = min(rnd.randint(1, 6), len(tokens) - at)
        logits = model(mx.array([tokens[at : at + width]]), cache=cache)[0]
        keep = rnd.randint(1, width)
        for c in cache:
            c.trim(width - keep)
        got.append(logits[:keep])
        at += keep
    assert relative_diff(mx.concatenate(want), mx.concatenate(got)) <= TOLERANCE
    windows = [c for c in cache if isinstance(c, WindowKVCache)]
    assert all(c.start > 0 and c.held <= c.window - 1 + c.spare + 6 for c in windows)


def held_tail(cache, n):
    """The keys and values of the last n positions a layer's cache holds."""
    held = cache.held if isinstance(cache, WindowKVCache) else cache.offset
    return [a[..., held - n : held, :] for a in (cache.keys, cache.values)]


@pytest.mark.parametrize("name", list(MODELS))
def test_target_cache_after_rollbacks_equals_a_fresh_prefill(name, small_spare):
    """MLXTarget past the window with drafts accepted anywhere from none to all: its caches
    then hold the same keys and values, at the same positions, as a fresh prefill of the
    committed tokens."""
    model = MODELS[name]()
    rnd = random.Random(1)
    tokens = [rnd.randrange(VOCAB) for _ in range(10)]
    target = MLXTarget(model, speculative=True)
    target.prefill(tokens)
    for _ in range(25):
        assert target.rollback_room() is None
        draft = Draft(tokens=drafts_for(model, tokens, rnd.choice([1, 3, 5]), rnd))
        verdict = target.launch(tokens[-1], draft, GREEDY).verdict()
        target.settle(verdict)
        tokens += verdict.committed
    fresh = MLXTarget(model)
    fresh.prefill(tokens)
    assert target.offset == fresh.offset == len(tokens) - 1
    for got, want in zip(target.cache, fresh.cache):
        n = got.window - 1 if isinstance(got, WindowKVCache) else got.offset
        for g, w in zip(held_tail(got, n), held_tail(want, n)):
            assert relative_diff(w, g) <= TOLERANCE


class WrongEverywhere(Drafter):
    """The target's own continuation with one draft made wrong at a position that moves every
    step, so every position of a draft gets rejected at some step."""

    name = "wrong-everywhere"
    default_num_draft = max_draft = 4

    def __init__(self, model):
        self.model, self.step = model, 0

    def propose(self, tokens, k, sampling):
        drafts = greedy_continuation(self.model, tokens, k)
        if drafts:
            at = self.step % len(drafts)
            drafts[at] = (drafts[at] + 1) % VOCAB
        self.step += 1
        return Draft(tokens=drafts)


def drafters(model):
    draft = tiny_gemma3(vocab=VOCAB, window=3, seed=5)  # a draft model with a window too
    return {
        "lookup": PromptLookupDrafter(),
        "lookup-tree": PromptLookupDrafter(branches=3),
        "draft-model": DraftModelDrafter(draft),
        "wrong-everywhere": WrongEverywhere(model),
    }


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_speculation_past_the_window_is_lossless_and_keeps_drafting(name, tokenizer,
                                                                          small_spare):
    """A prompt 10 windows long: every drafter's output equals mlx-lm's greedy decoding, and
    every step may draft (none falls back to plain for lack of rollback room); lookup on a
    repeating prompt gets drafts accepted."""
    model = MODELS[name]()
    prompt = repeating(40)
    want = mlx_lm_tokens(model, prompt, 30)
    for kind, drafter in drafters(model).items():
        out = list(mlxspec.stream_generate(model, tokenizer, prompt, 30, drafter=drafter,
                                           num_draft=4, adaptive=False))
        assert [r.token for r in out] == want, kind
        assert out[-1].drafted > 0, kind
        if kind.startswith("lookup"):
            assert out[-1].accepted > 0, kind


def test_a_tree_pass_over_a_window_gives_each_branch_s_chain_logits(small_spare):
    """Per node, a tree pass's logits over a WindowKVCache past its window equal those of its
    branch run as a chain, and the kept branch leaves the cache a fresh prefill gives."""
    model = MODELS["gemma3"]()
    prompt = [5, 9, 2, 7, 1, 3, 8, 6, 4, 2, 9]
    parents = (0, 1, 0, 3, 3, 4)  # two roots; node 3 has children 4 and 5; node 6 under 4
    nodes = [11, 12, 13, 14, 15, 16]
    target = MLXTarget(model, speculative=True)
    target.prefill(prompt)
    assert target.holds_trees()
    with target._tree_cache(TreeShape(parents)) as cache:
        logits = target._forward(mx.array([prompt[-1]] + nodes), cache)[0]
    for leaf in (2, 5, 6):
        branch, node = [], leaf
        while node:
            branch.insert(0, node)
            node = parents[node - 1]
        chain = MLXTarget(model)
        chain.prefill(prompt)
        want = chain._forward(mx.array([prompt[-1]] + [nodes[n - 1] for n in branch]))[0]
        got = logits[mx.array([0] + branch)]
        assert relative_diff(want, got) <= TOLERANCE, branch


def test_trees_past_the_window_are_lossless(tokenizer, small_spare):
    """Lookup trees (3 branches) on both models, prompts 10 windows long: mlx-lm's tokens, and
    some steps verify more than one branch."""
    for name in MODELS:
        model = MODELS[name]()
        prompt = repeating(40, period=5, seed=3)
        out = list(mlxspec.stream_generate(model, tokenizer, prompt, 30,
                                           drafter=PromptLookupDrafter(branches=3)))
        assert [r.token for r in out] == mlx_lm_tokens(model, prompt, 30), name


@pytest.mark.parametrize("name", list(MODELS))
def test_batch_rows_past_the_window_roll_back_as_the_single_path(name, small_spare):
    """Rows of different lengths (some past the window, one not yet), ragged drafts, rows
    joining and leaving: each row's verify logits and verdicts equal a lone MLXTarget's, and
    its cache copied out holds what a fresh prefill holds."""
    model = MODELS[name]()
    rnd = random.Random(2)
    prompts = [[rnd.randrange(VOCAB) for _ in range(n)] for n in (3, 13, 7, 21)]
    batch = MLXBatchTarget(model)
    singles, tokens, ids = {}, {}, []

    def join(uids):  # in chunks of 5 tokens: rows join the batch as they become ready
        tickets = dict(zip(batch.add([prompts[u] for u in uids]), uids))
        while batch.joining:
            for ticket, _ in batch.fill(5):
                u = tickets[ticket]
                singles[u] = MLXTarget(model, speculative=True)
                singles[u].prefill(prompts[u])
                tokens[u], _ = list(prompts[u]), ids.append(u)

    join([0, 1, 2])
    for step in range(14):
        if step == 4:
            join([3])
        if step == 9:
            batch.remove([ids.index(1)])
            ids.remove(1)
        drafts = [Draft(tokens=drafts_for(model, tokens[u], rnd.choice([0, 1, 3, 5]), rnd))
                  for u in ids]
        verdicts = batch.launch([tokens[u][-1] for u in ids], drafts,
                                [GREEDY] * len(ids)).verdicts()
        for u, d, v in zip(ids, drafts, verdicts):
            ref = singles[u].launch(tokens[u][-1], d, GREEDY).verdict()
            assert (v.accepted, v.next_token) == (ref.accepted, ref.next_token), (step, u)
            singles[u].settle(ref)
            tokens[u] += v.committed
        batch.settle(verdicts)
    for row, u in enumerate(ids):
        caches, held, _ = batch.row_cache(row)
        assert held == len(tokens[u]) - 1
        fresh = MLXTarget(model)
        fresh.prefill(tokens[u])
        for got, want in zip(caches, fresh.cache):
            assert got.offset == want.offset
            n = got.window - 1 if isinstance(got, WindowKVCache) else got.offset
            for g, w in zip(held_tail(got, n), held_tail(want, n)):
                assert relative_diff(w, g) <= TOLERANCE, (u, type(got).__name__)


@pytest.mark.parametrize("name", list(MODELS))
def test_batch_generate_past_the_window_equals_each_prompt_alone(name, tokenizer):
    """batch_generate of 3 prompts (one inside the window, two past it) with lookup and with
    no drafter: each row's tokens are that prompt's alone; lookup drafts in the batch."""
    model = MODELS[name]()
    prompts = [repeating(40, seed=1), [3, 4, 5], repeating(23, period=4, seed=2)]
    for drafter in (None, "lookup"):
        alone = [[r.token for r in mlxspec.stream_generate(model, tokenizer, p, 24,
                                                            drafter=drafter)]
                 for p in prompts]
        batch = mlxspec.batch_generate(model, tokenizer, prompts, 24, drafter=drafter)
        for got, want in zip(batch.token_ids, alone):
            assert got == [t for t in want if t != VOCAB - 1][: len(got)] and got, drafter
        if drafter:
            assert sum(s.accepted for s in batch.stats) > 0


def test_kept_caches_past_the_window_continue_alone_and_in_a_batch(tokenizer, small_spare,
                                                                    tmp_path):
    """A prompt cache that has forgotten positions: a second turn extending the first, alone
    (PromptCache) and as a batch row started from it, equals decoding the whole anew; the
    cache survives a file round trip."""
    model = MODELS["gemma3"]()
    first = repeating(30, seed=4)
    kept = PromptCache()
    reply = [r.token for r in mlxspec.stream_generate(model, tokenizer, first, 12,
                                                      drafter="lookup", prompt_cache=kept)]
    assert any(isinstance(c, WindowKVCache) and c.start > 0 for c in kept.cache)
    second = first + reply + [7, 8, 9, 7, 8]
    want = mlx_lm_tokens(model, second, 16)
    kept.save(tmp_path / "kept.safetensors")
    loaded = PromptCache.load(tmp_path / "kept.safetensors", model)
    for cache in (kept, loaded):
        got = [r.token for r in mlxspec.stream_generate(model, tokenizer, second, 16,
                                                        drafter="lookup", prompt_cache=cache)]
        assert got == want
    # a batch row starting from a kept cache that has forgotten positions
    row_start = PromptCache()
    list(mlxspec.stream_generate(model, tokenizer, first, 12, prompt_cache=row_start))
    caches = row_start.prefix(len(row_start.tokens))
    batch = MLXBatchTarget(model)
    ticket, = batch.add([second], [Start(caches, len(row_start.tokens))])
    while batch.joining:
        batch.fill()
    tokens = list(second)
    for _ in range(16):
        v = batch.launch([tokens[-1]], [Draft(tokens=[])], [GREEDY]).verdicts()[0]
        batch.settle([v])
        tokens += v.committed
    assert tokens[len(second):] == want


@pytest.mark.slow  # χ²: thousands of sampled generations
def test_sampled_speculation_past_a_window_follows_the_target_distribution(small_spare):
    """Window 2, a 6-token prompt, 3 sampled tokens with one-hot drafts the target often
    rejects, as rows of batches (each rolled back by its own amount, past the window): the
    continuations follow the exact distribution (full forward passes with the window mask, no
    cache) by χ². (One sequence's rollback past a window: the greedy and cache tests above.)"""
    import test_sampling_exactness as exactness

    vocab, prompt, length, samples = 5, [0, 1, 2, 3, 4, 0], 3, exactness.SAMPLES
    model = tiny_gemma3(vocab=vocab, window=2, seed=11, sharpness=3.0)
    sampling = SamplingConfig(temp=0.8, top_p=0.95)
    probs = {}
    for seq in itertools.product(range(vocab), repeat=length):
        logq = processed_logprobs(model(mx.array([prompt + list(seq)]))[0], sampling)
        probs[seq] = float(np.exp(sum(logq[len(prompt) - 1 + i, seq[i]].item()
                                      for i in range(length))))
    assert abs(sum(probs.values()) - 1) < 1e-4 and max(probs.values()) < 0.5
    fixed = exactness.FixedDrafter()
    mx.random.seed(1234)
    batched, rows = Counter(), 250
    for _ in range(samples // rows):
        loop = Loop(MLXBatchTarget(model))
        made = [Row(fixed.fork(), list(prompt), sampling, length, 2) for _ in range(rows)]
        for row in made:
            loop.join(row)
        for _ in loop:
            pass
        batched.update(tuple(row.tokens[len(prompt):][:length]) for row in made)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(exactness, "SAMPLES", samples)
        pvalue = chi_squared_pvalue(batched, probs)
        assert pvalue > 0.001, f"p = {pvalue:.2g}"


def test_a_full_attention_model_keeps_mlx_lm_s_caches():
    """No sliding window, nothing replaced: a llama's caches are mlx-lm's own."""
    model = tiny_llama(vocab=VOCAB)
    assert [type(c) for c in make_cache(model)] == [type(c) for c in make_prompt_cache(model)]


@pytest.fixture(scope="module")
def gemma3_dir(smollm_dir, tmp_path_factory):
    """A tiny Gemma 3 (window 4) as a model directory, with SmolLM2's tokenizer."""
    from test_hybrid_draft_model import save_model_dir

    model = tiny_gemma3(vocab=49152, window=4, seed=3, sharpness=4.0)
    return save_model_dir(model, vars(model.args), tmp_path_factory.mktemp("g") / "gemma3",
                          smollm_dir)


def test_cli_drafts_past_the_window_alone_and_in_a_batch(gemma3_dir, tmp_path):
    """`mlxspec generate -m DIR` on a prompt many windows long, drafted for by the same
    checkpoint as a draft model (so drafts are accepted past the window), prints plain
    decoding's text; `--prompts` does the same for every line at once."""
    from click.testing import CliRunner

    from mlxspec.cli.main import main

    def generate(*args):
        result = CliRunner().invoke(main, ["generate", "-m", str(gemma3_dir), "-n", "20",
                                           "--no-chat-template", *args])
        assert result.exit_code == 0, result.output
        return result

    text = "the cat sat on the mat and the cat sat on the hat " * 3
    plain = generate("-p", text)
    drafter = ["--drafter", "draft", "--draft-model", str(gemma3_dir)]
    spec = generate("-p", text, *drafter, "--verbose")
    assert spec.stdout == plain.stdout
    assert int(re.search(r"accepted: (\d+)", spec.stderr)[1]) > 0, spec.stderr
    lines = [text, "one two three", text[::-1]]
    (tmp_path / "prompts.txt").write_text("\n".join(lines) + "\n")
    batch = generate("--prompts", str(tmp_path / "prompts.txt"), *drafter)
    rows = [json.loads(line) for line in batch.stdout.splitlines()]
    alone = [generate("-p", line).stdout.strip() for line in lines]
    assert [row["text"].strip() for row in rows] == alone
