"""The slab table protocol: huge blocks shared by a manager's leaves (``spec/manager.md`` §13).

A multi-leaf manager keeps one byte slab per replica, cut into huge blocks
``0 .. num_huge_blocks-1`` (0 = the null block). The policy that decides which
leaf claims which huge block, and when one returns, is written once
(``kvref.Slab``); it keeps its state in a ``SlabTable``: who owns each huge
block, how many of its pages are referenced, and the **parked queue** of huge
blocks no page of which is referenced (FIFO: parked at the back, claimed from
the front; pristine blocks ``1 .. H-1`` start it in ascending order).

Implementations: ``kvref.ReferenceSlabTable`` (lists and an ordered dict) and
``kvfast``'s table (int32 arrays and an intrusive parked list). Both are O(1)
per operation and give identical answers for identical calls.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["PRISTINE", "SlabTable"]

#: ``owner[h]`` of a huge block no leaf has typed yet.
PRISTINE = -1


@runtime_checkable
class SlabTable(Protocol):
    """Owners, live page counts and the parked queue of one slab's huge blocks.

    Attributes
    ----------
    num_huge_blocks : int
        Huge blocks including the null block 0.
    num_leaves : int
        Leaves sharing the slab; owners are ``0 .. num_leaves-1`` or ``PRISTINE``.
    owner : sequence of int
        ``owner[h]``: the leaf huge block ``h`` is typed to, or ``PRISTINE``.
    live : sequence of int
        ``live[h]``: referenced pages of huge block ``h``.
    """

    num_huge_blocks: int
    num_leaves: int

    @property
    def num_parked(self) -> int:
        """Huge blocks on the parked queue."""

    def parked_typed(self, leaf: int) -> int:
        """Parked huge blocks typed to ``leaf``."""

    def front(self) -> int:
        """The parked queue's front (the block a claim takes); 0 when the queue is empty."""

    def is_parked(self, h: int) -> bool:
        """Whether ``h`` is on the parked queue."""

    def park(self, h: int) -> None:
        """Append ``h`` to the back of the parked queue."""

    def unpark(self, h: int) -> None:
        """Take ``h`` off the parked queue (from anywhere in it)."""

    def set_owner(self, h: int, leaf: int) -> None:
        """Type ``h`` to ``leaf``."""

    def add_live(self, h: int, delta: int) -> int:
        """``live[h] += delta``; returns the new count."""

    def take(self, hs) -> None:
        """For each huge block of ``hs`` in order (a page of it referenced again): off the parked
        queue if parked, ``live += 1``."""

    def drop(self, hs) -> None:
        """For each huge block of ``hs`` in order (a page of it went idle): ``live -= 1``; at 0 the
        block is parked at the back of the queue."""

    def parked_order(self) -> list[int]:
        """The parked queue front to back (for tests)."""

    def owners(self) -> list[int]:
        """``owner`` of every huge block (a copy)."""

    def live_counts(self) -> list[int]:
        """``live`` of every huge block (a copy)."""
