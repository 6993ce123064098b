"""Every value a user's ``clock=`` returns is read, and checked, before anything changes
(spec/manager.md §14.7), in both packages.

The defect this closes: a clock returning ``None`` when ``release`` read it raised
``TypeError`` after the request was forgotten, leaving its pages at ``ref_count=1``
with no table entry (a leak ``check_invariants`` caught). The class is "a user
callable's return value used after a change": every call that reads the clock
(``alloc``, ``step``'s slide and checkpoint, ``release``, the pools' ``free`` and
``set_retention``, the slot cache's ``admit`` and ``retire``) reads it once, first,
and within the call every later reading is that same instant (``with clock:``), so a
clock that fails on a second reading cannot stop a call half-way either. Also here:
``retention_seconds`` past float's range is the documented ``ValueError``.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

import kvfast
import kvref
from kvfast._block_pool import BlockPool as FastPool
from kvref._block_pool import BlockPool as RefPool
from kvspec import KVCacheConfig, KVCacheMode, KVCacheParams, KVLayerSpec, LeafSpec, TextContext
from kvspec.retention import CheckedClock, check_clock, check_reading, held

PKGS = [pytest.param(kvref, id="kvref"), pytest.param(kvfast, id="kvfast")]
PAGE = 4
BAD = [(None, TypeError), ("x", TypeError), (math.nan, ValueError), (math.inf, ValueError),
       (10**400, ValueError), (True, TypeError)]


class Clock:
    """A clock that returns ``t`` until ``bad_after`` readings, then ``bad`` (counts readings)."""

    def __init__(self, t: float = 0.0):
        self.t, self.reads, self.bad_after, self.bad = t, 0, None, None

    def fail_after(self, n: int, value) -> None:
        self.reads, self.bad_after, self.bad = 0, n, value

    def __call__(self):
        self.reads += 1
        if self.bad_after is not None and self.reads > self.bad_after:
            return self.bad
        return self.t


def _manager(pkg, clock, leaves=None, num_blocks=33):
    params = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=2, dtype="float32", leaves=leaves)
    return pkg.PagedKVCacheManager(params, num_blocks=num_blocks, max_batch_size=4, max_seq_len=48, clock=clock)


def _fingerprint(m, *ctxs):
    pools = [{lid: p.snapshot() for lid, p in pools.items()} for pools in m._pools]
    reqs = {rid: {k: getattr(q, k) for k in type(q).__slots__ if k != "ctx"} for rid, q in m._requests.items()}
    bufs = [{lid: hashlib.sha256(np.ascontiguousarray(b).tobytes()).hexdigest() for lid, b in d.items()}
            for d in m._buffers]
    cs = [(c.request_id, c.processed_length, c.active_length, len(c), c.cached_prefix_length) for c in ctxs]
    return repr((pools, reqs, m.get_metrics_aggregated(), bufs, cs))


def _refused(m, clock, value, fn, exc, *ctxs):
    """``fn`` refused on a clock whose next reading is ``value``; state unchanged (the
    check itself, ``check_invariants``, reads the clock: on a good one)."""
    before = _fingerprint(m, *ctxs)
    clock.fail_after(0, value)
    with pytest.raises(exc, match=r"clock\(\) returned"):
        fn()
    clock.bad_after = None
    assert _fingerprint(m, *ctxs) == before
    m.check_invariants()


def _running(m, rid="a", n=10, **retention):
    ctx = TextContext(rid, np.arange(100, 100 + n, dtype=np.int32), **retention)
    m.claim(ctx)
    m.alloc(ctx)
    ctx.update(7)
    m.step(ctx)
    return ctx


# ---------------------------------------------------------------- the checks themselves

@pytest.mark.parametrize("value,exc", BAD)
def test_a_bad_reading_is_named(value, exc):
    with pytest.raises(exc, match=r"owner: clock\(\) returned"):
        check_reading("owner", value)
    clock = check_clock("owner", lambda: value)
    assert isinstance(clock, CheckedClock)
    with pytest.raises(exc, match=r"owner: clock\(\) returned"):
        clock()


def test_held_reads_once_and_returns_that_instant():
    c = Clock(5.0)
    clock = check_clock("o", c)
    with held(clock) as now:
        c.t = 9.0
        assert now == 5.0 and clock() == 5.0 and clock() == 5.0
        with held(clock):  # nested: still the outer reading
            assert clock() == 5.0
    assert c.reads == 1
    assert clock() == 9.0
    assert check_clock("o", None) is check_clock("o", None)  # time.monotonic: unwrapped
    assert check_clock("o", clock) is clock  # an already checked clock is not wrapped again


# ---------------------------------------------------------------- the manager

@pytest.mark.parametrize("pkg", PKGS)
@pytest.mark.parametrize("value,exc", BAD)
def test_release_with_a_bad_clock_changes_nothing(pkg, value, exc):
    c = Clock(1.0)
    m = _manager(pkg, c)
    a = _running(m, retention_seconds=30.0)
    _refused(m, c, value, lambda: m.release(a), exc, a)
    m.release(a)  # the request is still claimed: a good reading releases it
    m.check_invariants()
    assert m.get_metrics_aggregated() is not None


@pytest.mark.parametrize("pkg", PKGS)
def test_release_without_a_time_to_live_needs_no_reading_but_checks_it(pkg):
    c = Clock(1.0)
    m = _manager(pkg, c)
    a = _running(m)
    _refused(m, c, None, lambda: m.release(a), TypeError, a)  # read once at the start, whatever the claim


@pytest.mark.parametrize("pkg", PKGS)
@pytest.mark.parametrize("leaves", [
    pytest.param({"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(8)}, id="full+sliding"),
    pytest.param({"full": LeafSpec.full(), "rec": LeafSpec.recurrent((4, 8))}, id="full+recurrent"),
])
def test_a_clock_that_fails_on_its_second_reading_cannot_stop_a_call_half_way(pkg, leaves):
    """Several pools let go (one per leaf): the call reads once and every pool sees that reading."""
    c = Clock(1.0)
    m = _manager(pkg, c, leaves=leaves)
    a = _running(m, n=17, retention_seconds=5.0)
    for _ in range(6):  # decode past a page: the slide and the checkpoint run under the claim
        c.fail_after(1, None)
        m.alloc(a)
        a.update(9)
        c.fail_after(1, None)  # each call: one good reading, then None
        m.step(a)
        c.bad_after = None
        m.check_invariants()
    c.fail_after(1, None)
    m.release(a)
    c.bad_after = None
    m.check_invariants()
    assert not m._requests


@pytest.mark.parametrize("pkg", PKGS)
@pytest.mark.parametrize("value,exc", BAD[:3])
def test_a_slide_with_a_bad_clock_changes_nothing(pkg, value, exc):
    c = Clock(1.0)
    m = _manager(pkg, c, leaves={"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(4)})
    a = _running(m, n=11, retention_seconds=5.0)
    while a.processed_length % PAGE != PAGE - 1:  # the next token fills a page: the window slides
        m.alloc(a)
        a.update(9)
        m.step(a)
    m.alloc(a)
    a.update(9)
    _refused(m, c, value, lambda: m.step(a), exc, a)
    m.step(a)
    m.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
@pytest.mark.parametrize("value,exc", BAD[:3])
def test_alloc_with_a_bad_clock_changes_nothing(pkg, value, exc):
    c = Clock(1.0)
    m = _manager(pkg, c, leaves={"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(8)})
    b = _running(m, "b", n=9, retention_seconds=2.0)
    m.release(b)  # published pages with a finite claim: the next draw may expire them
    a = TextContext("a", np.arange(100, 119, dtype=np.int32))
    m.claim(a)
    _refused(m, c, value, lambda: m.alloc(a), exc, a)
    m.alloc(a)
    m.check_invariants()
    assert a.cached_prefix_length == 8


# ---------------------------------------------------------------- the pools

@pytest.mark.parametrize("Pool", [RefPool, FastPool], ids=["kvref", "kvfast"])
def test_pool_free_and_set_retention_read_before_any_change(Pool):
    c = Clock(0.0)
    p = Pool(8, clock=c)
    blocks = p.allocate(4)
    for i, b in enumerate(blocks):
        p.publish(b, bytes([i]) * 8, [i] * 4)
    p.set_retention(blocks, 60, 10.0)
    for value, exc in BAD[:3]:
        c.fail_after(0, value)
        before = repr(p.snapshot())
        with pytest.raises(exc, match=r"clock\(\) returned"):
            p.free(blocks[::-1])
        assert repr(p.snapshot()) == before
        with pytest.raises(exc, match=r"clock\(\) returned"):
            p.set_retention(blocks, 70, 20.0)
        assert repr(p.snapshot()) == before
    c.bad_after = None
    p.free(blocks[::-1])
    assert p.num_free == 7


# ---------------------------------------------------------------- the slot cache

@pytest.mark.parametrize("pkg", PKGS)
@pytest.mark.parametrize("value,exc", BAD[:3])
def test_slot_cache_admit_and_retire_with_a_bad_clock_change_nothing(pkg, value, exc):
    c = Clock(0.0)
    cfg = KVCacheConfig(num_layers=1, max_seqs=2, max_seq_len=32, mode=KVCacheMode.PAGED, block_size=PAGE, num_blocks=17,
                        enable_prefix_caching=True, dtype="float32")
    cache = pkg.KVCache.make(cfg, [KVLayerSpec.attention(kv_heads=1, head_dim=2)], clock=c)
    prompt = np.arange(10, 22, dtype=np.int32)
    cache.reserve([0], [12])
    cache.update_position(0, 12)
    cache.retire(0, prompt, retention_seconds=5.0)
    cache.reserve([0], [12])
    cache.update_position(0, 12)

    def state():
        return (cache.seq_lens().tolist(), cache.paged_block_table().tolist(), cache._free_order(),
                cache._pool.snapshot())

    for call in (lambda: cache.admit(1, prompt, retention_seconds=5.0),
                 lambda: cache.retire(0, prompt, retention_seconds=5.0)):
        before = repr(state())
        c.fail_after(0, value)
        with pytest.raises(exc, match=r"clock\(\) returned"):
            call()
        c.bad_after = None
        assert repr(state()) == before
        cache.check_invariants()
    c.bad_after = None
    assert cache.admit(1, prompt) == 8
    cache.retire(0, prompt, retention_seconds=5.0)
    cache.check_invariants()


# ---------------------------------------------------------------- retention_seconds past float's range

@pytest.mark.parametrize("value", [10**400, -(10**400), math.inf, math.nan, 0, -1.0])
def test_retention_seconds_out_of_range_is_a_value_error_naming_the_field(value):
    with pytest.raises(ValueError, match=r"retention_seconds="):
        TextContext("r", [1, 2, 3], retention_seconds=value)
    ctx = TextContext("r", [1, 2, 3], retention_seconds=4.0)
    with pytest.raises(ValueError, match=r"retention_seconds="):
        ctx.retention_seconds = value
    assert ctx.retention_seconds == 4.0


@pytest.mark.parametrize("pkg", PKGS)
def test_retention_seconds_past_float_range_elsewhere(pkg):
    cfg = KVCacheConfig(num_layers=1, max_seqs=1, max_seq_len=16, mode=KVCacheMode.PAGED, block_size=PAGE, num_blocks=9,
                        enable_prefix_caching=True, dtype="float32")
    cache = pkg.KVCache.make(cfg, [KVLayerSpec.attention(kv_heads=1, head_dim=2)])
    with pytest.raises(ValueError, match=r"admit: retention_seconds="):
        cache.admit(0, [1, 2, 3, 4, 5], retention_seconds=10**400)
    pool = (FastPool if pkg is kvfast else RefPool)(4)
    with pytest.raises(ValueError, match=r"BlockPool.set_retention: expiry=1000.*past float's range"):
        pool.set_retention([1], 50, 10**400)
