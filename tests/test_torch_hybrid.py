"""Hybrid-attention targets (Gated DeltaNet + attention: Qwen3-Next, Qwen3.5) on the torch backend.

Tiny random models are built with mlx-lm's own classes (tiny_models) and saved in the Hugging
Face checkpoint layout, the inverse of mlx-lm's `sanitize`: HF names (`model.language_model.*`
for Qwen3.5), depthwise conv weights as (C, 1, K), and the RMSNorm weights HF stores as an
offset from 1 (its norms multiply by 1 + w). transformers loads that directory with
AutoModelForCausalLM, which gives Qwen3NextForCausalLM and, for the multimodal qwen3_5 layout,
its text-only Qwen3_5ForCausalLM (the vision tower is not built). The norm weights are randomised
first so the mapping is checked, not just ones.

The torch target rolls a rejected draft back by restoring the linear-attention layers' states
from a copy taken before the pass, cropping the attention layers and running the kept tokens
again. Checked: logits against the MLX model on the same weights; greedy identity with one wrong
draft planted at every position (and with lookup); every layer's state after rollback against a
fresh prefill; MLX and torch speculative greedy output through the API, and one CLI run.
On the CPU transformers runs its reference torch code for the delta rule and the convolution
(flash-linear-attention and causal-conv1d are not installed), which is deterministic. Set
MLXSPEC_TORCH_DEVICE=cuda to run the torch side on a GPU (float32, as test_torch_backend).
"""

import json
import os
import shutil

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten, tree_unflatten
from test_rollback_property import N, PROMPTS, PlantedDrafter, check_every_planting
from tiny_models import HYBRID_SIZES, tiny_qwen3_5, tiny_qwen3_next

torch = pytest.importorskip("torch", reason="needs torch (pip install .[reference])")
transformers = pytest.importorskip("transformers", reason="the torch backend needs transformers")

import mlxspec  # noqa: E402
from mlxspec.cli.main import main  # noqa: E402
from mlxspec.engine import SpecStats, speculative_tokens  # noqa: E402
from mlxspec.sampling import SamplingConfig  # noqa: E402
from mlxspec.backends.torch import TorchPromptCache, TorchTarget  # noqa: E402
from mlxspec.backends.torch.target import make_cache, recurrent_layers  # noqa: E402

DEVICE = os.environ.get("MLXSPEC_TORCH_DEVICE", "cpu")
VOCAB = 49152  # SmolLM2's tokenizer, for the API and CLI runs
PROMPT = "one two three one two three one two three one two"
# Where HF's Qwen3-Next / Qwen3.5 norms hold w for a scale of 1 + w (mlx-lm's hold the scale).
OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                "model.norm.weight", ".q_norm.weight", ".k_norm.weight")


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread(one_torch_thread):
    """torch on one thread while this module runs (conftest.one_torch_thread)."""


def randomised_norms(model, seed: int):
    """Every norm weight (mlx-lm initialises them to ones) moved off 1, so a wrong offset shows."""
    mx.random.seed(seed)
    norms = [(k, v + 0.3 * mx.random.normal(v.shape)) for k, v in tree_flatten(model.parameters())
             if k.endswith("norm.weight")]
    model.update(tree_unflatten(norms))
    mx.eval(model.parameters())
    return model


def favouring(model, token_ids: list[int]):
    """The LM head scaled to favour a few words (the prompt's and two more): a random model repeats
    itself then, enough for lookup drafts to be accepted, and still picks other words at times."""
    name, head = next((k, v) for k, v in tree_flatten(model.parameters())
                      if k.endswith("lm_head.weight"))
    scale = mx.full((head.shape[0], 1), 0.05)
    scale[mx.array(token_ids)] = 3.0
    model.update(tree_unflatten([(name, head * scale)]))
    mx.eval(model.parameters())
    return model


def hf_weights(model) -> dict:
    """mlx-lm parameters under their Hugging Face names and layouts (inverse of `sanitize`)."""
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if name.startswith("language_model.model."):  # Qwen3.5's multimodal wrapper
            name = "model.language_model." + name[len("language_model.model."):]
        elif name.startswith("language_model."):
            name = name[len("language_model."):]
        if name.endswith("conv1d.weight"):
            value = value.moveaxis(2, 1)  # (C, K, 1) -> (C, 1, K)
        if name.endswith(OFFSET_NORMS):
            value = value - 1.0
        weights[name] = value
    return weights


def hf_config(model) -> dict:
    if model.args.model_type == "qwen3_next":
        args = model.args
        return dict(model_type="qwen3_next", vocab_size=args.vocab_size, num_experts=0,
                    rope_theta=args.rope_theta, partial_rotary_factor=args.partial_rotary_factor,
                    tie_word_embeddings=False, **HYBRID_SIZES)
    text = model.language_model.args
    # transformers' Qwen3.5 rotates by (text, height, width) positions, one section each, the
    # sections summing to half the rotary dims; text positions are the same in all three, so
    # one section holding them all is mlx-lm's plain RoPE.
    rope = dict(rope_type="default", rope_theta=text.rope_theta,
                partial_rotary_factor=text.partial_rotary_factor,
                mrope_section=[int(text.head_dim * text.partial_rotary_factor) // 2, 0, 0])
    return dict(model_type="qwen3_5", tie_word_embeddings=False,
                text_config=dict(model_type="qwen3_5_text", vocab_size=text.vocab_size,
                                 tie_word_embeddings=False, rope_parameters=rope, **HYBRID_SIZES))


def save_hf_checkpoint(model, path, tokenizer_dir):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(model)))
    mx.save_safetensors(str(path / "model.safetensors"), hf_weights(model))
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, path / f.name)
    return path


