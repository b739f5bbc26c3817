"""EAGLE-3 on the torch backend against the MLX drafter, on one set of weights: the published
layouts' fixtures (tests/fixtures/eagle3) and random checkpoints (test_eagle3.make_drafter_dir),
on tiny llamas loaded in both mlx-lm and transformers (test_torch_backend.torch_twin), float32.

Measured here (2-core CPU, torch 2.13 + transformers 5.24 vs MLX): chain logits differ by at
most 6e-6 (|logits| up to 21), tree candidate scores by 2e-5; asserted 1e-4. Candidate ids and
parents, drafts, greedy tokens and acceptance counts must be identical.
"""

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from test_eagle3 import FIXTURES, make_drafter_dir
from test_eagle3_tree import DRAFT_IDS, llama_dir  # noqa: F401  (llama_dir: a fixture)
from test_torch_backend import torch_twin
from tiny_models import tiny_llama

torch = pytest.importorskip("torch", reason="needs torch (pip install .[reference])")
transformers = pytest.importorskip("transformers", reason="the torch backend needs transformers")

import mlxspec  # noqa: E402
from mlxspec.drafters.eagle3 import load_eagle3_drafter as load_mlx_eagle3  # noqa: E402
from mlxspec.engine import Drafter, SpecStats, Verdict, speculative_tokens  # noqa: E402
from mlxspec.backends.mlx.target import MLXTarget  # noqa: E402
from mlxspec.sampling import SamplingConfig  # noqa: E402
from mlxspec.backends.torch import TorchTarget  # noqa: E402
from mlxspec.backends.torch.eagle3 import TorchEagle3Drafter  # noqa: E402

GREEDY = SamplingConfig()
LAYOUTS = ["speculators", "specforge", "speculators_qwen3"]
TOKENS = [5, 9, 11, 5, 9, 11, 5, 9, 2, 3, 4, 6]
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [5, 9, 11, 5, 9, 11, 5, 9, 2, 3, 4, 6], [3]]
ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread(one_torch_thread):
    """torch on one thread while this module runs (conftest.one_torch_thread)."""


@pytest.fixture(scope="module")
def twins96(tmp_path_factory):
    """A llama the fixtures fit (hidden 32, 96 tokens, 4 layers), in MLX and transformers."""
    model = tiny_llama(vocab=96, hidden=32, layers=4, seed=2, sharpness=3.0)
    return model, torch_twin(model, tmp_path_factory.mktemp("twin96"))


@pytest.fixture(scope="module")
def twins12(tmp_path_factory):
    """test_eagle3's 12-token llama in both, and a random drafter for 8 of its tokens."""
    root = tmp_path_factory.mktemp("twin12")
    model = tiny_llama(vocab=12, hidden=32, layers=4, seed=1, sharpness=3.0)
    path = make_drafter_dir(root / "eagle3", vocab=12, draft_ids=DRAFT_IDS, seed=5)
    return model, torch_twin(model, root / "twin"), path


def pair(path, model, twin, tokens, **options):
    """The MLX and the torch drafter on one checkpoint, each begun on `tokens`."""
    theirs = load_mlx_eagle3(path, model=model, **options)
    ours = mlxspec.load_drafter("eagle3", path, model=twin, tokenizer=None, **options)
    assert isinstance(ours, TorchEagle3Drafter) and ours.capture_layers == theirs.capture_layers
    theirs.begin(tokens, MLXTarget(model, capture_layers=theirs.capture_layers).prefill(tokens))
    ours.begin(tokens, TorchTarget(twin, capture_layers=ours.capture_layers).prefill(tokens))
    return ours, theirs


def as_numpy(arrays) -> np.ndarray:
    return np.stack([a.float().cpu().numpy() if isinstance(a, torch.Tensor) else np.array(a)
                     for a in arrays])


def close(ours, theirs) -> bool:
    """Either backend's lists of arrays, equal within ATOL."""
    return np.abs(as_numpy(ours) - as_numpy(theirs)).max() < ATOL


