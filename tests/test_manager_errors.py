"""Every PagedKVCacheManager error path: the exact type, a message naming the
argument and value, and state bit-for-bit unchanged afterwards."""

import hashlib

import numpy as np
import pytest

from _pool_sizes import holdable
from kvref import PagedKVCacheManager
from kvspec import (
    InsufficientBlocksError,
    KVCacheParams,
    LeafSpec,
    NullConnector,
    TextContext,
)

PAGE = 4


def make(num_blocks=9, dp=1, leaves=None, max_batch_size=2, max_seq_len=None, **kw):
    params = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=2, dtype="float32",
                           data_parallel_degree=dp, leaves=leaves)
    if max_seq_len is None:  # the longest the pool holds, at most 32 (spec/manager.md §1.6)
        max_seq_len = holdable(PagedKVCacheManager, params, num_blocks, 32)
    return PagedKVCacheManager(params, num_blocks=num_blocks, max_batch_size=max_batch_size,
                               max_seq_len=max_seq_len, **kw)


def fingerprint(m, *ctxs):
    """Everything observable: pools, rows, request records, metrics, pins, queues, buffers, contexts."""
    pools = [{lid: p.snapshot() for lid, p in pools.items()} for pools in m._pools]
    reqs = {rid: {k: getattr(q, k) for k in type(q).__slots__ if k != "ctx"}  # every field of the record
            for rid, q in m._requests.items()}
    bufs = [{lid: hashlib.sha256(np.ascontiguousarray(b).tobytes()).hexdigest() for lid, b in d.items()}
            for d in m._buffers]
    cs = [(c.request_id, c.processed_length, c.active_length, len(c), c.cached_prefix_length,
           c.cached_prefix_external_length) for c in ctxs]
    return repr((pools, reqs, m.get_metrics_aggregated(), [dict(p) for p in m._pins],
                 m._offload_queue, len(m._loads), bufs, cs))


def unchanged(m, exc, match, fn, *ctxs):
    before = fingerprint(m, *ctxs)
    with pytest.raises(exc, match=match):
        fn()
    assert fingerprint(m, *ctxs) == before
    m.check_invariants()


@pytest.fixture
def busy():
    """A manager with a live request, a published chain and a dummy."""
    m = make(num_blocks=9, dp=2)
    a = TextContext("a", list(range(9)))
    m.claim(a, 0)
    m.alloc(a)
    a.update(1)
    m.step(a)
    m.alloc(a)
    d = TextContext("d", [1, 2])
    m.alloc_dummy(d, 1)
    return m, a, d


# --------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(params="p"), TypeError, r"PagedKVCacheManager: params='p', must be a KVCacheParams"),
        (dict(num_blocks=1), ValueError, r"PagedKVCacheManager: num_blocks=1, must be >= 2"),
        (dict(num_blocks=2.0), TypeError, r"num_blocks=2.0, must be an int"),
        (dict(max_batch_size=0), ValueError, r"max_batch_size=0, must be >= 1"),
        (dict(max_seq_len=0), ValueError, r"max_seq_len=0, must be >= 1"),
        (dict(device="gpu"), ValueError, r"device='gpu'"),
        (dict(device="cuda:0"), ValueError, r"device='cuda:0', kvref .* only 'cpu'"),
        (dict(connector=object()), TypeError, r"connector=.* does not implement kvspec.KVConnector"),
    ],
)
def test_constructor_errors(kw, exc, match):
    args = dict(params=KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=2),
                num_blocks=9, max_batch_size=2, max_seq_len=32)
    args.update(kw)
    params = args.pop("params")
    with pytest.raises(exc, match=match):
        PagedKVCacheManager(params, **args)


def test_recurrent_needs_three_blocks():
    with pytest.raises(ValueError, match=r"num_blocks=2, must be >= 3 with a recurrent leaf"):
        make(num_blocks=2, leaves={"full": LeafSpec.full(), "rec": LeafSpec.recurrent((2,))})


