"""The slot-cache engine protocol: the mechanisms under the slot cache's policy
(DESIGN §7, ``spec/slot-cache.md`` §9).

The policy (``kvref.KVCache`` and ``kvref.ops``) decides everything the spec
decides: which check runs first, the message of every error, all-or-nothing
reservation, the allocation order, prefix hits, publication and state
checkpoints. It touches storage and indices only through a ``SlotEngine``
chosen once, when the cache is made (``KVCache.make_engine``):

* ``kvref``'s reference engine: NumPy and plain Python loops, the readable
  definition of each mechanism;
* ``kvfast``'s engines: Numba kernels on the CPU, CuPy arrays and RawKernels
  on a GPU.

Two engines given the same calls return the same values (block ids, index
arrays, K/V bytes): the policy is identical, so every observable result is.
The validators only *find* the first offender; the policy formats the
message, so messages cannot drift between backends.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol, runtime_checkable

import numpy as np

from .._step import StepIndices

__all__ = [
    "SlotEngine", "WriteSets", "StepCheck",
    "STEP_OK", "STEP_CU0", "STEP_NOT_INCREASING", "STEP_SLOT_RANGE", "STEP_SLOT_DUP", "STEP_PAST_MISMATCH",
    "STEP_CAPACITY", "STEP_TOTAL",
]

#: Result codes of :meth:`SlotEngine.check_step` and :meth:`SlotEngine.check_slots`, in the order
#: the checks run (``spec/slot-cache.md`` §2.8): the first violated check is reported.
STEP_OK = 0
#: ``cu_seqlens_q[0] != 0``
STEP_CU0 = 1
#: ``cu_seqlens_q[i] <= cu_seqlens_q[i-1]`` (``i`` is the offending index)
STEP_NOT_INCREASING = 2
#: ``slot_ids[i]`` outside ``[0, max_seqs)``
STEP_SLOT_RANGE = 3
#: ``slot_ids[i] == slot_ids[j]`` with ``j < i`` (``j`` is reported too)
STEP_SLOT_DUP = 4
#: ``past_len[i] != seq_lens[slot_ids[i]]``
STEP_PAST_MISMATCH = 5
#: ``q_len[i] > max_seq_len - past_len[i]`` (compared so that nothing can wrap)
STEP_CAPACITY = 6
#: ``sum(past_len + q_len) > 2**31 - 1`` (``i`` is the sum)
STEP_TOTAL = 7

#: ``(code, i, j)``: a result code and the indices (or value) the message needs.
StepCheck = tuple[int, int, int]


@runtime_checkable
class WriteSets(Protocol):
    """slot -> blocks of its last prepared, not yet committed step (``spec/slot-cache.md`` §6.7).

    Bookkeeping for ``check_invariants`` only: how it is stored is the engine's
    choice (the reference keeps a frozenset per slot, the fast engine keeps the
    step's arrays and builds sets when asked).
    """

    def record(self, slot_ids: np.ndarray, step: StepIndices, block_size: int) -> None:
        """Every row's slot now has the blocks ``step.slot_mapping // block_size`` of its tokens
        (host arrays; ``slot_ids`` int64 ``[B]``)."""

    def pop(self, slot: int) -> None:
        """Forget slot ``slot``'s write set (committed, rolled back or freed)."""

    def clear(self) -> None:
        """Forget every write set."""

    def items(self) -> Iterable[tuple[int, frozenset[int]]]:
        """``(slot, blocks)`` of every tracked slot."""


@runtime_checkable
class SlotEngine(Protocol):
    """The mechanisms of one slot cache. Made once per cache by ``KVCache.make_engine``.

    Host arrays are NumPy; ``storage`` arrays live on :attr:`device`
    (``numpy.ndarray`` on ``"cpu"``, ``cupy.ndarray`` on ``"cuda:N"``).
    Integer inputs reach the engine validated for dtype and length (int64
    host vectors); the engine never raises for a bad argument, it reports.

    Attributes
    ----------
    device : str
        ``"cpu"`` or ``"cuda:N"``: where storage and ``StepIndices`` live.
    """

    device: str

    # ------------------------------------------------------------------ storage and bookkeeping

    def zeros(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """A zeroed storage buffer on :attr:`device` (CuPy keeps bfloat16 as its uint16 bits)."""

    def block_pool(self, num_blocks: int, on_evict: Callable[[bytes], None]) -> Any:
        """A block pool over ids ``0 .. num_blocks-1`` (block 0 null) with the allocation order
        of ``spec/slot-cache.md`` §5: ``allocate``, ``free``, ``touch``, ``lookup``, ``publish``,
        ``contains_hash``, ``num_free``, ``num_usable``, ``free_order``, ``is_published``,
        ``ref_count``, ``block_hash``, ``block_tokens``, ``hash_to_block``, ``reset``,
        ``check_invariants`` (the ``kvref._block_pool.BlockPool`` surface)."""

    def write_sets(self, max_seqs: int) -> WriteSets:
        """An empty write-set tracker for ``max_seqs`` slots."""

    # ------------------------------------------------------------------ validation (finders)

    def check_slots(self, slot_ids: np.ndarray, max_seqs: int) -> StepCheck:
        """The first slot out of range (``STEP_SLOT_RANGE, i, 0``) or repeated
        (``STEP_SLOT_DUP, i, j``) in row order, else ``(STEP_OK, 0, 0)``."""

    def check_step(self, cu_seqlens_q: np.ndarray, past_len: np.ndarray, slot_ids: np.ndarray,
                   seq_lens: np.ndarray, max_seqs: int, max_seq_len: int) -> StepCheck:
        """The first violation of a step, checks in the order of the ``STEP_*`` codes
        (lengths already agree: ``len(cu) == B + 1 == len(past) + 1``)."""

    # ------------------------------------------------------------------ reservation

    def blocks_needed(self, slot_ids: np.ndarray, new_len: np.ndarray, nblk: np.ndarray,
                      block_size: int) -> tuple[np.ndarray, int]:
        """``add[i] = max(ceil(new_len[i] / block_size) - nblk[slot_i], 0)`` (int64 ``[B]``) and its sum."""

    def step_blocks_needed(self, cu_seqlens_q: np.ndarray, past_len: np.ndarray, slot_ids: np.ndarray,
                           nblk: np.ndarray, block_size: int) -> tuple[np.ndarray, int]:
        """:meth:`blocks_needed` with ``new_len = past_len + diff(cu_seqlens_q)``."""

    def grow_rows(self, pool: Any, slot_ids: np.ndarray, add: np.ndarray, total: int, table: np.ndarray,
                  nblk: np.ndarray) -> np.ndarray:
        """Pop ``total`` blocks from ``pool`` in one call (the caller checked ``total <= pool.num_free``)
        and append ``add[i]`` of them to row ``slot_ids[i]`` of ``table``, rows in order, columns
        left to right; advance ``nblk``. Returns the popped block ids (host int array ``[total]``)."""

    def release_blocks(self, pool: Any, blocks: np.ndarray) -> None:
        """Drop one reference from each of ``blocks`` (int32, in the order given: tail first)."""

    # ------------------------------------------------------------------ step indices

    def build_step(self, cu_seqlens_q: np.ndarray, past_len: np.ndarray, slot_ids: np.ndarray,
                   table: np.ndarray | None, enc_lens: np.ndarray, block_size: int,
                   max_seq_len: int) -> StepIndices:
        """``StepIndices`` of a validated step (``spec/slot-cache.md`` §3) on :attr:`device`;
        ``table`` is the host block table after reservation, None when contiguous."""

    def plan_step(self, cu_seqlens_q: np.ndarray, past_len: np.ndarray, slot_ids: np.ndarray,
                  seq_lens: np.ndarray, nblk: np.ndarray, table: np.ndarray | None, enc_lens: np.ndarray,
                  max_seqs: int, max_seq_len: int,
                  block_size: int) -> tuple[int, int, int, np.ndarray | None, int, StepIndices | None]:
        """:meth:`check_step`, then (paged: ``table`` not None) :meth:`step_blocks_needed`, then, when
        the step needs no new block, :meth:`build_step`: a prepared step in one call, its result
        ``(code, i, j, add, total, step)`` equal to those calls' in that order.

        ``code != STEP_OK``: ``(code, i, j)`` is the finding, ``add``/``step`` None, ``total`` 0.
        Paged with ``total > 0``: ``add``/``total`` as :meth:`step_blocks_needed`, ``step`` None
        (the policy checks the free count, grows and calls :meth:`build_step`). Otherwise
        ``step`` is :meth:`build_step`'s (``add`` None when contiguous). Nothing is mutated."""

    # ------------------------------------------------------------------ copy kernels (ops)

    def kv_input(self, api: str, name: str, x: Any, storage_dtype: np.dtype, logical_dtype: str) -> Any:
        """A K/V input in the form the kernels take, before the policy checks its shape.

        Host engines return ``np.asarray(x)``; a CUDA engine moves it to the device in the
        storage dtype (bfloat16 rounded to its uint16 bits), raising ``TypeError``
        (``"<api>: <name> dtype=..., must be a floating type"``) for a non-floating input."""

    def scatter_kv(self, K: Any, V: Any, k: Any, v: Any, slot_mapping: Any) -> int:
        """Write row ``t`` of ``k``/``v`` (``[T, kv_heads, head_dim]``, cast to the storage dtype)
        at flat storage row ``slot_mapping[t]`` of ``K``/``V`` (``[rows_a, rows_b, kv_heads, head_dim]``
        flattened over the first two axes); ``slot_mapping < 0`` skips the token. Returns -1, or
        the first token whose row is past the storage, having written nothing."""

    def gather_kv(self, K: Any, V: Any, slot: int, n: int, block_row: np.ndarray | None,
                  block_size: int) -> tuple[Any, Any]:
        """Copies of positions ``[0, n)`` of one slot: through ``block_row`` (a paged table row)
        or, when None, the dense plane ``K[slot, :n]``."""

    def fill_plane(self, K: Any, slot: int, k: Any) -> None:
        """``K[slot, :t] = k`` (cast) and ``K[slot, t:] = 0`` for ``t = len(k)``."""

    def attend(self, q: Any, K: Any, V: Any, kind: Any, window: int, step: StepIndices,
               block_size: int | None, scale: float, kv_scales: tuple | None = None,
               softcap: float = 0.0, sinks: np.ndarray | None = None) -> Any:
        """float32 ``[T, q_heads, head_dim]`` varlen attention of a validated step
        (``spec/slot-cache.md`` §7.3); ``block_size`` None for dense planes. FP8 storage passes
        ``kv_scales=(K scales, V scales, unit_tokens)`` and reads keys and values as
        :meth:`gather_kv_fp8` returns them (spec/slot-cache.md §10.3). ``softcap`` (0.0: off)
        caps the scaled scores; ``sinks`` (host float32 ``[q_heads]``, checked) are the heads'
        sink logits (spec/slot-cache.md §7.3)."""

    # ------------------------------------------------------------------ FP8 K/V (spec/slot-cache.md §10)

    def kv_input_float32(self, api: str, name: str, x: Any) -> Any:
        """A K/V input of an FP8 layer as float32 ``[T, heads, dim]`` on :attr:`device` (exact
        widening, float64 rounded once); ``TypeError`` (``"<api>: <name> dtype=..., must be a
        floating type"``) for a non-floating input."""

    def first_nonfinite(self, x: Any) -> int:
        """The first row ``t`` of ``x [T, ...]`` holding a NaN or an infinity, else -1."""

    def scatter_kv_fp8(self, K: Any, V: Any, Ks: Any, Vs: Any, k: Any, v: Any, slot_mapping: Any,
                       unit: int) -> int:
        """The quantising append of ``spec/slot-cache.md`` §10.2: ``K``/``V`` FP8 storage
        ``[A, Bd, kv_heads, head_dim]``, ``Ks``/``Vs`` float32 scales of
        ``A * ceil(Bd / unit) * kv_heads`` elements (row-major ``[A, ceil(Bd / unit), kv_heads]``),
        ``k``/``v`` float32 ``[T, kv_heads, head_dim]`` (finite), flat storage row
        ``slot_mapping[t]`` (``< 0`` skipped) in unit ``(row // Bd) * ceil(Bd / unit) + (row % Bd) // unit``.
        Returns -1, or the first token whose row is past the storage, having written nothing."""

    def gather_kv_fp8(self, K: Any, V: Any, Ks: Any, Vs: Any, slot: int, n: int,
                      block_row: np.ndarray | None, block_size: int, unit: int) -> tuple[Any, Any]:
        """float32 dequantised positions ``[0, n)`` of one slot (as :meth:`gather_kv` reads them),
        each times its unit's scale."""

    def zero_index_rows(self, buffers: list, rows: np.ndarray) -> None:
        """``buf[rows] = 0`` for every buffer (the scales of newly allocated blocks, spec/slot-cache.md §10.4)."""

    def to_host(self, x: Any) -> np.ndarray:
        """A NumPy copy (or the array itself on the CPU)."""

    # ------------------------------------------------------------------ slot rows (state slabs, cross planes)

    def zero_rows(self, buffers: list, slot: int) -> None:
        """``buf[slot] = 0`` for every buffer ``[max_seqs, ...]`` (evict, retire, admit miss)."""

    def save_rows(self, buffers: list, slot: int) -> list:
        """Copies of row ``slot`` of every buffer, in order: a state checkpoint (``spec/slot-cache.md`` §4.3)."""

    def restore_rows(self, buffers: list, slot: int, saved: list) -> None:
        """``buf[slot] = saved[i]`` for the i-th buffer: a checkpoint restored by ``admit``."""
