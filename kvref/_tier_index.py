"""The entry index shared by the host and disk tiers: one lifecycle, two stores.

An entry is ``writing`` (reserved, bytes not landed) then ``ready``
(hittable); ``pins`` hold it while a transfer reads it; ``dead`` marks an
entry forgotten while pinned or being written, discarded once free. The
index is an ``OrderedDict`` in LRU order (least recently used first). A tier
subclass says how an entry's storage is given back (``_discard``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

import numpy as np

__all__ = ["EntryIndex"]


class EntryIndex:
    """Hash -> entry (with ``block_hash``, ``tokens``, ``state``, ``pins``, ``dead``), LRU by use."""

    def __init__(self):
        self._index: OrderedDict[bytes, object] = OrderedDict()

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
        """Ready, unpinned, live entries, least recently used first."""
        return (e for e in self._index.values() if e.state == "ready" and e.pins == 0 and not e.dead)

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
        for e in list(self._index.values()):
            e.dead = True
            if e.pins == 0 and e.state == "ready":
                self._discard(e)
