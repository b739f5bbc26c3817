"""DFlash in the shared loop, on tiny random targets and random drafters in the released format.

A random drafter drafts badly, which is the point: greedy output must still equal plain decoding,
sampled output must still follow the target's distribution, and the context cache must still be
exactly what the committed tokens' features give when built from scratch.
"""

import json
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from test_sampling_exactness import (
    LENGTH,
    PROMPT,
    SAMPLES,
    SAMPLING,
    VOCAB,
    chi_squared_pvalue,
    exact_distribution,
)
from tiny_models import tiny_llama

from mlxspec.converters import convert
from mlxspec.converters.dflash import convert_dflash, is_dflash_checkpoint
from mlxspec.drafters.dflash import DFlashDrafter, load_dflash_drafter
from mlxspec.engine import Drafter, SpecStats, Verdict, speculative_tokens
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.models.dflash import DFlashConfig, DFlashModel
from mlxspec.sampling import SamplingConfig
from mlxspec.backends.mlx.target_parts import head_rows

GREEDY = SamplingConfig()


def drafter_config(*, vocab=12, hidden=32, target_layers=4, **overrides) -> dict:
    """A released-format config.json (z-lab's keys), small enough for a test."""
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "vocab_size": vocab,
        "attention_bias": False,
        "layer_types": ["sliding_attention", "full_attention"],
        "use_sliding_window": True,
        "sliding_window": 4,
        "tie_word_embeddings": False,
        "block_size": 6,
        "num_target_layers": target_layers,
        "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": [1, target_layers - 2]},
    }
    for key in ("mask_token_id", "target_layer_ids"):
        if key in overrides:
            config["dflash_config"][key] = overrides.pop(key)
    config.update(overrides)
    return config


def random_weights(config: dict, seed: int = 0, *, own_vocab: bool = False) -> dict:
    args = DFlashConfig.from_dict(config)
    model = DFlashModel(args, own_embed=own_vocab, own_head=own_vocab)
    keys = mx.random.split(mx.random.key(seed), len(tree_flatten(model.parameters())))
    weights = {}
    for key, (name, p) in zip(keys, tree_flatten(model.parameters())):
        noise = mx.random.normal(p.shape, key=key)
        if name.endswith("norm.weight"):
            weights[name] = 1 + 0.1 * noise
        else:
            weights[name] = noise * p.shape[-1] ** -0.5
    return weights


def save_drafter(path, config: dict, weights: dict):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


def make_drafter_dir(path, seed=0, **config_options):
    config = drafter_config(**config_options)
    return save_drafter(path, config, random_weights(config, seed))


def run(model, drafter, prompt, *, max_tokens=24, k=5, sampling=GREEDY):
    stats = SpecStats()
    target = MLXTarget(model, capture_layers=drafter.capture_layers, speculative=True)
    out = speculative_tokens(
        target, drafter, prompt, sampling=sampling, max_tokens=max_tokens, num_draft=k,
        stats=stats,
    )
    return [t for t, _ in out], stats


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=12, hidden=32, layers=4, seed=1, sharpness=3.0)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return make_drafter_dir(tmp_path_factory.mktemp("dflash"), seed=3)


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7, 7], [5, 9, 11, 5, 9, 11, 5, 9, 2, 3, 4, 6], [3]]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("block_size,k", [(None, 5), (3, 5), (None, 2)])
def test_greedy_identity_and_tau_accounting(target, drafter_dir, prompt, block_size, k):
    plain, _ = run(target, Drafter(), prompt)
    drafter = load_dflash_drafter(drafter_dir, model=target, block_size=block_size)
    out, stats = run(target, drafter, prompt, k=k)
    assert out == plain
    assert stats.generated == len(out) == 24
    assert stats.accepted + stats.target_passes == stats.generated
    assert max(len(stats.drafted_per_position), 1) <= drafter.block_size - 1


