"""`--drafter mtp` on the torch backend, on tiny checkpoints in the published DeepSeek-V3 layout
(MoE MTP module at `model.layers.2`): DeepSeek-V3 (tests/mtp_models.py, MLA attention) and
GLM-4.5 (glm4_moe, written here: GQA with q/k norms, partial rotary), each loaded by mlx-lm and by
transformers from the same directory, float32:

- against our MLX drafter: target logits, draft logits at depth 1 and chained depths 2 and 3,
  EAGLE-2 tree candidates (ids, parents, path scores), and the tokens, drafts and acceptance
  counts of chain and tree generations whose drafts are sometimes right;
- against the target: greedy output through `mlxspec.stream_generate` equals plain decoding;
- against transformers' own `MtpModel` (transformers 5.24, `modeling_layers`), built on the
  same target and loaded by transformers' own conversions (its `from_pretrained` finds no MTP
  weights in a tiny checkpoint: its regex comes from the hardcoded `model\\.layers\\.61`). It
  chains the normed hidden, so depth 2 is compared with ours built `chain_after_norm=True`.

Measured (2-core CPU, torch 2.13 + transformers 5.24 vs mlx 0.32), |logits| about 4-5: target
logits differ from MLX's by at most 2.7e-6; draft logits by at most 3.6e-6 against MLX (depths
1-3) and 1.4e-6 against transformers' MtpModel (depths 1-2); tree path scores (down to -42)
by 1.3e-5 against MLX; asserted 1e-4. Ours chained before the norm (DeepSeek's h^k, the
default) differs from transformers' depth 2 by about 1.1.
"""


import mlx.core as mx
import numpy as np
import pytest
from mtp_models import write_deepseek_v3, write_glm4_moe, write_qwen3_5

torch = pytest.importorskip("torch", reason="needs torch (pip install .[reference])")
transformers = pytest.importorskip("transformers", reason="the torch backend needs transformers")

import mlxspec  # noqa: E402
from mlxspec.converters.hf import load_checkpoint  # noqa: E402
from mlxspec.drafters.mtp import load_mtp_drafter as load_mlx_mtp  # noqa: E402
from mlxspec.drafters.mtp import read_model_config  # noqa: E402
from mlxspec.engine import PlainDecoding, SpecStats, speculative_tokens  # noqa: E402
from mlxspec.backends.mlx.target import MLXTarget  # noqa: E402
from mlxspec.models.mtp import read_mtp_tensors  # noqa: E402
from mlxspec.sampling import SamplingConfig  # noqa: E402
from mlxspec.backends.torch import TorchTarget  # noqa: E402
from mlxspec.backends.torch.loading import load_causal_lm  # noqa: E402
from mlxspec.backends.torch.mtp import (  # noqa: E402
    TorchMTPDrafter,
    build_mtp_model,
    load_mtp_drafter,
)

GREEDY = SamplingConfig(temp=0.0)
ATOL = 1e-4
PROMPT = [1, 5, 9, 100, 2000, 17, 42, 7, 9, 311]


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread(one_torch_thread):
    """torch on one thread while this module runs (conftest.one_torch_thread)."""


@pytest.fixture(scope="module")
def deepseek(smollm_dir, tmp_path_factory):
    """A tiny DeepSeek-V3 with SmolLM2's tokenizer (vocab 49152), on both backends."""
    path = write_deepseek_v3(tmp_path_factory.mktemp("deepseek"), seed=3,
                             tokenizer_dir=smollm_dir)
    return path, mlxspec.load(path), mlxspec.load(path, backend="torch")


WRITERS = {"deepseek_v3": write_deepseek_v3, "glm4_moe": write_glm4_moe}


