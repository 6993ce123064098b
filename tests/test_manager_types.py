"""kvspec manager types: params, leaves, TextContext, counts, metrics (spec/types.md §2)."""

import numpy as np
import pytest

from kvspec import (
    BlockCount,
    ByteCount,
    CompletedTransfer,
    KVCacheMetrics,
    KVCacheParams,
    KVTransfer,
    LeafKind,
    LeafSpec,
    NullConnector,
    PrefixCacheHits,
    TextContext,
    KVLoadRefused,
)


def test_params_leaves_default_and_immutable():
    p = KVCacheParams(16, 2, 4, 8)
    assert list(p.leaves()) == ["full"] and p.leaves()["full"].kind is LeafKind.FULL
    assert p.page_shape == (2, 2, 16, 4, 8)
    assert p.page_bytes() == 2 * 2 * 16 * 4 * 8 * 2
    with pytest.raises(AttributeError):
        p.page_size = 3
    assert p == KVCacheParams(16, 2, 4, 8) and p != KVCacheParams(16, 2, 4, 8, hash_seed=1)
    leaves = {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(64), "rec": LeafSpec.recurrent((2, 4, 4))}
    q = KVCacheParams(16, 2, 4, 8, leaves=leaves)
    assert q.leaves() == leaves and q.page_bytes("rec") == 2 * 4 * 4 * 4


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(page_size=0), ValueError, "KVCacheParams: page_size=0"),
        (dict(dtype="int8"), ValueError, "dtype='int8'"),
        (dict(data_parallel_degree=0), ValueError, "data_parallel_degree=0"),
        (dict(hash_algo="md5"), ValueError, "hash_algo='md5'"),
        (dict(host_offload_bytes=-1), ValueError, "host_offload_bytes=-1"),
        (dict(disk_offload_bytes=10), ValueError, "needs disk_offload_dir"),
        (dict(leaves={}), ValueError, "leaves="),
        (dict(leaves={"r": LeafSpec.recurrent((2,))}), ValueError, "no full or sliding"),
        (dict(leaves={"f": "full"}), TypeError, r"leaves\['f'\]"),
    ],
)
def test_params_errors(kwargs, exc, match):
    base = dict(page_size=4, num_layers=1, kv_heads=1, head_dim=4)
    base.update(kwargs)
    with pytest.raises(exc, match=match):
        KVCacheParams(**base)


def test_leaf_spec_errors():
    with pytest.raises(ValueError, match="window=1"):
        LeafSpec.sliding_window(1)
    with pytest.raises(ValueError, match="dtype='int8'"):
        LeafSpec.recurrent((2,), "int8")


def test_text_context_lifecycle():
    c = TextContext("r", [5, 6, 7, 8, 9])
    assert (c.processed_length, c.active_length, c.current_position) == (0, 5, 5)
    c.chunk(2)
    assert (c.active_length, c.pending_length) == (2, 3)
    with pytest.raises(ValueError, match="pending"):
        c.update(1)
    c.advance_chunk()
    assert (c.processed_length, c.active_length) == (2, 3)
    c.update(10)
    assert (c.processed_length, c.active_length, len(c)) == (5, 1, 6)
    assert list(c.tokens) == [5, 6, 7, 8, 9, 10] and not c.tokens.flags.writeable
    c.rewind_processing(2)
    assert (c.processed_length, c.active_length) == (3, 3)
    c.skip_processing(2)
    assert (c.processed_length, c.active_length) == (5, 1)
    for _ in range(40):  # growth past the initial buffer
        c.update(1)
    assert len(c) == 46 and c.active_length == 1
    c.reset()
    assert (c.processed_length, c.active_length) == (0, 46)