def test_drafts_are_lazy_one_hot(target, drafter_dir):
    drafter = load_dflash_drafter(drafter_dir, model=target)
    features = MLXTarget(target, capture_layers=drafter.capture_layers).prefill([1, 2, 3, 4])
    drafter.begin([1, 2, 3, 4], features)
    draft = drafter.propose([1, 2, 3, 4], 9, GREEDY)
    assert isinstance(draft.tokens, mx.array) and draft.probs is None
    assert len(draft) == drafter.default_num_draft == 5  # capped by the block


def test_context_cache_equals_fresh_build(target, drafter_dir):
    drafter = load_dflash_drafter(drafter_dir, model=target)
    for p in PROMPTS[1:]:  # earlier sequences must leave no trace after begin()
        run(target, drafter, p, max_tokens=30)
    prompt = PROMPTS[0]
    out, stats = run(target, drafter, prompt, max_tokens=30)
    assert stats.accepted > 0  # some steps committed several positions at once
    committed = prompt + out
    assert drafter.context_length == len(committed) - 1
    drafter._rewind(len(committed) - 1)  # as the next proposal does: deferred features run

    fresh_features = MLXTarget(target, capture_layers=drafter.capture_layers).prefill(committed)
    fresh = drafter.model.make_cache()
    drafter.model.append_context(fresh_features, fresh)
    for ours, theirs in zip(drafter.cache, fresh):
        for a, b in zip(ours.keys_and_values(), theirs.keys_and_values()):
            assert a.shape == b.shape
            assert mx.allclose(a, b, atol=1e-4).item()


def test_plain_steps_features_join_the_context_at_the_next_draft_in_one_pass(target,
                                                                              drafter_dir):
    """Steps that draft nothing leave the drafter idle: their features are projected into the
    context when it next drafts, in one pass, and draft what projecting each at once drafts."""
    sequence = PROMPTS[2]
    drafter = load_dflash_drafter(drafter_dir, model=target)
    features = MLXTarget(target, capture_layers=drafter.capture_layers).prefill(sequence)
    passes = []
    append = drafter.model.append_context
    drafter.model.append_context = lambda f, cache: passes.append(f.shape[0]) or append(f, cache)
    drafter.begin(sequence[:4], features[:3])
    for i in range(4, len(sequence)):  # one plain step per token
        drafter.commit(sequence[: i + 1], Verdict([], 0, sequence[i], features=features[i - 1 : i]))
    assert passes == [3] and drafter.context_length == len(sequence) - 1  # nothing ran yet
    ours = drafter.block_logits(sequence, 4)
    assert passes == [3, len(sequence) - 4]
    fresh = load_dflash_drafter(drafter_dir, model=target)
    fresh.begin(sequence, features)
    assert mx.allclose(ours, fresh.block_logits(sequence, 4), atol=1e-4).item()


@pytest.mark.parametrize("block_size", [None, 3])
def test_rows_of_a_batch_draft_in_one_pass_as_each_alone(target, drafter_dir, block_size):
    """propose_together: forks at different context lengths (a one-token prompt with none at
    all; the sliding layer's window cut in some and not others) asking for different K draft
    in one pass what each drafts alone, and keep their own contexts."""
    drafter = load_dflash_drafter(drafter_dir, model=target, block_size=block_size)
    prompts = [PROMPTS[2], PROMPTS[3], PROMPTS[0], PROMPTS[1]]
    ks = [5, 2, 9, 1]
    forks, alone = [drafter.fork() for _ in prompts], [drafter.fork() for _ in prompts]
    assert len({f.together() for f in forks}) == 1 and forks[0].together() is not None
    for prompt, f, a in zip(prompts, forks, alone):
        features = MLXTarget(target, capture_layers=drafter.capture_layers).prefill(prompt)
        f.begin(prompt, features)
        a.begin(prompt, features)
    together = DFlashDrafter.propose_together(forks, prompts, ks, [GREEDY] * len(ks))
    for prompt, draft, k, a, f in zip(prompts, together, ks, alone, forks):
        want = a.propose(prompt, k, GREEDY)
        assert len(draft) == min(k, drafter.block_size - 1)
        assert draft.tokens.tolist() == want.tokens.tolist()
        assert f.context_length == len(prompt) - 1
    assert len(DFlashDrafter.propose_together(forks[:1], prompts[:1], [0], [GREEDY])[0]) == 0


