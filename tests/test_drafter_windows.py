"""`--drafter-window N` for the drafters that keep a context of their own besides DFlash and
EAGLE-3 (tested in their own files): a draft model and MTP modules. The window is
mlxspec.backends.mlx.window: each entry attends to its own and the N - 1 entries before it, and
on MLX only those keys are read. Checked against mlx-lm's RotatingKVCache (which keeps exactly
the last N positions), losslessly (greedy identity at the narrowest window), and as no window at
all where the window is wider than any context."""

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mtp_models import write_deepseek_v3, write_qwen3_5
from tiny_models import tiny_llama, tiny_qwen3_next

from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.backends.mlx.window import windowed
from mlxspec.cli.main import main
from mlxspec.converters.hf import load_checkpoint
from mlxspec.drafters import DraftModelDrafter
from mlxspec.drafters.mtp import load_mtp_drafter
from mlxspec.engine import PlainDecoding, SpecStats, speculative_tokens
from mlxspec.sampling import SamplingConfig

GREEDY = SamplingConfig(temp=0.0)
PROMPTS = [[1, 5, 3, 7, 2, 9, 4, 12, 5, 3, 1, 5, 3, 7], [3, 3, 3], [2, 8, 1, 6, 2, 8, 1, 6, 2]]


def run(model, drafter, prompt, n=30, k=4, sampling=GREEDY):
    stats = SpecStats()
    target = MLXTarget(model, capture_layers=drafter.capture_layers, speculative=True)
    out = speculative_tokens(target, drafter, prompt, sampling=sampling, max_tokens=n,
                             num_draft=k, stats=stats, adaptive=False)
    return [t for t, _ in out], stats


@pytest.mark.parametrize("window", [2, 4])
def test_a_window_view_attends_as_a_rotating_cache(window):
    """Feeds of several tokens and of one, through the view over a growing KVCache, give the
    logits mlx-lm gives over a RotatingKVCache of `window` positions; without the view they
    differ."""
    model = tiny_llama(vocab=32, layers=2, seed=4)
    ours = [KVCache() for _ in model.layers]
    rotating = [RotatingKVCache(max_size=window) for _ in model.layers]
    free = [KVCache() for _ in model.layers]
    for feed in ([1, 5, 3, 7, 2, 9], [4], [12], [5, 3, 1], [7], [8, 8]):
        ids = mx.array([feed])
        got = model(ids, cache=windowed(ours, window))
        want = model(ids, cache=rotating)
        assert mx.allclose(got, want, atol=1e-5).item(), feed
        all_of_it = model(ids, cache=free)
    assert all(c.offset == 14 for c in ours)  # every entry stays: a rollback can cut any
    assert not mx.allclose(all_of_it, want, atol=1e-3).item()


def test_a_window_leaves_a_hybrid_s_recurrent_layers_alone():
    model = tiny_qwen3_next(vocab=32, seed=1)
    caches = model.make_cache()
    views = windowed(caches, 3)
    kinds = [(type(c).__name__, type(v).__name__) for c, v in zip(caches, views)]
    assert ("KVCache", "WindowView") in kinds and ("ArraysCache", "ArraysCache") in kinds


# ---- A draft model --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=16, layers=2, seed=1, sharpness=3.0)


@pytest.fixture(scope="module")
def draft():
    return tiny_llama(vocab=16, layers=2, seed=2, sharpness=3.0)


def test_a_draft_model_s_window_changes_no_output(target, draft):
    """Window 2 (each position sees itself and the one before) still gives plain decoding's
    output through its rollbacks; window 1000 drafts exactly as no window."""
    for prompt in PROMPTS:
        plain, _ = run(target, PlainDecoding(), prompt)
        narrow, narrow_stats = run(target, DraftModelDrafter(draft, window=2), prompt)
        wide, wide_stats = run(target, DraftModelDrafter(draft, window=1000), prompt)
        _, free_stats = run(target, DraftModelDrafter(draft), prompt)
        assert narrow == plain and wide == plain and narrow_stats.drafted > 0
        assert (wide_stats.drafted_per_position, wide_stats.accepted_per_position) == (
            free_stats.drafted_per_position, free_stats.accepted_per_position)
    with pytest.raises(ValueError, match="drafter window must be an integer >= 2, got 1"):
        DraftModelDrafter(draft, window=1)


