"""The block pool protocol: free list, reference counts and prefix index (DESIGN §4.2, §7).

One pool per paged storage: the slot cache has one, the request manager one
per replica and leaf (with several leaves each leaf's pool holds only the
pages of the slab's huge blocks it claimed, ``grant`` / ``revoke``,
spec/manager.md §13). A pool knows block ids only, never K/V bytes. The
policies (``kvref.KVCache``, ``kvref.PagedKVCacheManager``) decide *which*
blocks to allocate, touch, free and publish; a pool does it with the
allocation order below, which is part of the spec (block ids agree across
backends):

* the free list starts in ascending id order ``1 .. num_blocks-1`` (block 0
  is the null block: never handed out, freed or published);
* a block freed to ref count 0 that holds **no** published content goes to
  the **front** (reused first); a freed **published** block goes to the
  **back** and stays hittable until it is popped (LRU eviction);
* ``free`` takes blocks in the order given (callers free a chain tail first);
* ``allocate`` pops the front; popping a published block unpublishes it;
* retention (spec/manager.md §14): a published block may hold a claim
  ``(priority, expiry)`` (``set_retention``); a freed published block goes to
  the back of **level** ``priority`` (35 without a claim) and the free order is
  the unpublished front, then levels 0 .. 100, LRU within each; a claim whose
  expiry passed on ``clock`` is dropped when its block is freed or the
  eviction front is read (``allocate``, ``allocate_one``, ``peek``,
  ``free_order``: expired free blocks move, in expiry order, to the back of
  level 35). With no claims this is the plain LRU order above.

Implementations: ``kvref.BlockPool`` (an ordered dict and Python lists, the
readable definition) and ``kvfast``'s pool (an intrusive int32 free list with
Numba batch kernels). Both satisfy :class:`BlockPool` and give identical
results for identical calls.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol, Sequence, runtime_checkable

import numpy as np

__all__ = ["BlockPool", "NULL_BLOCK"]

#: The null block: padding target of every table, never allocated, freed or published.
NULL_BLOCK = 0


@runtime_checkable
class BlockPool(Protocol):
    """Ids ``0 .. num_blocks-1`` with ref counts, a free list in the spec's order and a prefix index.

    Attributes
    ----------
    num_blocks : int
        Pool size including the null block.
    block_hash : sequence of bytes or None
        ``block_hash[b]``: the hash block ``b`` is published under, else None.
    clock : callable() -> float
        Seconds for retention expiries (``time.monotonic`` unless the owner
        assigns its injected clock); read only while a claim has a finite expiry.
    """

    num_blocks: int
    clock: Callable[[], float]

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out (free, including evictable published ones)."""

    # -- allocation order
    def allocate(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the front (ref count 1 each; a popped published block is
        evicted). ``CapacityError`` with state unchanged when fewer than ``n`` are free."""

    def allocate_one(self) -> int:
        """``allocate(1)[0]`` (a decode step's page)."""

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block, in the order given; at 0 an unpublished block
        goes to the front, a published one to the back. Block 0 is skipped."""

    def touch(self, block: int) -> None:
        """Take one more reference; a free (published) block leaves the free list."""

    def touch_many(self, blocks: Sequence[int]) -> int:
        """``touch`` each of ``blocks`` (distinct, none null); returns how many left the free list."""

    def count_free(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` (distinct) are on the free list."""

    def free_order(self) -> list[int]:
        """The free list front to back (the order ``allocate`` pops)."""

    # -- prefix index
    def lookup(self, block_hash: bytes, tokens) -> int | None:
        """The block published under ``block_hash`` **whose stored tokens equal** ``tokens``
        (int32 ``[page]``), else None: a hash is a key, never a proof."""

    def lookup_run(self, hashes: Sequence[bytes], tokens: np.ndarray) -> list[int]:
        """The longest leading run of ``lookup`` hits over ``hashes``; ``tokens``: int32
        ``[len(hashes) * page]``, the run's tokens in order."""

    def last_indexed(self, hashes: Sequence[bytes], stop: int) -> int:
        """The largest ``i < stop`` whose ``hashes[i]`` the prefix index holds (its tokens not
        checked: a candidate for ``lookup``), else -1. A recurrent leaf's deepest checkpoint
        (spec/manager.md §3.2) is found by these probes, not by a ``lookup`` per block."""

    def publish(self, block: int, block_hash: bytes, tokens) -> int:
        """Enter ``block`` under ``block_hash`` with ``tokens``. Returns the page that holds the
        content: ``block`` (published now or already), an existing **twin** (same hash and
        tokens; ``block`` stays private), or ``block`` unpublished on a **collision** (the hash
        is held by other tokens)."""

    def publish_run(self, blocks: Sequence[int], hashes: Sequence[bytes], tokens: np.ndarray) -> list[int]:
        """``publish`` each block in order as one chain, stopping at the first collision;
        returns the kept page of each block before the stop (``len(result) < len(blocks)``:
        block ``len(result)`` collided). ``tokens``: int32 ``[len(blocks) * page]``."""

    # -- slab leaves (spec/manager.md §13.2)
    def grant(self, blocks: Sequence[int]) -> None:
        """Put revoked ``blocks`` back in circulation: onto the free list at the **front**, in the
        order given (``blocks[0]`` is popped first)."""

    def revoke(self, blocks: Sequence[int]) -> None:
        """Take free ``blocks`` (ref count 0) out of circulation: off the free list and out of the
        prefix index (evicted); ``free_order``, ``num_free`` and ``count_free`` no longer see them."""

    # -- retention (spec/manager.md §14)
    def set_retention(self, blocks: Sequence[int], priority: int, expiry: float) -> None:
        """Merge the claim ``(priority, expiry)`` (``0 .. 100``; absolute time on ``clock``,
        ``math.inf`` for none) into each **published** block of ``blocks`` (others skipped):
        no claim or an expired one is replaced, else the higher priority wins, at equal
        priority the later expiry (``kvspec.retention.merge``). A free block moves to the
        back of its new level. ``TypeError`` / ``ValueError`` / ``IndexError`` before any change."""

    def retain_free(self, blocks: Sequence[int], priority: int, expiry: float) -> None:
        """``set_retention(blocks, priority, expiry)`` then ``free(blocks)``: a holder's claim on
        the pages it lets go, then its references (a release or a slide, spec/manager.md §14.2,
        §6). The caller references each block, so the claims move nothing; an engine may do both
        in one pass. ``TypeError`` / ``ValueError`` / ``IndexError`` before any change."""

    def retention(self, block: int) -> tuple[int, float]:
        """The claim of ``block``: ``(priority, expiry)``, ``(-1, inf)`` without one."""

    def reset_prefix_cache(self) -> list[int]:
        """Unpublish every free published block (free order unchanged; claims dropped); returns them."""

    def check_invariants(self, table_refs: dict[int, int] | None = None) -> None:
        """``AssertionError`` if inconsistent; with ``table_refs`` every ref count must equal it."""
