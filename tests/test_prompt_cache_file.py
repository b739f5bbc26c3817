"""Prompt caches in files (--prompt-cache-file, PromptCache.save/load): a loaded cache continues
exactly as the in-memory one would, and another model's file, a truncated or a corrupted one is
refused in one line before it is used."""

import re

import mlx.core as mx
import pytest
from test_api_hardening import tiny_tokenizer
from tiny_models import tiny_llama, tiny_qwen3_next

import mlxspec
from mlxspec.backends.mlx.prompt_cache_file import check_file

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 3, 4]


def tokens_of(model, prompt, cache=None, drafter=None, max_tokens=10):
    tokenizer = tiny_tokenizer(model.args.vocab_size)
    return [r.token for r in mlxspec.stream_generate(
        model, tokenizer, prompt, max_tokens=max_tokens, prompt_cache=cache, drafter=drafter)]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=16, hidden=32, layers=2, seed=3, sharpness=3.0)


@pytest.fixture
def saved(model, tmp_path):
    cache = mlxspec.PromptCache()
    reply = tokens_of(model, PROMPT, cache)
    path = tmp_path / "agent.safetensors"
    cache.save(path)
    return path, cache, PROMPT + reply


@pytest.mark.parametrize("drafter", [None, "lookup", "suffix"])
def test_a_loaded_cache_continues_as_the_kept_one(model, saved, drafter):
    """The next turn (the conversation so far + new tokens) from the file: only the new tokens
    are prefilled, and the reply is the one the cache kept in memory gives, and plain's."""
    path, kept, conversation = saved
    loaded = mlxspec.PromptCache.load(path, model)
    assert loaded.tokens == kept.tokens and len(loaded.tokens) >= len(PROMPT)
    for a, b in zip(loaded.cache, kept.cache):
        assert a.offset == b.offset
        assert (a.keys[..., : a.offset, :] == b.keys[..., : b.offset, :]).all()
    turn = conversation + [5, 9, 2]
    assert loaded.shared(turn) == len(loaded.tokens)  # all it holds is reused
    fresh = tokens_of(model, turn, drafter=drafter)
    assert tokens_of(model, turn, loaded, drafter) == fresh
    assert tokens_of(model, turn, kept, drafter) == fresh


def test_a_hybrid_target_s_recurrent_state_round_trips(tmp_path):
    model = tiny_qwen3_next(vocab=16, seed=2)
    cache = mlxspec.PromptCache()
    reply = tokens_of(model, PROMPT, cache)
    cache.save(tmp_path / "hybrid.safetensors")
    loaded = mlxspec.PromptCache.load(tmp_path / "hybrid.safetensors", model)
    turn = PROMPT + reply + [7, 1]
    assert tokens_of(model, turn, loaded) == tokens_of(model, turn)


def test_another_model_s_file_is_refused(saved):
    path, _, _ = saved
    other = tiny_llama(vocab=16, hidden=32, layers=2, seed=4, sharpness=3.0)
    with pytest.raises(ValueError, match="holds the prompt cache of another model"):
        mlxspec.PromptCache.load(path, other)
    wider = tiny_llama(vocab=16, hidden=64, layers=2, seed=3)
    with pytest.raises(ValueError, match="another model"):
        mlxspec.PromptCache.load(path, wider)


def test_truncated_corrupted_or_foreign_files_are_refused_in_one_line(model, saved, tmp_path):
    path, _, _ = saved
    data = path.read_bytes()
    cases = {
        "truncated": (data[:-100], "not a usable prompt cache file: size"),
        "cut-header": (data[:6], "shorter than a safetensors header"),
        "flipped": (data[:-40] + bytes([data[-40] ^ 0xFF]) + data[-39:],
                    "is corrupted (its arrays do not match their checksum)"),
    }
    for name, (content, words) in cases.items():
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=re.escape(words)) as err:
            mlxspec.PromptCache.load(bad, model)
        assert "\n" not in str(err.value)
    import mlx.core as mx

    weights = tmp_path / "weights.safetensors"
    mx.save_safetensors(str(weights), {"w": mx.zeros((2, 2))})
    with pytest.raises(ValueError, match="is not an mlxspec prompt cache file"):
        mlxspec.PromptCache.load(weights, model)
    with pytest.raises(ValueError, match="no prompt cache file"):
        check_file(tmp_path / "missing.safetensors")


def test_saving_is_whole_or_nothing(model, saved, tmp_path):
    path, kept, _ = saved
    with pytest.raises(ValueError, match="holds nothing yet"):
        mlxspec.PromptCache().save(tmp_path / "empty.safetensors")
    before = path.read_bytes()
    kept.save(path)  # over an existing file: replaced whole
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["agent.safetensors"]


# ---- The CLI ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dirs(smollm_dir, tmp_path_factory):
    from test_cli import tiny_llama as tiny_llama_dir

    root = tmp_path_factory.mktemp("models")
    return [tiny_llama_dir(root / name, smollm_dir, 49152) for name in ("a", "b")]