def test_rolled_back_tokens_trim_the_context(target, drafter_dir):
    drafter = load_dflash_drafter(drafter_dir, model=target)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    features = MLXTarget(target, capture_layers=drafter.capture_layers).prefill(tokens)
    drafter.begin(tokens, features)
    before = drafter.block_logits(tokens, 3)
    mx.eval(before)
    drafter.block_logits(tokens[:4], 3)  # a caller rolled back three tokens
    assert drafter.context_length == 3
    with pytest.raises(ValueError, match="commit"):
        drafter.block_logits(tokens, 3)  # features of positions 3..5 are gone now
    drafter.commit(tokens, Verdict([5, 6], 2, 7, features=features[3:]))
    assert drafter.context_length == 6
    assert mx.allclose(drafter.block_logits(tokens, 3), before, atol=1e-5).item()


def test_last_target_layer_is_conditioned_after_the_final_norm(target, tmp_path):
    """transformers' hidden_states[-1], which z-lab's reference uses, is after the final norm."""
    drafter = load_dflash_drafter(make_drafter_dir(tmp_path, target_layer_ids=[1, 3]), model=target)
    prompt = [1, 2, 3, 4, 5]
    features = MLXTarget(target, capture_layers=(1, 3)).prefill(prompt)
    drafter.begin(prompt, features)
    normed = mx.concatenate([features[:, :32], target.model.norm(features[:, 32:])], axis=-1)
    want = drafter.model.make_cache()
    drafter.model.append_context(normed, want)
    for ours, theirs in zip(drafter.cache, want):
        assert mx.allclose(ours.keys_and_values()[0], theirs.keys_and_values()[0]).item()
    assert run(target, drafter, prompt)[0] == run(target, Drafter(), prompt)[0]


@pytest.fixture(scope="module")
def small_vocab_target():
    return tiny_llama(vocab=VOCAB, seed=11, sharpness=2.5)


@pytest.mark.slow  # χ²: thousands of sampled generations
@pytest.mark.parametrize("draft_vocab", [None, [0, 1, 3]])
def test_sampled_output_follows_target_distribution(small_vocab_target, tmp_path, draft_vocab):
    """Chi-squared against the exact distribution, as tests/test_sampling_exactness.py does;
    also with drafts from part of the vocabulary."""
    model = small_vocab_target
    path = make_drafter_dir(tmp_path, seed=5, vocab=VOCAB, target_layers=2, target_layer_ids=[0, 1])
    if draft_vocab is not None:
        with_draft_vocab(path, draft_vocab)
    drafter = load_dflash_drafter(path, model=model)
    mx.random.seed(1234)
    counts, stats = Counter(), SpecStats()
    for _ in range(SAMPLES):
        target = MLXTarget(model, capture_layers=drafter.capture_layers, speculative=True)
        out = speculative_tokens(
            target, drafter, PROMPT, sampling=SAMPLING, max_tokens=LENGTH, num_draft=2,
            stats=stats,
        )
        counts[tuple(t for t, _ in out)] += 1
    assert 0 < stats.accepted < stats.drafted  # both acceptance and rejection happened
    pvalue = chi_squared_pvalue(counts, exact_distribution(model, SAMPLING))
    assert pvalue > 0.001, f"p = {pvalue:.2g}"


DRAFT_VOCAB = [0, 2, 3, 5, 8, 10]


def with_draft_vocab(path, token_ids=DRAFT_VOCAB):
    (path / "draft_vocab.json").write_text(json.dumps({"token_ids": token_ids}))
    return path


