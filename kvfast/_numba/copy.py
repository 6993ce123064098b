"""Row copies on the CPU (the Numba twins of ``kernels/append_kv.cu`` and ``gather_kv.cu``).

Storage is addressed exactly like the CUDA kernels address it: a flat word
array plus a base offset, ``block_size``, ``block_stride`` and ``row_stride``
(all in words), so one kernel serves a slot-cache pool
``[num_blocks, block_size, kv_heads, head_dim]``, contiguous storage
``[max_seqs, max_seq_len, kv_heads, head_dim]`` and a plane of the manager's
``[num_blocks, 2, num_layers, page_size, kv_heads, head_dim]`` buffer.
"""

from __future__ import annotations

import os

import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = [
    "PARALLEL_RUNS", "PARALLEL_RUNS_ON", "PARALLEL_RUNS_OFF", "PARALLEL_SPAN_BYTES", "word_dtype", "as_words", "flat_words",
    "scatter_rows", "gather_rows",
]

#: The scatter runs in parallel (prange over spans) when a step has at least
#: PARALLEL_RUNS spans of at most PARALLEL_SPAN_BYTES each: many small
#: scattered rows are latency-bound, so a second core helps (decode steps).
#: Long spans (prefill) are bandwidth-bound and one core saturates memory;
#: measured on the 2-core CI VM (docs/performance.md).
#: Off by default (``KVFAST_PARALLEL_SCATTER=1`` turns it on for every engine made
#: after import; ``FastSlotEngine(parallel_scatter=True)`` for one): on a busy machine
#: an OpenMP parallel region waits for a descheduled worker (milliseconds).
PARALLEL_RUNS_ON = 128
PARALLEL_RUNS_OFF = 1 << 62
PARALLEL_RUNS = PARALLEL_RUNS_ON if os.environ.get("KVFAST_PARALLEL_SCATTER") == "1" else PARALLEL_RUNS_OFF
PARALLEL_SPAN_BYTES = 16 << 10

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


@intrinsic
def _memcpy(typingctx, dst, src, nbytes):
    """``memcpy(dst, src, nbytes)`` on raw addresses (LLVM's memcpy intrinsic, so
    libc's vectorised copy; no globals, so the kernels stay cacheable)."""
    sig = types.void(types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        d, s_, n = args
        dp = builder.inttoptr(d, cgutils.voidptr_t)
        sp = builder.inttoptr(s_, cgutils.voidptr_t)
        cgutils.raw_memcpy(builder, dp, sp, n, 1)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True)
def _runs(slot_mapping, block_size, starts, lengths, limit):
    """Split tokens into runs of consecutive slots inside one block (one memcpy each).

    Padding tokens (slot < 0) form no run. Returns the number of runs, or
    ``-1 - t`` for the first token ``t`` whose slot is ``>= limit``.
    """
    n = slot_mapping.shape[0]
    for t in range(n):
        if slot_mapping[t] >= limit:
            return -1 - t
    k = 0
    t = 0
    while t < n:
        s = slot_mapping[t]
        if s < 0:
            t += 1
            continue
        length = 1
        room = block_size - s % block_size
        while t + length < n and length < room and slot_mapping[t + length] == s + length:
            length += 1
        starts[k] = t
        lengths[k] = length
        k += 1
        t += length
    return k


