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
  row's tokens share them); then each query token's softmax for the group's query heads is
  ``kvfast/_numba/vecmath.py``'s ``attend_head`` (the slot cache's kernel shares it): scores
  (soft-capped, ``softcap * tanh(s / softcap)``, when ``softcap`` is not 0), the largest (the
  head's sink logit included when there are sinks), the weights and the weighted values (the
  sink's weight joins the denominator, with no value), then the division. float16 and
  bfloat16 pages are read as their bits and widened exactly; float32 pages directly; FP8 pages
  (``uint8`` bits) through the 256-entry table of their format, times their page-head's scale
  (spec/manager.md §18.5).

The FP8 write is the slot cache's quantising append, ``kvfast/_numba/fp8.py``'s ``append_fp8``,
run on one layer's K / V plane of the pages with one scale unit per page.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .vecmath import attend_head, head_scratch, value_of

__all__ = ["scatter_paged", "attend_paged"]


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


@njit(cache=True, nogil=True)
def attend_paged(kv, table, layer, q, lut, lengths, row_offsets, window, scale, out, scales, scaled, softcap,
                 sinks, has_sinks):
    """float32 attention of ``q [T, q_heads, head_dim]`` into the zeroed ``out`` (spec/manager.md §18.4).

    ``kv`` is a word view of the pages (``kvfast/_numba/vecmath.py``'s :func:`word_view`):
    float32, float16 or bfloat16 bits (widened exactly), or FP8 ``uint8`` bits read through
    ``table`` (``kvspec._dtypes.fp8_decode_table``; not read otherwise) and, with ``scaled``,
    times ``scales[page, 0 | 1, layer, kv_head]`` (float32 ``[num_blocks, 2, num_layers,
    kv_heads]``: the dequantised value, spec/manager.md §18.5; unscaled, ``scales`` is not
    read); ``lut`` int64 [B, cols], ``lengths`` int64 [B], ``row_offsets`` int64 [B + 1];
    ``window`` 0 for full attention.

    Each score is ``s = scale * dot(q, k)``, then, when ``softcap`` is not 0, ``softcap *
    tanh(s / softcap)`` (logit soft-capping). With ``has_sinks``, ``sinks`` (float32 [q_heads])
    holds each query head's sink logit: it joins the largest score ``m`` and the denominator
    (``exp(sinks[h] - m)``) and has no value; without, ``sinks`` is not read. A query that sees
    no key keeps its zeros.

    Per row and K/V head, the keys and values on real pages that any of the row's queries sees
    are read once into float32 scratch (dequantised), shared by the head's query heads and the
    row's tokens; keys on the null page are never read (their scratch rows are zeros, masked out
    of the softmax). Each query token's softmax is ``vecmath.attend_head``.
    """
    P, Hk, D = kv.shape[3], kv.shape[4], kv.shape[5]
    G = q.shape[1] // Hk
    cap = np.float32(softcap)
    B = lengths.shape[0]
    longest = 1
    widest = 1
    for b in range(B):
        n = lengths[b] + row_offsets[b + 1] - row_offsets[b]
        if n > longest:
            longest = n
        if row_offsets[b + 1] - row_offsets[b] > widest:
            widest = row_offsets[b + 1] - row_offsets[b]
    pages = np.empty(longest, np.int64)
    Kb, Vb, qh, scores, acc, totals, k_lo, k_hi = head_scratch(longest, widest, G, D)
    for b in range(B):
        past = lengths[b]
        n = past + row_offsets[b + 1] - row_offsets[b]
        if n == past:
            continue  # no query in this row
        lo = 0  # the first key any query of the row sees
        if window > 0 and past - window + 1 > 0:
            lo = past - window + 1
        for key in range(lo, n):
            pg = lut[b, key // P]
            pages[key] = pg if pg > 0 else 0
        w = row_offsets[b + 1] - row_offsets[b]
        for i in range(w):  # each query token's keys; a padding query's none
            p = past + i
            k_lo[i], k_hi[i] = 0, p + 1
            if window > 0 and p - window + 1 > 0:
                k_lo[i] = p - window + 1
            if pages[p] == 0:
                k_hi[i] = 0
        for kh in range(Hk):
            for key in range(lo, n):
                pg = pages[key]
                if pg == 0:  # the null page: never read
                    for d in range(D):
                        Kb[key, d] = np.float32(0.0)
                        Vb[key, d] = np.float32(0.0)
                    continue
                o = key % P
                ks = scales[pg, 0, layer, kh] if scaled else np.float32(1.0)
                vs = scales[pg, 1, layer, kh] if scaled else np.float32(1.0)
                for d in range(D):
                    Kb[key, d] = value_of(kv, table, kv[pg, 0, layer, o, kh, d]) * ks
                for d in range(D):
                    Vb[key, d] = value_of(kv, table, kv[pg, 1, layer, o, kh, d]) * vs
            attend_head(q, row_offsets[b], k_lo[:w], k_hi[:w], kh * G, Kb, Vb, pages, True, scale, cap, sinks,
                        has_sinks, qh, scores, acc, totals, out)
