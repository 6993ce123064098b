"""The tier index's retention levels (kvref/_tier_index.py, spec/tiers.md §3.1) against a
straightforward model: the whole index sorted by level on every read (the implementation
before the per-level heaps). Random reservations, commits, pins, touches, claims, clock
steps, evictions, rejections and clears must give the same eviction order, claims and
LRU order; mutants of the order are caught."""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kvspec import retention as ret

from kvref import _tier_index
from kvref._tier_index import EntryIndex

N_HASHES = 4


def _h(i: int) -> bytes:
    return bytes([i + 1]) * 16


@dataclass(slots=True, eq=False)
class Entry:
    block_hash: bytes
    tokens: np.ndarray
    state: str = "writing"
    pins: int = 0
    dead: bool = False


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Index(EntryIndex):
    """The index as a tier uses it: ``_discard`` removes the entry."""

    def _discard(self, entry) -> None:
        if self._index.get(entry.block_hash) is entry:
            self._remove(entry)


class Model:
    """The sorted-list model: LRU ``OrderedDict``, a claim dict, a full sort per read."""

    def __init__(self, clock) -> None:
        self._index: OrderedDict[bytes, Entry] = OrderedDict()
        self._claims: dict[bytes, tuple[int, float]] = {}
        self.clock = clock

    def _discard(self, entry) -> None:
        if self._index.get(entry.block_hash) is entry:
            self._remove(entry)

    def _add(self, entry) -> None:
        self._index[entry.block_hash] = entry

    def _remove(self, entry) -> None:
        del self._index[entry.block_hash]
        self._claims.pop(entry.block_hash, None)

    def _mark_dead(self, entry) -> None:
        entry.dead = True

    def ready_hashes(self):
        return [h for h, e in self._index.items() if e.state == "ready" and not e.dead]

    def _evictable(self):
        lru = [e for e in self._index.values() if e.state == "ready" and e.pins == 0 and not e.dead]
        now = self.clock()

        def level(e):
            c = self._claims.get(e.block_hash)
            return ret.DEFAULT_PRIORITY if c is None or c[1] <= now else c[0]

        return iter(sorted(lru, key=level))  # stable: LRU within a level

    def _victims(self, need, size):
        out, freed = [], 0
        for e in self._evictable():
            if freed >= need:
                break
            out.append(e)
            freed += size(e)
        return out

    def retention(self, h):
        c = self._claims.get(h)
        if c is None or h not in self._index or c[1] <= self.clock():
            return ret.NO_CLAIM, ret.NEVER
        return c

    def set_retention(self, hashes, priority, expiry):
        for h in hashes:
            e = self._index.get(h)
            if e is not None and e.dead:
                continue
            old = self._claims.pop(h, None)
            self._claims[h] = (priority, expiry) if old is None else ret.merge(*old, priority, expiry, self.clock())

    def commit(self, entry):
        if entry.dead:
            self._discard(entry)
            return
        entry.state = "ready"
        self._index.move_to_end(entry.block_hash)

    def pin(self, entry):
        entry.pins += 1

    def unpin(self, entry):
        entry.pins -= 1
        if entry.pins == 0 and entry.dead:
            self._discard(entry)

    def touch(self, hashes):
        for h in hashes:
            e = self._index.get(h)
            if e is not None and not e.dead:
                self._index.move_to_end(h)

    def clear(self):
        self._claims.clear()
        for e in list(self._index.values()):
            e.dead = True
            if e.pins == 0 and e.state == "ready":
                self._discard(e)


ids = st.integers(0, N_HASHES - 1)
_ARGS = {
    "add": st.tuples(st.just("add"), ids, st.booleans()),
    "claim": st.tuples(st.just("claim"), st.lists(ids, min_size=1, max_size=3),
                       st.sampled_from([0, 20, 35, 50, 80, 100]), st.one_of(st.just(math.inf), st.integers(-1, 4))),
    "tick": st.tuples(st.just("tick"), st.integers(0, 3)),
    "touch": st.tuples(st.just("touch"), st.lists(ids, max_size=3)),
    "evict": st.tuples(st.just("evict"), st.integers(1, 3)),
    "clear": st.tuples(st.just("clear")),
}
#: reservations, claims and clock steps weighted up; a clear is rare
_KINDS = ["add"] * 6 + ["claim"] * 4 + ["tick"] * 3 + ["touch"] * 2 + [
    "commit", "commit", "pin", "unpin", "evict", "reject", "abort"] + ["add"] * 4 + ["clear"]
ops = st.sampled_from(_KINDS).flatmap(lambda k: _ARGS[k] if k in _ARGS else st.tuples(st.just(k), ids))


