"""The reference slot-cache engine (``kvspec.engine.SlotEngine``, ``spec/slot-cache.md`` §9).

NumPy and plain Python loops: each mechanism written the way the spec states
it. The policy that calls it is ``kvref.KVCache`` (``_slot_cache.py``) and
``kvref.ops``; ``kvfast`` runs the same policy on a faster engine.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from kvspec import LayerKind, StepIndices
from kvspec._dtypes import dtype_name, fp8_scale
from kvspec._interop import host_array
from kvspec.engine import (
    STEP_CAPACITY, STEP_CU0, STEP_NOT_INCREASING, STEP_OK, STEP_PAST_MISMATCH, STEP_SLOT_DUP, STEP_SLOT_RANGE,
    STEP_TOTAL, StepCheck,
)

from ._block_pool import BlockPool

__all__ = ["ReferenceSlotEngine", "build_step_indices"]

_INT32_MAX = 2**31 - 1


def build_step_indices(
    cu_seqlens_q: np.ndarray,
    past_len: np.ndarray,
    slot_ids: np.ndarray,
    *,
    max_seq_len: int,
    block_size: int,
    block_table: np.ndarray | None,
    enc_lens: np.ndarray,
) -> StepIndices:
    """``StepIndices`` from validated host arrays (``spec/slot-cache.md`` §3).

    Parameters
    ----------
    cu_seqlens_q : int [B+1]
        Query offsets, validated: ``cu[0] == 0``, strictly increasing.
    past_len : int [B]
        Cached tokens per row (already checked against ``seq_lens()``).
    slot_ids : int [B]
        Distinct slots in range.
    max_seq_len, block_size : int
        Geometry of the cache.
    block_table : int32 [max_seqs, max_blocks_per_seq] or None
        The paged block table **after** this step's reservation; None when
        contiguous.
    enc_lens : int [max_seqs]
        Encoder length of every slot.

    Returns
    -------
    StepIndices
        Dtypes per DESIGN §4.3 (int32 indices, int64 ``slot_mapping``,
        bool ``has_initial_state``).
    """
    cu = np.asarray(cu_seqlens_q, dtype=np.int64)
    past = np.asarray(past_len, dtype=np.int64)
    slots = np.asarray(slot_ids, dtype=np.int64)
    q_len = np.diff(cu)
    num_rows = int(slots.shape[0])
    seqused_k = past + q_len
    cu_k = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(seqused_k, out=cu_k[1:])
    batch_indices = np.repeat(np.arange(num_rows, dtype=np.int64), q_len)
    # positions[t] = past[b] + (t - cu[b]) for the row b that owns token t
    positions = past[batch_indices] + (np.arange(int(cu[-1]), dtype=np.int64) - cu[:-1][batch_indices])
    token_slots = slots[batch_indices]
    if block_table is None:
        slot_mapping = token_slots * max_seq_len + positions
        rows = None
    else:
        cols = positions // block_size
        slot_mapping = block_table[token_slots, cols].astype(np.int64) * block_size + positions % block_size
        rows = np.ascontiguousarray(block_table[slots], dtype=np.int32)
    return StepIndices(
        cu_seqlens_q=cu.astype(np.int32),
        past_len=past.astype(np.int32),
        seqused_k=seqused_k.astype(np.int32),
        cu_seqlens_k=cu_k.astype(np.int32),
        max_seqlen_q=int(q_len.max()) if num_rows else 0,
        max_seqlen_k=int(seqused_k.max()) if num_rows else 0,
        slot_ids=slots.astype(np.int32),
        batch_indices=batch_indices.astype(np.int32),
        positions=positions.astype(np.int32),
        slot_mapping=slot_mapping.astype(np.int64),
        block_table=rows,
        has_initial_state=past > 0,
        cross_seqused_k=np.asarray(enc_lens, dtype=np.int64)[slots].astype(np.int32),
        logits_indices=(cu[1:] - 1).astype(np.int32),
    )


class FrozenWriteSets:
    """slot -> frozenset of the blocks its last prepared step writes (``WriteSets``)."""

    def __init__(self) -> None:
        self._sets: dict[int, frozenset[int]] = {}

    def record(self, slot_ids: np.ndarray, step: StepIndices, block_size: int) -> None:
        blocks = step.slot_mapping // block_size
        rows = step.batch_indices
        for i, s in enumerate(slot_ids.tolist()):
            self._sets[s] = frozenset(int(x) for x in blocks[rows == i])

    def pop(self, slot: int) -> None:
        self._sets.pop(slot, None)

    def clear(self) -> None:
        self._sets.clear()

    def items(self):
        return list(self._sets.items())

    def __setitem__(self, slot: int, blocks) -> None:  # tests plant a write set by hand
        self._sets[int(slot)] = frozenset(blocks)


class ReferenceSlotEngine:
    """NumPy storage and Python-loop mechanisms on the CPU (the readable definition).

    Implements ``kvspec.engine.SlotEngine``; see there for each method's contract.
    """

    device = "cpu"

    # ------------------------------------------------------------------ storage and bookkeeping

    def zeros(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        return np.zeros(shape, dtype)

    def block_pool(self, num_blocks: int, on_evict: Callable[[bytes], None]):
        return BlockPool(num_blocks, on_evict=on_evict)

    def write_sets(self, max_seqs: int) -> FrozenWriteSets:
        return FrozenWriteSets()

    # ------------------------------------------------------------------ validation (finders)

    def check_slots(self, slot_ids: np.ndarray, max_seqs: int) -> StepCheck:
        seen: dict[int, int] = {}
        for i, s in enumerate(slot_ids.tolist()):
            if not 0 <= s < max_seqs:
                return STEP_SLOT_RANGE, i, 0
            if s in seen:
                return STEP_SLOT_DUP, i, seen[s]
            seen[s] = i
        return STEP_OK, 0, 0

    def check_step(self, cu_seqlens_q, past_len, slot_ids, seq_lens, max_seqs: int, max_seq_len: int) -> StepCheck:
        cu, past = cu_seqlens_q.tolist(), past_len.tolist()
        if cu[0] != 0:
            return STEP_CU0, 0, 0
        for i in range(1, len(cu)):
            if cu[i] <= cu[i - 1]:
                return STEP_NOT_INCREASING, i, 0
        found = self.check_slots(slot_ids, max_seqs)
        if found[0] != STEP_OK:
            return found
        for i, s in enumerate(slot_ids.tolist()):
            if past[i] != seq_lens[s]:
                return STEP_PAST_MISMATCH, i, 0
        total = 0
        for i, p in enumerate(past):
            q = cu[i + 1] - cu[i]
            if q > max_seq_len - p:  # 0 <= p <= max_seq_len here: nothing can wrap
                return STEP_CAPACITY, i, 0
            total += p + q
        if total > _INT32_MAX:
            return STEP_TOTAL, total, 0
        return STEP_OK, 0, 0

    # ------------------------------------------------------------------ reservation

    def blocks_needed(self, slot_ids, new_len, nblk, block_size: int) -> tuple[np.ndarray, int]:
        need = -(-np.asarray(new_len, np.int64) // block_size)  # ceil
        add = np.maximum(need - nblk[slot_ids], 0)
        return add, int(add.sum())

    def step_blocks_needed(self, cu_seqlens_q, past_len, slot_ids, nblk, block_size: int) -> tuple[np.ndarray, int]:
        return self.blocks_needed(slot_ids, past_len + np.diff(cu_seqlens_q), nblk, block_size)

    def grow_rows(self, pool, slot_ids, add, total: int, table, nblk) -> np.ndarray:
        blocks = pool.allocate(total)
        i = 0
        for s, n in zip(slot_ids.tolist(), add.tolist()):
            start = int(nblk[s])
            table[s, start : start + n] = blocks[i : i + n]
            nblk[s] = start + n
            i += n
        return np.asarray(blocks, dtype=np.int64)

    def release_blocks(self, pool, blocks) -> None:
        pool.free([int(b) for b in blocks])

    # ------------------------------------------------------------------ step indices

    def build_step(self, cu_seqlens_q, past_len, slot_ids, table, enc_lens, block_size: int,
                   max_seq_len: int) -> StepIndices:
        return build_step_indices(cu_seqlens_q, past_len, slot_ids, max_seq_len=max_seq_len,
                                  block_size=block_size, block_table=table, enc_lens=enc_lens)

    def plan_step(self, cu_seqlens_q, past_len, slot_ids, seq_lens, nblk, table, enc_lens, max_seqs: int,
                  max_seq_len: int, block_size: int):
        code, i, j = self.check_step(cu_seqlens_q, past_len, slot_ids, seq_lens, max_seqs, max_seq_len)
        if code != STEP_OK:
            return code, i, j, None, 0, None
        add, total = None, 0
        if table is not None:
            add, total = self.step_blocks_needed(cu_seqlens_q, past_len, slot_ids, nblk, block_size)
            if total:
                return code, 0, 0, add, total, None
        step = self.build_step(cu_seqlens_q, past_len, slot_ids, table, enc_lens, block_size, max_seq_len)
        return code, 0, 0, add, total, step

    # ------------------------------------------------------------------ copy kernels (ops)

    def kv_input(self, api: str, name: str, x, storage_dtype, logical_dtype: str):
        # torch tensors (bfloat16 included) through DLPack, without a copy (kvspec._interop).
        return x if isinstance(x, np.ndarray) else host_array(x)

    def scatter_kv(self, K, V, k, v, slot_mapping) -> int:
        rows = K.shape[0] * K.shape[1]
        sm = np.asarray(slot_mapping, dtype=np.int64)
        over = np.flatnonzero(sm >= rows)
        if over.size:
            return int(over[0])
        keep = sm >= 0
        Kf = K.reshape(rows, *K.shape[2:])  # a view: writes land in the cache
        Vf = V.reshape(rows, *V.shape[2:])
        Kf[sm[keep]] = k[keep]
        Vf[sm[keep]] = v[keep]
        return -1

    def gather_kv(self, K, V, slot: int, n: int, block_row, block_size: int):
        if block_row is None:
            return K[slot, :n].copy(), V[slot, :n].copy()
        pos = np.arange(n)
        flat = np.asarray(block_row, dtype=np.int64)[pos // block_size] * block_size + pos % block_size
        return K.reshape(-1, *K.shape[2:])[flat], V.reshape(-1, *V.shape[2:])[flat]

    def fill_plane(self, K, slot: int, k) -> None:
        t = k.shape[0]
        K[slot, :t] = k
        K[slot, t:] = 0

    def attend(self, q, K, V, kind, window: int, step: StepIndices, block_size, scale: float, kv_scales=None,
               softcap: float = 0.0, sinks=None):
        out = np.zeros(q.shape, np.float32)
        cu = np.asarray(step.cu_seqlens_q, dtype=np.int64)
        for b in range(step.num_seqs):
            slot = int(step.slot_ids[b])
            lo, hi = int(cu[b]), int(cu[b + 1])
            if kind is LayerKind.CROSS_ATTENTION:
                n = int(step.cross_seqused_k[b])
                k, v = self._gather_any(K, V, slot, n, None, 0, kv_scales)
                mask = np.ones((hi - lo, n), bool)
            else:
                n = int(step.seqused_k[b])
                row = None if block_size is None else step.block_table[b]
                k, v = self._gather_any(K, V, slot, n, row, block_size or 0, kv_scales)
                pos = int(step.past_len[b]) + np.arange(hi - lo)[:, None]
                key = np.arange(n)[None, :]
                mask = key <= pos
                if kind is LayerKind.SLIDING_WINDOW:
                    mask &= key > pos - window
            out[lo:hi] = softmax_attend(q[lo:hi], k, v, mask, scale, softcap, sinks)
        return out

    def _gather_any(self, K, V, slot, n, row, block_size, kv_scales):
        if kv_scales is None:
            return self.gather_kv(K, V, slot, n, row, block_size)
        Ks, Vs, unit = kv_scales
        return self.gather_kv_fp8(K, V, Ks, Vs, slot, n, row, block_size, unit)

    def to_host(self, x) -> np.ndarray:
        return np.asarray(x)

    # ------------------------------------------------------------------ FP8 K/V (spec/slot-cache.md §10)

    def kv_input_float32(self, api: str, name: str, x):
        x = x if isinstance(x, np.ndarray) else host_array(x)
        if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
            raise TypeError(f"{api}: {name} dtype={x.dtype}, must be a floating type")
        return x.astype(np.float32, copy=False)

    def first_nonfinite(self, x) -> int:
        bad = np.flatnonzero(~np.isfinite(x).reshape(x.shape[0], -1).all(axis=1))
        return int(bad[0]) if bad.size else -1

    def zero_index_rows(self, buffers, rows) -> None:
        rows = np.asarray(rows, dtype=np.int64)
        for buf in buffers:
            buf[rows] = 0

    def scatter_kv_fp8(self, K, V, Ks, Vs, k, v, slot_mapping, unit: int) -> int:
        A, Bd, H, D = K.shape
        rows = A * Bd
        sm = np.asarray(slot_mapping, dtype=np.int64)
        over = np.flatnonzero(sm >= rows)
        if over.size:
            return int(over[0])
        name = dtype_name(K.dtype)
        upb = -(-Bd // unit)  # scale units per storage block (1 when paged)
        toks = np.flatnonzero(sm >= 0).tolist()
        units = (sm // Bd) * upb + (sm % Bd) // unit
        for X, S, x in ((K, Ks, k), (V, Vs, v)):
            Xf = X.reshape(rows, H, D)  # views: writes land in the cache
            Sf = S.reshape(A * upb, H)
            # 1. the scale every touched unit-head needs: the old one or the new tokens' (the larger)
            new = {}
            for t in toks:
                u = int(units[t])
                need = fp8_scale(np.abs(x[t]).max(axis=-1), name)
                new[u] = np.maximum(new.get(u, Sf[u]), need)
            # 2. a unit-head whose scale grows is re-quantised to the new scale (0 -> unwritten: zeroed)
            for u, s_new in new.items():
                a, j = divmod(u, upb)
                r0, r1 = a * Bd + j * unit, a * Bd + min((j + 1) * unit, Bd)
                for h in np.flatnonzero(s_new > Sf[u]).tolist():
                    if Sf[u, h] == 0:
                        Xf[r0:r1, h] = 0
                    else:
                        ratio = np.float32(Sf[u, h]) / np.float32(s_new[h])
                        Xf[r0:r1, h] = (Xf[r0:r1, h].astype(np.float32) * ratio).astype(X.dtype)
                    Sf[u, h] = s_new[h]
            # 3. the new tokens, quantised with their unit's scale
            for t in toks:
                Xf[sm[t]] = (x[t] / Sf[units[t]][:, None]).astype(X.dtype)
        return -1

    def gather_kv_fp8(self, K, V, Ks, Vs, slot: int, n: int, block_row, block_size: int, unit: int):
        k, v = self.gather_kv(K, V, slot, n, block_row, block_size)
        Bd = K.shape[1]
        upb = -(-Bd // unit)
        pos = np.arange(n)
        if block_row is None:
            units = slot * upb + pos // unit
        else:
            units = np.asarray(block_row, dtype=np.int64)[pos // block_size] * upb + (pos % block_size) // unit
        H = K.shape[2]
        ks = Ks.reshape(-1, H)[units][:, :, None]
        vs = Vs.reshape(-1, H)[units][:, :, None]
        return k.astype(np.float32) * ks, v.astype(np.float32) * vs

    # ------------------------------------------------------------------ slot rows (state, cross planes)

    def zero_rows(self, buffers, slot: int) -> None:
        for buf in buffers:
            buf[slot] = 0

    def save_rows(self, buffers, slot: int) -> list:
        return [buf[slot].copy() for buf in buffers]

    def restore_rows(self, buffers, slot: int, saved) -> None:
        for buf, row in zip(buffers, saved):
            buf[slot] = row


def softmax_attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float,
                   softcap: float = 0.0, sinks: np.ndarray | None = None) -> np.ndarray:
    """float32 attention of q [Tq, Hq, D] over k, v [Tk, Hk, D] with bool mask [Tq, Tk] (GQA by repeat).

    ``softcap > 0`` caps every scaled score ``s`` to ``softcap * tanh(s / softcap)``; ``sinks``
    (float32 ``[Hq]``) adds one value-less logit per query head to each softmax denominator
    (spec/slot-cache.md §7.3). A query that sees no key gives zeros.
    """
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k.astype(np.float32), group, axis=1)
    v = np.repeat(v.astype(np.float32), group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q.astype(np.float32), k) * np.float32(scale)
    return softmax_values(scores, mask[None], v, softcap, sinks)


def softmax_values(scores: np.ndarray, mask: np.ndarray, v: np.ndarray, softcap: float,
                           sinks: np.ndarray | None) -> np.ndarray:
    """``softmax(scores) @ v`` over the allowed keys, float32: ``scores`` ``[H, Tq, Tk]`` (scaled),
    ``mask`` bool broadcasting to it, ``v`` ``[Tk, H, D]``; soft-capped and with sink logits as
    :func:`softmax_attend` says; rows that see no key are zeros."""
    if softcap:
        c = np.float32(softcap)
        scores = c * np.tanh(scores / c)
    seen = mask.any(axis=-1, keepdims=True)
    m = np.where(mask, scores, -np.inf).max(axis=-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, sinks.astype(np.float32)[:, None, None])
    m = np.where(seen, m, np.float32(0))
    w = np.where(mask, np.exp(scores - m), np.float32(0)).astype(np.float32)
    total = w.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sinks.astype(np.float32)[:, None, None] - m)
    w = np.where(seen, w / np.where(total > 0, total, 1), np.float32(0))
    return np.einsum("hqk,khd->qhd", w, v).astype(np.float32)
