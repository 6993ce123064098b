"""Configuration of the slot cache: modes, layer kinds, layer specs, config (DESIGN §3)."""

from __future__ import annotations

import enum
import math
import re

import numpy as np
from dataclasses import dataclass

from ._dtypes import KV_DTYPES, STATE_DTYPES, resolve_dtype
from .hashing import HASH_ALGOS

__all__ = ["KVCacheMode", "LayerKind", "KVLayerSpec", "KVCacheConfig", "parse_device", "check_int", "is_int", "INT32_MAX"]

#: Largest value of the int32 index tensors (positions, slot ids, block ids,
#: ``cu_seqlens``): every size that ends up in one is bounded by it
#: (``spec/types.md`` §1).
INT32_MAX = 2**31 - 1


class KVCacheMode(enum.Enum):
    """Storage mode of a slot cache."""

    #: Per layer ``[max_seqs, max_seq_len, kv_heads, head_dim]``; no prefix reuse.
    CONTIGUOUS = "contiguous"
    #: Per layer a pool ``[num_blocks, block_size, kv_heads, head_dim]`` plus one block table.
    PAGED = "paged"


class LayerKind(enum.Enum):
    """What a layer stores."""

    ATTENTION = "attention"
    SLIDING_WINDOW = "sliding_window"
    CROSS_ATTENTION = "cross_attention"
    STATE = "state"


