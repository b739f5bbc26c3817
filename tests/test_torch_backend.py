"""The torch backend against the MLX one: same loop, same tokens, same stats, same distribution.

Both backends run float32 here (on CUDA too: bf16 would move logits by ~0.1 and make greedy
parity a matter of luck), so their logits differ only by summation order. Set
MLXSPEC_TORCH_DEVICE=cuda to run the torch side on a GPU (scripts/gpu_check.sh does); the MLX side
stays on its own device.

Tolerances (measured on the 2-core CPU machine, torch 2.13 + transformers 5.24 vs MLX 0.32.4 with
OpenBLAS; printed with -s), the same on CUDA:
- target logits, SmolLM2-135M, all 166 positions of a HumanEval prompt: max |diff| 9.4e-5 (mean
  1.0e-5, |logits| up to 47); asserted < 1e-3, argmax equal at every position.
- target features (outputs of the DFlash layers): relative max |diff| 9e-8; asserted < 1e-4.
- DFlash block logits, same checkpoint and context: max |diff| 2.5e-5 (SmolLM2, 1-layer drafter),
  1.3e-6 (tiny target, sliding + full layers, last-layer features); asserted < 1e-3.
- q (processed distribution): < 1e-6 absolute, identical support.
Greedy tokens and stats (target passes, drafted, accepted, tau, per-position counts) must be
identical: fixed K (the adaptive policy times steps, so its K depends on the machine).
"""

import os
import subprocess
import sys
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

torch = pytest.importorskip("torch", reason="needs torch (pip install .[reference])")
transformers = pytest.importorskip("transformers", reason="the torch backend needs transformers")

import mlxspec  # noqa: E402
from mlxspec.backends.mlx import acceptance as mlx_acceptance  # noqa: E402
from mlxspec.backends.mlx import sampling as mlx_sampling  # noqa: E402
from mlxspec.drafters import DraftModelDrafter  # noqa: E402
from mlxspec.drafters.dflash import load_dflash_drafter as load_mlx_dflash  # noqa: E402
from mlxspec.engine import Draft, Drafter, SpecStats, speculative_tokens  # noqa: E402
from mlxspec.generate import encode_prompt  # noqa: E402
from mlxspec.backends.mlx.target import MLXTarget  # noqa: E402
from mlxspec.prompts import humaneval_prompts, mtbench_prompts  # noqa: E402
from mlxspec.sampling import SamplingConfig  # noqa: E402
from mlxspec.backends.torch import (  # noqa: E402
    TorchDraftModelDrafter,
    TorchPromptCache,
    TorchTarget,
    load_causal_lm,
)
from mlxspec.backends.torch import acceptance as torch_acceptance  # noqa: E402
from mlxspec.backends.torch import sampling as torch_sampling  # noqa: E402

DEVICE = os.environ.get("MLXSPEC_TORCH_DEVICE", "cpu")
LOGIT_ATOL = 1e-3
MAX_TOKENS = 12  # ~24 was the goal; 12 keeps this module near 4 CPU-minutes here
N_EACH = 3  # real prompts from each set: 6 in all (10 took 4 CPU-minutes)


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    """On a shared 2-core machine two torch threads spin against other work (measured 6x slower
    than one); the GPU run does not care."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def torch_smollm(smollm_dir):
    return mlxspec.load(smollm_dir, backend="torch", device=DEVICE, torch_dtype="float32")


@pytest.fixture(scope="module")
def prompt_ids(smollm):
    _, tokenizer = smollm
    texts = humaneval_prompts(limit=N_EACH) + mtbench_prompts(limit=N_EACH)
    return [
        encode_prompt(
            tokenizer,
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
            ),
        )
        for t in texts
    ]


# ---- MLX-free import -------------------------------------------------------------------------

MLX_ONLY = r"""
import sys
sys.modules["torch"] = None  # a machine without torch: any import of it raises ImportError
import mlxspec
model, tokenizer = mlxspec.load(sys.argv[1])
for drafter in (None, "lookup"):
    text = mlxspec.generate(model, tokenizer, "Hello, Hello, Hello,", max_tokens=6, drafter=drafter)
    assert text, "no output"
