"""Launchers of ``stage_gather_kernel`` / ``stage_scatter_kernel`` (``kernels/stage.cu``).

Tier transfers run them on their own stream (``stream=``) so staging overlaps
with compute.
"""

from __future__ import annotations

from ._module import check_rows, cupy, get_kernel

__all__ = ["stage_gather", "stage_scatter"]


def _launch(base, buffer, staging, block_ids, threads, stream, gather: bool):
    api = "stage_gather" if gather else "stage_scatter"
    cp = cupy()
    n = int(block_ids.shape[0])
    if n == 0:
        return
    itemsize = buffer.dtype.itemsize
    block_stride = check_rows(api, "buffer", buffer)
    block_elems = int(buffer[0].size)
    # The kernel addresses staging[i] at i * block_elems: contiguous rows of exactly one block.
    if check_rows(api, "staging", staging, block_elems, itemsize) != block_elems and staging.shape[0] > 1:
        raise ValueError(f"{api}: staging.strides[0]={staging.strides[0]}, must be {block_elems * itemsize} "
                         "(one block per row, contiguous)")
    if staging.shape[0] < n:
        raise ValueError(f"{api}: staging.shape[0]={staging.shape[0]} < len(block_ids)={n}")
    chunks = max(1, min(64, -(-block_elems * itemsize // (16 * threads * 4))))
    kern = get_kernel("stage.cu", base, itemsize, buffer.device.id)
    a, b = (buffer, staging) if gather else (staging, buffer)
    kern(
        (n, chunks), (threads,),
        (a, b, cp.ascontiguousarray(cp.asarray(block_ids), dtype=cp.int64), cp.int64(n), cp.int64(block_elems),
         cp.int64(block_stride)),
        stream=stream,
    )


def stage_gather(buffer, staging, block_ids, *, threads: int = 256, stream=None) -> None:
    """``staging[i] = buffer[block_ids[i]]`` for whole blocks.

    Parameters
    ----------
    buffer : cupy.ndarray [num_blocks, 2, num_layers, page_size, kv_heads, head_dim]
    staging : cupy.ndarray [n, 2, num_layers, page_size, kv_heads, head_dim], contiguous
        Same element size as ``buffer``; ``n >= len(block_ids)``.
    block_ids : int64 [n]
        Blocks of ``buffer`` (host or device integers).

    Raises
    ------
    ValueError
        A block of ``buffer`` that is not one contiguous run, ``staging`` rows that
        are not exactly one block apart, or element sizes that differ.
    """
    _launch("stage_gather_kernel", buffer, staging, block_ids, threads, stream, True)


def stage_scatter(staging, buffer, block_ids, *, threads: int = 256, stream=None) -> None:
    """``buffer[block_ids[i]] = staging[i]`` for whole blocks (shapes as :func:`stage_gather`)."""
    _launch("stage_scatter_kernel", buffer, staging, block_ids, threads, stream, False)