def both_backends(path):
    model, _ = load_checkpoint(path, lazy=False, action="load")
    return path, model, load_causal_lm(path, device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture(scope="module", params=sorted(WRITERS))
def twins(request, deepseek, tmp_path_factory):
    """Each family on both backends: the DeepSeek-V3 above, a GLM-4.5 of 2048 tokens."""
    if request.param == "deepseek_v3":
        path, (mlx_model, _), (torch_model, _) = deepseek
        return path, mlx_model, torch_model
    return both_backends(write_glm4_moe(tmp_path_factory.mktemp("glm"), vocab=2048, seed=3))


@pytest.fixture(scope="module", params=sorted(WRITERS))
def sharp(request, tmp_path_factory):
    """A 16-token target of each family whose MTP drafts are sometimes right (seeds where
    some are: a random module rarely agrees with a random target)."""
    out = tmp_path_factory.mktemp(f"sharp_{request.param}")
    seed = {"deepseek_v3": 0, "glm4_moe": 2}[request.param]
    return both_backends(WRITERS[request.param](out, vocab=16, seed=seed, sharpness=3.0))


def as_numpy(array) -> np.ndarray:
    if isinstance(array, torch.Tensor):
        return array.float().cpu().numpy()
    return np.array(array.astype(mx.float32))


def max_diff(ours, theirs) -> float:
    return max(float(np.abs(as_numpy(a) - as_numpy(b)).max()) for a, b in zip(ours, theirs))


def begun(drafter, target, tokens):
    drafter.begin(tokens, target.prefill(tokens))
    return drafter


def test_target_logits_equal_mlx(twins):
    """transformers reads the directory as mlx-lm does; the MTP tensors at model.layers.2 are
    left out by both."""
    _, mlx_model, torch_model = twins
    with torch.inference_mode():
        ours = torch_model(torch.tensor([PROMPT])).logits[0]
    assert max_diff([ours], [mlx_model(mx.array([PROMPT]))[0]]) < ATOL


def test_draft_logits_equal_mlx(twins):
    """Depth 1 (module 1 on the committed pairs), then depths 2 and 3 (the module reused on its
    own output), fed the same draft tokens on both backends."""
    path, mlx_model, torch_model = twins
    ours = mlxspec.load_drafter("mtp", path, model=torch_model, tokenizer=None)
    assert isinstance(ours, TorchMTPDrafter)
    theirs = load_mlx_mtp(path, model=mlx_model)
    assert ours.capture_layers == theirs.capture_layers == (1,)
    begun(ours, TorchTarget(torch_model, capture_layers=ours.capture_layers), PROMPT)
    begun(theirs, MLXTarget(mlx_model, capture_layers=theirs.capture_layers), PROMPT)
    drafts = [int(mx.argmax(theirs.chain_logits(PROMPT, 1)[0])), 77]
    assert max_diff(ours.chain_logits(PROMPT, 3, drafts), theirs.chain_logits(PROMPT, 3, drafts)) \
        < ATOL


def test_greedy_stream_equals_plain_decoding(deepseek):
    """By name (the directory the target came from) and as a loaded drafter, chains of 1-3."""
    path, _, (model, tokenizer) = deepseek
    prompt = "one two three one two three"
    plain = [r.token for r in mlxspec.stream_generate(model, tokenizer, prompt, 16)]
    drafter = load_mtp_drafter(path, model=model)
    for source, num_draft in (("mtp", 3), (drafter, 1), (drafter, 2)):
        out = list(mlxspec.stream_generate(model, tokenizer, prompt, 16, drafter=source,
                                           num_draft=num_draft, adaptive=False))
        assert [r.token for r in out] == plain and out[-1].drafted > 0


def run(target, drafter, n=32, num_draft=3):
    stats = SpecStats()
    out = speculative_tokens(target, drafter, [1, 5, 3, 7, 2, 9, 4, 12, 5, 3], sampling=GREEDY,
                             max_tokens=n, num_draft=num_draft, stats=stats)
    return [t for t, _ in out], (stats.drafted, stats.accepted, stats.accepted_per_position)


def test_accepted_drafts_and_cuts_equal_mlx(sharp):
    """Drafts accepted and rejected: every cut of the chain's entries leaves the modules' caches
    as on MLX, so tokens and acceptance counts are identical (and the output is the target's)."""
    path, mlx_model, torch_model = sharp
    ours = load_mtp_drafter(path, model=torch_model)
    theirs = load_mlx_mtp(path, model=mlx_model)
    tokens, stats = run(TorchTarget(torch_model, capture_layers=ours.capture_layers,
                                    speculative=True), ours)
    assert (tokens, stats) == run(MLXTarget(mlx_model, capture_layers=theirs.capture_layers,
                                            speculative=True), theirs)
    assert 0 < stats[1] < stats[0]
    plain = run(TorchTarget(torch_model), PlainDecoding())[0]
    assert tokens == plain


# ---- Trees: EAGLE-2's dynamic tree grown by module 1 -------------------------------------------


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temp=0.7)], ids=["greedy", "temp"])
def test_tree_candidates_equal_mlx(twins, sampling):
    """Every candidate's id and parent as on MLX, its path score within ATOL: each tree entry
    saw only its ancestors, at its depth's RoPE position, through transformers' attention."""
    path, mlx_model, torch_model = twins
    ours = load_mtp_drafter(path, model=torch_model, tree_budget=16, tree_width=3)
    theirs = load_mlx_mtp(path, model=mlx_model, tree_budget=16, tree_width=3)
    begun(ours, TorchTarget(torch_model, capture_layers=ours.capture_layers), PROMPT)
    begun(theirs, MLXTarget(mlx_model, capture_layers=theirs.capture_layers), PROMPT)
    scores, ids, parents = ours.tree_candidates(PROMPT, 16, sampling)
    want_scores, want_ids, want_parents = theirs.tree_candidates(PROMPT, 16, sampling)
    assert (ids, parents) == (want_ids, want_parents) and len(ids) == 3 + 5 * 9
    assert np.abs(np.array(scores) - np.array(want_scores)).max() < ATOL


