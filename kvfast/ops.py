"""Ops that write to and attend through a ``kvfast.KVCache`` (DESIGN §4.4).

Same names, arguments, results and errors as ``kvref.ops``:

* :func:`append_kv` scatters a step's new K/V through ``slot_mapping`` with
  a Numba kernel (CPU; parallel over tokens for large steps) or the
  ``append_kv.cu`` RawKernel (GPU); bit-pattern copies, padding slots
  (``< 0``) skipped.
* :func:`gather_kv` returns one slot's committed K/V densely (Numba or
  ``gather_kv.cu``).
* :func:`varlen_attention` attends a step's queries through the cache in
  float32; on the CPU it is the reference algorithm, on the GPU it is built
  from CuPy array operations over gathered K/V.
"""

from __future__ import annotations

import numpy as np

from kvref import ops as _ref_ops
from kvref._slot_cache import _check_index
from kvspec import KVCacheMode, LayerKind, StepIndices

from ._slot_cache import KVCache

__all__ = ["append_kv", "gather_kv", "varlen_attention"]

_ATTN_KINDS = (LayerKind.ATTENTION, LayerKind.SLIDING_WINDOW)
_KV_KINDS = (LayerKind.ATTENTION, LayerKind.SLIDING_WINDOW, LayerKind.CROSS_ATTENTION)


_COPY = None


def _copy():
    """The CPU copy kernels (Numba is imported on first use, then kept)."""
    global _COPY
    if _COPY is None:
        from ._numba import copy

        _COPY = copy
    return _COPY


def _layer_spec(api: str, cache, layer, kinds):
    """The layer's spec: ``TypeError`` for a non-cache, a non-int or a wrong kind, ``IndexError`` out of range."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"{api}: cache={type(cache).__name__}, must be a kvfast.KVCache")
    spec = cache.layer_specs[_check_index(api, "layer", layer, len(cache.layer_specs))]
    if spec.kind not in kinds:
        want = " or ".join(k.name for k in kinds)
        raise TypeError(f"{api}: layer={int(layer)} is {spec.kind.name}, must be {want}")
    return spec


def _geometry(cache, spec) -> tuple[int, int, int]:
    """``(block_size, block_stride, row_stride)`` in elements of an attention layer's storage."""
    row = spec.kv_heads * spec.head_dim
    if cache.mode() is KVCacheMode.PAGED:
        bs = cache.config.block_size
    else:
        bs = cache.config.max_seq_len
    return bs, bs * row, row


def append_kv(cache, layer: int, k, v, step: StepIndices) -> None:
    """Scatter a step's new K/V into an attention or sliding-window layer.

    Token t goes to flat storage row ``step.slot_mapping[t]``; tokens with
    ``slot_mapping < 0`` are skipped (padding).

    Parameters
    ----------
    cache : kvfast.KVCache
    layer : int
        An ATTENTION or SLIDING_WINDOW layer.
    k, v : float [T, kv_heads, head_dim]
        The step's new keys and values; cast to the storage dtype (no cast,
        a bit copy, when they already have it).
    step : StepIndices
        From ``cache.prepare_step``; ``T == step.num_tokens``.

    Raises
    ------
    IndexError
        ``layer`` out of range, or a ``slot_mapping`` entry past the storage.
    TypeError
        Wrong layer kind, non-floating ``k``/``v``, or ``step`` not a ``StepIndices``.
    ValueError
        Shapes wrong. Storage is unchanged.
    """
    api = "append_kv"
    spec = _layer_spec(api, cache, layer, _ATTN_KINDS)
    _ref_ops._check_step(api, step)
    if cache._device is not None:  # pragma: no cover - needs a GPU
        return _append_kv_cuda(cache, int(layer), spec, k, v, step)
    T = step.num_tokens
    k = _ref_ops._check_heads(api, "k", k, T, spec.kv_heads, spec.head_dim)
    v = _ref_ops._check_heads(api, "v", v, T, spec.kv_heads, spec.head_dim)
    sm = step.slot_mapping
    if not (isinstance(sm, np.ndarray) and sm.dtype == np.int64):
        sm = np.asarray(sm, dtype=np.int64)
    if sm.shape != (T,):
        raise ValueError(f"{api}: step.slot_mapping.shape={sm.shape} != ({T},)")
    if T == 0:
        return
    c = _copy()
    Kw, Vw, word, rows, bs, block_stride, row_stride = _word_views(cache, int(layer), spec)
    dt = cache._kv[int(layer)][0].dtype
    if k.dtype != dt:
        k = k.astype(dt)  # the reference's assignment casts the same way
    if v.dtype != dt:
        v = v.astype(dt)
    bad = c.scatter_rows(c.as_words(k, word), c.as_words(v, word), Kw, Vw, 0, 0, sm, bs, block_stride, row_stride,
                         rows)
    if bad >= 0:  # nothing was written
        raise IndexError(f"{api}: step.slot_mapping[{bad}]={sm[bad]} out of range [0, {rows})")


