"""The manager ops' CPU kernels (spec/manager.md §18): a step's K/V into a manager's pages and
a causal GQA attention through them, with Numba.

``kv_blocks`` is ``[num_blocks, 2, num_layers, page_size, kv_heads, head_dim]`` with any strides
(a slab leaf's view, spec/manager.md §13.1); both kernels index it as a 6-D array, so Numba
computes every address from its byte strides in 64-bit arithmetic.

* :func:`scatter_paged` copies bit patterns (the inputs already in the buffer's dtype, viewed
  as unsigned words of its size): token ``t`` goes to ``kv[pages[t], 0/1, layer, offsets[t]]``,
  page 0 (the null page: padding) skipped.
* :func:`attend_paged` computes in float32: per row and K/V head, the keys and values its
  queries see are read once into float32 scratch (dequantised; the head's query heads and the
  row's tokens share them); then per query (token, head) one pass for the largest score
  (soft-capped, ``softcap * tanh(s / softcap)``, when ``softcap`` is not 0; the head's sink
  logit included when there are sinks), one for the weights and the weighted values (the
  sink's weight joins the denominator, with no value), then the division. A 16-bit buffer
  (float16 or bfloat16 bits as ``uint16``) is read through a 65536-entry float32 table of its
  values (exact); a float32 buffer directly; FP8 pages (``uint8`` bits) through the 256-entry
  table of their format, times their page-head's scale (spec/manager.md §18.5).

The FP8 write is the slot cache's quantising append, ``kvfast/_numba/fp8.py``'s ``append_fp8``,
run on one layer's K / V plane of the pages with one scale unit per page.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

__all__ = ["scatter_paged", "attend_paged", "decode_table", "dot_row", "value_of"]


@njit(cache=True, nogil=True)
def scatter_paged(kv, layer, k, v, pages, offsets):
    """``kv[pages[t], 0, layer, offsets[t]] = k[t]`` and ``kv[..., 1, ...] = v[t]`` where ``pages[t] > 0``.

    ``kv`` is the buffer viewed as words (``uint8/16/32``), ``k`` / ``v`` ``[T, kv_heads, head_dim]``
    of the same words; ``pages``, ``offsets`` int64 [T].
    """
    H, D = kv.shape[4], kv.shape[5]
    for t in range(pages.shape[0]):
        pg = pages[t]
        if pg <= 0:
            continue  # the null page: a padding token, not read
        o = offsets[t]
        for h in range(H):
            for d in range(D):
                kv[pg, 0, layer, o, h, d] = k[t, h, d]
                kv[pg, 1, layer, o, h, d] = v[t, h, d]


def value_of(kv, table, x):
    """The float32 value of one stored element ``x`` of ``kv`` (compiled through :func:`_value_of`)."""
    return x if kv.dtype.kind == "f" else table[x]


@overload(value_of, jit_options={"cache": True})
def _value_of(kv, table, x):
    """``x`` itself for a float32 buffer, ``table[x]`` for 16-bit words (float16 / bfloat16 bits)."""
    if isinstance(kv.dtype, types.Float):
        return lambda kv, table, x: x
    return lambda kv, table, x: table[x]


@njit(cache=True, fastmath={"reassoc", "contract"})
def dot_row(q, t, h, Kb, key, D):
    """``sum_d q[t, h, d] * Kb[key, d]`` in float32 (reassociated: the loop vectorises)."""
    s = np.float32(0.0)
    for d in range(D):
        s += q[t, h, d] * Kb[key, d]
    return s


@njit(cache=True, nogil=True)
def attend_paged(kv, table, layer, q, lut, lengths, row_offsets, window, scale, out, scales, scaled, softcap,
                 sinks, has_sinks):
    """float32 attention of ``q [T, q_heads, head_dim]`` into the zeroed ``out`` (spec/manager.md §18.4).

    ``kv`` float32, or ``uint16`` words read through ``table`` (:func:`decode_table`), or FP8
    ``uint8`` bits read through ``kvspec._dtypes.fp8_decode_table`` and, with ``scaled``, times
    ``scales[page, 0 | 1, layer, kv_head]`` (float32 ``[num_blocks, 2, num_layers, kv_heads]``:
    the dequantised value, spec/manager.md §18.5; unscaled, ``scales`` is not read); ``lut``
    int64 [B, cols], ``lengths`` int64 [B], ``row_offsets`` int64 [B + 1]; ``window`` 0 for
    full attention.

    Each score is ``s = scale * dot(q, k)``, then, when ``softcap`` is not 0, ``softcap *
    tanh(s / softcap)`` (logit soft-capping). With ``has_sinks``, ``sinks`` (float32 [q_heads])
    holds each query head's sink logit: it joins the largest score ``m`` and the denominator
    (``exp(sinks[h] - m)``) and has no value; without, ``sinks`` is not read. A query that sees
    no key keeps its zeros.

    Per row and K/V head, the keys and values on real pages that any of the row's queries sees
    are read once into float32 scratch (dequantised), shared by the head's query heads and the
    row's tokens; keys on the null page are never read.
    """
    P, Hk, D = kv.shape[3], kv.shape[4], kv.shape[5]
    Hq = q.shape[1]
    group = Hq // Hk
    sc = np.float32(scale)
    cap = np.float32(softcap)
    capped = cap != np.float32(0.0)
    B = lengths.shape[0]
    longest = 1
    for b in range(B):
        n = lengths[b] + row_offsets[b + 1] - row_offsets[b]
        if n > longest:
            longest = n
    Kb = np.empty((longest, D), np.float32)
    Vb = np.empty((longest, D), np.float32)
    pages = np.empty(longest, np.int64)
    scores = np.empty(longest, np.float32)
    acc = np.empty(D, np.float32)
    for b in range(B):
        past = lengths[b]
        n = past + row_offsets[b + 1] - row_offsets[b]
        if n == past:
            continue  # no query in this row
        lo = 0  # the first key any query of the row sees
        if window > 0 and past - window + 1 > 0:
            lo = past - window + 1
        for key in range(lo, n):
            pages[key] = lut[b, key // P]
        for kh in range(Hk):
            for key in range(lo, n):
                pg = pages[key]
                if pg <= 0:
                    continue  # the null page: never read
                o = key % P
                ks = scales[pg, 0, layer, kh] if scaled else np.float32(1.0)
                vs = scales[pg, 1, layer, kh] if scaled else np.float32(1.0)
                for d in range(D):
                    Kb[key, d] = value_of(kv, table, kv[pg, 0, layer, o, kh, d]) * ks
                    Vb[key, d] = value_of(kv, table, kv[pg, 1, layer, o, kh, d]) * vs
            for t in range(row_offsets[b], row_offsets[b + 1]):
                p = past + t - row_offsets[b]
                if pages[p] <= 0:
                    continue  # a padding query: zeros
                k0 = 0
                if window > 0 and p - window + 1 > 0:
                    k0 = p - window + 1
                for h in range(kh * group, (kh + 1) * group):
                    m = np.float32(0.0)
                    seen = False
                    for key in range(k0, p + 1):
                        if pages[key] <= 0:
                            continue
                        s = dot_row(q, t, h, Kb, key, D) * sc
                        if capped:
                            s = cap * np.tanh(s / cap)
                        scores[key] = s
                        if not seen or s > m:
                            m = s
                            seen = True
                    if not seen:
                        continue
                    sink = sinks[h] if has_sinks else np.float32(0.0)
                    if has_sinks and sink > m:
                        m = sink
                    for d in range(D):
                        acc[d] = np.float32(0.0)
                    total = np.float32(0.0)
                    for key in range(k0, p + 1):
                        if pages[key] <= 0:
                            continue
                        w = np.exp(scores[key] - m)
                        total += w
                        for d in range(D):
                            acc[d] += w * Vb[key, d]
                    if has_sinks:
                        total += np.exp(sink - m)
                    for d in range(D):
                        out[t, h, d] = acc[d] / total


_TABLES: dict = {}


def decode_table(name: str) -> np.ndarray:
    """float32 [65536]: the value of every 16-bit pattern of ``"float16"`` or ``"bfloat16"`` (exact)."""
    got = _TABLES.get(name)
    if got is None:
        bits = np.arange(1 << 16, dtype=np.uint32)
        if name == "bfloat16":
            got = (bits << np.uint32(16)).view(np.float32)
        else:
            got = bits.astype(np.uint16).view(np.float16).astype(np.float32)
        _TABLES[name] = got
    return got
