"""Retention priority and time-to-live of cached prefixes (spec/manager.md §14, spec/slot-cache.md §4.5).

(a) shared system prompts at priority 80 keep their hit rate under a burst of
one-off prompts that overflows the pool, where plain LRU loses it; (b) a pool
whose free pages are all priority 100 still serves a request that fits; (c)
time-to-live with an injected clock; (d) kvref and kvfast agree, pools
compared call for call by Hypothesis with random priorities and expiries.
Tiers (host order, disk metadata, Redis TTL) are in ``test_retention_tiers.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvfast
import kvref
from kvfast._block_pool import BlockPool as FastPool
from kvref._block_pool import BlockPool as RefPool
from kvspec import (
    CapacityError, InsufficientBlocksError, KVCacheConfig, KVCacheMode, KVCacheParams, KVLayerSpec, TextContext,
)
from kvspec.retention import DEFAULT_PRIORITY, merge

PKGS = [pytest.param(kvref, id="kvref"), pytest.param(kvfast, id="kvfast")]
PAGE = 4


class Clock:
    """A settable clock (seconds)."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _manager(pkg, num_blocks: int, clock=None, max_seq_len: int = 64):
    params = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=2)
    return pkg.PagedKVCacheManager(params, num_blocks=num_blocks, max_batch_size=4, max_seq_len=max_seq_len,
                                   clock=clock)


def _serve(m, rid: str, tokens, **retention) -> int:
    """One request: claim, prefill, one decode token, release; returns its cached prefix (tokens)."""
    ctx = TextContext(rid, np.asarray(tokens, np.int32), **retention)
    m.claim(ctx)
    m.alloc(ctx)
    ctx.update(7)
    m.step(ctx)
    m.release(ctx)
    return ctx.cached_prefix_length


# ---------------------------------------------------------------- (a) system prompts under a burst

SYSTEM = [list(range(1000, 1016)), list(range(2000, 2016))]  # two system prompts, 4 pages each


def _system_hit_rate(pkg, *, burst: bool, system_priority: int) -> float:
    """Rounds of: both system prompts (each with a fresh user suffix), then (``burst``) three
    one-off prompts of 10 pages each, more than the pool holds beside the system prompts.
    Returns the system prompts' hit rate over every round after the first (tokens)."""
    m = _manager(pkg, num_blocks=25)  # 24 pages
    hit = asked = 0
    for rnd in range(6):
        for i, sysp in enumerate(SYSTEM):
            user = [50_000 + 100 * rnd + 10 * i + j for j in range(3)]
            got = _serve(m, f"s{rnd}.{i}", sysp + user, retention_priority=system_priority)
            if rnd:
                hit += min(got, len(sysp))
                asked += len(sysp)
        if burst:
            for j in range(3):
                _serve(m, f"o{rnd}.{j}", [90_000 + 1000 * rnd + 100 * j + k for k in range(40)])
        m.check_invariants()
    return hit / asked


@pytest.mark.parametrize("pkg", PKGS)
def test_system_prompts_keep_their_hit_rate_under_a_burst(pkg):
    calm = _system_hit_rate(pkg, burst=False, system_priority=80)
    kept = _system_hit_rate(pkg, burst=True, system_priority=80)
    lru = _system_hit_rate(pkg, burst=True, system_priority=DEFAULT_PRIORITY)
    assert calm == 1.0
    assert kept == calm  # retention: the burst costs the system prompts nothing
    assert lru == 0.0  # plain LRU: every burst evicts them


# ---------------------------------------------------------------- (b) retention never starves


