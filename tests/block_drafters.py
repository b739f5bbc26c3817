"""Checks every block drafter (DFlash2, DSpark) shares: its checkpoint loads exactly what it
stores, its sampled output follows the target's distribution, and the CLI, the API, a batch and
the server give plain decoding's text with it."""

from collections import Counter

import mlx.core as mx
from mlx.utils import tree_flatten
from test_sampling_exactness import LENGTH, PROMPT, SAMPLES, SAMPLING, chi_squared_pvalue
from test_sampling_exactness import exact_distribution

import mlxspec
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.drafters import load_drafter
from mlxspec.engine import SpecStats, speculative_tokens


def started(drafter, target, prompt):
    """`drafter` begun on `prompt` with the target's features; the features."""
    features = MLXTarget(target, capture_layers=drafter.capture_layers).prefill(prompt)
    drafter.begin(prompt, features)
    return features


def assert_context_is_a_fresh_build(drafter, target, committed: list[int]) -> None:
    """After a generation (its rollbacks included), the drafter's context K/V are what the
    committed tokens' features give built from scratch."""
    drafter._rewind(len(committed) - 1)
    features = MLXTarget(target, capture_layers=drafter.capture_layers).prefill(committed)
    fresh = drafter.model.make_cache()
    drafter.model.append_context(features, fresh)
    for ours, theirs in zip(drafter.cache, fresh):
        for a, b in zip(ours.keys_and_values(), theirs.keys_and_values()):
            assert a.shape == b.shape and mx.allclose(a, b, atol=1e-4).item()


def forks_begun(drafter, target, prompts) -> tuple[list, list]:
    """Two forks per prompt, each begun on it: one to draft in a batch, one alone."""
    forks, alone = [drafter.fork() for _ in prompts], [drafter.fork() for _ in prompts]
    for prompt, f, a in zip(prompts, forks, alone):
        features = MLXTarget(target, capture_layers=drafter.capture_layers).prefill(prompt)
        f.begin(prompt, features)
        a.begin(prompt, features)
    return forks, alone


def assert_loads_exactly_its_weights(drafter, path) -> dict:
    """Every stored tensor is a parameter, unchanged, and every parameter is stored."""
    stored = mx.load(str(path / "model.safetensors"))
    loaded = dict(tree_flatten(drafter.model.parameters()))
    assert sorted(stored) == sorted(loaded)
    for name, value in stored.items():
        assert mx.array_equal(loaded[name], value).item(), name
    return stored


def sampled_counts(model, drafter, target_class=MLXTarget,
                   seed=mx.random.seed) -> tuple[Counter, SpecStats]:
    """The sampled outputs of SAMPLES generations (on torch: a transformers model, TorchTarget
    and torch.manual_seed)."""
    seed(1234)
    counts, stats = Counter(), SpecStats()
    for _ in range(SAMPLES):
        target = target_class(model, capture_layers=drafter.capture_layers, speculative=True)
        out = speculative_tokens(target, drafter, PROMPT, sampling=SAMPLING, max_tokens=LENGTH,
                                 num_draft=2, stats=stats)
        counts[tuple(t for t, _ in out)] += 1
    return counts, stats


def sampled_pvalue(model, drafter, *, both_ways: bool = True) -> float:
    """χ² p-value of the drafter's sampled output against the target's exact distribution;
    `both_ways`: also check that drafts were both accepted and rejected."""
    counts, stats = sampled_counts(model, drafter)
    if both_ways:
        assert 0 < stats.accepted < stats.drafted
    return chi_squared_pvalue(counts, exact_distribution(model, SAMPLING))


def assert_cli_api_batch_and_server_are_plain(kind: str, smollm_dir, smollm, drafter_dir):
    """Greedy text with `--drafter kind` equals plain decoding's: `mlxspec generate`, the API
    alone and in a batch, and `mlxspec serve`'s completions with a batch of 2."""
    import openai
    from test_cli import QUESTION, gen, ok
    from test_server import Running

    from mlxspec.server import make_server

    flags = ("--model", str(smollm_dir), "--temp", "0", "--max-tokens", "12")
    plain = ok(gen(*flags))
    spec = ok(gen(*flags, "--drafter", kind, "--drafter-model", str(drafter_dir)))
    assert spec.stdout == plain.stdout and plain.stdout.strip()
    model, tokenizer = smollm
    drafter = load_drafter(kind, str(drafter_dir), model=model, tokenizer=tokenizer)
    prompts = ["def f(x):", QUESTION]
    alone = [mlxspec.generate(model, tokenizer, p, max_tokens=12) for p in prompts]
    assert [mlxspec.generate(model, tokenizer, p, max_tokens=12, drafter=drafter)
            for p in prompts] == alone
    assert mlxspec.batch_generate(model, tokenizer, prompts, 12, drafter=drafter).texts == alone
    server = make_server(model, tokenizer, drafter=kind, draft_model=str(drafter_dir),
                         max_batch=2)
    running = Running(server)
    try:
        api = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        reply = api.completions.create(model="model", prompt=prompts[0], max_tokens=12,
                                       temperature=0, extra_body={"drafter": kind})
        assert reply.choices[0].text == alone[0]
        assert reply.usage.model_extra["mlxspec"]["drafter"] == kind
    finally:
        running.stop()
