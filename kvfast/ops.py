"""Ops that write to and attend through a ``kvfast.KVCache`` (DESIGN §4.4).

Same names, arguments, results and errors as ``kvref.ops``, whose functions
are the ops' policy (checks, messages, which positions a layer reads); the
work is the cache's fast engine (``cache.engine``):

* :func:`append_kv` scatters through ``slot_mapping`` with a Numba ``memcpy``
  kernel (CPU) or the ``append_kv.cu`` RawKernel (GPU); bit-pattern copies,
  padding slots (``< 0``) skipped; an FP8 cache quantises instead
  (``kvfast/_numba/fp8.py`` on the CPU, ``append_kv_fp8.cu`` on the GPU);
* :func:`gather_kv` returns one slot's committed K/V densely (Numba or
  ``gather_kv.cu``);
* :func:`varlen_attention` attends in float32: on the CPU the reference
  algorithm, on the GPU the same algorithm in CuPy array operations;
* :func:`gather_step` reads a step's histories, padded or packed, through the
  engine's gather kernels.

Torch in, torch out and ``layout="bhsd"`` as kvref's (``spec/slot-cache.md`` §7.4).

The manager's ops (``spec/manager.md`` §18), kvref's policy with kvfast's mechanisms:
:func:`append_kv_paged` and :func:`paged_attention` over a manager's ``kv_blocks``
run the Numba kernels of ``kvfast/_numba/paged.py`` on a NumPy buffer and the
``paged_attention.cu`` kernels on a CuPy buffer (under ``KVFAST_CUDA_EMULATE=1``
on the CPU, through the host harness).
"""

from __future__ import annotations

import numpy as np

import kvref
from kvspec._interop import host_array, is_torch

from ._slot_cache import KVCache

__all__ = ["append_kv", "gather_kv", "varlen_attention", "gather_step", "append_kv_paged", "paged_attention",
           "FastPagedOps", "CudaPagedOps"]


def _check_cache(api: str, cache) -> None:
    if not isinstance(cache, KVCache):
        raise TypeError(f"{api}: cache={type(cache).__name__}, must be a kvfast.KVCache")


def append_kv(cache, layer: int, k, v, step, *, layout: str = "thd") -> None:
    """Scatter a step's new K/V into an attention or sliding-window layer.

    Token t goes to flat storage row ``step.slot_mapping[t]``; tokens with
    ``slot_mapping < 0`` are skipped (padding).

    Parameters
    ----------
    cache : kvfast.KVCache
    layer : int
        An ATTENTION or SLIDING_WINDOW layer.
    k, v : float [T, kv_heads, head_dim]
        The step's new keys and values; an FP8 cache quantises them with per-(block, head)
        scales (``spec/slot-cache.md`` §10.2: finite values in every row with ``slot_mapping >= 0``,
        else ``ValueError``; padding rows are never read, any values there change nothing); otherwise
        cast to the storage dtype (no cast, a bit copy, when they already have it; a wider input
        rounded once, to nearest even). NumPy, torch tensors of any floating dtype (bfloat16,
        FP8 widened exactly), device arrays on CUDA; ``[B, kv_heads, S, head_dim]`` with
        ``layout="bhsd"``.
    step : StepIndices
        From ``cache.prepare_step``; ``T == step.num_tokens``.
    layout : {"thd", "bhsd"}
        As ``kvref.ops.append_kv`` (``spec/slot-cache.md`` §7.4).

    Raises
    ------
    IndexError
        ``layer`` out of range, or a ``slot_mapping`` entry past the storage.
    TypeError
        Wrong layer kind, non-floating ``k``/``v``, or ``step`` not a ``StepIndices``.
    ValueError
        Shapes or ``layout`` wrong. Storage is unchanged.
    """
    _check_cache("append_kv", cache)
    kvref.ops.append_kv(cache, layer, k, v, step, layout=layout)