def test_cli_generate_reads_and_writes_the_file(model_dirs, tmp_path):
    from test_cli import assert_clean_error, invoke, ok

    path = tmp_path / "agent.safetensors"
    args = ["generate", "--model", str(model_dirs[0]), "--prompt", "Tools: search, open, edit.",
            "--max-tokens", "8"]
    plain = ok(invoke(*args)).stdout
    for drafter in ("none", "suffix"):
        assert ok(invoke(*args, "--drafter", drafter, "--prompt-cache-file", str(path))).stdout \
            == plain
        first = check_file(path)
        assert first["format"] == "mlxspec.prompt_cache"
    held = len(mlxspec.PromptCache.load(path, mlxspec.load(model_dirs[0])[0]).tokens)
    assert held > 8  # the prompt and the reply

    r = invoke("generate", "--model", str(model_dirs[1]), "--prompt", "hi", "--prompt-cache-file",
               str(path))
    assert_clean_error(r, "holds the prompt cache of another model")
    path.write_bytes(path.read_bytes()[:-64])
    r = invoke(*args, "--prompt-cache-file", str(path))
    assert_clean_error(r, "--prompt-cache-file", "not a usable prompt cache file")
    r = invoke(*args, "--prompt-cache-file", str(tmp_path / "nowhere" / "x.safetensors"))
    assert_clean_error(r, "does not exist")


def test_cli_chat_keeps_its_cache_across_sessions(model_dirs, tmp_path):
    from test_cli import ok, invoke

    path = tmp_path / "chat.safetensors"
    args = ["chat", "--model", str(model_dirs[0]), "--max-tokens", "6", "--prompt-cache-file",
            str(path)]
    first = ok(invoke(*args, input="hello\n/quit\n"))
    held = mlxspec.PromptCache.load(path, mlxspec.load(model_dirs[0])[0]).tokens
    again = ok(invoke(*args, input="hello\n/quit\n"))
    assert again.stdout == first.stdout
    assert mlxspec.PromptCache.load(path, mlxspec.load(model_dirs[0])[0]).tokens == held


@pytest.mark.parametrize("max_batch", [1, 4])
def test_a_server_starts_from_the_file_and_writes_it_when_it_stops(model, tmp_path, max_batch):
    """make_server(prompt_cache_file=...): the kept cache of the last request is written at
    stop; a new server reads it, and the same conversation continued is prefilled only past it,
    with the same reply as without the file. Another model's file stops the start."""
    from test_server import Running
    from test_server_batching import ask

    from mlxspec.server import make_server

    tokenizer = tiny_tokenizer(16)
    path = tmp_path / "server.safetensors"
    body = {"prompt": " ".join(f"t{t}" for t in PROMPT), "max_tokens": 6, "temperature": 0}
    replies = []
    for _ in range(2):
        running = Running(make_server(model, tokenizer, model_id="tiny", max_batch=max_batch,
                                      prompt_cache_file=path))
        try:
            replies.append(ask(running, body))
        finally:
            running.stop()
        assert path.exists()
    first, second = replies
    assert second["text"] == first["text"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        first["usage"]["prompt_tokens"] - 1
    other = tiny_llama(vocab=16, hidden=32, layers=2, seed=9)
    with pytest.raises(ValueError, match="another model"):
        make_server(other, tokenizer, model_id="tiny", max_batch=max_batch,
                    prompt_cache_file=path)


def test_features_of_other_layers_are_not_reused(tmp_path):
    """A cache (in memory or from a file) whose features one EAGLE-3 drafter left is not a start
    for another reading other target layers (the same sizes, other values): that row prefills
    afresh, and the features kept after it are its layers' own."""
    from test_eagle3 import make_drafter_dir

    from mlxspec.backends.mlx.target import MLXTarget
    from mlxspec.drafters.eagle3 import load_eagle3_drafter

    model = tiny_llama(vocab=12, hidden=32, layers=4, seed=1, sharpness=3.0)
    first, second = (load_eagle3_drafter(make_drafter_dir(
        tmp_path / str(ids), vocab=12, draft_ids=list(range(12)), seed=3, ids=ids), model=model)
        for ids in ((1, 2, 3), (2, 3, 4)))
    assert first.capture_layers != second.capture_layers
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    cache = mlxspec.PromptCache()
    reply = tokens_of(model, prompt, cache, first)
    assert cache.feature_layers == first.capture_layers and cache.features is not None
    cache.save(tmp_path / "first.safetensors")
    turn = prompt + reply + [7, 1]
    assert cache.shared(turn, first.capture_layers) == len(prompt) - 1
    assert cache.shared(turn, second.capture_layers) == 0
    for kept in (cache, mlxspec.PromptCache.load(tmp_path / "first.safetensors", model)):
        assert kept.feature_layers == first.capture_layers
        assert tokens_of(model, turn, kept, second) == tokens_of(model, turn)
        fresh = MLXTarget(model, capture_layers=second.capture_layers).prefill(turn)
        assert kept.feature_layers == second.capture_layers
        assert mx.allclose(kept.features, fresh, atol=1e-5)