print("LOADED", sorted(m for m in sys.modules if m.startswith(("torch.", "mlxspec.torch"))))
"""


def test_mlx_path_never_imports_torch(smollm_dir):
    """`import mlxspec` and MLX generation work where torch cannot be imported at all.

    (With torch installed, mlx-lm's tokenizer import pulls it in through transformers whatever we
    do, so "torch not in sys.modules" can only be asserted with torch made unimportable.)"""
    out = subprocess.run([sys.executable, "-c", MLX_ONLY, str(smollm_dir)], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LOADED []" in out.stdout, out.stdout


# ---- Tensor math: q and acceptance -------------------------------------------------------------

CONFIGS = [
    SamplingConfig(temp=0.7),
    SamplingConfig(temp=1.3, top_p=0.9),
    SamplingConfig(temp=0.8, top_k=20),
    SamplingConfig(temp=1.0, min_p=0.05),
    SamplingConfig(temp=0.6, top_p=0.8, min_p=0.02, top_k=50),
]


@pytest.mark.parametrize("config", CONFIGS,
                         ids=lambda c: f"T{c.temp}-p{c.top_p}-k{c.top_k}-m{c.min_p}")
def test_processed_distribution_equals_mlx(config):
    logits = np.random.default_rng(0).normal(size=(6, 1000)).astype(np.float32) * 3
    ours = torch_sampling.processed_logprobs(torch.from_numpy(logits).to(DEVICE), config)
    ours = ours.cpu().numpy()
    theirs = np.array(mlx_sampling.processed_logprobs(mx.array(logits), config))
    assert (np.isfinite(ours) == np.isfinite(theirs)).all(), "different truncation"
    np.testing.assert_allclose(np.exp(ours), np.exp(theirs), atol=1e-6)


def test_greedy_acceptance_equals_mlx():
    rng = np.random.default_rng(1)
    for _ in range(20):
        logits = rng.normal(size=(6, 50)).astype(np.float32)
        drafts = logits[:-1].argmax(-1)
        cut = rng.integers(0, 6)
        drafts[cut:] = (drafts[cut:] + 1) % 50  # a known number of correct drafts
        a_t, n_t = torch_acceptance.accept_greedy(torch.from_numpy(logits).to(DEVICE),
                                                  torch.from_numpy(drafts).long().to(DEVICE))
        a_m, n_m = mlx_acceptance.accept_greedy(mx.array(logits), mx.array(drafts))
        assert (int(a_t), int(n_t)) == (a_m.item(), n_m.item()) and int(a_t) == cut


# ---- The real target: logits, features, DFlash block logits ------------------------------------


def test_target_logits_match(smollm, torch_smollm, prompt_ids):
    model, _ = smollm
    ids = max(prompt_ids, key=len)
    theirs = np.array(model(mx.array([ids])).astype(mx.float32))[0]
    with torch.inference_mode():
        ours = torch_smollm[0](torch.tensor([ids], device=DEVICE)).logits[0].float().cpu().numpy()
    diff = np.abs(ours - theirs)
    print(f"\ntarget logits over {len(ids)} positions: max |diff| {diff.max():.2e}, "
          f"mean {diff.mean():.2e}, max |logit| {np.abs(theirs).max():.1f}")
    assert diff.max() < LOGIT_ATOL
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def _features_and_block_logits(mlx_model, torch_model, mlx_drafter, torch_drafter, ids, k):
    layers = mlx_drafter.capture_layers
    f_mlx = MLXTarget(mlx_model, capture_layers=layers).prefill(ids)
    f_torch = TorchTarget(torch_model, capture_layers=layers).prefill(ids)
    mlx_drafter.begin(ids, f_mlx)
    torch_drafter.begin(ids, f_torch)
    b_mlx = np.array(mlx_drafter.block_logits(ids, k).astype(mx.float32))
    b_torch = torch_drafter.block_logits(ids, k).float().cpu().numpy()
    return np.array(f_mlx), f_torch.float().cpu().numpy(), b_mlx, b_torch


def _check_block_parity(f_mlx, f_torch, b_mlx, b_torch, label):
    f_rel = np.abs(f_mlx - f_torch).max() / np.abs(f_mlx).max()
    diff = np.abs(b_mlx - b_torch)
    print(f"\n{label}: features rel. max |diff| {f_rel:.1e}; block logits max |diff| "
          f"{diff.max():.2e} (max |logit| {np.abs(b_mlx).max():.1f})")
    assert f_mlx.shape == f_torch.shape
    assert f_rel < 1e-4
    assert diff.max() < LOGIT_ATOL
    assert (b_mlx.argmax(-1) == b_torch.argmax(-1)).all()


def test_dflash_block_logits_match(smollm, torch_smollm, smollm_random_dflash, prompt_ids):
    model, tokenizer = smollm
    tmodel, ttokenizer = torch_smollm
    ours = mlxspec.load_drafter("dflash", smollm_random_dflash, model=tmodel, tokenizer=ttokenizer)
    theirs = mlxspec.load_drafter("dflash", smollm_random_dflash, model=model, tokenizer=tokenizer)
    assert type(ours).__module__.startswith("mlxspec.backends.torch")
    ids = prompt_ids[0]
    _check_block_parity(*_features_and_block_logits(model, tmodel, theirs, ours, ids, 15),
                        "SmolLM2 + 1-layer DFlash")


# ---- Tiny twins: one set of weights in mlx-lm and in transformers -------------------------------


def torch_twin(mlx_model, path):
    """The same llama as a transformers model: mlx-lm's llama uses HF's weight names."""
    args = mlx_model.args
    config = transformers.LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size, num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
        rms_norm_eps=args.rms_norm_eps, max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=args.tie_word_embeddings, rope_theta=args.rope_theta,
    )
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(mlx_model.parameters())))
    return load_causal_lm(path, device=torch.device(DEVICE), dtype=torch.float32)


@pytest.fixture(scope="module")
def tiny_target():
    from tiny_models import tiny_llama

    return tiny_llama(vocab=12, hidden=32, layers=4, seed=1, sharpness=3.0)


def test_tiny_twin_and_sliding_dflash_match(tiny_target, tmp_path):
    """A 2-layer drafter with a sliding-window layer, conditioned on the target's last layer
    (the final-norm path), on a tiny target: block logits agree with the MLX drafter's."""
    from test_dflash import make_drafter_dir

    twin = torch_twin(tiny_target, tmp_path / "twin")
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    with torch.inference_mode():
        ours = twin(torch.tensor([ids], device=DEVICE)).logits[0].cpu().numpy()
    assert np.abs(ours - np.array(tiny_target(mx.array([ids]))[0])).max() < 1e-5
    path = make_drafter_dir(tmp_path / "dflash", seed=3, target_layer_ids=[1, 3])
    theirs = load_mlx_dflash(path, model=tiny_target)
    mine = mlxspec.load_drafter("dflash", path, model=twin, tokenizer=None)
    assert mine._normed_slots == [1] and theirs.args.layer_types[0] == "sliding_attention"
    _check_block_parity(*_features_and_block_logits(tiny_target, twin, theirs, mine, ids, 5),
                        "tiny target + sliding DFlash")