@pytest.mark.parametrize("pkg", PKGS)
def test_a_pool_full_of_priority_100_pages_still_admits_a_request_that_fits(pkg):
    m = _manager(pkg, num_blocks=9, max_seq_len=32)  # 8 pages
    _serve(m, "pinned", list(range(100, 131)), retention_priority=100)  # 32 tokens: 7 full pages published
    holder = TextContext("holder", [1])
    m.claim(holder)
    m.alloc(holder)  # takes the one unpublished page: every free page is now a priority-100 page
    pool = m._pools[0]["full"]
    order = m._free_order()
    assert len(order) == 7 and all(pool.retention(b) == (100, math.inf) for b in order)
    with pytest.raises(InsufficientBlocksError):  # only the count decides: 8 pages do not fit in 7
        _serve(m, "big", list(range(500, 529)))
    assert m._free_order() == order
    assert _serve(m, "new", list(range(500, 527))) == 0  # 7 pages: every priority-100 page is evicted
    assert all(pool.retention(b)[0] != 100 for b in range(9))
    m.release(holder)
    m.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
def test_slot_cache_full_of_priority_100_blocks_still_reserves(pkg):
    cfg = KVCacheConfig(num_layers=1, max_seqs=2, max_seq_len=32, mode=KVCacheMode.PAGED, block_size=4,
                        num_blocks=9)
    cache = pkg.KVCache.make(cfg, [KVLayerSpec.attention(kv_heads=1, head_dim=2)])
    toks = np.arange(32, dtype=np.int32)
    cache.prepare_step([0, 32], [0], [0])
    cache.update_position(0, 32)
    cache.retire(0, toks, retention_priority=100)
    assert len(cache._free_order()) == 8
    cache.prepare_step([0, 32], [0], [1])  # all 8 blocks again, every one evicted
    cache.update_position(1, 32)
    cache.check_invariants()
    with pytest.raises(CapacityError):
        cache.prepare_step([0, 1], [0], [0])


# ---------------------------------------------------------------- (c) time-to-live


@pytest.mark.parametrize("pkg", PKGS)
def test_ttl_expires_back_to_plain_lru(pkg):
    clock = Clock(100.0)
    m = _manager(pkg, num_blocks=9, clock=clock, max_seq_len=32)  # 8 pages
    _serve(m, "sys", list(range(100, 109)), retention_priority=90, retention_seconds=10)  # 2 pages published
    pool = m._pools[0]["full"]
    sys_pages = [b for b in m._free_order() if pool.is_published(b)]  # at level 90: tail, then head
    assert len(sys_pages) == 2
    assert {pool.retention(b) for b in sys_pages} == {(90, 110.0)}
    clock.t = 105.0
    _serve(m, "o1", list(range(200, 223)))  # 6 pages from the front; 5 published at level 35
    clock.t = 106.0
    assert _serve(m, "sys2", list(range(100, 109)) + [1]) == 8  # a hit; its (35, inf) leaves (90, 110)
    assert {pool.retention(b) for b in sys_pages} == {(90, 110.0)}
    clock.t = 110.0  # expired (<=): dropped when the front is read, moved to the back of level 35
    order = m._free_order()
    assert {pool.retention(b) for b in sys_pages} == {(-1, math.inf)}
    assert order[-2:] == sys_pages  # expiry order, ties in the order they were freed (tail first)
    _serve(m, "o2", list(range(300, 331)))  # 8 pages: everything goes, the expired pages too
    assert _serve(m, "sys3", list(range(100, 109))) == 0
    m.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
def test_ttl_keeps_priority_until_expiry(pkg):
    clock = Clock(0.0)
    m = _manager(pkg, num_blocks=9, clock=clock, max_seq_len=32)
    _serve(m, "sys", list(range(100, 109)), retention_priority=90, retention_seconds=10)
    clock.t = 9.5
    _serve(m, "o1", list(range(200, 223)))  # 6 pages
    _serve(m, "o2", list(range(300, 323)))  # 6 more: level 35 goes first, the system prompt stays
    assert _serve(m, "sys2", list(range(100, 109))) == 8


