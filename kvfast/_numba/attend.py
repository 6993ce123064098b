"""The slot cache's attention kernel on the CPU (spec/slot-cache.md §7.3), with Numba.

:func:`attend_slots` is ``ops.varlen_attention`` for a step of any rows: per query (token, head)
one pass for the largest score (``scale * q . k``, soft-capped to ``softcap * tanh(s / softcap)``
when ``softcap`` is not 0; the head's sink logit included when there are sinks), one for the
weights and the weighted values (a sink's weight joins the denominator, with no value), then
the division, all in float32. Keys are read where the cache keeps them, with no gather:

* a paged layer through the step's block table, flat row ``block_table[b, p // block_size] *
  block_size + p % block_size`` of the ``[num_blocks * block_size, kv_heads, head_dim]`` storage;
* a contiguous layer, and every cross layer (its encoder plane), at flat row ``slot *
  plane_rows + p``.

float32 storage is read directly; float16 and bfloat16 storage as ``uint16`` words through the
65536-entry table of their values (exact, ``kvfast/_numba/paged.py``'s :func:`decode_table`).
FP8 storage takes the reference's dequantised path (spec/slot-cache.md §10.3), not this kernel.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .paged import dot_row, value_of

__all__ = ["ATTENTION", "SLIDING", "CROSS", "attend_slots"]

#: ``kind`` codes of :func:`attend_slots`: causal over ``[0, p]``, within a window, non-causal (encoder keys).
ATTENTION, SLIDING, CROSS = 0, 1, 2


@njit(cache=True, nogil=True)
def attend_slots(K, V, table, q, cu, past, used, slots, block_table, block_size, plane_rows, kind, window, scale,
                 softcap, sinks, has_sinks, out):
    """float32 attention of ``q [T, q_heads, head_dim]`` into ``out`` (same shape, every row written).

    ``K``, ``V`` ``[rows, kv_heads, head_dim]``: float32, or ``uint16`` words read through
    ``table``; ``cu`` ``[B + 1]``, ``past``, ``used``, ``slots`` ``[B]`` (int32: the step's
    ``cu_seqlens_q``, ``past_len``, ``seqused_k`` or, for ``kind == CROSS``,
    ``cross_seqused_k``, and ``slot_ids``); ``block_table`` ``[B, cols]`` read when
    ``block_size > 0``, else row ``slot * plane_rows + p``; ``window`` read for ``SLIDING``;
    ``sinks`` ``[q_heads]`` read when ``has_sinks``. Every query sees at least one key (its own,
    or the encoder's, which ``ops.varlen_attention`` checks).

    Per row and K/V head, the keys and values any of the row's queries sees are read once into
    float32 scratch (the head's query heads and the row's tokens share them), then each query
    head takes its scores, its softmax and its weighted values from the scratch.
    """
    Hk, D = K.shape[1], K.shape[2]
    Hq = q.shape[1]
    group = Hq // Hk
    sc = np.float32(scale)
    cap = np.float32(softcap)
    capped = cap != np.float32(0.0)
    B = slots.shape[0]
    longest = 1
    for b in range(B):
        if used[b] > longest:
            longest = used[b]
    Kb = np.empty((longest, D), np.float32)
    Vb = np.empty((longest, D), np.float32)
    rows = np.empty(longest, np.int64)
    scores = np.empty(longest, np.float32)
    acc = np.empty(D, np.float32)
    for b in range(B):
        n = np.int64(used[b])
        lo = 0  # the first key any query of the row sees
        if kind == SLIDING and past[b] - window + 1 > 0:
            lo = np.int64(past[b]) - window + 1
        base = np.int64(slots[b]) * plane_rows
        for key in range(lo, n):
            if block_size > 0:
                rows[key] = np.int64(block_table[b, key // block_size]) * block_size + key % block_size
            else:
                rows[key] = base + key
        for kh in range(Hk):
            for key in range(lo, n):
                r = rows[key]
                for d in range(D):
                    Kb[key, d] = value_of(K, table, K[r, kh, d])
                    Vb[key, d] = value_of(V, table, V[r, kh, d])
            for t in range(cu[b], cu[b + 1]):
                if kind == CROSS:
                    k0, k1 = 0, n
                else:
                    p = np.int64(past[b]) + t - cu[b]
                    k0, k1 = 0, p + 1
                    if kind == SLIDING and p - window + 1 > 0:
                        k0 = p - window + 1
                for h in range(kh * group, (kh + 1) * group):
                    m = np.float32(0.0)
                    for key in range(k0, k1):
                        s = dot_row(q, t, h, Kb, key, D) * sc
                        if capped:
                            s = cap * np.tanh(s / cap)
                        scores[key] = s
                        if key == k0 or s > m:
                            m = s
                    if has_sinks and sinks[h] > m:
                        m = sinks[h]
                    for d in range(D):
                        acc[d] = np.float32(0.0)
                    total = np.float32(0.0)
                    for key in range(k0, k1):
                        w = np.exp(scores[key] - m)
                        total += w
                        for d in range(D):
                            acc[d] += w * Vb[key, d]
                    if has_sinks:
                        total += np.exp(sinks[h] - m)
                    for d in range(D):
                        out[t, h, d] = acc[d] / total
