"""The entry index shared by the host and disk tiers: one lifecycle, two stores.

An entry is ``writing`` (reserved, bytes not landed) then ``ready``
(hittable); ``pins`` hold it while a transfer reads it; ``dead`` marks an
entry forgotten while pinned or being written, discarded once free. The
index is an ``OrderedDict`` in LRU order (least recently used first). A tier
subclass says how an entry's storage is given back (``_discard``) and adds
and removes entries through ``_add`` / ``_remove`` (``_mark_dead`` forgets one
still in use).

Retention (spec/tiers.md §3.1): an entry may hold a claim ``(priority,
expiry)`` merged by ``set_retention`` (``kvspec.retention.merge``, expiry on
``clock``); eviction takes the lowest level first (an entry without a claim,
or whose claim expired, is at level 35), least recently used within a level.

The evictable entries (ready, unpinned, live) are kept per level, as the
block pool keeps its free pages (``kvref/_block_pool.py``), so that no
operation scans the index. Each entry has an LRU rank (a counter bumped
whenever it becomes the most recently used); each level keeps its
evictable entries in rank order in two parts, merged when read:

* an ``OrderedDict`` of the entries placed or touched as the level's most
  recent (a new or committed entry, a touch: the common case), appended at
  the end and moved to the end by a touch, O(1) each;
* a min-heap of ``(rank, seq, hash)`` for an entry placed behind the
  dictionary's last one (an unpinned entry, a claim's level change, an
  expired claim's move to level 35: each at its own rank), whose item is
  live while ``_at[hash] == (level, seq)`` (a move or a touch leaves it
  stale, skipped when read; a heap holding more than twice the level's
  entries plus 64 is compacted: amortised O(1)). A touch takes an entry out
  of the heap into the dictionary, so a live item's rank is its entry's.

``_at[hash]`` is ``(level, 0)`` for an entry of the dictionary. The front
of a level is the smaller rank of the dictionary's first entry and the
heap's first live item: O(1) in the common case. The claims with a finite
expiry are a min-heap ``(expiry, hash)``; claims whose expiry passed are
dropped before the eviction front is read, their entries moving to level 35
at their own rank (so between the entries of level 35 in LRU order, exactly
as if they had never held a claim). Every operation is O(log n) or
amortised O(1).

``touch`` and ``set_retention`` are logged, not applied: the caller (the scheduler thread at
``release``) pays one C-level copy of the hashes, and the log is applied, in call order, by the next
operation that reads or changes ranks, claims, levels or the LRU order (every method but
``get``, ``has_entry``, ``touch`` and ``set_retention``, which read none of them), usually a
worker's reservation. A logged claim carries the clock read at its call, so the merge is the
one the call would have made; the log is applied on the caller once it holds more hashes than
the index entries plus ``_LOG_SLACK`` (amortised O(1) per hash, bounded memory).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np
from kvspec import retention as _ret

__all__ = ["EntryIndex"]

#: Claims kept for hashes that have no entry yet (their offload is queued or in flight).
_PENDING = 4096
#: Stale heap items tolerated beyond the live ones before a heap is compacted.
_SLACK = 64
#: Logged hashes tolerated beyond the index's entries before the log is applied on the caller.
_LOG_SLACK = 4096
_DEFAULT = _ret.DEFAULT_PRIORITY
_NEVER = _ret.NEVER


class EntryIndex:
    """Hash -> entry (with ``block_hash``, ``tokens``, ``state``, ``pins``, ``dead``), LRU by use."""

    def __init__(self):
        self._index: OrderedDict[bytes, object] = OrderedDict()
        #: retention claims of hashes with an entry: (priority, expiry on ``clock``); an expired
        #: claim may stay until the eviction front is next read (it counts as none)
        self._claims: dict[bytes, tuple[int, float]] = {}
        #: claims of hashes without an entry yet, the least recently claimed first
        self._pending: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        #: seconds for claim expiries (the connector assigns its own)
        self.clock = time.monotonic
        #: LRU rank of every entry of the index: larger is more recent (the index's order)
        self._rank: dict[bytes, int] = {}
        self._tick = 0
        #: evictable entries: hash -> (level, seq of its live heap item, or 0 in the level's dictionary)
        self._at: dict[bytes, tuple[int, int]] = {}
        self._seq = 0
        #: level -> its evictable entries placed or touched as its most recent, in rank order
        self._lru: dict[int, OrderedDict[bytes, None]] = {}
        #: level -> min-heap of (rank, seq, hash) of entries placed behind them, live items and stale ones
        self._heaps: dict[int, list[tuple[int, int, bytes]]] = {}
        #: level -> evictable entries at that level (levels without any are absent)
        self._count: dict[int, int] = {}
        #: (expiry, hash) of every claim in ``_claims`` with a finite expiry, and stale ones
        self._expiries: list[tuple[float, bytes]] = []
        #: touches ``(hashes, None, None, None)`` and claims ``(hashes, priority, expiry, now)`` not
        #: applied yet, in call order (``_sync`` applies them), and how many hashes they hold
        self._log: list[tuple] = []
        self._logged = 0

    def _discard(self, entry) -> None:  # the tier's own: free its slot or delete its file
        raise AssertionError(f"{type(self).__name__} must define _discard")

    # ------------------------------------------------------------------ queries

    def get(self, block_hash: bytes, tokens: np.ndarray):
        """The ready entry of ``block_hash`` whose stored tokens equal ``tokens``, else None."""
        e = self._index.get(block_hash)
        if e is None or e.dead or e.state != "ready":
            return None
        # DESIGN §6: a hash is a key, never a proof; the stored tokens must match.
        stored = e.tokens
        if (type(tokens) is np.ndarray and tokens.dtype == stored.dtype and stored.dtype.kind in "iu"
                and tokens.shape == stored.shape):
            same = stored.tobytes() == tokens.tobytes()  # the connector's int32 rows: ~20x cheaper
        else:
            same = np.array_equal(stored, tokens)
        return e if same else None

    def has_entry(self, block_hash: bytes) -> bool:
        """True while ``block_hash`` has any entry (ready, writing or dead)."""
        return block_hash in self._index

    def ready_hashes(self) -> list[bytes]:
        """Hashes of the hittable entries, least recently used first (for tests)."""
        self._sync()
        return [h for h, e in self._index.items() if e.state == "ready" and not e.dead]

    def _evictable(self):
        """Ready, unpinned, live entries in eviction order: lowest retention level first,
        least recently used first within a level (plain LRU while no entry holds a claim).

        A generator that takes the entries it yields off their heaps and puts them back
        when it ends: exhaust or ``close()`` it before changing the index (``_victims``)."""
        self._sync()
        if self._expiries:
            self._expire(self.clock())
        at, index, rank = self._at, self._index, self._rank
        taken: list[tuple[list, tuple[int, int, bytes]]] = []
        try:
            for level in sorted(self._count):
                heap = self._heaps.get(level, [])
                ordered = iter(self._lru.get(level, ()))
                h = next(ordered, None)  # the dictionary's next entry
                while True:  # the two parts merged by rank
                    while heap and at.get(heap[0][2]) != (level, heap[0][1]):
                        heapq.heappop(heap)  # stale: dropped for good
                    if heap and (h is None or heap[0][0] < rank[h]):
                        item = heapq.heappop(heap)
                        taken.append((heap, item))
                        yield index[item[2]]
                    elif h is not None:
                        yield index[h]
                        h = next(ordered, None)
                    else:
                        break
        finally:
            for heap, item in taken:
                heapq.heappush(heap, item)

    def _front(self):
        """The first entry of the eviction order (what ``_evictable`` yields first), or None when
        no entry is evictable; changes no entry. As the generator reads the front, stale heap
        items are dropped; the front entry stays where it is (its removal unplaces it)."""
        if self._log:
            self._sync()
        if self._expiries:
            self._expire(self.clock())
        if not self._count:
            return None
        # the lowest level with an evictable entry: the first of its dictionary or its heap
        level = min(self._count)
        ordered = self._lru.get(level)
        first = next(iter(ordered)) if ordered else None
        heap = self._heaps.get(level)
        if heap:
            at = self._at
            while heap and at.get(heap[0][2]) != (level, heap[0][1]):
                heapq.heappop(heap)  # stale: dropped for good
            if heap and (first is None or heap[0][0] < self._rank[first]):
                return self._index[heap[0][2]]
        if first is None:
            raise AssertionError(f"{type(self).__name__}._front: level {level} counts {self._count[level]} "
                                 "evictable entries and holds none")
        return self._index[first]

    def _victims(self, need: int, size) -> list:
        """The first entries of the eviction order whose ``size(entry)`` sum to at least
        ``need`` (all evictable entries if they do not); changes nothing."""
        out, freed = [], 0
        it = self._evictable()
        try:
            while freed < need:
                e = next(it, None)
                if e is None:
                    break
                out.append(e)
                freed += size(e)
        finally:
            it.close()
        return out

    def retention(self, block_hash: bytes) -> tuple[int, float]:
        """The claim of ``block_hash``'s entry: ``(priority, expiry)``; ``(-1, inf)`` without one
        (or an expired one)."""
        self._sync()
        c = self._claims.get(block_hash)
        if c is None or block_hash not in self._index or c[1] <= self.clock():
            return _ret.NO_CLAIM, _ret.NEVER
        return c

    def set_retention(self, hashes: Iterable[bytes], priority: int, expiry: float, now: float | None = None) -> None:
        """Merge the claim ``(priority, expiry)`` into each hash's claim. A hash without an
        entry yet keeps the claim for the entry its offload (still queued or in flight)
        creates; the claims of hashes that never get one are dropped past a bound
        (``_PENDING`` beyond twice the entries, oldest first: amortised O(1)).

        Logged with ``now`` (the clock read by the caller; None: read here), applied before
        the next read (see the module doc)."""
        hs = list(hashes)
        if hs:
            self._enlog(hs, priority, expiry, self.clock() if now is None else now)

    def _set_retention_now(self, hashes: list[bytes], priority: int, expiry: float, now: float) -> None:
        """``set_retention`` applied, merging at ``now`` (the clock when it was called)."""
        claims, pending, index, at = self._claims, self._pending, self._index, self._at
        for h in hashes:
            e = index.get(h)
            if e is not None and e.dead:
                continue
            old = claims.get(h) if e is not None else pending.pop(h, None)
            if old is None:
                new = (priority, expiry)
            elif old[0] == priority and old[1] == expiry:
                new = old  # the same claim again: merge gives it back
            else:
                new = _ret.merge(old[0], old[1], priority, expiry, now)
            if e is None:
                pending[h] = new  # re-inserted: the most recent claim is the last to go
                continue
            if new == old:
                continue
            claims[h] = new
            if new[1] != _NEVER:
                self._push_expiry(new[1], h)
            a = at.get(h)
            if a is not None and a[0] != new[0]:
                self._unplace(h)
                self._place(h, new[0])
        if len(claims) + len(pending) > 2 * len(index) + _PENDING:
            while len(pending) > _PENDING:  # each claim is dropped once: amortised O(1)
                pending.popitem(last=False)

    # ------------------------------------------------------------------ lifecycle

    def commit(self, entry) -> None:
        """The bytes of a ``writing`` entry landed: make it hittable (most
        recently used), or discard it if it was forgotten meanwhile."""
        self._sync()
        if entry.dead:
            self._discard(entry)
            return
        entry.state = "ready"
        h = entry.block_hash
        self._index.move_to_end(h)
        self._bump(h)
        if entry.pins == 0:
            self._unplace(h)
            self._place(h, self._level(h))

    def pin(self, entry) -> None:
        self._sync()
        entry.pins += 1
        if entry.pins == 1 and self._index.get(entry.block_hash) is entry:
            self._unplace(entry.block_hash)

    def unpin(self, entry) -> None:
        self._sync()
        entry.pins -= 1
        if entry.pins == 0:
            if entry.dead:
                self._discard(entry)
            elif entry.state == "ready" and self._index.get(entry.block_hash) is entry:
                self._place(entry.block_hash, self._level(entry.block_hash))

    def touch(self, hashes: Iterable[bytes]) -> None:
        """Make the given hashes most recently used, in the order given (the
        last one ends up most recent). Logged, applied before the next read (module doc)."""
        hs = list(hashes)
        if hs:
            self._enlog(hs)

    def _enlog(self, hs: list[bytes], priority: int | None = None, expiry: float | None = None,
               now: float | None = None) -> None:
        """Log a touch (``priority`` None) or a claim; applied on the caller once the log holds
        more hashes than the index has entries plus ``_LOG_SLACK`` (bounded memory)."""
        self._log.append((hs, priority, expiry, now))
        self._logged += len(hs)
        if self._logged > len(self._index) + _LOG_SLACK:
            self._sync()

    def _sync(self) -> None:
        """Apply the logged touches and claims, in call order."""
        if not self._log:
            return
        log, self._log, self._logged = self._log, [], 0
        for hs, priority, expiry, now in log:
            if priority is None:
                self._touch_now(hs)
            else:
                self._set_retention_now(hs, priority, expiry, now)

    def _touch_now(self, hashes: list[bytes]) -> None:
        """``touch`` applied."""
        index, rank, tick, at, lru = self._index, self._rank, self._tick, self._at, self._lru
        for h in hashes:
            e = index.get(h)
            if e is not None and not e.dead:
                index.move_to_end(h)
                tick += 1
                rank[h] = tick
                a = at.get(h)
                if a is not None:  # evictable: now its level's most recent (see the module doc)
                    if a[1]:  # out of the heap (its item goes stale) into the dictionary
                        at[h] = (a[0], 0)
                        lru[a[0]][h] = None
                    else:
                        lru[a[0]].move_to_end(h)
        self._tick = tick

    def clear(self) -> None:
        """Forget every entry; those still read or written are discarded when they end."""
        self._sync()
        self._claims.clear()
        self._pending.clear()
        self._expiries.clear()
        self._at.clear()
        self._lru.clear()
        self._heaps.clear()
        self._count.clear()
        for e in list(self._index.values()):
            e.dead = True
            if e.pins == 0 and e.state == "ready":
                self._discard(e)

    # ------------------------------------------------------------------ for the tiers

    def _add(self, entry) -> None:
        """Insert a new entry (its hash has none) as the most recently used; a claim made
        while its offload was queued becomes its claim."""
        if self._log:
            self._sync()
        h = entry.block_hash
        self._index[h] = entry
        self._bump(h)
        c = self._pending.pop(h, None) if self._pending else None
        if c is not None:
            self._claims[h] = c
            if c[1] != _NEVER:
                self._push_expiry(c[1], h)
        if entry.state == "ready" and entry.pins == 0 and not entry.dead:
            self._place(h, self._level(h))

    def _remove(self, entry) -> None:
        """Take ``entry`` (the index's entry of its hash) out of the index, its claim with it."""
        if self._log:
            self._sync()
        h = entry.block_hash
        del self._index[h]
        del self._rank[h]
        if self._claims:
            self._claims.pop(h, None)  # spec/tiers.md §3.1: a claim lives with its entry
        self._unplace(h)

    def _mark_dead(self, entry) -> None:
        """Forget ``entry``: never hit nor evicted again, discarded by its owner once free."""
        self._sync()
        entry.dead = True
        if self._index.get(entry.block_hash) is entry:
            self._unplace(entry.block_hash)

    # ------------------------------------------------------------------ retention levels

    def _bump(self, h: bytes) -> None:
        self._tick += 1
        self._rank[h] = self._tick

    def _level(self, h: bytes) -> int:
        """Level of ``h``'s claim; an expired claim still here is moved by the next ``_expire``."""
        c = self._claims.get(h)
        return _DEFAULT if c is None else c[0]

    def _place(self, h: bytes, level: int) -> None:
        """Make entry ``h`` evictable at ``level`` (at its own rank): at the end of the level's
        dictionary when it is the level's most recent, else on its heap."""
        n = self._count[level] = self._count.get(level, 0) + 1
        rank = self._rank[h]
        ordered = self._lru.get(level)
        if ordered is None:
            ordered = self._lru[level] = OrderedDict()
        if not ordered or self._rank[next(reversed(ordered))] < rank:
            ordered[h] = None
            self._at[h] = (level, 0)
            return
        self._seq += 1
        self._at[h] = (level, self._seq)
        heap = self._heaps.get(level)
        if heap is None:
            heap = self._heaps[level] = []
        heapq.heappush(heap, (rank, self._seq, h))
        if len(heap) > 2 * n + _SLACK:  # stale items of moved entries: amortised O(1)
            at = self._at
            heap[:] = [x for x in heap if at.get(x[2]) == (level, x[1])]
            heapq.heapify(heap)

    def _unplace(self, h: bytes) -> None:
        a = self._at.pop(h, None)
        if a is None:
            return
        level = a[0]
        if not a[1]:
            del self._lru[level][h]
        n = self._count[level] - 1
        if n:
            self._count[level] = n
        else:  # nothing live is left at this level (a heap holds stale items only)
            del self._count[level]
            self._lru.pop(level, None)
            self._heaps.pop(level, None)

    def _push_expiry(self, expiry: float, h: bytes) -> None:
        heapq.heappush(self._expiries, (expiry, h))
        if len(self._expiries) > 2 * len(self._claims) + _SLACK:
            claims = self._claims
            self._expiries = [x for x in self._expiries if (claims.get(x[1]) or (0, None))[1] == x[0]]
            heapq.heapify(self._expiries)

    def _expire(self, now: float) -> None:
        """spec/tiers.md §3.1: claims whose expiry passed are dropped (they count as none);
        their evictable entries move to level 35, at their own LRU rank."""
        ex, claims, at = self._expiries, self._claims, self._at
        while ex and ex[0][0] <= now:
            x, h = heapq.heappop(ex)
            c = claims.get(h)
            if c is None or c[1] != x:
                continue  # stale: the claim changed or went
            del claims[h]
            a = at.get(h)
            if a is not None and a[0] != _DEFAULT:
                self._unplace(h)
                self._place(h, _DEFAULT)

    def _check_levels(self) -> None:
        """``AssertionError`` unless the level heaps hold exactly the evictable entries at
        their claim's level, the ranks follow the index's order, and every finite claim
        has its expiry item (O(n); for tests and ``check_invariants``)."""
        self._sync()
        p = f"{type(self).__name__}._check_levels"
        ranks = [self._rank[h] for h in self._index]
        assert len(self._rank) == len(self._index), f"{p}: {len(self._rank)} ranks for {len(self._index)} entries"
        assert all(a < b for a, b in itertools.pairwise(ranks)), f"{p}: ranks out of the index's LRU order"
        want = {h for h, e in self._index.items() if e.state == "ready" and e.pins == 0 and not e.dead}
        assert set(self._at) == want, f"{p}: {len(self._at)} placed entries, {len(want)} evictable"
        items = {level: {x[1:]: x[0] for x in heap} for level, heap in self._heaps.items()}
        for h, (level, seq) in self._at.items():
            assert level == self._level(h), f"{p}: {h.hex()[:12]} at level {level}, claim {self._claims.get(h)}"
            if seq:  # its live heap item: (its rank, seq, h)
                assert items.get(level, {}).get((seq, h)) == self._rank[h], f"{p}: {h.hex()[:12]} not in its heap"
            else:
                assert h in self._lru.get(level, ()), f"{p}: {h.hex()[:12]} not in its level's dictionary"
        for level, ordered in self._lru.items():
            assert all(self._at.get(h) == (level, 0) for h in ordered), f"{p}: level {level}'s dictionary holds others"
            assert all(self._rank[a] < self._rank[b] for a, b in itertools.pairwise(ordered)), (
                f"{p}: level {level}'s dictionary out of rank order")
        counts: dict[int, int] = {}
        for level, _ in self._at.values():
            counts[level] = counts.get(level, 0) + 1
        assert counts == self._count, f"{p}: level counts {self._count} != {counts}"
        assert set(self._heaps) | set(self._lru) <= set(self._count), f"{p}: parts of empty levels"
        assert set(self._claims) <= set(self._index), f"{p}: a claim without an entry"
        assert not set(self._pending) & set(self._index), f"{p}: a pending claim of a hash with an entry"
        live = set(self._expiries)
        for h, (_, x) in self._claims.items():
            assert x == _NEVER or (x, h) in live, f"{p}: claim of {h.hex()[:12]} has no expiry item"