# ---- Parity with the MLX drafter ---------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_chain_logits_equal_mlx_step_by_step(twins96, layout):
    """Both layouts (and a qwen3 layer's q/k norms): the prefill's outputs, greedy chain steps,
    steps fed given drafts, and again after a commit with the target's features."""
    model, twin = twins96
    tokens = TOKENS[:8]
    ours, theirs = pair(FIXTURES / layout, model, twin, tokens)
    assert close(ours._hidden, theirs._hidden)
    assert close(ours.chain_logits(tokens, 4), theirs.chain_logits(tokens, 4))
    fed = [TOKENS[8], TOKENS[9], 17]
    assert close(ours.chain_logits(tokens, 4, draft_ids=fed),
                 theirs.chain_logits(tokens, 4, draft_ids=fed))
    drafts = ours.propose(tokens, 4, GREEDY).tokens.tolist()
    assert drafts == theirs.propose(tokens, 4, GREEDY).tokens.tolist()
    verdict = {"draft_tokens": TOKENS[8:10], "accepted": 2, "next_token": TOKENS[10]}
    features = (TorchTarget(twin, capture_layers=ours.capture_layers).prefill(TOKENS[:12]),
                MLXTarget(model, capture_layers=theirs.capture_layers).prefill(TOKENS[:12]))
    ours.commit(TOKENS[:11], Verdict(**verdict, features=features[0][7:10]))
    theirs.commit(TOKENS[:11], Verdict(**verdict, features=features[1][7:10]))
    assert ours.context_length == theirs.context_length == 10
    assert close(ours.chain_logits(TOKENS[:11], 3), theirs.chain_logits(TOKENS[:11], 3))


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temp=0.7)], ids=["greedy", "temp"])
@pytest.mark.parametrize("layout", ["speculators", "specforge"])
def test_tree_candidates_equal_mlx(twins96, layout, sampling):
    """Every candidate of EAGLE-2's expansion: scores within 1e-4, the same ids and parents,
    hence the same tree of drafts."""
    model, twin = twins96
    ours, theirs = pair(FIXTURES / layout, model, twin, TOKENS, tree_budget=12, tree_width=3)
    mine, other = (d.tree_candidates(TOKENS, 12, sampling) for d in (ours, theirs))
    assert len(mine[0]) == 3 + 5 * 9  # depth 6: the root's 3 best, then 3 x 3 per depth
    assert np.abs(np.array(mine[0]) - np.array(other[0])).max() < ATOL
    assert (mine[1], mine[2]) == (other[1], other[2])
    mine, other = (d.propose(TOKENS, 12, sampling) for d in (ours, theirs))
    assert (mine.tokens, mine.parents) == (other.tokens, other.parents)


@pytest.mark.parametrize("options", [{}, {"tree_budget": 12, "tree_width": 3}],
                         ids=["chain", "tree"])
def test_a_drafter_window_masks_as_on_mlx(twins96, options):
    """--drafter-window 3: the prefill's outputs, chain steps and tree candidates as MLX's
    windowed drafter gives them (torch masks the cache; MLX also reads fewer keys)."""
    model, twin = twins96
    ours, theirs = pair(FIXTURES / "speculators", model, twin, TOKENS, window=3, **options)
    assert close(ours._hidden, theirs._hidden)
    if options:
        mine, other = (d.tree_candidates(TOKENS, 12, GREEDY) for d in (ours, theirs))
        assert np.abs(np.array(mine[0]) - np.array(other[0])).max() < ATOL
        assert (mine[1], mine[2]) == (other[1], other[2])
    else:
        assert close(ours.chain_logits(TOKENS, 4), theirs.chain_logits(TOKENS, 4))
    free, _ = pair(FIXTURES / "speculators", model, twin, TOKENS, **options)
    assert not close(free._hidden, ours._hidden)  # the window changed what they see


