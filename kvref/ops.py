"""Ops that write to and attend through a ``KVCache`` (DESIGN §4.4, ``spec/slot-cache.md`` §7).

The ops' **policy**: argument checks in the spec's order, messages, which
positions a layer reads. The mechanisms (scatter, gather, attention) are the
cache's engine (``cache.engine``, a ``kvspec.engine.SlotEngine``), so these
functions serve every backend that runs the ``kvref.KVCache`` policy; with
the reference engine they are the semantic oracle: attention through a cache
equals dense attention over each sequence's concatenated history.

* :func:`append_kv` scatters a step's new K/V through ``step.slot_mapping``.
* :func:`gather_kv` returns one slot's committed K/V densely.
* :func:`varlen_attention` attends a step's queries through the cache
  (causal, sliding-window aware, GQA; cross layers non-causal), in float32.
"""

from __future__ import annotations

import math

import numpy as np

from kvspec import KVCacheMode, LayerKind, StepIndices
from kvspec._interop import host_array

from ._slot_cache import KVCache, _check_index

__all__ = ["append_kv", "gather_kv", "varlen_attention"]

_ATTN_KINDS = (LayerKind.ATTENTION, LayerKind.SLIDING_WINDOW)
_KV_KINDS = (LayerKind.ATTENTION, LayerKind.SLIDING_WINDOW, LayerKind.CROSS_ATTENTION)


