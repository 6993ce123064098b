"""Device pages as the tiers see them (spec/tiers.md §2).

A tier never indexes a device buffer itself: it reads and writes whole pages
through a ``PageStore``, one per replica, which the engine that owns the
buffer provides. On the CPU that is a view of the NumPy buffer
(``HostPageStore``); on a GPU the fast engine stages pages through pinned
host memory with its own kernels; in bookkeeping-only mode
(``KVCacheParams(allocate_buffers=False)``) the store holds no bytes and the
tiers keep only their accounting.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

__all__ = ["PageStore", "HostPageStore", "BookkeepingPageStore"]


@runtime_checkable
class PageStore(Protocol):
    """The pages of one replica's device buffer, each one contiguous run of bytes.

    Attributes
    ----------
    num_pages : int
        Pages in the buffer, the null page 0 included.
    page_nbytes : int
        Bytes of one page (every layer's K and V of one block).
    holds_bytes : bool
        ``False`` in bookkeeping-only mode: ``read`` and ``write`` raise
        ``RuntimeError`` and the tiers account bytes without copying them.
    """

    num_pages: int
    page_nbytes: int
    holds_bytes: bool

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        """Host copies (or, on the CPU, views) of the pages: uint8 ``[n, page_nbytes]``.

        The result is valid until the next ``read`` on the same store from the
        same thread; callers copy what they keep.
        """

    def write(self, block_ids: Sequence[int], data: np.ndarray) -> None:
        """Overwrite the pages ``block_ids`` with ``data``: uint8 ``[n, page_nbytes]``."""

    def alloc_host(self, num_pages: int) -> np.ndarray:
        """Host memory for ``num_pages`` pages, uint8 ``[num_pages, page_nbytes]``, zeroed,
        suited to this store's transfers (pinned on a GPU). The host tier's arena."""


class HostPageStore:
    """A ``PageStore`` over a C-contiguous NumPy buffer ``[num_pages, ...]``.

    Parameters
    ----------
    buffer : ndarray [num_pages, ...]
        C-contiguous; page ``i`` is ``buffer[i]`` viewed as bytes.
    """

    holds_bytes = True

    def __init__(self, buffer: np.ndarray):
        if not isinstance(buffer, np.ndarray):
            raise TypeError(f"HostPageStore: buffer is {type(buffer).__name__}, must be a numpy.ndarray")
        if buffer.ndim < 1 or not buffer.flags.c_contiguous:
            raise ValueError(
                f"HostPageStore: buffer.shape={buffer.shape} C-contiguous={buffer.flags.c_contiguous}, "
                "must be C-contiguous with at least one dimension"
            )
        self.buffer = buffer  # kept so the store pins the memory its views read
        self._pages = buffer.reshape(buffer.shape[0], -1).view(np.uint8)
        self.num_pages = int(buffer.shape[0])
        self.page_nbytes = int(self._pages.shape[1])

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size == 1:
            return self._pages[int(ids[0]) : int(ids[0]) + 1]  # a view: no copy for one page
        return self._pages[ids]

    def write(self, block_ids: Sequence[int], data: np.ndarray) -> None:
        ids = np.asarray(block_ids, dtype=np.int64)
        self._pages[ids] = np.asarray(data, dtype=np.uint8).reshape(len(ids), self.page_nbytes)

    def alloc_host(self, num_pages: int) -> np.ndarray:
        return np.zeros((int(num_pages), self.page_nbytes), dtype=np.uint8)

    def __repr__(self) -> str:
        return f"HostPageStore(num_pages={self.num_pages}, page_nbytes={self.page_nbytes})"


class BookkeepingPageStore:
    """A ``PageStore`` that holds no bytes (bookkeeping-only mode, spec/tiers.md §11).

    The tiers attached to it run their whole policy (indexes, LRU, byte
    capacities, hits, transfers as accounting) without allocating an arena,
    writing a file or storing a value remotely; ``read``, ``write`` and
    ``alloc_host`` raise ``RuntimeError``.

    Parameters
    ----------
    num_pages : int
        Pages of the replica's pool, the null page 0 included (>= 1).
    page_nbytes : int
        Bytes one page would hold (>= 1).
    """

    holds_bytes = False

    def __init__(self, num_pages: int, page_nbytes: int):
        for name, v in (("num_pages", num_pages), ("page_nbytes", page_nbytes)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"BookkeepingPageStore: {name}={v!r}, must be an int")
            if not 1 <= int(v) <= 2**62:
                raise ValueError(f"BookkeepingPageStore: {name}={v} out of range [1, 2**62]")
        self.num_pages = int(num_pages)
        self.page_nbytes = int(page_nbytes)

    def _no_bytes(self, op: str):
        raise RuntimeError(f"BookkeepingPageStore.{op}: bookkeeping-only mode holds no page bytes")

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        self._no_bytes("read")

    def write(self, block_ids: Sequence[int], data: np.ndarray) -> None:
        self._no_bytes("write")

    def alloc_host(self, num_pages: int) -> np.ndarray:
        self._no_bytes("alloc_host")

    def __repr__(self) -> str:
        return f"BookkeepingPageStore(num_pages={self.num_pages}, page_nbytes={self.page_nbytes})"