def test_draft_vocab_drafts_its_best_rows_and_output_is_unchanged(target, tmp_path):
    """With draft_vocab.json each draft is the best of those tokens by the full head's logits,
    greedy output stays the plain output, and draft_vocab=False ignores the file."""
    path = with_draft_vocab(make_drafter_dir(tmp_path, seed=3))
    sub = load_dflash_drafter(path, model=target)
    full = load_dflash_drafter(path, model=target, draft_vocab=False)
    assert full.draft_ids is None and sub.draft_ids.tolist() == DRAFT_VOCAB
    ids, outside = mx.array(DRAFT_VOCAB), 0
    for prompt in PROMPTS[:3]:
        features = MLXTarget(target, capture_layers=sub.capture_layers).prefill(prompt)
        sub.begin(prompt, features)
        full.begin(prompt, features)
        logits = full.block_logits(prompt, 5)
        outside += sum(t not in DRAFT_VOCAB for t in mx.argmax(logits, axis=-1).tolist())
        best_rows = ids[mx.argmax(logits[:, ids], axis=-1)]
        assert sub.propose(prompt, 5, GREEDY).tokens.tolist() == best_rows.tolist()
    assert outside > 0  # the full vocabulary would have drafted other tokens
    for prompt in PROMPTS:
        assert run(target, sub, prompt)[0] == run(target, Drafter(), prompt)[0]


@pytest.mark.parametrize("kind", ["linear", "linear with bias", "tied embedding",
                                  "quantized embedding", "quantized linear with bias"])
def test_head_rows_compute_the_heads_logits_for_those_tokens(kind):
    mx.random.seed(0)
    if kind.startswith("linear"):
        head = nn.Linear(64, 40, bias="bias" in kind)
    elif kind == "tied embedding":
        head = nn.Embedding(40, 64).as_linear
    elif kind == "quantized embedding":
        head = nn.QuantizedEmbedding.from_embedding(nn.Embedding(40, 64), 32, 4).as_linear
    else:
        head = nn.QuantizedLinear.from_linear(nn.Linear(64, 40), 32, 4)
    ids = mx.array([1, 4, 5, 17, 39])
    hidden = mx.random.normal((3, 64))
    assert mx.allclose(head_rows(head, ids)(hidden), head(hidden)[:, ids], atol=1e-5)


@pytest.mark.parametrize(
    "content,words",
    [
        ('{"ids": [1, 2]}', "is not a draft vocabulary"),
        ("[1, 2]", "is not a draft vocabulary"),
        ("not json", r"is not valid JSON \(line 1 column 1: Expecting value\)"),
        ('{"token_ids": []}', "non-empty list of integers"),
        ('{"token_ids": [1, 2.0]}', "non-empty list of integers"),
        ('{"token_ids": [1, 12]}', "outside the vocabulary of 12"),
        ('{"token_ids": [3, 1, 3]}', "repeats"),
    ],
)
def test_bad_draft_vocab_refused(target, tmp_path, content, words):
    path = make_drafter_dir(tmp_path)
    (path / "draft_vocab.json").write_text(content)
    with pytest.raises(ValueError, match=words):
        load_dflash_drafter(path, model=target)
    assert load_dflash_drafter(path, model=target, draft_vocab=False).draft_ids is None


def test_target_without_features_refused(target, drafter_dir):
    drafter = load_dflash_drafter(drafter_dir, model=target)
    no_features = MLXTarget(target, speculative=True)
    with pytest.raises(ValueError, match="capture_layers"):
        list(speculative_tokens(no_features, drafter, [1, 2, 3], sampling=GREEDY, max_tokens=4,
                                num_draft=2, stats=SpecStats()))


@pytest.mark.parametrize("block_size", [1, 0, 7])
def test_block_size_out_of_range_refused(target, drafter_dir, block_size):
    with pytest.raises(ValueError, match=rf"between 2 and the checkpoint's 6, got {block_size}"):
        load_dflash_drafter(drafter_dir, model=target, block_size=block_size)


def test_lower_block_size_accepted(target, drafter_dir):
    drafter = load_dflash_drafter(drafter_dir, model=target, block_size=3)
    assert drafter.block_size == 3 and drafter.default_num_draft == 2
    assert drafter.name == "dflash" and drafter.capture_layers == (1, 2)


