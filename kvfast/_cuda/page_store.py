"""``CudaPageStore``: the tiers' view of a CuPy device buffer (spec/tiers.md §2).

A tier reads and writes whole pages through a :class:`kvspec.PageStore`. On a
GPU the pages of one replica's buffer ``[num_pages, ...]`` are gathered by
``stage_gather_kernel`` (``kernels/stage.cu``) into a device bounce buffer,
then copied into pinned host memory (``read``); ``write`` runs the reverse
(pinned host -> bounce buffer -> ``stage_scatter_kernel``). Both run on the
stream current when the store was built, and synchronize it before
returning, so the caller sees finished bytes and the forward's writes issued
before the call are ordered before the copy.
"""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from ._module import cupy
from .stage import stage_gather, stage_scatter

__all__ = ["CudaPageStore", "pinned_empty"]


def pinned_empty(shape: tuple[int, ...], dtype=np.uint8) -> np.ndarray:
    """A zeroed NumPy array in page-locked (pinned) host memory.

    Parameters
    ----------
    shape : tuple of int
        Shape of the array.
    dtype : numpy dtype
        Element type (default uint8).

    Returns
    -------
    numpy.ndarray
        C-contiguous, backed by ``cupy.cuda.alloc_pinned_memory`` (the array
        keeps the allocation alive).
    """
    cp = cupy()
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    nbytes = max(1, n * dt.itemsize)
    mem = cp.cuda.alloc_pinned_memory(nbytes)
    out = np.frombuffer(mem, dtype=np.uint8, count=nbytes)[: n * dt.itemsize].view(dt).reshape(shape)
    out[...] = 0
    return out


def _word(page_nbytes: int) -> np.dtype:
    """The widest staging word (4, 2 or 1 bytes) that divides a page."""
    for w, dt in ((4, np.uint32), (2, np.uint16), (1, np.uint8)):
        if page_nbytes % w == 0:
            return np.dtype(dt)
    raise AssertionError("unreachable: every size divides by 1")


