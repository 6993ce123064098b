"""``ReferenceManagerEngine``: the request manager's mechanisms in plain Python and NumPy.

The readable definition of each mechanism of ``kvspec.engine.ManagerEngine``
(spec/manager.md §12): ``kvref.BlockPool`` pools, zero-filled NumPy page
buffers seen by the tiers through ``HostPageStore``, the hash chain of
``kvspec.hashing``, and lookup tables filled row by row.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvspec import hashing
from kvspec._page_store import HostPageStore

from ._block_pool import BlockPool
from ._slab import ReferenceSlabTable

__all__ = ["ReferenceManagerEngine"]


class ReferenceManagerEngine:
    """The reference engine of ``kvref.PagedKVCacheManager`` (device ``"cpu"`` only).

    Subclasses (``kvfast``'s engines) replace mechanisms, never policy.
    """

    name = "reference"

    def block_pool(self, num_blocks: int) -> BlockPool:
        """A ``kvref.BlockPool`` of ``num_blocks`` ids (block 0 null)."""
        return BlockPool(num_blocks)

    def page_buffer(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """``numpy.zeros(shape, dtype)``."""
        return np.zeros(shape, dtype=dtype)

    def slab_table(self, num_huge_blocks: int, num_leaves: int) -> ReferenceSlabTable:
        """A ``ReferenceSlabTable``: owners, live counts and the parked queue of one slab."""
        return ReferenceSlabTable(num_huge_blocks, num_leaves)

    def slab_buffer(self, num_huge_blocks: int, huge_bytes: int):
        """The zero-filled slab ``uint8 [num_huge_blocks, huge_bytes]`` of one replica (spec/manager.md §13.1)."""
        return self.page_buffer((num_huge_blocks, huge_bytes), np.uint8)

    def leaf_view(self, slab, padded_bytes: int, shape: tuple[int, ...], dtype):
        """One leaf's page buffer ``shape = (pages, *page_shape)`` of ``dtype`` as a view into ``slab``:
        page ``b`` starts at byte ``b * padded_bytes`` (a strided view when the page is padded)."""
        dt = self.storage_dtype(dtype)
        rows = slab.reshape(shape[0], padded_bytes)
        data = int(np.prod(shape[1:])) * dt.itemsize
        if data != padded_bytes:
            rows = rows[:, :data]
        return rows.view(dt).reshape(shape)

    def storage_dtype(self, dtype) -> np.dtype:
        """The dtype buffers of ``dtype`` are stored as on this engine's device (itself on the CPU)."""
        return np.dtype(dtype)

    def page_store(self, buffer: np.ndarray) -> HostPageStore:
        """A ``HostPageStore`` over the NumPy buffer."""
        return HostPageStore(buffer)

    def chain_hashes(self, parent: bytes, tokens: np.ndarray, page_size: int, hash_algo: str) -> list[bytes]:
        """``kvspec.hashing.block_hashes`` of the int32 tokens from ``parent``."""
        return list(hashing.block_hashes(tokens, page_size, hash_algo, parent=parent))

    def lookup_table(self, rows: Sequence[Sequence[int]], widths: Sequence[int], cols: int) -> np.ndarray:
        """``uint32 [len(rows), cols]``, row ``i`` = ``rows[i][:widths[i]]`` then 0."""
        lut = np.zeros((len(rows), cols), dtype=np.uint32)
        for i, (row, n) in enumerate(zip(rows, widths)):
            lut[i, :n] = row[:n]
        return lut

    def copy_page(self, dst, dst_page: int, src, src_page: int) -> None:
        dst[dst_page] = src[src_page]

    def zero_page(self, buffer, page: int) -> None:
        buffer[page] = 0

    def to_device(self, array: np.ndarray) -> np.ndarray:
        return array

    def __repr__(self) -> str:
        return "ReferenceManagerEngine()"