def gather_kv(cache, layer: int, slot: int, *, like=None):
    """Dense K and V of one slot.

    Parameters
    ----------
    cache : kvfast.KVCache
    layer : int
        ATTENTION / SLIDING_WINDOW (the slot's committed ``seq_lens()[slot]``
        positions) or CROSS_ATTENTION (the filled encoder length).
    slot : int
        ``0 <= slot < max_seqs``.
    like : torch.Tensor or numpy.ndarray, optional
        A torch tensor: torch results on its device (bfloat16 as ``torch.bfloat16``).

    Returns
    -------
    K, V : config.dtype [n, kv_heads, head_dim]
        Copies (NumPy on CPU, CuPy on CUDA, torch with a torch ``like``); float32, dequantised,
        for an FP8 cache (``spec/slot-cache.md`` §10.3).

    Raises
    ------
    IndexError
        ``layer`` or ``slot`` out of range.
    TypeError
        A STATE layer, or a bad ``like``.
    """
    _check_cache("gather_kv", cache)
    return kvref.ops.gather_kv(cache, layer, slot, like=like)


def varlen_attention(q, cache, layer: int, step, scale: float | None = None, *, layout: str = "thd",
                     out_dtype=None, softcap: float | None = None, sinks=None):
    """Attention of a step's queries through the cache, computed in float32.

    Same semantics as ``kvref.ops.varlen_attention``: row b attends keys
    ``[0, step.seqused_k[b])`` causally (ATTENTION), within the window
    (SLIDING_WINDOW), or all ``cross_seqused_k[b]`` encoder keys
    non-causally (CROSS_ATTENTION); GQA groups query heads over K/V heads.

    Parameters
    ----------
    q : float [T, q_heads, head_dim] (``"bhsd"``: [B, q_heads, S, head_dim])
        ``q_heads`` a multiple of the layer's ``kv_heads``; NumPy, torch (any floating dtype)
        or a device array.
    cache : kvfast.KVCache
    layer : int
        ATTENTION, SLIDING_WINDOW or CROSS_ATTENTION.
    step : StepIndices
        From ``cache.prepare_step``, with the step's K/V already appended.
    scale : float, optional
        Score scale; default ``1 / sqrt(head_dim)``.
    layout : {"thd", "bhsd"}
        Of ``q`` and of the result.
    out_dtype : {None, "float16", "bfloat16", "float32"}, optional
        The float32 result rounded once to this dtype; None: float32.
    softcap : float, optional
        Logit soft-capping (Gemma 2): each score ``s`` becomes ``softcap * tanh(s / softcap)``; as
        ``kvref.ops``. None: off.
    sinks : array [q_heads], optional
        Per-head sink logits (gpt-oss) in the softmax denominator, with no value; as ``kvref.ops``.

    Returns
    -------
    float32 [T, q_heads, head_dim] (``"bhsd"``: [B, q_heads, S, head_dim])
        A torch tensor on ``q``'s device for a torch ``q``, else NumPy (CPU) or CuPy (CUDA).
        An FP8 cache is read dequantised, exactly as ``gather_kv`` returns it (``spec/slot-cache.md`` §10.3).

    Raises
    ------
    IndexError, TypeError, ValueError
        As the reference.
    """
    _check_cache("varlen_attention", cache)
    return kvref.ops.varlen_attention(q, cache, layer, step, scale, layout=layout, out_dtype=out_dtype,
                                      softcap=softcap, sinks=sinks)


