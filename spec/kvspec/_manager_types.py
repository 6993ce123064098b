"""Types of the request manager (DESIGN §5): params, leaves, contexts, counts, metrics, inputs."""

from __future__ import annotations

import dataclasses
import enum
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, runtime_checkable

import numpy as np

from ._config import check_int
from ._dtypes import FP8_DTYPES, KV_DTYPES, STATE_DTYPES, dtype_name, resolve_dtype
from ._interop import int64_from_ints
from . import retention as _retention
from .hashing import HASH_ALGOS, salt_bytes

__all__ = [
    "LUT_ALIGN",
    "LeafKind",
    "LeafSpec",
    "KVCacheParams",
    "TextContext",
    "BlockCount",
    "ByteCount",
    "PrefixCacheHits",
    "KVCacheMetrics",
    "KVCacheInputsPerDevice",
    "KVCacheInputs",
    "KVTransfer",
    "CompletedTransfer",
    "DEFAULT_LEAF_ID",
    "SpecDecodingState",
    "SPECULATIVE_METHODS",
    "spec_decode_cache_slack",
]

#: Id of the default full-attention leaf.
DEFAULT_LEAF_ID = "full"


# --------------------------------------------------------------------------- leaves


class LeafKind(enum.Enum):
    """What kind of pages a leaf holds."""

    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    RECURRENT = "recurrent"


@dataclass(frozen=True, slots=True)
class LeafSpec:
    """One leaf of the manager: a kind of page with its own pool per replica.

    Build with ``LeafSpec.full()``, ``LeafSpec.sliding_window(window)`` or
    ``LeafSpec.recurrent(state_shape, dtype="float32")``.

    Attributes
    ----------
    kind : LeafKind
    window : int
        SLIDING_WINDOW: keys visible including the current token (> 1).
    state_shape : tuple of int
        RECURRENT: shape of one state checkpoint (one page holds one state).
    state_dtype : str
        RECURRENT: dtype name of the state.
    """

    kind: LeafKind
    window: int = 0
    state_shape: tuple[int, ...] = ()
    state_dtype: str = "float32"

    @classmethod
    def full(cls) -> "LeafSpec":
        """A full-attention leaf: every token's K/V kept."""
        return cls(LeafKind.FULL)

    @classmethod
    def sliding_window(cls, window: int) -> "LeafSpec":
        """A sliding-window leaf that keeps the last ``window`` keys (``window >= 2``, counting the current token)."""
        return cls(LeafKind.SLIDING_WINDOW, window=check_int("LeafSpec.sliding_window", "window", window, low=2))

    @classmethod
    def recurrent(cls, state_shape, dtype: str = "float32") -> "LeafSpec":
        """A recurrent-state leaf: one page holds one state checkpoint of ``state_shape`` in ``dtype``."""
        o = "LeafSpec.recurrent"
        if not hasattr(state_shape, "__iter__"):
            raise TypeError(f"{o}: state_shape={state_shape!r}, must be a tuple of ints")
        shape = tuple(check_int(o, f"state_shape[{i}]", d, low=1) for i, d in enumerate(state_shape))
        if not shape:
            raise ValueError(f"{o}: state_shape=(), must have at least one dimension")
        resolve_dtype(o, "dtype", dtype, STATE_DTYPES)
        return cls(LeafKind.RECURRENT, state_shape=shape, state_dtype=dtype_name(dtype))


# --------------------------------------------------------------------------- params


_PARAM_FIELDS = (
    "page_size", "num_layers", "kv_heads", "head_dim", "dtype", "data_parallel_degree",
    "enable_prefix_caching", "hash_algo", "hash_seed", "host_offload_bytes",
    "disk_offload_bytes", "disk_offload_dir", "model_id", "allocate_buffers",
    "speculative_method", "num_draft_tokens",
)

#: Speculative-decoding methods (MAX's ``SpeculativeMethod``) and the draft tokens each
#: draft forward writes (``num_draft_tokens_per_step``): autoregressive drafts one,
#: block drafts (DFlash) all of them (spec/manager.md "Speculative decoding").
SPECULATIVE_METHODS = ("standalone", "eagle", "mtp", "dflash", "dflash2")
_BLOCK_DRAFT_METHODS = ("dflash", "dflash2")