@pytest.mark.parametrize("Pool", [RefPool, FastPool], ids=["kvref", "kvfast"])
def test_pool_ttl_orders_and_merges(Pool):
    clock = Clock(0.0)
    p = Pool(8, clock=clock)
    a = p.allocate(5)
    for i, b in enumerate(a):
        p.publish(b, bytes([i]), [i])
    p.set_retention(a[0:1], 80, math.inf)
    p.set_retention(a[1:2], 60, 10.0)
    p.set_retention(a[2:3], 10, math.inf)
    p.set_retention(a[3:4], 60, 5.0)
    p.free(a[::-1])
    # front (6, 7), level 10: a[2], level 35: a[4], level 60: a[3], a[1], level 80: a[0]
    assert p.free_order() == [6, 7, a[2], a[4], a[3], a[1], a[0]]
    clock.t = 5.0  # a[3] expires (<=): to the back of level 35
    assert p.free_order() == [6, 7, a[2], a[4], a[3], a[1], a[0]]
    assert p.retention(a[3]) == (-1, math.inf)
    clock.t = 10.0
    assert p.free_order() == [6, 7, a[2], a[4], a[3], a[1], a[0]]
    assert p.retention(a[1]) == (-1, math.inf)
    # merge: higher priority wins; equal priority keeps the later expiry; expired is replaced
    p.touch(a[0])
    p.set_retention([a[0]], 50, 20.0)
    assert p.retention(a[0]) == (80, math.inf)
    p.touch(a[4])
    p.set_retention([a[4]], 40, 20.0)
    p.set_retention([a[4]], 40, 30.0)
    p.set_retention([a[4]], 40, 25.0)
    assert p.retention(a[4]) == (40, 30.0)
    clock.t = 31.0
    p.set_retention([a[4]], 20, math.inf)
    assert p.retention(a[4]) == (20, math.inf)
    p.free([a[4], a[0]])
    assert p.free_order() == [6, 7, a[2], a[4], a[3], a[1], a[0]]
    # evicting drops the claim; unpublished pages take no claim
    got = p.allocate(7)
    assert got == [6, 7, a[2], a[4], a[3], a[1], a[0]]
    assert all(p.retention(b) == (-1, math.inf) for b in range(8))
    p.set_retention(got, 90, math.inf)
    assert all(p.retention(b) == (-1, math.inf) for b in range(8))
    p.check_invariants()


@pytest.mark.parametrize("Pool", [RefPool, FastPool], ids=["kvref", "kvfast"])
def test_pool_set_retention_validates_before_any_change(Pool):
    p = Pool(4)
    (b,) = p.allocate(1)
    p.publish(b, b"h", [1])
    for args, exc, text in [
        (([b], 101, math.inf), ValueError, "priority=101"),
        (([b], True, math.inf), TypeError, "priority=True"),
        (([b], 50, float("nan")), ValueError, "expiry=nan"),
        (([b], 50, "soon"), TypeError, "expiry='soon'"),
        (([b, 9], 50, math.inf), IndexError, "block 9"),
    ]:
        with pytest.raises(exc, match=text):
            p.set_retention(*args)
        assert p.retention(b) == (-1, math.inf)


@pytest.mark.parametrize("pkg", PKGS)
def test_arguments_are_checked_with_their_name(pkg):
    with pytest.raises(ValueError, match=r"TextContext: retention_priority=101, must be in 0..100"):
        TextContext("a", [1, 2], retention_priority=101)
    with pytest.raises(TypeError, match=r"TextContext: retention_priority=1.5"):
        TextContext("a", [1, 2], retention_priority=1.5)
    with pytest.raises(ValueError, match=r"TextContext: retention_seconds=0"):
        TextContext("a", [1, 2], retention_seconds=0)
    with pytest.raises(TypeError, match=r"TextContext: retention_seconds='1'"):
        TextContext("a", [1, 2], retention_seconds="1")
    ctx = TextContext("a", [1, 2], retention_priority=70, retention_seconds=2.5)
    with pytest.raises(ValueError, match="retention_priority=-1"):
        ctx.retention_priority = -1
    assert (ctx.retention_priority, ctx.retention_seconds) == (70, 2.5)
    ctx.retention_seconds = None
    assert ctx.retention_seconds is None
    with pytest.raises(TypeError, match="PagedKVCacheManager: clock=3"):
        _manager(pkg, 9, clock=3, max_seq_len=32)
    cfg = KVCacheConfig(num_layers=1, max_seqs=2, max_seq_len=8, mode=KVCacheMode.PAGED, block_size=4)
    with pytest.raises(TypeError, match="KVCache.make: clock='x'"):
        pkg.KVCache.make(cfg, [KVLayerSpec.attention(kv_heads=1, head_dim=2)], clock="x")
    cache = pkg.KVCache.make(cfg, [KVLayerSpec.attention(kv_heads=1, head_dim=2)])
    before = (cache.seq_lens().tolist(), cache._free_order())
    with pytest.raises(ValueError, match=r"admit: retention_priority=200, must be in 0..100"):
        cache.admit(0, [1, 2, 3], retention_priority=200)
    with pytest.raises(ValueError, match=r"retire: retention_seconds=-1"):
        cache.retire(0, [1, 2, 3], retention_seconds=-1)
    assert (cache.seq_lens().tolist(), cache._free_order()) == before