def test_draft_vocab_drafts_match(tiny_target, tmp_path):
    """A checkpoint with a draft vocabulary drafts the same tokens, all from it, on both backends."""
    from test_dflash import make_drafter_dir, with_draft_vocab

    twin = torch_twin(tiny_target, tmp_path / "twin")
    path = with_draft_vocab(make_drafter_dir(tmp_path / "dflash", seed=3), [0, 2, 3, 5, 8, 10])
    theirs = load_mlx_dflash(path, model=tiny_target)
    mine = mlxspec.load_drafter("dflash", path, model=twin, tokenizer=None)
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    _features_and_block_logits(tiny_target, twin, theirs, mine, ids, 5)  # begin() both
    drafts = mine.propose(ids, 5, SamplingConfig()).tokens.tolist()
    assert drafts == theirs.propose(ids, 5, SamplingConfig()).tokens.tolist()
    assert set(drafts) <= {0, 2, 3, 5, 8, 10}



def test_truncated_dflash_drafter_refused_naming_the_file(tiny_target, tmp_path):
    """The torch drafter loader runs the same safetensors check as the MLX one."""
    from test_dflash import make_drafter_dir, truncate

    twin = torch_twin(tiny_target, tmp_path / "twin")
    path = make_drafter_dir(tmp_path / "dflash")
    weights = path / "model.safetensors"
    truncate(weights)
    with pytest.raises(ValueError, match=f"corrupted safetensors file {weights}: .*truncated"):
        mlxspec.load_drafter("dflash", path, model=twin, tokenizer=None)

