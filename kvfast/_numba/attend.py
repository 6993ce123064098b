"""The slot cache's attention kernel on the CPU (spec/slot-cache.md §7.3), with Numba.

:func:`attend_slots` is ``ops.varlen_attention`` for a step of any rows, in float32: the scores
``scale * q . k`` (soft-capped to ``softcap * tanh(s / softcap)`` when ``softcap`` is not 0),
their largest (the head's sink logit included when there are sinks), the weights and the
weighted values (a sink's weight joins the denominator, with no value), then the division,
per query token and K/V head group in ``vecmath.attend_head``. Keys are read where the cache
keeps them, with no gather:

* a paged layer through the step's block table, flat row ``block_table[b, p // block_size] *
  block_size + p % block_size`` of the ``[num_blocks * block_size, kv_heads, head_dim]`` storage;
* a contiguous layer, and every cross layer (its encoder plane), at flat row ``slot *
  plane_rows + p``.

float32 storage is read directly; float16 and bfloat16 storage as their bits, widened exactly by
bit arithmetic (``kvfast/_numba/vecmath.py``, which also holds the softmax core both CPU attention
kernels share). FP8 storage takes the reference's dequantised path (spec/slot-cache.md §10.3),
not this kernel.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .vecmath import attend_head, head_scratch, value_of

__all__ = ["ATTENTION", "SLIDING", "CROSS", "attend_slots"]

#: ``kind`` codes of :func:`attend_slots`: causal over ``[0, p]``, within a window, non-causal (encoder keys).
ATTENTION, SLIDING, CROSS = 0, 1, 2


@njit(cache=True, nogil=True)
def attend_slots(K, V, q, cu, past, used, slots, block_table, block_size, plane_rows, kind, window, scale, softcap,
                 sinks, has_sinks, out):
    """float32 attention of ``q [T, q_heads, head_dim]`` into ``out`` (same shape, every row written).

    ``K``, ``V`` ``[rows, kv_heads, head_dim]``: word views of the storage
    (``kvfast/_numba/vecmath.py``'s :func:`word_view`: float32, or float16 / bfloat16 bits);
    ``cu`` ``[B + 1]``, ``past``, ``used``, ``slots`` ``[B]`` (int32: the step's
    ``cu_seqlens_q``, ``past_len``, ``seqused_k`` or, for ``kind == CROSS``,
    ``cross_seqused_k``, and ``slot_ids``); ``block_table`` ``[B, cols]`` read when
    ``block_size > 0``, else row ``slot * plane_rows + p``; ``window`` read for ``SLIDING``;
    ``sinks`` ``[q_heads]`` read when ``has_sinks``. Every query sees at least one key (its own,
    or the encoder's, which ``ops.varlen_attention`` checks).

    Per row and K/V head, the keys and values any of the row's queries sees are read once into
    float32 scratch (the head's query heads and the row's tokens share them); then each query
    token's softmax over them for the group's query heads is :func:`attend_head`.
    """
    Hk, D = K.shape[1], K.shape[2]
    G = q.shape[1] // Hk
    cap = np.float32(softcap)
    B = slots.shape[0]
    longest = 1
    widest = 1
    for b in range(B):
        if used[b] > longest:
            longest = used[b]
        if cu[b + 1] - cu[b] > widest:
            widest = cu[b + 1] - cu[b]
    rows = np.empty(longest, np.int64)
    Kb, Vb, qh, scores, acc, totals, k_lo, k_hi = head_scratch(longest, widest, G, D)
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
        for t in range(cu[b], cu[b + 1]):  # each query token's keys
            i = t - cu[b]
            if kind == CROSS:
                k_lo[i], k_hi[i] = 0, n
            else:
                p = np.int64(past[b]) + i
                k_lo[i], k_hi[i] = 0, p + 1
                if kind == SLIDING and p - window + 1 > 0:
                    k_lo[i] = p - window + 1
        for kh in range(Hk):
            for key in range(lo, n):
                r = rows[key]
                for d in range(D):
                    Kb[key, d] = value_of(K, _NO_TABLE, K[r, kh, d])
                for d in range(D):
                    Vb[key, d] = value_of(V, _NO_TABLE, V[r, kh, d])
            attend_head(q, cu[b], k_lo[: cu[b + 1] - cu[b]], k_hi[: cu[b + 1] - cu[b]], kh * G, Kb, Vb, _NO_MASK,
                        False, scale, cap, sinks, has_sinks, qh, scores, acc, totals, out)

#: ``value_of``'s table argument for the words this kernel reads (float32, float16, bfloat16: no table)
_NO_TABLE = np.zeros(1, np.float32)
#: ``attend_head``'s key mask when every key is real (not read)
_NO_MASK = np.zeros(1, np.int64)