class KVCacheParams:
    """Geometry and options of a ``PagedKVCacheManager`` (immutable).

    Parameters
    ----------
    page_size : int
        Tokens per page (block), > 0.
    num_layers, kv_heads, head_dim : int
        Geometry of every full/sliding leaf's pages.
    dtype : {"float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"}
        K/V storage; the FP8 dtypes add per-page scales (spec/manager.md §16).
    data_parallel_degree : int
        Replicas, each with its own pools and block ids.
    enable_prefix_caching : bool
    hash_algo : {"sha256", "xxh3_128"}
    hash_seed : int
    leaves : mapping of str to LeafSpec, optional
        ``None`` means one full-attention leaf ``"full"``.
    host_offload_bytes, disk_offload_bytes : int
        Tier sizes; with ``connector=None`` the manager builds a
        ``TieredConnector`` when either is non-zero.
    disk_offload_dir : str, optional
        Directory of the disk tier.
    model_id : str
        Identity of the model whose K/V the pages hold (name plus revision,
        e.g. ``"meta-llama/Llama-3.1-8B@main"``). Mixed into what every tier
        keys and verifies, so two models of the same geometry never share a
        block through any tier (spec/tiers.md). ``""`` means unnamed.
    allocate_buffers : bool
        ``False`` runs the whole policy (allocation, hits, eviction, tier
        accounting) without allocating K/V bytes (bookkeeping-only mode, as
        MAX's ``allocate_buffers``); calls that need the bytes raise
        ``RuntimeError``.
    speculative_method : {"standalone", "eagle", "mtp", "dflash", "dflash2"}, optional
        Speculative-decoding method (MAX's ``speculative_method``); decides
        ``num_draft_tokens_per_step``. Needs ``num_draft_tokens >= 1``.
    num_draft_tokens : int
        Draft tokens proposed per speculative iteration (0: no speculation).
        ``alloc`` reserves MAX's slack for them (spec/manager.md
        "Speculative decoding").

    Notes
    -----
    With an FP8 ``dtype`` (``"float8_e4m3fn"``, ``"float8_e5m2"``) every
    full/sliding page also carries float32 scales, one per (layer, K/V,
    kv head): ``page_scales_shape = (2, num_layers, kv_heads)``; one page's
    payload (``kv_page_bytes``) is its value bytes followed by its scale bytes.
    """

    __slots__ = tuple("_" + f for f in _PARAM_FIELDS) + ("_leaves",)

    def __init__(
        self,
        page_size: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: str = "float16",
        data_parallel_degree: int = 1,
        enable_prefix_caching: bool = True,
        hash_algo: str = "sha256",
        hash_seed: int = 0,
        leaves: Mapping[str, LeafSpec] | None = None,
        host_offload_bytes: int = 0,
        disk_offload_bytes: int = 0,
        disk_offload_dir: str | None = None,
        model_id: str = "",
        allocate_buffers: bool = True,
        speculative_method: str | None = None,
        num_draft_tokens: int = 0,
    ):
        o = "KVCacheParams"
        check_int(o, "page_size", page_size, low=1)
        check_int(o, "num_layers", num_layers, low=1)
        check_int(o, "kv_heads", kv_heads, low=1)
        check_int(o, "head_dim", head_dim, low=1)
        resolve_dtype(o, "dtype", dtype, KV_DTYPES)
        check_int(o, "data_parallel_degree", data_parallel_degree, low=1)
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"{o}: enable_prefix_caching={enable_prefix_caching!r}, must be a bool")
        if hash_algo not in HASH_ALGOS:
            raise ValueError(f"{o}: hash_algo={hash_algo!r}, must be one of {sorted(HASH_ALGOS)}")
        check_int(o, "hash_seed", hash_seed, low=0, high=2**64 - 1)
        check_int(o, "host_offload_bytes", host_offload_bytes, low=0)
        check_int(o, "disk_offload_bytes", disk_offload_bytes, low=0)
        if disk_offload_bytes and not disk_offload_dir:
            raise ValueError(f"{o}: disk_offload_bytes={disk_offload_bytes} needs disk_offload_dir")
        if not isinstance(model_id, str):
            raise TypeError(f"{o}: model_id={model_id!r}, must be a str")
        if len(model_id.encode("utf-8", "surrogatepass")) > 1024:
            raise ValueError(f"{o}: model_id has {len(model_id.encode('utf-8', 'surrogatepass'))} UTF-8 bytes, must be <= 1024")
        if not isinstance(allocate_buffers, bool):
            raise TypeError(f"{o}: allocate_buffers={allocate_buffers!r}, must be a bool")
        check_int(o, "num_draft_tokens", num_draft_tokens, low=0, high=2**20)
        if speculative_method is not None and speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"{o}: speculative_method={speculative_method!r}, must be None or one of "
                             f"{list(SPECULATIVE_METHODS)}")
        if speculative_method is not None and not num_draft_tokens:
            raise ValueError(f"{o}: speculative_method={speculative_method!r} needs num_draft_tokens >= 1, got 0")
        if leaves is None:
            leaf_map = {DEFAULT_LEAF_ID: LeafSpec.full()}
        else:
            if not isinstance(leaves, Mapping) or not leaves:
                raise ValueError(f"{o}: leaves={leaves!r}, must be a non-empty mapping of leaf id to LeafSpec")
            leaf_map = {}
            for k, v in leaves.items():
                if not isinstance(k, str) or not k:
                    raise ValueError(f"{o}: leaves key {k!r}, must be a non-empty str")
                if not isinstance(v, LeafSpec):
                    raise TypeError(f"{o}: leaves[{k!r}]={v!r}, must be a LeafSpec")
                leaf_map[k] = v
            if not any(v.kind is not LeafKind.RECURRENT for v in leaf_map.values()):
                raise ValueError(f"{o}: leaves={sorted(leaf_map)} has no full or sliding-window leaf")
        object.__setattr__(self, "_leaves", dict(leaf_map))
        for name, value in zip(
            _PARAM_FIELDS,
            (page_size, num_layers, kv_heads, head_dim, dtype_name(dtype), data_parallel_degree,
             enable_prefix_caching, hash_algo, hash_seed, host_offload_bytes, disk_offload_bytes,
             disk_offload_dir, model_id, allocate_buffers, speculative_method, num_draft_tokens),
        ):
            object.__setattr__(self, "_" + name, int(value) if isinstance(value, np.integer) else value)

    def __setattr__(self, name, value):
        raise AttributeError(f"KVCacheParams is immutable; cannot set {name}")

    page_size = property(lambda self: self._page_size)
    num_layers = property(lambda self: self._num_layers)
    kv_heads = property(lambda self: self._kv_heads)
    head_dim = property(lambda self: self._head_dim)
    dtype = property(lambda self: self._dtype)
    data_parallel_degree = property(lambda self: self._data_parallel_degree)
    enable_prefix_caching = property(lambda self: self._enable_prefix_caching)
    hash_algo = property(lambda self: self._hash_algo)
    hash_seed = property(lambda self: self._hash_seed)
    host_offload_bytes = property(lambda self: self._host_offload_bytes)
    disk_offload_bytes = property(lambda self: self._disk_offload_bytes)
    disk_offload_dir = property(lambda self: self._disk_offload_dir)
    model_id = property(lambda self: self._model_id)
    allocate_buffers = property(lambda self: self._allocate_buffers)
    speculative_method = property(lambda self: self._speculative_method)
    num_draft_tokens = property(lambda self: self._num_draft_tokens)

    @property
    def num_draft_tokens_per_step(self) -> int:
        """Draft tokens one draft forward writes (MAX's rule): 0 without a
        ``speculative_method``; ``num_draft_tokens`` for block drafts
        (``"dflash"``, ``"dflash2"``); 1 for autoregressive drafts."""
        if self._speculative_method is None:
            return 0
        return self._num_draft_tokens if self._speculative_method in _BLOCK_DRAFT_METHODS else 1

    @property
    def page_scales_shape(self) -> tuple[int, ...]:
        """Shape of one full/sliding page's float32 scales, ``(2, num_layers, kv_heads)`` for an
        FP8 ``dtype``; ``()`` (no scales) otherwise."""
        if self._dtype in FP8_DTYPES:
            return (2, self._num_layers, self._kv_heads)
        return ()

    @property
    def kv_page_bytes(self) -> int:
        """Bytes of one full/sliding page's payload: its values, then (FP8) its float32 scales."""
        values = math.prod(self.page_shape) * self.np_dtype.itemsize
        scales = self.page_scales_shape
        return values + (4 * math.prod(scales) if scales else 0)

    def leaves(self) -> dict[str, LeafSpec]:
        """``{leaf_id: LeafSpec}`` in declaration order (a copy)."""
        return dict(self._leaves)

    @property
    def np_dtype(self) -> np.dtype:
        """The NumPy dtype of the pages (``dtype`` resolved; bfloat16 from ml_dtypes)."""
        return KV_DTYPES[self._dtype]

    @property
    def page_shape(self) -> tuple[int, ...]:
        """Shape of one full/sliding page: ``(2, num_layers, page_size, kv_heads, head_dim)``."""
        return (2, self._num_layers, self._page_size, self._kv_heads, self._head_dim)

    def page_bytes(self, leaf_id: str = DEFAULT_LEAF_ID) -> int:
        """Bytes of one page of ``leaf_id``'s buffer (an FP8 page's scales live in their own buffer:
        ``kv_page_bytes`` is the page's tier payload, values plus scales)."""
        leaf = self._leaves[leaf_id]
        if leaf.kind is LeafKind.RECURRENT:
            return math.prod(leaf.state_shape) * STATE_DTYPES[leaf.state_dtype].itemsize
        return math.prod(self.page_shape) * self.np_dtype.itemsize  # values only: FP8 scales are kv_page_bytes

    def _key(self):
        return tuple(getattr(self, "_" + f) for f in _PARAM_FIELDS) + (tuple(self._leaves.items()),)

    def __eq__(self, other):
        return isinstance(other, KVCacheParams) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        fields = ", ".join(f"{f}={getattr(self, '_' + f)!r}" for f in _PARAM_FIELDS)
        return f"KVCacheParams({fields}, leaves={self._leaves!r})"