def gather_step(cache, layer: int, step, *, padded: bool = True, like=None):
    """K and V of every row's whole history in a step, padded or packed (as ``kvref.ops.gather_step``).

    Parameters
    ----------
    cache : kvfast.KVCache
    layer : int
        ATTENTION, SLIDING_WINDOW or CROSS_ATTENTION.
    step : StepIndices
        From ``cache.prepare_step`` (after the step's ``append_kv``: its tokens are included).
    padded : bool
        True: ``[rows, max_len, kv_heads, head_dim]`` zero-padded and ``lengths`` int32 [rows];
        False: ``[total, kv_heads, head_dim]`` and ``cu_seqlens`` int32 [rows + 1].
    like : torch.Tensor or numpy.ndarray, optional
        A torch tensor: torch results on its device.

    Returns
    -------
    (K, V, lengths) or (K, V, cu_seqlens)
        config.dtype (float32 for FP8); NumPy on the CPU, CuPy on CUDA, torch with a torch ``like``.

    Raises
    ------
    IndexError, TypeError
        As the reference.
    """
    _check_cache("gather_step", cache)
    return kvref.ops.gather_step(cache, layer, step, padded=padded, like=like)


# ----------------------------------------------------------------------------- manager ops (spec/manager.md §18)


class FastPagedOps(kvref.ops.ReferencePagedOps):
    """The manager ops' mechanisms on the CPU: the Numba kernels of ``kvfast/_numba/paged.py``."""

    _WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32}

    def scatter(self, kv_blocks, layer: int, k, v, lut, lengths, row_offsets, pages, offsets) -> None:
        from ._numba.paged import scatter_paged

        word = self._WORDS[kv_blocks.dtype.itemsize]
        scatter_paged(kv_blocks.view(word), layer, k.view(word), v.view(word), pages, offsets)

    def scatter_fp8(self, kv_blocks, kv_scales, layer: int, k, v, slot_mapping, fresh, fp8: str) -> None:
        """The slot cache's quantising append (``kvfast/_numba/fp8.py``'s ``append_fp8``) on layer
        ``layer``'s K / V planes and scale rows, in place, one scale unit per page (see
        ``kvref.ops.ReferencePagedOps.scatter_fp8``)."""
        from ._numba.fp8 import append_fp8

        P = kv_blocks.shape[3]
        if fresh.size:
            kv_scales[fresh, :, layer] = 0
        append_fp8(k, v, kv_blocks[:, 0, layer], kv_blocks[:, 1, layer], kv_scales[:, 0, layer],
                   kv_scales[:, 1, layer], slot_mapping, P, fp8, _fp8_table(fp8))

    def attend(self, q, kv_blocks, layer: int, lut, lengths, row_offsets, window: int, scale: float,
               kv_scales=None, fp8: str | None = None, softcap: float = 0.0, sinks=None):
        """float32 ``[T, q_heads, head_dim]`` through ``attend_paged`` (``kvfast/_numba/paged.py``),
        as ``kvref.ops.ReferencePagedOps.attend``: ``softcap`` (0.0: off) soft-caps every score,
        ``sinks`` (host float32 [q_heads], or None) adds each head's sink logit to the softmax
        denominator."""
        from ._numba.paged import attend_paged
        from ._numba.vecmath import word_view

        q = np.ascontiguousarray(q.astype(np.float32, copy=False))
        out = np.zeros(q.shape, np.float32)
        cap = float(softcap)
        has_sinks = sinks is not None
        sk = np.ascontiguousarray(sinks, np.float32) if has_sinks else _NO_SINKS
        if kv_scales is not None:  # FP8 bits through their format's table, times the page-head's scale
            attend_paged(kv_blocks.view(np.uint8), _fp8_table(fp8), layer, q, lut, lengths, row_offsets, window,
                         scale, out, kv_scales, True, cap, sk, has_sinks)
        else:  # float32 as is, float16 / bfloat16 as their bits (widened exactly)
            attend_paged(word_view(kv_blocks), _NO_TABLE, layer, q, lut, lengths,
                         row_offsets, window, scale, out, _NO_SCALES, False, cap, sk, has_sinks)
        return out


_NO_TABLE = np.zeros(1, np.float32)
_NO_SCALES = np.ones((1, 1, 1, 1), np.float32)
_NO_SINKS = np.zeros(1, np.float32)
_FP8_TABLES: dict = {}


