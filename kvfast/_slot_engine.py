"""The fast slot-cache engines (``kvspec.engine.SlotEngine``, ``spec/slot-cache.md`` §9).

``kvfast.KVCache`` runs kvref's policy (``kvref.KVCache``) on one of these,
chosen once at ``make`` from ``config.device``:

* :class:`FastSlotEngine` (``"cpu"``): the intrusive int32 block pool
  (:mod:`kvfast._block_pool`), step validation, block growth and step-index
  construction as Numba kernels (:mod:`kvfast._numba.step`, one call each
  per step, no per-row or per-token Python work), K/V scatter and gather as
  ``memcpy`` kernels over word views (:mod:`kvfast._numba.copy`), write sets
  kept as the step's arrays; the FP8 quantising append as the Numba twin of
  ``append_kv_fp8.cu`` (:mod:`kvfast._numba.fp8`, ``spec/slot-cache.md`` §10);
* :class:`CudaSlotEngine` (``"cuda:N"``): the same bookkeeping on the host,
  storage and ``StepIndices`` as CuPy arrays (bfloat16 as its uint16 bits),
  ``append_kv.cu`` / ``gather_kv.cu`` RawKernels (FP8: ``append_kv_fp8.cu``,
  storage as uint8 bit patterns), attention from CuPy array operations.

Both subclass the public ``kvref.ReferenceSlotEngine`` only to inherit the
FP8 caches' dequantised float32 attention on the CPU (the oracle's, so results
are equal bit for bit, spec/slot-cache.md §10.3); every other mechanism is
overridden here, attention over float16 / bfloat16 / float32 storage included
(:mod:`kvfast._numba.attend`: the same float32 formula, sums in another order).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import deque
from itertools import repeat
from operator import itemgetter
from typing import Callable

import numpy as np

from kvref import ReferenceSlotEngine
from kvspec import LayerKind, StepIndices
from kvspec._dtypes import FP8_DTYPES, dtype_name, fp8_decode_table
from kvspec.engine import STEP_OK

from ._block_pool import BlockPool

__all__ = ["FastSlotEngine", "CudaSlotEngine", "ArrayWriteSets", "require_cuda"]


def _step():
    """The CPU step kernels (Numba compiles them on first use)."""
    from ._numba import step

    return step


def _copy():
    """The CPU copy kernels (Numba compiles them on first use)."""
    from ._numba import copy

    return copy


def _fp8():
    """The CPU quantising append (Numba compiles it on first use)."""
    from ._numba import fp8

    return fp8


_NO_BLOCK_TABLE = np.zeros((1, 1), np.int32)        # a dense plane: no block table
_NO_SINKS = np.zeros(1, np.float32)                 # no sink logits (not read)


def require_cuda(api: str, device_id: int):
    """CuPy, after checking that device ``device_id`` exists; ``RuntimeError`` otherwise."""
    from ._cuda._module import cupy  # the one place kvfast imports CuPy (or its KVFAST_CUDA_EMULATE stand-in)

    try:
        cp = cupy()
    except RuntimeError:
        raise RuntimeError(
            f"{api}: device='cuda:{device_id}' needs CuPy and a GPU; CuPy is not installed "
            "(pip install 'kvcache[gpu]'), use device='cpu'"
        ) from None
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # pragma: no cover - a CuPy without a driver
        raise RuntimeError(f"{api}: device='cuda:{device_id}' but no CUDA device is visible ({e})") from None
    if not 0 <= device_id < count:
        raise RuntimeError(f"{api}: device='cuda:{device_id}' but {count} CUDA device(s) are visible")
    return cp


#: The slots of ``StepIndices`` (a frozen, slotted dataclass without ``__post_init__``), in field
#: order, and their descriptors' setter (one for every member descriptor).
_STEP_SLOTS = tuple(getattr(StepIndices, f.name) for f in dataclasses.fields(StepIndices))
_SET_SLOT = type(_STEP_SLOTS[0]).__set__
#: Runs an iterator of side effects to its end at C speed.
_consume = deque(maxlen=0).extend


def _step_indices(*values) -> StepIndices:
    """``StepIndices(*values)``, each slot set through its descriptor in one C-level loop: the
    dataclass's generated ``__init__`` sets the fourteen frozen fields with ``object.__setattr__``
    (the object is the same; assignments still raise ``FrozenInstanceError``;
    tests/test_slot_engine.py compares the two)."""
    step = object.__new__(StepIndices)
    _consume(map(_SET_SLOT, _STEP_SLOTS, repeat(step), values))
    return step


@functools.lru_cache(maxsize=1024)
def _index_views(n: int, t: int) -> tuple[Callable, int]:
    """The nine int32 ``StepIndices`` arrays of a step of ``n`` rows and ``t`` tokens as views of
    ``build_indices``' one buffer (``step.index_layout``): a getter of the nine slices, in the
    buffer's order (``cu_q``, ``cu_k``, ``past``, ``used``, ``slot``, ``cross``, ``logits``, ``bi``,
    ``pos``), and the buffer's length. Cached per shape, so a step of a seen shape slices in C."""
    *ends, size = _step().index_layout(n, t)
    bounds = [0, *ends, size]
    return itemgetter(*(slice(a, b) for a, b in zip(bounds, bounds[1:]))), size