def spec_decode_cache_slack(params: KVCacheParams) -> int:
    """Extra KV positions a speculating request may occupy past ``max_seq_len`` (MAX's formula).

    ``3 * num_draft_tokens + block_draft_extra + 1`` with ``block_draft_extra = 1``
    when ``num_draft_tokens_per_step == num_draft_tokens`` (block drafts), else 0;
    0 when ``num_draft_tokens == 0`` (spec/manager.md "Speculative decoding").

    Raises
    ------
    TypeError
        ``params`` is not a ``KVCacheParams``.
    """
    if not isinstance(params, KVCacheParams):
        raise TypeError(f"spec_decode_cache_slack: params={params!r}, must be a KVCacheParams")
    k = params.num_draft_tokens
    if k <= 0:
        return 0
    return 3 * k + (1 if params.num_draft_tokens_per_step == k else 0) + 1


# --------------------------------------------------------------------------- context


@dataclass
class SpecDecodingState:
    """A request's speculative-decoding state (MAX's ``SpecDecodingState``).

    Attributes
    ----------
    draft_tokens_to_verify : list of int
        Draft tokens the next forward verifies (after the active tokens); at
        most ``params.num_draft_tokens``.
    maybe_accepted_draft_tokens : list of int
        Draft tokens an in-flight forward is verifying (overlap scheduling):
        their K/V is counted as cached, conservatively assuming all are
        accepted; at most ``params.num_draft_tokens``.
    """

    draft_tokens_to_verify: list = field(default_factory=list)
    maybe_accepted_draft_tokens: list = field(default_factory=list)



