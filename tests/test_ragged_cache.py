"""RaggedKVCache: a batch's rows rolled back by different amounts without moving any key.

Each row must attend to exactly what one sequence's KVCache holding its tokens attends to,
through every per-row rollback, join (`extend`), leave (`filter`) and copy-out (`extract`),
and no rollback may realign the buffer (mlx-lm's dynamic_roll: a gather of the whole cache).
"""

import random

import mlx.core as mx
import mlx_lm.models.cache as cache_module
import pytest
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache

from mlxspec.backends.mlx.batch_target import copy_cache
from mlxspec.backends.mlx.ragged_cache import RaggedKVCache, RaggedQuantizedKVCache

HEADS, DIM = 2, 4


def positions(n: int, seed: int, dim: int = DIM) -> tuple[mx.array, mx.array]:
    """n positions of random keys and values, (1, HEADS, n, dim) each."""
    key = mx.random.key(seed)
    keys, values = mx.random.normal((2, 1, HEADS, n, dim), key=key)
    return keys, values


def batch_of(lengths: list[int], seed: int) -> tuple[RaggedKVCache, list[KVCache]]:
    """A batch of rows holding `lengths` positions (left-padded, as mlx-lm merges them) and
    the same rows as single caches."""
    singles = []
    for i, n in enumerate(lengths):
        single = KVCache()
        if n:
            single.update_and_fetch(*positions(n, seed + i))
        singles.append(single)
    return RaggedKVCache.from_batch(BatchKVCache.merge(singles)), singles


def attend(cache, queries: mx.array, keys: mx.array, values: mx.array, mask) -> mx.array:
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.5, mask=mask)


def step(batch: RaggedKVCache, singles: list[KVCache], n: int, seed: int) -> None:
    """n new positions per row through the batch and through each single cache: each row's
    attention outputs must match."""
    new = [positions(n, seed + 100 + i) for i in range(len(singles))]
    queries = [positions(n, seed + 200 + i)[0] for i in range(len(singles))]
    mask = batch.make_mask(n)
    keys, values = batch.update_and_fetch(mx.concatenate([k for k, _ in new]),
                                          mx.concatenate([v for _, v in new]))
    got = attend(batch, mx.concatenate(queries), keys, values, mask)
    for i, (single, (k, v), q) in enumerate(zip(singles, new, queries)):
        sk, sv = single.update_and_fetch(k, v)
        want = attend(single, q, sk, sv, "causal" if n > 1 else None)
        assert mx.allclose(got[i : i + 1], want, atol=1e-5).item(), i


def roll_back(batch: RaggedKVCache, singles: list[KVCache], drops: list[int]) -> None:
    batch.drop(drops)
    for single, d in zip(singles, drops):
        single.trim(d)


