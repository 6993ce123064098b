"""Launchers of ``stage_gather_kernel`` / ``stage_scatter_kernel`` (``kernels/stage.cu``).

Tier transfers run them on their own stream (``stream=``) so staging overlaps
with compute.
"""

from __future__ import annotations

from ._module import cupy, get_kernel

__all__ = ["stage_gather", "stage_scatter"]


def _launch(base, a, b, buffer, block_ids, threads, stream):  # pragma: no cover - needs a GPU
    cp = cupy()
    n = int(block_ids.shape[0])
    if n == 0:
        return
    itemsize = buffer.dtype.itemsize
    block_elems = int(buffer[0].size)
    chunks = max(1, min(64, -(-block_elems * itemsize // (16 * threads * 4))))
    kern = get_kernel("stage.cu", base, itemsize, buffer.device.id)
    kern(
        (n, chunks), (threads,),
        (a, b, cp.ascontiguousarray(block_ids, dtype=cp.int64), cp.int64(n), cp.int64(block_elems),
         cp.int64(buffer.strides[0] // itemsize)),
        stream=stream,
    )


def stage_gather(buffer, staging, block_ids, *, threads: int = 256, stream=None) -> None:  # pragma: no cover - needs a GPU
    """``staging[i] = buffer[block_ids[i]]`` for whole blocks.

    Parameters
    ----------
    buffer : cupy.ndarray [num_blocks, 2, num_layers, page_size, kv_heads, head_dim]
    staging : cupy.ndarray [n, 2, num_layers, page_size, kv_heads, head_dim], contiguous
    block_ids : int64 [n]
    """
    _launch("stage_gather_kernel", buffer, staging, buffer, block_ids, threads, stream)


def stage_scatter(staging, buffer, block_ids, *, threads: int = 256, stream=None) -> None:  # pragma: no cover - needs a GPU
    """``buffer[block_ids[i]] = staging[i]`` for whole blocks (shapes as :func:`stage_gather`)."""
    _launch("stage_scatter_kernel", staging, buffer, buffer, block_ids, threads, stream)
