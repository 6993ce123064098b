"""The slot cache ``KVCache``: the policy of ``spec/slot-cache.md`` (DESIGN §4).

Per-layer K/V storage over slot-indexed batches, contiguous or paged, plus
cross-attention planes and state slabs. This class is the **policy**: every
decision of the spec (the order of the checks and their messages,
all-or-nothing reservation, allocation order, prefix hits, publication,
state checkpoints) is written here once. Every public method validates all
of its arguments before the first mutation, so a raise leaves the cache
exactly as it was (``spec/slot-cache.md`` §2); nothing is snapshotted.

The mechanisms (storage buffers, block pool, the validators that find the
first offender, block growth, the step-index builder, copy kernels) are a
``kvspec.engine.SlotEngine`` chosen once by :meth:`KVCache.make_engine`:
``kvref`` runs on the reference engine (``_slot_engine.py``, NumPy and Python
loops), ``kvfast.KVCache`` overrides ``make_engine`` with its fast engines.
The hash chain is ``kvspec.hashing``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np

from kvspec import CapacityError, KVCacheConfig, KVCacheMode, KVLayerSpec, LayerKind, StepIndices
from kvspec._interop import host_array, int64_from_ints
from kvspec._config import INT32_MAX, parse_device
from kvspec._dtypes import is_fp8
from kvspec.engine import (
    STEP_CU0, STEP_NOT_INCREASING, STEP_OK, STEP_PAST_MISMATCH, STEP_SLOT_DUP, STEP_SLOT_RANGE, STEP_TOTAL,
    SlotEngine,
)
from kvspec import retention as _retention
from kvspec.hashing import block_hash, block_hashes, root_hash

from ._block_pool import NULL_BLOCK
from ._slot_engine import ReferenceSlotEngine, build_step_indices

__all__ = ["KVCache", "build_step_indices", "check_make_args"]

_INT32_MIN, _INT32_MAX = -(2**31), INT32_MAX
_ATTN_KINDS = (LayerKind.ATTENTION, LayerKind.SLIDING_WINDOW)
_KV_KINDS = (LayerKind.ATTENTION, LayerKind.SLIDING_WINDOW, LayerKind.CROSS_ATTENTION)


# ---------------------------------------------------------------------- argument checks


def _check_index(api: str, name: str, value, n: int) -> int:
    """An int in ``[0, n)``: ``TypeError`` for a non-int, ``IndexError`` out of range."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{api}: {name}={value!r}, must be an int")
    value = int(value)
    if not 0 <= value < n:
        raise IndexError(f"{api}: {name}={value} out of range [0, {n})")
    return value