def _host_step(views, max_q: int, max_k: int, slot_mapping, block_table, has_initial_state) -> StepIndices:
    """``StepIndices`` of ``build_indices``' outputs (``views``: :func:`_index_views`' nine arrays)."""
    cu_q, cu_k, past_o, used, slot_o, cross, logits, bi, pos = views
    # (StepIndices' field order: cu_seqlens_q, past_len, seqused_k, cu_seqlens_k, max_seqlen_q,
    # max_seqlen_k, slot_ids, batch_indices, positions, slot_mapping, block_table, has_initial_state,
    # cross_seqused_k, logits_indices)
    return _step_indices(cu_q, past_o, used, cu_k, max_q, max_k, slot_o, bi, pos, slot_mapping, block_table,
                         has_initial_state, cross, logits)


class ArrayWriteSets:
    """slot -> blocks of its last prepared, uncommitted step (``kvspec.engine.WriteSets``).

    A step is kept as its arrays and a slot points at its step: ``record`` and
    ``pop`` are O(1) per step; sets are built only by ``items()`` (``check_invariants``).
    """

    __slots__ = ("_step_of", "_steps", "_next", "_to_host")

    def __init__(self, max_seqs: int, to_host=np.asarray):
        self._step_of = np.full(max_seqs, -1, np.int64)
        self._steps: dict[int, tuple] = {}
        self._next = 0
        self._to_host = to_host

    def record(self, slot_ids: np.ndarray, step: StepIndices, block_size: int) -> None:
        sid = self._next
        self._next = sid + 1
        self._steps[sid] = (step, block_size)   # the step's own arrays (its slot_ids: a copy of slot_ids)
        if slot_ids.shape[0] == 1:  # a one-row step (decode of one request): a scalar store
            self._step_of[slot_ids[0]] = sid
        else:
            self._step_of[slot_ids] = sid
        if len(self._steps) > 32:
            live = set(np.unique(self._step_of[self._step_of >= 0]).tolist())
            self._steps = {k: v for k, v in self._steps.items() if k in live}

    def pop(self, slot: int) -> None:
        self._step_of[slot] = -1

    def clear(self) -> None:
        self._step_of[:] = -1
        self._steps.clear()

    def items(self):
        out = []
        host = self._to_host
        for s in np.flatnonzero(self._step_of >= 0).tolist():
            step, bs = self._steps[int(self._step_of[s])]
            row = int(np.flatnonzero(host(step.slot_ids) == s)[0])
            blocks = host(step.slot_mapping) // bs
            out.append((s, frozenset(int(x) for x in blocks[host(step.batch_indices) == row])))
        return out


