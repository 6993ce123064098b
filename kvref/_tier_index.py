"""The entry index shared by the host and disk tiers: one lifecycle, two stores.

An entry is ``writing`` (reserved, bytes not landed) then ``ready``
(hittable); ``pins`` hold it while a transfer reads it; ``dead`` marks an
entry forgotten while pinned or being written, discarded once free. The
index is an ``OrderedDict`` in LRU order (least recently used first). A tier
subclass says how an entry's storage is given back (``_discard``).

Retention (spec/tiers.md §3.1): an entry may hold a claim ``(priority,
expiry)`` merged by ``set_retention`` (``kvspec.retention.merge``, expiry on
``clock``); eviction takes the lowest level first (an entry without a claim,
or whose claim expired, is at level 35), least recently used within a level.
Without any claim the order is plain LRU and costs nothing extra.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Iterable

import numpy as np

from kvspec import retention as _ret

__all__ = ["EntryIndex"]

#: Claims kept for hashes that have no entry yet (their offload is queued or in flight).
_PENDING = 4096


class EntryIndex:
    """Hash -> entry (with ``block_hash``, ``tokens``, ``state``, ``pins``, ``dead``), LRU by use."""

    def __init__(self):
        self._index: OrderedDict[bytes, object] = OrderedDict()
        #: retention claims by hash: (priority, expiry on ``clock``); only hashes with an entry count
        self._claims: dict[bytes, tuple[int, float]] = {}
        #: seconds for claim expiries (the connector assigns its own)
        self.clock = time.monotonic

    def _discard(self, entry) -> None:  # the tier's own: free its slot or delete its file
        raise AssertionError(f"{type(self).__name__} must define _discard")

    # ------------------------------------------------------------------ queries

    def get(self, block_hash: bytes, tokens: np.ndarray):
        """The ready entry of ``block_hash`` whose stored tokens equal ``tokens``, else None."""
        e = self._index.get(block_hash)
        if e is None or e.dead or e.state != "ready":
            return None
        # DESIGN §6: a hash is a key, never a proof; the stored tokens must match.
        if not np.array_equal(e.tokens, tokens):
            return None
        return e

    def has_entry(self, block_hash: bytes) -> bool:
        """True while ``block_hash`` has any entry (ready, writing or dead)."""
        return block_hash in self._index

    def ready_hashes(self) -> list[bytes]:
        """Hashes of the hittable entries, least recently used first (for tests)."""
        return [h for h, e in self._index.items() if e.state == "ready" and not e.dead]

    def _evictable(self):
        """Ready, unpinned, live entries in eviction order: lowest retention level first,
        least recently used first within a level (plain LRU while no entry holds a claim)."""
        lru = (e for e in self._index.values() if e.state == "ready" and e.pins == 0 and not e.dead)
        if not self._claims:
            return lru
        return iter(sorted(lru, key=self._level_at(self.clock())))  # stable: LRU within a level

    def _level_at(self, now: float):
        claims = self._claims

        def level(entry) -> int:
            c = claims.get(entry.block_hash)
            return _ret.DEFAULT_PRIORITY if c is None or c[1] <= now else c[0]

        return level

    def retention(self, block_hash: bytes) -> tuple[int, float]:
        """The claim of ``block_hash``'s entry: ``(priority, expiry)``; ``(-1, inf)`` without one
        (or an expired one)."""
        c = self._claims.get(block_hash)
        if c is None or block_hash not in self._index or c[1] <= self.clock():
            return _ret.NO_CLAIM, _ret.NEVER
        return c

    def set_retention(self, hashes: Iterable[bytes], priority: int, expiry: float) -> None:
        """Merge the claim ``(priority, expiry)`` into each hash's claim. A hash without an
        entry yet keeps the claim for the entry its offload (still queued or in flight)
        creates; the claims of hashes that never get one are dropped past a bound
        (``_PENDING`` beyond twice the entries, oldest first: amortised O(1))."""
        now = None
        claims = self._claims
        for h in hashes:
            e = self._index.get(h)
            if e is not None and e.dead:
                continue
            old = claims.pop(h, None)  # re-inserted: the most recent claim is the last to go
            if old is None:
                claims[h] = (priority, expiry)
                continue
            if now is None:
                now = self.clock()
            claims[h] = _ret.merge(old[0], old[1], priority, expiry, now)
        if len(claims) > 2 * len(self._index) + _PENDING:
            index = self._index
            pending = [h for h in claims if h not in index]
            for h in pending[: len(pending) - _PENDING]:
                del claims[h]

    # ------------------------------------------------------------------ lifecycle

    def commit(self, entry) -> None:
        """The bytes of a ``writing`` entry landed: make it hittable (most
        recently used), or discard it if it was forgotten meanwhile."""
        if entry.dead:
            self._discard(entry)
            return
        entry.state = "ready"
        self._index.move_to_end(entry.block_hash)

    def pin(self, entry) -> None:
        entry.pins += 1

    def unpin(self, entry) -> None:
        entry.pins -= 1
        if entry.pins == 0 and entry.dead:
            self._discard(entry)

    def touch(self, hashes: Iterable[bytes]) -> None:
        """Make the given hashes most recently used, in the order given (the
        last one ends up most recent)."""
        for h in hashes:
            e = self._index.get(h)
            if e is not None and not e.dead:
                self._index.move_to_end(h)

    def clear(self) -> None:
        """Forget every entry; those still read or written are discarded when they end."""
        self._claims.clear()
        for e in list(self._index.values()):
            e.dead = True
            if e.pins == 0 and e.state == "ready":
                self._discard(e)