# ---- Training on torch: the same run as on MLX ---------------------------------------------

TRAIN_PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 3], [5, 9, 11, 5], [3, 8, 1], [2, 4, 6, 8], [10, 1, 10]]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_torch_training_matches_mlx(tiny_target, tmp_path, batch_size):
    """`train_dflash(backend="torch")` is the MLX run in other tensor math: same data, anchors,
    init, schedule and reduced loss vocabulary give the same losses and checkpoint, with a
    sliding-window layer in the drafter; a torch run stopped and resumed equals an
    uninterrupted one. With several sequences a step, torch pads them into one pass (target and
    drafter) where MLX loops over them: the same losses still."""
    from mlxspec.backends.torch.dflash_training import TorchTraining
    from mlxspec.training import train_dflash

    twin = torch_twin(tiny_target, tmp_path / "twin")
    options = dict(layers=2, block_size=4, steps=5, anchors=4, max_new_tokens=10, heldout=1,
                   batch_size=batch_size,
                   eval_every=0, save_every=5, progress=False, seed=0, lr=3e-3, warmup=1,
                   loss_vocab=8, data_dir=tmp_path / "data",
                   drafter_overrides={"layer_types": ["sliding_attention", "full_attention"],
                                      "use_sliding_window": True, "sliding_window": 5})
    on_mlx = train_dflash(tiny_target, TRAIN_PROMPTS, tmp_path / "mlx", **options)
    on_torch = train_dflash(tiny_target, TRAIN_PROMPTS, tmp_path / "torch", backend="torch",
                            torch_training=TorchTraining(twin), **options)
    losses = np.array([[a, b] for (_, a), (_, b) in zip(on_mlx.losses, on_torch.losses)])
    assert len(losses) == 5 and np.abs(losses[:, 0] - losses[:, 1]).max() < 1e-4, losses
    mlx_w = mx.load(str(tmp_path / "mlx" / "model.safetensors"))
    torch_w = mx.load(str(tmp_path / "torch" / "model.safetensors"))
    assert set(mlx_w) == set(torch_w)
    assert max(float(mx.abs(mlx_w[k] - torch_w[k]).max()) for k in mlx_w) < 1e-4

    train_dflash(tiny_target, TRAIN_PROMPTS, tmp_path / "resumed", backend="torch",
                 torch_training=TorchTraining(twin), stop_after=2, **options)
    resumed = train_dflash(tiny_target, TRAIN_PROMPTS, tmp_path / "resumed", backend="torch",
                           torch_training=TorchTraining(twin), resume=True, **options)
    assert resumed.step == 5
    again = mx.load(str(tmp_path / "resumed" / "model.safetensors"))
    assert max(float(mx.abs(again[k] - torch_w[k]).max()) for k in torch_w) < 1e-6
    with pytest.raises(ValueError, match="resume it with that backend"):
        train_dflash(tiny_target, TRAIN_PROMPTS, tmp_path / "resumed", resume=True, **options)


def test_torch_run_resumed_with_more_layers(tiny_target, tmp_path):
    """Growing a torch run: the old layer keeps its AdamW moments, the new one starts its own,
    and the checkpoint is a two-layer drafter in the same format."""
    from mlxspec.backends.torch.dflash_training import TorchTraining
    from mlxspec.training import train_dflash

    twin = torch_twin(tiny_target, tmp_path / "twin")
    options = dict(block_size=4, steps=4, anchors=4, max_new_tokens=10, heldout=1, eval_every=0,
                   save_every=2, progress=False, seed=0, lr=3e-3, warmup=1, backend="torch",
                   torch_training=TorchTraining(twin))
    train_dflash(tiny_target, TRAIN_PROMPTS, tmp_path / "run", stop_after=2, **options)
    grown = train_dflash(tiny_target, TRAIN_PROMPTS, tmp_path / "run", resume=True, layers=2,
                         **options)
    assert grown.step == 4 and all(np.isfinite(l) for _, l in grown.losses)
    weights = mx.load(str(tmp_path / "run" / "model.safetensors"))
    assert float(mx.abs(weights["layers.1.mlp.down_proj.weight"]).max()) > 0
    moments = mx.load(str(tmp_path / "run" / "train_state" / "optimizer_torch.safetensors"))
    assert moments["layers.0.mlp.down_proj.weight.step"].item() == 4
    assert moments["layers.1.mlp.down_proj.weight.step"].item() == 2