def _token_int(owner: str, token) -> int:
    """A token id as an int in the int32 range: a Python or NumPy integer, or anything with
    ``__index__`` (a 0-d integer array or tensor); ``TypeError`` / ``ValueError`` naming ``token``."""
    if type(token) is not int and not isinstance(token, (bool, np.integer)) and hasattr(token, "__index__"):
        try:
            token = operator.index(token)  # torch.tensor(7), np.array(7)
        except TypeError:
            pass  # a float tensor: the message below
    if isinstance(token, np.integer):
        token = int(token)
    return check_int(owner, "token", token, low=-(2**31), high=2**31 - 1)


def _token_list(owner: str, tokens) -> list:
    """``tokens`` (a sequence, a 1-D integer array or CPU tensor) as a list of Python values."""
    if type(tokens) is list:
        return list(tokens)
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__"):
        raise TypeError(f"{owner}: tokens={tokens!r}, must be a sequence or a 1-D integer array")
    if isinstance(tokens, (tuple, range)):
        return list(tokens)
    try:
        arr = np.asarray(tokens)
    except Exception as e:  # noqa: BLE001  (a device tensor: no host view)
        raise TypeError(f"{owner}: tokens={type(tokens).__name__} has no host array view ({e})") from None
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == object):
        raise TypeError(f"{owner}: tokens has shape {arr.shape} and dtype {arr.dtype}, must be 1-D integers")
    return arr.tolist()