def _layer_spec(api: str, cache, layer, kinds):
    """The layer's spec: ``TypeError`` for a non-cache, a non-int or a wrong kind, ``IndexError`` out of range."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"{api}: cache={type(cache).__name__}, must be a kvref.KVCache")
    spec = cache.layer_specs[_check_index(api, "layer", layer, len(cache.layer_specs))]
    if spec.kind not in kinds:
        want = " or ".join(k.name for k in kinds)
        raise TypeError(f"{api}: layer={int(layer)} is {spec.kind.name}, must be {want}")
    return spec


def _check_step(api: str, step) -> None:
    if not isinstance(step, StepIndices):
        raise TypeError(f"{api}: step={type(step).__name__}, must be the StepIndices of prepare_step")


def _check_heads(api: str, name: str, arr, T: int, heads: int, dim: int, *, multiple: bool = False,
                 storage_dtype=None):
    """A floating ``[T, heads, dim]`` array (``heads`` a multiple of the layer's when ``multiple``).

    Device arrays (``__cuda_array_interface__``) are checked in place, anything else through
    ``np.asarray``. An array already in ``storage_dtype`` (the engine's converted form) passes
    the dtype check.
    """
    if not (isinstance(arr, np.ndarray) or hasattr(arr, "__cuda_array_interface__")):
        arr = host_array(arr)  # torch tensors too, bfloat16 included (kvspec._interop)
    if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16" and arr.dtype != storage_dtype:
        raise TypeError(f"{api}: {name} dtype={arr.dtype}, must be a floating type")
    if arr.ndim != 3:
        raise ValueError(f"{api}: {name}.ndim={arr.ndim}, must be 3 [tokens, heads, head_dim]")
    if arr.shape[0] != T:
        raise ValueError(f"{api}: {name}.shape[0]={arr.shape[0]} != step.num_tokens={T}")
    if arr.shape[2] != dim:
        raise ValueError(f"{api}: {name}.shape[2]={arr.shape[2]} != head_dim={dim}")
    if multiple:
        if arr.shape[1] % heads:
            raise ValueError(f"{api}: {name}.shape[1]={arr.shape[1]} is not a multiple of kv_heads={heads}")
    elif arr.shape[1] != heads:
        raise ValueError(f"{api}: {name}.shape[1]={arr.shape[1]} != kv_heads={heads}")
    return arr


def append_kv(cache, layer: int, k, v, step: StepIndices) -> None:
    """Scatter a step's new K/V into an attention or sliding-window layer.

    Token t goes to flat storage row ``step.slot_mapping[t]`` (``[slots *
    max_seq_len]`` contiguous, ``[num_blocks * block_size]`` paged); tokens
    with ``slot_mapping < 0`` are skipped (padding).

    Parameters
    ----------
    cache : KVCache
    layer : int
        An ATTENTION or SLIDING_WINDOW layer.
    k, v : float [T, kv_heads, head_dim]
        The step's new keys and values; an FP8 cache quantises them with per-(block, head)
        scales (``spec/slot-cache.md`` §10.2: finite values in every row with ``slot_mapping >= 0``,
        else ``ValueError``; padding rows are never read, any values there change nothing); otherwise
        cast to the storage dtype.
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
    _check_step(api, step)
    T = step.num_tokens
    engine, layer = cache._engine, int(layer)
    K, V = cache._kv[layer]  # the layer is validated above
    if cache._fp8:
        return _append_fp8(api, cache, engine, layer, spec, k, v, step, T)
    dt = cache.config.dtype
    k = _check_heads(api, "k", engine.kv_input(api, "k", k, K.dtype, dt), T, spec.kv_heads, spec.head_dim,
                     storage_dtype=K.dtype)
    v = _check_heads(api, "v", engine.kv_input(api, "v", v, V.dtype, dt), T, spec.kv_heads, spec.head_dim,
                     storage_dtype=V.dtype)
    sm = step.slot_mapping
    if not hasattr(sm, "shape"):
        sm = np.asarray(sm, dtype=np.int64)
    if sm.shape != (T,):
        raise ValueError(f"{api}: step.slot_mapping.shape={sm.shape} != ({T},)")
    bad = engine.scatter_kv(K, V, k, v, sm)
    if bad >= 0:  # spec/slot-cache.md §7.1: nothing was written
        raise IndexError(f"{api}: step.slot_mapping[{bad}]={int(sm[bad])} out of range [0, {K.shape[0] * K.shape[1]})")


def _append_fp8(api: str, cache, engine, layer: int, spec, k, v, step: StepIndices, T: int) -> None:
    """spec/slot-cache.md §10.2: quantise a step's K/V into an FP8 layer (checks first, then the write)."""
    K, V = cache._kv[layer]
    Ks, Vs = cache._scales[layer]
    k = _check_heads(api, "k", engine.kv_input_float32(api, "k", k), T, spec.kv_heads, spec.head_dim)
    v = _check_heads(api, "v", engine.kv_input_float32(api, "v", v), T, spec.kv_heads, spec.head_dim)
    sm = step.slot_mapping
    if not hasattr(sm, "shape"):
        sm = np.asarray(sm, dtype=np.int64)
    if sm.shape != (T,):
        raise ValueError(f"{api}: step.slot_mapping.shape={sm.shape} != ({T},)")
    for name, x in (("k", k), ("v", v)):
        bad = _first_nonfinite_token(engine, x, sm)
        if bad >= 0:
            raise ValueError(f"{api}: {name}[{bad}] has a non-finite value, FP8 storage needs finite inputs")
    bad = engine.scatter_kv_fp8(K, V, Ks, Vs, k, v, sm, cache.config.block_size)
    if bad >= 0:  # spec/slot-cache.md §7.1: nothing was written
        raise IndexError(f"{api}: step.slot_mapping[{bad}]={int(sm[bad])} out of range [0, {K.shape[0] * K.shape[1]})")


def _first_nonfinite_token(engine, x, sm) -> int:
    """The first token ``t`` with ``slot_mapping[t] >= 0`` whose row of ``x`` holds a NaN or an
    infinity, else -1 (``spec/slot-cache.md`` §7.1, §10.2: padding rows are not read, so their
    values, finite or not, change nothing).

    One ``engine.first_nonfinite`` over all rows when no row is non-finite (the common case: the
    slot mapping is not even brought to the host); a hit in a padding row resumes the search at
    the next real token, as a slice (a view: no copy, no host index into a device array).
    """
    bad = engine.first_nonfinite(x)
    if bad < 0:
        return -1
    real = np.asarray(engine.to_host(sm)) >= 0
    while not real[bad]:
        after = np.flatnonzero(real[bad:])
        if not after.size:
            return -1  # only padding from here on
        t0 = bad + int(after[0])
        got = engine.first_nonfinite(x[t0:])
        if got < 0:
            return -1
        bad = t0 + got
    return bad


def gather_kv(cache, layer: int, slot: int) -> tuple[np.ndarray, np.ndarray]:
    """Dense K and V of one slot.

    Parameters
    ----------
    cache : KVCache
    layer : int
        ATTENTION / SLIDING_WINDOW (the slot's committed ``seq_lens()[slot]``
        positions) or CROSS_ATTENTION (the filled encoder length).
    slot : int
        ``0 <= slot < max_seqs``.

    Returns
    -------
    K, V : ndarray, config.dtype, [n, kv_heads, head_dim]
        Copies. An FP8 cache returns float32, dequantised (``spec/slot-cache.md`` §10.3:
        stored value times its unit's scale).

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
    engine = cache.engine
    if cache._fp8:
        Ks, Vs = cache._scales[layer]
        P = cache.config.block_size

        def gather(K, V, slot, n, row, bs):
            return engine.gather_kv_fp8(K, V, Ks, Vs, slot, n, row, bs, P)
    else:
        gather = engine.gather_kv
    if spec.kind is LayerKind.CROSS_ATTENTION:
        return gather(K, V, slot, int(cache._enc[slot]), None, 0)
    n = int(cache._seq[slot])
    if cache.mode() is KVCacheMode.CONTIGUOUS:
        return gather(K, V, slot, n, None, 0)
    # spec/slot-cache.md §7.2: paged positions are read through the slot's current table row.
    return gather(K, V, slot, n, cache._table[slot], cache.config.block_size)


def varlen_attention(q, cache, layer: int, step: StepIndices, scale: float | None = None) -> np.ndarray:
    """Attention of a step's queries through the cache, computed in float32.

    Row b (slot ``step.slot_ids[b]``) attends keys ``[0, step.seqused_k[b])``
    read through ``step.block_table[b]`` (paged) or the slot's row
    (contiguous). Query j of the row sits at ``p = past_len[b] + j`` and sees
    keys ``[0, p]`` (ATTENTION) or ``[max(0, p - window + 1), p]``
    (SLIDING_WINDOW). A CROSS_ATTENTION layer attends all
    ``step.cross_seqused_k[b]`` encoder keys, non-causally. Query heads are
    grouped over K/V heads (GQA): query head h uses K/V head
    ``h // (q_heads // kv_heads)``.

    Parameters
    ----------
    q : float [T, q_heads, head_dim]
        ``q_heads`` a multiple of the layer's ``kv_heads``; ``T == step.num_tokens``.
    cache : KVCache
    layer : int
        ATTENTION, SLIDING_WINDOW or CROSS_ATTENTION.
    step : StepIndices
        From ``cache.prepare_step``, with the step's K/V already appended.
    scale : float, optional
        Score scale; default ``1 / sqrt(head_dim)``.

    Returns
    -------
    float32 [T, q_heads, head_dim]
        An FP8 cache is read dequantised, exactly as ``gather_kv`` returns it (``spec/slot-cache.md`` §10.3).

    Raises
    ------
    IndexError
        ``layer`` out of range.
    TypeError
        A STATE layer, non-floating ``q``, or ``step`` not a ``StepIndices``.
    ValueError
        Shapes wrong, or a cross row whose slot has no encoder keys.
    """
    api = "varlen_attention"
    spec = _layer_spec(api, cache, layer, _KV_KINDS)
    _check_step(api, step)
    layer = int(layer)
    T = step.num_tokens
    q = _check_heads(api, "q", q, T, spec.kv_heads, spec.head_dim, multiple=True)
    if scale is None:
        scale = 1.0 / float(np.sqrt(spec.head_dim))
    elif isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"{api}: scale={scale!r}, must be a float or None")
    else:
        try:
            finite = math.isfinite(float(scale))
        except OverflowError:  # an int past float's range (10**400): out of range, not a crash
            finite = False
        if not finite:
            raise ValueError(f"{api}: scale={scale!r}, must be a finite float or None")
    engine = cache.engine
    if spec.kind is LayerKind.CROSS_ATTENTION:
        # spec/slot-cache.md §7.3: a cross row reads all of its slot's encoder keys; none is an error.
        empty = np.flatnonzero(engine.to_host(step.cross_seqused_k) == 0)
        if empty.size:
            b = int(empty[0])
            slot = int(engine.to_host(step.slot_ids)[b])
            raise ValueError(f"{api}: step.cross_seqused_k[{b}]=0 for slot {slot}, fill layer {layer} first")
    block_size = cache.config.block_size if cache.mode() is KVCacheMode.PAGED else None
    if cache._fp8:
        # spec/slot-cache.md §10.3: keys and values dequantised exactly as gather_kv returns them.
        Ks, Vs = cache._scales[layer]
        return engine.attend(q, cache.keys(layer), cache.values(layer), spec.kind, spec.window, step, block_size,
                             float(scale), kv_scales=(Ks, Vs, cache.config.block_size))
    return engine.attend(q, cache.keys(layer), cache.values(layer), spec.kind, spec.window, step, block_size,
                         float(scale))