def test_batched_torch_responses_equal_mlx_greedy(tiny_target, tmp_path):
    """Training data written by the torch twin in left-padded batches is the MLX target's own
    greedy answer, end token included."""
    from mlxspec.training.data import greedy_response, greedy_responses

    twin = torch_twin(tiny_target, tmp_path / "twin")
    eos = {3}
    batched = greedy_responses(twin, TRAIN_PROMPTS, 12, eos, batch_size=4)
    single = [greedy_response(tiny_target, p, 12, eos) for p in TRAIN_PROMPTS]
    assert batched == single and any(r and r[-1] == 3 for r in single)


# ---- Greedy parity on real prompts --------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt_caches(prompt_ids):
    """One KV cache per prompt and backend, kept across the drafter kinds: only the first kind
    prefills (DFlash, which needs the prompt's features, always does). Saves ~1/3 of CI time."""
    return {"mlx": [mlxspec.PromptCache() for _ in prompt_ids],
            "torch": [TorchPromptCache() for _ in prompt_ids]}


def _run(model, tokenizer, ids, drafter, num_draft, cache):
    responses = list(mlxspec.stream_generate(model, tokenizer, ids, MAX_TOKENS, drafter=drafter,
                                             num_draft=num_draft, adaptive=False,
                                             prompt_cache=cache))
    last = responses[-1]
    stats = (last.target_passes, last.drafted, last.accepted, round(last.tau, 9),
             last.drafted_per_position, last.accepted_per_position)
    return [r.token for r in responses], stats


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["none", "lookup", "draft", "dflash", "dflash+lookup"])
def test_greedy_tokens_and_stats_identical(smollm, torch_smollm, smollm_first_layers,
                                           smollm_random_dflash, prompt_ids, prompt_caches, kind):
    path = {"draft": smollm_first_layers, "dflash": smollm_random_dflash,
            "dflash+lookup": smollm_random_dflash}.get(kind)
    # Fixed K, kept small for CI time (the untrained drafters rarely hit): every step drafts,
    # so every step exercises verification, acceptance and the rollback of both caches.
    num_draft = {"draft": 2, "dflash": 2, "dflash+lookup": 2}.get(kind)
    sides = {}
    for name, (model, tokenizer) in (("mlx", smollm), ("torch", torch_smollm)):
        drafter = mlxspec.load_drafter(kind, path, model=model, tokenizer=tokenizer)
        sides[name] = [_run(model, tokenizer, ids, drafter, num_draft, cache)
                       for ids, cache in zip(prompt_ids, prompt_caches[name])]
    total_drafted = total_accepted = 0
    for i, ((tokens_m, stats_m), (tokens_t, stats_t)) in enumerate(zip(*sides.values())):
        assert tokens_t == tokens_m, f"prompt {i}: tokens differ"
        assert stats_t == stats_m, f"prompt {i}: stats differ (passes, drafted, accepted, tau, ...)"
        total_drafted += stats_m[1]
        total_accepted += stats_m[2]
    print(f"\n{kind}: {len(prompt_ids)} prompts identical; drafted {total_drafted}, "
          f"accepted {total_accepted}")
    if kind in ("lookup", "draft", "dflash+lookup"):
        assert total_accepted > 0, "no draft was ever accepted: the comparison proves little"


# ---- Sampled decoding follows the target's distribution (chi-squared) --------------------------


class FixedDrafter(Drafter):
    def propose(self, tokens, k, sampling):
        from test_sampling_exactness import VOCAB

        return Draft(tokens=[(tokens[-1] + 1 + i) % VOCAB for i in range(k)])