BUILDERS = {"qwen3_next": tiny_qwen3_next, "qwen3_5": tiny_qwen3_5}


@pytest.fixture(scope="module", params=list(BUILDERS))
def hybrid(request, smollm_dir, tmp_path_factory):
    """(MLX model, its HF-layout directory, the transformers model and tokenizer loaded from it)."""
    from mlx_lm.utils import load_tokenizer

    kind = request.param
    words = sorted(set(load_tokenizer(smollm_dir).encode(PROMPT + " four five")))
    model = favouring(randomised_norms(BUILDERS[kind](vocab=VOCAB, seed=5), seed=6), words)
    path = save_hf_checkpoint(model, tmp_path_factory.mktemp(kind), smollm_dir)
    twin, tokenizer = mlxspec.load(path, backend="torch", device=DEVICE, torch_dtype="float32")
    return model, path, twin, tokenizer


def torch_greedy(model, prompt: list[int], n: int = N) -> list[int]:
    """Greedy decoding with no cache at all (the whole sequence each step): outside the loop."""
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids], device=DEVICE)).logits
            out.append(int(logits[0, -1].argmax()))
            ids.append(out[-1])
    return out


def test_loads_as_the_text_only_causal_lm_with_a_hybrid_cache(hybrid):
    model, _, twin, _ = hybrid
    want = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM"}
    assert type(twin).__name__ == want[model.args.model_type]
    cache = make_cache(twin)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["LinearAttentionLayer", "DynamicLayer"] * 2  # as transformers' generate
    assert len(recurrent_layers(cache)) == 2


def test_logits_match_mlx_on_the_same_weights(hybrid):
    model, path, twin, _ = hybrid
    ids = [int(t) for t in np.random.default_rng(0).integers(0, VOCAB, 80)]
    theirs = np.array(model(mx.array([ids])))[0]
    with torch.inference_mode():
        ours = twin(input_ids=torch.tensor([ids], device=DEVICE)).logits[0].cpu().numpy()
    diff = np.abs(ours - theirs)
    print(f"\n{model.args.model_type}: max |diff| {diff.max():.1e} (max |logit| "
          f"{np.abs(theirs).max():.1f})")
    assert diff.max() < 1e-4
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    if model.args.model_type == "qwen3_5":
        # mlx-lm reads the same directory back to the same model (its sanitize undoes ours);
        # it leaves a dense Qwen3-Next checkpoint unsanitized (it only converts MoE ones).
        from mlx_lm.utils import load_model

        again, _ = load_model(path)
        assert np.array_equal(np.array(again(mx.array([ids])))[0], theirs)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_one_wrong_draft_at_every_position_is_plain_greedy(hybrid, prompt):
    """K in 1, 3, 5, the wrong draft at each position or none, passes queued ahead or one at a
    time: output and stats are plain greedy decoding's (test_rollback_property's check)."""
    _, _, twin, _ = hybrid
    check_every_planting(lambda: TorchTarget(twin, speculative=True), prompt,
                         torch_greedy(twin, prompt), overlaps=(True, False))


def test_state_after_rollback_equals_a_fresh_prefill(hybrid):
    """After a generation full of rejected drafts, every layer (convolution window, recurrent
    state, attention keys and values) holds what a fresh prefill of the committed tokens builds;
    a second identical run holds exactly the same tensors (the CPU path is deterministic)."""
    _, _, twin, _ = hybrid
    prompt = [1, 2, 3, 4, 5]
    full = prompt + torch_greedy(twin, prompt)

    def run():
        target = TorchTarget(twin, speculative=True)
        stats = SpecStats()
        out = [t for t, _ in speculative_tokens(target, PlantedDrafter(full, 1), prompt,
                                                sampling=SamplingConfig(), max_tokens=N,
                                                num_draft=4, stats=stats)]
        assert stats.drafted > stats.accepted > 0
        return target.cache, prompt + out

    ours, committed = run()
    assert committed == full
    fresh = make_cache(twin)
    with torch.inference_mode():
        twin(input_ids=torch.tensor([committed[:-1]], device=DEVICE), cache=fresh, use_cache=True)
    assert ours.get_seq_length() == fresh.get_seq_length() == len(committed) - 1
    again, _ = run()
    for mine, theirs, repeat in zip(ours.layers, fresh.layers, again.layers):
        if hasattr(theirs, "recurrent_states"):
            pairs = [(mine.conv_states[0], theirs.conv_states[0], repeat.conv_states[0]),
                     (mine.recurrent_states[0], theirs.recurrent_states[0],
                      repeat.recurrent_states[0])]
        else:
            pairs = [(mine.keys, theirs.keys, repeat.keys),
                     (mine.values, theirs.values, repeat.values)]
        for a, b, c in pairs:
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
            assert torch.equal(a, c) or DEVICE != "cpu"