class TextContext:
    """A request's token buffer: ``[processed | active | pending]``.

    ``processed_length`` tokens are in the KV cache; the next forward computes
    the ``active_length`` tokens after them; ``pending`` tokens (after a
    ``chunk``) wait for later chunks. ``current_position = processed_length +
    active_length``.

    A fresh context has ``processed_length == 0`` and every token active.
    After a forward, ``update(token)`` appends the sampled token, moves the
    processed mark to the end of the old tokens and leaves one active token.
    A chunked prefill instead calls ``advance_chunk()`` after each non-final
    chunk.

    Parameters
    ----------
    request_id : str
    tokens : int [N]
        Prompt token ids (N >= 1, each in int32 range).
    cache_salt : str or bytes, optional
        Enters the hash root; different salts never share blocks.
    retention_priority : int, keyword-only
        ``0 .. 100`` (default 35, TensorRT-LLM's): the pages this request
        publishes or hits are evicted after pages of lower priority
        (spec/manager.md §14). Settable.
    retention_seconds : float or None, keyword-only
        Time-to-live of that priority from the request's release (``None``:
        until evicted); an expired page falls back to plain LRU. Settable.
    """

    __slots__ = (
        "request_id", "cache_salt", "_tokens", "_length", "_processed", "_active",
        "cached_prefix_length", "cached_prefix_external_length", "_spec_decoding_state",
        "_retention_priority", "_retention_seconds",
    )

    def __init__(self, request_id: str, tokens, cache_salt: str | bytes | None = None, *,
                 retention_priority: int = 35, retention_seconds: float | None = None):
        o = "TextContext"
        retention_priority = _retention.check_priority(o, retention_priority)  # spec/manager.md §14.1
        retention_seconds = _retention.check_seconds(o, retention_seconds)
        if not isinstance(request_id, str):
            raise TypeError(f"{o}: request_id={request_id!r}, must be a str")
        arr = int64_from_ints(tokens)  # a list of Python ints (a tokenizer's output), packed
        if arr is None:
            try:
                arr = np.asarray(tokens)
            except ValueError as e:  # ragged nesting: NumPy's words, our name
                raise ValueError(f"{o}: tokens={tokens!r:.80} is not a 1-D integer sequence ({e})") from None
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"{o}: tokens shape={arr.shape}, must be 1-D and non-empty")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{o}: tokens dtype={arr.dtype}, must be an integer type")
        if arr.min() < -(2**31) or arr.max() > 2**31 - 1:
            raise ValueError(f"{o}: tokens out of int32 range")
        salt_bytes(cache_salt)  # validates the type
        self.request_id = request_id
        self.cache_salt = cache_salt
        self._tokens = np.empty(max(16, 2 * arr.size), dtype=np.int32)
        self._tokens[: arr.size] = arr
        self._length = int(arr.size)
        self._processed = 0
        self._active = int(arr.size)
        #: Tokens reused from the prefix cache at the last admission (written by the manager).
        self.cached_prefix_length = 0
        #: Of those, tokens loaded from an external tier (written by the manager).
        self.cached_prefix_external_length = 0
        self._spec_decoding_state: SpecDecodingState | None = None  # created on first access
        self._retention_priority = retention_priority
        self._retention_seconds = retention_seconds

    # -- retention (spec/manager.md §14)
    @property
    def retention_priority(self) -> int:
        """``0 .. 100``: eviction level of the pages this request publishes or hits (35 by default)."""
        return self._retention_priority

    @retention_priority.setter
    def retention_priority(self, value: int) -> None:
        self._retention_priority = _retention.check_priority("TextContext", value)

    @property
    def retention_seconds(self) -> float | None:
        """Time-to-live of the priority from the release, or ``None`` (until evicted)."""
        return self._retention_seconds

    @retention_seconds.setter
    def retention_seconds(self, value: float | None) -> None:
        self._retention_seconds = _retention.check_seconds("TextContext", value)

    # -- reads
    @property
    def tokens(self) -> np.ndarray:
        """int32 [N]: every token (processed, active and pending); a read-only view."""
        v = self._tokens[: self._length]
        v = v.view()
        v.flags.writeable = False
        return v

    @property
    def processed_length(self) -> int:
        """Tokens whose K/V are in the cache (the prefix hit counts)."""
        return self._processed

    @property
    def active_length(self) -> int:
        """Tokens the next forward computes, right after ``processed_length``."""
        return self._active

    @property
    def current_position(self) -> int:
        """``processed_length + active_length``: where the next forward ends."""
        return self._processed + self._active

    @property
    def pending_length(self) -> int:
        """Tokens after the active region (left by ``chunk``)."""
        return self._length - self._processed - self._active

    @property
    def active_tokens(self) -> np.ndarray:
        """int32 ``[active_length]``: the tokens of the active region (a view of ``tokens``)."""
        return self.tokens[self._processed : self.current_position]

    @property
    def spec_decoding_state(self) -> SpecDecodingState:
        """The request's ``SpecDecodingState`` (draft tokens), created empty on first access;
        ``reset()`` drops it. Drafts are never part of ``tokens``: accepted ones are
        appended with ``update`` (spec/manager.md "Speculative decoding")."""
        state = self._spec_decoding_state
        if state is None:
            state = self._spec_decoding_state = SpecDecodingState()
        return state

    def __len__(self) -> int:
        return self._length

    # -- mutators
    def update(self, token: int) -> None:
        """After a forward over the whole active region: append ``token`` and
        leave it as the only active token.

        ``token``: an int in the int32 range, a NumPy integer or a 0-d integer
        array or tensor (a sampler's output, ``torch.argmax(...)[i]``).
        """
        if type(token) is not int or not -2147483648 <= token <= 2147483647:
            token = _token_int("TextContext.update", token)
        n = self._length  # the per-token path: each attribute read once
        if n != self._processed + self._active:  # pending_length, inlined
            raise self._pending_refused()
        buf = self._tokens
        if n == buf.size:
            grown = np.empty(2 * n, dtype=np.int32)
            grown[:n] = buf
            self._tokens = buf = grown
        buf[n] = token
        self._length = n + 1
        self._processed = n
        self._active = 1

    @staticmethod
    def update_many(ctxs, tokens) -> None:
        """``for ctx, token in zip(ctxs, tokens): ctx.update(token)``, all or nothing
        (spec/manager.md §17.4).

        Parameters
        ----------
        ctxs : sequence of TextContext
            One new token each, in order (a context listed twice gets two).
        tokens : sequence of int, or int [len(ctxs)]
            A list, a 1-D NumPy integer array, or a 1-D integer tensor on the
            CPU (anything ``numpy.asarray`` reads as 1-D integers).

        Raises
        ------
        TypeError, ValueError
            ``ctxs`` or ``tokens`` not a sequence, their lengths differ, or the
            error the loop of ``update`` would raise at its first failing
            context (the same message); no context changed.
        """
        o = "TextContext.update_many"
        if isinstance(ctxs, (str, bytes, TextContext)) or not hasattr(ctxs, "__iter__"):
            raise TypeError(f"{o}: ctxs={ctxs!r}, must be a sequence of TextContext")
        ctxs = ctxs if type(ctxs) is list else list(ctxs)
        toks = _token_list(o, tokens)
        if len(toks) != len(ctxs):
            raise ValueError(f"{o}: len(tokens)={len(toks)} != len(ctxs)={len(ctxs)}, one token per context")
        n = len(ctxs)
        if not n:
            return
        # One look at the whole batch (C-level passes): exact contexts, each once, nothing pending, every
        # token a Python int in int32 range. Anything else takes the loop's checks below, in its order.
        if not (set(map(type, ctxs)) == {TextContext} and set(map(type, toks)) == {int}
                and -2147483648 <= min(toks) and max(toks) <= 2147483647 and len(set(map(id, ctxs))) == n
                and all([c._length == c._processed + c._active for c in ctxs])):
            TextContext._check_many(o, ctxs, toks)
        # update's write, inlined: calling update per row (its checks again) costs 20 us more per 256 rows
        for ctx, t in zip(ctxs, toks):
            k = ctx._length
            buf = ctx._tokens
            if k == buf.size:
                grown = np.empty(2 * k, dtype=np.int32)
                grown[:k] = buf
                ctx._tokens = buf = grown
            buf[k] = t
            ctx._length = k + 1
            ctx._processed = k
            ctx._active = 1

    @staticmethod
    def _check_many(o: str, ctxs: list, toks: list) -> None:
        """``update_many``'s checks one context at a time, in the loop's order: the error the loop
        of ``update`` would raise first (``toks`` entries are converted in place)."""
        seen = set()
        for i, ctx in enumerate(ctxs):  # every check of the loop first, in its order: nothing changes on an error
            if not isinstance(ctx, TextContext):
                raise TypeError(f"{o}: ctxs[{i}]={ctx!r}, must be a TextContext")
            t = toks[i]
            if type(t) is not int or not -2147483648 <= t <= 2147483647:
                toks[i] = _token_int("TextContext.update", t)
            if id(ctx) not in seen:  # (a repeat follows its own update: nothing pending)
                seen.add(id(ctx))
                if ctx._length != ctx._processed + ctx._active:
                    raise ctx._pending_refused()

    def _pending_refused(self) -> ValueError:
        """``update``'s refusal while a chunk's tokens are pending."""
        return ValueError(f"TextContext.update: {self.pending_length} pending tokens after a chunk; call advance_chunk()")

    def chunk(self, n: int) -> None:
        """Shrink the active region to its first ``n`` tokens (1 <= n < active_length)."""
        n = check_int("TextContext.chunk", "n", n)
        if not 1 <= n < self._active:
            raise ValueError(f"TextContext.chunk: n={n} out of range [1, {self._active})")
        self._active = n

    def advance_chunk(self) -> None:
        """After a forward over a non-final chunk: the chunk is processed and
        every pending token becomes active."""
        if not self.pending_length:
            raise ValueError("TextContext.advance_chunk: no pending tokens; call update(token)")
        self._processed += self._active
        self._active = self._length - self._processed

    def skip_processing(self, n: int) -> None:
        """Mark ``n`` active tokens as processed (a prefix hit); at least one stays active."""
        n = check_int("TextContext.skip_processing", "n", n, low=0)
        if n >= self._active:
            raise ValueError(
                f"TextContext.skip_processing: n={n} would leave 0 active tokens (active_length={self._active})"
            )
        self._processed += n
        self._active -= n

    def rewind_processing(self, n: int) -> None:
        """Move the processed mark back by ``n`` tokens; they become active again."""
        n = check_int("TextContext.rewind_processing", "n", n, low=0)
        if n > self._processed:
            raise ValueError(
                f"TextContext.rewind_processing: n={n} > processed_length={self._processed}"
            )
        self._processed -= n
        self._active += n

    def reset(self) -> None:
        """Back to unprocessed (preemption): every token active, no cached prefix."""
        self._processed = 0
        self._active = self._length
        self.cached_prefix_length = 0
        self.cached_prefix_external_length = 0
        self._spec_decoding_state = None

    def __repr__(self):
        return (
            f"TextContext({self.request_id!r}, len={self._length}, processed={self._processed}, "
            f"active={self._active})"
        )