def test_explicit_null_connector_accepted():
    m = make(connector=NullConnector())
    assert m.host_byte_count().total == 0


# --------------------------------------------------------------------------- claim discipline


def test_claim_errors(busy):
    m, a, d = busy
    unchanged(m, ValueError, r"claim: request_id='a' is already claimed, on replica 0", lambda: m.claim(a, 1), a)
    unchanged(m, ValueError, r"claim: request_id='d' is already claimed, on replica 1", lambda: m.claim(d), d)
    x = TextContext("x", [1])
    unchanged(m, IndexError, r"claim: replica_idx=2 out of range \[0, 2\)", lambda: m.claim(x, 2), x)
    unchanged(m, IndexError, r"claim: replica_idx=-1 out of range", lambda: m.claim(x, -1), x)
    unchanged(m, TypeError, r"claim: replica_idx='0', must be an int", lambda: m.claim(x, "0"), x)
    unchanged(m, TypeError, r"claim: ctx='x', must be a TextContext", lambda: m.claim("x"))
    long = TextContext("long", list(range(33)))
    unchanged(m, ValueError, r"claim: len\(ctx\)=33 > max_seq_len=32", lambda: m.claim(long), long)


@pytest.mark.parametrize(
    "call",
    ["alloc", "step", "release", "get_req_blocks_per_leaf", "starts_lookup", "start_lookup",
     "awaits_lookup", "hand_back_lookup"],
)
def test_unclaimed_request_errors(busy, call):
    m, a, d = busy
    x = TextContext("x", [1, 2, 3])
    unchanged(m, ValueError, rf"{call}: request_id='x' is not claimed, so it holds no pages",
              lambda: getattr(m, call)(x), x)


def test_release_twice_and_by_id(busy):
    m, a, d = busy
    m.release("a")
    unchanged(m, ValueError, r"release: request_id='a' is not claimed", lambda: m.release(a), a)
    unchanged(m, TypeError, r"release: ctx=3, must be a TextContext", lambda: m.release(3))
    unchanged(m, TypeError, r"contains: ctx=3, must be a TextContext", lambda: m.contains(3))


def test_claimed_id_with_other_tokens(busy):
    m, a, d = busy
    impostor = TextContext("a", [7] * 9)
    unchanged(m, ValueError, r"alloc: request_id='a' was claimed with other tokens", lambda: m.alloc(impostor), a)


def test_alloc_dummy_errors(busy):
    m, a, d = busy
    unchanged(m, ValueError, r"alloc_dummy: request_id='a' is already claimed, on replica 0",
              lambda: m.alloc_dummy(a, 1), a)
    x = TextContext("x", [1])
    unchanged(m, IndexError, r"alloc_dummy: replica_idx=5 out of range", lambda: m.alloc_dummy(x, 5), x)
    long = TextContext("long", list(range(40)))
    unchanged(m, ValueError, r"alloc_dummy: len\(ctx\)=40 > max_seq_len=32", lambda: m.alloc_dummy(long), long)


# --------------------------------------------------------------------------- alloc / step


def test_alloc_argument_errors(busy):
    m, a, d = busy
    unchanged(m, TypeError, r"alloc: defer_lookup=1, must be a bool", lambda: m.alloc(a, defer_lookup=1), a)
    unchanged(m, TypeError, r"alloc: ctx=None, must be a TextContext", lambda: m.alloc(None))
    for _ in range(32 - len(a)):
        a.update(3)
        m.step(a)
        m.alloc(a)
    a.update(4)
    unchanged(m, ValueError, r"alloc: len\(ctx\)=33 > max_seq_len=32", lambda: m.alloc(a), a)