def _word_views(cache, layer: int, spec):
    """``(K words, V words, word dtype, storage rows, block_size, block_stride, row_stride)``
    of an attention layer, strides in words; cached on the cache (buffers keep
    their identity for the cache's life, DESIGN §4.1)."""
    views = cache.__dict__.setdefault("_word_views", {})
    got = views.get(layer)
    if got is None:
        c = _copy()
        K, V = cache._kv[layer]
        word = c.word_dtype(spec.kv_heads * spec.head_dim * K.dtype.itemsize)
        scale = K.dtype.itemsize / word.itemsize  # elements -> words
        bs, block_stride, row_stride = _geometry(cache, spec)
        got = (c.flat_words(K, word), c.flat_words(V, word), word, K.shape[0] * K.shape[1], bs,
               int(block_stride * scale), int(row_stride * scale))
        views[layer] = got
    return got


def _append_kv_cuda(cache, layer, spec, k, v, step):  # pragma: no cover - needs a GPU
    from ._cuda._module import cupy
    from ._cuda.append_kv import append_kv as launch
    from ._cuda.convert import rows_contiguous, shape_proxy, to_device_storage

    api = "append_kv"
    cp = cupy()
    T = step.num_tokens
    K, V = cache.keys(layer), cache.values(layer)
    with cp.cuda.Device(cache._device):
        # The reference's conversion (bfloat16: round to nearest even, ml_dtypes' bits) and checks, same messages.
        k = to_device_storage(api, "k", k, K.dtype, cache.config.dtype)
        _ref_ops._check_heads(api, "k", shape_proxy(k), T, spec.kv_heads, spec.head_dim)
        v = to_device_storage(api, "v", v, V.dtype, cache.config.dtype)
        _ref_ops._check_heads(api, "v", shape_proxy(v), T, spec.kv_heads, spec.head_dim)
        sm = cp.asarray(step.slot_mapping, cp.int64)
        if sm.shape != (T,):
            raise ValueError(f"{api}: step.slot_mapping.shape={sm.shape} != ({T},)")
        if T == 0:
            return
        rows = K.shape[0] * K.shape[1]
        if int(sm.max()) >= rows:  # one device sync; the kernel must not write past the storage
            i = int(cp.flatnonzero(sm >= rows)[0])
            raise IndexError(f"{api}: step.slot_mapping[{i}]={int(sm[i])} out of range [0, {rows})")
        bs, block_stride, row_stride = _geometry(cache, spec)
        launch(rows_contiguous(k), rows_contiguous(v), K, V, sm, block_size=bs, block_stride=block_stride,
               row_stride=row_stride)


def gather_kv(cache, layer: int, slot: int) -> tuple[np.ndarray, np.ndarray]:
    """Dense K and V of one slot.

    Parameters
    ----------
    cache : kvfast.KVCache
    layer : int
        ATTENTION / SLIDING_WINDOW (the slot's committed ``seq_lens()[slot]``
        positions) or CROSS_ATTENTION (the filled encoder length).
    slot : int
        ``0 <= slot < max_seqs``.

    Returns
    -------
    K, V : config.dtype [n, kv_heads, head_dim]
        Copies (NumPy on CPU, CuPy on CUDA).

    Raises
    ------
    IndexError
        ``layer`` or ``slot`` out of range.
    TypeError
        A STATE layer.
    """
    api = "gather_kv"
    spec = _layer_spec(api, cache, layer, _KV_KINDS)
    slot = _check_index(api, "slot", slot, cache.config.max_seqs)
    layer = int(layer)
    K, V = cache.keys(layer), cache.values(layer)
    if spec.kind is LayerKind.CROSS_ATTENTION:
        n = int(cache._enc[slot])
        return K[slot, :n].copy(), V[slot, :n].copy()
    n = int(cache._seq[slot])
    if cache.mode() is KVCacheMode.CONTIGUOUS:
        return K[slot, :n].copy(), V[slot, :n].copy()
    if cache._device is not None:  # pragma: no cover - needs a GPU
        import cupy as cp

        from ._cuda.gather_kv import gather_kv as launch

        bs, block_stride, row_stride = _geometry(cache, spec)
        return launch(K, V, cp.asarray(cache._table[slot]), n, block_size=bs, block_stride=block_stride,
                      row_stride=row_stride, kv_heads=spec.kv_heads, head_dim=spec.head_dim)
    out_k = np.empty((n, spec.kv_heads, spec.head_dim), K.dtype)
    out_v = np.empty_like(out_k)
    if n == 0:
        return out_k, out_v
    c = _copy()
    word = c.word_dtype(spec.kv_heads * spec.head_dim * K.dtype.itemsize)
    row_words = spec.kv_heads * spec.head_dim * K.dtype.itemsize // word.itemsize
    bs = cache.config.block_size
    table_row = cache._table[slot]
    for src, out in ((K, out_k), (V, out_v)):
        c.gather_rows(c.flat_words(src, word), 0, table_row, n, bs, bs * row_words, row_words,
                      out.reshape(n, -1).view(word))
    return out_k, out_v


