"""Trees of drafts on the torch backend: one pass over [pending, nodes] with a 4D ancestor mask
and per-node positions scores each node as MLX's tree pass does and as a plain pass over its own
branch does; the cache after settling the committed branch is a fresh prefill's; greedy output
with branched lookup and DDTree is plain decoding's; sampled tree acceptance is distributed as the
target (chi-squared, and a wrong rule fails the same test); a cache that cannot hold a tree
verifies the first chain and counts it; and the CLI runs both tree drafters on torch.

The tiny targets are test_tree_verification's, loaded in transformers from the same weights
(test_torch_backend.torch_twin), float32 on the CPU (MLXSPEC_TORCH_DEVICE=cuda for a GPU).
"""

import os

import mlx.core as mx
import numpy as np
import pytest
import test_tree_acceptance as table_trees
from mlx_lm.models.cache import make_prompt_cache
from test_torch_backend import torch_twin
from test_tree_verification import SHAPE, VOCAB, PlantedTreeDrafter, paths
from tiny_models import tiny_llama

torch = pytest.importorskip("torch", reason="needs torch (pip install .[reference])")
transformers = pytest.importorskip("transformers", reason="the torch backend needs transformers")

import mlxspec  # noqa: E402
from mlxspec.drafters.lookup import PromptLookupDrafter  # noqa: E402
from mlxspec.engine import SpecStats, speculative_tokens  # noqa: E402
from mlxspec.backends.mlx.target import MLXTarget  # noqa: E402
from mlxspec.sampling import SamplingConfig  # noqa: E402
from mlxspec.backends.torch import TorchTarget  # noqa: E402
from mlxspec.backends.torch.sampling import categorical, processed_logprobs  # noqa: E402
from mlxspec.backends.torch.target import cache_argument, make_cache, tree_attention  # noqa: E402
from mlxspec.backends.torch.tree_acceptance import (  # noqa: E402
    DeviceTree,
    accept_tree_greedy,
    accept_tree_sampled,
)
from mlxspec.backends.mlx.tree_pass import attention_modules, tree_pass  # noqa: E402

DEVICE = torch.device(os.environ.get("MLXSPEC_TORCH_DEVICE", "cpu"))
GREEDY = SamplingConfig()
CONTEXT = [3, 1, 4, 1, 5, 9, 2]
NODES = [7, 8, 9, 10, 11, 12, 13, 14]  # SHAPE's tokens: 3 children at the root, depth 4


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread(one_torch_thread):
    """torch on one thread while this module runs (conftest.one_torch_thread)."""


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """test_tree_verification's target in MLX and in transformers."""
    model = tiny_llama(vocab=VOCAB, seed=21, sharpness=8.0)
    return model, torch_twin(model, tmp_path_factory.mktemp("tree_twin"))


def ids(values) -> torch.Tensor:
    return torch.tensor([list(values)], device=DEVICE)