def test_a_draft_model_s_window_is_what_its_steps_see(draft):
    """A proposal after a long prompt: its first draft's logits are those of the draft model
    over a RotatingKVCache of the window's size."""
    prompt = PROMPTS[0]
    drafter = DraftModelDrafter(draft, window=3)
    drafter.begin(prompt)
    first = drafter._step(mx.array([prompt]))
    rotating = [RotatingKVCache(max_size=3) for _ in draft.layers]
    assert mx.allclose(first, draft(mx.array([prompt]), cache=rotating)[0, -1], atol=1e-5).item()
    assert not mx.allclose(first, draft(mx.array([prompt]))[0, -1], atol=1e-3).item()


# ---- MTP modules ------------------------------------------------------------------------------

WRITERS = {"qwen3_5": write_qwen3_5, "deepseek_v3": write_deepseek_v3}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def mtp_target(request, tmp_path_factory):
    path = WRITERS[request.param](tmp_path_factory.mktemp(request.param), vocab=16, seed=0,
                                  sharpness=3.0)
    return path, load_checkpoint(path, lazy=False, action="load")[0]


@pytest.mark.parametrize("options", [{}, {"tree_budget": 8, "tree_width": 3}],
                         ids=["chain", "tree"])
def test_mtp_s_window_changes_no_output(mtp_target, options):
    path, model = mtp_target
    k = options.get("tree_budget", 3)
    for prompt in PROMPTS:
        plain, _ = run(model, PlainDecoding(), prompt)
        narrow = load_mtp_drafter(path, model=model, window=2, **options)
        assert run(model, narrow, prompt, k=k)[0] == plain
        wide, wide_stats = run(model, load_mtp_drafter(path, model=model, window=1000,
                                                       **options), prompt, k=k)
        _, free_stats = run(model, load_mtp_drafter(path, model=model, **options), prompt, k=k)
        assert wide == plain
        assert (wide_stats.drafted_per_position, wide_stats.accepted_per_position) == (
            free_stats.drafted_per_position, free_stats.accepted_per_position)


def test_mtp_s_window_is_what_its_chain_sees(mtp_target):
    """Chain logits through the window equal those of modules whose caches keep only the last
    `window` entries (mlx-lm's RotatingKVCache), and differ from the modules seeing all."""
    path, model = mtp_target
    tokens, window = PROMPTS[0], 3
    features = MLXTarget(model, capture_layers=(len(model.layers) - 1,)).prefill(tokens)
    narrow = load_mtp_drafter(path, model=model, window=window)
    rotating = load_mtp_drafter(path, model=model)
    rotating.model.make_cache = lambda: [[RotatingKVCache(max_size=window) for _ in m.layers]
                                         for m in rotating.model.mtp]
    free = load_mtp_drafter(path, model=model)
    logits = []
    for drafter in (narrow, rotating, free):
        drafter.begin(tokens, features)
        logits.append(drafter.chain_logits(tokens, 3, [4, 9]))
    for a, b in zip(logits[0], logits[1]):
        assert mx.allclose(a, b, atol=1e-4).item()
    assert not all(mx.allclose(a, c, atol=1e-3).item() for a, c in zip(logits[0], logits[2]))


def test_cli_drafter_window_for_a_draft_model(smollm_dir, smollm_first_layers):
    """From the CLI, the same text as plain decoding; a copier has no window to bound."""
    common = ["generate", "--model", str(smollm_dir), "-p", "Count: one two three", "-n", "12"]
    plain = CliRunner().invoke(main, common + ["--drafter", "none"])
    windowed_run = CliRunner().invoke(main, common + [
        "--drafter", "draft", "--draft-model", str(smollm_first_layers), "--drafter-window", "8"])
    assert windowed_run.exit_code == 0, windowed_run.output
    assert windowed_run.stdout == plain.stdout
    refused = CliRunner().invoke(main, common + ["--drafter", "suffix", "--drafter-window", "8"])
    assert refused.exit_code != 0 and "window" in refused.output, refused.output
    assert "Traceback" not in refused.output
