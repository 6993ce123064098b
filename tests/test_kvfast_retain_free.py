"""kvfast's fused release (``BlockPool.retain_free``, one kernel pass) leaves exactly the state of
``set_retention`` then ``free``, the two calls the policy makes (spec/manager.md §14.2, §6)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfast._block_pool import BlockPool

N = 24


def _state(pool: BlockPool):
    snap = pool.snapshot()
    return repr([x.tolist() if isinstance(x, np.ndarray) else x for x in snap[:2]] + [snap[2]]) + repr(
        [snap[4].tolist(), snap[5].tolist(), snap[6].tolist(), snap[7],
         [x.tolist() if isinstance(x, np.ndarray) else x for x in snap[8]]])


def _build(ops, clock_value):
    """A pool after ``ops``: each op allocates some pages, publishes a few, claims and frees some."""
    pool = BlockPool(N)
    now = [clock_value]
    pool.clock = lambda: now[0]
    held = []
    for i, (n, publish, prio, secs, drop) in enumerate(ops):
        n = min(n, pool.num_free)
        got = [int(b) for b in pool.allocate(n)] if n else []
        for j, b in enumerate(got[:publish]):
            pool.publish(b, hashlib.sha256(f"{i}/{j}".encode()).digest(), np.full(4, i * 10 + j, np.int32))
        if got:
            pool.set_retention(got, prio, np.inf if secs is None else now[0] + secs)
        held += got
        for b in held[:drop]:
            pool.free([b])
        held = held[drop:]
        now[0] += 1.0
    return pool, held, now


ops_strategy = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6), st.sampled_from([10, 35, 80]),
                                  st.one_of(st.none(), st.floats(0, 3)), st.integers(0, 4)),
                        min_size=1, max_size=8)


@settings(deadline=None)
@given(ops=ops_strategy, prio=st.sampled_from([10, 35, 80]), secs=st.one_of(st.none(), st.floats(0, 3)),
       share=st.integers(0, 3))
def test_retain_free_equals_set_retention_then_free(ops, prio, secs, share):
    a, held, now_a = _build(ops, 100.0)
    b, _, _ = _build(ops, 100.0)
    if not held:
        return
    # a request's row, tail first; some pages also referenced by another holder (touched twice)
    extra = held[:share]
    if extra:
        a.touch_many(extra)
        b.touch_many(extra)
    row = np.array(held[::-1], np.int64)
    expiry = np.inf if secs is None else now_a[0] + secs
    a.set_retention(row, prio, expiry)
    a.free(row)
    b.retain_free(row, prio, expiry)
    assert _state(a) == _state(b)


def test_retain_free_bad_input_changes_nothing():
    pool = BlockPool(8)
    pages = [int(b) for b in pool.allocate(3)]
    before = _state(pool)
    with pytest.raises(IndexError, match=r"^BlockPool.retain_free: block 8 out of range 0..7$"):
        pool.retain_free(np.array(pages + [8], np.int64), 35, np.inf)
    with pytest.raises(ValueError, match="priority"):
        pool.retain_free(np.array(pages, np.int64), 101, np.inf)
    assert _state(pool) == before
    pool.retain_free(pages[::-1], 35, np.inf)  # a list works as an int64 array does
    assert pool.num_free == 7


def test_reference_retain_free_is_the_two_calls():
    """kvref's engine defines the operation as the two calls (spec/kvspec/engine BlockPool)."""
    import kvref

    a, b = kvref.BlockPool(10), kvref.BlockPool(10)
    for pool in (a, b):
        pages = [int(x) for x in pool.allocate(4)]
        pool.publish(pages[0], b"h" * 32, np.arange(4, dtype=np.int32))
    row = pages[::-1]
    a.set_retention(row, 80, np.inf)
    a.free(row)
    b.retain_free(row, 80, np.inf)
    assert a.free_order() == b.free_order() and a.retention(pages[0]) == b.retention(pages[0]) == (80, np.inf)


@settings(deadline=None)
@given(ops=ops_strategy, prio=st.sampled_from([10, 35, 80]), secs=st.one_of(st.none(), st.floats(0, 3)),
       pick=st.integers(0, 40), share=st.booleans())
def test_one_page_path_equals_the_kernel_pass(ops, prio, secs, pick, share):
    """``retain_free([b])`` (one page: Python, no kernel call) leaves the state of the kernel pass
    over the same page, under a clock that moves at every reading (both read it once)."""
    a, held, now_a = _build(ops, 100.0)
    b, _, _ = _build(ops, 100.0)
    if not held:
        return
    page = held[pick % len(held)]
    if share:  # another holder references it too: the claim merges, the page stays held
        a.touch(page)
        b.touch(page)
    for pool in (a, b):
        ticks = [now_a[0]]

        def clock(ticks=ticks):
            ticks[0] += 0.25
            return ticks[0]

        pool.clock = clock
    expiry = np.inf if secs is None else now_a[0] + secs
    a.retain_free([page], prio, expiry)
    b.retain_free(np.array([page], np.int64), prio, expiry)
    assert _state(a) == _state(b)
    for bad in (N, -1):  # the range check, nothing changed
        before = _state(a)
        with pytest.raises(IndexError, match=rf"^BlockPool.retain_free: block {bad} out of range 0..{N - 1}$"):
            a.retain_free([bad], prio, expiry)
        assert _state(a) == before
