"""kvfast's request-manager engines (``kvspec.engine.ManagerEngine``, spec/manager.md §12).

* :class:`FastManagerEngine` (CPU): the Numba block pool
  (:class:`kvfast._block_pool.BlockPool`: intrusive int32 free list, batch
  kernels, one token table), the SHA-256 chain kernel that reads the
  context's int32 tokens in place, and lookup tables built by one kernel call
  (:func:`kvfast._numba.lut.fill_lut`).
* :class:`CudaManagerEngine` (GPU): the same bookkeeping; page buffers as CuPy
  arrays, seen by the tiers through ``CudaPageStore`` (``stage.cu`` and pinned
  host memory), lookup tables and cache lengths moved to the device.

Both subclass the public ``kvref.ReferenceManagerEngine`` only to inherit
what is identical (the NumPy page buffer, plain page copies); every method
they replace returns the same values.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from typing import Sequence

import numpy as np

import kvref
from kvspec import hashing

from ._block_pool import BlockPool
from ._slab import FastSlabTable
from ._numba import sha as _sha
from ._numba.lut import fill_lut

__all__ = ["FastManagerEngine", "CudaManagerEngine"]

def chain(parent: bytes, data, step: int, n: int, hash_algo: str) -> list[bytes]:
    """``n`` chained block hashes over ``data`` (bytes, or int32 tokens read in place;
    ``step`` bytes per block), spec/hashing.md."""
    if hash_algo == "sha256" and _sha.AVAILABLE:
        return _sha.chain_sha256(parent, data, step, n)
    if hash_algo == "sha256":
        import hashlib

        h = lambda b: hashlib.sha256(b).digest()  # noqa: E731
    else:
        import xxhash

        h = xxhash.xxh3_128_digest
    buf = data.tobytes() if isinstance(data, np.ndarray) else data
    out = []
    for i in range(n):
        parent = h(parent + buf[i * step : (i + 1) * step])
        out.append(parent)
    return out


class FastManagerEngine(kvref.ReferenceManagerEngine):
    """Numba bookkeeping over NumPy page buffers (``device="cpu"``)."""

    name = "numba"

    def block_pool(self, num_blocks: int) -> BlockPool:
        """A :class:`kvfast._block_pool.BlockPool` (same allocation order as the reference)."""
        return BlockPool(num_blocks)

    def slab_table(self, num_huge_blocks: int, num_leaves: int) -> FastSlabTable:
        """A :class:`kvfast._slab.FastSlabTable` (int32 arrays, intrusive parked list)."""
        return FastSlabTable(num_huge_blocks, num_leaves)

    def chain_hashes(self, parent: bytes, tokens: np.ndarray, page_size: int, hash_algo: str) -> list[bytes]:
        """One kernel call over the int32 tokens in place (or their ``tokens_to_bytes`` when the
        hash input is patched); byte-identical to ``kvspec.hashing.block_hashes``."""
        n = len(tokens) // page_size
        if n == 0:
            return []
        data = tokens if hashing.native_tokens_are_hash_input() else hashing.tokens_to_bytes(tokens)
        if n == 1 and hash_algo == "sha256":  # a decode step's block: hashlib beats a kernel call
            return [hashlib.sha256(parent + (data.tobytes() if isinstance(data, np.ndarray) else data)).digest()]
        return chain(parent, data, 4 * page_size, n, hash_algo)

    def lookup_table(self, rows: Sequence[Sequence[int]], widths: Sequence[int], cols: int) -> np.ndarray:
        """The rows' leading ids gathered into one ``uint32`` run (``array.fromlist`` per row, no
        per-block Python work), scattered by one kernel call into a zeroed ``uint32 [len(rows), cols]``."""
        flat = array("I")
        put = flat.fromlist
        try:
            for row, k in zip(rows, widths):
                put(row if len(row) == k else row[:k])  # a row is a list of Python ints (the policy's rows)
        except (TypeError, OverflowError):  # another sequence type: one pass over every id
            flat = np.fromiter(itertools.chain.from_iterable(row[:k] for row, k in zip(rows, widths)),
                               dtype=np.uint32)
        return fill_lut(np.frombuffer(flat, dtype=np.uint32), np.array(widths, dtype=np.int64), cols)

    def __repr__(self) -> str:
        return "FastManagerEngine()"


class CudaManagerEngine(FastManagerEngine):
    """Numba bookkeeping over CuPy page buffers on device ``device_id`` (``device="cuda[:N]"``).

    Parameters
    ----------
    device_id : int
        The CUDA device (checked by the caller).
    """

    name = "cuda"

    def __init__(self, device_id: int):
        from ._cuda._module import cupy  # CuPy, or its KVFAST_CUDA_EMULATE stand-in

        self.device_id = device_id
        self._cp = cupy()

    def storage_dtype(self, dtype) -> np.dtype:
        """CuPy has no bfloat16 or FP8, so such buffers hold their bit patterns (uint16 for
        bfloat16, uint8 for float8_e4m3fn / float8_e5m2)."""
        dt = np.dtype(dtype)
        if dt.name == "bfloat16":
            return np.dtype(np.uint16)
        if dt.name.startswith("float8"):
            return np.dtype(np.uint8)
        return dt

    def page_buffer(self, shape: tuple[int, ...], dtype):
        """A zeroed CuPy buffer of :meth:`storage_dtype`."""
        dt = self.storage_dtype(dtype)
        with self._cp.cuda.Device(self.device_id):
            return self._cp.zeros(shape, dtype=dt)

    def page_store(self, buffer):
        """A ``CudaPageStore``: the tiers' pages staged by ``stage.cu`` through pinned host memory."""
        from ._cuda.page_store import CudaPageStore

        with self._cp.cuda.Device(self.device_id):
            return CudaPageStore(buffer)

    def to_device(self, array: np.ndarray):
        with self._cp.cuda.Device(self.device_id):
            return self._cp.asarray(array)

    def copy_page(self, dst, dst_page: int, src, src_page: int) -> None:
        """``dst[dst_page] = src[src_page]`` through ``copy_blocks.cu`` (cross-replica copies,
        recurrent checkpoints; both buffers on this device)."""
        from ._cuda.copy_blocks import copy_blocks

        with self._cp.cuda.Device(self.device_id):
            copy_blocks(src, dst, np.array([[src_page, dst_page]], np.int64))

    def zero_page(self, buffer, page: int) -> None:
        """``buffer[page] = 0`` through ``state.cu``'s zeroing kernel (a fresh recurrent state)."""
        from ._cuda.state import state_zero_rows

        with self._cp.cuda.Device(self.device_id):
            if buffer.shape[0] > 1 and buffer.strides[0] != buffer[0].nbytes:
                # spec/manager.md §13.1: a padded slab leaf is a strided view, which the row kernel
                # (contiguous rows) refuses; CuPy's fill writes the page's bytes, not its padding.
                buffer[page] = 0
                return
            state_zero_rows(buffer, np.array([page], np.int64))

    def __repr__(self) -> str:
        return f"CudaManagerEngine(device_id={self.device_id})"
