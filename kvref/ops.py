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
* :func:`gather_step` reads every row's history of a step at once, padded
  ``[rows, max_len, kv_heads, head_dim]`` or packed ``[total, kv_heads, head_dim]``.

Torch in, torch out (``spec/slot-cache.md`` §7.4): inputs may be torch tensors
of any floating dtype (bfloat16 and FP8 included), read without a copy where the
memory allows; a torch query (or a ``like=`` tensor) gives a torch result on its
device, a NumPy input a NumPy result. ``layout="bhsd"`` takes transformers'
``[batch, heads, seq, head_dim]`` (``batch * seq`` tokens, row-major ``(b, s)``).

The manager's ops (``spec/manager.md`` §18) work on a ``PagedKVCacheManager``'s
``kv_blocks`` ``[num_blocks, 2, num_layers, page_size, kv_heads, head_dim]``
through its ``runtime_inputs``:

* :func:`append_kv_paged` writes a step's K/V at ``cache_lengths[b] + j``
  through ``lookup_table``;
* :func:`paged_attention` attends a step's queries through the same pages
  (causal, optional sliding window, GQA), in float32.

FP8 pages (``spec/manager.md`` §18.5) are written with their scales
(``inputs.kv_scales``) by the slot cache's quantising append and read
dequantised.

Their mechanisms are a :class:`ReferencePagedOps` (NumPy here; kvfast passes
its Numba and CUDA engines).
"""

from __future__ import annotations

import math

import numpy as np

from kvspec import KVCacheMode, LayerKind, StepIndices
from kvspec._interop import host_array, is_torch, to_torch, widen_fp8

from ._slot_cache import KVCache, _check_index

__all__ = ["append_kv", "gather_kv", "varlen_attention", "gather_step", "append_kv_paged", "paged_attention",
           "ReferencePagedOps", "LAYOUTS"]

#: The token layouts the ops take (spec/slot-cache.md §7.4): ``"thd"`` = ``[tokens, heads, head_dim]``,
#: ``"bhsd"`` = transformers' ``[batch, heads, seq, head_dim]`` with ``batch * seq`` tokens in row-major
#: ``(b, s)`` order.
LAYOUTS = ("thd", "bhsd")

#: ``out_dtype`` names the attention ops accept (None: float32).
_OUT_DTYPES = ("float16", "bfloat16", "float32")

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


def _check_layout(api: str, layout) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"{api}: layout={layout!r}, must be 'thd' or 'bhsd'")
    return layout


def _tokens_input(api: str, name: str, x, layout: str, T: int):
    """``(x as [T, heads, head_dim], (batch, seq) or None)``: the op's view of an input.

    A CPU torch tensor becomes the NumPy array of its memory (``host_array``: bfloat16 and FP8
    as their ``ml_dtypes`` types); FP8 values are widened exactly to float32 (one copy);
    ``layout="bhsd"`` ``[B, H, S, D]`` is permuted to ``[B, S, H, D]`` and merged to
    ``[B * S, H, D]``: a view when the tensor's memory is ``[B, S, H, D]`` (transformers'
    ``view(B, S, H, D).transpose(1, 2)``), ``B == 1`` or ``H == 1``; otherwise the merge copies.
    A device array (CuPy, a CUDA tensor) stays on its device.
    """
    if is_torch(x):
        if x.device.type == "cpu":
            x = host_array(x)
        elif str(x.dtype) in ("torch.float8_e4m3fn", "torch.float8_e5m2"):
            x = x.float()  # a device FP8 tensor: its exact float32 values, on its device
    x = widen_fp8(x)
    if layout == "thd":
        return x, None
    if not hasattr(x, "shape"):
        x = host_array(x)
    if x.ndim != 4:
        raise ValueError(f"{api}: {name}.ndim={x.ndim}, must be 4 [batch, heads, seq, head_dim] with layout='bhsd'")
    B, H, S, D = (int(n) for n in x.shape)
    if B * S != T:
        raise ValueError(f"{api}: {name}.shape={tuple(int(n) for n in x.shape)} (layout='bhsd') holds "
                         f"batch*seq={B * S} tokens != step.num_tokens={T}")
    x = x.permute(0, 2, 1, 3) if is_torch(x) else x.transpose(0, 2, 1, 3)
    return x.reshape(B * S, H, D), (B, S)


def _check_like(api: str, like):
    if like is not None and not is_torch(like) and not isinstance(like, np.ndarray):
        raise TypeError(f"{api}: like={type(like).__name__}, must be a torch.Tensor, a numpy.ndarray or None")
    return like if is_torch(like) else None


def _check_out_dtype(api: str, out_dtype):
    if out_dtype is None:
        return None
    name = str(out_dtype).removeprefix("torch.")
    if isinstance(out_dtype, (np.dtype, type)):
        try:
            name = np.dtype(out_dtype).name
        except TypeError:
            pass  # not a NumPy dtype: the name check below refuses it
    if name not in _OUT_DTYPES:
        raise ValueError(f"{api}: out_dtype={out_dtype!r}, must be None, 'float16', 'bfloat16' or 'float32'")
    return name


def _result(api: str, out, like, bhsd, out_dtype):
    """The float32 ``[T, heads, dim]`` result in the caller's layout, kind, device and dtype."""
    if bhsd is not None:
        B, S = bhsd
        out = out.reshape(B, S, *out.shape[1:]).transpose(0, 2, 1, 3)  # a view: [B, H, S, D] of [B, S, H, D]
    if like is not None:
        import torch

        t = to_torch(out, device=like.device)
        return t if out_dtype in (None, "float32") else t.to(getattr(torch, out_dtype))  # rounded once (RNE)
    if out_dtype in (None, "float32"):
        return out
    if isinstance(out, np.ndarray):
        import ml_dtypes

        return out.astype(ml_dtypes.bfloat16 if out_dtype == "bfloat16" else np.float16)
    if out_dtype == "bfloat16":
        raise ValueError(f"{api}: out_dtype='bfloat16' for a device result without torch: CuPy has no bfloat16 "
                         "(pass a torch query, or out_dtype='float16' / 'float32')")
    return out.astype(out_dtype)


def _torch_out(arrays, like, logical=None):
    """Each array as a torch tensor on ``like``'s device (no copy where it already lives there)."""
    if like is None:
        return arrays
    return tuple(to_torch(a, logical if a.dtype.itemsize == 2 and a.dtype.kind == "u" else None, like.device)
                 for a in arrays)