def test_alloc_out_of_blocks_with_a_splice_rolls_back(busy):
    m, a, d = busy
    hog = TextContext("hog", list(range(100, 112)))
    m.claim(hog, 0)
    m.alloc(hog)  # 3 + 3 of 8 used
    b = TextContext("b", list(range(8)) + list(range(50, 62)))  # 20 tokens: 5 blocks, 2 reusable
    m.claim(b, 0)
    unchanged(m, InsufficientBlocksError, r"alloc: request_id='b' needs 3 blocks of leaf 'full', 2 free or evictable on replica 0",
              lambda: m.alloc(b), a, b, hog)
    m.release(hog)
    m.alloc(b)
    assert b.cached_prefix_length == 8


def test_alloc_out_of_blocks_in_a_hybrid_leaf_rolls_back():
    leaves = {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(5), "rec": LeafSpec.recurrent((2,))}
    m = make(num_blocks=11, leaves=leaves)  # spec/manager.md §13: 10 huge blocks the three leaves share
    a = TextContext("a", list(range(8)))
    m.claim(a)
    m.alloc(a)
    a.update(1)
    m.step(a)  # checkpoint at 8, swa block 0 freed
    m.release(a)
    hog = TextContext("hog", list(range(100, 108)))
    m.claim(hog)
    m.alloc(hog)
    b = TextContext("b", list(range(8)) + list(range(40, 50)))
    m.claim(b)
    assert m.get_prefix_cache_hit_counts(b)[0].device_blocks == 2  # full, window and checkpoint agree
    unchanged(m, InsufficientBlocksError, r"needs 3 blocks of leaf 'full', 1 free", lambda: m.alloc(b), b, hog)
    m.release(hog)
    m.alloc(b)  # the splice (checkpoint restore, nulled window) now succeeds
    assert b.cached_prefix_length == 8
    assert m.get_req_blocks_per_leaf(b)["swa"][0] == 0


def test_step_before_alloc_covers_the_forward(busy):
    m, a, d = busy
    b = TextContext("b", list(range(20, 24)))
    m.claim(b, 0)
    m.alloc(b)
    b.update(1)
    m.step(b)
    b.update(2)  # a forward ran without alloc: processed 5 > 4 allocated tokens
    before = fingerprint(m, b)
    with pytest.raises(ValueError, match=r"step: processed_length=5 > 4 tokens in the allocated rows"):
        m.step(b)
    assert fingerprint(m, b) == before


# --------------------------------------------------------------------------- replica-indexed queries


@pytest.mark.parametrize(
    "call",
    ["block_count", "pressure_pct", "pending_transfers_exist", "host_byte_count", "disk_byte_count",
     "get_device_buffer", "_free_order"],
)
def test_replica_index_errors(busy, call):
    m, a, d = busy
    unchanged(m, IndexError, rf"{call}: replica_idx=2 out of range \[0, 2\)", lambda: getattr(m, call)(2))
    unchanged(m, TypeError, rf"{call}: replica_idx=None, must be an int", lambda: getattr(m, call)(None))


def test_query_type_errors(busy):
    m, a, d = busy
    unchanged(m, TypeError, r"num_req_blocks: ctx=\[1\], must be a TextContext", lambda: m.num_req_blocks([1]))
    unchanged(m, TypeError, r"get_prefix_cache_hit_counts: ctx='a'",
              lambda: m.get_prefix_cache_hit_counts("a"))
    unchanged(m, ValueError, r"_free_order: leaf_id='swa' not in \['full'\]", lambda: m._free_order(0, "swa"))


# --------------------------------------------------------------------------- runtime inputs, in order


