"""The host tier: a fixed arena of page-sized slots with its own prefix index (DESIGN §5).

The arena is one ``uint8 [num_slots, page_bytes]`` NumPy array allocated at
``TieredConnector.attach``; on a GPU the fast path (``kvfast``) allocates it
as pinned host memory so copies to and from device pages run on a copy
engine. Here it is plain memory.

Entries move through three states:

* ``writing``: a slot is reserved for an offload (or a promotion from disk)
  whose copy has not landed; invisible to ``lookup`` and ``load``;
* ``ready``: the slot holds the block's bytes; hittable;
* ``dead``: forgotten (``reset_prefix_cache``) while a copy still reads or
  writes the slot; invisible, and its slot is released when the last pin or
  the in-flight write lets go.

An entry stays in the index until its slot is released, so a second
offload of the same hash never races the first. Recency is LRU by use:
``OrderedDict`` order, least recent first.

This class is **not** thread-safe: ``TieredConnector`` holds its lock around
every call. Slot bytes are copied outside the lock, protected by the entry
state (``writing``) or by pins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ._tier_index import EntryIndex

__all__ = ["HostTier", "HostEntry"]


@dataclass(slots=True, eq=False)
class HostEntry:
    """One block held (or being written) in a host slot."""

    block_hash: bytes
    tokens: np.ndarray
    slot: int
    state: str = "writing"
    pins: int = 0
    dead: bool = False


@dataclass(slots=True)
class Evicted:
    """A ready block pushed out of the host tier; ``data`` is a copy of its slot
    bytes when the caller asked for it (write-back), else None."""

    block_hash: bytes
    tokens: np.ndarray
    data: np.ndarray | None = field(default=None)


class HostTier(EntryIndex):
    """Fixed arena of ``num_slots`` slots of ``page_bytes`` bytes, LRU by use.

    Parameters
    ----------
    num_slots : int
        Slots in the arena (``host_bytes // page_bytes``; may be 0).
    page_bytes : int
        Bytes of one device page (one block, every layer's K and V).
    """

    def __init__(self, num_slots: int, page_bytes: int):
        self.num_slots = num_slots
        self.page_bytes = page_bytes
        #: uint8 [num_slots, page_bytes]: the slot bytes.
        self.arena = np.zeros((num_slots, page_bytes), dtype=np.uint8)
        # pop() hands out the lowest slot first
        self._free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        super().__init__()

    # ------------------------------------------------------------------ queries

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free_slots)

    # ------------------------------------------------------------------ mutations

    def reserve(self, block_hash: bytes, tokens: np.ndarray, *, copy_evicted: bool) -> tuple[HostEntry | None, list[Evicted]]:
        """Reserve a slot for ``block_hash`` (state ``writing``), evicting the
        least recently used unpinned ready entry when no slot is free.

        Returns ``(None, [])`` when the hash already has an entry or every slot
        is busy (pinned or being written).
        """
        if block_hash in self._index:
            return None, []
        evicted: list[Evicted] = []
        if not self._free_slots:
            victim = next(self._evictable(), None)
            if victim is None:
                return None, []
            data = self.arena[victim.slot].copy() if copy_evicted else None
            evicted.append(Evicted(victim.block_hash, victim.tokens, data))
            self._release(victim)
        slot = self._free_slots.pop()
        entry = HostEntry(bytes(block_hash), np.array(tokens, dtype=np.int32), slot)
        self._index[entry.block_hash] = entry
        return entry, evicted

    def abort(self, entry: HostEntry) -> None:
        """Give up a ``writing`` entry: its slot returns to the free list."""
        self._release(entry)

    def _discard(self, entry: HostEntry) -> None:
        self._release(entry)

    def _release(self, entry: HostEntry) -> None:
        if self._index.get(entry.block_hash) is entry:
            del self._index[entry.block_hash]
            self._free_slots.append(entry.slot)

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """``AssertionError`` if the slots are not partitioned by the free list and the index."""
        p = "HostTier.check_invariants"
        slots = [e.slot for e in self._index.values()]
        assert len(set(slots)) == len(slots), f"{p}: a slot is held by two entries"
        assert not set(slots) & set(self._free_slots), f"{p}: a held slot is also free"
        assert len(slots) + len(self._free_slots) == self.num_slots, (
            f"{p}: {len(slots)} held + {len(self._free_slots)} free != {self.num_slots} slots"
        )
        for h, e in self._index.items():
            assert e.block_hash == h, f"{p}: entry under {h.hex()[:12]} holds {e.block_hash.hex()[:12]}"
            assert e.pins >= 0, f"{p}: entry {h.hex()[:12]} pins={e.pins} < 0"
            assert e.state in ("writing", "ready"), f"{p}: entry {h.hex()[:12]} state={e.state!r}"