# --------------------------------------------------------------------------- counts


class _FreeOfTotal:
    """``used``, ``used_pct`` and ``free_pct`` of a ``free``/``total`` pair (0 % when total is 0)."""

    __slots__ = ()
    free: int
    total: int

    @property
    def used(self) -> int:
        return self.total - self.free

    @property
    def used_pct(self) -> float:
        return 100.0 * self.used / self.total if self.total else 0.0

    @property
    def free_pct(self) -> float:
        return 100.0 * self.free / self.total if self.total else 0.0


@dataclass(frozen=True, slots=True)
class BlockCount(_FreeOfTotal):
    """Blocks of one replica: ``free`` (cached-unreferenced count as free) of ``total`` (null excluded)."""

    free: int
    total: int


@dataclass(frozen=True, slots=True)
class ByteCount(_FreeOfTotal):
    """Bytes of a tier: ``free`` of ``total``."""

    free: int
    total: int


@dataclass(frozen=True, slots=True)
class PrefixCacheHits:
    """Blocks of a prompt a replica could serve: from its device pool and from external tiers."""

    device_blocks: int = 0
    external_blocks: int = 0

    @property
    def total_blocks(self) -> int:
        """``device_blocks + external_blocks``."""
        return self.device_blocks + self.external_blocks


@dataclass(slots=True)
class KVCacheMetrics:
    """Counters of a manager and its connector; ``+`` sums them.

    ``prompt_tokens = input_tokens + cache_tokens``;
    ``cache_hit_rate = cache_tokens / prompt_tokens`` (0 when 0).
    """

    #: Tokens computed by forwards: ``active_length`` after the prefix skip, every ``alloc``.
    input_tokens: int = 0
    #: Tokens reused from the prefix cache (device and external), ``blocks * page_size``.
    cache_tokens: int = 0
    #: Blocks served from the device pool (cross-replica copies included).
    device_blocks_served: int = 0
    #: Blocks served from external tiers.
    external_blocks_served: int = 0
    h2d_bytes_copied: int = 0
    d2h_bytes_copied: int = 0
    disk_bytes_written: int = 0
    disk_bytes_read: int = 0
    connector_loads_refused: int = 0
    connector_load_failures: int = 0
    connector_offload_blocks_dropped: int = 0
    cross_replica_blocks_copied: int = 0
    cross_replica_bytes_copied: int = 0

    @property
    def prompt_tokens(self) -> int:
        """``input_tokens + cache_tokens``: every prompt token seen."""
        return self.input_tokens + self.cache_tokens

    @property
    def cache_hit_rate(self) -> float:
        """``cache_tokens / prompt_tokens`` (0.0 when no prompt token was seen)."""
        p = self.prompt_tokens
        return self.cache_tokens / p if p else 0.0

    def __add__(self, other: "KVCacheMetrics") -> "KVCacheMetrics":
        if not isinstance(other, KVCacheMetrics):
            return NotImplemented
        return KVCacheMetrics(*map(operator.add, _metric_values(self), _metric_values(other)))

    def copy(self) -> "KVCacheMetrics":
        """An independent copy of the counters."""
        return KVCacheMetrics(*_metric_values(self))

    def as_dict(self) -> dict[str, int | float]:
        """Every counter plus ``prompt_tokens`` and ``cache_hit_rate``, as a JSON-ready dict."""
        d = dataclasses.asdict(self)
        d["prompt_tokens"] = self.prompt_tokens
        d["cache_hit_rate"] = self.cache_hit_rate
        return d


