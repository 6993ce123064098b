"""Launchers of ``state_copy_kernel`` / ``state_zero_kernel`` (``kernels/state.cu``)."""

from __future__ import annotations

from ._module import cupy, get_kernel

__all__ = ["state_copy_rows", "state_zero_rows"]


def state_copy_rows(src, dst, src_rows, dst_rows, *, threads: int = 256) -> None:  # pragma: no cover - needs a GPU
    """``dst[dst_rows[i]] = src[src_rows[i]]`` (checkpoint save: slab -> store; restore: store -> slab).

    Parameters
    ----------
    src, dst : cupy.ndarray [rows, ...]
        Row-major slabs of the same dtype and row shape.
    src_rows, dst_rows : int64 [n]
    """
    cp = cupy()
    n = len(src_rows)
    if n == 0:
        return
    itemsize = src.dtype.itemsize
    row_elems = int(src[0].size)
    kern = get_kernel("state.cu", "state_copy_kernel", itemsize, dst.device.id)
    kern(
        (n, 1), (threads,),
        (src, dst, cp.asarray(src_rows, dtype=cp.int64), cp.asarray(dst_rows, dtype=cp.int64),
         cp.int64(n), cp.int64(row_elems)),
    )


def state_zero_rows(dst, rows, *, threads: int = 256) -> None:  # pragma: no cover - needs a GPU
    """``dst[rows[i]] = 0`` (slot zeroing on evict, admit miss and reset)."""
    cp = cupy()
    n = len(rows)
    if n == 0:
        return
    itemsize = dst.dtype.itemsize
    kern = get_kernel("state.cu", "state_zero_kernel", itemsize, dst.device.id)
    kern((n, 1), (threads,), (dst, cp.asarray(rows, dtype=cp.int64), cp.int64(n), cp.int64(int(dst[0].size))))
