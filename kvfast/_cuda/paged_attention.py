"""Launchers of ``paged_append_kernel`` and ``paged_attention_kernel`` (``kernels/paged_attention.cu``).

The manager's ops on CUDA (spec/manager.md §18): the lookup table, the cache lengths and the
row offsets are bound as device arrays; the host has checked them (kvref's policy) before
either kernel runs. FP8 pages (spec/manager.md §18.5) are written by ``append_kv_fp8.py``'s launches on the
layer's K / V planes and read here dequantised through ``kv_scales``.
"""

from __future__ import annotations

import struct

import numpy as np

from ._module import cupy, get_kernel, launch_1d_rows

__all__ = ["FILE", "KV_FORMATS", "paged_append", "paged_attention"]

#: The kernel file and its entry points.
FILE = "paged_attention.cu"

#: ``kv_format`` of the kernels by the buffer's logical dtype.
KV_FORMATS = {"float32": 0, "float16": 1, "bfloat16": 2, "float8_e4m3fn": 3, "float8_e5m2": 4}


def _strides(kv) -> tuple[int, ...]:
    it = kv.dtype.itemsize
    return tuple(int(s) // it for s in kv.strides)


def _f32_bits(x: float) -> int:
    """The bits of ``x`` rounded to float32, as an unsigned integer (how the kernels take a float)."""
    return struct.unpack("<I", struct.pack("<f", np.float32(x)))[0]


def _tables(lut, lengths, row_offsets):
    """The index arrays as the kernels take them: contiguous device ``uint32``, ``uint32``, ``int64``."""
    cp = cupy()
    return (cp.ascontiguousarray(cp.asarray(lut), dtype=cp.uint32),
            cp.ascontiguousarray(cp.asarray(lengths), dtype=cp.uint32),
            cp.ascontiguousarray(cp.asarray(row_offsets), dtype=cp.int64))


def paged_append(key, value, kv, layer: int, lut, lengths, row_offsets) -> None:
    """``kv[page, 0/1, layer, p % page_size] = key[t] / value[t]`` for every token on a real page.

    Parameters
    ----------
    key, value : cupy.ndarray [T, kv_heads, head_dim]
        In ``kv``'s dtype; each row's ``kv_heads * head_dim`` elements contiguous (rows may be strided).
    kv : cupy.ndarray [num_blocks, 2, num_layers, page_size, kv_heads, head_dim]
        Any strides.
    layer : int
    lut : uint32 [B, cols]; lengths : uint32 [B]; row_offsets : int64 [B + 1]
        Host or device arrays, already checked.
    """
    cp = cupy()
    t = int(key.shape[0])
    if t == 0:
        return
    if key.dtype != kv.dtype or value.dtype != kv.dtype:
        raise ValueError(f"paged_append: key dtype={key.dtype}, value dtype={value.dtype} != kv dtype={kv.dtype}")
    it = kv.dtype.itemsize
    lut, lengths, row_offsets = _tables(lut, lengths, row_offsets)
    H, D = int(kv.shape[4]), int(kv.shape[5])
    kern = get_kernel(FILE, "paged_append_kernel", it, kv.device.id)
    threads = launch_1d_rows(H * D * it)
    kern((t,), (threads,),
         (key, value, kv, lut, lengths, row_offsets, cp.int64(t), cp.int64(lengths.shape[0]),
          cp.int64(lut.shape[1]), cp.int64(layer), cp.int64(H), cp.int64(D), cp.int64(kv.shape[3]),
          cp.int64(key.strides[0] // it), cp.int64(value.strides[0] // it), *map(cp.int64, _strides(kv))))


def paged_attention(q, kv, layer: int, lut, lengths, row_offsets, *, window: int, scale: float, kv_format: int,
                    kv_scales=None, softcap: float = 0.0, sinks=None):
    """float32 ``[T, q_heads, head_dim]``: the attention of ``q`` through ``kv`` (spec/manager.md §18.4).

    Parameters
    ----------
    q : cupy.ndarray float32 [T, q_heads, head_dim]
    kv : cupy.ndarray [num_blocks, 2, num_layers, page_size, kv_heads, head_dim]
        float32 (``uint32`` words are not accepted: pass the float32 array), float16, ``uint16``
        bfloat16 bits, or ``uint8`` FP8 bits (with ``kv_scales``); ``kv_format`` says which
        (:data:`KV_FORMATS`).
    window : int
        0 for full attention.
    scale : float
        The score scale (passed to the kernel as its float32 bits).
    kv_scales : cupy.ndarray float32 [num_blocks, 2, num_layers, kv_heads], optional
        FP8 pages' scales (any strides): each key and value read as ``float(x) * scale``
        (spec/manager.md §18.5). Required for FP8 formats, refused otherwise.
    softcap : float
        Logit soft-capping (Gemma 2): each score ``s = scale * dot(q, k)`` becomes ``softcap *
        tanh(s / softcap)`` before the softmax; 0.0 (the default) leaves the scores as they are.
        Passed to the kernel as its float32 bits (0 bits: off).
    sinks : numpy.ndarray or cupy.ndarray float32 [q_heads], optional
        Per-head sink logits (gpt-oss): with ``m`` the largest of head h's visible scores and
        ``sinks[h]``, the output is ``sum_k exp(s_k - m) v_k / (sum_k exp(s_k - m) + exp(sinks[h] -
        m))``; host arrays are copied to the device. A query that sees no key still gives zeros.
        None: no sinks (the kernel gets a one-element array it does not read).

    Returns
    -------
    cupy.ndarray float32 [T, q_heads, head_dim]

    Raises
    ------
    ValueError
        FP8 pages without their scales (or scales for other pages), ``kv_scales`` of the wrong
        dtype or shape, ``sinks`` not of shape ``[q_heads]``.
    """
    cp = cupy()
    q = cp.ascontiguousarray(q, dtype=cp.float32)
    T, Hq, D = (int(n) for n in q.shape)
    out = cp.zeros((T, Hq, D), cp.float32)
    if T == 0:
        return out
    fp8 = kv_format in (KV_FORMATS["float8_e4m3fn"], KV_FORMATS["float8_e5m2"])
    if fp8 != (kv_scales is not None) or (fp8 and kv.dtype != cp.uint8):
        raise ValueError(f"paged_attention: kv_format={kv_format} (kv dtype={kv.dtype}) with kv_scales "
                         f"{'given' if kv_scales is not None else 'None'}: FP8 (uint8) pages need their scales, "
                         "no other pages take any")
    if fp8:
        if kv_scales.dtype != cp.float32 or kv_scales.shape != (kv.shape[0], 2, kv.shape[2], kv.shape[4]):
            raise ValueError(f"paged_attention: kv_scales {kv_scales.dtype} {tuple(kv_scales.shape)}, must be "
                             "float32 [num_blocks, 2, num_layers, kv_heads] of kv")
        scales, sstrides = kv_scales, tuple(int(n) // 4 for n in kv_scales.strides)
    else:
        scales, sstrides = cp.ones((1,), cp.float32), (0, 0, 0, 0)  # every value times 1.0f: exact
    if sinks is None:
        sinks_arg, has_sinks = cp.zeros((1,), cp.float32), 0
    else:
        sinks_arg, has_sinks = cp.ascontiguousarray(cp.asarray(sinks), dtype=cp.float32), 1
        if sinks_arg.shape != (Hq,):
            raise ValueError(f"paged_attention: sinks shape={tuple(sinks_arg.shape)}, must be [q_heads] = ({Hq},)")
    lut, lengths, row_offsets = _tables(lut, lengths, row_offsets)
    kern = get_kernel(FILE, "paged_attention_kernel", kv.dtype.itemsize, kv.device.id)
    threads = int(min(128, -(-Hq // 32) * 32))
    bits = _f32_bits(scale)
    cap_bits = 0 if np.float32(softcap) == 0 else _f32_bits(softcap)  # -0.0 (and what rounds to 0) is off too
    kern((T,), (threads,),
         (q, kv, lut, lengths, row_offsets, out, scales, sinks_arg, cp.int64(T), cp.int64(lengths.shape[0]),
          cp.int64(lut.shape[1]), cp.int64(layer), cp.int64(Hq), cp.int64(kv.shape[4]), cp.int64(D),
          cp.int64(kv.shape[3]), cp.int64(window), cp.int64(kv_format), cp.int64(bits), cp.int64(cap_bits),
          cp.int64(has_sinks), *map(cp.int64, _strides(kv)), *map(cp.int64, sstrides)))
    return out
