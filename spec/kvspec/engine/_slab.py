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

The batched calls (``claim_pristine``, ``claim_front``, ``take_pages``,
``take_idle``, ``drop_idle``) are each defined as a loop of the single-block
calls above (``claim_pristine_pages``: ``claim_pristine`` then ``take_pages``;
``free_pages``: a pool's free, then ``drop_idle``; ``allocate_pages``: a pool's
allocate, then ``take_pages``; ``touch_pages``: ``take_idle``, then a pool's
``touch_many``); an engine may
run them in one compiled pass (``kvfast``) but must leave exactly the state
the loop leaves. Pristine huge blocks are only ever taken from the
queue's front and never return to it, so they are always the ids
``h0 .. num_huge_blocks-1`` in ascending order at the front of the queue.

A slab leaf's pool (a ``kvspec.engine.BlockPool``) also provides
``unpublished_run(n)``: how many of the first ``n`` pages ``allocate`` would pop
(front first) are unpublished before the first published one; it reads the
eviction front as ``peek`` does (expired retention claims move first) and
changes nothing else.
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

    def take(self, hs) -> None:
        """For each huge block of ``hs`` in order (a page of it referenced again): off the parked
        queue if parked, ``live += 1``."""

    def drop(self, hs) -> None:
        """For each huge block of ``hs`` in order (a page of it went idle): ``live -= 1``; at 0 the
        block is parked at the back of the queue."""

    def claim_pristine(self, leaf: int, k: int) -> range:
        """Take up to ``k`` pristine huge blocks off the front of the parked queue and type them to
        ``leaf`` (``unpark`` + ``set_owner`` of each, front first); stops at the first typed block.
        Returns the blocks taken, a run of consecutive ids (see the module docstring)."""

    def claim_pristine_pages(self, leaf: int, n: int, ratio: int) -> range:
        """``claim_pristine(leaf, ceil(n / ratio))``, then ``take_pages`` of the first ``n`` pages of the
        blocks taken (all of their pages when fewer; ``ratio`` pages per block, ascending): the claim
        of a draw of ``n`` pages, which pops the granted pages first. Returns the blocks taken."""

    def claim_front(self, leaf: int, k: int) -> tuple[list[int], list[int]]:
        """Take the ``k`` front blocks off the parked queue (the caller checked ``k <= num_parked``)
        and type them to ``leaf`` (``front`` + ``unpark`` + ``set_owner`` of each, in order).
        Returns the blocks and their previous owners (``PRISTINE`` or a leaf), front first."""

    def take_pages(self, pages, ratio: int) -> None:
        """``take([p // ratio for p in pages])``: pages of a leaf with ``ratio`` pages per huge block
        were referenced (allocated)."""

    def take_idle(self, pages, ratio: int, ref_count) -> None:
        """``take`` of ``p // ratio`` for each page ``p`` of ``pages`` (distinct, none null) whose
        ``ref_count[p]`` is 0, in order: the pages are about to be touched, the idle ones revive."""

    def drop_idle(self, pages, ratio: int, ref_count) -> None:
        """``drop`` of ``p // ratio`` for each page ``p != 0`` of ``pages`` whose ``ref_count[p]`` is 0,
        in order: the pages were just freed, the ones that went idle release their huge blocks."""

    def free_pages(self, pool, pages, ratio: int, claim: tuple[int, float] | None = None) -> None:
        """A leaf's ``pages`` let go in one call: ``pool.free(pages)`` (with a retention claim
        ``(priority, expiry)``: ``pool.retain_free(pages, priority, expiry)``), then
        ``drop_idle(pages, ratio, pool.ref_count)``. ``pool`` is the leaf's ``BlockPool`` (``ratio``
        pages per huge block); an engine may convert the page ids once for both. The pool's errors
        are raised before the table changes."""

    def allocate_pages(self, pool, n: int, ratio: int) -> list[int]:
        """A leaf's draw of ``n`` pages in one call: ``pool.allocate(n)``, then ``take_pages`` of the
        pages drawn; returns them. The pool's ``CapacityError`` is raised before the table changes."""

    def touch_pages(self, pool, pages, ratio: int) -> int:
        """A leaf's ``pages`` (distinct, none null) referenced once more in one call:
        ``take_idle(pages, ratio, pool.ref_count)``, then ``pool.touch_many(pages)``, whose count of
        revived pages it returns."""

    def parked_order(self, limit: int | None = None) -> list[int]:
        """The parked queue front to back; with ``limit``, its first ``limit`` blocks (the slab's
        replay reads only as far as its draws reach)."""

    def owners(self) -> list[int]:
        """``owner`` of every huge block (a copy)."""

    def live_counts(self) -> list[int]:
        """``live`` of every huge block (a copy)."""