def test_greedy_tree_tokens_and_counts_equal_mlx(sharp):
    """Trees verified by transformers' DeepSeek and GLM caches: the target's output, with the
    drafts and acceptance counts of MLX."""
    path, mlx_model, torch_model = sharp
    ours = load_mtp_drafter(path, model=torch_model, tree_budget=8, tree_width=3)
    theirs = load_mlx_mtp(path, model=mlx_model, tree_budget=8, tree_width=3)
    tokens, stats = run(TorchTarget(torch_model, capture_layers=ours.capture_layers,
                                    speculative=True), ours, num_draft=8)
    assert (tokens, stats) == run(MLXTarget(mlx_model, capture_layers=theirs.capture_layers,
                                            speculative=True), theirs, num_draft=8)
    assert stats[1] > 0 and tokens == run(TorchTarget(torch_model), PlainDecoding())[0]


# ---- transformers' own MTP model as the outside peer ---------------------------------------------


def transformers_mtp(model, path):
    """transformers' MtpModel on `model`, its weights read as its from_pretrained reads them
    (the published tensors, renamed and fused by its own conversions)."""
    from safetensors import safe_open
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_layers import MtpModel
    from transformers.modeling_utils import LoadStateDictConfig

    peer = MtpModel(model, model.config.num_mtp_layers)
    prefix = f"model.layers.{model.config.num_hidden_layers}."
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    info, _ = convert_and_load_state_dict_in_model(
        model=peer, state_dict=tensors, load_config=LoadStateDictConfig(
            weight_mapping=peer.get_weight_conversions(model), dtype=model.dtype))
    copies = {"embed_tokens.weight", "shared_head.weight"}  # the target's, tied
    assert set(info.missing_keys) <= copies and not info.mismatched_keys, info
    assert {k.rsplit(".", 2)[-2] for k in info.unexpected_keys} <= {"head", "embed_tokens"}
    return peer.eval()


def peer_logits(peer, hidden, tokens, draft) -> list:
    """Depths 1 and 2 as MTPCandidateGenerator runs them: pair (token p+1, target hidden p) at
    position p+1 in an MtpCache, then the layer again on (draft, its own normed output)."""
    from transformers.cache_utils import MtpCache

    cache = MtpCache(config=peer.config)
    positions = torch.arange(1, hidden.shape[1] + 1)[None]
    with torch.inference_mode():
        first = peer.forward_layer(0, hidden, positions, cache, input_ids=torch.tensor([tokens]))
        second = peer.forward_layer(0, first[:, -1:], positions[:, -1:] + 1, cache,
                                    input_ids=torch.tensor([[draft]]))
        return [peer._project_to_logits(x[0, -1]) for x in (first, second)]


def test_draft_logits_equal_transformers_mtp_model(twins):
    """Depth 1 equals transformers'; depth 2 too when ours chains the normed output as
    transformers does, and not with DeepSeek's pre-norm chaining (our default)."""
    path, _, model = twins
    config = read_model_config(path)
    tensors, _ = read_mtp_tensors(path, config)
    target = TorchTarget(model, capture_layers=(1,))
    features = target.prefill(PROMPT)
    with torch.inference_mode():
        hidden = model.model.norm(features)[None]
    default = begun(load_mtp_drafter(path, model=model), TorchTarget(model, capture_layers=(1,)),
                    PROMPT)
    draft = int(torch.argmax(default.chain_logits(PROMPT, 1)[0]))
    theirs = peer_logits(transformers_mtp(model, path), hidden, PROMPT[1:], draft)
    normed = TorchMTPDrafter(build_mtp_model(model, config, tensors, chain_after_norm=True),
                             num_target_layers=2, hidden_size=config["hidden_size"],
                             target_vocab=config["vocab_size"])
    begun(normed, TorchTarget(model, capture_layers=(1,)), PROMPT)
    assert max_diff(normed.chain_logits(PROMPT, 2, [draft]), theirs) < ATOL
    prenorm = default.chain_logits(PROMPT, 2, [draft])
    assert max_diff(prenorm[:1], theirs[:1]) < ATOL and max_diff(prenorm[1:], theirs[1:]) > 0.01