def test_runtime_inputs_error_order(busy):
    m, a, d = busy
    # (1) replica count
    unchanged(m, ValueError, r"runtime_inputs: len\(batches\)=1 but data_parallel_degree=2", lambda: m.runtime_inputs([[a]]))
    # (3) not claimed / wrong replica / repeated / short of blocks
    x = TextContext("x", [1, 2])
    unchanged(m, ValueError, r"runtime_inputs: batches\[0\]\[1\] request_id='x' is not claimed",
              lambda: m.runtime_inputs([[a, x], []]))
    unchanged(m, ValueError, r"runtime_inputs: batches\[1\]\[0\] request_id='a' is claimed on replica 0, not 1",
              lambda: m.runtime_inputs([[], [a]]))
    unchanged(m, ValueError, r"runtime_inputs: batches\[0\]\[1\] request_id='a' appears twice",
              lambda: m.runtime_inputs([[a, a], []]))
    b = TextContext("b", list(range(30, 39)))
    m.claim(b, 0)
    unchanged(m, ValueError, r"batches\[0\]\[0\] request_id='b' holds 0 blocks of leaf 'full' \(0 tokens\) < "
              r"current_position=9; it does not have sufficient blocks, alloc must be called first",
              lambda: m.runtime_inputs([[b], []]), b)
    # (3) before (4) and (5)
    unchanged(m, ValueError, r"does not have sufficient blocks",
              lambda: m.runtime_inputs([[b, a, d], []], max_cache_length=0))
    m.alloc(b)
    # (4)
    unchanged(m, ValueError, r"runtime_inputs: max_cache_length=0, must be >= 1",
              lambda: m.runtime_inputs([[a, b, a.__class__("z", [1])][:2], [d]], max_cache_length=0))
    unchanged(m, ValueError, r"max_cache_length=8 gives 2 blocks < 3 the batch needs; capture max_cache_length "
              r"cannot be smaller", lambda: m.runtime_inputs([[a, b], [d]], max_cache_length=8))
    unchanged(m, TypeError, r"max_cache_length=8.0, must be an int or None",
              lambda: m.runtime_inputs([[a], [d]], max_cache_length=8.0))
    # (5)
    c = TextContext("c", [5])
    m.claim(c, 0)
    m.alloc(c)
    unchanged(m, ValueError, r"runtime_inputs: len\(batches\[0\]\)=3 > max_batch_size=2",
              lambda: m.runtime_inputs([[a, b, c], [d]]))
    # (4) is checked before (5)
    unchanged(m, ValueError, r"max_cache_length=0", lambda: m.runtime_inputs([[a, b, c], [d]], max_cache_length=0))
    # types
    unchanged(m, TypeError, r"runtime_inputs: batches=dict", lambda: m.runtime_inputs({0: [a]}))
    unchanged(m, TypeError, r"runtime_inputs: batches\[1\]=TextContext", lambda: m.runtime_inputs([[a], d]))
    unchanged(m, TypeError, r"runtime_inputs: batches\[0\]\[0\]='a', must be a TextContext",
              lambda: m.runtime_inputs([["a"], []]))
    unchanged(m, ValueError, r"runtime_inputs_for_leaf: leaf_id='swa' not in \['full'\]",
              lambda: m.runtime_inputs_for_leaf("swa", [[a], []]))
    m.runtime_inputs([[a, b], [d]])


def test_runtime_inputs_empty_batch_with_recurrent_leaf():
    m = make(leaves={"full": LeafSpec.full(), "rec": LeafSpec.recurrent((2,))})
    unchanged(m, ValueError, r"runtime_inputs: every batch is empty, but a recurrent leaf binds rows",
              lambda: m.runtime_inputs([[]]))
    # (1) before (2)
    unchanged(m, ValueError, r"len\(batches\)=2 but data_parallel_degree=1", lambda: m.runtime_inputs([[], []]))
    # a paged-only view of the same manager allows it
    assert m.runtime_inputs_for_leaf("full", [[]]).inputs[0].lookup_table.shape == (0, 8)
    ctx = TextContext("a", [1, 2])
    m.claim(ctx)
    unchanged(m, ValueError, r"holds no state page of leaf 'rec'|holds 0 blocks",
              lambda: m.runtime_inputs_for_leaf("rec", [[ctx]]), ctx)
