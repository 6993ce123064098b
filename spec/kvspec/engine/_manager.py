"""The request manager's engine protocol (DESIGN §7, ``spec/manager.md`` §12).

The policy, ``kvref.PagedKVCacheManager``, decides everything
``spec/manager.md`` decides: hits, allocation order, twin dedup, check-then-
commit atomicity, transfers, runtime inputs and every message. It reaches
storage and indices only through a ``ManagerEngine`` chosen once, at
construction (``PagedKVCacheManager.make_engine(params, device)``):

* ``kvref.ReferenceManagerEngine``: ``kvref.BlockPool``, NumPy buffers,
  ``kvspec.hashing``, plain loops (the readable definition);
* ``kvfast``'s engines: the Numba block pool and SHA-256 chain kernel on the
  CPU; CuPy buffers, ``CudaPageStore`` and device-side inputs on a GPU.

Two engines given the same calls return the same values (block ids, hashes,
lookup tables), so the managers built on them are observably identical.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from .._page_store import PageStore
from ._pool import BlockPool
from ._slab import SlabTable

__all__ = ["ManagerEngine"]


@runtime_checkable
class ManagerEngine(Protocol):
    """The mechanisms under the request manager's policy.

    Attributes
    ----------
    name : str
        ``"reference"``, ``"numba"``, ``"cuda"`` (for reprs and benchmarks).
    """

    name: str

    def block_pool(self, num_blocks: int) -> BlockPool:
        """A pool over ids ``0 .. num_blocks-1`` with the spec's allocation order."""

    def page_buffer(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """A zero-filled page buffer ``[num_pages, ...]`` on the engine's device (allocated once
        per replica and leaf; never re-allocated)."""

    def slab_table(self, num_huge_blocks: int, num_leaves: int) -> SlabTable:
        """A fresh ``SlabTable`` (spec/manager.md §13): huge blocks ``1 .. num_huge_blocks-1`` parked
        and pristine."""

    def slab_buffer(self, num_huge_blocks: int, huge_bytes: int) -> Any:
        """The zero-filled ``uint8 [num_huge_blocks, huge_bytes]`` slab of one replica."""

    def leaf_view(self, slab: Any, padded_bytes: int, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """A leaf's page buffer ``shape`` of ``dtype`` viewing ``slab``; page ``b`` at byte
        ``b * padded_bytes`` (live: writes through the view land in the slab)."""

    def page_store(self, buffer: Any) -> PageStore:
        """The tiers' view of ``buffer`` (built after the final buffer exists)."""

    def chain_hashes(self, parent: bytes, tokens: np.ndarray, page_size: int, hash_algo: str) -> list[bytes]:
        """``len(tokens) // page_size`` chained block hashes of int32 ``tokens`` from ``parent``,
        byte-identical to ``kvspec.hashing.block_hashes`` (``spec/hashing.md``)."""

    def lookup_table(self, rows: Sequence[Sequence[int]], widths: Sequence[int], cols: int) -> np.ndarray:
        """``uint32 [len(rows), cols]``: row ``i`` holds ``rows[i][:widths[i]]`` then 0."""

    def copy_page(self, dst: Any, dst_page: int, src: Any, src_page: int) -> None:
        """``dst[dst_page] = src[src_page]`` (same shape and dtype; buffers of one device)."""

    def zero_page(self, buffer: Any, page: int) -> None:
        """``buffer[page] = 0``."""

    def to_device(self, array: np.ndarray) -> Any:
        """A host array as the engine's device array (identity on the CPU)."""