class CudaPageStore:
    """A :class:`kvspec.PageStore` over a C-contiguous CuPy buffer ``[num_pages, ...]``.

    Parameters
    ----------
    buffer : cupy.ndarray [num_pages, ...]
        C-contiguous device buffer of any dtype (bfloat16 storage as its
        uint16 bit patterns); page ``i`` is ``buffer[i]`` as bytes.
    stream : cupy.cuda.Stream, optional
        Stream the staging kernels and copies run on (default: the stream
        current when the store is built).

    Raises
    ------
    TypeError
        ``buffer`` is not a CuPy array.
    ValueError
        ``buffer`` has no dimension or is not C-contiguous.

    Notes
    -----
    ``read`` returns a view of a pinned host buffer the store owns, valid
    until the next ``read`` from the same thread (each thread stages through
    its own buffers); ``write`` takes any host uint8 ``[n, page_nbytes]``
    array. Staging is ordered after work already queued on ``stream``: the
    default (the legacy default stream, as torch and CuPy use unless told
    otherwise) also waits for other blocking streams, but a forward on a
    non-blocking stream must be that ``stream`` or be synchronized before
    its pages are offloaded.
    """

    holds_bytes = True

    def __init__(self, buffer, *, stream=None):
        cp = cupy()
        if not isinstance(buffer, cp.ndarray):
            raise TypeError(f"CudaPageStore: buffer is {type(buffer).__name__}, must be a cupy.ndarray")
        if buffer.ndim < 1 or not buffer.flags.c_contiguous:
            raise ValueError(
                f"CudaPageStore: buffer.shape={tuple(buffer.shape)} C-contiguous={buffer.flags.c_contiguous}, "
                "must be C-contiguous with at least one dimension"
            )
        self.buffer = buffer
        self.num_pages = int(buffer.shape[0])
        self.page_nbytes = int(buffer.nbytes // max(1, self.num_pages)) if self.num_pages else 0
        self._word = _word(max(1, self.page_nbytes))
        # [num_pages, page_words] view of the same memory in the staging word.
        self._pages = buffer.view(np.uint8).reshape(self.num_pages, self.page_nbytes).view(self._word)
        self._device_id = int(buffer.device.id)
        self._stream = stream if stream is not None else cp.cuda.get_current_stream()
        # Per thread (tiers read and write from transfer threads): a device bounce buffer
        # [cap, page_words] and a pinned host buffer [cap, page_nbytes] uint8.
        self._local = threading.local()

    # ------------------------------------------------------------------ helpers

    def _ids(self, api: str, block_ids: Sequence[int]) -> np.ndarray:
        try:
            ids = np.asarray(block_ids)
        except TypeError:
            raise TypeError(f"CudaPageStore.{api}: block_ids is {type(block_ids).__name__}, must be host integers") from None
        if ids.ndim != 1:
            raise ValueError(f"CudaPageStore.{api}: block_ids.ndim={ids.ndim}, must be 1")
        if ids.size and ids.dtype.kind not in "iu":
            raise TypeError(f"CudaPageStore.{api}: block_ids dtype={ids.dtype}, must be integer")
        ids = ids.astype(np.int64, copy=False)
        if ids.size:
            bad = np.flatnonzero((ids < 0) | (ids >= self.num_pages))
            if bad.size:
                i = int(bad[0])
                raise IndexError(
                    f"CudaPageStore.{api}: block_ids[{i}]={int(ids[i])} out of range [0, {self.num_pages})"
                )
        return ids

    def _staging(self, n: int, host: str = "host"):
        """Device bounce buffer and pinned host buffer of at least ``n`` pages: ``host="host"`` is
        ``read``'s (what it returns), ``"host_w"`` is ``write``'s, so a write never overwrites the
        last read's result (kvspec.PageStore: valid until the next *read*)."""
        cp = cupy()
        loc = self._local
        bounce = getattr(loc, "bounce", None)
        if bounce is None or bounce.shape[0] < n:
            cap = max(n, 2 * (0 if bounce is None else bounce.shape[0]), 1)
            with cp.cuda.Device(self._device_id):
                loc.bounce = cp.empty((cap, self._pages.shape[1]), dtype=self._word)
        pinned = getattr(loc, host, None)
        if pinned is None or pinned.shape[0] < n:
            pinned = pinned_empty((max(n, 2 * (0 if pinned is None else pinned.shape[0]), 1), self.page_nbytes))
            setattr(loc, host, pinned)
        return loc.bounce[:n], pinned[:n]

    # ------------------------------------------------------------------ PageStore

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        """Host copies of the pages ``block_ids``: uint8 ``[n, page_nbytes]`` in pinned memory.

        Parameters
        ----------
        block_ids : sequence of int [n]
            Pages in ``[0, num_pages)``.

        Returns
        -------
        numpy.ndarray uint8 [n, page_nbytes]
            Valid until the next ``read`` on this store from the same thread
            (each thread stages through its own buffers).

        Raises
        ------
        TypeError, ValueError, IndexError
            ``block_ids`` not a 1-D integer sequence, or an id out of range.
        """
        cp = cupy()
        ids = self._ids("read", block_ids)
        n = int(ids.shape[0])
        if n == 0:
            return np.empty((0, self.page_nbytes), np.uint8)
        dev, host = self._staging(n)
        with cp.cuda.Device(self._device_id):
            stage_gather(self._pages, dev, cp.asarray(ids), stream=self._stream)
            dev.get(out=host.view(self._word), stream=self._stream)
            self._stream.synchronize()
        return host

    def write(self, block_ids: Sequence[int], data: np.ndarray) -> None:
        """Overwrite the pages ``block_ids`` with ``data``.

        Parameters
        ----------
        block_ids : sequence of int [n]
            Distinct pages in ``[0, num_pages)``.
        data : numpy.ndarray uint8 [n, page_nbytes]
            Host bytes (any array of ``n * page_nbytes`` bytes is accepted).

        Raises
        ------
        TypeError, ValueError, IndexError
            Bad ids (as ``read``), repeated ids, or ``data`` of the wrong size;
            the buffer is unchanged.
        """
        cp = cupy()
        ids = self._ids("write", block_ids)
        n = int(ids.shape[0])
        if not isinstance(data, np.ndarray):
            raise TypeError(f"CudaPageStore.write: data is {type(data).__name__}, must be a numpy.ndarray")
        if data.nbytes != n * self.page_nbytes:
            raise ValueError(
                f"CudaPageStore.write: data.nbytes={data.nbytes} != len(block_ids)*page_nbytes="
                f"{n}*{self.page_nbytes}"
            )
        if n > 1 and np.unique(ids).size != n:
            raise ValueError(f"CudaPageStore.write: block_ids={ids.tolist()} repeats a page")
        if n == 0:
            return
        dev, host = self._staging(n, "host_w")
        np.copyto(host, np.ascontiguousarray(data).view(np.uint8).reshape(n, self.page_nbytes))
        with cp.cuda.Device(self._device_id):
            dev.set(host.view(self._word), stream=self._stream)
            stage_scatter(dev, self._pages, cp.asarray(ids), stream=self._stream)
            self._stream.synchronize()

    def alloc_host(self, num_pages: int) -> np.ndarray:
        """Zeroed pinned host memory for ``num_pages`` pages: uint8 ``[num_pages, page_nbytes]``.

        Raises
        ------
        ValueError
            ``num_pages < 0``.
        """
        n = int(num_pages)
        if n < 0:
            raise ValueError(f"CudaPageStore.alloc_host: num_pages={n} < 0")
        return pinned_empty((n, self.page_nbytes))

    def __repr__(self) -> str:
        return (
            f"CudaPageStore(num_pages={self.num_pages}, page_nbytes={self.page_nbytes}, "
            f"device=cuda:{self._device_id})"
        )
