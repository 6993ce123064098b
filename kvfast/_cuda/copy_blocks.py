"""Launcher of ``copy_blocks_kernel`` (``kernels/copy_blocks.cu``)."""

from __future__ import annotations

from ._module import check_rows, cupy, get_kernel

__all__ = ["copy_blocks"]


def copy_blocks(src, dst, block_mapping, *, threads: int = 256, stream=None) -> None:
    """Copy whole blocks ``src[m[i, 0]] -> dst[m[i, 1]]``.

    Parameters
    ----------
    src, dst : cupy.ndarray [num_blocks, ...]
        Block-major buffers of the same dtype and block shape (may be the
        same array; replicas may sit on different buffers).
    block_mapping : cupy.ndarray int64 [num_pairs, 2]
        ``(src_block, dst_block)`` pairs.
    """
    api = "copy_blocks"
    cp = cupy()
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"copy_blocks: src {src.dtype}{src.shape[1:]} but dst {dst.dtype}{dst.shape[1:]}")
    n = int(block_mapping.shape[0])
    if n == 0:
        return
    itemsize = src.dtype.itemsize
    stride = check_rows(api, "src", src)
    # One block stride for both buffers (the kernel takes one).
    if check_rows(api, "dst", dst) != stride and dst.shape[0] > 1 and src.shape[0] > 1:
        raise ValueError(f"{api}: dst.strides[0]={dst.strides[0]} != src.strides[0]={src.strides[0]}")
    block_elems = int(src[0].size)
    chunks = max(1, min(64, -(-block_elems * itemsize // (16 * threads * 4))))
    kern = get_kernel("copy_blocks.cu", "copy_blocks_kernel", itemsize, dst.device.id)
    kern(
        (n, chunks), (threads,),
        (src, dst, cp.ascontiguousarray(cp.asarray(block_mapping), dtype=cp.int64), cp.int64(n),
         cp.int64(block_elems), cp.int64(stride)),
        stream=stream,
    )