@pytest.mark.parametrize(
    "options,words",
    [
        ({"hidden": 48}, ["hidden size", "drafter 48", "target 32"]),
        ({"vocab": 13}, ["vocab size", "drafter 13", "target 12"]),
        ({"target_layers": 6, "target_layer_ids": [1, 2]},
         ["number of target layers", "num_target_layers 6", "target has 4"]),
        ({"target_layer_ids": [1, 4]}, ["target_layer_ids [4]", "target's 4 layers"]),
        ({"mask_token_id": 12}, ["mask_token_id", "drafter 12", "vocab of 12"]),
    ],
)
def test_target_mismatch_refused_naming_both_sides(target, tmp_path, options, words):
    path = make_drafter_dir(tmp_path, **options)
    with pytest.raises(ValueError) as err:
        load_dflash_drafter(path, model=target)
    for word in words:
        assert word in str(err.value)


def test_weight_problems_named(target, tmp_path):
    config = drafter_config()
    weights = random_weights(config)
    del weights["layers.1.self_attn.k_norm.weight"]
    weights["layers.0.mlp.up_proj.weight"] = mx.zeros((3, 32))
    weights["layers.0.self_attn.rotary_emb.inv_freq"] = mx.zeros((4,))
    with pytest.raises(ValueError) as err:
        load_dflash_drafter(save_drafter(tmp_path, config, weights), model=target)
    message = str(err.value)
    assert "missing weights: layers.1.self_attn.k_norm.weight" in message
    assert "layers.0.mlp.up_proj.weight has shape (3, 32), config.json implies (64, 32)" in message
    assert "unexpected weights: layers.0.self_attn.rotary_emb.inv_freq" in message


def test_checkpoint_vocab_weights_are_used(target, tmp_path):
    config = drafter_config()
    path = save_drafter(tmp_path, config, random_weights(config, own_vocab=True))
    drafter = load_dflash_drafter(path, model=target)
    assert drafter.embed_tokens is drafter.model.embed_tokens
    assert drafter.lm_head is drafter.model.lm_head
    out, _ = run(target, drafter, [1, 2, 3])
    assert out == run(target, Drafter(), [1, 2, 3])[0]


def test_tied_target_head(tmp_path):
    mx.random.seed(4)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=32, num_hidden_layers=4, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=12,
        max_position_embeddings=256, tie_word_embeddings=True,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    drafter = load_dflash_drafter(make_drafter_dir(tmp_path), model=model)
    assert drafter.lm_head == model.model.embed_tokens.as_linear
    assert run(model, drafter, [1, 2, 3])[0] == run(model, Drafter(), [1, 2, 3])[0]


def test_convert_casts_validates_and_writes_atomically(target, drafter_dir, tmp_path):
    out = convert_dflash(drafter_dir, tmp_path / "converted", dtype="float16")
    assert is_dflash_checkpoint(out) and not is_dflash_checkpoint(tmp_path)
    assert json.loads((out / "config.json").read_text())["dflash_config"]["mask_token_id"] == 11
    assert all(w.dtype == mx.float16 for w in mx.load(str(out / "model.safetensors")).values())
    drafter = load_dflash_drafter(out, model=target)
    assert isinstance(drafter, DFlashDrafter) and drafter.model.dtype == mx.float16
    with pytest.raises(FileExistsError):
        convert_dflash(drafter_dir, out)
    convert_dflash(drafter_dir, out, overwrite=True)
    assert mx.load(str(out / "model.safetensors"))["fc.weight"].dtype == mx.float32

    config = drafter_config()
    weights = random_weights(config)
    del weights["norm.weight"]
    broken = save_drafter(tmp_path / "broken", config, weights)
    with pytest.raises(ValueError, match="missing weights: norm.weight"):
        convert_dflash(broken, tmp_path / "never")
    assert not (tmp_path / "never").exists()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="not a DFlash drafter"):
        convert_dflash(broken, tmp_path / "never")


