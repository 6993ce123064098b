"""Launchers of ``kernels/append_kv_fp8.cu`` (``spec/slot-cache.md`` §10): the quantising append and
the dequantising gather of an FP8 cache."""

from __future__ import annotations

from ._module import check_rows, cupy, get_kernel, launch_1d_rows

__all__ = ["FP8_FORMAT", "append_kv_fp8", "gather_kv_fp8"]

#: FP8 storage dtype name -> the kernels' ``fp8_format`` code.
FP8_FORMAT = {"float8_e4m3fn": 0, "float8_e5m2": 1}


def append_kv_fp8(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping, *, fp8: str, block_size: int,
                  block_stride: int, row_stride: int, unit_tokens: int, bfloat16_input: bool = False,
                  threads: int | None = None, stream=None) -> None:
    """Quantise ``key``/``value`` rows into FP8 ``k_cache``/``v_cache`` through ``slot_mapping``.

    Three launches on one stream (scale, re-quantise, append), no host sync:
    the scales are read and written on the device.

    Parameters
    ----------
    key, value : cupy.ndarray [T, kv_heads, head_dim]
        float32, float16, or uint16 bfloat16 bit patterns (``bfloat16_input=True``);
        each row contiguous, rows may be strided. Finite in every row whose slot is ``>= 0``
        (checked by the caller); a padding row (slot ``< 0``) is never read, by any of the three
        kernels, so it may hold anything (NaN, inf, huge values).
    k_cache, v_cache : cupy.ndarray uint8 [num_blocks, block_size, kv_heads, head_dim]
        FP8 bit patterns; contiguous storage is ``[max_seqs, max_seq_len, ...]`` with
        ``block_size = max_seq_len``.
    k_scale, v_scale : cupy.ndarray float32
        The scales, updated in place: C-contiguous with ``num_blocks * units_per_block *
        kv_heads`` elements (``[num_blocks, kv_heads]`` paged, ``[max_seqs, units_per_slot,
        kv_heads]`` contiguous), or a 2-D ``[num_units, kv_heads]`` view whose rows are
        strided (the manager's ``scales[:, kv, layer]`` of ``[num_blocks, 2, num_layers,
        kv_heads]``) with contiguous heads.
    slot_mapping : cupy.ndarray int64 [T]
        Destination slot per token, every one ``< num_blocks * block_size`` (checked by the
        caller); ``< 0`` skips the token.
    fp8 : str
        ``"float8_e4m3fn"`` or ``"float8_e5m2"``.
    block_size, block_stride, row_stride : int
        Storage geometry in elements (see ``append_kv_fp8.cu``).
    unit_tokens : int
        Positions per scale unit (the cache's ``block_size``).
    threads : int, optional
        Threads per CTA of the append kernel (default: one per 16-byte vector, <= 256).
    """
    cp = cupy()
    t = int(slot_mapping.shape[0])
    if t == 0:
        return
    _check_storage("append_kv_fp8", fp8, k_cache, v_cache, k_scale, v_scale)
    if key.dtype != value.dtype or key.dtype not in (cp.float32, cp.float16, cp.uint16):
        raise ValueError(f"append_kv_fp8: key dtype={key.dtype}, value dtype={value.dtype}, must both be "
                         "float32, float16 or uint16 (bfloat16 bits)")
    if (key.dtype == cp.uint16) != bool(bfloat16_input):
        raise ValueError(f"append_kv_fp8: key dtype={key.dtype} but bfloat16_input={bfloat16_input}")
    if slot_mapping.dtype != cp.int64:
        raise ValueError(f"append_kv_fp8: slot_mapping dtype={slot_mapping.dtype}, must be int64")
    kv_heads, head_dim = int(key.shape[1]), int(key.shape[2])
    row_elems = kv_heads * head_dim
    check_rows("append_kv_fp8", "key", key, row_elems)
    check_rows("append_kv_fp8", "value", value, row_elems)
    if key.shape[0] != t or value.shape[0] != t:
        raise ValueError(f"append_kv_fp8: key.shape[0]={key.shape[0]}, value.shape[0]={value.shape[0]} != "
                         f"len(slot_mapping)={t}")
    units_per_block = -(-block_size // unit_tokens)
    itemsize = key.dtype.itemsize
    dev = k_cache.device.id
    I = cp.int64
    fmt, in_fmt = I(FP8_FORMAT[fp8]), I(1 if bfloat16_input else 0)
    ks, vs = _scale_rows("append_kv_fp8", k_scale, v_scale, kv_heads)
    num_units, scale_stride = int(ks.shape[0]), I(ks.strides[0] // 4)
    # 1. every touched unit-head's next scale: a copy of the scales, raised by atomicMax
    k_next, v_next = ks.copy(), vs.copy()
    get_kernel("append_kv_fp8.cu", "fp8_scale_kernel", itemsize, dev)(
        (t,), (32,),
        (key, value, k_next.view(cp.uint32), v_next.view(cp.uint32), slot_mapping, I(t), I(kv_heads),
         I(head_dim), I(key.strides[0] // itemsize), I(value.strides[0] // itemsize), in_fmt, fmt,
         I(block_size), I(units_per_block), I(unit_tokens)),
        stream=stream,
    )
    # 2. grown unit-heads re-quantised, scales committed
    get_kernel("append_kv_fp8.cu", "fp8_requant_kernel", itemsize, dev)(
        (num_units,), (32,),
        (k_cache, v_cache, ks, vs, k_next, v_next, I(num_units), I(kv_heads), I(head_dim), I(block_size),
         I(units_per_block), I(unit_tokens), I(block_stride), I(row_stride), scale_stride, fmt),
        stream=stream,
    )
    # 3. the step's rows, quantised with the committed scales (16-byte stores)
    threads = threads or launch_1d_rows(row_elems)
    get_kernel("append_kv_fp8.cu", "fp8_append_kernel", itemsize, dev)(
        (t,), (threads,),
        (key, value, k_cache, v_cache, ks, vs, slot_mapping, I(t), I(kv_heads), I(head_dim),
         I(key.strides[0] // itemsize), I(value.strides[0] // itemsize), in_fmt, fmt, I(block_size),
         I(units_per_block), I(unit_tokens), I(block_stride), I(row_stride), scale_stride),
        stream=stream,
    )


def _check_storage(op: str, fp8: str, k_cache, v_cache, k_scale, v_scale) -> None:
    """The format name, uint8 FP8 bit patterns and float32 scales (``ValueError`` naming ``op``)."""
    cp = cupy()
    if fp8 not in FP8_FORMAT:
        raise ValueError(f"{op}: fp8={fp8!r}, must be one of {sorted(FP8_FORMAT)}")
    if k_cache.dtype != cp.uint8 or v_cache.dtype != cp.uint8:
        raise ValueError(f"{op}: cache dtype={k_cache.dtype}, must be uint8 (FP8 bit patterns)")
    if k_scale.dtype != cp.float32 or v_scale.dtype != cp.float32:
        raise ValueError(f"{op}: scale dtype={k_scale.dtype}, must be float32")


def _scale_rows(op: str, k_scale, v_scale, kv_heads: int):
    """Both scales as ``[num_units, kv_heads]`` rows (:func:`_unit_rows`), of one shape and stride."""
    ks, vs = _unit_rows(op, k_scale, kv_heads), _unit_rows(op, v_scale, kv_heads)
    if ks.shape != vs.shape or ks.strides != vs.strides:
        raise ValueError(f"{op}: k_scale rows {ks.shape}/{ks.strides} != v_scale rows {vs.shape}/{vs.strides}")
    return ks, vs


def _unit_rows(op: str, scale, kv_heads: int):
    """``scale`` as ``[num_units, kv_heads]`` with contiguous heads (a view, never a copy)."""
    if scale.ndim == 2 and scale.shape[1] == kv_heads and scale.strides[1] == 4 and scale.strides[0] % 4 == 0:
        return scale
    if not scale.flags.c_contiguous or scale.size % kv_heads:
        raise ValueError(f"{op}: scale shape={scale.shape} strides={scale.strides}, must be C-contiguous "
                         f"or [num_units, {kv_heads}] rows with contiguous heads")
    return scale.reshape(-1, kv_heads)


def gather_kv_fp8(k_cache, v_cache, k_scale, v_scale, block_row, seq_len: int, *, fp8: str, block_size: int,
                  block_stride: int, row_stride: int, unit_tokens: int, kv_heads: int, head_dim: int,
                  threads: int | None = None):
    """Dense dequantised ``(K, V)``, each float32 ``[seq_len, kv_heads, head_dim]``, of one slot:
    every position's FP8 value times its unit-head's scale (spec/slot-cache.md §10.3), one launch.

    Parameters
    ----------
    k_cache, v_cache : cupy.ndarray uint8
        FP8 bit patterns, the geometry of :func:`append_kv_fp8`.
    k_scale, v_scale : cupy.ndarray float32
        The scales, as :func:`append_kv_fp8` takes them.
    block_row : cupy.ndarray int32 [max_blocks_per_seq]
        The slot's block-table row (contiguous storage: ``[slot]`` with ``block_size =
        max_seq_len``).
    seq_len : int
        Positions to gather.
    """
    cp = cupy()
    k_out = cp.empty((seq_len, kv_heads, head_dim), dtype=cp.float32)
    v_out = cp.empty_like(k_out)
    if seq_len == 0:
        return k_out, v_out
    _check_storage("gather_kv_fp8", fp8, k_cache, v_cache, k_scale, v_scale)
    ks, vs = _scale_rows("gather_kv_fp8", k_scale, v_scale, kv_heads)
    I = cp.int64
    threads = threads or launch_1d_rows(kv_heads * head_dim)
    get_kernel("append_kv_fp8.cu", "fp8_gather_kernel", 1, k_cache.device.id)(
        (seq_len,), (threads,),
        (k_cache, v_cache, ks, vs, cp.ascontiguousarray(block_row, dtype=cp.int32), k_out, v_out, I(seq_len),
         I(kv_heads), I(head_dim), I(block_size), I(-(-block_size // unit_tokens)), I(unit_tokens),
         I(block_stride), I(row_stride), I(ks.strides[0] // 4), I(FP8_FORMAT[fp8])),
    )
    return k_out, v_out