@pytest.mark.parametrize(
    "op, exc, match",
    [
        (lambda c: c.skip_processing(3), ValueError, "would leave 0 active"),
        (lambda c: c.rewind_processing(1), ValueError, "n=1 > processed_length=0"),
        (lambda c: c.chunk(3), ValueError, r"n=3 out of range \[1, 3\)"),
        (lambda c: c.chunk(0), ValueError, "n=0"),
        (lambda c: c.advance_chunk(), ValueError, "no pending"),
        (lambda c: c.update(2**31), ValueError, "token="),
        (lambda c: c.update(np.int64(2**31)), ValueError, "token=2147483648, must be <= 2147483647"),
        (lambda c: c.update(np.uint64(2**63)), ValueError, "token=9223372036854775808"),
        (lambda c: c.update(-(2**31) - 1), ValueError, "must be >= -2147483648"),
        (lambda c: c.update(True), TypeError, "token=True, must be an int"),
        (lambda c: c.update(np.True_), TypeError, "must be an int"),
        (lambda c: c.update(7.0), TypeError, "token=7.0, must be an int"),
        (lambda c: c.update("7"), TypeError, "must be an int"),
    ],
)
def test_text_context_errors_change_nothing(op, exc, match):
    """Each refusal names the argument and leaves the context as it was (a NumPy integer token, a
    sampler's output, is read as its Python int; a bool or a float is refused)."""
    c = TextContext("r", [1, 2, 3])
    before = (c.processed_length, c.active_length, list(c.tokens))
    with pytest.raises(exc, match=match):
        op(c)
    assert (c.processed_length, c.active_length, list(c.tokens)) == before


def test_update_takes_numpy_integer_tokens():
    """``update`` with a NumPy integer (``np.int64`` from a sampler, ``np.int32``, ``np.uint16``)
    appends the same token as with the Python int; an int subclass is read as its value."""
    import enum

    class Tok(enum.IntEnum):
        EOS = 2

    c = TextContext("r", [1, 2, 3])
    for t in (np.int64(-5), np.int32(2**31 - 1), np.uint16(7), np.int8(-(2**7)), Tok.EOS, 9):
        c.update(t)
    assert list(c.tokens) == [1, 2, 3, -5, 2**31 - 1, 7, -128, 2, 9] and c.active_length == 1


@pytest.mark.parametrize(
    "args, exc",
    [((1, [1]), TypeError), (("r", []), ValueError), (("r", [[1]]), ValueError), (("r", [1.5]), TypeError),
     (("r", [2**40]), ValueError), (("r", [1, [2]]), ValueError), (("r", [1, 2.5]), TypeError),
     (("r", [1, "x"]), TypeError), (("r", (1, 2**63)), TypeError)],
)
def test_text_context_construction_errors(args, exc):
    """Each refusal names ``TextContext`` and the argument (a list of Python ints takes the packed
    conversion; one it cannot pack exactly falls back to NumPy's and its checks)."""
    with pytest.raises(exc, match=r"^TextContext: (tokens|request_id)"):
        TextContext(*args)


@pytest.mark.parametrize("tokens", [[5, 6, 7], (5, 6, 7), [5, True, 7], [5, np.int64(6), 7], np.array([5, 6, 7]),
                                    [np.int32(5), 6, 7], range(5, 8)])
def test_text_context_token_forms(tokens):
    """Lists and tuples of ints (packed), arrays and other sequences (NumPy's conversion) give the
    same int32 tokens; bools mixed in are ints, as in ``np.asarray``."""
    c = TextContext("r", tokens)
    want = np.asarray(list(tokens), dtype=np.int64).astype(np.int32)
    assert c.tokens.dtype == np.int32 and c.tokens.tolist() == want.tolist() and c.active_length == 3


def test_counts_and_metrics():
    b = BlockCount(free=3, total=10)
    assert (b.used, b.used_pct, b.free_pct) == (7, 70.0, 30.0)
    assert BlockCount(0, 0).used_pct == 0.0 and ByteCount(5, 10).used == 5
    assert PrefixCacheHits(2, 3).total_blocks == 5
    m = KVCacheMetrics(input_tokens=30, cache_tokens=10) + KVCacheMetrics(input_tokens=10, h2d_bytes_copied=4)
    assert (m.prompt_tokens, m.cache_hit_rate, m.h2d_bytes_copied) == (50, 0.2, 4)
    assert KVCacheMetrics().cache_hit_rate == 0.0
    assert m.as_dict()["cache_hit_rate"] == 0.2


def test_null_connector_answers():
    n = NullConnector()
    assert n.lookup([b"x"], np.zeros((1, 4), np.int32)) == 0
    assert n.load([], [], np.zeros((0, 4), np.int32)).is_complete()
    with pytest.raises(KVLoadRefused):
        n.load([3], [b"x"], np.zeros((1, 4), np.int32))
    t = n.offload([3], [b"x"], np.zeros((1, 4), np.int32))
    assert isinstance(t, KVTransfer) and t.is_complete() and t.synchronize() is None
    assert n.host_byte_count() == ByteCount(0, 0) and n.disk_byte_count() == ByteCount(0, 0)
    assert n.metrics == KVCacheMetrics() and isinstance(CompletedTransfer(), KVTransfer)