# --------------------------------------------------------------------------- runtime inputs


#: ``lookup_table`` columns are a multiple of this (spec/manager.md §8: ``roundup8(max(1, n))``).
LUT_ALIGN = 8



#: Every counter of a ``KVCacheMetrics``, in field order (``copy`` and ``+`` in one C-level read).
_metric_values = operator.attrgetter(*(f.name for f in dataclasses.fields(KVCacheMetrics)))


@dataclass(frozen=True, slots=True)
class KVCacheInputsPerDevice:
    """What a paged attention kernel binds for one replica.

    Attributes
    ----------
    kv_blocks : [num_blocks, 2, num_layers, page_size, kv_heads, head_dim]
        The replica's device buffer (live view) of the leaf.
    lookup_table : uint32 [batch, cols]
        Row i: the request's first ``num_req_blocks`` block ids, then 0 (null);
        ``cols`` rounded up to a multiple of ``LUT_ALIGN`` (8).
    cache_lengths : uint32 [batch]
        ``processed_length + len(maybe_accepted_draft_tokens)`` of each request.
    max_prompt_length : int
        Max ``active_length + len(draft_tokens_to_verify)`` in the batch.
    max_cache_length : int
        Max ``processed_length + len(maybe_accepted_draft_tokens) + active_length +
        len(draft_tokens_to_verify) + num_draft_tokens`` in the batch (or the given bound);
        ``current_position`` without speculation.
    kv_scales : float32 [num_blocks, 2, num_layers, kv_heads] or None
        FP8 leaves: the replica's scales buffer (live view), one scale per
        (page, K/V, layer, kv head). ``None`` otherwise.
    scales_page_stride : int64 [1] or None
        FP8: elements from one page's scales to the next (``2 * num_layers * kv_heads``).
    scales_lookup_table : uint32 [batch, cols] or None
        FP8: the lookup table of ``kv_scales`` (scales share the values' block ids,
        so it equals ``lookup_table``). ``kv_scales``, ``scales_page_stride`` and
        ``scales_lookup_table`` are all set or all ``None`` (as MAX's).
    page_stride : int64 [1] or None
        Leaves of a slab (several leaves, spec/manager.md §13.1): elements of
        ``kv_blocks``' dtype from one page to the next, ``-1`` when the pages are
        packed (the page tiles the huge block exactly; MAX's ``PACKED_PAGE_STRIDE``),
        else the padded page. ``None`` with one leaf (always packed).
    """

    kv_blocks: Any
    lookup_table: Any
    cache_lengths: Any
    max_prompt_length: int
    max_cache_length: int
    kv_scales: Any = None
    scales_page_stride: Any = None
    scales_lookup_table: Any = None
    page_stride: Any = None


@dataclass(frozen=True, slots=True)
class KVCacheInputs:
    """``inputs[r]``: the replica-r ``KVCacheInputsPerDevice``."""

    inputs: tuple

    def __iter__(self):
        return iter(self.inputs)

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, i):
        return self.inputs[i]


# --------------------------------------------------------------------------- transfers


@runtime_checkable
class KVTransfer(Protocol):
    """Handle of an asynchronous transfer.

    ``is_complete()`` never blocks, may be called every iteration and may raise
    ``KVLoadFailed``; ``synchronize()`` blocks until the transfer lands (and
    raises ``KVLoadFailed`` if it failed).
    """

    def is_complete(self) -> bool:
        """True once the transfer landed; never blocks; raises ``KVLoadFailed`` if it failed."""

    def synchronize(self) -> None:
        """Block until the transfer lands; raises ``KVLoadFailed`` if it failed."""


class CompletedTransfer:
    """A transfer that is already done and pins nothing."""

    __slots__ = ()

    def is_complete(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def __repr__(self):
        return "CompletedTransfer()"