# ---------------------------------------------------------------- slot cache claims


@pytest.mark.parametrize("pkg", PKGS)
def test_slot_cache_admit_and_retire_claims(pkg):
    clock = Clock(0.0)
    cfg = KVCacheConfig(num_layers=1, max_seqs=2, max_seq_len=16, mode=KVCacheMode.PAGED, block_size=4,
                        num_blocks=9)
    cache = pkg.KVCache.make(cfg, [KVLayerSpec.attention(kv_heads=1, head_dim=2)], clock=clock)

    def go(toks, **kw):
        hit = cache.admit(0, toks, **kw)
        cache.prepare_step([0, len(toks) - hit], [hit], [0])
        cache.update_position(0, len(toks))
        cache.retire(0, toks, **kw)
        return hit

    sysp = list(range(100, 109))
    go(sysp, retention_priority=80)
    for i in range(5):  # 15 one-off blocks through a pool of 8: LRU alone would lose the system prompt
        go(list(range(1000 + 100 * i, 1009 + 100 * i)))
    assert go(sysp) == 8
    # admit's claim has its own time-to-live, counted from the admit
    go(list(range(3000, 3009)), retention_priority=60, retention_seconds=5)
    clock.t = 1.0
    cache.admit(0, list(range(3000, 3009)), retention_priority=70, retention_seconds=2)
    pool = cache._pool
    adopted = cache.paged_block_table()[0, :2].tolist()
    assert {pool.retention(b) for b in adopted} == {(70, 3.0)}
    cache.evict_batch(0)
    clock.t = 3.0
    order = cache._free_order()
    assert {pool.retention(b) for b in adopted} == {(-1, math.inf)}
    assert order.index(adopted[0]) > order.index(adopted[1])  # tail before head, at the back of level 35
    cache.check_invariants()


# ---------------------------------------------------------------- (d) kvref == kvfast


def _workload(pkg, seed: int):
    """A random mix of system-prompt and one-off requests with random priorities and TTLs
    under a moving clock; returns every hit and the final free order."""
    rng = np.random.default_rng(seed)
    clock = Clock(0.0)
    m = _manager(pkg, num_blocks=21, clock=clock)
    hits = []
    for i in range(60):
        clock.t += float(rng.uniform(0, 2))
        kind = rng.integers(3)
        if kind == 0:
            toks = SYSTEM[int(rng.integers(2))] + [int(x) for x in rng.integers(0, 50, 3)]
        else:
            toks = [int(x) for x in rng.integers(10_000 * (i + 1), 10_000 * (i + 1) + 500, int(rng.integers(5, 30)))]
        prio = int(rng.choice([0, 10, 35, 35, 35, 60, 80, 100]))
        ttl = None if rng.random() < 0.5 else float(rng.uniform(0.5, 8))
        hits.append(_serve(m, f"r{i}", toks, retention_priority=prio, retention_seconds=ttl))
    m.check_invariants()
    pool = m._pools[0]["full"]
    return hits, m._free_order(), [pool.retention(b) for b in range(21)]


@pytest.mark.parametrize("seed", range(4))
def test_kvref_and_kvfast_managers_agree(seed):
    assert _workload(kvref, seed) == _workload(kvfast, seed)


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "alloc1", "free", "publish", "retain", "touch", "tick", "peek", "reset"]),
        st.integers(0, 1_000_000),
        st.sampled_from([0, 5, 35, 35, 60, 100]),
        st.one_of(st.just(math.inf), st.floats(0.1, 6.0)),
    ),
    max_size=120,
)