# ---- refusals -----------------------------------------------------------------------------------


def test_families_and_checkpoints_refused_in_one_line(deepseek, tmp_path):
    """A family the torch backend does not build (Qwen3.5) and a checkpoint without MTP layers
    are refused before any weight loads; a module missing a tensor, naming it."""
    path, _, (model, _) = deepseek
    qwen = write_qwen3_5(tmp_path / "qwen", vocab=64)
    with pytest.raises(ValueError, match=r"^the torch backend's mtp drafter covers .*qwen3_5"):
        load_mtp_drafter(qwen, model=model)
    bare = write_deepseek_v3(tmp_path / "bare", vocab=64, mtp=False)
    with pytest.raises(ValueError, match="declares no MTP layers") as refused:
        mlxspec.load_drafter("mtp", bare, model=model, tokenizer=None)
    assert "\n" not in str(refused.value)
    config = read_model_config(path)
    tensors, _ = read_mtp_tensors(path, config)
    del tensors["model.layers.2.eh_proj.weight"]
    with pytest.raises(ValueError, match=r"^the MTP weights do not fit .*mtp\.0\.fc\.weight"):
        build_mtp_model(model, config, tensors)


@pytest.mark.slow  # χ²: thousands of sampled generations
def test_sampled_output_follows_the_targets_distribution(tmp_path):
    """Drafts drawn from the torch module's distribution p, accepted by the torch rule: the
    samples follow the target's q exactly (chi-squared over every sequence; q from the MLX
    twin, the same weights), so the p the drafter reports is the one it drew from."""
    from collections import Counter

    from test_sampling_exactness import (
        LENGTH,
        PROMPT,
        SAMPLES,
        SAMPLING,
        VOCAB,
        chi_squared_pvalue,
        exact_distribution,
    )

    path = write_deepseek_v3(tmp_path / "ds", vocab=VOCAB, seed=2, sharpness=1.5)
    path, mlx_model, model = both_backends(path)
    exact = exact_distribution(mlx_model, SAMPLING)
    drafter = load_mtp_drafter(path, model=model)
    torch.manual_seed(1234)
    counts, stats = Counter(), SpecStats()
    for _ in range(SAMPLES):
        out = speculative_tokens(
            TorchTarget(model, capture_layers=drafter.capture_layers, speculative=True),
            drafter, PROMPT, sampling=SAMPLING, max_tokens=LENGTH, num_draft=2, stats=stats)
        counts[tuple(t for t, _ in out)] += 1
    assert 0 < stats.accepted < stats.drafted
    pvalue = chi_squared_pvalue(counts, exact)
    assert pvalue > 0.001, f"p = {pvalue:.2g}"


@pytest.mark.parametrize("options", [{}, {"tree_budget": 16, "tree_width": 3}],
                         ids=["chain", "tree"])
def test_a_drafter_window_masks_as_on_mlx(twins, options):
    """--drafter-window 3: chain logits (depths 1-3) and tree candidates as on MLX, where the
    window reads only its keys; torch masks the rest."""
    path, mlx_model, torch_model = twins
    ours = load_mtp_drafter(path, model=torch_model, window=3, **options)
    theirs = load_mlx_mtp(path, model=mlx_model, window=3, **options)
    begun(ours, TorchTarget(torch_model, capture_layers=ours.capture_layers), PROMPT)
    begun(theirs, MLXTarget(mlx_model, capture_layers=theirs.capture_layers), PROMPT)
    if not options:
        drafts = [int(mx.argmax(theirs.chain_logits(PROMPT, 1)[0])), 77]
        assert max_diff(ours.chain_logits(PROMPT, 3, drafts),
                        theirs.chain_logits(PROMPT, 3, drafts)) < ATOL
        return
    scores, ids, parents = ours.tree_candidates(PROMPT, 16, GREEDY)
    want_scores, want_ids, want_parents = theirs.tree_candidates(PROMPT, 16, GREEDY)
    assert (ids, parents) == (want_ids, want_parents)
    assert np.abs(np.array(scores) - np.array(want_scores)).max() < ATOL