class FastSlotEngine(ReferenceSlotEngine):
    """NumPy storage and Numba mechanisms on the CPU.

    Parameters
    ----------
    max_seqs : int
        Slots of the cache (sizes the duplicate-slot scratch).
    parallel_scatter : bool, optional
        Scatter steps of many short runs over both cores (``prange``); ``None``
        takes ``KVFAST_PARALLEL_SCATTER`` (off unless ``"1"``). Fixed here, for
        the engine's life.
    """

    device = "cpu"

    def __init__(self, max_seqs: int, parallel_scatter: bool | None = None):
        #: scratch of the duplicate-slot check: a slot is seen in this call iff mark[s] == the call's stamp
        self._mark = np.zeros(max_seqs, np.int64)
        self._first = np.zeros(max_seqs, np.int32)
        self._gen = 0
        #: id(storage buffer) -> (buffer, flat word view, word dtype, rows, block_size, block_stride, row_stride)
        self._views: dict[int, tuple] = {}
        self._empty_table = np.zeros((1, 1), np.int32)
        #: (id(K), id(V)) -> (K, V, K words, V words, word, rows, block_size, block_stride, row_stride)
        self._pairs: dict[tuple[int, int], tuple] = {}
        #: (id(K), id(V)) -> (K, V, flat K [rows, heads, dim], flat V, value table) of ``attend`` (float32
        #: storage as is, 16-bit storage as its words)
        self._attend_views: dict[tuple[int, int], tuple] = {}
        #: FP8 dtype name -> the float32 value of every bit pattern, on this engine's device (made on first use)
        self._fp8_tables: dict[str, object] = {}
        #: the Numba step and copy kernels, bound once (compiled or loaded from the on-disk cache on first use)
        self._k = _step()
        self._c = _copy()
        if parallel_scatter is None:
            self._parallel_runs = self._c.PARALLEL_RUNS
        else:
            self._parallel_runs = self._c.PARALLEL_RUNS_ON if parallel_scatter else self._c.PARALLEL_RUNS_OFF

    # ------------------------------------------------------------------ storage and bookkeeping

    def block_pool(self, num_blocks: int, on_evict):
        return BlockPool(num_blocks, on_evict=on_evict)

    def write_sets(self, max_seqs: int) -> ArrayWriteSets:
        return ArrayWriteSets(max_seqs)

    # ------------------------------------------------------------------ validation (finders)

    def _stamp(self) -> int:
        self._gen += 1
        return self._gen

    def check_slots(self, slot_ids, max_seqs: int):
        return self._k.check_slots(slot_ids, max_seqs, self._mark, self._first, self._stamp())

    def check_step(self, cu_seqlens_q, past_len, slot_ids, seq_lens, max_seqs: int, max_seq_len: int):
        return self._k.check_step(cu_seqlens_q, past_len, slot_ids, seq_lens, max_seqs, max_seq_len, self._mark,
                                  self._first, self._stamp())

    # ------------------------------------------------------------------ reservation

    def blocks_needed(self, slot_ids, new_len, nblk, block_size: int):
        add = np.empty(slot_ids.shape[0], np.int64)
        total = self._k.blocks_needed(slot_ids, np.asarray(new_len, np.int64), nblk, block_size, add)
        return add, int(total)

    def step_blocks_needed(self, cu_seqlens_q, past_len, slot_ids, nblk, block_size: int):
        add = np.empty(slot_ids.shape[0], np.int64)
        total = self._k.step_blocks_needed(cu_seqlens_q, past_len, slot_ids, nblk, block_size, add)
        return add, int(total)

    def grow_rows(self, pool, slot_ids, add, total: int, table, nblk) -> np.ndarray:
        blocks = pool.allocate_array(total)
        self._k.grow_rows(slot_ids, add, blocks, table, nblk)
        return blocks

    def release_blocks(self, pool, blocks) -> None:
        pool.free(blocks)

    # ------------------------------------------------------------------ step indices

    def build_step(self, cu_seqlens_q, past_len, slot_ids, table, enc_lens, block_size: int,
                   max_seq_len: int) -> StepIndices:
        paged = table is not None
        n, t = slot_ids.shape[0], int(cu_seqlens_q[-1])
        views, out, sm, init, rows = self._step_buffers(n, t, table)
        max_q, max_k = self._k.build_indices(
            cu_seqlens_q, past_len, slot_ids, table if paged else self._empty_table, enc_lens, block_size,
            max_seq_len, paged, out, sm, init, rows)
        return self._device_step(_host_step(views(out), max_q, max_k, sm, rows if paged else None, init))

    def plan_step(self, cu_seqlens_q, past_len, slot_ids, seq_lens, nblk, table, enc_lens, max_seqs: int,
                  max_seq_len: int, block_size: int):
        n, t = slot_ids.shape[0], int(cu_seqlens_q[-1])
        if not 0 < t <= n * max_seq_len:
            # no valid step of rows has this many tokens (each row adds at most max_seq_len), or there
            # are no rows: nothing to size buffers by, the composed calls find the offender
            return ReferenceSlotEngine.plan_step(self, cu_seqlens_q, past_len, slot_ids, seq_lens, nblk, table,
                                                 enc_lens, max_seqs, max_seq_len, block_size)
        paged = table is not None
        views, out, sm, init, rows = self._step_buffers(n, t, table)
        add = np.empty(n, np.int64)
        self._gen += 1
        code, i, j, total, max_q, max_k = self._k.plan_indices(
            cu_seqlens_q, past_len, slot_ids, seq_lens, max_seqs, max_seq_len, self._mark, self._first, self._gen,
            nblk, block_size, add, table if paged else self._empty_table, enc_lens, paged, out, sm, init, rows)
        if code != STEP_OK:
            return code, i, j, None, 0, None
        if total:
            return code, 0, 0, add, total, None
        step = _host_step(views(out), max_q, max_k, sm, rows if paged else None, init)
        return code, 0, 0, add if paged else None, 0, self._device_step(step)

    def _step_buffers(self, n: int, t: int, table):
        """``build_indices``' outputs for ``n`` rows and ``t`` tokens: the getter of the nine int32 views
        and their one buffer (at the kernel's offsets, step.index_layout), ``slot_mapping``,
        ``has_initial_state`` and the block-table rows (paged; the placeholder when contiguous)."""
        views, size = _index_views(n, t)
        rows = np.empty((n, table.shape[1]), np.int32) if table is not None else self._empty_table
        return views, np.empty(size, np.int32), np.empty(t, np.int64), np.empty(n, np.bool_), rows

    def _device_step(self, step: StepIndices) -> StepIndices:
        """A host step on this engine's device: the host arrays themselves on the CPU."""
        return step

    # ------------------------------------------------------------------ copy kernels (ops)

    def _word_view(self, buf):
        """``(flat words, word dtype, rows, block_size, block_stride, row_stride)`` of a storage
        buffer ``[a, b, heads, dim]``, strides in words; cached (buffers keep their identity
        for the cache's life, DESIGN §4.1)."""
        got = self._views.get(id(buf))
        if got is None or got[0] is not buf:
            c = _copy()
            row_elems = buf.shape[2] * buf.shape[3]
            word = c.word_dtype(row_elems * buf.dtype.itemsize)
            row_words = row_elems * buf.dtype.itemsize // word.itemsize
            got = (buf, c.flat_words(buf, word), word, buf.shape[0] * buf.shape[1], buf.shape[1],
                   buf.shape[1] * row_words, row_words)
            self._views[id(buf)] = got
        return got[1:]

    def scatter_kv(self, K, V, k, v, slot_mapping) -> int:
        sm = slot_mapping
        if not (isinstance(sm, np.ndarray) and sm.dtype == np.int64):
            sm = np.asarray(sm, dtype=np.int64)
        t = sm.shape[0]
        if t == 0:
            return -1
        pair = self._pairs.get((id(K), id(V)))
        if pair is None or pair[0] is not K or pair[1] is not V:
            Kw, word, rows, bs, block_stride, row_stride = self._word_view(K)
            pair = (K, V, Kw, self._word_view(V)[0], word, rows, bs, block_stride, row_stride)
            self._pairs[(id(K), id(V))] = pair
        _, _, Kw, Vw, word, rows, bs, block_stride, row_stride = pair
        if k.dtype != K.dtype:
            k = k.astype(K.dtype)  # the reference's assignment casts the same way
        if v.dtype != V.dtype:
            v = v.astype(V.dtype)
        c = self._c
        # C-contiguous inputs (the common case) as [T, row_words] views without as_words' general path
        kw = k.reshape(t, -1).view(word) if k.flags.c_contiguous else c.as_words(k, word)
        vw = v.reshape(t, -1).view(word) if v.flags.c_contiguous else c.as_words(v, word)
        return c.scatter_rows(kw, vw, Kw, Vw, 0, 0, sm, bs, block_stride, row_stride, rows, self._parallel_runs)

    def gather_kv(self, K, V, slot: int, n: int, block_row, block_size: int):
        if block_row is None:
            return K[slot, :n].copy(), V[slot, :n].copy()
        out_k = np.empty((n, *K.shape[2:]), K.dtype)
        out_v = np.empty_like(out_k)
        if n == 0:
            return out_k, out_v
        c = _copy()
        for src, out in ((K, out_k), (V, out_v)):
            words, word, _, bs, block_stride, row_stride = self._word_view(src)
            c.gather_rows(words, 0, block_row, n, bs, block_stride, row_stride, out.reshape(n, -1).view(word))
        return out_k, out_v

    def attend(self, q, K, V, kind, window: int, step: StepIndices, block_size, scale: float, kv_scales=None,
               softcap: float = 0.0, sinks=None):
        """``spec/slot-cache.md`` §7.3 in one Numba call (:func:`kvfast._numba.attend.attend_slots`):
        keys and values read in place (float32, or float16 / bfloat16 bits widened exactly), no
        gather. FP8 storage takes the reference's dequantised path (spec/slot-cache.md §10.3)."""
        if kv_scales is not None:  # FP8: read as gather_kv_fp8 reads it, bit for bit (spec/slot-cache.md §10.3)
            return super().attend(q, K, V, kind, window, step, block_size, scale, kv_scales, softcap, sinks)
        from ._numba.attend import ATTENTION, CROSS, SLIDING, attend_slots
        from ._numba.vecmath import word_view

        got = self._attend_views.get((id(K), id(V)))
        if got is None or got[0] is not K or got[1] is not V:  # once per layer: storage keeps its identity
            H, D = K.shape[2], K.shape[3]
            # float32, or float16 / bfloat16 read as their bits
            got = (K, V, word_view(K.reshape(-1, H, D)), word_view(V.reshape(-1, H, D)))
            self._attend_views[(id(K), id(V))] = got
        _, _, Kf, Vf = got
        if not (q.dtype == np.float32 and q.flags.c_contiguous):
            q = np.ascontiguousarray(q, dtype=np.float32)
        out = np.empty(q.shape, np.float32)
        cross = kind is LayerKind.CROSS_ATTENTION
        code = CROSS if cross else SLIDING if kind is LayerKind.SLIDING_WINDOW else ATTENTION
        paged = block_size is not None and not cross  # a cross layer's plane is dense in both modes
        attend_slots(Kf, Vf, q, step.cu_seqlens_q, step.past_len,
                     step.cross_seqused_k if cross else step.seqused_k, step.slot_ids,
                     step.block_table if paged else _NO_BLOCK_TABLE, block_size if paged else 0, K.shape[1], code,
                     window, scale, softcap, _NO_SINKS if sinks is None else sinks, sinks is not None, out)
        return out

    # ------------------------------------------------------------------ FP8 K/V (spec/slot-cache.md §10)

    def scatter_kv_fp8(self, K, V, Ks, Vs, k, v, slot_mapping, unit: int) -> int:
        sm = np.asarray(slot_mapping, dtype=np.int64)
        rows = K.shape[0] * K.shape[1]
        over = np.flatnonzero(sm >= rows)
        if over.size:
            return int(over[0])
        if sm.shape[0] == 0:
            return -1
        name = dtype_name(K.dtype)
        _fp8().append_fp8(k, v, K, V, Ks, Vs, sm, unit, name, self._fp8_table(name))
        return -1

    def _fp8_table(self, name: str):
        """The float32 value of every FP8 bit pattern (on this engine's device), made once."""
        tables = self._fp8_tables
        if name not in tables:
            tables[name] = self._device_table(fp8_decode_table(name))
        return tables[name]

    def _device_table(self, table: np.ndarray):
        return table


