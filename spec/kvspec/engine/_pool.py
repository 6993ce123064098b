"""The block pool protocol: free list, reference counts and prefix index (DESIGN §4.2, §7).

One pool per paged storage: the slot cache has one, the request manager one
per replica and leaf. A pool knows block ids only, never K/V bytes. The
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
* ``allocate`` pops the front; popping a published block unpublishes it.

Implementations: ``kvref.BlockPool`` (an ordered dict and Python lists, the
readable definition) and ``kvfast``'s pool (an intrusive int32 free list with
Numba batch kernels). Both satisfy :class:`BlockPool` and give identical
results for identical calls.
"""

from __future__ import annotations

from typing import Iterable, Protocol, Sequence, runtime_checkable

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
    """

    num_blocks: int

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

    def publish(self, block: int, block_hash: bytes, tokens) -> int:
        """Enter ``block`` under ``block_hash`` with ``tokens``. Returns the page that holds the
        content: ``block`` (published now or already), an existing **twin** (same hash and
        tokens; ``block`` stays private), or ``block`` unpublished on a **collision** (the hash
        is held by other tokens)."""

    def publish_run(self, blocks: Sequence[int], hashes: Sequence[bytes], tokens: np.ndarray) -> list[int]:
        """``publish`` each block in order as one chain, stopping at the first collision;
        returns the kept page of each block before the stop (``len(result) < len(blocks)``:
        block ``len(result)`` collided). ``tokens``: int32 ``[len(blocks) * page]``."""

    def reset_prefix_cache(self) -> list[int]:
        """Unpublish every free published block (free order unchanged); returns them."""

    def check_invariants(self, table_refs: dict[int, int] | None = None) -> None:
        """``AssertionError`` if inconsistent; with ``table_refs`` every ref count must equal it."""
