"""Launchers of ``state_copy_kernel`` / ``state_zero_kernel`` (``kernels/state.cu``)."""

from __future__ import annotations

from ._module import check_rows, cupy, get_kernel

__all__ = ["state_copy_rows", "state_zero_rows"]


def state_copy_rows(src, dst, src_rows, dst_rows, *, threads: int = 256) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` (checkpoint save: slab -> store; restore: store -> slab).

    Parameters
    ----------
    src, dst : cupy.ndarray [rows, ...]
        Row-major slabs of the same dtype and row shape.
    src_rows, dst_rows : int64 [n]
    """
    api = "state_copy_rows"
    cp = cupy()
    n = len(src_rows)
    if len(dst_rows) != n:
        raise ValueError(f"{api}: len(dst_rows)={len(dst_rows)} != len(src_rows)={n}")
    if n == 0:
        return
    itemsize = src.dtype.itemsize
    row_elems = int(src[0].size)
    # The kernel addresses row r at r * row_elems in both slabs: contiguous rows, no gaps.
    for name, x in (("src", src), ("dst", dst)):
        if check_rows(api, name, x, row_elems, itemsize) != row_elems and x.shape[0] > 1:
            raise ValueError(f"{api}: {name}.strides[0]={x.strides[0]}, rows must be contiguous "
                             f"({row_elems * itemsize} bytes apart)")
    kern = get_kernel("state.cu", "state_copy_kernel", itemsize, dst.device.id)
    kern(
        (n, 1), (threads,),
        (src, dst, cp.asarray(src_rows, dtype=cp.int64), cp.asarray(dst_rows, dtype=cp.int64),
         cp.int64(n), cp.int64(row_elems)),
    )


def state_zero_rows(dst, rows, *, threads: int = 256) -> None:
    """``dst[rows[i]] = 0`` (slot zeroing on evict, admit miss and reset)."""
    api = "state_zero_rows"
    cp = cupy()
    n = len(rows)
    if n == 0:
        return
    itemsize = dst.dtype.itemsize
    row_elems = int(dst[0].size)
    if check_rows(api, "dst", dst) != row_elems and dst.shape[0] > 1:
        raise ValueError(f"{api}: dst.strides[0]={dst.strides[0]}, rows must be contiguous "
                         f"({row_elems * itemsize} bytes apart)")
    kern = get_kernel("state.cu", "state_zero_kernel", itemsize, dst.device.id)
    kern((n, 1), (threads,), (dst, cp.asarray(rows, dtype=cp.int64), cp.int64(n), cp.int64(row_elems)))
