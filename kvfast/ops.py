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
  algorithm, on the GPU the same algorithm in CuPy array operations.
"""

from __future__ import annotations

import kvref

from ._slot_cache import KVCache

__all__ = ["append_kv", "gather_kv", "varlen_attention"]


def _check_cache(api: str, cache) -> None:
    if not isinstance(cache, KVCache):
        raise TypeError(f"{api}: cache={type(cache).__name__}, must be a kvfast.KVCache")


def append_kv(cache, layer: int, k, v, step) -> None:
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
        cast to the storage dtype (no cast,
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
    _check_cache("append_kv", cache)
    kvref.ops.append_kv(cache, layer, k, v, step)


def gather_kv(cache, layer: int, slot: int):
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
        Copies (NumPy on CPU, CuPy on CUDA); float32, dequantised, for an FP8 cache
        (``spec/slot-cache.md`` §10.3).

    Raises
    ------
    IndexError
        ``layer`` or ``slot`` out of range.
    TypeError
        A STATE layer.
    """
    _check_cache("gather_kv", cache)
    return kvref.ops.gather_kv(cache, layer, slot)


def varlen_attention(q, cache, layer: int, step, scale: float | None = None):
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
        An FP8 cache is read dequantised, exactly as ``gather_kv`` returns it (``spec/slot-cache.md`` §10.3).

    Raises
    ------
    IndexError, TypeError, ValueError
        As the reference.
    """
    _check_cache("varlen_attention", cache)
    return kvref.ops.varlen_attention(q, cache, layer, step, scale)
