"""Every drafter kind the registry offers (a new one is covered by its entry) with the two caches
that change what the target keeps: quantized keys and values (kv_bits) and a prompt cache
written to a file and loaded back. Either way the output is plain decoding's with the same
cache, through the API. The planted-rejection and rollback tests of each are in test_kv_bits
and test_prompt_cache_file; here is the breadth."""

import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from mtp_models import write_qwen3_5
from test_api_hardening import tiny_tokenizer

import mlxspec
from mlxspec.drafters import registry

BITS = dict(kv_bits=4, kv_group_size=32)
PROMPT = [17, 4, 9, 23, 4, 9, 23, 4, 9, 31, 2, 17, 4, 9]
TOKENS = 10


@pytest.fixture(scope="module")
def targets(smollm_dir, tmp_path_factory):
    """A 2-layer llama (head size 32, so 32-wide groups quantize it; two layers, so LayerSkip
    has a layer to exit after) for every kind but MTP, which drafts from the modules a Qwen3.5
    ships; both with SmolLM2's tokenizer."""
    from test_cli import tiny_llama

    root = tmp_path_factory.mktemp("targets")
    llama = tiny_llama(root / "llama", smollm_dir, 49152, layers=2)
    qwen = write_qwen3_5(root / "qwen3_5", seed=3, tokenizer_dir=smollm_dir, head_dim=32)
    return {"llama": (llama, mlxspec.load(llama)), "qwen3_5": (qwen, mlxspec.load(qwen))}


@pytest.fixture(scope="module")
def checkpoints(targets, tmp_path_factory):
    """A checkpoint that fits the llama for each model drafter that reads one."""
    from test_dflash import drafter_config, random_weights, save_drafter
    from test_dflash2 import dflash2_config, dflash2_weights
    from test_dspark import make_dir as dspark_dir
    from test_eagle3 import make_drafter_dir
    from test_medusa import write_heads

    root = tmp_path_factory.mktemp("drafters")
    config = drafter_config(vocab=49152, hidden=64, target_layers=2, num_hidden_layers=1,
                            layer_types=["full_attention"], target_layer_ids=[0, 1],
                            mask_token_id=0)
    config2 = dflash2_config(vocab=49152, hidden=64, target_layers=2, num_hidden_layers=1,
                             layer_types=["full_attention"], target_layer_ids=[0, 1],
                             mask_token_id=0)
    return {
        "draft": targets["llama"][0],
        "dflash": save_drafter(root / "dflash", config, random_weights(config)),
        "dflash2": save_drafter(root / "dflash2", config2, dflash2_weights(config2)),
        "dspark": dspark_dir(root / "dspark", "lfm", vocab=49152, hidden=64, target_layers=2,
                             target_layer_ids=[0, 1], mask_token_id=0),
        "eagle3": make_drafter_dir(root / "eagle3", vocab=49152, draft_ids=list(range(64)),
                                   hidden=64, target_hidden=64, ids=(1, 2, 2)),
        "medusa": write_heads(root / "medusa", hidden=64, vocab=49152),
    }


def target_for(name, targets):
    """The first target the kind runs on (each says in one line what it lacks on the others)."""
    for _, (model, tokenizer) in targets.values():
        if not registry.why_unavailable(name, model):
            return model, tokenizer
    raise AssertionError(f"no test target runs {name}")


def build(name, model, tokenizer, checkpoints):
    kind = registry.drafter_kinds()[name]
    path = checkpoints.get(kind.model_name) if kind.checkpoint else None
    return mlxspec.load_drafter(name, path, model=model, tokenizer=tokenizer)


def generate(model, prompt, drafter=None, **options):
    return [r.token for r in mlxspec.stream_generate(
        model, tiny_tokenizer(49152), prompt, TOKENS, drafter=drafter, num_draft=3, **options)]


@pytest.mark.parametrize("name", list(registry.drafter_kinds()))
def test_every_drafter_with_kv_bits_is_the_quantized_target(name, targets, checkpoints):
    model, tokenizer = target_for(name, targets)
    kept = mlxspec.PromptCache()
    plain = generate(model, PROMPT, **BITS)
    drafter = build(name, model, tokenizer, checkpoints)
    assert generate(model, PROMPT, drafter, prompt_cache=kept, **BITS) == plain
    kinds = {type(c) for c in kept.cache}  # attention quantized, recurrent state as it was
    assert QuantizedKVCache in kinds and KVCache not in kinds


@pytest.mark.parametrize("name", list(registry.drafter_kinds()))
def test_every_drafter_continues_a_cache_loaded_from_a_file(name, targets, checkpoints,
                                                             tmp_path):
    """Turn one fills a cache kept in memory, which is written to a file; turn two (the
    conversation so far + new tokens) from the loaded file drafts as it would from scratch."""
    model, tokenizer = target_for(name, targets)
    kept = mlxspec.PromptCache()
    reply = generate(model, PROMPT, build(name, model, tokenizer, checkpoints), prompt_cache=kept)
    assert reply == generate(model, PROMPT)
    path = tmp_path / "agent.safetensors"
    kept.save(path)
    loaded = mlxspec.PromptCache.load(path, model)
    turn = PROMPT + reply + [5, 9, 2]
    # A drafter reading target features keeps the prompt (but its pending last token) with
    # them, a hybrid's recurrent states rewound to it; any other keeps the reply too.
    held = len(PROMPT) - 1 if build(name, model, tokenizer, checkpoints).capture_layers \
        else len(PROMPT) + len(reply) - 1
    assert loaded.shared(turn) == len(loaded.tokens) == held
    drafter = build(name, model, tokenizer, checkpoints)
    assert generate(model, turn, drafter, prompt_cache=loaded) == generate(model, turn)


@pytest.mark.parametrize("name", ["mtp", "dflash", "suffix"])
def test_a_batch_keeps_each_row_s_cache_for_its_next_turn(name, targets, checkpoints):
    """batch_generate with a prompt cache per row: each cache holds what the lone generation's
    would (MTP on the hybrid Qwen3.5: its recurrent states rewound to the prompt), and the
    next turn from it is plain's."""
    model, tokenizer = target_for(name, targets)
    prompts = [PROMPT, PROMPT[3:] + [8, 8]]
    caches = [mlxspec.PromptCache() for _ in prompts]
    drafter = build(name, model, tokenizer, checkpoints)
    replies = mlxspec.batch_generate(model, tiny_tokenizer(49152), prompts, TOKENS,
                                     drafter=drafter, num_draft=3, prompt_caches=caches)
    for prompt, reply, cache in zip(prompts, replies.token_ids, caches):
        assert reply == generate(model, prompt)
        held = len(prompt) - 1 if drafter.capture_layers else len(prompt) + len(reply) - 1
        assert len(cache.tokens) == held
        turn = prompt + reply + [5, 9]
        assert generate(model, turn, build(name, model, tokenizer, checkpoints),
                        prompt_cache=cache) == generate(model, turn)