@njit(nogil=True, cache=True)
def _copy_runs_serial(src_k, src_v, dst_k, dst_v, k_base, v_base, slot_mapping, starts, lengths, n_runs,
                      block_size, block_stride, row_stride):
    isz = dst_k.itemsize
    row_bytes = src_k.shape[1] * isz
    sk = src_k.ctypes.data
    sv = src_v.ctypes.data
    sks = src_k.strides[0]
    svs = src_v.strides[0]
    dk = dst_k.ctypes.data
    dv = dst_v.ctypes.data
    for j in range(n_runs):
        t = starts[j]
        s = slot_mapping[t]
        off = (s // block_size) * block_stride + (s % block_size) * row_stride
        if sks == row_bytes and svs == row_bytes and row_stride * isz == row_bytes:  # whole run: one span each
            _memcpy(dk + (k_base + off) * isz, sk + t * sks, lengths[j] * row_bytes)
            _memcpy(dv + (v_base + off) * isz, sv + t * svs, lengths[j] * row_bytes)
        else:
            for i in range(lengths[j]):
                o = off + i * row_stride
                _memcpy(dk + (k_base + o) * isz, sk + (t + i) * sks, row_bytes)
                _memcpy(dv + (v_base + o) * isz, sv + (t + i) * svs, row_bytes)


@njit(nogil=True, cache=True)
def _scatter_serial(src_k, src_v, dst_k, dst_v, slot_mapping, block_size, block_stride, row_stride, limit):
    """The whole serial scatter in one call: bounds check, then spans copied as found.

    Returns -1, or (writing nothing) the first token whose slot is ``>= limit``.
    """
    n = slot_mapping.shape[0]
    for t in range(n):
        if slot_mapping[t] >= limit:
            return t
    isz = dst_k.itemsize
    row_bytes = src_k.shape[1] * isz
    sk = src_k.ctypes.data
    sv = src_v.ctypes.data
    sks = src_k.strides[0]
    svs = src_v.strides[0]
    dk = dst_k.ctypes.data
    dv = dst_v.ctypes.data
    packed = sks == row_bytes and svs == row_bytes and row_stride * isz == row_bytes
    t = 0
    while t < n:
        s = slot_mapping[t]
        if s < 0:
            t += 1
            continue
        length = 1
        if packed:
            room = block_size - s % block_size
            while t + length < n and length < room and slot_mapping[t + length] == s + length:
                length += 1
        off = ((s // block_size) * block_stride + (s % block_size) * row_stride) * isz
        _memcpy(dk + off, sk + t * sks, length * row_bytes)
        _memcpy(dv + off, sv + t * svs, length * row_bytes)
        t += length
    return -1


@njit(nogil=True, cache=True, parallel=True)
def _copy_runs_parallel(src_k, src_v, dst_k, dst_v, k_base, v_base, slot_mapping, starts, lengths, n_runs,
                        block_size, block_stride, row_stride):
    isz = dst_k.itemsize
    row_bytes = src_k.shape[1] * isz
    sk = src_k.ctypes.data
    sv = src_v.ctypes.data
    sks = src_k.strides[0]
    svs = src_v.strides[0]
    dk = dst_k.ctypes.data
    dv = dst_v.ctypes.data
    for j in prange(n_runs):
        t = starts[j]
        s = slot_mapping[t]
        off = (s // block_size) * block_stride + (s % block_size) * row_stride
        if sks == row_bytes and svs == row_bytes and row_stride * isz == row_bytes:
            _memcpy(dk + (k_base + off) * isz, sk + t * sks, lengths[j] * row_bytes)
            _memcpy(dv + (v_base + off) * isz, sv + t * svs, lengths[j] * row_bytes)
        else:
            for i in range(lengths[j]):
                o = off + i * row_stride
                _memcpy(dk + (k_base + o) * isz, sk + (t + i) * sks, row_bytes)
                _memcpy(dv + (v_base + o) * isz, sv + (t + i) * svs, row_bytes)


def scatter_rows(src_k, src_v, dst_k, dst_v, k_base, v_base, slot_mapping, block_size, block_stride, row_stride,
                 limit=None, parallel_runs=None) -> int:
    """Write row ``t`` of ``src_k``/``src_v`` (``[T, row_words]``) at slot
    ``slot_mapping[t]`` of the flat word arrays ``dst_k``/``dst_v``.

    Destination word of slot ``s``: ``base + (s // block_size) * block_stride
    + (s % block_size) * row_stride``; ``s < 0`` is skipped (padding). Tokens
    going to consecutive slots of one block are copied as one span; spans run
    in parallel (``prange``) when enabled and there are many short ones
    (``PARALLEL_RUNS``, ``PARALLEL_SPAN_BYTES``); else one serial call. Rows are copied with libc
    ``memcpy`` (bit patterns, vectorised by libc). Slots must be distinct
    (a step's slot_mapping always is).

    ``parallel_runs`` (default: the module's ``PARALLEL_RUNS``) is the engine's
    threshold, fixed when the engine is made.

    Returns -1, or (writing nothing) the first token whose slot is ``>= limit``.
    """
    n = slot_mapping.shape[0]
    limit = (1 << 62) if limit is None else limit
    if parallel_runs is None:
        parallel_runs = PARALLEL_RUNS
    if n < parallel_runs or k_base or v_base:
        if k_base or v_base:  # a view per call costs as much as the dispatch: only when offset
            dst_k, dst_v = dst_k[k_base:], dst_v[v_base:]
        return _scatter_serial(src_k, src_v, dst_k, dst_v, slot_mapping, block_size, block_stride, row_stride,
                               limit)
    starts = np.empty(n, np.int64)
    lengths = np.empty(n, np.int64)
    n_runs = _runs(slot_mapping, block_size, starts, lengths, limit)
    if n_runs < 0:
        return -1 - n_runs
    nbytes = 2 * src_k.size * src_k.itemsize
    parallel = n_runs >= parallel_runs and nbytes <= n_runs * PARALLEL_SPAN_BYTES
    fn = _copy_runs_parallel if parallel else _copy_runs_serial
    fn(src_k, src_v, dst_k, dst_v, k_base, v_base, slot_mapping, starts, lengths, n_runs,
       block_size, block_stride, row_stride)
    return -1


@njit(nogil=True, cache=True)
def gather_rows(src, base, block_row, seq_len, block_size, block_stride, row_stride, out):
    """``out[p] = src[base + block_row[p // bs] * block_stride + (p % bs) * row_stride : +R]``
    for ``p < seq_len`` (``out`` is ``[seq_len, R]`` words)."""
    r = out.shape[1]
    for p in range(seq_len):
        off = base + block_row[p // block_size] * block_stride + (p % block_size) * row_stride
        for i in range(r):
            out[p, i] = src[off + i]
