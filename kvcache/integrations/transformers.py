"""kvcache inside Hugging Face transformers: torch in, torch out.

Three pieces, all on the CPU and on the public APIs of ``kvref`` / ``kvfast``:

* :class:`SlotKVCache`, a ``transformers.Cache`` over the slot cache
  (``KVCache``), paged or contiguous, with full and sliding-window layers, for
  ``model.generate(cache=SlotKVCache(model.config))`` (``past_key_values=`` is
  the same argument under its older name). One ``prepare_step`` per forward:
  the first layer's ``update`` of a forward opens the step, every layer
  appends its K/V with ``ops.append_kv``, and the last layer's ``update``
  commits the lengths (``update_position``).
* :func:`kvcache_attention`, registered in ``transformers.AttentionInterface``
  as ``"kvcache"`` (:data:`ATTENTION_NAME`) when this module is imported: the
  step's queries attend through the slot cache with ``ops.varlen_attention``,
  so a batch needs no padding (:meth:`SlotKVCache.prepare_packed` packs rows of
  different lengths into one ``[1, T]`` forward).
* :class:`ContinuousBatchingGenerator`, greedy decoding of many prompts over a
  ``PagedKVCacheManager``: prefix reuse across requests, chunked prefill and
  preemption, one packed forward per step.

**Dtype.** The cache stores K/V in the model's dtype: a :class:`SlotKVCache`
allocates its storage at the first ``update`` in the dtype of the key states
the model hands it (float32, float16 or bfloat16), and the generator builds
its manager in ``model.dtype``. Nothing is down-cast; a cache built with an
explicit ``dtype`` that differs from the model's is refused (``TypeError``)
rather than cast. Every tensor returned is a torch tensor of the input's dtype.
"""

from __future__ import annotations

import contextvars
import ctypes
import importlib
import inspect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs
from transformers.masking_utils import AttentionMaskInterface

#: ``memmove(dst, src, nbytes)`` on host addresses (a decode row's K/V into its storage row).
_memmove = ctypes.memmove

__all__ = [
    "ATTENTION_NAME", "SlotKVCache", "kvcache_attention", "register_attention", "layer_windows",
    "ContinuousBatchingGenerator", "GenerationStats",
]

#: The name :func:`kvcache_attention` is registered under (``attn_implementation="kvcache"``).
ATTENTION_NAME = "kvcache"

_BACKENDS = ("kvref", "kvfast")
_MODES = ("paged", "contiguous")
_SCATTERS = ("torch", "ops")
_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

# The cache whose step the next ``kvcache_attention`` call reads (set by every ``update``).
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("kvcache_active_cache", default=None)


# ----------------------------------------------------------------------------- helpers

def _backend(api: str, backend: str):
    if backend not in _BACKENDS:
        raise ValueError(f"{api}: backend={backend!r}, must be one of {list(_BACKENDS)}")
    return importlib.import_module(backend)


def _dtype_name(api: str, dtype) -> str:
    name = _DTYPES.get(dtype)
    if name is None:
        raise TypeError(f"{api}: dtype={dtype}, must be one of torch.float32, torch.float16, torch.bfloat16")
    return name


def _as_torch(arr) -> torch.Tensor:
    """A zero-copy torch view of a cache array (bfloat16 through its 16-bit words)."""
    if isinstance(arr, np.ndarray):
        if arr.dtype.name == "bfloat16":
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(arr)
    from kvfast import interop  # a device array (CuPy): DLPack

    return interop.to_torch(arr)


def _host_words(arr) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """``(4-D, rows [-1, heads, dim])`` NumPy views of a host cache array's words (bfloat16 as int16), or None."""
    if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous or arr.ndim != 4:
        return None
    if arr.dtype.name == "bfloat16":
        arr = arr.view(np.int16)
    return arr, arr.reshape(-1, arr.shape[2], arr.shape[3])


def _attn_implementation(config) -> Optional[str]:
    """``config._attn_implementation``, read from the instance dict where transformers keeps it (a
    plain dict look-up: the config's ``__getattribute__`` costs microseconds, once per forward)."""
    try:   # object's own look-up: the config's ``__getattribute__`` runs even for ``__dict__``
        d = object.__getattribute__(config, "__dict__")
    except AttributeError:
        d = {}
    if "_attn_implementation_internal" in d:
        return d["_attn_implementation_internal"]
    return getattr(config, "_attn_implementation", None)


def _text_config(api: str, config):
    if not hasattr(config, "get_text_config"):
        raise TypeError(f"{api}: config={type(config).__name__}, must be a transformers PretrainedConfig")
    return config.get_text_config(decoder=True)


def layer_windows(config) -> list[Optional[int]]:
    """Per decoder layer, its sliding window (``None`` for full attention), read as transformers reads it.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        A decoder's config (``LlamaConfig``, ``Qwen2Config`` with ``use_sliding_window``,
        ``MistralConfig`` with ``sliding_window``, ...).

    Returns
    -------
    list of (int or None)
        transformers' ``sliding_window=w`` lets position ``p`` see keys ``(p - w, p]``: ``w`` keys
        counting the current one, which is kvcache's ``KVLayerSpec.sliding_window(window=w)``.

    Raises
    ------
    ValueError
        A layer type other than ``full_attention`` / ``sliding_attention`` (linear, chunked,
        shared-KV layers have no slot-cache binding here).
    """
    api = "layer_windows"
    text = _text_config(api, config)
    types, kwargs = get_layer_types_and_kwargs(text)
    out: list[Optional[int]] = []
    for i, (kind, kw) in enumerate(zip(types, kwargs)):
        if kind == "full_attention":
            out.append(None)
        elif kind == "sliding_attention":
            out.append(int(kw["sliding_window"]))
        else:
            raise ValueError(f"{api}: layer_types[{i}]={kind!r}, must be 'full_attention' or 'sliding_attention'")
    return out


def _geometry(api: str, config) -> tuple[int, int, int]:
    """(num_layers, kv_heads, head_dim) of a decoder config."""
    text = _text_config(api, config)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return int(text.num_hidden_layers), kv_heads, int(head_dim)


def _check_positive(api: str, name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{api}: {name}={value!r}, must be an int >= {low}")
    return int(value)


def _cache_kwarg(model) -> str:
    """The forward's name for the cache argument (``cache`` in transformers 5, else ``past_key_values``)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


# ----------------------------------------------------------------------------- the slot-cache Cache

class _SlotLayer(CacheLayerMixin):
    """One decoder layer of a :class:`SlotKVCache`: sizes for transformers' mask code; the K/V live in the slot cache."""

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, owner: "SlotKVCache", index: int, window: Optional[int]):
        super().__init__()
        self._owner, self._index, self.window = owner, index, window
        self.is_sliding = window is not None
        self.sliding_window = window

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Storage is allocated by the owning cache at its first ``update``."""
        self._owner._allocate(key_states.dtype, key_states.shape[0], key_states.device, key_states.shape)

    def update(self, key_states, value_states, *args, **kwargs):
        """Same as ``SlotKVCache.update(key_states, value_states, layer_idx)`` for this layer."""
        return self._owner.update(key_states, value_states, self._index)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the keys this layer's ``update`` returns."""
        past = self._owner.get_seq_length()
        offset = 0 if self.window is None else max(past - self.window + 1, 0)
        return past - offset + query_length, offset

    def get_seq_length(self) -> int:
        """Committed length of slot 0."""
        return self._owner.get_seq_length()

    def get_max_length(self) -> int:
        """``max_seq_len`` of the slot cache."""
        return self._owner.max_seq_len

    def reset(self) -> None:
        """Nothing per layer: ``SlotKVCache.reset`` resets the storage."""
        self.is_initialized = self._owner._kv is not None