def is_int(value) -> bool:
    """Whether ``value`` is an integer :func:`check_int` accepts (an ``int`` or NumPy integer, not a ``bool``)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_int(owner: str, name: str, value, *, low: int | None = None, high: int | None = None) -> int:
    """Validate an integer argument; ``TypeError`` for a non-int, ``ValueError`` out of bounds.

    ``bool`` is refused: ``True`` is not a size.
    """
    if type(value) is int:  # the common case, without the isinstance chain
        if (low is None or value >= low) and (high is None or value <= high):
            return value
    elif isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{owner}: {name}={value!r}, must be an int")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{owner}: {name}={value}, must be >= {low}")
    if high is not None and value > high:
        raise ValueError(f"{owner}: {name}={value}, must be <= {high}")
    return value


_DEVICE_RE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


def parse_device(owner: str, device: str) -> tuple[str, int]:
    """``"cpu"`` -> ``("cpu", 0)``, ``"cuda:1"`` -> ``("cuda", 1)``; ``ValueError`` otherwise."""
    m = _DEVICE_RE.match(device) if isinstance(device, str) else None
    if m is None or (m.group(1) == "cpu" and m.group(2) is not None):
        raise ValueError(f"{owner}: device={device!r}, must be 'cpu', 'cuda' or 'cuda:N'")
    return m.group(1), int(m.group(2) or 0)


@dataclass(frozen=True, slots=True)
class KVLayerSpec:
    """What one layer of the model stores. Build it with a constructor.

    Attributes
    ----------
    kind : LayerKind
    kv_heads, head_dim : int
        Attention kinds: K/V heads and head size (0 for STATE).
    window : int
        SLIDING_WINDOW: keys visible including the current token; position p
        sees keys ``[p - window + 1, p]``. 0 otherwise.
    max_enc_len : int
        CROSS_ATTENTION: encoder positions per slot. 0 otherwise.
    conv_dims : tuple of int
        STATE: channels of each conv window (one entry per window).
    conv_width : int
        STATE: the conv window width W (the state keeps the last W inputs).
    recurrent : tuple (heads, k_dim, v_dim) or None
        STATE: shape of the recurrent state per slot.
    """

    kind: LayerKind
    kv_heads: int = 0
    head_dim: int = 0
    window: int = 0
    max_enc_len: int = 0
    conv_dims: tuple[int, ...] = ()
    conv_width: int = 0
    recurrent: tuple[int, int, int] | None = None

    @classmethod
    def attention(cls, kv_heads: int, head_dim: int) -> "KVLayerSpec":
        """A full causal attention layer."""
        o = "KVLayerSpec.attention"
        return cls(
            LayerKind.ATTENTION,
            check_int(o, "kv_heads", kv_heads, low=1, high=INT32_MAX),
            check_int(o, "head_dim", head_dim, low=1, high=INT32_MAX),
        )

    @classmethod
    def sliding_window(cls, kv_heads: int, head_dim: int, window: int) -> "KVLayerSpec":
        """A sliding-window layer; ``window`` counts the current token (>= 1)."""
        o = "KVLayerSpec.sliding_window"
        return cls(
            LayerKind.SLIDING_WINDOW,
            check_int(o, "kv_heads", kv_heads, low=1, high=INT32_MAX),
            check_int(o, "head_dim", head_dim, low=1, high=INT32_MAX),
            window=check_int(o, "window", window, low=1, high=INT32_MAX),
        )

    @classmethod
    def cross_attention(cls, kv_heads: int, head_dim: int, max_enc_len: int) -> "KVLayerSpec":
        """A cross-attention layer with dense per-slot planes of ``max_enc_len`` positions."""
        o = "KVLayerSpec.cross_attention"
        return cls(
            LayerKind.CROSS_ATTENTION,
            check_int(o, "kv_heads", kv_heads, low=1, high=INT32_MAX),
            check_int(o, "head_dim", head_dim, low=1, high=INT32_MAX),
            max_enc_len=check_int(o, "max_enc_len", max_enc_len, low=1, high=INT32_MAX),
        )

    @classmethod
    def state(cls, conv_dims, conv_width: int, recurrent=None) -> "KVLayerSpec":
        """A state-space layer: conv windows ``conv_dims`` of width ``conv_width``,
        and an optional recurrent state of shape ``(heads, k_dim, v_dim)``."""
        o = "KVLayerSpec.state"
        if isinstance(conv_dims, (int,)) or not hasattr(conv_dims, "__iter__"):
            raise TypeError(f"{o}: conv_dims={conv_dims!r}, must be a tuple of ints")
        dims = tuple(check_int(o, f"conv_dims[{i}]", d, low=1, high=INT32_MAX) for i, d in enumerate(conv_dims))
        width = check_int(o, "conv_width", conv_width, low=0, high=INT32_MAX)
        if dims and width < 1:
            raise ValueError(f"{o}: conv_width={width}, must be >= 1 when conv_dims is not empty")
        rec = None
        if recurrent is not None:
            if not hasattr(recurrent, "__len__") or len(recurrent) != 3:
                raise ValueError(f"{o}: recurrent={recurrent!r}, must be (heads, k_dim, v_dim) or None")
            rec = tuple(check_int(o, f"recurrent[{i}]", d, low=1, high=INT32_MAX) for i, d in enumerate(recurrent))
        if not dims and rec is None:
            raise ValueError(f"{o}: conv_dims=() and recurrent=None, a state layer must store something")
        return cls(LayerKind.STATE, conv_dims=dims, conv_width=width, recurrent=rec)

    @property
    def is_attention(self) -> bool:
        """True for kinds whose K/V live in the slot/paged storage (ATTENTION, SLIDING_WINDOW)."""
        return self.kind in (LayerKind.ATTENTION, LayerKind.SLIDING_WINDOW)


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """Sizes and options of a slot cache (``KVCache.make(config, layer_specs)``).

    ``num_blocks=0`` in paged mode sizes the pool to hold every slot at full
    length: ``max_seqs * ceil(max_seq_len / block_size) + 1`` (block 0 is the
    null block). ``num_state_checkpoints=None`` means ``max_seqs``.
    Validation raises ``ValueError`` (``TypeError`` for a non-int) naming the field.
    """

    num_layers: int
    max_seqs: int
    max_seq_len: int
    mode: KVCacheMode
    block_size: int = 16
    num_blocks: int = 0
    dtype: str = "float16"
    state_dtype: str = "float32"
    device: str = "cpu"
    enable_prefix_caching: bool = True
    hash_algo: str = "sha256"
    hash_seed: int = 0
    num_state_checkpoints: int | None = None

    def __post_init__(self):
        o = "KVCacheConfig"
        # spec/types.md §1: every size that lands in an int32 index tensor is bounded by INT32_MAX,
        # checked before any arithmetic on it.
        check_int(o, "num_layers", self.num_layers, low=1, high=INT32_MAX)
        check_int(o, "max_seqs", self.max_seqs, low=1, high=INT32_MAX)
        check_int(o, "max_seq_len", self.max_seq_len, low=1, high=INT32_MAX)
        if not isinstance(self.mode, KVCacheMode):
            raise ValueError(f"{o}: mode={self.mode!r}, must be a KVCacheMode")
        check_int(o, "block_size", self.block_size, low=1, high=INT32_MAX)
        check_int(o, "num_blocks", self.num_blocks, low=0, high=INT32_MAX)
        if self.mode is KVCacheMode.PAGED and self.num_blocks == 1:
            raise ValueError(f"{o}: num_blocks=1, must be 0 (auto) or >= 2 (block 0 is the null block)")
        if self.mode is KVCacheMode.PAGED and self.num_blocks == 0:
            auto = self.max_seqs * self.max_blocks_per_seq + 1
            if auto > INT32_MAX:
                raise ValueError(
                    f"{o}: num_blocks=0 sizes the pool to max_seqs*ceil(max_seq_len/block_size)+1={auto}, "
                    f"must be <= {INT32_MAX} (int32 block ids); give num_blocks"
                )
        resolve_dtype(o, "dtype", self.dtype, KV_DTYPES)
        resolve_dtype(o, "state_dtype", self.state_dtype, STATE_DTYPES)
        parse_device(o, self.device)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"{o}: enable_prefix_caching={self.enable_prefix_caching!r}, must be a bool")
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(f"{o}: hash_algo={self.hash_algo!r}, must be one of {sorted(HASH_ALGOS)}")
        check_int(o, "hash_seed", self.hash_seed, low=0, high=2**64 - 1)
        if self.num_state_checkpoints is not None:
            check_int(o, "num_state_checkpoints", self.num_state_checkpoints, low=0, high=INT32_MAX)

    @property
    def max_blocks_per_seq(self) -> int:
        """Columns of the block table: ``ceil(max_seq_len / block_size)``."""
        return -(-self.max_seq_len // self.block_size)  # exact integer ceil

    @property
    def resolved_num_blocks(self) -> int:
        """Pool size including the null block (``num_blocks`` or the auto size)."""
        if self.num_blocks:
            return self.num_blocks
        return self.max_seqs * self.max_blocks_per_seq + 1

    @property
    def resolved_num_state_checkpoints(self) -> int:
        """``num_state_checkpoints``, or ``max_seqs`` when it is None."""
        return self.max_seqs if self.num_state_checkpoints is None else self.num_state_checkpoints

    @property
    def np_dtype(self):
        """The NumPy dtype of K/V storage (``dtype`` resolved; bfloat16 from ml_dtypes)."""
        return resolve_dtype("KVCacheConfig", "dtype", self.dtype, KV_DTYPES)

    @property
    def np_state_dtype(self):
        """The NumPy dtype of the state slabs (``state_dtype`` resolved)."""
        return resolve_dtype("KVCacheConfig", "state_dtype", self.state_dtype, STATE_DTYPES)
