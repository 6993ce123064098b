"""Launcher of ``append_kv_kernel`` (``kernels/append_kv.cu``)."""

from __future__ import annotations

from ._module import check_rows, cupy, get_kernel, launch_1d_rows

__all__ = ["append_kv"]


def append_kv(key, value, k_cache, v_cache, slot_mapping, *, block_size: int, block_stride: int,
              row_stride: int, threads: int | None = None, stream=None) -> None:
    """Scatter ``key``/``value`` rows into ``k_cache``/``v_cache`` through ``slot_mapping``.

    Parameters
    ----------
    key, value : cupy.ndarray [T, kv_heads, head_dim]
        Rows of the step; each row's ``kv_heads * head_dim`` elements
        contiguous, rows may be strided.
    k_cache, v_cache : cupy.ndarray
        Destination planes, same dtype; row of slot ``s`` starts at
        ``(s // block_size) * block_stride + (s % block_size) * row_stride`` elements.
    slot_mapping : cupy.ndarray int64 [T]
        Destination slot per token; ``< 0`` skips the token (padding).
    block_size, block_stride, row_stride : int
        Geometry in elements (see ``append_kv.cu``).
    threads : int, optional
        Threads per CTA (default: one per 16-byte vector of a row, <= 256).
    """
    cp = cupy()
    t = int(slot_mapping.shape[0])
    if t == 0:
        return
    row_elems = int(key.shape[1] * key.shape[2])
    if key.dtype != k_cache.dtype or value.dtype != v_cache.dtype or key.dtype != value.dtype:
        raise ValueError(f"append_kv: key dtype={key.dtype} but cache dtype={k_cache.dtype}")
    if slot_mapping.dtype != cp.int64:
        raise ValueError(f"append_kv: slot_mapping dtype={slot_mapping.dtype}, must be int64")
    itemsize = key.dtype.itemsize
    check_rows("append_kv", "key", key, row_elems)  # rows may be strided; each row contiguous
    check_rows("append_kv", "value", value, row_elems)
    if value.shape[0] != t or key.shape[0] != t:
        raise ValueError(f"append_kv: key.shape[0]={key.shape[0]}, value.shape[0]={value.shape[0]} != "
                         f"len(slot_mapping)={t}")
    kern = get_kernel("append_kv.cu", "append_kv_kernel", itemsize, k_cache.device.id)
    threads = threads or launch_1d_rows(row_elems * itemsize)
    kern(
        (t,), (threads,),
        (key, value, k_cache, v_cache, slot_mapping, cp.int64(t), cp.int64(row_elems),
         cp.int64(key.strides[0] // itemsize), cp.int64(value.strides[0] // itemsize),
         cp.int64(block_size), cp.int64(block_stride), cp.int64(row_stride)),
        stream=stream,
    )
