"""Retention priority and time-to-live (spec/manager.md §14, spec/slot-cache.md §4.5).

Each scenario runs on the backend and on kvref and must give the same
observations (prefix hits, errors), which must also equal the golden values
written here (computed from the spec's rules, so a scenario guards kvref
too). Only public calls are used: ``TextContext(..., retention_priority=,
retention_seconds=)``, ``KVCache.admit/retire(..., retention_priority=,
retention_seconds=)``. Expiries use the real clock with wide margins (a
claim of 60 s never expires during a test; one of 0.05 s has expired after a
0.3 s sleep).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvspec import InsufficientBlocksError, KVCacheConfig, KVCacheMode, KVCacheParams, KVLayerSpec, TextContext
from kvspec.conformance._compare import capture
from kvspec.conformance.plugin import require

PAGE = 4


def _manager(backend, num_blocks: int, max_seq_len: int = 40):
    params = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=2, dtype="float32")
    return backend.build_manager(params, num_blocks=num_blocks, max_batch_size=2, max_seq_len=max_seq_len)


def _serve(m, rid: str, tokens, **retention) -> int:
    ctx = TextContext(rid, np.asarray(tokens, np.int32), **retention)
    m.claim(ctx)
    m.alloc(ctx)
    ctx.update(7)
    m.step(ctx)
    m.release(ctx)
    return ctx.cached_prefix_length


def _both(backend, oracle, scenario, caps=("manager", "prefix_caching")):
    """``scenario(backend)`` on both; the same observations (or the same error)."""
    require(backend, *caps)
    want = capture(lambda: scenario(oracle))
    got = capture(lambda: scenario(backend))
    assert not want.raised, f"kvref raised {want.exc!r}"
    assert not got.raised, f"backend raised {got.exc!r}; kvref returned {want.value!r}"
    assert got.value == want.value, f"backend observed {got.value!r}, kvref {want.value!r}"
    return want.value


SYSTEM = list(range(1000, 1016))  # 4 pages


def _burst(backend, system_priority: int, ttl=None, sleep: float = 0.0) -> list[int]:
    """The system prompt, then per round: a sleep, three one-off prompts of 6 pages each (a pool
    of 14 pages cannot keep them beside the system prompt), the system prompt again."""
    m = _manager(backend, num_blocks=15)
    hits = [_serve(m, "s0", SYSTEM + [1], retention_priority=system_priority, retention_seconds=ttl)]
    for r in range(3):
        time.sleep(sleep)
        for j in range(3):
            _serve(m, f"o{r}.{j}", [20_000 + 1000 * r + 100 * j + k for k in range(23)])
        hits.append(_serve(m, f"s{r + 1}", SYSTEM + [2 + r], retention_priority=system_priority,
                           retention_seconds=ttl))
    return hits


def test_priority_keeps_a_prefix_that_lru_evicts(kv_backend, kv_oracle):
    """spec/manager.md §14.4: levels are evicted lowest first; a priority-80 prefix survives a default burst."""
    assert _both(kv_backend, kv_oracle, lambda b: _burst(b, 80)) == [0, 16, 16, 16]
    assert _both(kv_backend, kv_oracle, lambda b: _burst(b, 35)) == [0, 0, 0, 0]


def test_a_live_time_to_live_keeps_the_priority(kv_backend, kv_oracle):
    """spec/manager.md §14.3: a claim with an expiry in the future acts like one without."""
    assert _both(kv_backend, kv_oracle, lambda b: _burst(b, 80, ttl=60.0)) == [0, 16, 16, 16]


def test_an_expired_claim_falls_back_to_lru(kv_backend, kv_oracle):
    """spec/manager.md §14.5: an expired claim is dropped; the page is plain LRU again and the burst evicts it."""
    assert _both(kv_backend, kv_oracle, lambda b: _burst(b, 80, ttl=0.05, sleep=0.3)) == [0, 0, 0, 0]


def test_low_priority_goes_before_older_default_pages(kv_backend, kv_oracle):
    """spec/manager.md §14.4: a priority-0 chain freed last is evicted before an older default chain."""

    def scenario(b):
        m = _manager(b, num_blocks=9, max_seq_len=32)  # 8 pages
        a, c = list(range(100, 113)), list(range(200, 213))  # 3 full pages each, 4 with the decode page
        _serve(m, "a", a)
        _serve(m, "c", c, retention_priority=0)
        _serve(m, "x", list(range(300, 311)))  # 3 pages: the front (2 unpublished), then c's tail
        return [_serve(m, "a2", a + [9]), _serve(m, "c2", c + [9])]

    assert _both(kv_backend, kv_oracle, scenario) == [12, 8]


def test_a_pool_of_priority_100_pages_still_serves_what_fits(kv_backend, kv_oracle):
    """spec/manager.md §14.6: retention never starves: priority only orders evictions; the count alone decides."""

    def scenario(b):
        m = _manager(b, num_blocks=9, max_seq_len=32)  # 8 pages
        _serve(m, "pinned", list(range(100, 131)), retention_priority=100)  # 7 published pages
        holder = TextContext("holder", np.array([1], np.int32))
        m.claim(holder)
        m.alloc(holder)  # takes the unpublished page: every free page has priority 100
        big = capture(lambda: _serve(m, "big", list(range(500, 529))))  # needs 8 pages
        fits = _serve(m, "fits", list(range(600, 627)))  # 7 pages
        m.release(holder)
        again = _serve(m, "pinned2", list(range(100, 131)))  # evicted by "fits"
        return [type(big.exc).__name__, fits, again]

    assert _both(kv_backend, kv_oracle, scenario) == [InsufficientBlocksError.__name__, 0, 0]


@pytest.mark.parametrize("value, exc, text", [
    (dict(retention_priority=101), ValueError, "TextContext: retention_priority=101, must be in 0..100"),
    (dict(retention_priority=True), TypeError, "TextContext: retention_priority=True"),
    (dict(retention_seconds=0), ValueError, "TextContext: retention_seconds=0"),
    (dict(retention_seconds=float("inf")), ValueError, "TextContext: retention_seconds=inf"),
    (dict(retention_seconds=10**400), ValueError, "TextContext: retention_seconds=1000"),  # past float: not OverflowError
])
def test_context_arguments_are_checked(value, exc, text):
    """spec/manager.md §14.1: each argument named with its value."""
    with pytest.raises(exc, match=text):
        TextContext("a", [1, 2], **value)


# ---------------------------------------------------------------- slot cache (spec/slot-cache.md §4.5)


def _cache(backend):
    require(backend, "paged")
    cfg = KVCacheConfig(num_layers=1, max_seqs=2, max_seq_len=16, mode=KVCacheMode.PAGED, block_size=4,
                        num_blocks=9, dtype="float32")
    return backend.build_cache(cfg, [KVLayerSpec.attention(1, 2)])


def _session(cache, toks, **kw) -> int:
    hit = cache.admit(0, toks, **kw)
    n = len(toks) - hit
    step = cache.prepare_step([0, n], [hit], [0])
    assert step is not None
    cache.update_position(0, len(toks))
    cache.retire(0, toks, **kw)
    return hit


def test_slot_cache_claims_order_eviction(kv_backend, kv_oracle):
    """``spec/slot-cache.md`` §4.5: retire's claim keeps a prefix through bursts of default sessions; a lower claim
    with a short time-to-live does not replace it; an admit's claim with a time-to-live that
    expired falls back to LRU."""

    def scenario(b):
        cache = _cache(b)
        sysp = list(range(100, 109))  # 2 full blocks
        out = [_session(cache, sysp, retention_priority=80)]
        for i in range(5):
            out.append(_session(cache, list(range(1000 + 100 * i, 1009 + 100 * i))))
        out.append(_session(cache, sysp))
        # a lower claim leaves the higher one (spec/manager.md §14.3): 60 with 0.05 s changes nothing
        out.append(_session(cache, sysp, retention_priority=60, retention_seconds=0.05))
        time.sleep(0.3)
        for i in range(5):
            out.append(_session(cache, list(range(3000 + 100 * i, 3009 + 100 * i))))
        out.append(_session(cache, sysp))
        other = list(range(5000, 5009))
        out.append(cache.admit(1, other, retention_priority=90, retention_seconds=0.05))  # a miss
        cache.evict_batch(1)  # nothing published: no claim
        out.append(_session(cache, other, retention_priority=90, retention_seconds=0.05))
        out.append(cache.admit(1, other, retention_priority=90, retention_seconds=0.05))  # a hit: claimed
        cache.evict_batch(1)
        time.sleep(0.3)  # expired: back to LRU, behind sysp (80)
        for i in range(5):
            out.append(_session(cache, list(range(6000 + 100 * i, 6009 + 100 * i))))
        out.append(_session(cache, other))
        out.append(_session(cache, sysp))
        return out

    assert _both(kv_backend, kv_oracle, scenario, ("paged",)) == [0, 0, 0, 0, 0, 0, 8, 8, 0, 0, 0, 0, 0, 8,
                                                                     0, 0, 8, 0, 0, 0, 0, 0, 0, 8]


@pytest.mark.parametrize("call, text", [
    ("admit", "admit: retention_priority=200, must be in 0..100"),
    ("retire", "retire: retention_seconds=-1"),
])
def test_slot_cache_arguments_are_checked_before_any_change(kv_backend, kv_oracle, call, text):
    def scenario(b):
        cache = _cache(b)
        before = cache.seq_lens().tolist()
        with pytest.raises(ValueError, match=text):
            if call == "admit":
                cache.admit(0, [1, 2, 3], retention_priority=200)
            else:
                cache.retire(0, [1, 2, 3], retention_seconds=-1)
        return [before, cache.seq_lens().tolist(), cache.admit(0, [1, 2, 3])]

    _both(kv_backend, kv_oracle, scenario, ("paged",))


# ---------------------------------------------------------------- the clock's readings (spec/manager.md §14.7)

class _FlakyClock:
    """Returns ``t``; after :meth:`fail_after` ``n`` good readings, ``bad`` (a user's broken clock)."""

    def __init__(self):
        self.t, self.left, self.bad = 1.0, None, None

    def fail_after(self, n: int, bad) -> None:
        self.left, self.bad = n, bad

    def __call__(self):
        if self.left is None:
            return self.t
        if self.left == 0:
            return self.bad
        self.left -= 1
        return self.t


@pytest.mark.parametrize("bad, exc", [(None, TypeError), (float("nan"), ValueError), (10**400, ValueError)])
def test_a_bad_clock_reading_changes_nothing(kv_backend, kv_oracle, bad, exc):
    """spec/manager.md §14.7: ``release`` reads its clock before it forgets the request; a bad
    reading is the documented error and the request stays claimed, its pages held; a clock
    that fails only on a second reading within one call does not stop the call."""
    def scenario(backend):
        clock = _FlakyClock()
        params = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=2, dtype="float32")
        m = backend.build_manager(params, num_blocks=9, max_batch_size=2, max_seq_len=24, clock=clock)
        ctx = TextContext("a", np.arange(100, 110, dtype=np.int32), retention_seconds=30.0)
        m.claim(ctx)
        m.alloc(ctx)
        ctx.update(7)
        m.step(ctx)
        clock.fail_after(0, bad)
        try:
            m.release(ctx)
            refused = None
        except (TypeError, ValueError) as e:
            refused = (type(e).__name__, "clock() returned" in str(e))
        clock.left = None
        m.check_invariants()
        claimed = m.contains(ctx.request_id)
        clock.fail_after(1, bad)
        m.release(ctx)  # one good reading, then bad: the release completes
        clock.left = None
        m.check_invariants()
        again = _serve(m, "b", np.arange(100, 110, dtype=np.int32))
        return [refused, claimed, again]

    assert _both(kv_backend, kv_oracle, scenario) == [(exc.__name__, True), True, 8]