def test_convert_keeps_the_draft_vocab(target, tmp_path):
    source = with_draft_vocab(make_drafter_dir(tmp_path / "source"), [5, 0, 2])
    out = convert_dflash(source, tmp_path / "converted")
    assert load_dflash_drafter(out, model=target).draft_ids.tolist() == [0, 2, 5]
    (source / "draft_vocab.json").write_text('{"token_ids": [99]}')
    with pytest.raises(ValueError, match="outside the vocabulary"):
        convert_dflash(source, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_uncached_repo_id_offline_is_a_clear_error(target, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE"):
        convert_dflash("z-lab/Qwen3-8B-DFlash-b16", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE"):
        load_dflash_drafter("z-lab/Qwen3-8B-DFlash-b16", model=target)
    assert not (tmp_path / "out").exists()


def truncate(file):
    """Keep the first half of `file`, as an interrupted download or copy leaves it."""
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def test_truncated_weights_refused_naming_the_file(target, tmp_path):
    path = make_drafter_dir(tmp_path / "drafter")
    truncate(path / "model.safetensors")
    expected = (f"corrupted safetensors file {path / 'model.safetensors'}: size "
                f"{(path / 'model.safetensors').stat().st_size} bytes does not match its header "
                "(truncated or corrupted); download or convert it again")
    for call in (lambda: load_dflash_drafter(path, model=target),
                 lambda: convert(path, tmp_path / "out")):
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == expected
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "content,problem",
    [
        ('{\n"architectures": ["DFlashDraftModel"],\n}',
         "is not valid JSON (line 3 column 1: Expecting property name enclosed in double quotes)"),
        ('["DFlashDraftModel"]', "holds a JSON list, not an object ({...})"),
    ],
    ids=["not-json", "not-an-object"],
)
def test_corrupt_config_json_refused_naming_the_file(target, tmp_path, content, problem):
    path = make_drafter_dir(tmp_path / "drafter")
    (path / "config.json").write_text(content)
    expected = f"{path / 'config.json'} {problem}: fix or replace the file"
    for call in (lambda: load_dflash_drafter(path, model=target),
                 lambda: convert(path, tmp_path / "out"),
                 lambda: convert_dflash(path, tmp_path / "out")):
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == expected
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("budget", [1, 6, 20])
def test_ddtree_drafts_are_lossless(target, drafter_dir, prompt, budget):
    """DDTree: each block's slots' best tokens grown into a tree of `budget` nodes; the tree
    is verified in one pass and the output is plain decoding's."""
    plain, _ = run(target, Drafter(), prompt)
    drafter = load_dflash_drafter(drafter_dir, model=target, tree_budget=budget, tree_width=3)
    assert drafter.max_draft == drafter.default_num_draft == budget
    out, stats = run(target, drafter, prompt, k=budget)
    assert out == plain
    assert stats.drafted > 0 and stats.chain_fallback_steps == 0


@pytest.mark.parametrize("options", [dict(tree_budget=0), dict(tree_budget=2.5),
                                     dict(tree_budget=4, tree_width=0)])
def test_bad_tree_options_refused(target, drafter_dir, options):
    with pytest.raises(ValueError, match="tree"):
        load_dflash_drafter(drafter_dir, model=target, **options)


def test_a_drafter_window_narrows_every_layer_and_changes_no_output(target, drafter_dir):
    """--drafter-window: the full-attention layer gets a window, the sliding one keeps the
    narrower of the two; drafts then read less context, and the output stays plain's. A window
    wider than any context drafts exactly what no window drafts."""
    windows = lambda d: [layer.self_attn.window for layer in d.model.layers]  # noqa: E731
    assert windows(load_dflash_drafter(drafter_dir, model=target)) == [4, None]
    assert windows(load_dflash_drafter(drafter_dir, model=target, window=6)) == [4, 6]
    narrow = load_dflash_drafter(drafter_dir, model=target, window=2)
    assert windows(narrow) == [2, 2]
    for prompt in PROMPTS:
        plain, _ = run(target, Drafter(), prompt)
        assert run(target, narrow, prompt)[0] == plain
        wide, wide_stats = run(target, load_dflash_drafter(drafter_dir, model=target,
                                                           window=1000), prompt)
        free, free_stats = run(target, load_dflash_drafter(drafter_dir, model=target), prompt)
        assert wide == free == plain
        assert (wide_stats.drafted_per_position, wide_stats.accepted_per_position) == (
            free_stats.drafted_per_position, free_stats.accepted_per_position)
    with pytest.raises(ValueError, match="drafter window must be an integer >= 2, got 1"):
        load_dflash_drafter(drafter_dir, model=target, window=1)