def _api_run(model, tokenizer, drafter):
    responses = list(mlxspec.stream_generate(model, tokenizer, PROMPT, 24, drafter=drafter,
                                             num_draft=3, adaptive=False))
    last = responses[-1]
    stats = (last.target_passes, last.drafted, last.accepted)
    return [r.token for r in responses], stats, "".join(r.text for r in responses)


def test_torch_and_mlx_speculative_output_equal_through_the_api_and_cli(hybrid):
    """Lookup on the torch backend is plain torch decoding, and MLX's lookup run on the same
    weights: same tokens, same passes, drafts and acceptances. The CLI prints the same text."""
    model, path, twin, tokenizer = hybrid
    plain, _, _ = _api_run(twin, tokenizer, None)
    ours, ours_stats, text = _api_run(twin, tokenizer, "lookup")
    theirs, theirs_stats, _ = _api_run(model, tokenizer, "lookup")
    assert ours == plain == theirs
    assert ours_stats == theirs_stats and ours_stats[2] > 0, ours_stats  # some drafts accepted

    result = CliRunner().invoke(main, ["generate", "--no-chat-template", "-n", "24", "-p", PROMPT,
                                       "--model", str(path), "--backend", "torch",
                                       "--device", DEVICE, "--drafter", "lookup",
                                       "--num-draft", "3", "--fixed-k", "--verbose"])
    assert result.exit_code == 0, result.output
    assert result.stdout == text + "\n"
    assert f"drafted: {ours_stats[1]}, accepted: {ours_stats[2]}" in result.stderr


def test_chat_turns_keep_the_recurrent_state(hybrid):
    """A TorchPromptCache on a hybrid keeps the state for a turn that extends what it holds (it
    prefills only the new tokens) and rebuilds it for one that does not (a recurrent state cannot
    be cut back to a shared prefix); replies are the ones without a cache either way."""
    _, _, twin, tokenizer = hybrid
    cache = TorchPromptCache()
    prompt = tokenizer.encode(PROMPT)
    for _ in range(2):
        kept = [r.token for r in mlxspec.stream_generate(twin, tokenizer, prompt, 8,
                                                         drafter="lookup", prompt_cache=cache)]
        fresh = [r.token for r in mlxspec.stream_generate(twin, tokenizer, prompt, 8)]
        assert kept == fresh
        held = len(cache.tokens)
        assert held >= len(prompt) and cache.cache.get_seq_length() == held
        prompt = prompt + kept + tokenizer.encode(" three one two")
        assert cache.take(twin, prompt) is cache.cache and len(cache.tokens) == held
    before = cache.cache
    assert cache.take(twin, tokenizer.encode(PROMPT + " four")) is not before
    list(mlxspec.stream_generate(twin, tokenizer, PROMPT, 8, prompt_cache=cache))
    cache.remember(cache.tokens[:-1])  # it holds more than the reply (drafts past a stop token)
    assert cache.cache is None and cache.tokens == []


def test_dflash_on_a_hybrid_torch_target_is_lossless(hybrid, tmp_path):
    """A random DFlash drafter reading a linear-attention layer (0), an attention layer (1) and
    the last layer: the features of a pass whose drafts were rolled back stay the committed
    positions' own, and greedy output is plain decoding's."""
    from test_dflash import drafter_config, random_weights, save_drafter

    _, _, twin, tokenizer = hybrid
    config = drafter_config(vocab=VOCAB, hidden=32, target_layers=4, num_hidden_layers=1,
                            layer_types=["full_attention"], block_size=4, mask_token_id=0,
                            target_layer_ids=[0, 1, 3])
    path = save_drafter(tmp_path / "dflash", config, random_weights(config))
    drafter = mlxspec.load_drafter("dflash", path, model=twin, tokenizer=tokenizer)
    plain, _, _ = _api_run(twin, tokenizer, None)
    ours, (_, drafted, _), _ = _api_run(twin, tokenizer, drafter)
    assert ours == plain and drafted > 0


def test_a_cache_layer_that_cannot_roll_back_is_named(hybrid):
    """A layer kind that neither crops nor restores (here a stand-in that also holds keys and
    values beside its recurrent state) is refused by name before any pass runs."""
    from transformers.cache_utils import LinearAttentionAndFullAttentionLayer

    _, _, twin, _ = hybrid
    cache = make_cache(twin)
    cache.layers[0] = LinearAttentionAndFullAttentionLayer()
    with pytest.raises(ValueError, match="DynamicCache has LinearAttentionAndFullAttentionLayer "
                                         "layers, which cannot. Use --drafter none"):
        TorchTarget(twin, speculative=True, cache=cache)
    assert TorchTarget(twin, cache=cache).rollback_room() == 0  # plain decoding still runs
