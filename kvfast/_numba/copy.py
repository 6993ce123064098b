"""Row and block copies on the CPU (the Numba twins of ``kernels/*.cu``).

Storage is addressed exactly like the CUDA kernels address it: a flat word
array plus a base offset, ``block_size``, ``block_stride`` and ``row_stride``
(all in words), so one kernel serves a slot-cache pool
``[num_blocks, block_size, kv_heads, head_dim]``, contiguous storage
``[max_seqs, max_seq_len, kv_heads, head_dim]`` and a plane of the manager's
``[num_blocks, 2, num_layers, page_size, kv_heads, head_dim]`` buffer.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

__all__ = [
    "PARALLEL_BYTES", "word_dtype", "as_words", "flat_words",
    "scatter_rows", "gather_rows", "copy_blocks", "zero_rows",
]

#: Steps moving at least this many bytes use the parallel scatter (prange).
PARALLEL_BYTES = 4 << 20

_WORDS = (np.dtype(np.uint64), np.dtype(np.uint32), np.dtype(np.uint16), np.dtype(np.uint8))


def word_dtype(row_bytes: int) -> np.dtype:
    """The widest unsigned word that divides ``row_bytes`` (8, 4, 2 or 1 bytes)."""
    for w in _WORDS:
        if row_bytes % w.itemsize == 0:
            return w
    raise AssertionError("unreachable: uint8 divides every size")


def as_words(rows: np.ndarray, word: np.dtype) -> np.ndarray:
    """``rows`` ``[T, ...]`` as a 2-D ``[T, row_words]`` array of ``word`` (a view
    when the trailing axes are contiguous, else a contiguous copy)."""
    t = rows.shape[0]
    try:
        r2 = rows.reshape(t, -1) if t else rows.reshape(0, int(np.prod(rows.shape[1:])))
        if r2.shape[1] and r2.strides[1] != r2.itemsize:
            raise ValueError("inner axis not contiguous")
        return r2.view(word)
    except (ValueError, AttributeError):
        return np.ascontiguousarray(rows).reshape(t, -1).view(word)


def flat_words(buffer: np.ndarray, word: np.dtype) -> np.ndarray:
    """A C-contiguous ``buffer`` as a flat 1-D view of ``word``."""
    return buffer.reshape(-1).view(word)


@njit(nogil=True, cache=True)
def _scatter_serial(src_k, src_v, dst_k, dst_v, k_base, v_base, slot_mapping, block_size, block_stride, row_stride):
    n_rows, r = src_k.shape
    for t in range(n_rows):
        slot = slot_mapping[t]
        if slot < 0:  # padding token
            continue
        off = (slot // block_size) * block_stride + (slot % block_size) * row_stride
        dk = k_base + off
        dv = v_base + off
        for i in range(r):
            dst_k[dk + i] = src_k[t, i]
        for i in range(r):
            dst_v[dv + i] = src_v[t, i]


@njit(nogil=True, cache=True, parallel=True)
def _scatter_parallel(src_k, src_v, dst_k, dst_v, k_base, v_base, slot_mapping, block_size, block_stride, row_stride):
    n_rows, r = src_k.shape
    for t in prange(n_rows):
        slot = slot_mapping[t]
        if slot >= 0:
            off = (slot // block_size) * block_stride + (slot % block_size) * row_stride
            dk = k_base + off
            dv = v_base + off
            for i in range(r):
                dst_k[dk + i] = src_k[t, i]
            for i in range(r):
                dst_v[dv + i] = src_v[t, i]


def scatter_rows(src_k, src_v, dst_k, dst_v, k_base, v_base, slot_mapping, block_size, block_stride, row_stride):
    """Write row ``t`` of ``src_k``/``src_v`` (``[T, row_words]``) at slot
    ``slot_mapping[t]`` of the flat word arrays ``dst_k``/``dst_v``.

    Destination word of slot ``s``: ``base + (s // block_size) * block_stride
    + (s % block_size) * row_stride``; ``s < 0`` is skipped (padding).
    Parallel over tokens when the step moves >= ``PARALLEL_BYTES``.
    """
    nbytes = 2 * src_k.size * src_k.itemsize
    fn = _scatter_parallel if nbytes >= PARALLEL_BYTES else _scatter_serial
    fn(src_k, src_v, dst_k, dst_v, k_base, v_base, slot_mapping, block_size, block_stride, row_stride)


@njit(nogil=True, cache=True)
def gather_rows(src, base, block_row, seq_len, block_size, block_stride, row_stride, out):
    """``out[p] = src[base + block_row[p // bs] * block_stride + (p % bs) * row_stride : +R]``
    for ``p < seq_len`` (``out`` is ``[seq_len, R]`` words)."""
    r = out.shape[1]
    for p in range(seq_len):
        off = base + block_row[p // block_size] * block_stride + (p % block_size) * row_stride
        for i in range(r):
            out[p, i] = src[off + i]


@njit(nogil=True, cache=True)
def copy_blocks(src, dst, block_mapping):
    """``dst[m[i, 1]] = src[m[i, 0]]`` for each pair of ``block_mapping``
    (``src``/``dst`` ``[num_blocks, block_words]``; pairs applied in order)."""
    r = src.shape[1]
    for p in range(block_mapping.shape[0]):
        s = block_mapping[p, 0]
        d = block_mapping[p, 1]
        for i in range(r):
            dst[d, i] = src[s, i]


@njit(nogil=True, cache=True)
def zero_rows(dst, rows):
    """``dst[rows[i]] = 0`` (``dst`` ``[num_rows, row_words]``)."""
    r = dst.shape[1]
    for p in range(rows.shape[0]):
        row = rows[p]
        for i in range(r):
            dst[row, i] = 0
