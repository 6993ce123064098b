"""The fast slot cache ``KVCache`` (DESIGN §4, §7).

``kvfast.KVCache`` *is* a ``kvref.KVCache`` (a subclass) with the hot paths
replaced, so every observable result is the reference's by construction and
the differential suite checks the replaced parts:

* block bookkeeping on :class:`kvfast._block_pool.BlockPool` (intrusive
  int32 free list, O(1) per block);
* ``prepare_step`` / ``reserve`` validated and built by Numba kernels
  (:mod:`kvfast._numba.step`), no per-row or per-token Python loops;
* write sets kept as arrays and turned into sets only when
  ``check_invariants`` reads them.

``device="cuda[:N]"`` stores every buffer as a CuPy array (bfloat16 storage as
its uint16 bit patterns: CuPy has no bfloat16 dtype); without CuPy or a
visible GPU ``make`` raises ``RuntimeError`` saying so.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvref import _slot_cache as _ref
from kvref._slot_cache import _check_index, _int_vector  # the reference's argument checks (same messages)
from kvspec import CapacityError, KVCacheConfig, KVLayerSpec, StepIndices
from kvspec._config import parse_device

from ._block_pool import NULL_BLOCK, BlockPool

__all__ = ["KVCache"]


def _kernels():
    """The CPU step kernels (Numba compiles them on first use)."""
    from ._numba import step

    return step


def require_cuda(api: str, device_id: int):
    """CuPy, after checking that device ``device_id`` exists; ``RuntimeError`` otherwise."""
    try:
        import cupy as cp
    except ImportError:
        raise RuntimeError(
            f"{api}: device='cuda:{device_id}' needs CuPy and a GPU; CuPy is not installed "
            "(pip install 'kvcache[gpu]'), use device='cpu'"
        ) from None
    try:  # pragma: no cover - needs CuPy
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # pragma: no cover - needs CuPy
        raise RuntimeError(f"{api}: device='cuda:{device_id}' but no CUDA device is visible ({e})") from None
    if not 0 <= device_id < count:  # pragma: no cover - needs CuPy
        raise RuntimeError(f"{api}: device='cuda:{device_id}' but {count} CUDA device(s) are visible")
    return cp  # pragma: no cover - needs CuPy


class _WriteSets:
    """slot -> blocks of its last prepared, uncommitted step (the reference's ``_write_sets``).

    Steps are kept as arrays; a slot points at its step. ``pop`` is O(1);
    sets are built only by ``items()`` (``check_invariants``).
    """

    __slots__ = ("_step_of", "_steps", "_next")

    def __init__(self, max_seqs: int):
        self._step_of = np.full(max_seqs, -1, np.int64)
        self._steps: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._next = 0

    def record(self, slots: np.ndarray, blocks: np.ndarray, batch_indices: np.ndarray) -> None:
        sid = self._next
        self._next += 1
        self._steps[sid] = (slots, blocks, batch_indices)
        self._step_of[slots] = sid
        if len(self._steps) > 32:
            live = set(np.unique(self._step_of[self._step_of >= 0]).tolist())
            self._steps = {k: v for k, v in self._steps.items() if k in live}

    def pop(self, slot, default=None):
        self._step_of[slot] = -1
        return default

    def clear(self) -> None:
        self._step_of[:] = -1
        self._steps.clear()

    def items(self):
        out = []
        for s in np.flatnonzero(self._step_of >= 0).tolist():
            slots, blocks, bi = self._steps[int(self._step_of[s])]
            row = int(np.flatnonzero(slots == s)[0])
            out.append((s, frozenset(int(x) for x in blocks[bi == row])))
        return out

    def __len__(self) -> int:
        return int(np.count_nonzero(self._step_of >= 0))


class KVCache(_ref.KVCache):
    """Slot-indexed serving KV cache, contiguous or paged (DESIGN §4); the fast path.

    Same constructor (:meth:`make`), methods, results and errors as
    ``kvref.KVCache``; see there for the full semantics.

    Examples
    --------
    >>> from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec
    >>> cfg = KVCacheConfig(num_layers=1, max_seqs=2, max_seq_len=8,
    ...                     mode=KVCacheMode.PAGED, block_size=4)
    >>> cache = KVCache.make(cfg, [KVLayerSpec.attention(kv_heads=1, head_dim=2)])
    >>> cache.prepare_step([0, 3], [0], [1]).slot_mapping.tolist()
    [4, 5, 6]
    """

    @classmethod
    def make(cls, config: KVCacheConfig, layer_specs: Sequence[KVLayerSpec]) -> "KVCache":
        """Allocate a cache: every buffer once, all slots empty, all blocks free.

        Parameters
        ----------
        config : KVCacheConfig
            ``config.device`` is ``"cpu"`` (NumPy + Numba) or ``"cuda[:N]"`` (CuPy).
        layer_specs : sequence of KVLayerSpec
            One per layer.

        Raises
        ------
        TypeError
            ``config`` or a layer spec of the wrong type.
        ValueError
            Wrong number of layer specs.
        RuntimeError
            ``device="cuda"`` without CuPy or a visible GPU.
        """
        api = "KVCache.make"
        specs = _ref.check_make_args(api, config, layer_specs)
        kind, dev = parse_device(api, config.device)
        xp = require_cuda(api, dev) if kind == "cuda" else None
        self = object.__new__(cls)
        self._init_storage(config, specs)
        if xp is not None:  # pragma: no cover - needs a GPU
            self._to_device(xp, dev)
        return self

    def _init_storage(self, config: KVCacheConfig, specs: tuple[KVLayerSpec, ...]) -> None:
        super()._init_storage(config, specs)
        S = config.max_seqs
        if self._paged:
            # Spec §4.2: same allocation order as the reference pool, O(1) per block.
            self._pool = BlockPool(config.resolved_num_blocks, on_evict=self._on_evict)
        self._write_sets = _WriteSets(S)
        self._mark = np.zeros(S, np.int64)
        self._first = np.zeros(S, np.int32)
        self._gen = 0
        self._device = None

    def _to_device(self, xp, dev: int) -> None:  # pragma: no cover - needs a GPU
        """Move every storage buffer to GPU ``dev`` (bookkeeping stays on the host)."""
        def dev_array(a):
            # CuPy has no bfloat16: such storage lives as its uint16 bit patterns on the device.
            return xp.asarray(a.view(np.uint16) if a.dtype.name == "bfloat16" else a)

        with xp.cuda.Device(dev):
            self._kv = {l: (dev_array(k), dev_array(v)) for l, (k, v) in self._kv.items()}
            self._conv = {l: [dev_array(s) for s in slabs] for l, slabs in self._conv.items()}
            self._rec = {l: None if r is None else dev_array(r) for l, r in self._rec.items()}
        self._device = dev

    # ------------------------------------------------------------------ fast paths

    def _stamp(self) -> int:
        self._gen += 1
        return self._gen

    def _check_slots(self, api: str, slots: np.ndarray) -> None:
        k = _kernels()
        code, i, j = k.check_slots(slots, self._config.max_seqs, self._mark, self._first, self._stamp())
        self._raise_slot(api, code, slots, i, j)

    def _raise_slot(self, api, code, slots, i, j) -> None:
        k = _kernels()
        if code == k.SLOT_RANGE:
            raise IndexError(f"{api}: slot_ids[{i}]={slots[i]} out of range [0, {self._config.max_seqs})")
        if code == k.SLOT_DUP:
            raise ValueError(f"{api}: slot_ids[{i}]={slots[i]} duplicates slot_ids[{j}]")

    def _grow(self, api: str, slots: np.ndarray, add: np.ndarray) -> None:
        """All-or-nothing: append ``add[i]`` fresh blocks to row ``slots[i]``, rows in order."""
        total = int(add.sum())
        free = self._pool.num_free
        if total > free:
            raise CapacityError(f"{api}: needs {total} blocks, {free} free or evictable")
        # Spec §5: one pop from the front for the whole step, handed out in row order.
        blocks = self._pool.allocate_array(total)
        _kernels().grow_rows(slots, np.asarray(add, np.int64), blocks, self._table, self._nblk)

    def _release(self, b: int) -> None:
        if self._paged:
            n = int(self._nblk[b])
            # Spec §5: release tail first, so a chain's tail is evicted before its head.
            self._pool.free(self._table[b, :n][::-1])
            self._table[b, :] = NULL_BLOCK
            self._nblk[b] = 0
        super()._release(b)

    def prepare_step(self, cu_seqlens_q, past_len, slot_ids) -> StepIndices:
        """Validate a step, reserve its blocks (paged, all or nothing) and return its indices.

        Same contract as ``kvref.KVCache.prepare_step`` (does not advance
        ``seq_lens()``).

        Parameters
        ----------
        cu_seqlens_q : int [B+1]
            Query offsets; ``cu_seqlens_q[0] == 0``, strictly increasing.
        past_len : int [B]
            Cached length per row; equals ``seq_lens()[slot_ids]``.
        slot_ids : int [B]
            Distinct slots in ``[0, max_seqs)``.

        Returns
        -------
        StepIndices

        Raises
        ------
        TypeError, ValueError, IndexError, CapacityError
            As the reference, same messages; state is unchanged.
        """
        api = "prepare_step"
        k = _kernels()
        cu = _int_vector(api, "cu_seqlens_q", cu_seqlens_q)
        past = _int_vector(api, "past_len", past_len)
        slots = _int_vector(api, "slot_ids", slot_ids)
        B = slots.shape[0]
        if cu.shape[0] != B + 1:
            raise ValueError(f"{api}: len(cu_seqlens_q)={cu.shape[0]} != len(slot_ids)+1={B + 1}")
        if past.shape[0] != B:
            raise ValueError(f"{api}: len(past_len)={past.shape[0]} != len(slot_ids)={B}")
        L = self._config.max_seq_len
        code, i, j = k.check_step(cu, past, slots, self._seq, self._config.max_seqs, L, self._mark, self._first,
                                  self._stamp())
        if code != k.OK:
            self._raise_step(api, code, cu, past, slots, i, j)
        bs = self._config.block_size
        if self._paged:
            add = np.empty(B, np.int64)
            total = k.blocks_needed(slots, past + (cu[1:] - cu[:-1]), self._nblk, bs, add)
            if total:
                self._grow(api, slots, add)
        table = self._table if self._paged else np.zeros((1, 1), np.int32)
        cu_q, past_o, used, cu_k, slot_o, bi, pos, sm, init, cross, logits, max_q, max_k = k.build_indices(
            cu, past, slots, table, self._enc, bs, L, self._paged
        )
        rows = np.ascontiguousarray(self._table[slots]) if self._paged else None
        step = StepIndices(
            cu_seqlens_q=cu_q, past_len=past_o, seqused_k=used, cu_seqlens_k=cu_k,
            max_seqlen_q=int(max_q), max_seqlen_k=int(max_k), slot_ids=slot_o, batch_indices=bi,
            positions=pos, slot_mapping=sm, block_table=rows, has_initial_state=init,
            cross_seqused_k=cross, logits_indices=logits,
        )
        if self._paged:
            self._write_sets.record(slot_o, sm // bs, bi)
        if self._device is not None:  # pragma: no cover - needs a GPU
            step = self._step_to_device(step)
        return step

    def _raise_step(self, api, code, cu, past, slots, i, j) -> None:
        k = _kernels()
        if code == k.CU0:
            raise ValueError(f"{api}: cu_seqlens_q[0]={cu[0]}, must be 0")
        if code == k.NOT_INCREASING:
            raise ValueError(
                f"{api}: cu_seqlens_q[{i}]={cu[i]} <= cu_seqlens_q[{i - 1}]={cu[i - 1]}, must be strictly increasing"
            )
        self._raise_slot(api, code, slots, i, j)
        if code == k.PAST_MISMATCH:
            s = int(slots[i])
            raise ValueError(f"{api}: past_len[{i}]={past[i]} but seq_lens()[slot {s}]={int(self._seq[s])}")
        if code == k.TOTAL:
            raise CapacityError(f"{api}: sum(past_len+q_len)={i} > {2**31 - 1} (int32 cu_seqlens_k)")
        p, q = int(past[i]), int(cu[i + 1]) - int(cu[i])
        raise CapacityError(f"{api}: past_len[{i}]+q_len[{i}]={p}+{q}={p + q} > max_seq_len={self._config.max_seq_len}")

    def _step_to_device(self, step: StepIndices) -> StepIndices:  # pragma: no cover - needs a GPU
        import dataclasses

        import cupy as cp

        with cp.cuda.Device(self._device):
            moved = {
                f.name: (cp.asarray(getattr(step, f.name)) if isinstance(getattr(step, f.name), np.ndarray)
                         else getattr(step, f.name))
                for f in dataclasses.fields(step)
            }
        return StepIndices(**moved)

    def _blocks_needed(self, slots: np.ndarray, new_len: np.ndarray) -> np.ndarray:
        add = np.empty(slots.shape[0], np.int64)
        _kernels().blocks_needed(slots, np.asarray(new_len, np.int64), self._nblk, self._config.block_size, add)
        return add
