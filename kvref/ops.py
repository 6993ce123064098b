"""Ops that write to and attend through a ``KVCache`` (DESIGN §4.4, ``spec/slot-cache.md`` §7).

Plain NumPy, one loop per row: the semantic oracle. Attention through a
cache must equal dense attention over each sequence's concatenated history.

* :func:`append_kv` scatters a step's new K/V through ``step.slot_mapping``.
* :func:`gather_kv` returns one slot's committed K/V densely.
* :func:`varlen_attention` attends a step's queries through the cache
  (causal, sliding-window aware, GQA; cross layers non-causal), in float32.
"""

from __future__ import annotations

import numpy as np

from kvspec import KVCacheMode, LayerKind, StepIndices

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


def _check_heads(api: str, name: str, arr, T: int, heads: int, dim: int, *, multiple: bool = False) -> np.ndarray:
    """A floating ``[T, heads, dim]`` array (``heads`` a multiple of the layer's when ``multiple``)."""
    arr = np.asarray(arr)
    if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16":
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


def _rows_of(cache, layer: int, slot: int, n: int, block_row=None) -> tuple[np.ndarray, np.ndarray]:
    """K, V of positions ``[0, n)`` of ``slot`` (copies in storage dtype).

    Paged storage is read through ``block_row`` (a step's table row) or the
    cache's current table; contiguous storage through the slot's row.
    """
    K, V = cache.keys(layer), cache.values(layer)
    if cache.layer_specs[layer].kind is LayerKind.CROSS_ATTENTION or cache.mode() is KVCacheMode.CONTIGUOUS:
        return K[slot, :n].copy(), V[slot, :n].copy()
    bs = cache.config.block_size
    if block_row is None:
        block_row = cache.paged_block_table()[slot]
    pos = np.arange(n)
    flat = np.asarray(block_row, dtype=np.int64)[pos // bs] * bs + pos % bs
    Kf = K.reshape(-1, *K.shape[2:])
    Vf = V.reshape(-1, *V.shape[2:])
    return Kf[flat].copy(), Vf[flat].copy()


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
        The step's new keys and values; cast to the storage dtype.
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
    k = _check_heads(api, "k", k, T, spec.kv_heads, spec.head_dim)
    v = _check_heads(api, "v", v, T, spec.kv_heads, spec.head_dim)
    K, V = cache.keys(layer), cache.values(layer)
    rows = K.shape[0] * K.shape[1]
    sm = np.asarray(step.slot_mapping, dtype=np.int64)
    if sm.shape != (T,):
        raise ValueError(f"{api}: step.slot_mapping.shape={sm.shape} != ({T},)")
    over = np.flatnonzero(sm >= rows)
    if over.size:
        i = int(over[0])
        raise IndexError(f"{api}: step.slot_mapping[{i}]={sm[i]} out of range [0, {rows})")
    keep = sm >= 0
    Kf = K.reshape(rows, spec.kv_heads, spec.head_dim)  # a view: writes land in the cache
    Vf = V.reshape(rows, spec.kv_heads, spec.head_dim)
    Kf[sm[keep]] = k[keep]
    Vf[sm[keep]] = v[keep]


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
        Copies.

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
    if spec.kind is LayerKind.CROSS_ATTENTION:
        n = int(cache._enc[slot])
    else:
        n = int(cache.seq_lens()[slot])
    return _rows_of(cache, int(layer), slot, n)


def _softmax_attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float) -> np.ndarray:
    """float32 attention of q [Tq, Hq, D] over k, v [Tk, Hk, D] with bool mask [Tq, Tk] (GQA by repeat)."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k.astype(np.float32), group, axis=1)
    v = np.repeat(v.astype(np.float32), group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q.astype(np.float32), k) * np.float32(scale)
    scores = np.where(mask[None], scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    w = np.exp(scores)
    w = w / w.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", w, v).astype(np.float32)


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
    out = np.zeros(q.shape, np.float32)
    cu = np.asarray(step.cu_seqlens_q, dtype=np.int64)
    for b in range(step.num_seqs):
        slot = int(step.slot_ids[b])
        lo, hi = int(cu[b]), int(cu[b + 1])
        qb = q[lo:hi]
        if spec.kind is LayerKind.CROSS_ATTENTION:
            n = int(step.cross_seqused_k[b])
            if n == 0:
                raise ValueError(f"{api}: step.cross_seqused_k[{b}]=0 for slot {slot}, fill layer {layer} first")
            k, v = _rows_of(cache, layer, slot, n)
            mask = np.ones((hi - lo, n), bool)
        else:
            n = int(step.seqused_k[b])
            row = None if step.block_table is None else step.block_table[b]
            k, v = _rows_of(cache, layer, slot, n, row)
            pos = int(step.past_len[b]) + np.arange(hi - lo)[:, None]
            key = np.arange(n)[None, :]
            mask = key <= pos
            if spec.kind is LayerKind.SLIDING_WINDOW:
                mask &= key > pos - spec.window
        out[lo:hi] = _softmax_attend(qb, k, v, mask, scale)
    return out