@pytest.fixture(scope="module")
def sampling_twins(tmp_path_factory):
    """test_sampling_exactness's tiny target and draft model, as transformers twins."""
    from test_sampling_exactness import VOCAB
    from tiny_models import tiny_llama

    root = tmp_path_factory.mktemp("twins")
    target = tiny_llama(vocab=VOCAB, seed=11, sharpness=2.5)
    draft = tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=12, sharpness=2.5)
    return target, torch_twin(target, root / "target"), torch_twin(draft, root / "draft")


def _torch_samples(model, drafter, sampling, samples, *, seed=1234, num_draft=2, length=None):
    from test_sampling_exactness import LENGTH, PROMPT

    torch.manual_seed(seed)
    counts, stats = Counter(), SpecStats()
    for _ in range(samples):
        target = TorchTarget(model, speculative=True)
        out = speculative_tokens(target, drafter, PROMPT, sampling=sampling,
                                 max_tokens=length or LENGTH, num_draft=num_draft, stats=stats)
        counts[tuple(t for t, _ in out)] += 1
    return counts, stats


@pytest.mark.slow  # χ²: thousands of sampled generations
@pytest.mark.parametrize("kind", ["fixed_one_hot", "draft_model"])
def test_sampled_output_follows_target_distribution(sampling_twins, kind):
    from test_sampling_exactness import SAMPLES, SAMPLING, chi_squared_pvalue, exact_distribution

    mlx_target, target, draft = sampling_twins
    exact = exact_distribution(mlx_target, SAMPLING)  # the MLX model's; same weights
    drafter = FixedDrafter() if kind == "fixed_one_hot" else TorchDraftModelDrafter(draft)
    counts, stats = _torch_samples(target, drafter, SAMPLING, SAMPLES)
    assert 0 < stats.accepted < stats.drafted  # both acceptance and rejection happened
    pvalue = chi_squared_pvalue(counts, exact)
    assert pvalue > 0.001, f"{kind}: p = {pvalue:.2g}"


def test_seeded_torch_runs_are_reproducible(sampling_twins):
    from test_sampling_exactness import SAMPLING

    _, target, draft = sampling_twins
    once = _torch_samples(target, TorchDraftModelDrafter(draft), SAMPLING, 3, seed=7, length=12)
    again = _torch_samples(target, TorchDraftModelDrafter(draft), SAMPLING, 3, seed=7, length=12)
    assert once[0] == again[0]


# ---- Chat cache, dispatch and bad input ---------------------------------------------------------


def test_torch_prompt_cache_across_turns(torch_smollm):
    model, tokenizer = torch_smollm
    cache, history = TorchPromptCache(), []
    for question in ["Name two colours.", "Which is warmer?"]:
        history.append({"role": "user", "content": question})
        prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        held = len(cache.tokens)
        reused = [r.token for r in mlxspec.stream_generate(model, tokenizer, prompt, 8,
                                                          drafter="lookup", prompt_cache=cache)]
        fresh = list(mlxspec.stream_generate(model, tokenizer, prompt, 8))
        assert reused == [r.token for r in fresh]
        if len(history) > 1:
            assert held > 20  # the first turn was not prefilled again
        assert cache.cache.get_seq_length() == len(cache.tokens)
        history.append({"role": "assistant", "content": "".join(r.text for r in fresh)})