@pytest.mark.parametrize("tied", [False, True], ids=["target-head", "tied-embedding"])
def test_a_checkpoint_without_lm_head_ranks_as_on_mlx(twins12, tmp_path, tied):
    """No embed_tokens and no lm_head (the whole vocabulary drafts): the target's embedding, and
    the target's head or (tie_word_embeddings) its embedding as the head, on both backends."""
    model, twin, _ = twins12
    path = make_drafter_dir(tmp_path / "headless", vocab=12, draft_ids=list(range(12)), seed=2)
    weights = dict(mx.load(str(path / "model.safetensors")))
    del weights["lm_head.weight"]
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": tied}))
    tokens = PROMPTS[1]
    ours, theirs = pair(path, model, twin, tokens)
    assert "lm_head" not in dict(ours.model.named_children())
    assert close(ours.chain_logits(tokens, 3), theirs.chain_logits(tokens, 3))


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
     "original_max_position_embeddings": 4096},
], ids=lambda rope: rope["rope_type"])
def test_scaled_rope_equals_mlx(twins12, tmp_path, rope):
    """transformers' rotary class for the layer's rope dict, mlx-lm's initialize_rope on MLX:
    Llama 3.1's scaling (the common EAGLE-3 target) and YaRN's give the same logits."""
    model, twin, _ = twins12
    path = make_drafter_dir(tmp_path / "rope", vocab=12, draft_ids=list(range(12)), seed=2)
    config = json.loads((path / "config.json").read_text())
    config["transformer_layer_config"].update(rope_parameters=rope,
                                              max_position_embeddings=16384)
    (path / "config.json").write_text(json.dumps(config))
    tokens = list(range(1, 12)) * 3
    ours, theirs = pair(path, model, twin, tokens)
    assert close(ours.chain_logits(tokens, 3), theirs.chain_logits(tokens, 3))


# ---- Through the loop --------------------------------------------------------------------------


def run(target, drafter, prompt, *, max_tokens=20, k=4, sampling=GREEDY):
    stats = SpecStats()
    out = speculative_tokens(target, drafter, prompt, sampling=sampling, max_tokens=max_tokens,
                             num_draft=k, stats=stats)
    return [t for t, _ in out], stats


def run_torch(twin, drafter, prompt, **options):
    target = TorchTarget(twin, capture_layers=drafter.capture_layers, speculative=True)
    return run(target, drafter, prompt, **options)


def run_mlx(model, drafter, prompt, **options):
    target = MLXTarget(model, capture_layers=drafter.capture_layers, speculative=True)
    return run(target, drafter, prompt, **options)