def varlen_attention(q, cache, layer: int, step: StepIndices, scale: float | None = None):
    """Attention of a step's queries through the cache, computed in float32.

    Same semantics as ``kvref.ops.varlen_attention``: row b attends keys
    ``[0, step.seqused_k[b])`` causally (ATTENTION), within the window
    (SLIDING_WINDOW), or all ``cross_seqused_k[b]`` encoder keys
    non-causally (CROSS_ATTENTION); GQA groups query heads over K/V heads.

    Parameters
    ----------
    q : float [T, q_heads, head_dim]
        ``q_heads`` a multiple of the layer's ``kv_heads``.
    cache : kvfast.KVCache
    layer : int
        ATTENTION, SLIDING_WINDOW or CROSS_ATTENTION.
    step : StepIndices
        From ``cache.prepare_step``, with the step's K/V already appended.
    scale : float, optional
        Score scale; default ``1 / sqrt(head_dim)``.

    Returns
    -------
    float32 [T, q_heads, head_dim]

    Raises
    ------
    IndexError, TypeError, ValueError
        As the reference.
    """
    api = "varlen_attention"
    _layer_spec(api, cache, layer, _KV_KINDS)
    if cache._device is not None:  # pragma: no cover - needs a GPU
        return _varlen_attention_cuda(q, cache, int(layer), step, scale)
    # Spec §4.4: the reference is the oracle; on the CPU kvfast runs the same float32 algorithm.
    return _ref_ops.varlen_attention(q, cache, layer, step, scale)


def _varlen_attention_cuda(q, cache, layer, step, scale):  # pragma: no cover - needs a GPU
    """CuPy version of the reference algorithm (same masks, float32 math)."""
    import cupy as cp

    api = "varlen_attention"
    spec = cache.layer_specs[layer]
    _ref_ops._check_step(api, step)
    q = cp.asarray(q)
    T = step.num_tokens
    if q.ndim != 3 or q.shape[0] != T or q.shape[2] != spec.head_dim or q.shape[1] % spec.kv_heads:
        raise ValueError(f"{api}: q.shape={q.shape}, must be [{T}, k*{spec.kv_heads}, {spec.head_dim}]")
    if scale is None:
        scale = 1.0 / float(np.sqrt(spec.head_dim))
    group = q.shape[1] // spec.kv_heads
    out = cp.zeros(q.shape, cp.float32)
    cu = cp.asnumpy(cp.asarray(step.cu_seqlens_q)).astype(np.int64)
    past = cp.asnumpy(cp.asarray(step.past_len))
    used = cp.asnumpy(cp.asarray(step.seqused_k))
    cross = cp.asnumpy(cp.asarray(step.cross_seqused_k))
    slots = cp.asnumpy(cp.asarray(step.slot_ids))
    K, V = cache.keys(layer), cache.values(layer)
    for b in range(step.num_seqs):
        lo, hi = int(cu[b]), int(cu[b + 1])
        slot = int(slots[b])
        if spec.kind is LayerKind.CROSS_ATTENTION:
            n = int(cross[b])
            if n == 0:
                raise ValueError(f"{api}: step.cross_seqused_k[{b}]=0 for slot {slot}, fill layer {layer} first")
            k, v = K[slot, :n], V[slot, :n]
            mask = cp.ones((hi - lo, n), bool)
        else:
            n = int(used[b])
            if cache.mode() is KVCacheMode.CONTIGUOUS:
                k, v = K[slot, :n], V[slot, :n]
            else:
                bs = cache.config.block_size
                pos = cp.arange(n)
                flat = cp.asarray(step.block_table[b]).astype(cp.int64)[pos // bs] * bs + pos % bs
                k = K.reshape(-1, *K.shape[2:])[flat]
                v = V.reshape(-1, *V.shape[2:])[flat]
            p = int(past[b]) + cp.arange(hi - lo)[:, None]
            key = cp.arange(n)[None, :]
            mask = key <= p
            if spec.kind is LayerKind.SLIDING_WINDOW:
                mask &= key > p - spec.window
        kf = cp.repeat(k.astype(cp.float32), group, axis=1)
        vf = cp.repeat(v.astype(cp.float32), group, axis=1)
        s = cp.einsum("qhd,khd->hqk", q[lo:hi].astype(cp.float32), kf) * cp.float32(scale)
        s = cp.where(mask[None], s, -cp.inf)
        s = s - s.max(axis=-1, keepdims=True)
        w = cp.exp(s)
        w = w / w.sum(axis=-1, keepdims=True)
        out[lo:hi] = cp.einsum("hqk,khd->qhd", w, vf)
    return out