@pytest.fixture(autouse=True)
def no_realignment(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a ragged rollback moved the cache")

    monkeypatch.setattr(cache_module, "dynamic_roll", refuse)


def test_rows_rolled_back_apart_attend_as_single_caches():
    rnd = random.Random(0)
    batch, singles = batch_of([5, 9, 1, 0], seed=1)
    for s in range(12):
        width = rnd.choice([1, 2, 4])
        step(batch, singles, width, seed=10 * s)
        roll_back(batch, singles, [rnd.randrange(width) for _ in singles])
        assert [c.offset for c in singles] == \
            [e - p for e, p in zip(batch.ends, batch.left_padding.tolist())]
        assert batch.offset.tolist() == [c.offset for c in singles]
    assert not batch.aligned
    for i, single in enumerate(singles):
        out = batch.extract(i)
        assert out.offset == single.offset
        assert mx.array_equal(out.keys, single.keys[..., : single.offset, :]).item()


def test_rows_join_and_leave_a_ragged_batch():
    rnd = random.Random(1)
    batch, singles = batch_of([4, 7], seed=2)
    step(batch, singles, 3, seed=3)
    roll_back(batch, singles, [0, 2])
    joining, new = batch_of([2, 11, 0], seed=4)  # mlx-lm's own cache, as prefill leaves it
    batch.extend(BatchKVCache.merge(new))
    singles += new
    for s in range(4):
        step(batch, singles, 2, seed=20 + s)
        roll_back(batch, singles, [rnd.randrange(2) for _ in singles])
    keep = [4, 1, 3]
    batch.filter(mx.array(keep))
    singles = [singles[i] for i in keep]
    assert min(batch.left_padding.tolist()) == 0  # the padding every row carried is cut
    for s in range(3):
        step(batch, singles, 3, seed=40 + s)
        roll_back(batch, singles, [rnd.randrange(3) for _ in singles])


def test_aligned_rows_are_mlx_lm_s_own_cache():
    """While every row ends at one index, writes and masks are BatchKVCache's, to the bit."""
    batch, _ = batch_of([3, 6], seed=5)
    plain = BatchKVCache.merge([batch.extract(0), batch.extract(1)])
    k, v = positions(2, 6)
    k, v = mx.concatenate([k, k]), mx.concatenate([v, v])
    assert mx.array_equal(batch.make_mask(2), plain.make_mask(2)).item()
    for a, b in zip(batch.update_and_fetch(k, v), plain.update_and_fetch(k, v)):
        assert mx.array_equal(a, b).item()
    assert batch.ends == [plain._idx] * 2


def test_a_row_cannot_drop_more_than_it_holds():
    batch, _ = batch_of([2, 3], seed=7)
    with pytest.raises(ValueError, match="cannot drop"):
        batch.drop([0, 9])


# ---- quantized rows (--kv-bits in a batch) ----

QDIM, GROUP, BITS = 64, 32, 4


def quantized_batch_of(lengths: list[int], seed: int):
    """Rows prefilled at full precision and then quantized, in a batch and one by one (as a
    single sequence's target quantizes its cache once the prompt is in it)."""
    plain = []
    for i, n in enumerate(lengths):
        single = KVCache()
        if n:
            single.update_and_fetch(*positions(n, seed + i, QDIM))
        plain.append(single)
    batch = RaggedQuantizedKVCache.from_batch(BatchKVCache.merge(plain), GROUP, BITS)
    singles = [c.to_quantized(group_size=GROUP, bits=BITS) if c.keys is not None
               else QuantizedKVCache(GROUP, BITS) for c in plain]
    return batch, singles


def quantized_step(batch, singles, n: int, seed: int) -> None:
    new = [positions(n, seed + 100 + i, QDIM) for i in range(len(singles))]
    queries = [positions(n, seed + 200 + i, QDIM)[0] for i in range(len(singles))]
    attend_q = lambda q, k, v, mask: quantized_scaled_dot_product_attention(  # noqa: E731
        q, k, v, scale=0.5, mask=mask, group_size=GROUP, bits=BITS)
    mask = batch.make_mask(n)
    keys, values = batch.update_and_fetch(mx.concatenate([k for k, _ in new]),
                                          mx.concatenate([v for _, v in new]))
    got = attend_q(mx.concatenate(queries), keys, values, mask)
    for i, (single, (k, v), q) in enumerate(zip(singles, new, queries)):
        sk, sv = single.update_and_fetch(k, v)
        want = attend_q(q, sk, sv, "causal" if n > 1 else None)
        assert mx.allclose(got[i : i + 1], want, atol=1e-5).item(), i


def test_quantized_rows_rolled_back_apart_attend_as_single_quantized_caches():
    """Each row of a RaggedQuantizedKVCache attends as mlx-lm's QuantizedKVCache holding its
    positions does, through steps aligned and not, per-row rollbacks, joins and leaves, and
    copies out as that cache, part for part."""
    rnd = random.Random(2)
    batch, singles = quantized_batch_of([5, 9, 0], seed=1)
    assert batch.bits == BITS and batch.group_size == GROUP  # mlx-lm's quantized attention
    quantized_step(batch, singles, 1, seed=0)  # aligned
    for s in range(8):
        width = rnd.choice([1, 2, 4])
        quantized_step(batch, singles, width, seed=10 * s + 1)
        drops = [rnd.randrange(width) for _ in singles]
        roll_back(batch, singles, drops)
    _, new = quantized_batch_of([3, 12], seed=50)
    joining = [KVCache() for _ in new]  # mlx-lm's own batch cache of fresh prefills
    for i, c in enumerate(joining):
        c.update_and_fetch(*positions([3, 12][i], 50 + i, QDIM))
    batch.extend(BatchKVCache.merge(joining))
    singles += new
    keep = [3, 0, 4, 2]
    batch.filter(mx.array(keep))
    singles = [singles[i] for i in keep]
    for s in range(4):
        quantized_step(batch, singles, 2, seed=90 + s)
        roll_back(batch, singles, [rnd.randrange(2) for _ in singles])
    assert not batch.aligned
    for i, single in enumerate(singles):
        out = batch.extract(i)
        assert isinstance(out, QuantizedKVCache) and out.offset == single.offset
        for ours, theirs in zip(out.keys + out.values, single.keys + single.values):
            assert mx.array_equal(ours, theirs[..., : single.offset, :]).item()


def test_a_kept_quantized_cache_joins_as_it_is_and_stays_as_it_was():
    """A kept quantized cache (a conversation's last turn) becomes a batch row part for part,
    through a copy: what the row writes next leaves the kept cache as it was."""
    kept = KVCache()
    kept.update_and_fetch(*positions(7, 3, QDIM))
    kept = kept.to_quantized(group_size=GROUP, bits=BITS)
    before = [mx.array(a) for a in kept.keys + kept.values]
    batch = RaggedQuantizedKVCache.from_single(copy_cache(kept))
    other, _ = quantized_batch_of([4], seed=9)
    batch.extend(other)
    batch.update_and_fetch(*[mx.concatenate([x, x]) for x in positions(3, 4, QDIM)])
    batch.drop([1, 0])
    row = batch.extract(0)
    assert row.offset == 9
    for ours, theirs in zip(row.keys + row.values, kept.keys + kept.values):
        assert mx.array_equal(ours[..., :7, :], theirs[..., :7, :]).item()
    assert kept.offset == 7 and all(mx.array_equal(a, b).item()
                                    for a, b in zip(before, kept.keys + kept.values))