@pytest.mark.parametrize("options", [{}, {"tree_budget": 6}], ids=["chain", "tree"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_is_plain_decoding_and_mlx_tokens(twins12, prompt, options):
    model, twin, path = twins12
    plain, _ = run_torch(twin, Drafter(), prompt)
    drafter = mlxspec.load_drafter("eagle3", path, model=twin, tokenizer=None, **options)
    k = options.get("tree_budget", 4)
    out, stats = run_torch(twin, drafter, prompt, k=k)
    assert out == plain
    theirs, mlx_stats = run_mlx(model, load_mlx_eagle3(path, model=model, **options), prompt, k=k)
    assert out == theirs
    assert (stats.drafted, stats.accepted) == (mlx_stats.drafted, mlx_stats.accepted)
    assert stats.chain_fallback_steps == 0 and (len(prompt) == 1 or stats.drafted > 0)


@pytest.mark.parametrize("options", [{}, {"tree_budget": 8, "tree_width": 3}],
                         ids=["chain", "tree"])
def test_draft_cache_after_a_step_holds_the_committed_pairs_only(twins12, options):
    """After generation and one more proposal (chain steps, or tree entries, in the cache), the
    next commit leaves the keys, values and last output a fresh begin on the committed tokens
    builds."""
    _, twin, path = twins12
    drafter = mlxspec.load_drafter("eagle3", path, model=twin, tokenizer=None, **options)
    out, stats = run_torch(twin, drafter, PROMPTS[0], max_tokens=20, k=8)
    assert stats.accepted > 0
    committed = PROMPTS[0] + out
    tokens = committed[:-3]
    drafter.propose(tokens, 8, GREEDY)
    assert drafter.cache.get_seq_length() > len(tokens) - 1  # the proposal's own entries
    features = TorchTarget(twin, capture_layers=drafter.capture_layers).prefill(committed)
    new = committed[len(tokens):]
    drafter.commit(committed, Verdict(new[:-1], len(new) - 1, new[-1],
                                      features=features[len(tokens) - 1:]))
    with torch.inference_mode():  # as the next proposal does: the commit's pairs run
        drafter._rewind(len(committed) - 1)
    fresh = mlxspec.load_drafter("eagle3", path, model=twin, tokenizer=None)
    fresh.begin(committed, features)
    assert drafter.cache.get_seq_length() == fresh.cache.get_seq_length() == len(committed) - 1
    for ours, theirs in zip(drafter.cache.layers, fresh.cache.layers):
        assert torch.allclose(ours.keys, theirs.keys, atol=ATOL)
        assert torch.allclose(ours.values, theirs.values, atol=ATOL)
    assert torch.allclose(drafter._last_output(), fresh._last_output(), atol=ATOL)


@pytest.mark.parametrize("options", [{}, {"tree_budget": 8}], ids=["chain", "tree"])
def test_sampled_runs_complete_with_valid_tokens(twins12, options):
    """The acceptance rules' exactness is tested elsewhere (test_torch_backend, test_torch_trees);
    here sampled EAGLE-3 drafts go through them: whole outputs of target tokens."""
    _, twin, path = twins12
    torch.manual_seed(0)
    drafter = mlxspec.load_drafter("eagle3", path, model=twin, tokenizer=None, **options)
    sampling = SamplingConfig(temp=1.0, top_p=0.9)
    out, stats = run_torch(twin, drafter, PROMPTS[0], max_tokens=24, k=options.get(
        "tree_budget", 4), sampling=sampling)
    assert len(out) == 24 and all(0 <= t < 12 for t in out) and stats.accepted > 0
    if not options:  # a chain's p: over the target's vocabulary, zero outside the draft's
        draft = drafter.propose(PROMPTS[0] + out, 3, SamplingConfig(temp=1.0))
        p = draft.probs.cpu().numpy()
        assert p.shape == (3, 12) and np.allclose(p.sum(axis=1), 1, atol=1e-5)
        assert (p[:, sorted(set(range(12)) - set(DRAFT_IDS))] == 0).all()
        assert set(draft.tokens.tolist()) <= set(DRAFT_IDS)


# ---- From the CLI ------------------------------------------------------------------------------


def cli(*options):
    from click.testing import CliRunner

    from mlxspec.cli.main import main

    return CliRunner().invoke(main, ["generate", "-p", "abcabcab", "-n", "16",
                                     "--no-chat-template", "--backend", "torch", *options])


def test_cli_on_torch_prints_plain_text(llama_dir, tmp_path):  # noqa: F811
    """The published layout's fixture (trained for another target) and a drafter whose draft
    vocabulary is the plain output's most common token (so drafts are accepted), each as a
    chain and as a tree: plain decoding's text."""
    from mlx_lm.utils import load_tokenizer

    plain = cli("--model", str(llama_dir))
    assert plain.exit_code == 0, plain.output
    ids = load_tokenizer(llama_dir).encode(plain.stdout.strip(), add_special_tokens=False)
    common = max(set(ids), key=ids.count)
    accepting = make_drafter_dir(tmp_path / "one_token", vocab=96, draft_ids=[common])
    for drafter, accepts in ((FIXTURES / "speculators", False), (accepting, True)):
        for tree in ([], ["--tree-budget", "6"]):
            spec = cli("--model", str(llama_dir), "--drafter", "eagle3", "--drafter-model",
                       str(drafter), "--verbose", *tree)
            assert spec.exit_code == 0, spec.output
            assert spec.stdout == plain.stdout and spec.stdout.strip(), (drafter, tree)
            counts = re.search(r"drafted: (\d+), accepted: (\d+)", spec.stderr)
            assert int(counts[1]) > 0 and (int(counts[2]) > 0 or not accepts), spec.stderr


def test_cli_refuses_a_mismatched_checkpoint_in_one_line_before_the_weights(llama_dir,  # noqa: F811
                                                                           tmp_path):
    other = make_drafter_dir(tmp_path / "other", vocab=12, draft_ids=DRAFT_IDS)
    (Path(other) / "model.safetensors").write_bytes(b"not a safetensors file")  # never read
    result = cli("--model", str(llama_dir), "--drafter", "eagle3", "--drafter-model", str(other))
    errors = [line for line in result.output.splitlines() if "Error" in line]
    assert result.exit_code != 0 and len(errors) == 1, result.output
    assert "vocab size: drafter 12, target 96" in errors[0] and "Traceback" not in result.output
