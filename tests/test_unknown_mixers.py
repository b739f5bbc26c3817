"""Recurrent mixers found per decoder layer rather than by name (target.state_mixers): the child
module of a layer holding a recurrent state whose call takes a `cache`. gear's `local_mixer`,
kimi_linear's and kimi_k3's delta attention under `self_attn`, bailing_hybrid's and
bailing_moe_v3's linear attention under `attention` are found, so rows that draft share a batch
of these models and a lone sequence replays only those mixers when it rolls back.
"""

import mlx.core as mx
import pytest
from architectures import build, window
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache
from test_api_hardening import tiny_tokenizer
from test_architectures import assert_same, repeat

import mlxspec
from mlxspec.backends.mlx.hidden_states import decoder_layers, replay, stops_rows
from mlxspec.backends.mlx.target import MLXTarget, WholeModel, model_setting, state_mixers
from mlxspec.backends.mlx.window_cache import make_cache
from mlxspec.rollback import is_recurrent

MAX_TOKENS = 24
# Each model's attribute holding its recurrent layers' mixer.
MIXERS = {"gear": "local_mixer", "kimi_linear": "self_attn", "kimi_k3": "self_attn",
          "bailing_hybrid": "attention", "bailing_moe_v3": "attention"}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer(65)


def alone(model, prompt):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS)]


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_each_recurrent_layers_mixer_is_found(name):
    model = build(name)
    layers = decoder_layers(model)
    recurrent = [layer for layer, c in zip(layers, make_cache(model)) if is_recurrent(c)]
    found = state_mixers(model)
    assert [id(layer) for layer, _ in found] == [id(layer) for layer in recurrent]
    assert {attribute for _, attribute in found} == {MIXERS[name]}


def _states(cache, row=None):
    return [a if row is None else a[row : row + 1] for a in cache.cache if a is not None]


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_each_mixer_stops_a_padded_row_at_its_length(name):
    """A right-padded pass whose cache holds each row's length leaves each row's state as that
    row run alone to its length: the mixer may replay a batch in one call (stops_rows)."""
    model = build(name)
    layer, attribute = state_mixers(model)[0]
    mixer = getattr(layer, attribute)
    assert stops_rows(mixer)
    size = len(next(c for c in make_cache(model) if is_recurrent(c)).cache)
    hidden = model_setting(model, "hidden_size")
    prefix, x = mx.random.normal((2, 3, hidden), key=mx.random.key(1)), \
        mx.random.normal((2, 6, hidden), key=mx.random.key(2))
    lengths = [6, 2]
    batch = ArraysCache(size)
    replay(mixer, prefix, batch)
    batch.prepare(lengths=lengths)
    replay(mixer, x, batch, batch.make_mask(x.shape[1]))
    batch.finalize()
    for i, n in enumerate(lengths):
        row = ArraysCache(size)
        replay(mixer, prefix[i : i + 1], row)
        replay(mixer, x[i : i + 1, :n], row)
        for got, want in zip(_states(batch, i), _states(row), strict=True):
            assert mx.allclose(got, want, atol=1e-5).item(), f"row {i}"


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_rows_that_draft_share_a_batch_and_equal_each_alone(name, tokenizer):
    model = build(name)
    lookup = repeat([5, 6, 7, 8, 9, 10, 11, 12], 19)
    past = repeat([21, 4, 33, 17, 40, 2], 3 * (window(model) or 8) + 5)
    prompts = [[1, 2, 3, 4, 5], lookup, past]
    batch = mlxspec.batch_generate(model, tokenizer, prompts, MAX_TOKENS, drafter="lookup")
    for i, (prompt, row) in enumerate(zip(prompts, batch.token_ids)):
        assert_same(model, prompt, list(row), alone(model, prompt), f"batch row {i}")
    drafted = sum(s.drafted for s in batch.stats)
    assert drafted > sum(s.accepted for s in batch.stats)  # rows rolled back rejected drafts


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_a_lone_sequence_replays_only_the_mixers(name, tokenizer, monkeypatch):
    def whole_model(*args):
        raise AssertionError("rolled back by running the whole model again")

    monkeypatch.setattr(WholeModel, "rerun", whole_model)
    model = build(name)
    prompt = repeat([5, 6, 7, 8, 9, 10, 11, 12], 19)
    out = list(mlxspec.stream_generate(model, tokenizer, prompt, MAX_TOKENS, drafter="lookup",
                                       num_draft=3, adaptive=False))
    assert out[-1].drafted > out[-1].accepted
    assert_same(model, prompt, [r.token for r in out], alone(model, prompt), "alone")


def test_a_mixer_handed_keys_and_values_is_not_replayed():
    """baichuan_m1's attention takes its layer's CacheList (a state beside keys and values):
    replaying it would write its keys and values again, so a lone sequence runs the whole model
    over its kept positions instead (the batch rolls it back by its last position)."""
    target = MLXTarget(build("baichuan_m1"), speculative=True)
    assert target._mixers
    target.prefill(list(range(1, 12)))
    target._chain_forward(mx.array([3, 4, 5, 6], dtype=mx.int32), 3)
    assert target._last_pass[2] is None