def _check_scale(api: str, scale, head_dim: int) -> float:
    """The score scale: ``1 / sqrt(head_dim)`` for None, else a finite real (``TypeError`` /
    ``ValueError`` naming it)."""
    if scale is None:
        return 1.0 / float(np.sqrt(head_dim))
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"{api}: scale={scale!r}, must be a float or None")
    try:
        finite = math.isfinite(float(scale))
    except OverflowError:  # an int past float's range (10**400): out of range, not a crash
        finite = False
    if not finite:
        raise ValueError(f"{api}: scale={scale!r}, must be a finite float or None")
    return float(scale)


def _check_softcap(api: str, softcap) -> float:
    """Logit soft-capping: 0.0 for None (off), else a finite real > 0 (``TypeError`` / ``ValueError``
    naming it)."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.floating, np.integer)):
        raise TypeError(f"{api}: softcap={softcap!r}, must be a float > 0 or None")
    try:
        value = float(softcap)
    except OverflowError:  # an int past float's range
        value = math.inf
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{api}: softcap={softcap!r}, must be a finite float > 0 or None")
    return value


def _check_sinks(api: str, sinks, q_heads: int, engine):
    """Attention sinks: None, or one finite logit per query head as a host float32 ``[q_heads]``
    (NumPy, torch of any floating dtype and device, or a device array)."""
    if sinks is None:
        return None
    if is_torch(sinks):
        sinks = sinks.detach().cpu()  # a parameter (module.sinks) needs no grad here; a copy only off the CPU
    elif hasattr(sinks, "__cuda_array_interface__"):
        sinks = engine.to_host(sinks)
    arr = sinks if isinstance(sinks, np.ndarray) else host_array(sinks)
    if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16":
        raise TypeError(f"{api}: sinks dtype={arr.dtype}, must be a floating type")
    if arr.shape != (q_heads,):
        raise ValueError(f"{api}: sinks.shape={tuple(arr.shape)}, must be (q_heads,)=({q_heads},)")
    arr = arr.astype(np.float32)
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        raise ValueError(f"{api}: sinks[{int(bad[0])}]={arr[bad[0]]}, must be finite")
    return arr


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
    return _check_shape(api, name, arr, T, heads, dim, multiple=multiple, tokens="step.num_tokens")


def _check_shape(api: str, name: str, x, T: int, heads: int, dim: int, *, multiple: bool, tokens: str):
    """``x`` is ``[T, heads (or a multiple of them), dim]``; ``ValueError`` naming the axis."""
    if x.ndim != 3:
        raise ValueError(f"{api}: {name}.ndim={x.ndim}, must be 3 [tokens, heads, head_dim]")
    if x.shape[0] != T:
        raise ValueError(f"{api}: {name}.shape[0]={x.shape[0]} != {tokens}={T}")
    if x.shape[2] != dim:
        raise ValueError(f"{api}: {name}.shape[2]={x.shape[2]} != head_dim={dim}")
    if multiple:
        if x.shape[1] % heads:
            raise ValueError(f"{api}: {name}.shape[1]={x.shape[1]} is not a multiple of kv_heads={heads}")
    elif x.shape[1] != heads:
        raise ValueError(f"{api}: {name}.shape[1]={x.shape[1]} != kv_heads={heads}")
    return x


def append_kv(cache, layer: int, k, v, step: StepIndices, *, layout: str = "thd") -> None:
    """Scatter a step's new K/V into an attention or sliding-window layer.

    Token t goes to flat storage row ``step.slot_mapping[t]`` (``[slots *
    max_seq_len]`` contiguous, ``[num_blocks * block_size]`` paged); tokens
    with ``slot_mapping < 0`` are skipped (padding).

    Parameters
    ----------
    cache : KVCache
    layer : int
        An ATTENTION or SLIDING_WINDOW layer.
    k, v : float [T, kv_heads, head_dim] (``layout="thd"``) or [B, kv_heads, S, head_dim] (``"bhsd"``)
        The step's new keys and values: NumPy arrays, CPU torch tensors of any floating dtype
        (float16, bfloat16, float32, float64; FP8 widened exactly first), read without a copy,
        or device arrays on a CUDA cache. An FP8 cache quantises them with per-(block, head)
        scales (``spec/slot-cache.md`` §10.2: finite values in every row with ``slot_mapping >= 0``,
        else ``ValueError``; padding rows are never read, any values there change nothing); otherwise
        cast to the storage dtype: a wider input (float32 into a float16 or bfloat16 cache) is
        rounded once, to nearest even (``spec/slot-cache.md`` §7.1, the down-cast rule).
    step : StepIndices
        From ``cache.prepare_step``; ``T == step.num_tokens`` (``B * S`` with ``"bhsd"``).
    layout : {"thd", "bhsd"}
        ``"bhsd"``: transformers' ``[batch, heads, seq, head_dim]``, token ``b * S + s`` of the
        step is ``k[b, :, s]`` (the packed step, ``spec/slot-cache.md`` §7.4).

    Raises
    ------
    IndexError
        ``layer`` out of range, or a ``slot_mapping`` entry past the storage.
    TypeError
        Wrong layer kind, non-floating ``k``/``v``, or ``step`` not a ``StepIndices``.
    ValueError
        Shapes wrong, or ``layout`` not ``"thd"`` / ``"bhsd"``. Storage is unchanged.
    """
    api = "append_kv"
    spec = _layer_spec(api, cache, layer, _ATTN_KINDS)
    _check_step(api, step)
    layout = _check_layout(api, layout)
    T = step.num_tokens
    k, _ = _tokens_input(api, "k", k, layout, T)
    v, _ = _tokens_input(api, "v", v, layout, T)
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


def gather_kv(cache, layer: int, slot: int, *, like=None):
    """Dense K and V of one slot.

    Parameters
    ----------
    cache : KVCache
    layer : int
        ATTENTION / SLIDING_WINDOW (the slot's committed ``seq_lens()[slot]``
        positions) or CROSS_ATTENTION (the filled encoder length).
    slot : int
        ``0 <= slot < max_seqs``.
    like : torch.Tensor or numpy.ndarray, optional
        A torch tensor: return torch tensors on its device (the copies themselves, shared
        through ``torch.from_numpy`` / DLPack; bfloat16 as ``torch.bfloat16``). Default: arrays
        of the cache's kind (NumPy on the CPU, CuPy on CUDA).

    Returns
    -------
    K, V : ndarray (or torch.Tensor), config.dtype, [n, kv_heads, head_dim]
        Copies. An FP8 cache returns float32, dequantised (``spec/slot-cache.md`` §10.3:
        stored value times its unit's scale).

    Raises
    ------
    IndexError
        ``layer`` or ``slot`` out of range.
    TypeError
        A STATE layer, or ``like`` neither a tensor, an array nor None.
    """
    api = "gather_kv"
    spec = _layer_spec(api, cache, layer, _KV_KINDS)
    slot = _check_index(api, "slot", slot, cache.config.max_seqs)
    like = _check_like(api, like)
    if like is not None:
        return _torch_out(gather_kv(cache, layer, slot), like, cache.config.dtype)
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


def varlen_attention(q, cache, layer: int, step: StepIndices, scale: float | None = None, *, layout: str = "thd",
                     out_dtype=None, softcap: float | None = None, sinks=None):
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
    q : float [T, q_heads, head_dim] (``layout="thd"``) or [B, q_heads, S, head_dim] (``"bhsd"``)
        ``q_heads`` a multiple of the layer's ``kv_heads``; ``T == step.num_tokens``. A NumPy
        array, a torch tensor of any floating dtype (bfloat16, FP8 included), or a device array.
    cache : KVCache
    layer : int
        ATTENTION, SLIDING_WINDOW or CROSS_ATTENTION.
    step : StepIndices
        From ``cache.prepare_step``, with the step's K/V already appended.
    scale : float, optional
        Score scale; default ``1 / sqrt(head_dim)``.
    layout : {"thd", "bhsd"}
        The layout of ``q`` and of the result (``spec/slot-cache.md`` §7.4).
    out_dtype : {None, "float16", "bfloat16", "float32"} or a NumPy / torch dtype, optional
        The result's dtype: the float32 values rounded once (to nearest even). None: float32.
    softcap : float, optional
        Logit soft-capping (Gemma 2): every scaled score ``s`` becomes
        ``softcap * tanh(s / softcap)``. None: off.
    sinks : float [q_heads], optional
        Attention sinks (gpt-oss): one logit per query head that joins each softmax
        denominator and carries no value. NumPy, torch (any floating dtype) or a device array.

    Returns
    -------
    float32 [T, q_heads, head_dim] (``"bhsd"``: [B, q_heads, S, head_dim], a transposed view of a
    ``[B, S, q_heads, head_dim]`` buffer)
        A torch tensor on ``q``'s device when ``q`` is one, else an array of the cache's kind.
        An FP8 cache is read dequantised, exactly as ``gather_kv`` returns it (``spec/slot-cache.md`` §10.3).

    Raises
    ------
    IndexError
        ``layer`` out of range.
    TypeError
        A STATE layer, non-floating ``q``, or ``step`` not a ``StepIndices``.
    ValueError
        Shapes wrong, a cross row whose slot has no encoder keys, a bad ``layout`` or ``out_dtype``,
        ``softcap`` not finite and > 0, ``sinks`` not ``(q_heads,)`` or not finite.
    """
    api = "varlen_attention"
    spec = _layer_spec(api, cache, layer, _KV_KINDS)
    _check_step(api, step)
    layout = _check_layout(api, layout)
    out_dtype = _check_out_dtype(api, out_dtype)
    like = q if is_torch(q) else None
    layer = int(layer)
    T = step.num_tokens
    q, bhsd = _tokens_input(api, "q", q, layout, T)
    q = _check_heads(api, "q", q, T, spec.kv_heads, spec.head_dim, multiple=True)
    scale = _check_scale(api, scale, spec.head_dim)
    softcap = _check_softcap(api, softcap)
    engine = cache.engine
    sinks = _check_sinks(api, sinks, q.shape[1], engine)
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
        out = engine.attend(q, cache.keys(layer), cache.values(layer), spec.kind, spec.window, step, block_size,
                            float(scale), kv_scales=(Ks, Vs, cache.config.block_size), softcap=softcap, sinks=sinks)
    else:
        out = engine.attend(q, cache.keys(layer), cache.values(layer), spec.kind, spec.window, step, block_size,
                            float(scale), softcap=softcap, sinks=sinks)
    return _result(api, out, like, bhsd, out_dtype)


def _gather_step_host(K, V, lengths, cu, slots, table, P: int, padded: bool):
    """``gather_step``'s copies from host (NumPy) storage, each position copied once, straight into
    the result: ``np.take`` of the flat rows ``table[b, pos // P] * P + pos % P`` (paged) or slices
    of the slot's row (contiguous, ``table`` None). The same values as the engine's ``gather_kv``."""
    B = lengths.shape[0]
    H, D = K.shape[2], K.shape[3]
    width = int(lengths.max()) if B else 0
    shape = (B, width, H, D) if padded else (int(cu[-1]), H, D)
    outs = (np.empty(shape, K.dtype), np.empty(shape, V.dtype))
    flat = None
    if table is not None:
        rows = np.repeat(np.arange(B), lengths)
        pos = np.arange(int(cu[-1])) - cu[rows]
        tab = np.asarray(table, dtype=np.int64)
        flat = tab[rows, pos // P] * P + pos % P
    for src, out in zip((K, V), outs):
        if flat is not None and not padded:
            np.take(src.reshape(-1, H, D), flat, axis=0, out=out)
            continue
        for b in range(B):
            n, lo = int(lengths[b]), int(cu[b])
            dst = out[b, :n] if padded else out[lo:lo + n]
            if flat is None:
                dst[...] = src[int(slots[b]), :n]
            else:
                np.take(src.reshape(-1, H, D), flat[lo:lo + n], axis=0, out=dst)
            if padded:
                out[b, n:] = 0
    return outs


def gather_step(cache, layer: int, step: StepIndices, *, padded: bool = True, like=None):
    """K and V of every row's whole history in a step (cached positions and the step's own), at once.

    Row b (slot ``step.slot_ids[b]``) holds ``n_b = step.seqused_k[b]`` positions of an ATTENTION
    or SLIDING_WINDOW layer (the whole history, read through ``step.block_table[b]`` when paged;
    a sliding layer's window is the attention's mask, not the read), or
    ``step.cross_seqused_k[b]`` encoder positions of a CROSS_ATTENTION layer. Call it after the
    step's ``append_kv``: the step's own positions are then part of the history.

    Parameters
    ----------
    cache : KVCache
    layer : int
        ATTENTION, SLIDING_WINDOW or CROSS_ATTENTION.
    step : StepIndices
        From ``cache.prepare_step``.
    padded : bool
        True: ``[rows, max_len, kv_heads, head_dim]`` with zeros past each row's length, and
        the lengths. False: ``[total, kv_heads, head_dim]`` (rows back to back) and
        ``cu_seqlens`` (``step.cu_seqlens_k`` for attention layers).
    like : torch.Tensor or numpy.ndarray, optional
        A torch tensor: every result is a torch tensor on its device (sharing the gathered
        arrays' memory where it is the same device; bfloat16 as ``torch.bfloat16``).

    Returns
    -------
    padded=True : (K, V, lengths)
        K, V : config.dtype [rows, max_len, kv_heads, head_dim] (float32, dequantised, for FP8);
        lengths : int32 [rows].
    padded=False : (K, V, cu_seqlens)
        K, V : config.dtype [total, kv_heads, head_dim]; cu_seqlens : int32 [rows + 1].
        Copies, NumPy on the CPU, CuPy on CUDA, unless ``like`` is a torch tensor.

    Raises
    ------
    IndexError
        ``layer`` out of range.
    TypeError
        A STATE layer, ``step`` not a ``StepIndices``, ``padded`` not a bool, or a bad ``like``.
    """
    api = "gather_step"
    spec = _layer_spec(api, cache, layer, _KV_KINDS)
    _check_step(api, step)
    if not isinstance(padded, (bool, np.bool_)):
        raise TypeError(f"{api}: padded={padded!r}, must be a bool")
    like = _check_like(api, like)
    layer = int(layer)
    engine = cache.engine
    K, V = cache.keys(layer), cache.values(layer)
    cross = spec.kind is LayerKind.CROSS_ATTENTION
    lengths_dev = step.cross_seqused_k if cross else step.seqused_k
    lengths = np.asarray(engine.to_host(lengths_dev), dtype=np.int64)
    slots = np.asarray(engine.to_host(step.slot_ids), dtype=np.int64)
    B = int(lengths.shape[0])
    paged = cache.mode() is KVCacheMode.PAGED and not cross
    P = cache.config.block_size
    if cache._fp8:
        Ks, Vs = cache._scales[layer]

        def gather(slot, n, row, bs):
            return engine.gather_kv_fp8(K, V, Ks, Vs, slot, n, row, bs, P)
        dtype = np.float32
    else:
        def gather(slot, n, row, bs):
            return engine.gather_kv(K, V, slot, n, row, bs)
        dtype = K.dtype
    H, D = spec.kv_heads, spec.head_dim
    cu = np.zeros(B + 1, np.int64)
    np.cumsum(lengths, out=cu[1:])
    if isinstance(K, np.ndarray) and not cache._fp8:  # host storage: one copy per position, no temporaries
        outs = _gather_step_host(K, V, lengths, cu, slots, step.block_table if paged else None, P, padded)
    else:  # the engine's gather kernels (CUDA; FP8 dequantised), a row at a time
        width = int(lengths.max()) if B else 0
        shape = (B, width, H, D) if padded else (int(cu[-1]), H, D)
        outs = (engine.zeros(shape, dtype), engine.zeros(shape, dtype))
        for b in range(B):
            n = int(lengths[b])
            if n == 0:
                continue
            k, v = gather(int(slots[b]), n, step.block_table[b] if paged else None, P if paged else 0)
            if padded:
                outs[0][b, :n], outs[1][b, :n] = k, v
            else:
                lo = int(cu[b])
                outs[0][lo:lo + n], outs[1][lo:lo + n] = k, v
    if padded:
        index = lengths_dev.copy()
    elif cross:
        index = engine.zeros((B + 1,), np.int32)
        if B:
            index[1:] = lengths_dev.cumsum().astype(np.int32)
    else:
        index = step.cu_seqlens_k.copy()
    return _torch_out((*outs, index), like, cache.config.dtype)


# ----------------------------------------------------------------------------- manager ops (spec/manager.md §18)

from ._slot_engine import ReferenceSlotEngine, softmax_values  # noqa: E402  (FP8 write and softmax rules reused)

#: Storage dtypes of ``kv_blocks`` the manager ops read and write (CuPy keeps bfloat16 as uint16, FP8 as
#: uint8 bit patterns: ``kv_dtype=`` names the format of a uint8 buffer).
_PAGED_DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2")
_PAGED_FP8 = ("float8_e4m3fn", "float8_e5m2")


class ReferencePagedOps:
    """The mechanisms of the manager ops, in NumPy (the readable definition; spec/manager.md §18).

    Every method receives what the policy (:func:`append_kv_paged`, :func:`paged_attention`)
    has checked: host ``int64`` index arrays and a ``kv_blocks`` of a supported dtype. kvfast
    passes its own engines (Numba on the CPU, the ``paged_attention.cu`` kernels on CUDA) with
    these methods.
    """

    def buffer(self, api: str, kv_blocks):
        """``kv_blocks`` as this engine's array (a CPU torch tensor: its memory, no copy)."""
        if is_torch(kv_blocks):
            if kv_blocks.device.type != "cpu":
                raise TypeError(f"{api}: kv_blocks is a {kv_blocks.device.type} tensor; kvref runs on the CPU "
                                "(use kvfast.ops)")
            return host_array(kv_blocks)
        if not isinstance(kv_blocks, np.ndarray):
            raise TypeError(f"{api}: kv_blocks={type(kv_blocks).__name__}, must be a numpy.ndarray or a CPU "
                            "torch.Tensor (the manager's get_device_buffer / runtime_inputs kv_blocks)")
        return kv_blocks

    def scales_buffer(self, api: str, kv_scales):
        """``inputs.kv_scales`` as this engine's array (a CPU torch tensor: its memory, no copy)."""
        if is_torch(kv_scales) and kv_scales.device.type == "cpu":
            return host_array(kv_scales)
        if not isinstance(kv_scales, np.ndarray):
            raise TypeError(f"{api}: inputs.kv_scales={type(kv_scales).__name__}, must be a numpy.ndarray or a CPU "
                            "torch.Tensor beside a host kv_blocks")
        return kv_scales

    def to_host(self, x) -> np.ndarray:
        """``x`` as a host NumPy array (an index array of ``inputs``, ``input_row_offsets``)."""
        return host_array(x)

    def kv_input(self, api: str, name: str, x, kv_blocks):
        """``x`` as ``kv_blocks``' dtype (a wider input rounded once, to nearest even)."""
        x = x if isinstance(x, np.ndarray) else host_array(x)
        if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
            raise TypeError(f"{api}: {name} dtype={x.dtype}, must be a floating type")
        return x.astype(kv_blocks.dtype, copy=False)

    def query_input(self, api: str, q):
        """``q`` as a floating host array (``TypeError`` otherwise); the engine widens it to float32."""
        q = q if isinstance(q, np.ndarray) else host_array(q)
        if q.dtype.kind != "f" and q.dtype.name != "bfloat16":
            raise TypeError(f"{api}: q dtype={q.dtype}, must be a floating type")
        return q

    def scatter(self, kv_blocks, layer: int, k, v, lut, lengths, row_offsets, pages, offsets) -> None:
        """``kv_blocks[pages[t], 0|1, layer, offsets[t]] = k[t] | v[t]`` for every ``pages[t] > 0``.

        ``lut``, ``lengths``, ``row_offsets`` (host int64) are what ``pages`` / ``offsets`` were
        computed from, for an engine that computes them on its device.
        """
        keep = pages > 0
        kv_blocks[pages[keep], 0, layer, offsets[keep]] = k[keep]
        kv_blocks[pages[keep], 1, layer, offsets[keep]] = v[keep]

    # ------------------------------------------------------------------ FP8 pages (spec/manager.md §18.5)

    def kv_input_float32(self, api: str, name: str, x):
        """``x`` as float32 (exact; float64 rounded once), ``TypeError`` if not floating: the slot
        engine's conversion (spec/slot-cache.md §10.2 step 1)."""
        return _SLOT_REFERENCE.kv_input_float32(api, name, x)

    def first_nonfinite(self, x) -> int:
        """The first token row of ``x`` holding a NaN or an infinity, else -1."""
        return _SLOT_REFERENCE.first_nonfinite(x)

    def scatter_fp8(self, kv_blocks, kv_scales, layer: int, k, v, slot_mapping, fresh, fp8: str) -> None:
        """Quantise ``k`` / ``v`` (float32, finite in every written row) into layer ``layer``'s K and
        V planes of FP8 ``kv_blocks`` with their scales ``kv_scales[:, 0 | 1, layer]``: the slot
        cache's quantising append (``ReferenceSlotEngine.scatter_kv_fp8``, spec/slot-cache.md §10.2)
        with one scale unit per page.

        ``slot_mapping`` (host int64 [T]): ``page * page_size + offset``, -1 for a padding token;
        ``fresh`` (host int64): the pages whose scales of this layer restart at 0 first (written
        from their first position, spec/manager.md §18.5). The reference runs the slot engine on
        dense copies of the touched pages and writes them back.
        """
        P = kv_blocks.shape[3]
        if fresh.size:
            kv_scales[fresh, :, layer] = 0
        sm = np.asarray(slot_mapping, dtype=np.int64)
        real = sm >= 0
        touched = np.unique(sm[real] // P)
        if not touched.size:
            return
        local = np.full(sm.shape, -1, np.int64)
        local[real] = np.searchsorted(touched, sm[real] // P) * P + sm[real] % P
        K, V = kv_blocks[touched, 0, layer], kv_blocks[touched, 1, layer]  # copies [n, P, H, D]
        Ks, Vs = kv_scales[touched, 0, layer], kv_scales[touched, 1, layer]  # copies [n, H]
        _SLOT_REFERENCE.scatter_kv_fp8(K, V, Ks, Vs, k, v, local, P)
        kv_blocks[touched, 0, layer], kv_blocks[touched, 1, layer] = K, V
        kv_scales[touched, 0, layer], kv_scales[touched, 1, layer] = Ks, Vs

    def attend(self, q, kv_blocks, layer: int, lut, lengths, row_offsets, window: int, scale: float,
               kv_scales=None, fp8: str | None = None, softcap: float = 0.0, sinks=None):
        """float32 ``[T, q_heads, head_dim]``: each query over its row's visible keys (see
        :func:`paged_attention`); a padding query (its own page 0) gives zeros. With ``kv_scales``
        (FP8 pages of format ``fp8``) every key and value is read dequantised: ``float32(x) *
        kv_scales[page, 0 | 1, layer, head]`` (spec/slot-cache.md §10.3). ``softcap`` (0.0: off)
        and ``sinks`` (host float32 ``[q_heads]`` or None) as ``softmax_attend``."""
        T, Hq, D = q.shape
        P, Hk = kv_blocks.shape[3], kv_blocks.shape[4]
        out = np.zeros((T, Hq, D), np.float32)
        group = Hq // Hk
        for b in range(lengths.shape[0]):
            lo, hi = int(row_offsets[b]), int(row_offsets[b + 1])
            if hi == lo:
                continue
            past = int(lengths[b])
            n = past + hi - lo
            pos = np.arange(n)
            pages = lut[b, pos // P]
            live = pages > 0
            kb = np.zeros((n, Hk, D), np.float32)
            vb = np.zeros((n, Hk, D), np.float32)
            kb[live] = kv_blocks[pages[live], 0, layer, pos[live] % P].astype(np.float32)
            vb[live] = kv_blocks[pages[live], 1, layer, pos[live] % P].astype(np.float32)
            if kv_scales is not None:  # dequantised, as gather_kv_fp8 reads them
                kb[live] *= kv_scales[pages[live], 0, layer][:, :, None]
                vb[live] *= kv_scales[pages[live], 1, layer][:, :, None]
            qpos = past + np.arange(hi - lo)[:, None]
            mask = (pos[None, :] <= qpos) & live[None, :]
            if window > 0:
                mask &= pos[None, :] > qpos - window
            mask &= live[past:][:, None]  # a padding query sees nothing
            kf = np.repeat(kb, group, axis=1)
            vf = np.repeat(vb, group, axis=1)
            s = np.einsum("qhd,khd->hqk", q[lo:hi].astype(np.float32), kf) * np.float32(scale)
            out[lo:hi] = softmax_values(s, mask[None], vf, softcap, sinks)
        return out


_REFERENCE_PAGED = ReferencePagedOps()
_SLOT_REFERENCE = ReferenceSlotEngine()  # the FP8 quantising append of the slot cache, reused (spec/manager.md §18.5)


def _check_int(api: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{api}: {name}={value!r}, must be an int")
    return int(value)


def _index_array(api: str, name: str, x, engine, ndim: int) -> np.ndarray:
    """A host int64 copy of an integer index array (uint32 lookup tables, NumPy, CuPy, torch)."""
    if x is None:
        raise TypeError(f"{api}: {name}=None, must be an integer array")
    try:
        h = np.asarray(engine.to_host(x))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{api}: {name} is {type(x).__name__}, not an integer array ({e})") from None
    if h.dtype.kind not in "iu":
        raise TypeError(f"{api}: {name} dtype={h.dtype}, must be an integer type")
    if h.ndim != ndim:
        raise ValueError(f"{api}: {name}.ndim={h.ndim}, must be {ndim}")
    if h.dtype.kind == "u" and h.size and int(h.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{api}: {name} holds {int(h.max())}, past int64")
    return h.astype(np.int64)


def _paged_dtype(api: str, kv, kv_dtype) -> str:
    """The buffer's logical dtype name (spec/manager.md §18.2): its own, CuPy's ``uint16`` as
    bfloat16, ``uint8`` FP8 bits as ``kv_dtype`` names them; ``TypeError`` for any other."""
    if kv_dtype is not None and not isinstance(kv_dtype, str):
        raise TypeError(f"{api}: kv_dtype={kv_dtype!r}, must be a dtype name (str) or None")
    if kv.dtype == np.uint8:  # a CUDA buffer's FP8 bit patterns (CuPy has no FP8)
        if kv_dtype not in _PAGED_FP8:
            raise TypeError(f"{api}: kv_blocks dtype=uint8 holds FP8 bit patterns, pass kv_dtype='float8_e4m3fn' "
                            f"or 'float8_e5m2' (got kv_dtype={kv_dtype!r})")
        return kv_dtype
    name = "bfloat16" if kv.dtype == np.uint16 else kv.dtype.name  # CuPy's bfloat16 is its uint16 bits
    if name not in _PAGED_DTYPES:
        raise TypeError(f"{api}: kv_blocks dtype={name}, must be float16, bfloat16, float32, float8_e4m3fn or "
                        "float8_e5m2")
    if kv_dtype is not None and kv_dtype != name:
        raise ValueError(f"{api}: kv_dtype={kv_dtype!r} != kv_blocks dtype={name}")
    return name


def _paged_scales(api: str, inputs, kv, lut, engine):
    """spec/manager.md §18.5: an FP8 buffer's scales, ``inputs.kv_scales`` float32 ``[num_blocks, 2,
    num_layers, kv_heads]`` (the engine's array), looked up through ``inputs.scales_lookup_table``,
    which must equal ``lookup_table`` (the manager passes the same array)."""
    scales = getattr(inputs, "kv_scales", None)
    if scales is None:
        raise TypeError(f"{api}: inputs.kv_scales=None, FP8 kv_blocks need the leaf's scales (the FP8 manager's "
                        "runtime_inputs, spec/manager.md §16.3)")
    scales = engine.scales_buffer(api, scales)
    if scales.dtype != np.float32:
        raise TypeError(f"{api}: inputs.kv_scales dtype={scales.dtype}, must be float32")
    NB, _, L = (int(n) for n in kv.shape[:3])
    want = (NB, 2, L, int(kv.shape[4]))
    if tuple(int(n) for n in scales.shape) != want:
        raise ValueError(f"{api}: inputs.kv_scales.shape={tuple(int(n) for n in scales.shape)} != {want} "
                         "[num_blocks, 2, num_layers, kv_heads] of kv_blocks")
    slut = getattr(inputs, "scales_lookup_table", None)
    if slut is not None and slut is not inputs.lookup_table:
        h = _index_array(api, "inputs.scales_lookup_table", slut, engine, 2)
        if h.shape != lut.shape or not np.array_equal(h, lut):
            raise ValueError(f"{api}: inputs.scales_lookup_table != inputs.lookup_table (scales share the values' "
                             "block ids, spec/manager.md §16.3)")
    return scales


def _paged_plan(api: str, kv_blocks, layer, inputs, input_row_offsets, T: int, engine, kv_dtype=None):
    """spec/manager.md §18.2: the checks of a manager op, in this order, and each token's page.

    Returns ``(kv_blocks, layer, lut, lengths, offsets, pages, slot_offsets, name)``: ``pages[t]``
    the page of token t (0: a padding token), ``slot_offsets[t]`` its offset in the page, ``name``
    the buffer's logical dtype.
    """
    if kv_blocks is None:
        raise TypeError(f"{api}: kv_blocks=None (a bookkeeping-only manager allocates no buffers, "
                        "spec/manager.md §1.5)")
    kv = engine.buffer(api, kv_blocks)
    if kv.ndim != 6 or kv.shape[1] != 2:
        raise ValueError(f"{api}: kv_blocks.shape={tuple(kv.shape)}, must be [num_blocks, 2, num_layers, page_size, "
                         "kv_heads, head_dim]")
    name = _paged_dtype(api, kv, kv_dtype)
    NB, _, L, P = (int(n) for n in kv.shape[:4])
    layer = _check_index(api, "layer", layer, L)
    for field in ("lookup_table", "cache_lengths"):
        if not hasattr(inputs, field):
            raise TypeError(f"{api}: inputs={type(inputs).__name__}, must be a KVCacheInputsPerDevice "
                            f"(runtime_inputs(...).inputs[r]); it has no {field}")
    lut = _index_array(api, "inputs.lookup_table", inputs.lookup_table, engine, 2)
    lengths = _index_array(api, "inputs.cache_lengths", inputs.cache_lengths, engine, 1)
    B = lengths.shape[0]
    if lut.shape[0] != B:
        raise ValueError(f"{api}: inputs.lookup_table.shape[0]={lut.shape[0]} != len(inputs.cache_lengths)={B}")
    offsets = _index_array(api, "input_row_offsets", input_row_offsets, engine, 1)
    if offsets.shape[0] != B + 1:
        raise ValueError(f"{api}: len(input_row_offsets)={offsets.shape[0]} != rows + 1 = {B + 1}")
    if offsets[0] != 0:
        raise ValueError(f"{api}: input_row_offsets[0]={int(offsets[0])}, must be 0")
    dec = np.flatnonzero(np.diff(offsets) < 0)
    if dec.size:
        i = int(dec[0]) + 1
        raise ValueError(f"{api}: input_row_offsets[{i}]={int(offsets[i])} < input_row_offsets[{i - 1}]="
                         f"{int(offsets[i - 1])}, must be non-decreasing")
    if int(offsets[-1]) != T:
        raise ValueError(f"{api}: input_row_offsets[-1]={int(offsets[-1])} != num_tokens={T}")
    counts = np.diff(offsets)
    row_of = np.repeat(np.arange(B), counts)
    pos = lengths[row_of] + (np.arange(T) - offsets[row_of])
    col = pos // P
    cols = lut.shape[1]
    over = np.flatnonzero(col >= cols)
    if over.size:
        t = int(over[0])
        raise IndexError(f"{api}: token {t} (row {int(row_of[t])}) at position {int(pos[t])} needs "
                         f"inputs.lookup_table[{int(row_of[t])}, {int(col[t])}], the table has {cols} columns")
    if B and cols:
        past = np.flatnonzero((lut >= NB).any(axis=1))
        if past.size:
            b = int(past[0])
            c = int(np.flatnonzero(lut[b] >= NB)[0])
            raise IndexError(f"{api}: inputs.lookup_table[{b}, {c}]={int(lut[b, c])} out of range [0, {NB})")
    pages = lut[row_of, col] if T else np.zeros(0, np.int64)
    return kv, layer, lut, lengths, offsets, pages, pos % P, name


def _paged_heads(api: str, name: str, x, T: int, heads: int, dim: int, *, multiple: bool = False):
    """The shape checks of the slot ops' ``_check_heads``, against the manager's layer geometry."""
    return _check_shape(api, name, x, T, heads, dim, multiple=multiple, tokens="num_tokens")


def _num_tokens(api: str, name: str, x, layout: str) -> int:
    """The step's token count: ``x.shape[0]`` (``"thd"``) or ``B * S`` (``"bhsd"``)."""
    shape = getattr(x, "shape", None)
    if shape is None:
        shape = host_array(x).shape
    if layout == "bhsd":
        if len(shape) != 4:
            raise ValueError(f"{api}: {name}.ndim={len(shape)}, must be 4 [batch, heads, seq, head_dim] with "
                             "layout='bhsd'")
        return int(shape[0]) * int(shape[2])
    if len(shape) != 3:
        raise ValueError(f"{api}: {name}.ndim={len(shape)}, must be 3 [tokens, heads, head_dim]")
    return int(shape[0])


def append_kv_paged(kv_blocks, layer: int, k, v, inputs, input_row_offsets, *, layout: str = "thd",
                    kv_dtype: str | None = None, engine=None) -> None:
    """Write a step's new K/V into a manager's pages (spec/manager.md §18.3).

    Row b of the batch is ``inputs``' row b (``cache_lengths[b]`` tokens already cached); its
    new tokens are ``input_row_offsets[b] : input_row_offsets[b + 1]``. Token j of row b sits
    at position ``p = cache_lengths[b] + j`` and goes to
    ``kv_blocks[page, 0 (K) / 1 (V), layer, p % page_size]`` with
    ``page = lookup_table[b, p // page_size]``. A token whose page is 0 (the null page: a
    dummy row, padding) is skipped: its rows are not read, nothing is written.

    FP8 pages (spec/manager.md §18.5) are quantised by the slot cache's rule (spec/slot-cache.md
    §10.2) with one scale unit per page: ``inputs.kv_scales[page, 0 | 1, layer, head]`` grows to
    what the step's tokens need and the page-head is re-quantised; a page written from its first
    position (offset 0) restarts its scales of this layer at 0 first. ``k`` and ``v`` must be
    finite in every non-padding token.

    Parameters
    ----------
    kv_blocks : [num_blocks, 2, num_layers, page_size, kv_heads, head_dim]
        float16 / bfloat16 / float32 / float8_e4m3fn / float8_e5m2 (CuPy: bfloat16 as ``uint16``,
        FP8 as ``uint8`` bits with ``kv_dtype``). The leaf's buffer (``inputs.kv_blocks``,
        ``get_device_buffer(r)``, or a torch view of it); any strides (a slab leaf's view).
    layer : int
        ``0 <= layer < num_layers``.
    k, v : float [T, kv_heads, head_dim] (``"thd"``) or [B, kv_heads, S, head_dim] (``"bhsd"``)
        NumPy arrays, torch tensors of any floating dtype (bfloat16; FP8 widened exactly), or
        device arrays with a device buffer; cast to the buffer's dtype, rounded once (to nearest even).
    inputs : KVCacheInputsPerDevice
        ``manager.runtime_inputs(batches).inputs[r]`` (its ``lookup_table`` uint32 [B, cols] and
        ``cache_lengths`` uint32 [B] are read; FP8: ``kv_scales``, written, and
        ``scales_lookup_table``, which must equal ``lookup_table``).
    input_row_offsets : int [B + 1]
        Exclusive cumulative sum of each row's new tokens (``ctx.active_length``): 0 first,
        non-decreasing, ``T`` last.
    layout : {"thd", "bhsd"}
        As the slot ops (``spec/slot-cache.md`` §7.4).
    kv_dtype : str, optional
        The buffer's dtype name; needed only for a ``uint8`` (CUDA) buffer of FP8 bit patterns
        (``"float8_e4m3fn"`` / ``"float8_e5m2"``), else it must match the buffer's.
    engine : ReferencePagedOps-like, optional
        The mechanisms (default: NumPy); kvfast passes its Numba / CUDA engines.

    Raises
    ------
    TypeError
        ``kv_blocks`` None, not an array, or of another dtype; a ``uint8`` buffer without an FP8
        ``kv_dtype``; FP8 without ``inputs.kv_scales``; a non-int ``layer``; ``inputs`` without a
        lookup table; non-integer index arrays; non-floating ``k``/``v``.
    IndexError
        ``layer`` out of range; a token's position past the lookup table's columns; a page id
        past ``num_blocks``.
    ValueError
        Shapes, ``input_row_offsets``, ``layout`` or ``kv_dtype`` wrong; FP8: a non-finite value in
        a non-padding token of ``k`` / ``v`` (named), scales of another shape. Every check precedes
        the write: a raise leaves ``kv_blocks`` (and the scales) unchanged.
    """
    api = "append_kv_paged"
    engine = _REFERENCE_PAGED if engine is None else engine
    layout = _check_layout(api, layout)
    T = _num_tokens(api, "k", k, layout)
    kv, layer, lut, lengths, offsets, pages, offs, name = _paged_plan(api, kv_blocks, layer, inputs,
                                                                       input_row_offsets, T, engine, kv_dtype)
    H, D = int(kv.shape[4]), int(kv.shape[5])
    scales = _paged_scales(api, inputs, kv, lut, engine) if name in _PAGED_FP8 else None
    k, _ = _tokens_input(api, "k", k, layout, T)
    v, _ = _tokens_input(api, "v", v, layout, T)
    if scales is not None:
        return _append_paged_fp8(api, engine, kv, scales, layer, k, v, pages, offs, T, name)
    k = _paged_heads(api, "k", engine.kv_input(api, "k", k, kv), T, H, D)
    v = _paged_heads(api, "v", engine.kv_input(api, "v", v, kv), T, H, D)
    if T:
        engine.scatter(kv, layer, k, v, lut, lengths, offsets, pages, offs)


def _append_paged_fp8(api: str, engine, kv, scales, layer: int, k, v, pages, offs, T: int, fp8: str) -> None:
    """spec/manager.md §18.5: the quantising write of FP8 pages (checks first, then the write)."""
    H, D, P = int(kv.shape[4]), int(kv.shape[5]), int(kv.shape[3])
    k = _paged_heads(api, "k", engine.kv_input_float32(api, "k", k), T, H, D)
    v = _paged_heads(api, "v", engine.kv_input_float32(api, "v", v), T, H, D)
    sm = np.where(pages > 0, pages * P + offs, -1)  # the slot cache's slot mapping: one unit per page
    for name, x in (("k", k), ("v", v)):
        bad = _first_nonfinite_token(engine, x, sm)
        if bad >= 0:  # spec/slot-cache.md §10.2 step 1: nothing is written
            raise ValueError(f"{api}: {name}[{bad}] has a non-finite value, FP8 storage needs finite inputs")
    if T:
        fresh = np.unique(pages[(pages > 0) & (offs == 0)])  # written from their first position
        engine.scatter_fp8(kv, scales, layer, k, v, sm, fresh, fp8)


def paged_attention(q, kv_blocks, layer: int, inputs, input_row_offsets, *, window: int | None = None,
                    scale: float | None = None, layout: str = "thd", out_dtype=None, kv_dtype: str | None = None,
                    softcap: float | None = None, sinks=None, engine=None):
    """Causal GQA attention of a step's queries through a manager's pages, in float32 (spec/manager.md §18.4).

    Query j of row b sits at ``p = cache_lengths[b] + j`` and attends the keys at positions
    ``[0, p]`` (``[max(0, p - window + 1), p]`` with a window) of its row, read through
    ``lookup_table[b]`` from ``kv_blocks[page, 0/1, layer, pos % page_size]``; keys on the null
    page 0 are never read (a sliding leaf's slots below its window), and a query whose own page
    is 0 (padding, a dummy row) gives zeros. Query head h uses K/V head
    ``h // (q_heads // kv_heads)``. Call it after the step's :func:`append_kv_paged`. FP8 pages
    are read dequantised, ``float32(x) * inputs.kv_scales[page, 0 | 1, layer, head]``
    (spec/manager.md §18.5).

    Parameters
    ----------
    q : float [T, q_heads, head_dim] (``"thd"``) or [B, q_heads, S, head_dim] (``"bhsd"``)
        ``q_heads`` a multiple of ``kv_heads``. NumPy, torch (any floating dtype), or a device array.
    kv_blocks, layer, inputs, input_row_offsets
        As :func:`append_kv_paged`.
    window : int, optional
        A sliding-window layer's window (``>= 1``); None: full causal attention.
    scale : float, optional
        Score scale; default ``1 / sqrt(head_dim)``.
    layout : {"thd", "bhsd"}
        Of ``q`` and of the result.
    out_dtype : {None, "float16", "bfloat16", "float32"}, optional
        The result rounded once to this dtype; None: float32.
    softcap : float, optional
        Logit soft-capping: every scaled score ``s`` becomes ``softcap * tanh(s / softcap)``.
    sinks : float [q_heads], optional
        One sink logit per query head in each softmax denominator (no value).
    kv_dtype, engine : optional
        As :func:`append_kv_paged`.

    Returns
    -------
    float32 [T, q_heads, head_dim] (``"bhsd"``: [B, q_heads, S, head_dim])
        A torch tensor on ``q``'s device for a torch ``q``, else an array of the buffer's kind.

    Raises
    ------
    TypeError, IndexError, ValueError
        As :func:`append_kv_paged`; also ``window`` not an int >= 1 or None, a bad ``scale``,
        ``out_dtype``, ``softcap`` (finite, > 0) or ``sinks`` (finite, ``(q_heads,)``). Nothing is written.
    """
    api = "paged_attention"
    engine = _REFERENCE_PAGED if engine is None else engine
    layout = _check_layout(api, layout)
    out_dtype = _check_out_dtype(api, out_dtype)
    if window is not None:
        window = _check_int(api, "window", window)
        if window < 1:
            raise ValueError(f"{api}: window={window}, must be >= 1 or None")
    like = q if is_torch(q) else None
    T = _num_tokens(api, "q", q, layout)
    kv, layer, lut, lengths, offsets, pages, _, name = _paged_plan(api, kv_blocks, layer, inputs, input_row_offsets,
                                                                    T, engine, kv_dtype)
    Hk, D = int(kv.shape[4]), int(kv.shape[5])
    scales = _paged_scales(api, inputs, kv, lut, engine) if name in _PAGED_FP8 else None
    scale = _check_scale(api, scale, D)
    softcap = _check_softcap(api, softcap)
    q, bhsd = _tokens_input(api, "q", q, layout, T)
    q = _paged_heads(api, "q", engine.query_input(api, q), T, Hk, D, multiple=True)
    sinks = _check_sinks(api, sinks, int(q.shape[1]), engine)
    w = 0 if window is None else window
    if scales is None:
        out = engine.attend(q, kv, layer, lut, lengths, offsets, w, scale, softcap=softcap, sinks=sinks)
    else:  # spec/manager.md §18.5: keys and values dequantised
        out = engine.attend(q, kv, layer, lut, lengths, offsets, w, scale, kv_scales=scales, fp8=name,
                            softcap=softcap, sinks=sinks)
    return _result(api, out, like, bhsd, out_dtype)
