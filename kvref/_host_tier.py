"""The host tier: a fixed arena of page-sized slots with its own prefix index (DESIGN §5).

The arena is one ``uint8 [num_slots, page_bytes]`` array that
``TieredConnector.attach`` takes from the page store (``store.alloc_host``:
pinned host memory on a GPU, plain NumPy memory on the CPU). In
bookkeeping-only mode there is no arena (``arena is None``): the index, the
slot accounting and the LRU run as usual and no byte is stored. Slots are
handed out lazily (a counter plus a list of released slots), so a huge arena
costs memory only for the entries it holds (spec/tiers.md §11).

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
    """A ready block pushed out of the host tier. ``wanted``: the caller asked
    for it (write-back); ``data`` is then a copy of its slot bytes (None in
    bookkeeping-only mode, where there are no bytes)."""

    block_hash: bytes
    tokens: np.ndarray
    data: np.ndarray | None = field(default=None)
    wanted: bool = False


class HostTier(EntryIndex):
    """Fixed arena of ``num_slots`` slots of ``page_bytes`` bytes, LRU by use.

    Parameters
    ----------
    num_slots : int
        Slots in the arena (``host_bytes // page_bytes``; may be 0).
    page_bytes : int
        Bytes of one device page (one block, every layer's K and V).
    arena : ndarray uint8 [num_slots, page_bytes] or None
        The slot bytes; None in bookkeeping-only mode.
    """

    def __init__(self, num_slots: int, page_bytes: int, arena: np.ndarray | None = None):
        self.num_slots = num_slots
        self.page_bytes = page_bytes
        #: uint8 [num_slots, page_bytes]: the slot bytes (None: bookkeeping only).
        self.arena = arena
        # Slots never used are handed out in ascending order (a counter); a released
        # slot is reused first, last released first.
        self._fresh = 0
        self._released: list[int] = []
        super().__init__()

    # ------------------------------------------------------------------ queries

    @property
    def used_slots(self) -> int:
        return self._fresh - len(self._released)

    def _pop_slot(self) -> int:
        if self._released:
            return self._released.pop()
        self._fresh += 1
        return self._fresh - 1

    # ------------------------------------------------------------------ mutations

    def reserve(self, block_hash: bytes, tokens: np.ndarray, *, copy_evicted: bool,
                ready: bool = False, own_tokens: bool = False) -> tuple[HostEntry | None, list[Evicted]]:
        """Reserve a slot for ``block_hash`` (state ``writing``), evicting the
        least recently used unpinned ready entry when no slot is free.

        ``ready=True`` (bookkeeping only: no bytes to copy) makes the entry
        ``ready`` at once, exactly as ``reserve`` then ``commit`` with nothing
        in between. ``own_tokens=True``: ``tokens`` is an int32 row the caller
        hands over (its own copy, never changed again), kept without a copy.
        Returns ``(None, [])`` when the hash already has an entry or every
        slot is busy (pinned or being written).
        """
        if block_hash in self._index:
            return None, []
        evicted: list[Evicted] = []
        if not (self._released or self._fresh < self.num_slots):  # no free slot
            victim = self._front()  # the least recently used evictable entry (one slot is needed)
            if victim is None:
                return None, []
            data = self.arena[victim.slot].copy() if copy_evicted and self.arena is not None else None
            evicted.append(Evicted(victim.block_hash, victim.tokens, data, wanted=copy_evicted))
            self._release(victim)
        slot = self._pop_slot()
        entry = HostEntry(bytes(block_hash), tokens if own_tokens else np.array(tokens, dtype=np.int32), slot,
                          "ready" if ready else "writing")
        self._add(entry)  # a ready entry is placed at once, the most recently used (as commit would)
        return entry, evicted

    def abort(self, entry: HostEntry) -> None:
        """Give up a ``writing`` entry: its slot returns to the free list."""
        self._release(entry)

    def _discard(self, entry: HostEntry) -> None:
        self._release(entry)

    def _release(self, entry: HostEntry) -> None:
        if self._index.get(entry.block_hash) is entry:
            self._remove(entry)  # spec/tiers.md §3.1: its claim goes with it
            self._released.append(entry.slot)

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """``AssertionError`` if the slots are not partitioned by the free list and the index."""
        p = "HostTier.check_invariants"
        slots = [e.slot for e in self._index.values()]
        assert len(set(slots)) == len(slots), f"{p}: a slot is held by two entries"
        assert not set(slots) & set(self._released), f"{p}: a held slot is also free"
        assert all(0 <= s < self._fresh <= self.num_slots for s in slots + self._released), (
            f"{p}: a slot outside [0, {self._fresh}) of {self.num_slots}"
        )
        assert len(slots) + len(self._released) == self._fresh, (
            f"{p}: {len(slots)} held + {len(self._released)} released != {self._fresh} slots handed out"
        )
        for h, e in self._index.items():
            assert e.block_hash == h, f"{p}: entry under {h.hex()[:12]} holds {e.block_hash.hex()[:12]}"
            assert e.pins >= 0, f"{p}: entry {h.hex()[:12]} pins={e.pins} < 0"
            assert e.state in ("writing", "ready"), f"{p}: entry {h.hex()[:12]} state={e.state!r}"
        self._check_levels()