@given(num_blocks=st.integers(3, 12), ops=_OPS)
def test_pools_evict_in_the_same_order(num_blocks, ops):
    clock = Clock(0.0)
    pools = [RefPool(num_blocks, clock=clock), FastPool(num_blocks, clock=clock)]
    held: list[int] = []  # one entry per reference
    for op, r, prio, ttl in ops:
        out = []
        if op in ("alloc", "alloc1"):
            n = r % 4 if op == "alloc" else 1
            for p in pools:
                try:
                    out.append(p.allocate(n) if op == "alloc" else [p.allocate_one()])
                except CapacityError:
                    out.append("full")
            if out[0] != "full":
                held += out[0]
        elif op == "free" and held:
            k = 1 + r % min(6, len(held))
            start = r % len(held)
            batch = list(dict.fromkeys(held[start : start + k]))
            for b in batch:
                held.remove(b)
            for p in pools:
                p.free(batch)
        elif op == "publish" and held:
            b = held[r % len(held)]
            h = bytes([b % 5, r % 3])
            out = [p.publish(b, h, [b % 3]) for p in pools]
        elif op == "retain":
            cand = held + pools[0].free_order() + [0]
            blocks = list(dict.fromkeys(cand[(r + j) % len(cand)] for j in range(r % 4)))
            for p in pools:
                p.set_retention(blocks, prio, clock.t + ttl)
        elif op == "touch":
            pub = [b for b in pools[0].free_order() if pools[0].is_published(b)]
            if pub:
                b = pub[r % len(pub)]
                for p in pools:
                    p.touch(b)
                held.append(b)
        elif op == "tick":
            clock.t += (r % 100) / 25
        elif op == "peek":
            out = [p.peek(r % 5) for p in pools]
        elif op == "reset" and r % 10 == 0:
            out = [p.reset_prefix_cache() for p in pools]
        if out:
            assert out[0] == out[1], (op, out)
        assert pools[0].free_order() == pools[1].free_order()
        assert [pools[0].retention(b) for b in range(num_blocks)] == [pools[1].retention(b) for b in range(num_blocks)]
        for p in pools:
            p.check_invariants()


def test_merge_rule():
    assert merge(-1, math.inf, 10, 5.0, 0.0) == (10, 5.0)  # no claim: the new one
    assert merge(80, 4.0, 10, 5.0, 4.0) == (10, 5.0)  # expired (<=): replaced
    assert merge(80, 4.0, 90, 1.0, 0.0) == (90, 1.0)  # higher priority wins, with its expiry
    assert merge(80, 4.0, 80, 9.0, 0.0) == (80, 9.0)  # equal priority: the later expiry
    assert merge(80, 4.0, 35, math.inf, 0.0) == (80, 4.0)  # lower: unchanged


@pytest.mark.parametrize("Pool", [RefPool, FastPool], ids=["kvref", "kvfast"])
def test_expiry_heap_stays_bounded_under_revivals(Pool):
    """A block freed with a time-to-live and revived by a hit, over and over, leaves stale heap
    entries; they are compacted away (amortised O(1)) and the order is unchanged."""
    clock = Clock(0.0)
    p = Pool(5, clock=clock)
    blocks = p.allocate(3)
    for i, b in enumerate(blocks):
        p.publish(b, bytes([i]), [i])
    for i in range(500):
        p.set_retention(blocks, 50, 1000.0 + i)
        p.free(blocks[::-1])
        assert len(p._heap) <= 2 * 5 + 64 + 3
        p.touch_many(blocks)
    p.free(blocks[::-1])
    assert p.free_order() == [4, blocks[2], blocks[1], blocks[0]]
    clock.t = 2000.0
    assert p.free_order() == [4, blocks[2], blocks[1], blocks[0]]
    assert all(p.retention(b) == (-1, math.inf) for b in blocks)
    p.check_invariants()