class SlotKVCache(Cache):
    """A ``transformers.Cache`` whose K/V live in a kvcache slot cache (``KVCache``).

    Batch row ``b`` of ``generate`` is slot ``b``. Per forward, the first layer's ``update``
    calls ``prepare_step`` (paged: reserves the step's blocks), each layer's ``update`` scatters
    its K/V through ``step.slot_mapping`` (see ``scatter``) and returns the row's history as torch tensors
    ``[batch, kv_heads, n, head_dim]`` (contiguous mode: zero-copy views of the storage; paged:
    zero-copy views while a single row's positions sit in consecutive storage rows, else one
    gather through ``step.block_table``), and the last layer's ``update`` commits the new
    lengths with ``update_position``. A sliding-window layer returns only its window (as
    ``DynamicSlidingWindowLayer`` does), with the offset ``get_mask_sizes`` reports.

    With ``attn_implementation="kvcache"`` (:func:`kvcache_attention`) ``update`` returns the
    step's own K/V unchanged and the attention reads the cache with ``ops.varlen_attention``;
    :meth:`prepare_packed` then runs rows of different lengths as one pad-free forward.

    **Dtype**: the storage is allocated at the first ``update`` in the key states' dtype, which
    is the model's dtype (float32, float16 or bfloat16); nothing is down-cast. Given ``dtype=``
    (to allocate at once), a model of another dtype is refused with ``TypeError``.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config: layers, K/V heads, head_dim and sliding windows (:func:`layer_windows`).
    backend : {"kvfast", "kvref"}
        The package whose ``KVCache`` and ``ops`` run the cache.
    mode : {"paged", "contiguous"}
    max_seq_len : int, optional
        Longest sequence of a slot; default ``config.max_position_embeddings``.
    max_batch_size : int, optional
        Slots; default the batch of the first forward (``generate``'s batch). Needed before
        :meth:`prepare_packed`.
    block_size : int
        Paged mode: tokens per block.
    num_blocks : int
        Paged mode: pool size, ``0`` for ``max_batch_size * ceil(max_seq_len / block_size) + 1``.
    dtype : torch.dtype, optional
        Allocate at once in this dtype (with ``max_batch_size``); it must be the model's.
    scatter : {"torch", "ops"}
        How ``update`` writes a layer's K/V: ``"torch"`` copies them through ``step.slot_mapping``
        into the live ``keys(l)`` / ``values(l)`` storage (the slot cache's documented binding, no
        conversion since the storage is in the model's dtype; a one-token step's dense row is copied
        by address, one ``memcpy`` for K and V, other steps on zero-copy NumPy views of both sides,
        a microsecond where torch's indexing costs several, and as ``index_copy_`` for inputs that
        need grad), ``"ops"``
        calls the backend's ``ops.append_kv`` (its checks and kernels). Same bytes either way.

    Attributes
    ----------
    kv : KVCache or None
        The slot cache (``None`` until allocated).
    windows : list of (int or None)
        Per layer, its sliding window.
    max_seq_len : int
    """

    def __init__(self, config, *, backend: str = "kvfast", mode: str = "paged", max_seq_len: Optional[int] = None,
                 max_batch_size: Optional[int] = None, block_size: int = 16, num_blocks: int = 0,
                 dtype: Optional[torch.dtype] = None, scatter: str = "torch"):
        api = "SlotKVCache"
        if scatter not in _SCATTERS:
            raise ValueError(f"{api}: scatter={scatter!r}, must be one of {list(_SCATTERS)}")
        self.scatter = scatter
        self._pkg = _backend(api, backend)
        self.backend = backend
        if mode not in _MODES:
            raise ValueError(f"{api}: mode={mode!r}, must be one of {list(_MODES)}")
        self.mode = mode
        self.windows = layer_windows(config)
        self.num_layers, self.kv_heads, self.head_dim = _geometry(api, config)
        if max_seq_len is None:
            max_seq_len = int(getattr(_text_config(api, config), "max_position_embeddings", 0) or 0)
        self.max_seq_len = _check_positive(api, "max_seq_len", max_seq_len)
        self.max_batch_size = None if max_batch_size is None else _check_positive(api, "max_batch_size",
                                                                                   max_batch_size)
        self.block_size = _check_positive(api, "block_size", block_size)
        self.num_blocks = _check_positive(api, "num_blocks", num_blocks, low=0)
        self._config = config
        super().__init__(layers=[_SlotLayer(self, i, w) for i, w in enumerate(self.windows)])
        self.kv = None
        self._kv = None
        self._dtype: Optional[torch.dtype] = None
        self._lengths = np.zeros(0, np.int64)   # committed length per slot (mirror of kv.seq_lens())
        self._packed: Optional[tuple[np.ndarray, np.ndarray]] = None  # (slots, q_lens) of the next forward
        self._step = None                       # StepIndices of the open (or last) forward
        self._written = 0                       # layers appended in the open forward (0 = none open)
        self._rows = self._past = self._q = None
        self._varlen = False
        self._hist: dict = {}                   # per-step index cache of the paged history gathers
        self._auto: dict = {}                   # (batch, q_len) -> the index arrays of a generate step
        self._pending: Optional[int] = None     # the layer whose K/V the last update appended
        self._done: list = []
        self._np_write = False                  # update writes the host storage itself (set at allocation)
        self._one = None                        # the length an open one-token forward of slot 0 commits
        self._chunk = None                      # (first, end, storage rows) of slot 0's prepared block
        self._rowwise = False                   # the open forward's later layers copy one row by address
        self._wrow_at = 0                       # (then) that row's byte offset in every layer's storage
        self._shape = None                      # every layer's K/V shape of the open forward
        if dtype is not None:
            if self.max_batch_size is None:
                raise ValueError(f"{api}: dtype={dtype} needs max_batch_size to allocate at once")
            self._allocate(dtype, self.max_batch_size)

    # -- storage
    def _allocate(self, dtype: torch.dtype, batch: int, device=None, shape=None) -> None:
        api = "SlotKVCache.update"
        if self._kv is not None:
            if dtype != self._dtype:
                raise TypeError(f"{api}: key_states dtype={dtype} != the cache's dtype={self._dtype}; "
                                "a SlotKVCache stores K/V in the model's dtype (build it with dtype=model.dtype)")
            return
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"{api}: key_states on device={device}; SlotKVCache runs the slot cache on the CPU")
        name = _dtype_name(api, dtype)
        if shape is not None:   # the model's own K/V geometry wins over the config's (GPT-NeoX, ...)
            self.kv_heads, self.head_dim = int(shape[1]), int(shape[3])
        seqs = self.max_batch_size or int(batch)
        kv = self._pkg
        cfg = kv.KVCacheConfig(num_layers=self.num_layers, max_seqs=seqs, max_seq_len=self.max_seq_len,
                               mode=kv.KVCacheMode.PAGED if self.mode == "paged" else kv.KVCacheMode.CONTIGUOUS,
                               block_size=self.block_size, num_blocks=self.num_blocks, dtype=name)
        specs = [kv.KVLayerSpec.attention(self.kv_heads, self.head_dim) if w is None
                 else kv.KVLayerSpec.sliding_window(self.kv_heads, self.head_dim, w) for w in self.windows]
        self._kv = self.kv = kv.KVCache.make(cfg, specs)
        self.max_batch_size = seqs
        self._dtype = dtype
        self._lengths = np.zeros(seqs, np.int64)
        # paged: flat storage row of every position of every slot, kept up to date step by step
        self._flat = np.zeros((seqs, self.max_seq_len), np.int64)
        self._flat_ok = np.zeros(seqs, np.int64)   # leading positions of each slot whose row is known
        self._run = np.zeros(seqs, np.bool_)       # those positions sit in consecutive storage rows
        self._r0 = None                            # a one-row step's: the storage row of position 0
        self._keys = [_as_torch(self._kv.keys(i)) for i in range(self.num_layers)]
        self._values = [_as_torch(self._kv.values(i)) for i in range(self.num_layers)]
        # The same storage as NumPy arrays of the storage's words (bfloat16 as int16), 4-D and as
        # rows [-1, kv_heads, head_dim]: a decode step's tiny writes and gathers cost about a
        # microsecond each in NumPy against several in torch (see docs/transformers.md). None where
        # the storage is not a C-contiguous host array (then the torch ops run instead).
        self._kw = [_host_words(self._kv.keys(i)) for i in range(self.num_layers)]
        self._vw = [_host_words(self._kv.values(i)) for i in range(self.num_layers)]
        self._host = all(w is not None for w in self._kw + self._vw)
        self._np_write = self.scatter == "torch" and self._host   # update writes the storage itself
        self._slot0 = np.zeros(1, np.int64)        # slot_ids of a one-token forward of slot 0
        self._chunk = None
        self._bf16 = dtype is torch.bfloat16
        # A contiguous decode row of K/V is copied into its storage row by address (``ctypes.memmove``,
        # no torch -> NumPy conversion): per layer the K / V base addresses, and the row size.
        self._addr = [(int(k[0].ctypes.data), int(v[0].ctypes.data)) for k, v in zip(self._kw, self._vw)] \
            if self._host else None
        self._row_bytes = self.kv_heads * self.head_dim * self._kv.keys(0).dtype.itemsize
        # The history's torch views straight from the storage tensors (torch.as_strided: one call
        # each, where a NumPy view's torch.from_numpy costs twice as much): the storage strides.
        H, D = self.kv_heads, self.head_dim
        rows = self.max_seq_len if self.mode == "contiguous" else self.block_size
        self._hstride = (rows * H * D, D, H * D, 1)
        for layer in self.layers:
            layer.is_initialized = True

    # -- what transformers asks
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Committed length of slot 0 (``generate``'s rows all have the same length)."""
        return int(self._lengths[0]) if self._lengths.size else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of layer ``layer_idx``'s keys for a step of ``query_length`` tokens."""
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        """``max_seq_len``."""
        return self.max_seq_len

    @property
    def is_compileable(self) -> bool:
        """False: a step's bookkeeping runs on the host."""
        return False

    @property
    def batch_size(self) -> int:
        """Slots of the cache, ``-1`` before allocation."""
        return -1 if self._kv is None else int(self.max_batch_size)

    def seq_lens(self) -> np.ndarray:
        """Committed length of every slot, int64 ``[max_batch_size]`` (a copy)."""
        return self._lengths.copy()

    # -- a step
    def prepare_packed(self, slot_ids: Sequence[int], q_lens: Sequence[int]) -> torch.Tensor:
        """Describe the next forward as packed rows: slot ``slot_ids[b]`` gets ``q_lens[b]`` new tokens.

        The forward then takes ``input_ids`` of shape ``[1, sum(q_lens)]`` (rows back to back, no
        padding) and the returned ``position_ids``; it needs ``attn_implementation="kvcache"``.

        Parameters
        ----------
        slot_ids : sequence of int
            Distinct slots in ``[0, max_batch_size)``.
        q_lens : sequence of int
            New tokens per row, each >= 1.

        Returns
        -------
        torch.LongTensor [1, T]
            Each token's position: ``seq_lens()[slot] + j``.

        Raises
        ------
        ValueError
            Lengths differ, a slot repeats or is out of range, a ``q_len`` < 1, a forward is open,
            or ``max_batch_size`` is unknown.
        """
        api = "SlotKVCache.prepare_packed"
        if self._written:
            raise ValueError(f"{api}: a forward is open ({self._written} of {self.num_layers} layers written)")
        if self.max_batch_size is None:
            raise ValueError(f"{api}: max_batch_size=None; build the cache with max_batch_size to pack rows")
        slots = np.asarray(list(slot_ids), dtype=np.int64)
        qs = np.asarray(list(q_lens), dtype=np.int64)
        if slots.ndim != 1 or slots.size == 0 or slots.shape != qs.shape:
            raise ValueError(f"{api}: len(slot_ids)={slots.size} and len(q_lens)={qs.size} must be equal and >= 1")
        bad = np.flatnonzero((slots < 0) | (slots >= self.max_batch_size))
        if bad.size:
            raise ValueError(f"{api}: slot_ids[{bad[0]}]={slots[bad[0]]} out of range [0, {self.max_batch_size})")
        if np.unique(slots).size != slots.size:
            raise ValueError(f"{api}: slot_ids={slots.tolist()} repeats a slot")
        bad = np.flatnonzero(qs < 1)
        if bad.size:
            raise ValueError(f"{api}: q_lens[{bad[0]}]={qs[bad[0]]}, must be >= 1")
        self._packed = (slots, qs)
        past = self._lengths[slots] if self._lengths.size else np.zeros_like(slots)
        pos = np.repeat(past - np.cumsum(np.concatenate([[0], qs[:-1]])), qs) + np.arange(int(qs.sum()))
        return torch.from_numpy(pos)[None]

    def _begin(self, key_states: torch.Tensor) -> None:
        """Open a forward: ``prepare_step`` over the packed rows, or over batch rows ``0..B-1``."""
        api = "SlotKVCache.update"
        B, _, S, _ = key_states.shape
        packed = self._packed is not None
        self._varlen = _attn_implementation(self._config) == ATTENTION_NAME
        self._one = None
        if B * S == 1 and not packed and not self._varlen and self._np_write and self._decode_one():
            return
        self._chunk = None
        if packed:
            rows, q = self._packed
            self._packed = None
            if B != 1 or S != int(q.sum()):
                raise ValueError(f"{api}: key_states.shape={tuple(key_states.shape)}, the packed step needs "
                                 f"[1, kv_heads, {int(q.sum())}, head_dim]")
            past = self._lengths[rows]
            cu = np.concatenate([[0], np.cumsum(q)])
        else:
            if B > self.max_batch_size:
                raise ValueError(f"{api}: batch={B} > max_batch_size={self.max_batch_size}")
            shape = self._auto.get((B, S))
            if shape is None:   # the arrays of a generate step, built once per (batch, q_len)
                shape = self._auto[(B, S)] = (np.arange(B, dtype=np.int64), np.full(B, S, dtype=np.int64),
                                              np.arange(B + 1, dtype=np.int64) * S)
            rows, q, cu = shape
            past = self._lengths[:B].copy()
        if not self._varlen and (packed or (B > 1 and np.any(past != past[0]))):
            raise ValueError(f"{api}: packed rows and rows of unequal lengths need "
                             f"attn_implementation={ATTENTION_NAME!r} (the model runs "
                             f"{getattr(self._config, '_attn_implementation', None)!r})")
        self._step = step = self._kv.prepare_step(cu, past, rows)
        self._rows, self._past, self._q = rows, past, q
        self._hist = {}
        self._done = [False] * self.num_layers
        sm = step.slot_mapping
        self._sm_np = sm = sm if sm.dtype == np.int64 else sm.astype(np.int64)
        self._sm = None                        # its torch twin, made if a torch write needs it
        self._shape = (B, self.kv_heads, S, self.head_dim)   # every layer's K/V of this step
        self._wrow = row = int(sm[0]) if B * S == 1 else None   # a one-token step's storage row
        # the later layers of a one-token host step take update's by-address path (a real row: >= 0)
        self._rowwise = self._np_write and row is not None and row >= 0
        self._wrow_at = row * self._row_bytes if self._rowwise else 0
        if not self._varlen:
            p0 = int(past[0])
            self._span = (p0, p0 + S)          # every row's positions of this step
            if self.mode == "paged":
                ok, flat, run = self._flat_ok, self._flat, self._run
                if ok[0] < p0 if B == 1 else bool((ok[:B] < p0).any()):   # rows not followed step by step
                    pos = np.arange(p0)
                    for b in np.flatnonzero(ok[:B] < p0).tolist():
                        blocks = np.asarray(step.block_table[b], dtype=np.int64)[pos // self.block_size]
                        flat[b, :p0] = blocks * self.block_size + pos % self.block_size
                        run[b] = bool(np.all(np.diff(flat[b, :p0]) == 1))
                self._r0 = None
                if B * S == 1:   # a decode token
                    self._follow_row(p0, self._wrow)
                    return
                flat[:B, p0:p0 + S] = sm.reshape(B, S)
                ok[:B] = p0 + S
                if B == 1:   # one row whose positions [0, n) sit in consecutive storage rows: views, no gather
                    r = (not p0 or (run[0] and int(sm[0]) == int(flat[0, p0 - 1]) + 1)) and (
                        S == 1 or bool(np.all(np.diff(sm) == 1)))
                    run[0] = r
                    if r:
                        self._r0 = int(flat[0, 0])
                else:
                    run[:B] = False

    def _decode_one(self) -> bool:
        """Open a one-token forward of slot 0 (batch 1, sdpa, host storage written by ``update``) on
        the slot's current block chunk; False where it needs the general path (which then runs).

        A chunk is one ``prepare_step`` of the tokens left in the block that holds position ``p``
        (at most ``block_size``, never past ``max_seq_len``): it reserves that block and lists the
        storage rows of those positions (``step.slot_mapping``). Each one-token forward inside the
        chunk writes the next row and commits it with ``update_position`` (``spec/slot-cache.md``
        §2.8: a step's rows stay its rows), so the slot cache's validation, reservation
        and slot mapping run once per block, not once per token. The chunk holds only while slot 0
        is followed step by step: its length is read back from the slot cache (``seq_lens()``) every
        forward, and every path that changes a slot here (another step shape, ``crop``, ``reset``,
        ``release``, ``admit``, a reorder) drops it.
        """
        p = int(self._lengths[0])
        chunk = self._chunk
        if self.mode == "paged" and self._flat_ok[0] != p:
            return False              # rows not followed step by step: the general path catches up
        if chunk is None or not chunk[0] <= p < chunk[1] or int(self._kv.seq_lens()[0]) != p:
            if p >= self.max_seq_len:
                return False          # the general path raises prepare_step's CapacityError
            q = min(self.block_size - p % self.block_size, self.max_seq_len - p)
            step = self._kv.prepare_step(np.array([0, q]), np.array([p]), self._slot0)
            self._chunk = chunk = (p, p + q, step.slot_mapping.tolist())
        row = chunk[2][p - chunk[0]]
        self._step, self._one = None, p + 1
        self._rows, self._past, self._q = self._slot0, None, None
        self._done = [False] * self.num_layers
        self._sm_np = self._sm = None          # made from `_wrow` if a later layer's write needs them
        self._shape = (1, self.kv_heads, 1, self.head_dim)
        self._wrow = row
        self._rowwise = True
        self._wrow_at = row * self._row_bytes
        self._span = (p, p + 1)
        self._hist = {}
        self._r0 = None
        if self.mode == "paged":
            self._follow_row(p, row)
        return True

    def _follow_row(self, p: int, row: int) -> None:
        """Paged, slot 0 at position ``p`` (every earlier row followed): position ``p`` sits in storage
        row ``row``; the history is a view from ``_r0`` while the rows stay consecutive, else a gather."""
        flat, run = self._flat, self._run
        flat[0, p] = row
        self._flat_ok[0] = p + 1
        r = not p or bool(run[0] and row == flat[0, p - 1] + 1)
        run[0] = r
        if r:
            self._r0 = int(flat[0, 0])

    def _commit(self) -> None:
        """Close the forward: every row's new length, committed with ``update_position``."""
        if self._one is not None:      # a one-token forward of slot 0 (``_decode_one``)
            m = self._one
            self._kv.update_position(0, m)
            self._lengths[0] = m
        elif self._rows.size == 1:
            slot, m = int(self._rows[0]), int(self._past[0]) + int(self._q[0])
            self._kv.update_position(slot, m)
            self._lengths[slot] = m
        else:
            n = self._past + self._q
            for slot, m in zip(self._rows.tolist(), n.tolist()):
                self._kv.update_position(slot, m)
            self._lengths[self._rows] = n
        self._written = 0
        self._rowwise = False

    def _history(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the step's rows after the append: ``[B, kv_heads, n - offset, head_dim]``."""
        w = self.windows[layer]
        past, n = self._span
        off = 0 if w is None or past < w else past - w + 1
        B = self._rows.size
        if self._host:                         # torch views of the storage, or NumPy takes of its words
            contiguous = self.mode == "contiguous"
            if contiguous or self._r0 is not None:   # zero-copy views: the slots' rows / consecutive rows
                H, D = self.kv_heads, self.head_dim
                size = (B, H, n - off, D)
                at = (off if contiguous else self._r0 + off) * H * D
                return (torch.as_strided(self._keys[layer], size, self._hstride, at),
                        torch.as_strided(self._values[layer], size, self._hstride, at))
            else:
                rows = self._hist.get(off)
                if rows is None:               # flat storage rows of positions [off, n), once per step
                    r = self._flat[:B, off:n]
                    rows = self._hist[off] = r[0] if B == 1 else r.reshape(-1)
                Kr, Vr = self._kw[layer][1], self._vw[layer][1]
                H, D = Kr.shape[1], Kr.shape[2]
                k = Kr.take(rows, axis=0).reshape(B, n - off, H, D).transpose(0, 2, 1, 3)
                v = Vr.take(rows, axis=0).reshape(B, n - off, H, D).transpose(0, 2, 1, 3)
            k, v = torch.from_numpy(k), torch.from_numpy(v)
            if self._bf16:
                return k.view(torch.bfloat16), v.view(torch.bfloat16)
            return k, v
        K, V = self._keys[layer], self._values[layer]
        if self.mode == "contiguous":          # zero-copy views of the slots' rows
            return K[:B, off:n].permute(0, 2, 1, 3), V[:B, off:n].permute(0, 2, 1, 3)
        rows = self._hist.get(off)
        if rows is None:                       # flat storage rows of positions [off, n), once per step
            r = self._flat[:B, off:n]
            rows = self._hist[off] = r[0] if B == 1 else r.reshape(-1)
        rows = torch.from_numpy(rows)
        H, D = K.shape[-2], K.shape[-1]
        k = K.view(-1, H, D).index_select(0, rows).view(B, n - off, H, D)
        v = V.view(-1, H, D).index_select(0, rows).view(B, n - off, H, D)
        return k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Append layer ``layer_idx``'s K/V of this forward; return what the model's attention reads.

        Parameters
        ----------
        key_states, value_states : torch.Tensor [batch, kv_heads, q_len, head_dim]
            This forward's new K/V (rotary applied), in the model's dtype.
        layer_idx : int

        Returns
        -------
        keys, values : torch.Tensor
            ``[batch, kv_heads, kv_length, head_dim]`` in the input's dtype: the rows' history
            (the window of a sliding layer). Under ``attn_implementation="kvcache"``: the inputs.

        Raises
        ------
        ValueError
            A layer written twice in one forward, a shape that does not fit, a step the cache
            refuses (``CapacityError`` from ``prepare_step`` is raised as is).
        TypeError
            Not a 4-D tensor, or a dtype other than the cache's.

        Notes
        -----
        Layer 0 always opens a forward: one that raised before its last layer is dropped (its
        lengths were never committed, so the K/V it wrote are overwritten later).
        """
        k, v, shape, dt = key_states, value_states, self._shape, self._dtype
        if (self._rowwise and 0 < layer_idx < self.num_layers and not self._done[layer_idx] and k.shape == shape
                and v.shape == shape and k.dtype is dt and v.dtype is dt and k.is_cpu and v.is_cpu
                and k.is_contiguous() and v.is_contiguous() and not k.requires_grad and not v.requires_grad):
            # The next layer of an open one-token host forward (``_begin`` set ``_rowwise``): both rows
            # dense on the host in the storage's dtype, [1, H, 1, D] copied by address into the step's
            # storage row (a real token's, never padding). Every other call takes ``_update``.
            self._done[layer_idx] = True
            k_at, v_at = self._addr[layer_idx]
            at, nbytes = self._wrow_at, self._row_bytes
            _memmove(k_at + at, k.data_ptr(), nbytes)
            _memmove(v_at + at, v.data_ptr(), nbytes)
            return self._appended(k, v, layer_idx)
        return self._update(key_states, value_states, layer_idx)

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        """:meth:`update`'s general path: opens a forward at its first layer, checks, writes."""
        if self._written and layer_idx == 0:
            self._written = 0   # a forward that raised before its last layer: dropped, nothing committed
        if self._written == 0:
            api = "SlotKVCache.update"
            if not isinstance(key_states, torch.Tensor) or key_states.ndim != 4:
                raise TypeError(f"{api}: key_states={type(key_states).__name__}"
                                f"{tuple(getattr(key_states, 'shape', ()))}, must be a 4-D torch.Tensor")
            if self._kv is None:
                self._allocate(key_states.dtype, key_states.shape[0], key_states.device, key_states.shape)
            elif key_states.dtype != self._dtype:
                self._allocate(key_states.dtype, 0)     # raises the dtype error
            self._begin(key_states)
        elif key_states.dtype != self._dtype:
            self._allocate(key_states.dtype, 0)     # raises the dtype error
        done = self._done
        if not 0 <= layer_idx < self.num_layers or done[layer_idx]:
            raise ValueError(f"SlotKVCache.update: layer_idx={layer_idx} out of range [0, {self.num_layers}) or "
                             "written twice in one forward")
        done[layer_idx] = True
        shape = key_states.shape
        if shape != self._shape:               # (the step's own shape passes without a second look)
            B, H, S, D = shape
            tokens = self._shape[0] * self._shape[2]
            if shape != (B, self.kv_heads, S, self.head_dim) or B * S != tokens:
                raise ValueError(f"SlotKVCache.update: key_states.shape={tuple(shape)}, the step needs "
                                 f"{tokens} tokens of [{self.kv_heads}, {self.head_dim}]")
        kn, by_address = None, False
        row = self._wrow
        if (row is not None and row >= 0 and self._np_write and value_states.shape == shape
                and value_states.dtype is key_states.dtype and not key_states.requires_grad
                and not value_states.requires_grad and key_states.is_cpu and value_states.is_cpu
                and key_states.is_contiguous() and value_states.is_contiguous()):
            # one token, both rows dense on the host in the storage's dtype (checked above):
            # [1, H, 1, D] copied by address into storage row `row` (a real token's, never padding)
            k_at, v_at = self._addr[layer_idx]
            at, nbytes = row * self._row_bytes, self._row_bytes
            _memmove(k_at + at, key_states.data_ptr(), nbytes)
            _memmove(v_at + at, value_states.data_ptr(), nbytes)
            by_address = True
        elif self._np_write and value_states.shape == shape and value_states.dtype is key_states.dtype:
            try:                               # zero-copy NumPy views of the inputs' words
                if self._bf16:
                    kn, vn = key_states.view(torch.int16).numpy(), value_states.view(torch.int16).numpy()
                else:
                    kn, vn = key_states.numpy(), value_states.numpy()
            except (RuntimeError, TypeError):  # inputs that need grad, or not on the CPU: the torch write
                kn = None
        if kn is not None:                     # the slot_mapping binding on the live storage
            if row is not None:                # one token: [1, H, 1, D] into storage row `row`
                self._kw[layer_idx][1][row] = kn[0, :, 0]
                self._vw[layer_idx][1][row] = vn[0, :, 0]
            else:
                B, H, S, D = shape
                if S == 1:                     # decode rows: [B, H, 1, D] -> [B, H, D], views
                    kn, vn = kn[:, :, 0], vn[:, :, 0]
                else:
                    kn = kn.transpose(0, 2, 1, 3).reshape(B * S, H, D)
                    vn = vn.transpose(0, 2, 1, 3).reshape(B * S, H, D)
                self._kw[layer_idx][1][self._sm_np] = kn
                self._vw[layer_idx][1][self._sm_np] = vn
        elif not by_address:                   # (a row copied by address is written)
            B, H, S, D = shape
            k = key_states.transpose(1, 2).reshape(B * S, H, D)   # a view for decode (S == 1) and for packed rows
            v = value_states.transpose(1, 2).reshape(B * S, H, D)
            if self.scatter == "torch":        # the same binding through torch
                if self._sm is None:
                    self._sm = torch.from_numpy(self._sm_np if self._sm_np is not None
                                                else np.array([self._wrow], np.int64))
                self._keys[layer_idx].view(-1, H, D).index_copy_(0, self._sm, k)
                self._values[layer_idx].view(-1, H, D).index_copy_(0, self._sm, v)
            else:
                self._pkg.ops.append_kv(self._kv, layer_idx, k, v, self._step)
        return self._appended(key_states, value_states, layer_idx)

    def _appended(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        """Layer ``layer_idx``'s K/V are written: what its attention reads; the last layer commits."""
        self._written += 1
        self._pending = layer_idx                          # the layer kvcache_attention may read next
        _ACTIVE.set(self)
        out = (key_states, value_states) if self._varlen else self._history(layer_idx)
        if self._written == self.num_layers:
            self._commit()
        return out

    def _attend(self, layer: int, query: torch.Tensor, scaling: Optional[float], softcap: Optional[float] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``ops.varlen_attention`` of the step's packed queries: ``[B, S, q_heads, head_dim]``, query's dtype."""
        B, Hq, S, D = query.shape
        q = query.transpose(1, 2).reshape(B * S, Hq, D)
        if not q.requires_grad and q.device.type == "cpu":
            # The attention widens q to float32 either way: widened here (exact, float16 / bfloat16 ->
            # float32), it goes in and comes out as NumPy, without two torch <-> NumPy conversions.
            q = (q if q.dtype is torch.float32 else q.float()).numpy()
        out = self._pkg.ops.varlen_attention(q, self._kv, layer, self._step, scale=scaling, softcap=softcap,
                                             sinks=sinks)
        out = out if isinstance(out, torch.Tensor) else torch.from_numpy(np.asarray(out))
        return out.to(query.dtype).view(B, S, Hq, D)

    # -- lifecycle
    def release(self, slot: int, tokens: Optional[Sequence[int]] = None) -> None:
        """Free a slot; paged with ``tokens`` (every token fed so far): publish its full blocks for reuse.

        Raises
        ------
        ValueError
            ``slot`` out of range, or a forward is open.
        """
        api = "SlotKVCache.release"
        if self._written:
            raise ValueError(f"{api}: a forward is open")
        if self._kv is None or not 0 <= int(slot) < self.max_batch_size:
            raise ValueError(f"{api}: slot={slot} out of range [0, {self.max_batch_size or 0})")
        if tokens is not None and self.mode == "paged":
            self._kv.retire(int(slot), np.asarray(list(tokens), dtype=np.int64))
        else:
            self._kv.evict_batch(int(slot))
        self._lengths[int(slot)] = 0
        self._flat_ok[int(slot)] = 0
        self._chunk = None                     # slot 0's prepared block chunk, if any, is stale

    def admit(self, slot: int, prompt: Sequence[int]) -> int:
        """Paged: adopt the longest cached prefix of ``prompt`` into the empty ``slot``; return its length.

        Raises
        ------
        ValueError
            Not allocated yet (build with ``dtype`` and ``max_batch_size``), or ``slot`` out of range.
        RuntimeError
            A contiguous cache (``KVCache.admit`` is paged only).
        """
        api = "SlotKVCache.admit"
        if self._kv is None or not 0 <= int(slot) < self.max_batch_size:
            raise ValueError(f"{api}: slot={slot} out of range [0, {self.max_batch_size or 0}) "
                             "(or the cache is not allocated: pass dtype= and max_batch_size=)")
        hit = int(self._kv.admit(int(slot), np.asarray(list(prompt), dtype=np.int64)))
        self._lengths[int(slot)] = hit
        self._flat_ok[int(slot)] = 0
        self._chunk = None                     # slot 0's prepared block chunk, if any, is stale
        return hit

    def reset(self) -> None:
        """Every slot empty, storage kept (``KVCache.reset``)."""
        if self._kv is not None:
            self._kv.reset()
            self._lengths[:] = 0
            self._flat_ok[:] = 0
        self._written, self._packed, self._rowwise, self._chunk = 0, None, False, None

    def crop(self, tokens_to_remove: int) -> None:
        """Roll every slot back by ``-tokens_to_remove`` tokens (``update_position``), as ``DynamicCache.crop``.

        Raises
        ------
        ValueError
            ``tokens_to_remove`` > 0 (transformers' own caches refuse it too) or a slot shorter than that.
        """
        api = "SlotKVCache.crop"
        n = int(tokens_to_remove)
        if n > 0:
            raise ValueError(f"{api}: tokens_to_remove={n}, must be <= 0 (the tokens to remove, negated)")
        if n == 0 or self._kv is None:
            return
        short = np.flatnonzero((self._lengths > 0) & (self._lengths < -n))
        if short.size:
            raise ValueError(f"{api}: tokens_to_remove={n} but slot {short[0]} holds {self._lengths[short[0]]}")
        for slot in np.flatnonzero(self._lengths).tolist():
            self._lengths[slot] += n
            self._kv.update_position(slot, int(self._lengths[slot]))
        np.minimum(self._flat_ok, self._lengths, out=self._flat_ok)
        self._chunk = None

    def _rewrite(self, rows: Sequence[int]) -> None:
        """New slot ``i`` holds what old slot ``rows[i]`` held (beam search, ``num_return_sequences``)."""
        rows = [int(r) for r in rows]
        if self._kv is None or not self._lengths.size or int(self._lengths.max()) == 0:
            if self._kv is not None and len(rows) > self.max_batch_size:
                self._kv, self.kv, self.max_batch_size = None, None, len(rows)
                self._lengths = np.zeros(0, np.int64)
            elif self._kv is None:
                self.max_batch_size = max(self.max_batch_size or 0, len(rows)) or None
            return
        n = int(self._lengths[0])
        if np.any(self._lengths[: max(rows) + 1] != n):
            raise ValueError("SlotKVCache: reordering needs rows of equal length")
        dense = []
        for layer in range(self.num_layers):
            K, V = self._keys[layer], self._values[layer]
            if self.mode == "contiguous":
                k, v = K[rows, :n].clone(), V[rows, :n].clone()
            else:
                table = torch.from_numpy(self._kv.paged_block_table()[rows].astype(np.int64))
                k, v = K[table].flatten(1, 2)[:, :n].clone(), V[table].flatten(1, 2)[:, :n].clone()
            dense.append((k, v))
        dtype = self._dtype
        if len(rows) > self.max_batch_size:
            self._kv, self.max_batch_size = None, len(rows)
            self._allocate(dtype, len(rows))
        else:
            self._kv.reset()
        self._lengths[:] = 0
        B = len(rows)
        step = self._kv.prepare_step(np.arange(B + 1) * n, np.zeros(B, np.int64), np.arange(B))
        for layer, (k, v) in enumerate(dense):
            self._pkg.ops.append_kv(self._kv, layer, k.reshape(B * n, self.kv_heads, self.head_dim),
                                    v.reshape(B * n, self.kv_heads, self.head_dim), step)
        for slot in range(B):
            self._kv.update_position(slot, n)
        self._lengths[:B] = n
        self._flat_ok[:] = 0
        self._chunk = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` takes old row ``beam_idx[i]``'s K/V (beam search; a copy of the histories)."""
        self._rewrite(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row ``repeats`` times (``num_return_sequences``, contrastive search)."""
        B = self.max_batch_size if self._lengths.size else 0
        live = int(np.count_nonzero(self._lengths)) or B
        self._rewrite([r for r in range(live) for _ in range(int(repeats))])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only rows ``indices``, in that order."""
        self._rewrite(torch.as_tensor(indices).tolist())


# ----------------------------------------------------------------------------- the attention function

def kvcache_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                      dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention over the kvcache step of the current forward (registered as ``"kvcache"``).

    The keys and values were appended by the cache's ``update`` just before; this reads the
    cache, not ``key`` / ``value``: causal, GQA, the layer's sliding window, rows of any lengths
    packed back to back (:meth:`SlotKVCache.prepare_packed`, :class:`ContinuousBatchingGenerator`).

    Parameters
    ----------
    module : torch.nn.Module
        The attention module (its ``layer_idx`` names the cache layer).
    query : torch.Tensor [batch, q_heads, q_len, head_dim]
    key, value : torch.Tensor
        Unused (the cache holds them).
    attention_mask : None
        A padding mask is refused: pack the rows instead.
    scaling : float, optional
        Score scale; default ``1 / sqrt(head_dim)``.
    dropout : float
        Must be 0 (inference).
    **kwargs
        ``sliding_window`` (checked against the cache's layer), anything else transformers passes.

    Returns
    -------
    out : torch.Tensor [batch, q_len, q_heads, head_dim]
        In ``query``'s dtype.
    None
        No attention weights.

    Raises
    ------
    RuntimeError
        No kvcache cache ran this forward's ``update`` (pass a :class:`SlotKVCache`).
    ValueError
        A padding mask, dropout, a sliding window the cache's layer does not have; a ``softcap``
        or sinks (``s_aux``) the ops refuse (spec/slot-cache.md §7.3).

    Notes
    -----
    ``softcap`` (logit soft-capping, Gemma 2) and ``s_aux`` (one sink logit per query head,
    gpt-oss), as transformers passes them, are applied as the ops' ``softcap`` and ``sinks``.
    """
    api = "kvcache_attention"
    cache = _ACTIVE.get()
    if cache is None or not getattr(cache, "_varlen", False):
        raise RuntimeError(f"{api}: no kvcache step is open; pass cache=SlotKVCache(model.config) with "
                           f"attn_implementation={ATTENTION_NAME!r}")
    if attention_mask is not None:
        raise ValueError(f"{api}: attention_mask with padding (shape {tuple(attention_mask.shape)}); kvcache "
                         "batches are pad-free: pack the rows (SlotKVCache.prepare_packed)")
    if dropout:
        raise ValueError(f"{api}: dropout={dropout}, must be 0")
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")   # Gemma 2's soft-capping, gpt-oss's sinks
    layer = int(module.layer_idx)
    if cache._pending != layer:   # a cache of an earlier forward, or update() was not called for this layer
        raise RuntimeError(f"{api}: no kvcache step is open for layer {layer}; pass cache=SlotKVCache(model.config) "
                           f"with attn_implementation={ATTENTION_NAME!r}")
    cache._pending = None
    window = kwargs.get("sliding_window")
    if window is not None and cache.windows[layer] != int(window):
        raise ValueError(f"{api}: sliding_window={window} but the cache's layer {layer} has "
                         f"window={cache.windows[layer]}")
    return cache._attend(layer, query, scaling, softcap, sinks), None


def _pad_only_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   mask_function=None, attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """The mask function of ``"kvcache"``: ``None`` unless the 2-D mask has padding (then that mask)."""
    if attention_mask is not None and attention_mask.ndim == 2 and bool(attention_mask[:, -kv_length:].all()):
        return None
    return attention_mask


def register_attention(name: str = ATTENTION_NAME) -> str:
    """Register :func:`kvcache_attention` (and its mask function) under ``name``; return ``name``.

    Done for ``"kvcache"`` when this module is imported; calling again is harmless.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_attention: name={name!r}, must be a non-empty str")
    AttentionInterface.register(name, kvcache_attention)
    AttentionMaskInterface.register(name, _pad_only_mask)
    return name


register_attention()


# ----------------------------------------------------------------------------- continuous batching

@dataclass
class GenerationStats:
    """Counters of one :meth:`ContinuousBatchingGenerator.generate` call.

    Attributes
    ----------
    steps : int
        Forwards run.
    prompt_tokens : int
        Tokens of the prompts.
    prefix_hit_tokens : int
        Tokens admissions took from the prefix cache (``ctx.cached_prefix_length``).
    admissions_with_hit : int
        Admissions whose hit was > 0.
    chunked_prefill_steps : int
        Forwards in which some request ran a non-final prefill chunk.
    preemptions : int
        Requests sent back to the queue because the pool ran out (``InsufficientBlocksError``).
    readmissions : int
        Admissions of preempted requests.
    """

    steps: int = 0
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    admissions_with_hit: int = 0
    chunked_prefill_steps: int = 0
    preemptions: int = 0
    readmissions: int = 0


@dataclass
class _Request:
    index: int
    ctx: Any
    max_new: int
    generated: list = field(default_factory=list)
    preempted: bool = False


class _ManagerStep(Cache):
    """One forward over a manager's ``runtime_inputs``: ``ops.append_kv_paged`` into ``kv_blocks``,
    ``ops.paged_attention`` through ``lookup_table`` (spec/manager.md §18), per layer's leaf."""

    def __init__(self, gen: "ContinuousBatchingGenerator", inputs, q_lens: np.ndarray):
        super().__init__(layers=[])
        self._ops = gen._pkg.ops
        self._varlen = True
        self._pending: Optional[int] = None
        self.windows = gen.windows
        self._per_layer = [inputs[leaf] for leaf in gen.layer_leaf] if isinstance(inputs, dict) else [inputs] * len(
            gen.windows)
        past = np.asarray(self._per_layer[0].cache_lengths, dtype=np.int64)
        self._offsets = cu = np.concatenate([[0], np.cumsum(q_lens)])       # input_row_offsets
        row_of = np.repeat(np.arange(q_lens.size), q_lens)
        positions = past[row_of] + (np.arange(int(cu[-1])) - cu[row_of])
        self._q_pos = torch.from_numpy(positions)
        self._past = past

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Processed length of the first row."""
        return int(self._past[0])

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """The packed step needs no mask: ``(query_length, 0)``."""
        return query_length, 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Write the step's K/V of layer ``layer_idx`` (``[1, kv_heads, T, head_dim]``) into its pages;
        return the inputs."""
        inp = self._per_layer[layer_idx]
        self._ops.append_kv_paged(inp.kv_blocks, layer_idx, key_states, value_states, inp, self._offsets,
                                  layout="bhsd")
        self._pending = layer_idx
        _ACTIVE.set(self)
        return key_states, value_states

    def _attend(self, layer: int, query: torch.Tensor, scaling: Optional[float], softcap: Optional[float] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``ops.paged_attention`` of the packed queries through the layer's pages (its leaf's window,
        ``softcap``, ``sinks``): ``[1, T, q_heads, head_dim]`` in the query's dtype."""
        inp = self._per_layer[layer]
        out = self._ops.paged_attention(query, inp.kv_blocks, layer, inp, self._offsets, window=self.windows[layer],
                                        scale=scaling, layout="bhsd", softcap=softcap, sinks=sinks)
        return out.transpose(1, 2).to(query.dtype)     # [1, q_heads, T, D] of a [1, T, q_heads, D] buffer


class _Probed(Exception):
    """Raised by :class:`_GeometryProbe` once it has seen layer 0's K/V: the probe forward stops there."""


class _GeometryProbe(Cache):
    """A cache that records the shape of the first K/V a forward hands it, then stops the forward."""

    def __init__(self):
        super().__init__(layers=[])
        self._varlen = True
        self.shape: Optional[tuple[int, ...]] = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return query_length, 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.shape = tuple(key_states.shape)
        raise _Probed


def _kv_geometry(api: str, model) -> tuple[int, int, int]:
    """``(num_layers, kv_heads, head_dim)`` of the K/V the model's layers hand their cache.

    The config's ``num_key_value_heads`` is not what every architecture uses (GPT-2 and GPT-NeoX
    attend with all their heads whatever it says), so the heads and the head size are read from
    one probe forward of one token, stopped at layer 0's ``update``; the config's values are the
    fallback of a model the probe cannot run.
    """
    num_layers, kv_heads, head_dim = _geometry(api, model.config)
    probe = _GeometryProbe()
    saved = getattr(model.config, "_attn_implementation", None)
    try:
        if saved != ATTENTION_NAME:
            model.set_attn_implementation(ATTENTION_NAME)
        with torch.no_grad():
            model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=model.device), use_cache=True,
                  position_ids=torch.zeros((1, 1), dtype=torch.long, device=model.device),
                  **{_cache_kwarg(model): probe})
    except _Probed:
        pass
    except Exception:   # a model the probe cannot drive: the config's geometry
        probe.shape = None
    finally:
        if saved != ATTENTION_NAME:
            model.set_attn_implementation(saved)
    if probe.shape is not None and len(probe.shape) == 4:
        kv_heads, head_dim = int(probe.shape[1]), int(probe.shape[3])
    return num_layers, kv_heads, head_dim


class ContinuousBatchingGenerator:
    """Greedy generation of many prompts at once over a ``PagedKVCacheManager``.

    A scheduler of the vLLM shape: admit requests while batch rows and pages last (taking the
    longest cached prefix: prompts that share a prefix with a finished or running request reuse
    its published pages), run every running request in one packed, pad-free forward (a prefill
    chunk of at most ``chunk_size`` tokens, or one decode token), and when ``alloc`` raises
    ``InsufficientBlocksError`` preempt the youngest request: it is released (its full pages
    stay cached), goes back to the front of the queue, and is recomputed from its cached prefix
    when re-admitted. Tokens equal each prompt's own greedy generation.

    The model runs with ``attn_implementation="kvcache"`` for the duration of :meth:`generate`
    (set and restored by it). The manager's pages are in ``model.dtype``.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM whose config :func:`layer_windows` accepts.
    backend : {"kvfast", "kvref"}
    num_blocks : int
        Pages in the pool (page 0 is the null page).
    page_size : int
    max_batch_size : int
        Requests in one forward.
    max_seq_len : int, optional
        Longest request (prompt + generated); default ``config.max_position_embeddings``.
    chunk_size : int
        Longest prefill chunk of one request in one forward.

    Attributes
    ----------
    manager : PagedKVCacheManager
    stats : GenerationStats
        Of the last :meth:`generate` call.
    """

    def __init__(self, model, *, backend: str = "kvfast", num_blocks: int = 64, page_size: int = 16,
                 max_batch_size: int = 8, max_seq_len: Optional[int] = None, chunk_size: int = 64):
        api = "ContinuousBatchingGenerator"
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"{api}: model={type(model).__name__}, must be a transformers model")
        self.model = model
        self._pkg = kv = _backend(api, backend)
        self.windows = layer_windows(model.config)
        num_layers, kv_heads, head_dim = _kv_geometry(api, model)
        self.page_size = _check_positive(api, "page_size", page_size)
        self.max_batch_size = _check_positive(api, "max_batch_size", max_batch_size)
        self.chunk_size = _check_positive(api, "chunk_size", chunk_size)
        if max_seq_len is None:
            max_seq_len = int(getattr(_text_config(api, model.config), "max_position_embeddings", 0) or 0)
        self.max_seq_len = _check_positive(api, "max_seq_len", max_seq_len)
        _check_positive(api, "num_blocks", num_blocks, low=2)
        self.layer_leaf = ["full" if w is None else f"swa{w}" for w in self.windows]
        leaves = None
        if any(w is not None for w in self.windows):
            leaves = {leaf: (kv.LeafSpec.full() if w is None else kv.LeafSpec.sliding_window(w))
                      for leaf, w in zip(self.layer_leaf, self.windows)}
        dtype = _dtype_name(api, model.dtype)
        params = kv.KVCacheParams(page_size=self.page_size, num_layers=num_layers, kv_heads=kv_heads,
                                  head_dim=head_dim, dtype=dtype, leaves=leaves)
        self.manager = kv.PagedKVCacheManager(params, num_blocks=num_blocks, max_batch_size=self.max_batch_size,
                                              max_seq_len=self.max_seq_len)
        self.stats = GenerationStats()
        self._cache_kw = _cache_kwarg(model)
        self._n = 0

    def _admit(self, req: _Request) -> bool:
        mgr, ps, ctx = self.manager, self.page_size, req.ctx
        if not mgr.contains(ctx):
            mgr.claim(ctx)
        hits = mgr.get_prefix_cache_hit_counts(ctx)[0]
        expect = min(hits.total_blocks, (ctx.active_length - 1) // ps) * ps
        if expect + self.chunk_size < ctx.active_length:
            ctx.chunk(expect + self.chunk_size)
        try:
            mgr.alloc(ctx)
        except self._pkg.InsufficientBlocksError:
            mgr.release(ctx)
            ctx.reset()
            return False
        hit = int(ctx.cached_prefix_length)
        self.stats.prefix_hit_tokens += hit
        self.stats.admissions_with_hit += hit > 0
        self.stats.readmissions += req.preempted
        return True

    @torch.no_grad()
    def _forward(self, batch: list[_Request]) -> torch.Tensor:
        ctxs = [r.ctx for r in batch]
        inputs = self.manager.runtime_inputs([ctxs]).inputs[0]
        q_lens = np.asarray([c.active_length for c in ctxs], dtype=np.int64)
        step = _ManagerStep(self, inputs, q_lens)
        ids = torch.from_numpy(np.concatenate([c.active_tokens for c in ctxs]).astype(np.int64))[None]
        last = torch.from_numpy(np.cumsum(q_lens) - 1)
        out = self.model(input_ids=ids, position_ids=step._q_pos[None], use_cache=True, logits_to_keep=last,
                         **{self._cache_kw: step})
        return out.logits[0]                                       # [B, vocab]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens,
                 eos_token_id: Optional[int] = None) -> list[list[int]]:
        """Greedy-decode every prompt; return each prompt's new tokens, in prompt order.

        Parameters
        ----------
        prompts : sequence of sequence of int
            Token ids, each non-empty.
        max_new_tokens : int or sequence of int
            Tokens to generate per prompt (one value for all, or one each), each >= 1.
        eos_token_id : int, optional
            A request also ends when it generates this token (which is returned).

        Returns
        -------
        list of list of int

        Raises
        ------
        ValueError
            An empty prompt, a bad ``max_new_tokens``, or a request longer than ``max_seq_len``.
        RuntimeError
            A request that does not fit the idle pool.
        """
        api = "ContinuousBatchingGenerator.generate"
        prompts = [np.asarray(list(p), dtype=np.int64) for p in prompts]
        if isinstance(max_new_tokens, (int, np.integer)) and not isinstance(max_new_tokens, bool):
            news = [int(max_new_tokens)] * len(prompts)
        else:
            news = [int(x) for x in max_new_tokens]
            if len(news) != len(prompts):
                raise ValueError(f"{api}: len(max_new_tokens)={len(news)} != len(prompts)={len(prompts)}")
        for i, (p, m) in enumerate(zip(prompts, news)):
            if p.ndim != 1 or p.size == 0:
                raise ValueError(f"{api}: prompts[{i}] is empty, must hold at least one token")
            if m < 1:
                raise ValueError(f"{api}: max_new_tokens={m} for prompt {i}, must be >= 1")
            if p.size + m > self.max_seq_len:
                raise ValueError(f"{api}: prompts[{i}] has {p.size} tokens + max_new_tokens={m} > "
                                 f"max_seq_len={self.max_seq_len}")
        self.stats = stats = GenerationStats(prompt_tokens=int(sum(p.size for p in prompts)))
        kv, mgr = self._pkg, self.manager
        waiting: deque = deque()
        for i, (p, m) in enumerate(zip(prompts, news)):
            self._n += 1
            waiting.append(_Request(i, kv.TextContext(f"g{self._n}", p.astype(np.int32)), m))
        running: list[_Request] = []
        results: list[Optional[list[int]]] = [None] * len(prompts)
        saved = getattr(self.model.config, "_attn_implementation", None)
        if saved != ATTENTION_NAME:
            self.model.set_attn_implementation(ATTENTION_NAME)
        try:
            while waiting or running:
                while waiting and len(running) < self.max_batch_size and self._admit(waiting[0]):
                    running.append(waiting.popleft())
                if not running:
                    raise RuntimeError(f"{api}: prompt {waiting[0].index} ({len(waiting[0].ctx)} tokens) does not "
                                       f"fit an idle pool of {mgr.block_count().total} blocks")
                for r in running:
                    if r.ctx.active_length > self.chunk_size:
                        r.ctx.chunk(self.chunk_size)
                while True:                                          # pages for this step, one call; else preempt
                    try:
                        mgr.alloc_many([r.ctx for r in running])     # all or nothing (spec/manager.md §17)
                        break
                    except kv.InsufficientBlocksError:
                        if len(running) == 1:
                            raise RuntimeError(f"{api}: prompt {running[0].index} does not fit an idle pool of "
                                               f"{mgr.block_count().total} blocks") from None
                        victim = running.pop()                       # the youngest
                        mgr.release(victim.ctx)                      # its published pages stay cached
                        victim.ctx.reset()
                        victim.preempted = True
                        waiting.appendleft(victim)
                        stats.preemptions += 1
                logits = self._forward(running)
                stats.steps += 1
                stats.chunked_prefill_steps += any(r.ctx.pending_length for r in running)
                tokens = logits.argmax(dim=-1).tolist()
                sampled, token_ids = [], []
                for r, tok in zip(running, tokens):
                    if r.ctx.pending_length:
                        r.ctx.advance_chunk()
                    else:
                        r.generated.append(int(tok))
                        sampled.append(r.ctx)
                        token_ids.append(int(tok))
                kv.TextContext.update_many(sampled, token_ids)
                mgr.step_many([r.ctx for r in running])              # publish the pages the forward filled
                done = [r for r in running if len(r.generated) >= r.max_new or (
                    eos_token_id is not None and r.generated and r.generated[-1] == eos_token_id)]
                mgr.release_many([r.ctx for r in done])
                for r in done:
                    running.remove(r)
                    results[r.index] = r.generated
        finally:
            for r in running:
                if mgr.contains(r.ctx):
                    mgr.release(r.ctx)
            if saved != ATTENTION_NAME:
                self.model.set_attn_implementation(saved)
        return results