def _fp8_table(fp8: str) -> np.ndarray:
    """float32 [256]: every bit pattern's value (``kvspec._dtypes.fp8_decode_table``), cached."""
    got = _FP8_TABLES.get(fp8)
    if got is None:
        from kvspec._dtypes import fp8_decode_table

        got = _FP8_TABLES[fp8] = fp8_decode_table(fp8)
    return got


class CudaPagedOps(FastPagedOps):
    """The manager ops' mechanisms on CUDA: ``paged_attention.cu`` through CuPy (``kvfast/_cuda/paged_attention.py``).

    ``kv_blocks`` is a CuPy array (a bfloat16 manager's ``uint16`` bit patterns) or a CUDA torch
    tensor (taken through DLPack, no copy). Inputs are converted to the buffer's dtype as kvref
    converts them (``kvfast/_cuda/convert.py``).
    """

    def buffer(self, api: str, kv_blocks):
        if is_torch(kv_blocks):
            from .interop import from_torch

            return from_torch(kv_blocks)
        return kv_blocks

    def scales_buffer(self, api: str, kv_scales):
        """``inputs.kv_scales`` as a CuPy array (a CUDA tensor through DLPack, no copy)."""
        if is_torch(kv_scales):
            from .interop import from_torch

            return from_torch(kv_scales)
        if not hasattr(kv_scales, "__cuda_array_interface__"):
            raise TypeError(f"{api}: inputs.kv_scales={type(kv_scales).__name__}, must be a device array beside a "
                            "device kv_blocks")
        return kv_scales

    def to_host(self, x) -> np.ndarray:
        """A host NumPy array of ``x``: a device array copied back, a tensor through ``host_array``."""
        if is_torch(x):
            return host_array(x.detach().cpu())
        if not isinstance(x, np.ndarray) and hasattr(x, "__cuda_array_interface__"):
            from ._cuda._module import cupy

            return cupy().asnumpy(x)
        return host_array(x)

    @staticmethod
    def _logical(kv_blocks) -> str:
        return "bfloat16" if kv_blocks.dtype == np.uint16 else kv_blocks.dtype.name

    def kv_input(self, api: str, name: str, x, kv_blocks):
        from ._cuda._module import cupy
        from ._cuda.convert import rows_contiguous, to_device_storage

        with cupy().cuda.Device(kv_blocks.device.id):
            return rows_contiguous(to_device_storage(api, name, x, kv_blocks.dtype, self._logical(kv_blocks)))

    def query_input(self, api: str, q):
        """``q`` checked floating (``TypeError`` otherwise); :meth:`attend` widens it to float32 on
        the buffer's device."""
        if is_torch(q):
            if str(q.dtype) in ("torch.bfloat16", "torch.float8_e4m3fn", "torch.float8_e5m2"):
                q = q.float()  # exact; CuPy has neither dtype
            q = self.buffer(api, q)
        dt = getattr(q, "dtype", None)
        if dt is None:
            q = host_array(q)
            dt = q.dtype
        if np.dtype(dt).kind != "f" and np.dtype(dt).name != "bfloat16":
            raise TypeError(f"{api}: q dtype={dt}, must be a floating type")
        return q

    def scatter(self, kv_blocks, layer: int, k, v, lut, lengths, row_offsets, pages, offsets) -> None:
        from ._cuda._module import cupy
        from ._cuda.paged_attention import paged_append

        with cupy().cuda.Device(kv_blocks.device.id):
            paged_append(k, v, kv_blocks, layer, lut, lengths, row_offsets)

    def kv_input_float32(self, api: str, name: str, x):
        """``x`` as float32 rows on the buffer's device (``kvfast/_cuda/convert.py``; ``TypeError``
        if not floating)."""
        from ._cuda.convert import rows_contiguous, to_device_storage

        return rows_contiguous(to_device_storage(api, name, x, np.dtype(np.float32), "float32"))

    def first_nonfinite(self, x) -> int:
        cp = self._cupy()
        if x.shape[0] == 0:
            return -1
        ok = cp.asnumpy(cp.isfinite(x).reshape(x.shape[0], -1).all(axis=1))  # one device sync
        bad = np.flatnonzero(~ok)
        return int(bad[0]) if bad.size else -1

    @staticmethod
    def _cupy():
        from ._cuda._module import cupy

        return cupy()

    def scatter_fp8(self, kv_blocks, kv_scales, layer: int, k, v, slot_mapping, fresh, fp8: str) -> None:
        """``append_kv_fp8.cu``'s three launches (the slot cache's quantising append) on layer
        ``layer``'s K / V planes of the pages and their scale rows, one scale unit per page."""
        from ._cuda.append_kv_fp8 import append_kv_fp8 as launch

        cp = self._cupy()
        it = kv_blocks.dtype.itemsize
        s = [int(n) // it for n in kv_blocks.strides]
        H, D, P = int(kv_blocks.shape[4]), int(kv_blocks.shape[5]), int(kv_blocks.shape[3])
        if s[5] != 1 or (s[4] != D and H > 1):
            raise ValueError(f"append_kv_paged: kv_blocks strides={tuple(kv_blocks.strides)}: FP8 pages on CUDA "
                             "need each slot's [kv_heads, head_dim] contiguous")
        with cp.cuda.Device(kv_blocks.device.id):
            if fresh.size:
                kv_scales[cp.asarray(fresh), :, layer] = 0
            launch(k, v, kv_blocks[:, 0, layer], kv_blocks[:, 1, layer], kv_scales[:, 0, layer],
                   kv_scales[:, 1, layer], cp.asarray(np.ascontiguousarray(slot_mapping, np.int64)), fp8=fp8,
                   block_size=P, block_stride=s[0], row_stride=s[3], unit_tokens=P)

    def attend(self, q, kv_blocks, layer: int, lut, lengths, row_offsets, window: int, scale: float,
               kv_scales=None, fp8: str | None = None, softcap: float = 0.0, sinks=None):
        """One ``paged_attention_kernel`` launch (``kvfast/_cuda/paged_attention.py``) on the
        buffer's device; ``softcap`` and ``sinks`` (host float32 [q_heads], copied to the device)
        as :meth:`FastPagedOps.attend`."""
        from ._cuda._module import cupy
        from ._cuda.convert import query_float32
        from ._cuda.paged_attention import KV_FORMATS, paged_attention as launch

        with cupy().cuda.Device(kv_blocks.device.id):
            return launch(query_float32(q), kv_blocks, layer, lut, lengths, row_offsets, window=window, scale=scale,
                          kv_format=KV_FORMATS[fp8 if kv_scales is not None else self._logical(kv_blocks)],
                          kv_scales=kv_scales, softcap=float(softcap), sinks=sinks)


_FAST_PAGED = FastPagedOps()
_CUDA_PAGED = None


def _paged_engine(kv_blocks):
    """The engine of a buffer: CUDA for a device array or a CUDA tensor, Numba otherwise."""
    global _CUDA_PAGED
    on_device = (is_torch(kv_blocks) and kv_blocks.device.type == "cuda") or (
        not isinstance(kv_blocks, np.ndarray) and not is_torch(kv_blocks)
        and hasattr(kv_blocks, "__cuda_array_interface__"))
    if not on_device:
        return _FAST_PAGED
    if _CUDA_PAGED is None:
        _CUDA_PAGED = CudaPagedOps()
    return _CUDA_PAGED


def append_kv_paged(kv_blocks, layer: int, k, v, inputs, input_row_offsets, *, layout: str = "thd",
                    kv_dtype: str | None = None) -> None:
    """Write a step's new K/V into a manager's pages (``kvref.ops.append_kv_paged``; spec/manager.md §18.3).

    Token j of row b sits at ``p = inputs.cache_lengths[b] + j`` and goes to
    ``kv_blocks[lookup_table[b, p // page_size], 0 / 1, layer, p % page_size]``; tokens on the
    null page 0 are skipped (padding, dummy rows).

    FP8 pages are quantised with their per-page scales ``inputs.kv_scales`` by the slot cache's
    rule (spec/manager.md §18.5): ``append_fp8`` of ``kvfast/_numba/fp8.py`` on the CPU, the
    ``append_kv_fp8.cu`` launches on CUDA, on the layer's K / V planes; the same bytes and scales
    as kvref's.

    Parameters
    ----------
    kv_blocks : [num_blocks, 2, num_layers, page_size, kv_heads, head_dim]
        float16 / bfloat16 / float32 / float8_e4m3fn / float8_e5m2 (CuPy: bfloat16 as ``uint16``
        bits, FP8 as ``uint8`` bits named by ``kv_dtype``); NumPy (Numba kernel), CuPy
        (``paged_append_kernel``), or a torch view of either.
    layer : int
    k, v : float [T, kv_heads, head_dim] (``"bhsd"``: [B, kv_heads, S, head_dim])
    inputs : KVCacheInputsPerDevice
        ``manager.runtime_inputs(...).inputs[r]`` (FP8: its ``kv_scales`` are written).
    input_row_offsets : int [B + 1]
        Exclusive cumulative sum of each row's new tokens.
    layout : {"thd", "bhsd"}
    kv_dtype : str, optional
        As the reference: the FP8 format of a ``uint8`` (CUDA) buffer.

    Raises
    ------
    TypeError, IndexError, ValueError
        As the reference; a raise writes nothing.
    """
    kvref.ops.append_kv_paged(kv_blocks, layer, k, v, inputs, input_row_offsets, layout=layout, kv_dtype=kv_dtype,
                              engine=_paged_engine(kv_blocks))


def paged_attention(q, kv_blocks, layer: int, inputs, input_row_offsets, *, window: int | None = None,
                    scale: float | None = None, layout: str = "thd", out_dtype=None, kv_dtype: str | None = None,
                    softcap: float | None = None, sinks=None):
    """Causal GQA attention through a manager's pages, float32 (``kvref.ops.paged_attention``,
    spec/manager.md §18.4); FP8 pages read dequantised (spec/manager.md §18.5).

    Parameters
    ----------
    q : float [T, q_heads, head_dim] (``"bhsd"``: [B, q_heads, S, head_dim])
    kv_blocks, layer, inputs, input_row_offsets
        As :func:`append_kv_paged`.
    window : int, optional
        Sliding window (``>= 1``); None: full attention.
    scale : float, optional
        Default ``1 / sqrt(head_dim)``.
    layout : {"thd", "bhsd"}
    out_dtype : {None, "float16", "bfloat16", "float32"}, optional
    kv_dtype : str, optional
        As :func:`append_kv_paged`.
    softcap : float, optional
        Logit soft-capping (Gemma 2): each score ``s`` becomes ``softcap * tanh(s / softcap)``; as
        ``kvref.ops``. None: off.
    sinks : array [q_heads], optional
        Per-head sink logits (gpt-oss) in the softmax denominator, with no value; as ``kvref.ops``.

    Returns
    -------
    float32 [T, q_heads, head_dim]
        Torch on ``q``'s device for a torch ``q``; else NumPy (Numba kernel) or CuPy (CUDA kernel).
        Equal to kvref's within 1e-5 (relative, 1e-6 absolute): float32 sums in another order.

    Raises
    ------
    TypeError, IndexError, ValueError
        As the reference.
    """
    return kvref.ops.paged_attention(q, kv_blocks, layer, inputs, input_row_offsets, window=window, scale=scale,
                                     layout=layout, out_dtype=out_dtype, kv_dtype=kv_dtype, softcap=softcap,
                                     sinks=sinks, engine=_paged_engine(kv_blocks))
