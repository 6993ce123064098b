"""Step-index construction on the CPU (DESIGN §4.3) as Numba kernels.

``check_step`` validates a step in the reference's order and reports the
first offender as a code; ``grow_rows`` appends freshly allocated blocks to
the rows' table entries; ``build_indices`` writes every ``StepIndices``
array in one pass; ``plan_indices`` is the three of a step that needs no
new block (check, block count, indices) as one call. No per-token Python
work: one call each per step.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvspec.engine import (
    STEP_CAPACITY as CAPACITY, STEP_CU0 as CU0, STEP_NOT_INCREASING as NOT_INCREASING, STEP_OK as OK,
    STEP_PAST_MISMATCH as PAST_MISMATCH, STEP_SLOT_DUP as SLOT_DUP, STEP_SLOT_RANGE as SLOT_RANGE,
    STEP_TOTAL as TOTAL,
)

__all__ = [
    "OK", "CU0", "NOT_INCREASING", "SLOT_RANGE", "SLOT_DUP", "PAST_MISMATCH", "CAPACITY", "TOTAL",
    "check_step", "check_slots", "blocks_needed", "step_blocks_needed", "grow_rows", "index_layout",
    "build_indices", "plan_indices",
]

# Result codes of check_step / check_slots are the engine protocol's (kvspec.engine); the
# policy formats the message. Numba freezes them as module globals.

#: int32 index tensors (spec/types.md §1)
_INT32_MAX = 2**31 - 1


@njit(cache=True)
def check_slots(slots, max_seqs, mark, first, gen):
    """First slot out of range or duplicated, in row order.

    ``mark``/``first`` are int64/int32 scratch arrays ``[max_seqs]``; ``gen``
    is a fresh stamp (so the scratch never needs clearing). Returns
    ``(code, i, j)``: ``j`` is the earlier row of a duplicate.
    """
    for i in range(slots.shape[0]):
        s = slots[i]
        if s < 0 or s >= max_seqs:
            return SLOT_RANGE, i, 0
        if mark[s] == gen:
            return SLOT_DUP, i, first[s]
        mark[s] = gen
        first[s] = i
    return OK, 0, 0


@njit(cache=True)
def check_step(cu, past, slots, seq, max_seqs, max_seq_len, mark, first, gen):
    """Validate ``(cu_seqlens_q, past_len, slot_ids)`` (lengths already checked).

    Order and codes follow ``kvref.KVCache.prepare_step``: ``cu[0] == 0``;
    strictly increasing ``cu``; slots in range and distinct; ``past_len[i] ==
    seq[slot_i]``; ``past + q <= max_seq_len``. Returns ``(code, i, j)``.
    """
    n = slots.shape[0]
    if cu[0] != 0:
        return CU0, 0, 0
    for i in range(1, n + 1):
        if cu[i] <= cu[i - 1]:
            return NOT_INCREASING, i, 0
    code, i, j = check_slots(slots, max_seqs, mark, first, gen)
    if code != OK:
        return code, i, j
    for i in range(n):
        if past[i] != seq[slots[i]]:
            return PAST_MISMATCH, i, 0
    total = 0
    for i in range(n):
        # q > L - past, not past + q > L: q may be near 2**63 (no wrap); 0 <= past <= L here
        if cu[i + 1] - cu[i] > max_seq_len - past[i]:
            return CAPACITY, i, 0
        total += past[i] + (cu[i + 1] - cu[i])
    if total > _INT32_MAX:
        return TOTAL, total, 0
    return OK, 0, 0


@njit(cache=True)
def blocks_needed(slots, new_len, nblk, block_size, add):
    """``add[i] = max(ceil(new_len[i] / block_size) - nblk[slot_i], 0)``; returns the sum."""
    total = 0
    for i in range(slots.shape[0]):
        need = (new_len[i] + block_size - 1) // block_size - nblk[slots[i]]
        if need < 0:
            need = 0
        add[i] = need
        total += need
    return total


@njit(cache=True)
def step_blocks_needed(cu, past, slots, nblk, block_size, add):
    """:func:`blocks_needed` with ``new_len[i] = past[i] + cu[i + 1] - cu[i]``."""
    total = 0
    for i in range(slots.shape[0]):
        need = (past[i] + cu[i + 1] - cu[i] + block_size - 1) // block_size - nblk[slots[i]]
        if need < 0:
            need = 0
        add[i] = need
        total += need
    return total


@njit(cache=True)
def grow_rows(slots, add, blocks, table, nblk):
    """Append ``add[i]`` blocks of ``blocks`` (handed out in row order) to row ``slots[i]``."""
    k = 0
    for i in range(slots.shape[0]):
        s = slots[i]
        start = nblk[s]
        for j in range(add[i]):
            table[s, start + j] = blocks[k]
            k += 1
        nblk[s] = start + add[i]


def index_layout(n: int, t: int) -> tuple[int, int, int, int, int, int, int, int, int]:
    """Where ``build_indices`` puts each int32 ``StepIndices`` array of a step of ``n`` rows and ``t``
    tokens in its one buffer: the offsets of ``cu_k``, ``past``, ``used``, ``slot``, ``cross``,
    ``logits``, ``bi``, ``pos`` (``cu_q`` starts at 0), then the buffer's length. Plain Python for
    the caller's views, compiled below for the kernel: one layout."""
    o_cu_k = n + 1
    o_past = 2 * (n + 1)
    o_used = o_past + n
    o_slot = o_used + n
    o_cross = o_slot + n
    o_logits = o_cross + n
    o_bi = o_logits + n
    o_pos = o_bi + t
    return o_cu_k, o_past, o_used, o_slot, o_cross, o_logits, o_bi, o_pos, o_pos + t