@torch.inference_mode()
def torch_tree_logits(model, context, nodes, shape):
    """One tree pass through a transformers model after a cache of context[:-1], and the
    attention mask each attention layer was handed."""
    cache = make_cache(model)
    model(input_ids=ids(context[:-1]), **{cache_argument(model): cache}, use_cache=True)
    mask, positions = tree_attention(DeviceTree.of(shape, DEVICE), len(context) - 1,
                                     model.dtype)
    seen = []
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["attention_mask"]), with_kwargs=True)
        for layer in model.model.layers]
    try:
        out = model(input_ids=ids([context[-1]] + nodes), attention_mask=mask,
                    position_ids=positions, **{cache_argument(model): cache}, use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    return out.logits[0].float().cpu().numpy(), mask, seen


def test_tree_pass_scores_each_node_after_its_own_branch_as_mlx_does(twins):
    model, twin = twins
    ours, mask, seen = torch_tree_logits(twin, CONTEXT, NODES, SHAPE)
    # transformers hands the 4D mask to every attention layer as given, not rebuilt as causal.
    assert len(seen) == len(twin.model.layers) and all(m is mask for m in seen)
    assert mask.shape == (1, 1, SHAPE.size + 1, len(CONTEXT) + SHAPE.size)
    assert mask.dtype == twin.dtype and (mask[0, 0, :, : len(CONTEXT) - 1] == 0).all()
    cache = make_prompt_cache(model)
    model(mx.array(CONTEXT[:-1])[None], cache=cache)
    with tree_pass(attention_modules(model), cache, SHAPE) as view:
        theirs = np.array(model(mx.array([CONTEXT[-1]] + NODES)[None], cache=view)[0])
    assert np.abs(ours - theirs).max() < 1e-4
    with torch.inference_mode():
        for node, branch in enumerate(paths(SHAPE)):
            chain = twin(input_ids=ids(CONTEXT + [NODES[n - 1] for n in branch])).logits[0, -1]
            assert np.abs(ours[node] - chain.cpu().numpy()).max() < 1e-4, node


def greedy_reference(model, prompt, n):
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            tokens.append(int(model(input_ids=ids(tokens)).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def generate(target, drafter, prompt, n, num_draft, sampling=GREEDY):
    stats = SpecStats()
    out = speculative_tokens(target, drafter, prompt, sampling=sampling, max_tokens=n,
                             num_draft=num_draft, stats=stats)
    return [t for t, _ in out], stats


@pytest.mark.parametrize("leaf, wrong", [(8, None), (8, 3), (5, None), (7, 2), (3, None)])
def test_settled_cache_is_a_fresh_prefill_of_the_committed_tokens(twins, leaf, wrong):
    """Planted trees (test_tree_verification's): the branch through `leaf` holds the true
    continuation, with its token at depth `wrong` made wrong."""
    _, twin = twins
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    reference = greedy_reference(twin, prompt, 14)
    target = TorchTarget(twin, speculative=True)
    assert target.holds_trees()
    out, stats = generate(target, PlantedTreeDrafter(prompt + reference, leaf, wrong), prompt,
                          14, SHAPE.size)
    assert out == reference and stats.chain_fallback_steps == 0
    assert stats.accepted >= min(SHAPE.depth[leaf], (wrong or 99) - 1)
    fresh = make_cache(twin)
    with torch.inference_mode():
        twin(input_ids=ids((prompt + out)[:-1]), **{cache_argument(twin): fresh}, use_cache=True)
    assert target.cache.get_seq_length() == fresh.get_seq_length() == len(prompt + out) - 1
    for ours, theirs in zip(target.cache.layers, fresh.layers):
        assert torch.allclose(ours.keys, theirs.keys, atol=1e-5)
        assert torch.allclose(ours.values, theirs.values, atol=1e-5)


@pytest.mark.parametrize("prompt", [[1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 4, 1, 2], [7, 7, 7], [3]])
def test_branched_lookup_is_greedy_decoding(twins, prompt):
    _, twin = twins
    out, stats = generate(TorchTarget(twin, speculative=True), PromptLookupDrafter(branches=3),
                          prompt, 20, 8)
    assert out == greedy_reference(twin, prompt, 20) and stats.chain_fallback_steps == 0


@pytest.fixture(scope="module")
def dflash_twins(tmp_path_factory):
    """test_torch_backend's tiny target and a random 2-layer DFlash drafter for it."""
    from test_dflash import make_drafter_dir

    root = tmp_path_factory.mktemp("ddtree")
    model = tiny_llama(vocab=12, hidden=32, layers=4, seed=1, sharpness=3.0)
    return model, torch_twin(model, root / "twin"), make_drafter_dir(
        root / "dflash", seed=3, target_layer_ids=[1, 3])


def test_ddtree_is_greedy_decoding_and_grows_the_mlx_tree(dflash_twins):
    from mlxspec.drafters.dflash import load_dflash_drafter as load_mlx_dflash

    model, twin, path = dflash_twins
    drafter = mlxspec.load_drafter("dflash", path, model=twin, tokenizer=None, tree_budget=8)
    assert drafter.drafts_trees and drafter.max_draft == 8
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    target = TorchTarget(twin, capture_layers=drafter.capture_layers, speculative=True)
    out, stats = generate(target, drafter, prompt, 16, 8)
    assert out == greedy_reference(twin, prompt, 16)
    assert stats.chain_fallback_steps == 0 and stats.accepted > 0
    # The same tree as the MLX drafter grows from the same block.
    theirs = load_mlx_dflash(path, model=model, tree_budget=8)
    theirs.begin(prompt, MLXTarget(model, capture_layers=theirs.capture_layers).prefill(prompt))
    drafter.begin(prompt, TorchTarget(twin, capture_layers=drafter.capture_layers)
                  .prefill(prompt))
    mine, other = (d.propose(prompt, 8, GREEDY) for d in (drafter, theirs))
    assert (mine.tokens, mine.parents) == (other.tokens, other.parents)
    # Sampled: the tree's one-hot rule runs through the same pass.
    torch.manual_seed(0)
    out, stats = generate(TorchTarget(twin, capture_layers=drafter.capture_layers,
                                      speculative=True), drafter, prompt, 12, 8,
                          SamplingConfig(temp=1.0))
    assert len(out) == 12 and stats.drafted > 0


def test_a_cache_with_a_sliding_window_verifies_the_first_chain_and_says_so():
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        use_sliding_window=True, sliding_window=64,
        layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE).eval()
    target = TorchTarget(model, speculative=True)
    assert not target.holds_trees()
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    reference = greedy_reference(model, prompt, 14)
    out, stats = generate(target, PlantedTreeDrafter(prompt + reference, 8, None), prompt, 14,
                          SHAPE.size)
    assert out == reference and stats.chain_fallback_steps > 0 and stats.accepted > 0


# ---- sampled: the target's distribution (test_tree_acceptance's tables) ------------------------


def as_torch(array):
    return None if array is None else torch.from_numpy(np.array(array)).to(DEVICE)


def torch_rule(logits, tokens, shape, probs, sampling):
    """test_tree_acceptance's rule signature over MLX arrays, run by the torch rule."""
    return accept_tree_sampled(as_torch(logits), as_torch(tokens).long(),
                               DeviceTree.of(shape, DEVICE), as_torch(probs), sampling)


def wrong_torch_rule(logits, tokens, shape, probs, sampling):
    """The right acceptance, the next token drawn from the target's q where the branch ends
    instead of what the rejections left of it."""
    accepted, _, path = torch_rule(logits, tokens, shape, probs, sampling)
    q = processed_logprobs(as_torch(logits)[path[-1:]], sampling).exp()
    return accepted, categorical(q), path


@pytest.mark.slow  # χ²: thousands of sampled generations
@pytest.mark.parametrize("shape, sampled", [(table_trees.BINARY, False),
                                            (table_trees.UNEVEN, True)],
                         ids=["binary-top-k", "uneven-sampled"])
def test_sampled_tree_acceptance_keeps_the_target_distribution(shape, sampled):
    torch.manual_seed(0)
    counts = table_trees.sample_sequences(shape, sampled, rule=torch_rule)
    assert table_trees.chi_squared_pvalue(counts) > 1e-3


@pytest.mark.slow  # χ²: thousands of sampled generations
@pytest.mark.parametrize("sampled", [False, True], ids=["top-k", "sampled"])
def test_a_rule_without_the_residual_fails_the_same_test(sampled):
    torch.manual_seed(0)
    counts = table_trees.sample_sequences(table_trees.BINARY, sampled, rule=wrong_torch_rule)
    assert table_trees.chi_squared_pvalue(counts) < 1e-4


def test_greedy_tree_acceptance_equals_mlx():
    """Random logits and trees: the same accepted depth, next token and path as MLX's rule."""
    from mlxspec.backends.mlx.tree_acceptance import accept_tree_greedy as mlx_greedy

    rng = np.random.default_rng(4)
    for shape in (SHAPE, table_trees.BINARY, table_trees.UNEVEN):
        for _ in range(10):
            logits = rng.normal(size=(shape.size + 1, 5)).astype(np.float32)
            tokens = rng.integers(0, 5, shape.size)
            ours = accept_tree_greedy(as_torch(logits), as_torch(tokens),
                                      DeviceTree.of(shape, DEVICE))
            theirs = mlx_greedy(mx.array(logits), mx.array(tokens), shape)
            assert [t.tolist() for t in ours] == [np.array(t).reshape(-1).tolist()
                                                  for t in theirs]


# ---- from the CLI ----------------------------------------------------------------------------


def test_trees_from_the_cli_on_torch(smollm_dir):
    """Branched lookup and DDTree on the shipped DFlash drafter, on torch: plain output."""
    from click.testing import CliRunner
    from mlxspec.cli.main import main

    def cli(*options):
        result = CliRunner().invoke(main, [
            "generate", "-m", str(smollm_dir), "--backend", "torch", "--device", DEVICE.type,
            "--no-chat-template", "-n", "12", "-p",
            "def add(a, b):\n    return a + b\n\ndef add(a, b):", *options])
        assert result.exit_code == 0, result.output
        return result

    plain = cli()
    for options in (["--drafter", "lookup", "--lookup-branches", "3"],
                    ["--drafter", "dflash", "--tree-budget", "8"]):
        assert cli(*options).stdout == plain.stdout, options