def test_bad_backend_input(smollm, torch_smollm, smollm_first_layers):
    model, tokenizer = smollm
    tmodel, ttokenizer = torch_smollm
    with pytest.raises(ValueError, match="unknown backend 'jax'; choose from mlx, torch"):
        mlxspec.load(backend="jax")
    with pytest.raises(ValueError, match="torch backend only"):
        mlxspec.load(device="cpu")
    with pytest.raises(ValueError, match="backend='torch' but the model is a mlx model"):
        next(mlxspec.stream_generate(model, tokenizer, "Hi", 2, backend="torch"))
    with pytest.raises(ValueError, match="unknown backend"):
        next(mlxspec.stream_generate(model, tokenizer, "Hi", 2, backend="jax"))
    with pytest.raises(TypeError, match="TorchPromptCache"):
        next(mlxspec.stream_generate(tmodel, ttokenizer, "Hi", 2,
                                     prompt_cache=mlxspec.PromptCache()))
    # A drafter built for one backend, handed a target of the other.
    torch_draft = mlxspec.load_drafter("draft", smollm_first_layers, model=tmodel,
                                       tokenizer=ttokenizer)
    with pytest.raises(ValueError, match="built for the torch backend"):
        next(mlxspec.stream_generate(model, tokenizer, "Hi", 2, drafter=torch_draft))
    mlx_draft = DraftModelDrafter(model)
    with pytest.raises(TypeError, match="another backend"):
        list(mlxspec.stream_generate(tmodel, ttokenizer, "Hi there", 4, drafter=mlx_draft))
    # Ids outside the vocabulary, refused before the embedding is read (as on MLX).
    for bad_id in (999999, -1, 49152):
        with pytest.raises(ValueError, match=f"token id {bad_id} is outside the model's "
                                             "vocabulary of 49152 tokens"):
            mlxspec.generate(tmodel, ttokenizer, [1, bad_id], max_tokens=4)
    with pytest.raises(TypeError, match="max_tokens must be an integer"):
        mlxspec.generate(tmodel, ttokenizer, [1, 2], max_tokens=3.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without CUDA")
def test_cuda_requested_without_cuda_is_a_clear_error():
    from click.testing import CliRunner

    from mlxspec.cli.main import main

    with pytest.raises(ValueError, match="'cuda' requested but CUDA is not available"):
        mlxspec.load(backend="torch", device="cuda")
    result = CliRunner().invoke(main, ["generate", "-p", "Hi", "--backend", "torch",
                                       "--device", "cuda"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "Error: device 'cuda' requested but CUDA is not available" in result.stderr
    result = CliRunner().invoke(main, ["generate", "-p", "Hi", "--device", "cpu"])
    assert result.exit_code == 2 and "applies to --backend torch only" in result.stderr
    result = CliRunner().invoke(main, ["generate", "-p", "Hi", "--backend", "jax"])
    assert result.exit_code == 2 and "'jax' is not one of 'mlx', 'torch'" in result.stderr


def test_default_device_and_dtype():
    from mlxspec.backends.torch import resolve_device, resolve_dtype

    cuda = torch.cuda.is_available()
    assert resolve_device(None).type == ("cuda" if cuda else "cpu")
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    if cuda:
        assert resolve_dtype(None, torch.device("cuda")) in (torch.bfloat16, torch.float16)
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="unknown torch device 'tpu'"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        resolve_dtype("int8", torch.device("cpu"))


def test_cli_generate_and_bench_with_torch_backend(smollm_dir):
    from click.testing import CliRunner

    from mlxspec.cli.main import main

    result = CliRunner().invoke(main, ["generate", "-m", str(smollm_dir), "-p", "Count to five.",
                                       "-n", "6", "--drafter", "lookup", "-v",
                                       "--backend", "torch", "--device", DEVICE])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()
    assert f"torch: {torch.device(DEVICE)}" in result.stderr and "Drafter: lookup" in result.stderr
    result = CliRunner().invoke(main, ["bench", "--backend", "torch", "--mlx-lm"])
    assert result.exit_code == 2 and "mlx-lm runs on MLX only" in result.stderr


def test_torch_target_labels_equal_mlx(tiny_target, tmp_path):
    """The torch training twin reads the same teacher-forced target predictions as MLX."""
    from mlxspec.models.dflash import DFlashConfig, DFlashModel
    from mlxspec.backends.torch.dflash_training import TorchDFlashTraining
    from mlxspec.training.dflash_trainer import MLXDFlashTraining, _schedule, drafter_config_for

    twin = torch_twin(tiny_target, tmp_path / "twin")
    vocab = tiny_target.args.vocab_size
    args = DFlashConfig.from_dict(drafter_config_for(tiny_target, layers=1, block_size=4,
                                                     mask_token_id=vocab - 1))
    weights = dict(tree_flatten(DFlashModel(args).parameters()))
    options = dict(schedule=_schedule(1e-3, 1, 2), weight_decay=0.0, grad_clip=0.0, gamma=4.0,
                   loss_ids=None, inv_scale=None, labels="target")
    text = [int(t) for t in np.random.default_rng(5).integers(0, vocab, 24)]
    mlx_math = MLXDFlashTraining(tiny_target, args, weights, **options)
    torch_math = TorchDFlashTraining(twin, args, weights, **options)
    mlx_feats, mlx_labels = mlx_math.features(text)
    torch_feats, torch_labels = torch_math.features(text)
    mlx_labels, torch_labels = mlx_labels.tolist(), torch_labels.tolist()
    assert mlx_labels == torch_labels and mlx_labels[1:] != text[1:]
    assert np.abs(np.array(mlx_feats) - torch_feats.numpy()).max() < 1e-3
    # Batched with a shorter sequence (padded in the target pass), each keeps its own labels.
    short = text[5:14]
    batched = [labels.tolist() for _, labels in torch_math.features_batch([text, short])]
    assert batched == [mlx_labels, mlx_math.features(short)[1].tolist()]


def test_torch_padded_batch_is_the_sum_of_its_sequences(tiny_target, tmp_path):
    """One torch step over sequences of different lengths and anchor counts, padded into one
    target pass and one drafter pass, weighs exactly what each sequence alone does: padded
    positions and padded blocks carry nothing, and no sequence sees another's context."""
    from mlxspec.models.dflash import DFlashConfig, DFlashModel
    from mlxspec.backends.torch.dflash_training import TorchDFlashTraining
    from mlxspec.training.dflash_trainer import _schedule, drafter_config_for

    twin = torch_twin(tiny_target, tmp_path / "twin")
    vocab = tiny_target.args.vocab_size
    args = DFlashConfig.from_dict(drafter_config_for(tiny_target, layers=2, block_size=4,
                                                     mask_token_id=vocab - 1))
    weights = dict(tree_flatten(DFlashModel(args).parameters()))
    math = TorchDFlashTraining(twin, args, weights, schedule=_schedule(1e-3, 1, 2),
                               weight_decay=0.0, grad_clip=0.0, gamma=4.0, loss_ids=None,
                               inv_scale=None, labels="target")
    rng = np.random.default_rng(7)
    sequences = [[int(t) for t in rng.integers(0, vocab, n)] for n in (19, 7, 12)]
    anchors = [np.array([0, 3, 9, 15]), np.array([2]), np.array([1, 4, 10])]
    with torch.no_grad():
        together = math._batch_loss(list(zip(math.features_batch(sequences), sequences, anchors)))
        alone = [math._batch_loss([(math.features(s), s, a)]) for s, a in zip(sequences, anchors)]
    for part, whole in zip(zip(*alone), together):
        assert abs(float(sum(part)) - float(whole)) < 1e-4 * max(1.0, abs(float(whole)))
    assert int(together[2]) == sum(int(c) for _, _, c in alone)


def test_a_draft_model_window_masks_as_on_mlx(smollm, torch_smollm, smollm_first_layers,
                                              prompt_ids):
    """--drafter-window for a draft model on torch: a 4D mask transformers applies as given
    (the MLX drafter reads only the window's keys); a prompt's feed and a one-token step give
    the MLX drafter's logits, and differ from the same steps without the window."""
    (model, tokenizer), (tmodel, ttokenizer) = smollm, torch_smollm
    ids = prompt_ids[0][:40]
    logits = {}
    for window in (8, None):
        ours = mlxspec.load_drafter("draft", smollm_first_layers, model=tmodel,
                                    tokenizer=ttokenizer, window=window)
        theirs = mlxspec.load_drafter("draft", smollm_first_layers, model=model,
                                      tokenizer=tokenizer, window=window)
        steps = []
        for drafter in (ours, theirs):
            drafter.begin(ids)
            with torch.inference_mode():
                steps.append([drafter._step(drafter.xp.ids(feed)) for feed in (ids, [42])])
        for a, b in zip(*steps):
            assert np.abs(a.float().numpy() - np.array(b)).max() < 1e-3
        logits[window] = steps[1]
    assert not all(mx.allclose(a, b, atol=1e-2).item() for a, b in zip(*logits.values()))