_index_layout = njit(cache=True)(index_layout)


@njit(cache=True)
def build_indices(cu, past, slots, table, enc, block_size, max_seq_len, paged, out, sm, init, rows):
    """Write every ``StepIndices`` array of a validated step, in one pass.

    The outputs are preallocated by the caller with the dtypes of DESIGN §4.3
    (passing arrays in is cheap; returning a dozen arrays from Numba is
    not, and each argument costs its share of the dispatch): the int32
    arrays back to back in ``out`` (:func:`index_layout`), in the order
    ``cu_q`` ``[B+1]``, ``cu_k`` ``[B+1]``, ``past_o``, ``used``, ``slot_o``,
    ``cross``, ``logits`` ``[B]`` each, ``bi``, ``pos`` ``[T]`` each (the
    caller hands out views of it); ``sm`` int64 ``[T]``; ``init`` bool
    ``[B]``; ``rows`` int32 ``[B, max_blocks_per_seq]`` (``table[slots]``)
    when paged. Returns ``(max_seqlen_q, max_seqlen_k)``.
    """
    n = slots.shape[0]
    if paged:
        ncol = table.shape[1]
        for b in range(n):  # element loops (a row slice per b costs a view each)
            s = slots[b]
            for j in range(ncol):
                rows[b, j] = table[s, j]
    o_cu_k, o_past, o_used, o_slot, o_cross, o_logits, o_bi, o_pos, _ = _index_layout(n, cu[n])
    out[0] = 0
    out[o_cu_k] = 0
    max_q = 0
    max_k = 0
    acc = 0
    for b in range(n):
        lo = cu[b]
        hi = cu[b + 1]
        q = hi - lo
        p0 = past[b]
        s = slots[b]
        out[b + 1] = hi
        out[o_past + b] = p0
        out[o_used + b] = p0 + q
        acc += p0 + q
        out[o_cu_k + b + 1] = acc
        out[o_slot + b] = s
        init[b] = p0 > 0
        out[o_cross + b] = enc[s]
        out[o_logits + b] = hi - 1
        if q > max_q:
            max_q = q
        if p0 + q > max_k:
            max_k = p0 + q
        for t in range(lo, hi):
            p = p0 + (t - lo)
            out[o_bi + t] = b
            out[o_pos + t] = p
            if paged:
                sm[t] = np.int64(table[s, p // block_size]) * block_size + p % block_size
            else:
                sm[t] = np.int64(s) * max_seq_len + p
    return max_q, max_k


@njit(cache=True)
def plan_indices(cu, past, slots, seq, max_seqs, max_seq_len, mark, first, gen, nblk, block_size, add, table, enc,
                 paged, out, sm, init, rows):
    """``check_step``, then (``paged``) ``step_blocks_needed`` into ``add``, then, when no row needs a
    new block, ``build_indices`` into the caller's buffers: ``SlotEngine.plan_step`` in one dispatch.

    Returns ``(code, i, j, total, max_seqlen_q, max_seqlen_k)``: ``code != OK`` is the finding
    (nothing written but the scratch); ``total > 0`` means nothing was built.
    """
    code, i, j = check_step(cu, past, slots, seq, max_seqs, max_seq_len, mark, first, gen)
    if code != OK:
        return code, i, j, 0, 0, 0
    if paged:
        total = step_blocks_needed(cu, past, slots, nblk, block_size, add)
        if total:
            return code, 0, 0, total, 0, 0
    max_q, max_k = build_indices(cu, past, slots, table, enc, block_size, max_seq_len, paged, out, sm, init, rows)
    return code, 0, 0, 0, max_q, max_k