class CudaSlotEngine(FastSlotEngine):
    """Storage and ``StepIndices`` on a CUDA device (CuPy); bookkeeping on the host.

    Every method runs in CI without a GPU, on the emulated device (``KVFAST_CUDA_EMULATE=1``:
    the CuPy stand-in launches the ``.cu`` kernels compiled for the host), and on a lent GPU
    in ``kvcache gpu-check``.

    Parameters
    ----------
    max_seqs : int
        Slots of the cache.
    device_id : int
        The CUDA device (already checked by :func:`require_cuda`).
    cp : module
        The ``cupy`` module.
    fp8_dtype : str, optional
        ``config.dtype`` of an FP8 cache (``"float8_e4m3fn"`` or ``"float8_e5m2"``): the
        device keeps FP8 storage as uint8 bit patterns, so the engine is told the format.
    """

    def __init__(self, max_seqs: int, device_id: int, cp, fp8_dtype: str | None = None):
        super().__init__(max_seqs)
        #: the cache's FP8 dtype name (its storage is uint8 bit patterns on the device), or None
        self.fp8_dtype = fp8_dtype
        self.device = f"cuda:{device_id}"
        self._dev = device_id
        self._cp = cp

    def zeros(self, shape, dtype):
        # CuPy has no bfloat16 and no FP8: such storage lives as its bit patterns on the device.
        name = np.dtype(dtype).name
        dt = np.dtype(np.uint16) if name == "bfloat16" else np.dtype(np.uint8) if name in FP8_DTYPES else dtype
        with self._cp.cuda.Device(self._dev):
            return self._cp.zeros(shape, dt)

    def write_sets(self, max_seqs: int) -> ArrayWriteSets:
        return ArrayWriteSets(max_seqs, to_host=self.to_host)

    def to_host(self, x) -> np.ndarray:
        return self._cp.asnumpy(x) if isinstance(x, self._cp.ndarray) else np.asarray(x)

    def _device_step(self, step: StepIndices) -> StepIndices:
        cp = self._cp
        with cp.cuda.Device(self._dev):
            moved = [cp.asarray(v) if isinstance(v, np.ndarray) else v
                     for v in (getattr(step, f.name) for f in dataclasses.fields(step))]
        return _step_indices(*moved)

    def kv_input(self, api: str, name: str, x, storage_dtype, logical_dtype: str):
        from ._cuda.convert import to_device_storage

        with self._cp.cuda.Device(self._dev):
            # The reference's conversion (bfloat16: round to nearest even, ml_dtypes' bits), same messages.
            return to_device_storage(api, name, x, storage_dtype, logical_dtype)

    def _geometry(self, K):
        row = K.shape[2] * K.shape[3]
        return K.shape[1], K.shape[1] * row, row

    def _device_slots(self, K, slot_mapping):
        """``(slot_mapping on the device, None)``, or ``(None, t)`` when nothing may be launched:
        ``t = -1`` for no tokens, else the first token whose slot is past the storage (one device
        sync: the kernels must not write past it). Call inside ``cp.cuda.Device(self._dev)``."""
        cp = self._cp
        sm = cp.asarray(slot_mapping, cp.int64)
        if sm.shape[0] == 0:
            return None, -1
        rows = K.shape[0] * K.shape[1]
        if int(sm.max()) >= rows:
            return None, int(cp.flatnonzero(sm >= rows)[0])
        return sm, None

    def scatter_kv(self, K, V, k, v, slot_mapping) -> int:
        from ._cuda.append_kv import append_kv as launch
        from ._cuda.convert import rows_contiguous

        cp = self._cp
        with cp.cuda.Device(self._dev):
            sm, bad = self._device_slots(K, slot_mapping)
            if bad is not None:
                return bad
            bs, block_stride, row_stride = self._geometry(K)
            launch(rows_contiguous(k), rows_contiguous(v), K, V, sm, block_size=bs, block_stride=block_stride,
                   row_stride=row_stride)
        return -1

    def gather_kv(self, K, V, slot: int, n: int, block_row, block_size: int):
        cp = self._cp
        with cp.cuda.Device(self._dev):
            if block_row is None:
                return K[slot, :n].copy(), V[slot, :n].copy()
            from ._cuda.gather_kv import gather_kv as launch

            bs, block_stride, row_stride = self._geometry(K)
            return launch(K, V, cp.asarray(block_row), n, block_size=bs, block_stride=block_stride,
                          row_stride=row_stride, kv_heads=K.shape[2], head_dim=K.shape[3])

    def fill_plane(self, K, slot: int, k) -> None:
        logical = "bfloat16" if K.dtype == np.uint16 else str(K.dtype)  # uint16 storage is bfloat16 bits
        k = self.kv_input("fill", "k", k, K.dtype, logical)
        with self._cp.cuda.Device(self._dev):
            t = k.shape[0]
            K[slot, :t] = k
            K[slot, t:] = 0

    # ------------------------------------------------------------------ FP8 K/V (spec/slot-cache.md §10)

    def kv_input_float32(self, api: str, name: str, x):
        from ._cuda.convert import to_device_storage

        with self._cp.cuda.Device(self._dev):
            return to_device_storage(api, name, x, np.dtype(np.float32), "float32")

    def _device_table(self, table: np.ndarray):
        with self._cp.cuda.Device(self._dev):
            return self._cp.asarray(table)

    def first_nonfinite(self, x) -> int:
        cp = self._cp
        with cp.cuda.Device(self._dev):
            if x.shape[0] == 0:
                return -1
            ok = self.to_host(cp.isfinite(x).reshape(x.shape[0], -1).all(axis=1))  # one device sync
        bad = np.flatnonzero(~ok)
        return int(bad[0]) if bad.size else -1

    def zero_index_rows(self, buffers, rows) -> None:
        cp = self._cp
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0:
            return
        with cp.cuda.Device(self._dev):
            idx = cp.asarray(rows)
            for buf in buffers:
                buf[idx] = 0

    def scatter_kv_fp8(self, K, V, Ks, Vs, k, v, slot_mapping, unit: int) -> int:
        from ._cuda.append_kv_fp8 import append_kv_fp8 as launch
        from ._cuda.convert import rows_contiguous

        cp = self._cp
        with cp.cuda.Device(self._dev):
            sm, bad = self._device_slots(K, slot_mapping)
            if bad is not None:
                return bad
            bs, block_stride, row_stride = self._geometry(K)
            launch(rows_contiguous(k), rows_contiguous(v), K, V, Ks, Vs, sm, fp8=self.fp8_dtype, block_size=bs,
                   block_stride=block_stride, row_stride=row_stride, unit_tokens=unit)
        return -1

    def gather_kv_fp8(self, K, V, Ks, Vs, slot: int, n: int, block_row, block_size: int, unit: int):
        """One ``fp8_gather_kernel`` launch: decode and scale on the device (spec/slot-cache.md §10.3)."""
        from ._cuda.append_kv_fp8 import gather_kv_fp8 as launch

        cp = self._cp
        with cp.cuda.Device(self._dev):
            bs, block_stride, row_stride = self._geometry(K)
            row = cp.asarray([slot], cp.int32) if block_row is None else cp.asarray(block_row)
            return launch(K, V, Ks, Vs, row, n, fp8=self.fp8_dtype, block_size=bs, block_stride=block_stride,
                          row_stride=row_stride, unit_tokens=unit, kv_heads=K.shape[2], head_dim=K.shape[3])

    def zero_rows(self, buffers, slot: int) -> None:
        from ._cuda.state import state_zero_rows

        with self._cp.cuda.Device(self._dev):
            for buf in buffers:
                state_zero_rows(buf, np.array([slot], np.int64))

    def save_rows(self, buffers, slot: int) -> list:
        from ._cuda.state import state_copy_rows

        out = []
        with self._cp.cuda.Device(self._dev):
            for buf in buffers:  # state.cu: the checkpoint save, row slot -> a one-row store
                store = self._cp.empty((1, *buf.shape[1:]), buf.dtype)
                state_copy_rows(buf, store, np.array([slot], np.int64), np.array([0], np.int64))
                out.append(store[0])
        return out

    def restore_rows(self, buffers, slot: int, saved) -> None:
        from ._cuda.state import state_copy_rows

        with self._cp.cuda.Device(self._dev):
            for buf, row in zip(buffers, saved):
                state_copy_rows(row[None], buf, np.array([0], np.int64), np.array([slot], np.int64))

    def attend(self, q, K, V, kind, window: int, step: StepIndices, block_size, scale: float,
               kv_scales=None, softcap: float = 0.0, sinks=None):
        """CuPy version of the reference algorithm (same masks, float32 math); FP8 storage is
        dequantised as :meth:`gather_kv_fp8` returns it.

        ``softcap`` (0.0: off) turns every score ``s = scale * dot(q, k)`` into ``softcap *
        tanh(s / softcap)`` before the mask; ``sinks`` (host float32 [q_heads], or None) gives
        each query head a sink logit that joins the largest score and the softmax denominator,
        with no value."""
        from ._cuda.convert import query_float32, storage_float32

        cp = self._cp
        with cp.cuda.Device(self._dev):
            q = query_float32(q)  # bfloat16 storage is uint16 bits: widen them, never cast the integers
            group = q.shape[1] // K.shape[2]
            out = cp.zeros(q.shape, cp.float32)
            cap = cp.float32(softcap)
            sk = None if sinks is None else cp.asarray(sinks, dtype=cp.float32).reshape(-1, 1, 1)  # [h, 1, 1]
            cu = self.to_host(step.cu_seqlens_q).astype(np.int64)
            past, used = self.to_host(step.past_len), self.to_host(step.seqused_k)
            cross, slots = self.to_host(step.cross_seqused_k), self.to_host(step.slot_ids)
            for b in range(step.num_seqs):
                lo, hi = int(cu[b]), int(cu[b + 1])
                slot = int(slots[b])
                if kind is LayerKind.CROSS_ATTENTION:
                    n = int(cross[b])
                    if kv_scales is not None:
                        k, v = self.gather_kv_fp8(K, V, kv_scales[0], kv_scales[1], slot, n, None, 0, kv_scales[2])
                    else:
                        k, v = K[slot, :n], V[slot, :n]
                    mask = cp.ones((hi - lo, n), bool)
                else:
                    n = int(used[b])
                    if kv_scales is not None:
                        row = None if block_size is None else step.block_table[b]
                        k, v = self.gather_kv_fp8(K, V, kv_scales[0], kv_scales[1], slot, n, row, block_size or 0,
                                                  kv_scales[2])
                    elif block_size is None:
                        k, v = K[slot, :n], V[slot, :n]
                    else:
                        pos = cp.arange(n)
                        flat = cp.asarray(step.block_table[b]).astype(cp.int64)[pos // block_size] * block_size \
                            + pos % block_size
                        k = K.reshape(-1, *K.shape[2:])[flat]
                        v = V.reshape(-1, *V.shape[2:])[flat]
                    p = int(past[b]) + cp.arange(hi - lo)[:, None]
                    key = cp.arange(n)[None, :]
                    mask = key <= p
                    if kind is LayerKind.SLIDING_WINDOW:
                        mask &= key > p - window
                if kv_scales is None:
                    k, v = storage_float32(k), storage_float32(v)
                kf = cp.repeat(k, group, axis=1)
                vf = cp.repeat(v, group, axis=1)
                s = cp.einsum("qhd,khd->hqk", q[lo:hi].astype(cp.float32), kf) * cp.float32(scale)
                if cap != 0:
                    s = cap * cp.tanh(s / cap)
                s = cp.where(mask[None], s, -cp.inf)
                if sk is None:
                    s = s - s.max(axis=-1, keepdims=True)
                    w = cp.exp(s)
                    w = w / w.sum(axis=-1, keepdims=True)
                else:  # the sink: in the largest score and the denominator, no value
                    m = cp.maximum(s.max(axis=-1, keepdims=True), sk)
                    w = cp.exp(s - m)
                    w = w / (w.sum(axis=-1, keepdims=True) + cp.exp(sk - m))
                out[lo:hi] = cp.einsum("hqk,khd->qhd", w, vf)
            return out