def _apply(ix, clock: Clock, op) -> None:
    kind = op[0]
    if kind == "add":
        h = _h(op[1])
        if h not in ix._index:
            ix._add(Entry(h, np.array([op[1]], np.int32), state="ready" if op[2] else "writing"))
        return
    if kind == "touch":
        ix.touch([_h(i) for i in op[1]])
        return
    if kind == "claim":
        expiry = op[3] if op[3] == math.inf else clock.t + op[3]  # may lie in the past
        ix.set_retention([_h(i) for i in op[1]], op[2], expiry)
        return
    if kind == "tick":
        clock.t += op[1]
        return
    if kind == "evict":  # as the host and disk tiers: take the front, then drop it
        for e in ix._victims(op[1], lambda e: 1):
            ix._discard(e)
        return
    if kind == "clear":
        ix.clear()
        return
    e = ix._index.get(_h(op[1]))
    if e is None:
        return
    if kind == "commit" and e.state == "writing":
        ix.commit(e)
    elif kind == "pin" and e.state == "ready" and not e.dead:
        ix.pin(e)
    elif kind == "unpin" and e.pins > 0:
        ix.unpin(e)
    elif kind == "reject" and e.state == "ready" and not e.dead:
        ix._mark_dead(e)
        if e.pins == 0:
            ix._discard(e)
    elif kind == "abort" and e.state == "writing" and e.pins == 0:
        ix._discard(e)


def _observe(ix) -> tuple:
    order = [e.block_hash for e in ix._evictable()]
    claims = [ix.retention(_h(i)) for i in range(N_HASHES)]
    return order, claims, ix.ready_hashes()


def _run(ops_list, index_cls=Index) -> None:
    clock = Clock()
    ix = index_cls()
    ix.clock = clock
    model = Model(clock)
    for step, op in enumerate(ops_list):
        _apply(ix, clock, op)
        _apply(model, clock, op)
        got, want = _observe(ix), _observe(model)
        assert got == want, f"step {step} {op}: index {got} != model {want}"
        if index_cls is Index:  # the front a reservation evicts is the order's first entry
            front = ix._front()
            assert (front and front.block_hash) == (got[0][0] if got[0] else None), f"step {step} {op}: front"
        ix._check_levels()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, min_size=8, max_size=60))
def test_eviction_order_matches_the_sorted_model(ops_list):
    _run(ops_list)


def test_victims_peek_without_changing_anything():
    clock = Clock()
    ix = Index()
    ix.clock = clock
    for i in range(5):
        ix._add(Entry(_h(i), np.array([i], np.int32), state="ready"))
    ix.set_retention([_h(0)], 80, 3.0)
    before = [e.block_hash for e in ix._evictable()]
    assert [e.block_hash for e in ix._victims(2, lambda e: 1)] == before[:2]
    it = ix._evictable()
    next(it)
    it.close()  # abandoned early: the front is put back
    assert [e.block_hash for e in ix._evictable()] == before == [_h(i) for i in (1, 2, 3, 4, 0)]
    clock.t = 3.0  # 0's claim expired: back at level 35 as the least recently used
    assert [e.block_hash for e in ix._evictable()] == [_h(i) for i in range(5)]
    ix._check_levels()


def test_stale_items_are_compacted():
    ix = Index()
    ix.clock = Clock()
    for i in range(3):
        ix._add(Entry(_h(i), np.array([i], np.int32), state="ready"))
    for _ in range(1000):
        ix.touch([_h(0), _h(1), _h(2)])
        ix.set_retention([_h(1)], 50, ix.clock() + 1.0)
        ix.retention(_h(1))  # a read: the logged touch and claim are applied (their heap items pushed)
        ix.clock.t += 0.5
    assert not ix._log  # everything applied: the bounds below are of the applied index
    assert sum(map(len, ix._heaps.values())) <= 2 * 3 + 2 * _tier_index._SLACK
    assert len(ix._expiries) <= 2 + _tier_index._SLACK + 1
    ix._check_levels()


class _LruOnly(Index):
    """Mutant: ignores the levels (plain LRU)."""

    def _place(self, h, level):
        super()._place(h, ret.DEFAULT_PRIORITY)

    def _check_levels(self):
        pass


class _ExpiredToBack(Index):
    """Mutant: an expired claim's entry goes to the back of level 35 (the block pool's rule)."""

    def _expire(self, now):
        moved = [h for (x, h) in self._expiries if x <= now and h in self._at]
        super()._expire(now)
        for h in moved:
            if h in self._at:
                self._bump(h)  # a fresh rank, the index's LRU order unchanged
                self._unplace(h)
                self._place(h, self._level(h))

    def _check_levels(self):
        pass


class _NoExpiry(Index):
    """Mutant: claims never expire."""

    def _expire(self, now):
        pass

    def retention(self, h):
        c = self._claims.get(h)
        return (ret.NO_CLAIM, ret.NEVER) if c is None else c

    def _check_levels(self):
        pass


#: Two ready entries, a claim of priority 50 on the older one that expires at the next tick: the
#: claim puts it behind the other (level 50 after 35), the expiry back in front (level 35 at its
#: own LRU rank). Each mutant gets one of the two orders wrong.
_FIXED = [("add", 0, True), ("add", 1, True), ("claim", [0], 50, 1), ("tick", 2), ("touch", [])]


def test_the_fixed_sequence_passes_the_index():
    _run(_FIXED)


@pytest.mark.parametrize("mutant", [_LruOnly, _ExpiredToBack, _NoExpiry])
def test_the_comparison_catches_a_broken_order(mutant):
    @settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(ops, min_size=8, max_size=60))
    @example(_FIXED)  # found every time, whatever the random search finds besides
    def check(ops_list):
        _run(ops_list, mutant)

    with pytest.raises(AssertionError):
        check()