def _check_scalar(api: str, name: str, value) -> int:
    """A Python or NumPy int (not bool); ``TypeError`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{api}: {name}={value!r}, must be an int")
    return int(value)


def _int_vector(api: str, name: str, value) -> np.ndarray:
    """A 1-D host integer array as int64: ``TypeError`` for floats/bools, ``ValueError`` for ndim."""
    if type(value) is np.ndarray and value.ndim == 1 and value.dtype.kind == "i":
        return value if value.dtype == np.int64 else value.astype(np.int64)  # a signed array: the checks below pass
    arr = int64_from_ints(value)  # a list of Python ints, packed; else NumPy's conversion
    if arr is not None:
        return arr
    arr = np.asarray(value)
    if arr.size == 0 and arr.dtype.kind == "f":
        arr = arr.astype(np.int64)  # np.asarray([]) is float64; an empty list is an empty int list
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{api}: {name} dtype={arr.dtype}, must be an integer type")
    if arr.ndim != 1:
        raise ValueError(f"{api}: {name}.ndim={arr.ndim}, must be 1")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{api}: {name} max={arr.max()} > {np.iinfo(np.int64).max}")
    return arr if arr.dtype == np.int64 else arr.astype(np.int64)


def _token_vector(api: str, name: str, value) -> np.ndarray:
    """Token ids: 1-D integers that fit int32, returned as int32."""
    arr = _int_vector(api, name, value)
    bad = np.flatnonzero((arr < _INT32_MIN) | (arr > _INT32_MAX))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{api}: {name}[{i}]={arr[i]} out of int32 range [{_INT32_MIN}, {_INT32_MAX}]")
    return arr.astype(np.int32)


def _strip_pads(api: str, name: str, tokens: np.ndarray, pad_token_id, attention_mask) -> np.ndarray:
    """spec/slot-cache.md §13: the sequence's own tokens, pads removed before any hash is taken.

    ``attention_mask`` (transformers' convention: 1 = a token, 0 = a pad, any placement) keeps
    the tokens under a 1; ``pad_token_id`` drops the **leading** run of that id (left padding).
    Neither given: ``tokens`` as they are. ``TypeError`` / ``ValueError`` name the argument.
    """
    if pad_token_id is None and attention_mask is None:
        return tokens
    if pad_token_id is not None and attention_mask is not None:
        raise ValueError(f"{api}: pad_token_id={pad_token_id!r} and an attention_mask given, pass one of them")
    if attention_mask is not None:
        mask = np.asarray(attention_mask)
        if mask.dtype.kind not in "biu":
            raise TypeError(f"{api}: attention_mask dtype={mask.dtype}, must be bool or integer 0/1")
        if mask.ndim != 1 or mask.shape[0] != tokens.shape[0]:
            raise ValueError(f"{api}: attention_mask.shape={mask.shape}, must be [len({name})]=[{tokens.shape[0]}]")
        bad = np.flatnonzero((mask != 0) & (mask != 1))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{api}: attention_mask[{i}]={mask[i]}, must be 0 (pad) or 1 (token)")
        return tokens[mask.astype(bool)]
    pad = _check_scalar(api, "pad_token_id", pad_token_id)
    if not _INT32_MIN <= pad <= _INT32_MAX:
        raise ValueError(f"{api}: pad_token_id={pad} out of int32 range [{_INT32_MIN}, {_INT32_MAX}]")
    real = np.flatnonzero(tokens != pad)
    return tokens[int(real[0]):] if real.size else tokens[:0]


def _float_tensor(api: str, name: str, value, shape_hint: str) -> np.ndarray:
    """A floating array (float16/bfloat16/float32/float64); ``TypeError`` otherwise.

    Device arrays (``__cuda_array_interface__``) are checked in place, not copied to the host.
    """
    arr = value if hasattr(value, "__cuda_array_interface__") else host_array(value)  # torch too (bfloat16)
    if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16":
        raise TypeError(f"{api}: {name} dtype={arr.dtype}, must be a floating type {shape_hint}")
    return arr


# ---------------------------------------------------------------------- the cache



def check_make_args(api: str, config, layer_specs) -> tuple[KVLayerSpec, ...]:
    """Validate ``make``'s arguments (shared by every backend's ``make``); returns the specs as a tuple.

    Raises ``TypeError`` for a wrong type and ``ValueError`` for a wrong count
    or cross-attention layers of different ``max_enc_len``.
    """
    if not isinstance(config, KVCacheConfig):
        raise TypeError(f"{api}: config={config!r}, must be a KVCacheConfig")
    if isinstance(layer_specs, (str, bytes)) or not hasattr(layer_specs, "__len__"):
        raise TypeError(f"{api}: layer_specs={layer_specs!r}, must be a sequence of KVLayerSpec")
    specs = tuple(layer_specs)
    for i, spec in enumerate(specs):
        if not isinstance(spec, KVLayerSpec):
            raise TypeError(f"{api}: layer_specs[{i}]={spec!r}, must be a KVLayerSpec")
    if len(specs) != config.num_layers:
        raise ValueError(f"{api}: len(layer_specs)={len(specs)} != config.num_layers={config.num_layers}")
    # spec/slot-cache.md §8.16: one encoder length per slot, so every cross layer has the same max_enc_len.
    cross = [(i, sp.max_enc_len) for i, sp in enumerate(specs) if sp.kind is LayerKind.CROSS_ATTENTION]
    for i, m in cross[1:]:
        if m != cross[0][1]:
            raise ValueError(
                f"{api}: layer_specs[{i}].max_enc_len={m} but layer_specs[{cross[0][0]}].max_enc_len="
                f"{cross[0][1]}; cross-attention layers share one encoder length per slot"
            )
    return specs

class KVCache:
    """Slot-indexed serving KV cache, contiguous or paged (``spec/slot-cache.md``).

    Build it with :meth:`make`; ``KVCache()`` raises ``TypeError``.

    Storage (``spec/slot-cache.md`` §1), all allocated once by ``make``:

    * ATTENTION / SLIDING_WINDOW, contiguous: K and V
      ``[max_seqs, max_seq_len, kv_heads, head_dim]``; paged: K and V pools
      ``[num_blocks, block_size, kv_heads, head_dim]`` addressed through one
      block table int32 ``[max_seqs, max_blocks_per_seq]`` (block 0 is null).
    * CROSS_ATTENTION: K and V planes ``[max_seqs, max_enc_len, kv_heads, head_dim]``.
    * STATE: ``conv_state(l, i)`` ``[max_seqs, conv_dims[i], conv_width]`` and
      ``recurrent_state(l)`` ``[max_seqs, heads, k_dim, v_dim]``.

    K/V are in ``config.dtype``, state slabs in ``config.state_dtype``. An FP8
    ``config.dtype`` (``float8_e4m3fn``, ``float8_e5m2``) adds float32 scales per
    (block, layer, K/V, kv head), :meth:`scales` (``spec/slot-cache.md`` §10).
    Speculative decoding: :meth:`checkpoint_state` before a verification step,
    :meth:`restore_state` after a rejection (``spec/slot-cache.md`` §11). Beam search
    and ``n > 1`` sampling: :meth:`fork` copies a slot copy-on-write (``spec/slot-cache.md``
    §12). Padded batches: :meth:`admit` and :meth:`retire` take ``pad_token_id`` or
    ``attention_mask`` so pads never enter a prefix hash (``spec/slot-cache.md`` §13).

    Examples
    --------
    >>> from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec
    >>> cfg = KVCacheConfig(num_layers=1, max_seqs=2, max_seq_len=8,
    ...                     mode=KVCacheMode.PAGED, block_size=4)
    >>> cache = KVCache.make(cfg, [KVLayerSpec.attention(kv_heads=1, head_dim=2)])
    >>> step = cache.prepare_step([0, 3], [0], [1])
    >>> step.slot_mapping.tolist()
    [4, 5, 6]
    >>> cache.update_position(1, 3)
    >>> cache.seq_lens().tolist()
    [0, 3]
    """

    def __init__(self, *args, **kwargs):
        raise TypeError("KVCache() cannot be constructed directly; use KVCache.make(config, layer_specs)")

    # ------------------------------------------------------------------ construction

    @classmethod
    def make(cls, config: KVCacheConfig, layer_specs: Sequence[KVLayerSpec], *,
             clock: Callable[[], float] | None = None) -> "KVCache":
        """Allocate a cache: every buffer once, all slots empty, all blocks free.

        Parameters
        ----------
        config : KVCacheConfig
            Sizes and options; ``config.device`` must be ``"cpu"`` (kvref is NumPy).
        layer_specs : sequence of KVLayerSpec
            One per layer, ``len(layer_specs) == config.num_layers``.
        clock : callable() -> float, optional
            Seconds for retention time-to-live (``time.monotonic`` by default;
            spec/slot-cache.md §4.5).

        Returns
        -------
        KVCache

        Raises
        ------
        TypeError
            ``config`` is not a ``KVCacheConfig`` or a layer spec is not a ``KVLayerSpec``.
        ValueError
            Wrong number of layer specs, or a non-CPU device.
        """
        api = "KVCache.make"
        specs = check_make_args(api, config, layer_specs)
        clock = _retention.check_clock(api, clock)
        engine = cls.make_engine(config)
        self = object.__new__(cls)
        self._init_storage(config, specs, engine)
        self._clock = clock  # spec/slot-cache.md §4.5
        if self._pool is not None:
            self._pool.clock = clock
        return self

    @classmethod
    def make_engine(cls, config: KVCacheConfig) -> SlotEngine:
        """The mechanisms a cache of this class runs on; called once by :meth:`make`.

        The policy (this class) is the same in every backend; a backend
        subclasses ``KVCache`` and overrides this method to run the policy on
        its own ``kvspec.engine.SlotEngine`` (``kvfast.KVCache`` does).

        Parameters
        ----------
        config : KVCacheConfig
            The validated configuration (the engine reads ``device``).

        Returns
        -------
        kvspec.engine.SlotEngine
            Here the reference engine (NumPy, CPU).

        Raises
        ------
        ValueError
            ``config.device`` is not ``"cpu"`` (kvref is NumPy; CUDA storage is kvfast's).
        """
        # spec/slot-cache.md §1: kvref is pure NumPy; CUDA storage is kvfast's.
        if parse_device("KVCache.make", config.device)[0] != "cpu":
            raise ValueError(f"KVCache.make: config.device={config.device!r}, kvref stores on 'cpu' only (use kvfast)")
        return ReferenceSlotEngine()

    def _init_storage(self, config: KVCacheConfig, specs: tuple[KVLayerSpec, ...], engine: SlotEngine) -> None:
        self._engine = engine
        self._config = config
        self._specs = specs
        self._paged = config.mode is KVCacheMode.PAGED
        S, L = config.max_seqs, config.max_seq_len
        kv_dt, st_dt = config.np_dtype, config.np_state_dtype
        zeros = engine.zeros
        #: layer -> (K, V) for attention, sliding and cross layers
        self._kv: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        #: layer -> list of conv slabs; layer -> recurrent slab or None
        self._conv: dict[int, list[np.ndarray]] = {}
        self._rec: dict[int, np.ndarray | None] = {}
        for l, spec in enumerate(specs):
            if spec.kind in _ATTN_KINDS:
                if self._paged:
                    shape = (config.resolved_num_blocks, config.block_size, spec.kv_heads, spec.head_dim)
                else:
                    shape = (S, L, spec.kv_heads, spec.head_dim)
                self._kv[l] = (zeros(shape, kv_dt), zeros(shape, kv_dt))
            elif spec.kind is LayerKind.CROSS_ATTENTION:
                shape = (S, spec.max_enc_len, spec.kv_heads, spec.head_dim)
                self._kv[l] = (zeros(shape, kv_dt), zeros(shape, kv_dt))
            else:
                self._conv[l] = [zeros((S, d, spec.conv_width), st_dt) for d in spec.conv_dims]
                self._rec[l] = None if spec.recurrent is None else zeros((S, *spec.recurrent), st_dt)
        self._has_state = bool(self._conv)
        #: every state slab (conv slabs in layer and index order, then the recurrent slab, layer by
        #: layer: the checkpoint order of spec/slot-cache.md §4.3) and every cross plane
        self._slabs: list = []
        for l in sorted(self._conv):
            self._slabs.extend(self._conv[l])
            if self._rec[l] is not None:
                self._slabs.append(self._rec[l])
        self._cross_planes: list = [a for l, sp in enumerate(specs) if sp.kind is LayerKind.CROSS_ATTENTION
                                    for a in self._kv[l]]
        # spec/slot-cache.md §10.1: an FP8 cache keeps one float32 scale per (unit of block_size
        # positions, layer, K/V, kv head): paged layers per block, contiguous rows and cross planes
        # per slot and row block. 0 means "never written since the unit was (re)allocated".
        self._fp8 = is_fp8(config.dtype)
        #: layer -> (K scales, V scales), FP8 caches only
        self._scales: dict[int, tuple] = {}
        #: scale buffers indexed by block id (paged attention layers): zeroed when a block is allocated
        self._block_scales: list = []
        #: scale buffers indexed by slot (contiguous attention layers, cross layers): zeroed with the slot
        self._slot_scales: list = []
        if self._fp8:
            P = config.block_size
            for l, spec in enumerate(specs):
                if spec.kind in _ATTN_KINDS and self._paged:
                    shape = (config.resolved_num_blocks, spec.kv_heads)
                elif spec.kind in _ATTN_KINDS:
                    shape = (S, config.max_blocks_per_seq, spec.kv_heads)
                elif spec.kind is LayerKind.CROSS_ATTENTION:
                    shape = (S, -(-spec.max_enc_len // P), spec.kv_heads)
                else:
                    continue
                pair = (zeros(shape, np.float32), zeros(shape, np.float32))
                self._scales[l] = pair
                (self._block_scales if len(shape) == 2 else self._slot_scales).extend(pair)
        #: spec/slot-cache.md §11: slot -> (position, state slab copies) saved by checkpoint_state
        self._spec_checkpoints: dict[int, tuple[int, list]] = {}
        self._seq = np.zeros(S, np.int32)
        #: encoder length per slot (0 = not filled); shared by all cross layers
        self._enc = np.zeros(S, np.int64)
        if self._paged:
            self._pool = engine.block_pool(config.resolved_num_blocks, self._on_evict)
            self._table: np.ndarray | None = np.zeros((S, config.max_blocks_per_seq), np.int32)
        else:
            self._pool = None
            self._table = None
        #: blocks held per slot (live columns) and adopted (shared) columns per slot
        self._nblk = np.zeros(S, np.int64)
        self._nshared = np.zeros(S, np.int64)
        #: leading columns never written again (spec/slot-cache.md §12): the adopted ones and those
        #: a fork shares copy-on-write; ``nshared <= nfrozen <= nblk``; the rewind floor of spec/slot-cache.md §2.6
        self._nfrozen = np.zeros(S, np.int64)
        #: published hash -> parent hash, so check_invariants can recompute the chain
        self._parents: dict[bytes, bytes] = {}
        #: state checkpoints: block hash -> copies of the state slabs, LRU first
        self._checkpoints: OrderedDict[bytes, list[np.ndarray]] = OrderedDict()
        #: slot -> blocks of its last prepared (not yet committed) write set
        self._write_sets = engine.write_sets(S)

    # ------------------------------------------------------------------ properties and accessors

    @property
    def config(self) -> KVCacheConfig:
        """The configuration given to ``make``."""
        return self._config

    @property
    def layer_specs(self) -> tuple[KVLayerSpec, ...]:
        """The layer specs given to ``make``, as a tuple."""
        return self._specs

    @property
    def engine(self) -> SlotEngine:
        """The ``kvspec.engine.SlotEngine`` this cache runs on (chosen by :meth:`make_engine`)."""
        return self._engine

    def mode(self) -> KVCacheMode:
        """``KVCacheMode.CONTIGUOUS`` or ``KVCacheMode.PAGED``."""
        return self._config.mode

    def _layer(self, api: str, layer, kinds: tuple[LayerKind, ...]) -> int:
        layer = _check_index(api, "layer", layer, len(self._specs))
        kind = self._specs[layer].kind
        if kind not in kinds:
            want = " or ".join(k.name for k in kinds)
            raise TypeError(f"{api}: layer={layer} is {kind.name}, must be {want}")
        return layer

    def keys(self, layer: int) -> np.ndarray:
        """Live K storage of an attention, sliding-window or cross layer.

        Parameters
        ----------
        layer : int
            ``0 <= layer < num_layers``.

        Returns
        -------
        ndarray, config.dtype
            Contiguous ``[max_seqs, max_seq_len, kv_heads, head_dim]``, paged
            ``[num_blocks, block_size, kv_heads, head_dim]``, cross
            ``[max_seqs, max_enc_len, kv_heads, head_dim]``. The same object on
            every call, also after ``reset()``.

        Raises
        ------
        IndexError
            ``layer`` out of range.
        TypeError
            A STATE layer (or a non-int ``layer``).
        """
        return self._kv[self._layer("keys", layer, _KV_KINDS)][0]

    def values(self, layer: int) -> np.ndarray:
        """Live V storage; same shapes, errors and identity as :meth:`keys`."""
        return self._kv[self._layer("values", layer, _KV_KINDS)][1]

    def scales(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Live FP8 scales ``(K scales, V scales)`` of an attention, sliding-window or cross layer.

        ``spec/slot-cache.md`` §10: stored value ``x`` at a position of unit ``u`` and head ``h``
        stands for ``float32(x) * scales[u, h]``; a unit is ``block_size`` positions.

        Returns
        -------
        K scales, V scales : float32
            Paged ATTENTION/SLIDING_WINDOW ``[num_blocks, kv_heads]`` (per block); contiguous
            ``[max_seqs, max_blocks_per_seq, kv_heads]``; CROSS_ATTENTION
            ``[max_seqs, ceil(max_enc_len / block_size), kv_heads]``. Powers of two, or 0 for a
            unit never written since it was allocated. The same objects on every call.

        Raises
        ------
        RuntimeError
            ``config.dtype`` is not an FP8 dtype (no scales).
        IndexError
            ``layer`` out of range.
        TypeError
            A STATE layer (or a non-int ``layer``).
        """
        api = "scales"
        if not self._fp8:
            raise RuntimeError(f"{api}: config.dtype={self._config.dtype!r} has no scales, "
                               "needs 'float8_e4m3fn' or 'float8_e5m2'")
        return self._scales[self._layer(api, layer, _KV_KINDS)]

    def conv_state(self, layer: int, index: int = 0) -> np.ndarray:
        """Live conv state ``[max_seqs, conv_dims[index], conv_width]`` (config.state_dtype).

        Holds the last ``conv_width`` inputs, newest at ``[..., conv_width - 1]``.

        Raises
        ------
        IndexError
            ``layer`` or ``index`` out of range.
        TypeError
            Not a STATE layer.
        """
        layer = self._layer("conv_state", layer, (LayerKind.STATE,))
        slabs = self._conv[layer]
        return slabs[_check_index("conv_state", "index", index, len(slabs))]

    def recurrent_state(self, layer: int) -> np.ndarray:
        """Live recurrent state ``[max_seqs, heads, k_dim, v_dim]`` (config.state_dtype).

        Raises
        ------
        IndexError
            ``layer`` out of range.
        TypeError
            Not a STATE layer, or a STATE layer built with ``recurrent=None``.
        """
        layer = self._layer("recurrent_state", layer, (LayerKind.STATE,))
        rec = self._rec[layer]
        if rec is None:
            # spec/slot-cache.md §2.4: no recurrent slab is a missing storage kind, like a wrong layer kind.
            raise TypeError(f"recurrent_state: layer={layer} is STATE with recurrent=None, has no recurrent state")
        return rec

    def seq_lens(self) -> np.ndarray:
        """Committed length of every slot, int32 ``[max_seqs]`` (a copy)."""
        return self._seq.copy()

    def paged_block_table(self) -> np.ndarray | None:
        """The block table int32 ``[max_seqs, max_blocks_per_seq]`` (a copy), None when contiguous.

        Row s holds the slot's blocks in columns ``[0, nblk)`` (each >= 1);
        later columns are 0, the null block.
        """
        return None if self._table is None else self._table.copy()

    def _free_order(self) -> list[int]:
        """The free list front to back (the order allocation pops); [] when contiguous. For tests."""
        return [] if self._pool is None else self._pool.free_order()

    def _capacity(self, slot: int) -> int:
        if self._paged:
            return min(int(self._nblk[slot]) * self._config.block_size, self._config.max_seq_len)
        return self._config.max_seq_len

    def _require_paged(self, api: str) -> None:
        if not self._paged:
            raise RuntimeError(f"{api}: mode={self._config.mode.name}, needs PAGED")

    # ------------------------------------------------------------------ lifecycle

    def update_position(self, batch_idx: int, new_pos: int) -> None:
        """Set ``seq_lens()[batch_idx] = new_pos``: commit a step or roll back. Bookkeeping only.

        Parameters
        ----------
        batch_idx : int
            Slot, ``0 <= batch_idx < max_seqs``.
        new_pos : int
            ``0 <= new_pos <= capacity`` (paged: blocks held * block_size, at
            most max_seq_len; contiguous: max_seq_len) and, paged, not below
            the slot's adopted prefix ``nshared * block_size``.

        Raises
        ------
        IndexError
            ``batch_idx`` out of range.
        TypeError
            A non-int argument.
        ValueError
            ``new_pos`` out of bounds; state is unchanged.
        """
        api = "update_position"
        b = _check_index(api, "batch_idx", batch_idx, self._config.max_seqs)
        pos = _check_scalar(api, "new_pos", new_pos)
        if pos < 0:
            raise ValueError(f"{api}: new_pos={pos} < 0")
        cap = self._capacity(b)
        if pos > cap:
            raise ValueError(f"{api}: new_pos={pos} > capacity={cap} of slot {b}")
        shared = int(self._nfrozen[b]) * self._config.block_size
        if pos < shared:
            # spec/slot-cache.md §2.6, §12: positions below the adopted (or fork-shared) prefix live in shared
            # blocks; rewriting them is forbidden.
            raise ValueError(f"{api}: new_pos={pos} < shared prefix={shared} of slot {b}")
        # spec/slot-cache.md §2.6: shrinking keeps the blocks (capacity stays); nothing is zeroed or freed.
        self._seq[b] = pos
        self._write_sets.pop(b)

    # ------------------------------------------------------------------ speculative decoding (spec/slot-cache.md §11)

    def checkpoint_state(self, batch_idx: int) -> int:
        """Save a slot's length and state slabs before a speculative step; returns the length.

        ``spec/slot-cache.md`` §11: checkpoint before the step that verifies
        draft tokens; after verification :meth:`restore_state` brings the
        slot back to this point when drafts were rejected (then the accepted
        tokens are fed again as an ordinary step). One checkpoint per slot: a
        second call replaces the first. Works on every cache (without STATE
        layers only the length is kept).

        Parameters
        ----------
        batch_idx : int
            Slot, ``0 <= batch_idx < max_seqs``.

        Returns
        -------
        int
            ``seq_lens()[batch_idx]``, the position the checkpoint restores.

        Raises
        ------
        IndexError
            ``batch_idx`` out of range.
        TypeError
            A non-int ``batch_idx``. State is unchanged.
        """
        b = _check_index("checkpoint_state", "batch_idx", batch_idx, self._config.max_seqs)
        pos = int(self._seq[b])
        self._spec_checkpoints[b] = (pos, self._engine.save_rows(self._slabs, b))
        return pos

    def restore_state(self, batch_idx: int) -> int:
        """Roll a slot back to its :meth:`checkpoint_state`: state slabs and length.

        Copies the saved slab rows back and sets ``seq_lens()[batch_idx]`` to the
        saved position (bookkeeping like :meth:`update_position`: K/V bytes and
        blocks stay). The checkpoint is kept (restoring twice is allowed) until
        the next ``checkpoint_state``, ``evict_batch``, ``retire``, ``admit`` or
        ``reset``.

        Returns
        -------
        int
            The restored length.

        Raises
        ------
        IndexError
            ``batch_idx`` out of range.
        TypeError
            A non-int ``batch_idx``.
        ValueError
            The slot has no checkpoint. State is unchanged.
        """
        api = "restore_state"
        b = _check_index(api, "batch_idx", batch_idx, self._config.max_seqs)
        got = self._spec_checkpoints.get(b)
        if got is None:
            raise ValueError(f"{api}: batch_idx={b} has no state checkpoint (call checkpoint_state before the "
                             "speculative step)")
        pos, saved = got
        # spec/slot-cache.md §11: pos is within capacity and above the adopted prefix (neither moves while
        # the checkpoint lives: capacity never shrinks, and admit/evict/retire drop it).
        self._engine.restore_rows(self._slabs, b, saved)
        self._seq[b] = pos
        self._write_sets.pop(b)
        return pos

    def state_checkpoint_position(self, batch_idx: int) -> int:
        """The position saved by the slot's :meth:`checkpoint_state`, or -1 when it has none.

        Raises
        ------
        IndexError, TypeError
            ``batch_idx`` out of range or not an int.
        """
        b = _check_index("state_checkpoint_position", "batch_idx", batch_idx, self._config.max_seqs)
        got = self._spec_checkpoints.get(b)
        return -1 if got is None else got[0]

    def evict_batch(self, batch_idx: int) -> None:
        """Return a slot to empty. Idempotent; publishes nothing.

        Length and encoder length become 0, the slot's cross planes and state
        slabs are zeroed, its blocks are released tail first (published ones
        stay retained for reuse).

        Raises
        ------
        IndexError
            ``batch_idx`` out of range; state is unchanged.
        """
        b = _check_index("evict_batch", "batch_idx", batch_idx, self._config.max_seqs)
        self._release(b)

    def _release(self, b: int) -> None:
        """Free slot ``b``: blocks tail first, zero its cross planes and state slabs."""
        if self._paged:
            n = int(self._nblk[b])
            # spec/slot-cache.md §5: release tail first, so a chain's tail is evicted before its head.
            self._engine.release_blocks(self._pool, self._table[b, :n][::-1])
            self._table[b, :] = NULL_BLOCK
        self._nblk[b] = 0
        self._nshared[b] = 0
        self._nfrozen[b] = 0
        self._seq[b] = 0
        self._enc[b] = 0
        # spec/slot-cache.md §10.4: a slot's row scales go with it (contiguous rows, cross planes).
        self._engine.zero_rows(self._cross_planes + self._slabs + self._slot_scales, b)
        self._write_sets.pop(b)
        self._spec_checkpoints.pop(b, None)

    def _zero_state(self, b: int) -> None:
        self._engine.zero_rows(self._slabs, b)

    def reset(self) -> None:
        """Back to the state ``make`` produced, in place: buffers keep their identity.

        All storage zeroed, every slot empty, every block free in ascending
        order, the prefix index and state checkpoints emptied.
        """
        for k, v in self._kv.values():
            k[...] = 0
            v[...] = 0
        for l in self._conv:
            for slab in self._conv[l]:
                slab[...] = 0
            if self._rec[l] is not None:
                self._rec[l][...] = 0
        for ks, vs in self._scales.values():
            ks[...] = 0
            vs[...] = 0
        self._spec_checkpoints.clear()
        self._seq[:] = 0
        self._enc[:] = 0
        self._nblk[:] = 0
        self._nshared[:] = 0
        self._nfrozen[:] = 0
        if self._paged:
            self._table[...] = NULL_BLOCK
            self._pool.reset()
        self._parents.clear()
        self._checkpoints.clear()
        self._write_sets.clear()

    def fill(self, layer: int, batch_idx: int, k, v) -> None:
        """Write a slot's encoder K/V into a cross layer's planes and zero the rest.

        Parameters
        ----------
        layer : int
            A CROSS_ATTENTION layer.
        batch_idx : int
            Slot.
        k, v : float [t_enc, kv_heads, head_dim]
            ``1 <= t_enc <= max_enc_len``; cast to ``config.dtype``.

        Notes
        -----
        Does not change ``seq_lens()``. Sets the slot's encoder length
        (``StepIndices.cross_seqused_k``), shared by all cross layers.

        Raises
        ------
        IndexError
            ``layer`` or ``batch_idx`` out of range.
        TypeError
            Not a cross layer, or ``k``/``v`` not floating.
        ValueError
            Shapes wrong, ``t_enc`` out of range, or ``t_enc`` differs from the
            slot's filled length before eviction. State is unchanged.
        """
        api = "fill"
        layer = self._layer(api, layer, (LayerKind.CROSS_ATTENTION,))
        b = _check_index(api, "batch_idx", batch_idx, self._config.max_seqs)
        spec = self._specs[layer]
        k = _float_tensor(api, "k", k, "[t_enc, kv_heads, head_dim]")
        v = _float_tensor(api, "v", v, "[t_enc, kv_heads, head_dim]")
        for name, arr in (("k", k), ("v", v)):
            if arr.ndim != 3 or arr.shape[1:] != (spec.kv_heads, spec.head_dim):
                raise ValueError(
                    f"{api}: {name}.shape={arr.shape}, must be [t_enc, {spec.kv_heads}, {spec.head_dim}]"
                )
        if k.shape != v.shape:
            raise ValueError(f"{api}: v.shape={v.shape} != k.shape={k.shape}")
        t = k.shape[0]
        if not 1 <= t <= spec.max_enc_len:
            raise ValueError(f"{api}: t_enc={t} out of range [1, {spec.max_enc_len}]")
        if self._enc[b] and self._enc[b] != t:
            raise ValueError(f"{api}: t_enc={t} != {int(self._enc[b])} already filled for slot {b}")
        K, V = self._kv[layer]
        if self._fp8:
            self._fill_fp8(api, layer, b, k, v)
        else:
            self._engine.fill_plane(K, b, k)
            self._engine.fill_plane(V, b, v)
        self._enc[b] = t

    def _fill_fp8(self, api: str, layer: int, b: int, k, v) -> None:
        """spec/slot-cache.md §10.3: a fill quantises the plane afresh (its units' scales restart from 0)."""
        engine = self._engine
        k = engine.kv_input_float32(api, "k", k)
        v = engine.kv_input_float32(api, "v", v)
        for name, x in (("k", k), ("v", v)):
            bad = engine.first_nonfinite(x)
            if bad >= 0:
                raise ValueError(f"{api}: {name}[{bad}] has a non-finite value, FP8 storage needs finite inputs")
        # ---- commit (nothing below can fail)
        K, V = self._kv[layer]
        Ks, Vs = self._scales[layer]
        engine.zero_rows([K, V, Ks, Vs], b)
        t = k.shape[0]
        sm = b * K.shape[1] + np.arange(t, dtype=np.int64)
        engine.scatter_kv_fp8(K, V, Ks, Vs, k, v, sm, self._config.block_size)

    # ------------------------------------------------------------------ steps

    def _check_slots(self, api: str, slots: np.ndarray) -> None:
        code, i, j = self._engine.check_slots(slots, self._config.max_seqs)
        if code != STEP_OK:
            self._raise_slot(api, code, slots, i, j)

    def _raise_slot(self, api: str, code: int, slots: np.ndarray, i: int, j: int) -> None:
        if code == STEP_SLOT_RANGE:
            raise IndexError(f"{api}: slot_ids[{i}]={slots[i]} out of range [0, {self._config.max_seqs})")
        raise ValueError(f"{api}: slot_ids[{i}]={slots[i]} duplicates slot_ids[{j}]")

    def _grow(self, api: str, slots: np.ndarray, add: np.ndarray, total: int) -> None:
        """All-or-nothing: append ``add[i]`` fresh blocks to row ``slots[i]``, rows in order."""
        free = self._pool.num_free
        if total > free:
            raise CapacityError(f"{api}: needs {total} blocks, {free} free or evictable")
        # spec/slot-cache.md §5: one pop from the front for the whole step, handed out in row order.
        blocks = self._engine.grow_rows(self._pool, slots, add, total, self._table, self._nblk)
        if self._block_scales:
            # spec/slot-cache.md §10.4: a block starts its new life unwritten (scale 0).
            self._engine.zero_index_rows(self._block_scales, blocks)

    def prepare_step(self, cu_seqlens_q, past_len, slot_ids) -> StepIndices:
        """Validate a step, reserve its blocks (paged, all or nothing) and return its indices.

        Does **not** advance ``seq_lens()``; commit with ``update_position``. Rows of
        different lengths are packed (varlen), so a batch needs no pad tokens: give each
        row its own query length, and pads take no position and no block
        (spec/slot-cache.md §13).

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
            ``spec/slot-cache.md`` §3.

        Raises
        ------
        TypeError
            A non-integer array (floats are refused).
        ValueError
            Wrong ndim or lengths, ``cu_seqlens_q[0] != 0``, non-increasing
            offsets, a duplicate slot, ``past_len[b] != seq_lens()[slot_b]``.
        IndexError
            A slot out of range.
        CapacityError
            ``past + q > max_seq_len`` (tested as ``q > max_seq_len - past``, so
            no value wraps), ``sum(past + q) > 2**31 - 1`` (int32
            ``cu_seqlens_k``), or (paged) not enough free or evictable blocks.
            State is unchanged.
        """
        api = "prepare_step"
        cu = _int_vector(api, "cu_seqlens_q", cu_seqlens_q)
        past = _int_vector(api, "past_len", past_len)
        slots = _int_vector(api, "slot_ids", slot_ids)
        B = slots.shape[0]
        if cu.shape[0] != B + 1:
            raise ValueError(f"{api}: len(cu_seqlens_q)={cu.shape[0]} != len(slot_ids)+1={B + 1}")
        if past.shape[0] != B:
            raise ValueError(f"{api}: len(past_len)={past.shape[0]} != len(slot_ids)={B}")
        cfg = self._config
        # spec/slot-cache.md §2.8: the engine finds the first offender in the spec's check order; the message is
        # ours. One engine call checks the step, counts its new blocks and, when it needs none, builds it.
        code, i, j, add, total, step = self._engine.plan_step(
            cu, past, slots, self._seq, self._nblk, self._table, self._enc, cfg.max_seqs, cfg.max_seq_len,
            cfg.block_size)
        if code != STEP_OK:
            self._raise_step(api, code, cu, past, slots, i, j)
        if step is None:  # paged, and the step needs `total` new blocks: all or nothing, then its indices
            self._grow(api, slots, add, total)
            step = self._engine.build_step(cu, past, slots, self._table, self._enc, cfg.block_size, cfg.max_seq_len)
        if self._paged:
            self._write_sets.record(slots, step, cfg.block_size)
        return step

    def _raise_step(self, api: str, code: int, cu, past, slots, i: int, j: int) -> None:
        """The message of ``check_step``'s finding (spec/slot-cache.md §2.8, in check order)."""
        if code == STEP_CU0:
            raise ValueError(f"{api}: cu_seqlens_q[0]={cu[0]}, must be 0")
        if code == STEP_NOT_INCREASING:
            raise ValueError(
                f"{api}: cu_seqlens_q[{i}]={cu[i]} <= cu_seqlens_q[{i - 1}]={cu[i - 1]}, must be strictly increasing"
            )
        if code in (STEP_SLOT_RANGE, STEP_SLOT_DUP):
            self._raise_slot(api, code, slots, i, j)
        if code == STEP_PAST_MISMATCH:
            # spec/slot-cache.md §2.8: strict past_len keeps shared blocks out of every write set.
            s = int(slots[i])
            raise ValueError(f"{api}: past_len[{i}]={past[i]} but seq_lens()[slot {s}]={int(self._seq[s])}")
        if code == STEP_TOTAL:
            raise CapacityError(f"{api}: sum(past_len+q_len)={i} > {INT32_MAX} (int32 cu_seqlens_k)")
        # STEP_CAPACITY; Python ints, so the message shows the exact sum (no int64 wrap)
        p, q = int(past[i]), int(cu[i + 1]) - int(cu[i])
        raise CapacityError(f"{api}: past_len[{i}]+q_len[{i}]={p}+{q}={p + q} > max_seq_len={self._config.max_seq_len}")

    def reserve(self, slot_ids, n_new_per_seq) -> np.ndarray:
        """Paged: reserve blocks for ``n_new_per_seq`` more tokens per slot and advance.

        Parameters
        ----------
        slot_ids : int [B]
            Distinct slots in range.
        n_new_per_seq : int [B]
            Tokens to add per slot, ``>= 0``.

        Returns
        -------
        int32 [B]
            The pre-advance lengths (write offsets). ``n = 0`` returns the
            current length and changes nothing for that slot.

        Raises
        ------
        RuntimeError
            Contiguous cache.
        TypeError, ValueError, IndexError
            Bad arrays, negative counts, slots out of range or duplicated.
        CapacityError
            ``seq + n > max_seq_len`` (tested as ``n > max_seq_len - seq``, so no
            value wraps) or not enough blocks. State is unchanged.
        """
        api = "reserve"
        self._require_paged(api)
        slots = _int_vector(api, "slot_ids", slot_ids)
        n_new = _int_vector(api, "n_new_per_seq", n_new_per_seq)
        if n_new.shape[0] != slots.shape[0]:
            raise ValueError(f"{api}: len(n_new_per_seq)={n_new.shape[0]} != len(slot_ids)={slots.shape[0]}")
        self._check_slots(api, slots)
        for i, n in enumerate(n_new.tolist()):
            if n < 0:
                raise ValueError(f"{api}: n_new_per_seq[{i}]={n} < 0")
        L = self._config.max_seq_len
        before = self._seq[slots].astype(np.int64)
        for i, (s, b, n) in enumerate(zip(slots.tolist(), before.tolist(), n_new.tolist())):
            # spec/slot-cache.md §2.9: compared as n > L - seq (0 <= seq <= L), so an n near 2**63 cannot wrap.
            if n > L - b:
                raise CapacityError(f"{api}: seq_lens()[slot {s}]+n_new_per_seq[{i}]={b}+{n}={b + n} > max_seq_len={L}")
        after = before + n_new
        add, total = self._engine.blocks_needed(slots, after, self._nblk, self._config.block_size)
        self._grow(api, slots, add, total)
        for s, a, n in zip(slots.tolist(), after.tolist(), n_new.tolist()):
            if n:
                self._seq[s] = a
                self._write_sets.pop(s)
        return before.astype(np.int32)

    # ------------------------------------------------------------------ prefix reuse

    def _on_evict(self, h: bytes) -> None:
        """BlockPool listener: a published block was evicted; its chain link and checkpoint go."""
        self._parents.pop(h, None)
        # spec/slot-cache.md §4.4: a checkpoint lives only while the block that ends at its boundary is hittable.
        self._checkpoints.pop(h, None)

    def _chain(self, tokens: np.ndarray, n_blocks: int) -> list[bytes]:
        cfg = self._config
        return block_hashes(tokens, cfg.block_size, cfg.hash_algo, hash_seed=cfg.hash_seed, num_blocks=n_blocks)

    def admit(self, batch_idx: int, prompt_ids, addressable_len: int = -1, *,
              retention_priority: int = _retention.DEFAULT_PRIORITY, retention_seconds: float | None = None,
              pad_token_id: int | None = None, attention_mask=None) -> int:
        """Paged: adopt the longest cached prefix of ``prompt_ids`` into an empty slot.

        Hit = the longest run of leading full blocks whose chained hash is
        published **and** whose stored tokens equal the prompt's, capped at
        ``len(prompt) - 1`` (or ``min(addressable_len, len(prompt))``), whole
        blocks only; with STATE layers cut to the deepest boundary that has a
        state checkpoint, which is restored (else the slot's state is zeroed).
        Cross planes are never reused.

        Parameters
        ----------
        batch_idx : int
            An empty slot (``seq_lens()[b] == 0`` and no blocks held).
        prompt_ids : int [N]
            ``N >= 1`` token ids (int32 range).
        addressable_len : int
            ``-1`` for the default cap ``N - 1``; else ``>= 0``.
        retention_priority : int, keyword-only
            ``0 .. 100`` (35): claim merged into the adopted blocks (spec/slot-cache.md §4.5).
        retention_seconds : float or None, keyword-only
            Time-to-live of the claim from this call (``None``: until evicted).
        pad_token_id : int or None, keyword-only
            Left padding (spec/slot-cache.md §13): the leading run of this id is not part of
            the prompt; the hit is over the tokens after it, and ``addressable_len`` counts them.
        attention_mask : int or bool [N] or None, keyword-only
            transformers' mask (1 = token, 0 = pad): only the tokens under a 1 are the prompt.
            At most one of ``pad_token_id`` and ``attention_mask``.

        Returns
        -------
        int
            The hit, a multiple of ``block_size``; also the new ``seq_lens()[b]``. It counts
            prompt tokens without pads: the step that follows computes ``prompt[hit:]`` of the
            unpadded prompt, so pads take no position and no block.

        Raises
        ------
        RuntimeError
            Contiguous cache.
        IndexError
            ``batch_idx`` out of range.
        TypeError
            Non-integer arguments.
        ValueError
            Slot not empty, empty prompt (also once pads are removed), ``addressable_len < -1``,
            both or a malformed ``pad_token_id`` / ``attention_mask``. State is unchanged.
        """
        api = "admit"
        self._require_paged(api)
        b = _check_index(api, "batch_idx", batch_idx, self._config.max_seqs)
        tokens = _token_vector(api, "prompt_ids", prompt_ids)
        addr = _check_scalar(api, "addressable_len", addressable_len)
        if tokens.shape[0] == 0:
            raise ValueError(f"{api}: len(prompt_ids)=0, must be >= 1")
        n_in = tokens.shape[0]
        tokens = _strip_pads(api, "prompt_ids", tokens, pad_token_id, attention_mask)  # spec/slot-cache.md §13
        if tokens.shape[0] == 0:
            raise ValueError(f"{api}: prompt_ids holds {n_in} pads and no token, must hold >= 1 token")
        if addr < -1:
            raise ValueError(f"{api}: addressable_len={addr} < -1 (-1 means len(prompt_ids)-1)")
        prio = _retention.check_priority(api, retention_priority)  # spec/slot-cache.md §4.5
        secs = _retention.check_seconds(api, retention_seconds)
        if self._seq[b] != 0 or self._nblk[b] != 0:
            raise ValueError(f"{api}: batch_idx={b} holds seq_len={int(self._seq[b])} and {int(self._nblk[b])} blocks, must be empty")
        P = self._config.block_size
        # spec/slot-cache.md §4.1: at least one token must be computed for logits, so the default cap is len-1.
        limit = tokens.shape[0] - 1 if addr == -1 else min(addr, tokens.shape[0])
        hits: list[int] = []
        hashes: list[bytes] = []
        if self._config.enable_prefix_caching:
            hashes = self._chain(tokens, limit // P)
            for i, h in enumerate(hashes):
                blk = self._pool.lookup(h, tokens[i * P : (i + 1) * P])
                if blk is None:
                    break
                hits.append(blk)
        checkpoint = None
        if self._has_state:
            # spec/slot-cache.md §4.3: a hybrid hit is valid only where a state checkpoint exists.
            k = len(hits)
            while k > 0 and hashes[k - 1] not in self._checkpoints:
                k -= 1
            hits = hits[:k]
            if k:
                checkpoint = hashes[k - 1]
        if hits:
            # spec/manager.md §14.7: the clock is read (and its reading checked) before any change,
            # once: the pool's own reading below is the same instant
            with _retention.held(self._clock):
                expiry = _retention.expiry_of(secs, self._clock)
                self._admit_hits(b, hits, prio, expiry)
        self._nblk[b] = len(hits)
        self._nshared[b] = len(hits)
        self._nfrozen[b] = len(hits)
        self._seq[b] = len(hits) * P
        self._write_sets.pop(b)
        self._spec_checkpoints.pop(b, None)  # spec/slot-cache.md §11: admit starts a new sequence
        if checkpoint is None:
            self._zero_state(b)
        else:
            self._checkpoints.move_to_end(checkpoint)
            self._restore_state(b, self._checkpoints[checkpoint])
        return len(hits) * P

    def _admit_hits(self, b: int, hits: list[int], prio: int, expiry: float) -> None:
        """Slot ``b`` adopts the hit blocks (one reference each) and claims them (spec/slot-cache.md §4.5)."""
        for col, blk in enumerate(hits):
            self._pool.touch(blk)
            self._table[b, col] = blk
        self._pool.set_retention(hits, prio, expiry)

    def _restore_state(self, b: int, saved: list[np.ndarray]) -> None:
        self._engine.restore_rows(self._slabs, b, saved)

    def retire(self, batch_idx: int, full_token_ids, addressable_len: int = -1, *,
               retention_priority: int = _retention.DEFAULT_PRIORITY, retention_seconds: float | None = None,
               pad_token_id: int | None = None, attention_mask=None) -> None:
        """Paged: publish a finished slot's full blocks for reuse, then free it like ``evict_batch``.

        ``a = min(len(full_token_ids), seq_lens()[b])`` (or ``addressable_len``).
        Every full block below ``a`` is published under its chained hash; a
        block whose content is already published keeps the existing copy and
        ours is freed unpublished. With STATE layers and ``a == seq_len``,
        ``a % block_size == 0``, ``a > 0``, the slot's state slabs are saved as
        a checkpoint keyed by the hash of the block ending at ``a``.

        Parameters
        ----------
        batch_idx : int
            Slot.
        full_token_ids : int [N]
            Every token the session saw (may include a last token never written).
        addressable_len : int
            ``-1`` for the default; else ``0 <= a <= min(N, seq_len)``.
        retention_priority : int, keyword-only
            ``0 .. 100`` (35): claim merged into every published block of the slot
            before it is freed (spec/slot-cache.md §4.5).
        retention_seconds : float or None, keyword-only
            Time-to-live of the claim from this call (``None``: until evicted).
        pad_token_id : int or None, keyword-only
            Left padding (spec/slot-cache.md §13): the leading run of this id is removed from
            ``full_token_ids`` before anything is hashed or published; ``addressable_len``
            counts the tokens after it.
        attention_mask : int or bool [N] or None, keyword-only
            transformers' mask (1 = token, 0 = pad): only the tokens under a 1 are published.
            At most one of ``pad_token_id`` and ``attention_mask``.

        Raises
        ------
        RuntimeError
            Contiguous cache.
        IndexError
            ``batch_idx`` out of range.
        TypeError
            Non-integer arguments.
        ValueError
            ``addressable_len`` out of bounds, ``full_token_ids`` disagree
            with an adopted block that would be published, or both or a malformed
            ``pad_token_id`` / ``attention_mask``. State is unchanged.
        """
        api = "retire"
        self._require_paged(api)
        b = _check_index(api, "batch_idx", batch_idx, self._config.max_seqs)
        tokens = _token_vector(api, "full_token_ids", full_token_ids)
        tokens = _strip_pads(api, "full_token_ids", tokens, pad_token_id, attention_mask)  # spec/slot-cache.md §13
        addr = _check_scalar(api, "addressable_len", addressable_len)
        seq = int(self._seq[b])
        n = tokens.shape[0]
        if addr < -1:
            raise ValueError(f"{api}: addressable_len={addr} < -1 (-1 means min(len(full_token_ids), seq_len))")
        if addr > seq:
            raise ValueError(f"{api}: addressable_len={addr} > seq_lens()[{b}]={seq}")
        if addr > n:
            raise ValueError(f"{api}: addressable_len={addr} > len(full_token_ids)={n}")
        prio = _retention.check_priority(api, retention_priority)  # spec/slot-cache.md §4.5
        secs = _retention.check_seconds(api, retention_seconds)
        a = min(n, seq) if addr == -1 else addr
        P = self._config.block_size
        n_pub = a // P if self._config.enable_prefix_caching else 0
        for col in range(min(int(self._nfrozen[b]), n_pub)):
            # spec/slot-cache.md §2.11: the adopted prefix is fixed; tokens that contradict it would publish a false chain.
            # spec/slot-cache.md §12: so is a block a fork shared, once the other slot's retire published it.
            stored = self._pool.block_tokens[int(self._table[b, col])]
            if stored is None:
                continue  # a fork-shared block nobody published yet (adopted blocks are always published)
            mine = tokens[col * P : (col + 1) * P]
            diff = np.flatnonzero(stored != mine)
            if diff.size:
                j = col * P + int(diff[0])
                what = "adopted" if col < self._nshared[b] else "fork-shared"
                raise ValueError(f"{api}: full_token_ids[{j}]={mine[diff[0]]} but {what} block {col} holds {stored[diff[0]]}")
        hashes = self._chain(tokens, n_pub)
        # spec/manager.md §14.7: the clock is read (and its reading checked) before any change, once:
        # the claim's expiry and the pool's readings while the slot is released are that instant
        with _retention.held(self._clock):
            expiry = _retention.expiry_of(secs, self._clock)
            # ---- commit (nothing below can fail)
            parent = root_hash(self._config.hash_seed)  # spec/slot-cache.md §4: the slot cache's chain has no salt
            for col, h in enumerate(hashes):
                blk = int(self._table[b, col])
                canonical = self._pool.publish(blk, h, tokens[col * P : (col + 1) * P])
                # spec/slot-cache.md §4.2: a twin keeps the existing copy; ours stays unpublished and is freed to the front.
                if canonical == blk and self._pool.block_hash[blk] == h:
                    self._parents[h] = parent
                parent = h
            ncp = self._config.resolved_num_state_checkpoints
            if self._has_state and ncp > 0 and n_pub and a == seq and a % P == 0:
                key = hashes[-1]
                if self._pool.contains_hash(key):
                    self._checkpoints[key] = self._engine.save_rows(self._slabs, b)
                    self._checkpoints.move_to_end(key)
                    while len(self._checkpoints) > ncp:
                        # spec/slot-cache.md §4.3: least recently used checkpoint dropped first.
                        self._checkpoints.popitem(last=False)
            # spec/slot-cache.md §4.5: the claim goes to the slot's published blocks (held, so none moves)
            self._pool.set_retention(self._table[b, : int(self._nblk[b])].tolist(), prio, expiry)
            self._release(b)

    # ------------------------------------------------------------------ fork (spec/slot-cache.md §12)

    def fork(self, src_batch_idx: int, dst_batch_idx: int) -> None:
        """Copy-on-write fork: the empty slot ``dst_batch_idx`` becomes a copy of ``src_batch_idx``.

        For beam search and ``n > 1`` sampling (vLLM's ``fork`` of a sequence,
        SGLang's radix sharing): afterwards both slots hold the same history
        (``seq_lens()`` equal, the same K/V as read by ``gather_kv`` and
        ``varlen_attention``, the same state slabs, cross planes and encoder
        length) and each grows on its own. Paged: the destination's block table
        shares the source's **full** blocks (one more reference each, nothing
        copied) and gets a fresh copy of the partial last block (bytes and, on
        an FP8 cache, scales); shared blocks are never written again by either
        slot, because a step only writes at ``seq_lens()`` and beyond and
        ``update_position`` refuses to roll either slot back into them.
        Contiguous: the slot's rows are copied. The destination has no
        speculation checkpoint (spec/slot-cache.md §11); the source keeps its own.

        Parameters
        ----------
        src_batch_idx : int
            The slot to fork, ``0 <= src_batch_idx < max_seqs`` (it may be empty).
        dst_batch_idx : int
            Another slot, empty (``seq_lens()[dst] == 0`` and no blocks held, as
            for :meth:`admit`).

        Raises
        ------
        TypeError
            A non-int index (bools refused).
        IndexError
            An index out of range.
        ValueError
            ``dst_batch_idx == src_batch_idx``, or the destination is not empty.
        CapacityError
            Paged: no free or evictable block for the copied partial block(s).
            Every raise leaves the cache unchanged.

        Examples
        --------
        >>> from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec
        >>> cfg = KVCacheConfig(num_layers=1, max_seqs=2, max_seq_len=16,
        ...                     mode=KVCacheMode.PAGED, block_size=4)
        >>> cache = KVCache.make(cfg, [KVLayerSpec.attention(kv_heads=1, head_dim=2)])
        >>> _ = cache.prepare_step([0, 6], [0], [0]); cache.update_position(0, 6)
        >>> cache.fork(0, 1)
        >>> cache.paged_block_table()[:, :2].tolist()   # block 1 shared, block 2 copied into 3
        [[1, 2], [1, 3]]
        """
        api = "fork"
        S = self._config.max_seqs
        src = _check_index(api, "src_batch_idx", src_batch_idx, S)
        dst = _check_index(api, "dst_batch_idx", dst_batch_idx, S)
        if dst == src:
            raise ValueError(f"{api}: dst_batch_idx={dst} == src_batch_idx={src}, must be another slot")
        if self._seq[dst] != 0 or self._nblk[dst] != 0:
            raise ValueError(f"{api}: dst_batch_idx={dst} holds seq_len={int(self._seq[dst])} and "
                             f"{int(self._nblk[dst])} blocks, must be empty")
        seq = int(self._seq[src])
        engine = self._engine
        if self._paged:
            P = self._config.block_size
            # spec/slot-cache.md §12: the full blocks below the source's floor are shared. The floor is
            # seq_len, or the source's speculation checkpoint when it lies lower (restore_state may move
            # the source back there, and the blocks above it will be rewritten).
            floor = seq
            got = self._spec_checkpoints.get(src)
            if got is not None:
                floor = min(floor, got[0])
            k = floor // P
            n = -(-seq // P)
            copies = n - k
            free = self._pool.num_free
            if copies > free:
                raise CapacityError(f"{api}: needs {copies} blocks, {free} free or evictable")
            # ---- commit (nothing below can fail)
            shared = self._table[src, :k].tolist()
            for col, blk in enumerate(shared):
                self._pool.touch(blk)
                self._table[dst, col] = blk
            self._nblk[dst] = k
            if copies:
                self._grow(api, np.array([dst], np.int64), np.array([copies], np.int64), copies)
                old = self._table[src, k:n].tolist()
                new = self._table[dst, k:n].tolist()
                paged_kv = [a for l, sp in enumerate(self._specs) if sp.kind in _ATTN_KINDS for a in self._kv[l]]
                for o, d in zip(old, new):
                    engine.restore_rows(paged_kv + self._block_scales, d,
                                        engine.save_rows(paged_kv + self._block_scales, o))
            self._nshared[dst] = self._nshared[src]
            self._nfrozen[dst] = k
            self._nfrozen[src] = max(int(self._nfrozen[src]), k)
            rows = self._cross_planes + self._slabs + self._slot_scales
        else:
            rows = [a for l, sp in enumerate(self._specs) if sp.kind in _ATTN_KINDS for a in self._kv[l]]
            rows += self._cross_planes + self._slabs + self._slot_scales
        if rows:
            engine.restore_rows(rows, dst, engine.save_rows(rows, src))
        self._seq[dst] = seq
        self._enc[dst] = self._enc[src]
        self._write_sets.pop(dst)
        self._spec_checkpoints.pop(dst, None)

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` (``check_invariants: ...``) naming the first broken invariant.

        ``spec/slot-cache.md`` §6: lengths within capacity; paged: live table
        entries non-null and dead ones null, ref count == table references,
        free / retained / in-use partition the non-null blocks, adopted
        blocks published, every published block's hash recomputes from its
        parent and stored tokens, checkpoints keyed by published hashes and
        at most ``num_state_checkpoints``, no shared block in a write set.
        """
        p = "check_invariants"
        cfg = self._config
        S, P = cfg.max_seqs, cfg.block_size
        assert self._seq.dtype == np.int32 and self._seq.shape == (S,), f"{p}: seq_lens dtype={self._seq.dtype} shape={self._seq.shape}"
        for s in range(S):
            seq, cap = int(self._seq[s]), self._capacity(s)
            assert 0 <= seq <= cap, f"{p}: seq_lens()[{s}]={seq} outside [0, capacity={cap}]"
            assert 0 <= self._nshared[s] <= self._nblk[s], f"{p}: slot {s} nshared={self._nshared[s]} > nblk={self._nblk[s]}"
            assert self._nshared[s] * P <= seq, f"{p}: seq_lens()[{s}]={seq} < shared prefix={self._nshared[s] * P}"
            assert self._nshared[s] <= self._nfrozen[s] <= self._nblk[s] and self._nfrozen[s] * P <= seq, (
                f"{p}: slot {s} nfrozen={self._nfrozen[s]} outside [nshared={self._nshared[s]}, "
                f"min(nblk={self._nblk[s]}, seq_lens()[{s}]//{P})] (spec/slot-cache.md §12)")
        for l, spec in enumerate(self._specs):
            if spec.kind is LayerKind.CROSS_ATTENTION:
                for s in range(S):
                    assert 0 <= self._enc[s] <= spec.max_enc_len, f"{p}: enc_len[{s}]={self._enc[s]} > max_enc_len={spec.max_enc_len} of layer {l}"
        for s, (pos, _) in self._spec_checkpoints.items():
            lo, cap = int(self._nfrozen[s]) * P, self._capacity(s)
            assert lo <= pos <= cap, f"{p}: slot {s} state checkpoint at {pos} outside [{lo}, capacity={cap}]"
        for l, pair in self._scales.items():
            for sc in pair:
                host = self._engine.to_host(sc)
                m, _ = np.frexp(host)
                assert ((host == 0) | (m == 0.5)).all(), f"{p}: layer {l} has an FP8 scale that is not 0 or a power of two"
        ncp = cfg.resolved_num_state_checkpoints
        assert len(self._checkpoints) <= ncp, f"{p}: {len(self._checkpoints)} state checkpoints > num_state_checkpoints={ncp}"
        if not self._paged:
            assert not self._checkpoints and not self._parents, f"{p}: contiguous cache holds prefix state"
            return
        refs: dict[int, int] = {}
        for s in range(S):
            n = int(self._nblk[s])
            assert n <= cfg.max_blocks_per_seq, f"{p}: slot {s} holds {n} blocks > max_blocks_per_seq={cfg.max_blocks_per_seq}"
            for c in range(cfg.max_blocks_per_seq):
                blk = int(self._table[s, c])
                if c < n:
                    assert blk != NULL_BLOCK, f"{p}: table[{s}, {c}]=0 but slot {s} holds {n} blocks"
                    refs[blk] = refs.get(blk, 0) + 1
                else:
                    assert blk == NULL_BLOCK, f"{p}: table[{s}, {c}]={blk} beyond slot {s}'s {n} blocks"
            for c in range(int(self._nshared[s])):
                blk = int(self._table[s, c])
                assert self._pool.is_published(blk), f"{p}: adopted block {blk} (slot {s} column {c}) is not published"
        pool = self._pool
        pool.check_invariants(refs)
        free = set(pool.free_order())
        retained = {b for b in free if pool.is_published(b)}
        in_use = set(refs)
        assert len(free) + len(in_use) == pool.num_usable and not (free & in_use), (
            f"{p}: free={len(free)} (retained={len(retained)}) + in_use={len(in_use)} != {pool.num_usable} blocks"
        )
        for h, blk in pool.hash_to_block.items():
            parent = self._parents.get(h)
            assert parent is not None, f"{p}: published block {blk} has no recorded parent hash"
            again = block_hash(parent, pool.block_tokens[blk], cfg.hash_algo)
            assert again == h, f"{p}: published block {blk} tokens hash to {again.hex()[:12]}, index says {h.hex()[:12]}"
        assert set(self._parents) == set(pool.hash_to_block), (
            f"{p}: {len(self._parents)} parent links for {len(pool.hash_to_block)} published blocks"
        )
        for h in self._checkpoints:
            assert h in pool.hash_to_block, f"{p}: state checkpoint {h.hex()[:12]} has no published block"
        for s, blocks in self._write_sets.items():  # the engine's tracker (spec/slot-cache.md §6.7)
            shared = {int(x) for x in self._table[s, : int(self._nfrozen[s])]}
            for blk in blocks:
                assert blk not in shared and not pool.is_published(blk) and pool.ref_count[blk] == 1, (
                    f"{p}: block {blk} in slot {s}'s write set is shared (ref_count={pool.ref_count[blk]}, "
                    f"published={pool.is_published(blk)})"
                )
