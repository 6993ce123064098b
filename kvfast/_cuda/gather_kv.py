"""Launcher of ``gather_kv_kernel`` (``kernels/gather_kv.cu``)."""

from __future__ import annotations

from ._module import cupy, get_kernel, launch_1d_rows

__all__ = ["gather_kv"]


def gather_kv(k_cache, v_cache, block_row, seq_len: int, *, block_size: int, block_stride: int,
              row_stride: int, kv_heads: int, head_dim: int, threads: int | None = None):
    """Dense ``(K, V)``, each ``[seq_len, kv_heads, head_dim]``, of one slot.

    Parameters
    ----------
    k_cache, v_cache : cupy.ndarray
        Source planes (see ``gather_kv.cu`` for the geometry).
    block_row : cupy.ndarray int32 [max_blocks_per_seq]
        The slot's block-table row (contiguous mode: ``[slot]``).
    seq_len : int
        Positions to gather.
    """
    cp = cupy()
    k_out = cp.empty((seq_len, kv_heads, head_dim), dtype=k_cache.dtype)
    v_out = cp.empty_like(k_out)
    if seq_len == 0:
        return k_out, v_out
    row_elems = kv_heads * head_dim
    itemsize = k_cache.dtype.itemsize
    kern = get_kernel("gather_kv.cu", "gather_kv_kernel", itemsize, k_cache.device.id)
    threads = threads or launch_1d_rows(row_elems * itemsize)
    kern(
        (seq_len,), (threads,),
        (k_cache, v_cache, cp.ascontiguousarray(block_row, dtype=cp.int32), k_out, v_out,
         cp.int64(seq_len), cp.int64(row_elems), cp.int64(block_size), cp.int64(block_stride),
         cp.int64(row_stride)),
    )
    return k_out, v_out
