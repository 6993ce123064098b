"""``kvcache replay``: a continuous-batching scheduler loop over ``PagedKVCacheManager``.

The loop does the manager's bookkeeping a serving engine would do, without
running a model (no K/V bytes are computed): each scheduler step

1. returns cordoned requests whose onload has landed to the running set;
2. schedules running requests oldest first — decode (one token) or the next
   prefill chunk — under ``max_batch_tokens`` and ``max_batch_size`` per
   replica, calling ``alloc`` for each (a decode grows at a page crossing);
   when ``alloc`` raises ``InsufficientBlocksError`` the youngest running
   request of that replica is preempted (``release`` + ``ctx.reset()`` +
   front of the queue) until it fits, the request itself last;
3. admits waiting requests in arrival order (``claim`` + ``alloc``) while
   ``max_inflight`` allows; the head that does not fit waits (first come,
   first served, so a request never sees pages of a request behind it);
   an admission whose ``alloc`` returns an incomplete transfer is cordoned; a
   head that ``follows`` a request not finished yet has not arrived, and waits
   (docs/replay.md, "Causality");
4. builds ``runtime_inputs`` for the batch when the manager has a connector
   (it posts queued offloads there); without one the call is a pure function
   whose tables the replay never reads, so it is made only with
   ``ReplayConfig(build_inputs=True)`` (same figures);
5. "runs the forward": a non-final prefill chunk ``advance_chunk()``; every
   other row ``update(token)`` with its next output token (a speculative
   decode: its accepted drafts and the bonus token), then ``step``;
   a request that has produced all its tokens is ``release``-d.

The hit of a request is read at its first successful admission
(``cached_prefix_length``, of which ``cached_prefix_external_length`` came
from a tier); re-hits after a preemption are recomputation, not reuse, and are
not counted. The replay is a closed loop: arrival times order the queue, and
every request is waiting from the start (see ``docs/replay.md``).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import importlib
import math
import operator
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

from kvspec import CompletedTransfer, InsufficientBlocksError, KVCacheParams, KVLoadFailed, TextContext
from kvspec._config import check_int, parse_device

from .attribution import LostHits, evicted_cause
from .ceiling import infinite_cache_ceiling
from .models import ModelPreset, get_model
from .workload import Request

__all__ = ["BACKENDS", "DRAFT_ACCEPTANCE", "ReplayConfig", "ReplayError", "ReplayStats", "fit_hint", "manager_class", "replay",
           "required_blocks"]

#: Backends ``replay`` can drive, by package name.
BACKENDS = ("kvfast", "kvref")

#: How many drafts a speculative decode forward accepts (``ReplayConfig.draft_acceptance``).
DRAFT_ACCEPTANCE = ("random", "none", "all")

#: Bounds of the sizes a replay accepts (issue 11 §13). Bookkeeping-only runs
#: plan any byte size, but every block costs bookkeeping memory: at most
#: ``MAX_TOTAL_BLOCKS`` blocks over replicas and leaves. Runs with real bytes
#: may allocate at most half of this machine's physical memory.
MAX_REPLICAS = 1024
MAX_PAGE_SIZE = 2**20
MAX_TOTAL_BLOCKS = 2**22
MAX_GEOMETRY = 2**16
MAX_BATCH_TOKENS = 2**24
MAX_BATCH_SIZE = 2**16
MAX_BYTES = 2**60


def physical_memory() -> int:
    """Bytes of physical memory of this machine (0 when unknown)."""
    try:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


#: the fields that size the device pool, as a refusal names them when neither was given
SIZE_FIELDS = "num_blocks or device_bytes"

class ReplayError(RuntimeError):
    """The replay cannot run (a backend is missing, the pool can never fit a request)."""


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class ReplayConfig:
    """What to replay on: pool, tiers, scheduler limits and model geometry.

    Parameters
    ----------
    page_size : int
        Tokens per page, >= 1.
    num_blocks : int, optional
        Device blocks per replica including the null block (>= 2). Default:
        from ``device_bytes`` when given, else 2048.
    device_bytes : int, optional
        Device pool bytes per replica; ``num_blocks = device_bytes // page_bytes``.
        Exclusive with ``num_blocks``.
    host_bytes, disk_bytes : int
        Tier sizes (0 = no tier).
    disk_dir : str, optional
        Disk tier directory; default a temporary directory removed at the end.
    remote_url : str, optional
        Shared Redis tier under host and disk (``redis://host:port/db`` or
        ``redis+cluster://host:port``); see ``spec/remote-tier.md``.
    replicas : int
        Data-parallel replicas, each with its own pool.
    backend : {"auto", "kvfast", "kvref"}
        ``auto``: ``kvfast`` when it provides ``PagedKVCacheManager``, else ``kvref``.
    device : str
        ``"cpu"`` or ``"cuda[:N]"``.
    max_batch_size : int
        Requests per replica per step (the manager's ``max_batch_size``).
    max_batch_tokens : int
        Tokens per step over all replicas (decode first, then prefill chunks).
    max_inflight : int, optional
        Requests admitted at once over all replicas; default
        ``max_batch_size * replicas``.
    num_layers, kv_heads, head_dim : int
        Model geometry (sets page bytes and so tier traffic); ignored with ``model``.
    dtype : str, optional
        K/V dtype name; default the model's (``float16`` without a model).
    model : str, optional
        A preset of :data:`kvcache.models.MODELS`: geometry, leaves (sliding
        window, recurrent state) and ``model_id``.
    allocate_buffers : bool
        ``False`` (the default): bookkeeping only, the manager and the tiers
        run their whole policy without K/V bytes, so any size can be planned.
        ``True``: real buffers (at most half the machine's memory).
    model_id : str, optional
        ``KVCacheParams.model_id``; default the preset's hub id (``""`` without one).
    leaves : tuple of (str, LeafSpec), optional
        The manager's leaves for the hand-typed geometry (``model`` brings its own).
    draft_tokens : int
        Speculative decoding: each decode forward verifies ``draft_tokens`` drafts
        (``KVCacheParams(speculative_method="eagle", num_draft_tokens=...)``), accepts
        some of them (``draft_acceptance``) plus the bonus token (spec/manager.md §15),
        and costs ``1 + drafts`` tokens of ``max_batch_tokens`` (vLLM's budget; the
        drafts are cut when less is left; ``draft_acceptance="none"`` excepted). 0:
        plain decoding.
    draft_seed : int
        Seed of the acceptance draws.
    draft_acceptance : {"random", "none", "all"}
        Drafts accepted per forward: ``random``, a uniform number ``0..drafts`` (seeded
        by ``draft_seed``); ``none``, every draft rejected: one token per forward, the
        plain run's schedule with the speculative bookkeeping (slack, verification,
        rollback), the drafts charged nothing to the budget, so the loop makes the plain
        run's decisions and only the manager's speculative work differs (a diagnostic:
        docs/replay.md, "Speculative decoding"); ``all``, every draft accepted.
    build_inputs : bool
        Call ``runtime_inputs`` before every forward even when it changes nothing. By default
        the loop calls it only when the manager has a connector (it then posts the queued
        offloads, spec/manager.md §9.2); without one it is a pure function whose tables the
        replay (no forward) never reads. ``True`` builds them every step, as an engine does,
        and so checks every batch against the manager (same figures, slower).

    Raises
    ------
    ValueError, TypeError
        A field out of range (the message names it and the bound).
    """

    page_size: int = 16
    num_blocks: int | None = None
    device_bytes: int | None = None
    host_bytes: int = 0
    disk_bytes: int = 0
    disk_dir: str | None = None
    remote_url: str | None = None
    replicas: int = 1
    backend: str = "auto"
    device: str = "cpu"
    max_batch_size: int = 32
    max_batch_tokens: int = 2048
    max_inflight: int | None = None
    num_layers: int = 2
    kv_heads: int = 2
    head_dim: int = 16
    dtype: str | None = None
    model: str | None = None
    allocate_buffers: bool = False
    model_id: str | None = None
    leaves: tuple | None = None
    build_inputs: bool = False
    draft_tokens: int = 0
    draft_seed: int = 0
    draft_acceptance: str = "random"

    def __post_init__(self):
        o = "ReplayConfig"
        check_int(o, "page_size", self.page_size, low=1, high=MAX_PAGE_SIZE)
        if self.num_blocks is not None and self.device_bytes is not None:
            raise ValueError(f"{o}: num_blocks={self.num_blocks} and device_bytes={self.device_bytes} are exclusive")
        if self.num_blocks is not None:
            check_int(o, "num_blocks", self.num_blocks, low=2, high=MAX_TOTAL_BLOCKS)
        if self.device_bytes is not None:
            check_int(o, "device_bytes", self.device_bytes, low=1, high=MAX_BYTES)
        check_int(o, "host_bytes", self.host_bytes, low=0, high=MAX_BYTES)
        check_int(o, "disk_bytes", self.disk_bytes, low=0, high=MAX_BYTES)
        check_int(o, "replicas", self.replicas, low=1, high=MAX_REPLICAS)
        if self.model is not None:
            self.preset()  # ValueError naming the known presets
        if not isinstance(self.allocate_buffers, bool):
            raise TypeError(f"{o}: allocate_buffers={self.allocate_buffers!r}, must be a bool")
        if not isinstance(self.build_inputs, bool):
            raise TypeError(f"{o}: build_inputs={self.build_inputs!r}, must be a bool")
        check_int(o, "draft_tokens", self.draft_tokens, low=0, high=64)
        check_int(o, "draft_seed", self.draft_seed, low=0, high=2**63 - 1)
        if self.draft_acceptance not in DRAFT_ACCEPTANCE:
            raise ValueError(f"{o}: draft_acceptance={self.draft_acceptance!r}, must be one of {DRAFT_ACCEPTANCE}")
        if self.remote_url is not None and not str(self.remote_url).startswith(("redis://", "redis+cluster://")):
            raise ValueError(f"{o}: remote_url={self.remote_url!r}, must start with redis:// or redis+cluster://")
        if self.backend not in ("auto",) + BACKENDS:
            raise ValueError(f"{o}: backend={self.backend!r}, must be one of {('auto',) + BACKENDS}")
        parse_device(o, self.device)
        check_int(o, "max_batch_size", self.max_batch_size, low=1, high=MAX_BATCH_SIZE)
        check_int(o, "max_batch_tokens", self.max_batch_tokens, low=1, high=MAX_BATCH_TOKENS)
        if self.max_inflight is not None:
            check_int(o, "max_inflight", self.max_inflight, low=1, high=MAX_BATCH_SIZE * MAX_REPLICAS)
        check_int(o, "num_layers", self.num_layers, low=1, high=MAX_GEOMETRY)
        check_int(o, "kv_heads", self.kv_heads, low=1, high=MAX_GEOMETRY)
        check_int(o, "head_dim", self.head_dim, low=1, high=MAX_GEOMETRY)
        self.params()  # dtype, model_id: KVCacheParams' own checks
        nb = self.blocks_per_replica()
        if nb < 2:
            raise ValueError(f"{o}: device_bytes={self.device_bytes} holds {nb} pages of {self.page_bytes()} bytes, "
                             f"must hold >= 2")
        if nb > MAX_TOTAL_BLOCKS:
            raise ValueError(f"{o}: device_bytes={self.device_bytes} holds {nb} pages of {self.page_bytes()} bytes, "
                             f"must hold <= {MAX_TOTAL_BLOCKS} (use a larger page_size)")
        total = nb * self.replicas * len(self.params().leaves())
        if total > MAX_TOTAL_BLOCKS:
            raise ValueError(f"{o}: replicas={self.replicas} x {nb} blocks x {len(self.params().leaves())} leaves "
                             f"= {total} blocks of bookkeeping, must be <= {MAX_TOTAL_BLOCKS}")
        if self.allocate_buffers:
            self._check_real_bytes(o)

    def _check_real_bytes(self, o: str) -> None:
        limit = physical_memory() // 2
        if not limit:
            return
        pool = self.pool_bytes() * self.replicas
        if self.device_bytes is not None:
            sized = f"device_bytes={self.device_bytes}"
        elif self.num_blocks is not None:
            sized = f"num_blocks={self.num_blocks}"
        else:  # neither was given: name what the size comes from and what sets it
            sized = (f"the default device pool ({self.blocks_per_replica()} blocks of {self.page_size} tokens per "
                     f"replica; {SIZE_FIELDS} set its size)")
        for name, need in ((sized, pool), (f"host_bytes={self.host_bytes}", self.host_bytes)):
            if need > limit:
                raise ValueError(f"{o}: {name} allocates {need / 2**30:.1f} GiB of real buffers, "
                                 f"must be <= {limit / 2**30:.1f} GiB (half this machine's memory); plan it "
                                 f"bookkeeping-only instead")
        if pool + self.host_bytes > limit:
            raise ValueError(f"{o}: device pools {pool / 2**30:.1f} GiB + host_bytes={self.host_bytes} allocate "
                             f"{(pool + self.host_bytes) / 2**30:.1f} GiB with allocate_buffers=True, must be <= "
                             f"{limit / 2**30:.1f} GiB (half this machine's memory)")

    def preset(self) -> ModelPreset | None:
        """The model preset, or ``None`` for the hand-typed geometry."""
        return None if self.model is None else get_model(self.model)

    def kv_dtype(self) -> str:
        """The K/V dtype: ``dtype``, else the model's, else ``float16``."""
        if self.dtype is not None:
            return self.dtype
        m = self.preset()
        return m.dtype if m is not None else "float16"

    def params(self, disk_dir: str | None = None) -> KVCacheParams:
        """The manager's ``KVCacheParams`` (``disk_dir`` overrides ``self.disk_dir``)."""
        m = self.preset()
        kw = dict(
            data_parallel_degree=self.replicas,
            host_offload_bytes=self.host_bytes,
            disk_offload_bytes=self.disk_bytes,
            disk_offload_dir=(disk_dir or self.disk_dir or "unused") if self.disk_bytes else None,
            allocate_buffers=self.allocate_buffers,
        )
        if self.draft_tokens:  # spec/manager.md §15: an autoregressive drafter (EAGLE)
            kw.update(speculative_method="eagle", num_draft_tokens=self.draft_tokens)
        if m is not None:
            if self.model_id is not None:
                kw["model_id"] = self.model_id
            return m.params(self.page_size, self.kv_dtype(), **kw)
        return KVCacheParams(self.page_size, self.num_layers, self.kv_heads, self.head_dim, self.kv_dtype(),
                             model_id=self.model_id or "", leaves=dict(self.leaves) if self.leaves else None, **kw)

    def blocks_per_replica(self) -> int:
        """Device blocks per replica (per leaf), null block included."""
        if self.num_blocks is not None:
            return self.num_blocks
        if self.device_bytes is not None:
            return self.device_bytes // self.page_bytes()
        return 2048

    def page_bytes(self) -> int:
        """Bytes of one block over every leaf (each leaf has a page per block id, ``spec/manager.md`` §1):
        ``2 * num_layers * page_size * kv_heads * head_dim * itemsize`` per full or sliding leaf plus
        the state of a recurrent leaf."""
        p = self.params()
        return sum(p.page_bytes(leaf) for leaf in p.leaves())

    def pool_bytes(self) -> int:
        """Device bytes of one replica's pools, null block included."""
        return self.blocks_per_replica() * self.page_bytes()

    def capacity_tokens(self) -> int:
        """Tokens the usable device blocks of all replicas hold."""
        return (self.blocks_per_replica() - 1) * self.page_size * self.replicas

    def inflight_limit(self) -> int:
        """Requests admitted at once: ``max_inflight``, else ``max_batch_size * replicas``."""
        return self.max_inflight if self.max_inflight is not None else self.max_batch_size * self.replicas


def manager_class(backend: str):
    """``PagedKVCacheManager`` of ``backend`` (``"auto"``, ``"kvfast"`` or ``"kvref"``) and its name.

    Raises
    ------
    ReplayError
        The backend does not provide a manager (yet).
    """
    if backend == "auto":
        try:
            return manager_class("kvfast")
        except ReplayError:
            return manager_class("kvref")
    if backend not in BACKENDS:
        raise ReplayError(f"backend={backend!r}, must be one of {BACKENDS}")
    try:
        cls = getattr(importlib.import_module(backend), "PagedKVCacheManager")
    except (ImportError, AttributeError) as e:
        hint = "; use --backend kvref" if backend != "kvref" else ""
        raise ReplayError(f"backend {backend!r} has no PagedKVCacheManager ({e}){hint}") from None
    return cls, backend


def plans_without_bytes(cls) -> bool:
    """Whether manager class ``cls`` honours ``KVCacheParams(allocate_buffers=False)`` (its
    ``get_device_buffer`` then raises ``RuntimeError``); probed once per class on a tiny manager."""
    known = _PLANS.get(cls)
    if known is None:
        try:
            mgr = cls(KVCacheParams(1, 1, 1, 1, allocate_buffers=False), num_blocks=2, max_batch_size=1,
                      max_seq_len=1)
        except (ValueError, TypeError, RuntimeError):
            known = False
        else:
            try:
                mgr.get_device_buffer(0)
                known = False
            except RuntimeError:
                known = True
            finally:
                mgr.shutdown()
        _PLANS[cls] = known
    return known


_PLANS: dict = {}


def required_blocks(requests: Sequence[Request], page_size: int) -> tuple[int, Request]:
    """Blocks the longest request holds at its end (prompt plus output), and that request."""
    longest = max(requests, key=lambda r: r.total_length)
    return math.ceil(longest.total_length / page_size), longest


def _bytes_text(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fit_hint(config: ReplayConfig, tokens: int) -> str:
    """What would hold a request of ``tokens`` tokens: the pool (blocks and bytes) at this page size,
    and the page size that fits the present block count."""
    need = math.ceil(tokens / config.page_size) + 1  # + the null block
    pool = need * config.page_bytes()
    out = f"a pool of {need} blocks ({_bytes_text(pool)}) at page size {config.page_size}"
    nb = config.blocks_per_replica()
    if config.num_blocks is not None and nb > 1:
        page = math.ceil(tokens / (nb - 1))
        if page <= MAX_PAGE_SIZE:
            out += f", or page size {page} with {nb} blocks"
    return out


# --------------------------------------------------------------------------- results


@dataclass
class ReplayStats:
    """Everything ``kvcache replay`` reports.

    Hit rates are fractions of ``prompt_tokens``; ``*_bytes`` are totals moved
    between tiers; ``series`` holds one entry per scheduler step for each key
    of :attr:`SERIES_KEYS`.
    """

    backend: str
    workload: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    page_size: int
    replicas: int
    blocks_per_replica: int
    device_hit_tokens: int
    external_hit_tokens: int
    ceiling_hit_tokens: int
    peak_blocks_used: int
    mean_blocks_used: float
    preemptions: int
    load_failures: int
    steps: int
    h2d_bytes: int
    d2h_bytes: int
    disk_bytes_written: int
    disk_bytes_read: int
    bookkeeping_s_total: float
    bookkeeping_us_p50: float
    bookkeeping_us_p99: float
    wall_s: float
    manager_metrics: dict = field(default_factory=dict)
    series: dict = field(default_factory=dict)
    #: cause -> prompt tokens the ceiling reuses but the replay did not (``kvcache.attribution``)
    lost_hit_tokens: dict = field(default_factory=dict)
    attribution_mismatches: int = 0
    model: str = ""
    model_id: str = ""
    dtype: str = "float16"
    allocate_buffers: bool = False
    page_bytes: int = 0
    pool_bytes: int = 0
    host_bytes: int = 0
    disk_bytes: int = 0
    capacity_tokens: int = 0
    #: the run was stopped (Ctrl-C): the figures cover the requests admitted so far
    interrupted: bool = False
    #: ceiling tokens over pages found warm (hit, but committed by no request of the run: a tier
    #: warm at start); included in ``ceiling_hit_tokens`` (``kvcache.attribution``)
    warm_ceiling_tokens: int = 0
    #: per leaf of the manager (several leaves only, else empty): leaf id -> ``kind``
    #: (``full``, ``sliding_window``, ``recurrent``), ``window`` (tokens, 0 if none),
    #: ``page_bytes`` (bytes of one page of that leaf) and ``pages_peak`` / ``pages_mean`` (pages the
    #: requests in flight held, distinct over every replica, per scheduler step); the per-step
    #: counts are the series ``pages_used:<leaf id>``
    leaves: dict = field(default_factory=dict)

    SERIES_KEYS = (
        "step", "batch_requests", "batch_tokens", "running", "waiting", "cordoned",
        "blocks_used", "hit_rate", "preemptions", "h2d_bytes", "d2h_bytes",
        "disk_bytes_written", "disk_bytes_read", "bookkeeping_us",
    )

    @property
    def hit_tokens(self) -> int:
        """Prompt tokens served from a cache: ``device_hit_tokens + external_hit_tokens``."""
        return self.device_hit_tokens + self.external_hit_tokens

    def _rate(self, n: int) -> float:
        return n / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_rate(self) -> float:
        """Prefix hit rate, device and external tiers together."""
        return self._rate(self.hit_tokens)

    @property
    def device_hit_rate(self) -> float:
        """``device_hit_tokens / prompt_tokens`` (0.0 without prompt tokens)."""
        return self._rate(self.device_hit_tokens)

    @property
    def external_hit_rate(self) -> float:
        """``external_hit_tokens / prompt_tokens`` (0.0 without prompt tokens)."""
        return self._rate(self.external_hit_tokens)

    @property
    def ceiling_hit_rate(self) -> float:
        """The infinite-cache ceiling for the same workload and page size."""
        return self._rate(self.ceiling_hit_tokens)

    @property
    def lost_hit_total(self) -> int:
        """Sum of :attr:`lost_hit_tokens`; equals ``ceiling_hit_tokens - hit_tokens`` (the ceiling
        raised over pages found warm, ``warm_ceiling_tokens``)."""
        return sum(self.lost_hit_tokens.values())

    @property
    def bookkeeping_us_mean(self) -> float:
        """Mean bookkeeping time per scheduler step, in microseconds."""
        return 1e6 * self.bookkeeping_s_total / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        """A JSON-ready dict: the figures, derived rates, metrics and the series."""
        d = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        for name in ("hit_tokens", "hit_rate", "device_hit_rate", "external_hit_rate",
                     "ceiling_hit_rate", "bookkeeping_us_mean", "lost_hit_total"):
            d[name] = getattr(self, name)
        return d


_SCALARS = frozenset((int, float, str, bool, type(None)))


def _plain(v):
    """``dataclasses.asdict``'s copy of a field, without a deep copy per element of the long
    per-step series (plain scalars are immutable: they are shared, not copied)."""
    t = type(v)
    if t in _SCALARS:
        return v
    if t is list:
        return [x if type(x) in _SCALARS else _plain(x) for x in v]
    if t is dict:
        return {_plain(k): _plain(x) for k, x in v.items()}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return asdict(v)
    return copy.deepcopy(v)


# --------------------------------------------------------------------------- the loop


class _Live:
    """Scheduler state of one request."""

    __slots__ = ("index", "req", "ctx", "replica", "generated", "admitted_at", "recorded", "transfer",
                 "transfer_is_first", "failed_load", "n_out", "committed", "out", "decoding", "prompt_length",
                 "feed", "follows")

    def __init__(self, index: int, req: Request):
        self.index = index
        self.req = req
        self.ctx = TextContext(req.request_id, req.prompt, cache_salt=req.cache_key,
                               **req.retention)  # spec/manager.md §14: the request's claim, if any
        self.replica = -1
        self.generated = 0
        self.n_out = req.output_length
        self.admitted_at = -1
        self.recorded = False
        self.transfer = None
        self.transfer_is_first = False
        self.failed_load = False
        self.committed = 0  # pages the attribution has seen committed
        self.out: list[int] | None = None  # req.output as Python ints, from the first admission on
        #: its prompt has been computed and it samples one token per forward (``active_length == 1``,
        #: ``processed_length == prompt_length + generated - 1``); cleared by a preemption
        self.decoding = False
        self.prompt_length = req.prompt_length
        self.feed = None  # while decoding without tiers: see _Loop._start_decoding
        #: index of the request whose answer this prompt contains (``Request.follows``), else -1
        self.follows = -1


_NOTHING_MOVED = (0, 0, 0, 0)
_DECODING = operator.attrgetter("decoding")
_CTX = operator.attrgetter("ctx")
_FEED = operator.attrgetter("feed")
_MARK = operator.itemgetter(1)
_FAILED_LOAD = operator.attrgetter("failed_load")


class _Running(list):
    """The running requests (a list); ``dirty`` is set by every change of its members or order
    (the loop also sets it when a member starts decoding), so the loop recomputes what it caches
    about the leading decodes only then."""

    __slots__ = ("dirty",)

    def __init__(self):
        super().__init__()
        self.dirty = True

    def append(self, live) -> None:
        self.dirty = True
        super().append(live)

    def remove(self, live) -> None:
        self.dirty = True
        super().remove(live)

    def sort(self, **kw) -> None:
        self.dirty = True
        super().sort(**kw)


class _Timed:
    """Wraps a manager; sums the wall time spent inside its calls."""

    def __init__(self, mgr):
        self.mgr = mgr
        self.seconds = 0.0

    def __call__(self, name: str, *args):
        t0 = time.perf_counter()
        try:
            return getattr(self.mgr, name)(*args)
        finally:
            self.seconds += time.perf_counter() - t0


def _follows(requests: Sequence[Request]) -> list[int]:
    """Per request, the index of the earlier request it ``follows`` (-1: none, or a request the
    workload does not hold: it finished before the replay).

    Raises
    ------
    ValueError
        A request follows itself or a later request (it would wait forever).
    """
    first: dict[str, int] = {}
    for i, r in enumerate(requests):
        first.setdefault(r.request_id, i)
    out = []
    for i, r in enumerate(requests):
        f = r.follows
        j = -1 if f is None else first.get(f, -1)
        if j >= i:
            raise ValueError(f"replay: request {r.request_id} follows {f!r}, which arrives at or after it "
                             f"(a request follows an earlier one)")
        out.append(j)
    return out


def replay(
    requests: Sequence[Request],
    config: ReplayConfig = ReplayConfig(),
    *,
    workload: str = "requests",
    progress: Callable[[int, int, int], None] | None = None,
    status: Callable[[str], None] | None = None,
    connector=None,
) -> ReplayStats:
    """Replay ``requests`` through a ``PagedKVCacheManager`` and measure it.

    Parameters
    ----------
    requests : sequence of Request
        The workload in arrival order (at least one).
    config : ReplayConfig
    workload : str
        A label for the report.
    progress : callable(done, total, step), optional
        Called after every scheduler step.
    status : callable(str), optional
        Told what the replay is doing before each phase that takes a while
        (the ceiling, building the manager, the loop).
    connector : KVConnector, optional
        An explicit connector for the manager (a custom or fault-injecting
        one); it replaces the tiers of ``config`` (whose sizes still name the
        eviction cause).

    Returns
    -------
    ReplayStats
        ``interrupted`` is True when a ``KeyboardInterrupt`` stopped the loop:
        the figures then cover the requests admitted so far.

    Raises
    ------
    ValueError
        No requests, or the pool is too small for the longest request
        (checked before anything runs; the message names a pool or page
        size that would fit).
    ReplayError
        The backend has no manager, or no request can ever be admitted.
    """
    if len(requests) == 0:
        raise ValueError("replay: requests is empty")
    _follows(requests)  # ValueError before anything runs
    say = status or (lambda text: None)
    say(f"loading the {config.backend if config.backend != 'auto' else 'kvfast'} backend "
        f"(its kernels compile on first use)")
    cls, backend = manager_class(config.backend)
    if not config.allocate_buffers and not plans_without_bytes(cls):
        # The manager does not implement bookkeeping-only yet: run with real buffers, and say so
        # (stats.allocate_buffers is True; the table prints it).
        try:
            config = dataclasses.replace(config, allocate_buffers=True)
        except ValueError as e:
            raise ReplayError(f"replay: the {backend} manager does not implement bookkeeping-only mode "
                              f"(KVCacheParams(allocate_buffers=False)) yet, and with real buffers: {e}") from None
    bs = config.page_size
    nblocks = config.blocks_per_replica()
    need, longest = required_blocks(requests, bs)
    if need > nblocks - 1:
        # Spec (replay): refuse up front rather than livelock on a request that can never fit.
        raise ValueError(
            f"replay: num_blocks={nblocks} holds {nblocks - 1} usable blocks of {bs} tokens per replica, "
            f"but request {longest.request_id} needs {need} "
            f"({longest.prompt_length} prompt + {longest.output_length} output tokens); "
            f"{fit_hint(config, longest.total_length)} would fit"
        )
    say(f"infinite-cache ceiling over {len(requests):,} requests")
    ceiling = infinite_cache_ceiling(requests, bs)
    params = config.params()
    leaves = params.leaves()
    tiers = bool(config.host_bytes or config.disk_bytes or config.remote_url)
    lost = LostHits(
        ceiling.page_ids, ceiling.per_request // bs, [r.cache_salt for r in requests], bs,
        models=[r.model for r in requests],
        reusable_pages=np.fromiter(((r.prompt_length - 1) // bs for r in requests), dtype=np.int64,
                                   count=len(requests)),
        peers_serve=config.replicas > 1 or tiers,  # spec/manager.md §7.3, §9.8: every leaf kind
        recurrent=any(leaf.kind.value == "recurrent" for leaf in leaves.values()),
        evicted=evicted_cause(bool(config.host_bytes), bool(config.disk_bytes), config.remote_url is not None),
    )
    tiers = tiers or connector is not None
    lost.peers_serve = config.replicas > 1 or tiers
    tmp_dir = tempfile.mkdtemp(prefix="kvcache-disk-") if config.disk_bytes and not config.disk_dir else None
    try:
        if connector is None and config.remote_url is not None:
            # spec/remote-tier.md §7: the remote tier sits under the host and disk tiers.
            from kvref import TieredConnector

            connector = TieredConnector(
                config.host_bytes, config.disk_bytes, (tmp_dir or config.disk_dir) if config.disk_bytes else None,
                remote_url=config.remote_url,
            )
        say(f"building the {backend} manager ({nblocks:,} blocks x {config.replicas} replicas"
            f"{', bookkeeping only' if not config.allocate_buffers else ', real buffers'})")
        mgr = cls(
            config.params(tmp_dir),
            num_blocks=nblocks,
            max_batch_size=config.max_batch_size,
            max_seq_len=longest.total_length,
            device=config.device,
            connector=connector,
        )
        try:
            say("replaying")
            stats = _Loop(mgr, requests, config, progress, lost, tiers).run()
        finally:
            mgr.shutdown()
        final = mgr.get_metrics_aggregated()
    finally:
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    admitted = stats.pop("admitted")
    stats.update(
        backend=backend,
        workload=workload,
        ceiling_hit_tokens=int(ceiling.per_request[admitted].sum()) + lost.warm_ceiling_tokens,
        warm_ceiling_tokens=lost.warm_ceiling_tokens,
        blocks_per_replica=nblocks,
        h2d_bytes=final.h2d_bytes_copied,
        d2h_bytes=final.d2h_bytes_copied,
        disk_bytes_written=final.disk_bytes_written,
        disk_bytes_read=final.disk_bytes_read,
        manager_metrics=final.as_dict(),
        lost_hit_tokens=dict(lost.tokens),
        attribution_mismatches=lost.mismatches,
        model=config.model or "",
        model_id=params.model_id,
        dtype=params.dtype,
        allocate_buffers=config.allocate_buffers,
        page_bytes=config.page_bytes(),
        pool_bytes=config.pool_bytes() * config.replicas,
        host_bytes=config.host_bytes,
        disk_bytes=config.disk_bytes,
        capacity_tokens=config.capacity_tokens(),
    )
    return ReplayStats(**stats)


class _Loop:
    """One run of the scheduler over one manager."""

    def __init__(self, mgr, requests: Sequence[Request], config: ReplayConfig, progress, lost: LostHits,
                 tiers: bool):
        self.mgr = mgr
        self.call = _Timed(mgr)
        self.config = config
        self.progress = progress
        self.requests = requests
        self.lost = lost
        self.tiers = tiers
        self.align = int(getattr(mgr, "chunk_alignment_tokens", 0) or 0)
        # runtime_inputs changes the manager only by posting queued offloads (a connector):
        # without one the replay (no forward reads the tables) builds them only on request.
        self.build_inputs = tiers or config.build_inputs
        self.waiting: collections.deque[_Live] = collections.deque(_Live(i, r) for i, r in enumerate(requests))
        #: per request: it has produced all its tokens and was released (Request.follows waits for it)
        self.finished = bytearray(len(requests))
        for live, follows in zip(self.waiting, _follows(requests)):
            live.follows = follows
        self.running = _Running()  # admission order, oldest first
        #: the leading decodes of ``running`` (one replica, no tiers): their count, contexts and
        #: feeds, rebuilt when ``running`` changes (``running.dirty``); and how many of them lead
        #: this step's batch (``_schedule_allocs`` -> ``_forward``)
        self._lead = 0
        self._lead_ctxs: list = []
        self._lead_feeds: list = []
        self._fast_rows = 0
        self.cordoned: list[_Live] = []
        self.done = 0
        self.preemptions = 0
        self.load_failures = 0
        self.admissions = 0
        #: request index -> (device, external) hit tokens at its first admission
        self.hits: dict[int, tuple[int, int]] = {}
        self.hit_tokens = 0
        self.hit_prompt_tokens = 0
        self.series = {k: [] for k in ReplayStats.SERIES_KEYS}
        self._appends = tuple(self.series[k].append for k in ReplayStats.SERIES_KEYS)
        #: leaf id -> pages in use per step, for a manager with several leaves (else None)
        leaves = config.params().leaves()
        self.leaf_series = {lid: [] for lid in leaves} if len(leaves) > 1 else None
        #: with a sliding-window leaf: the full-attention leaves, whose hit alone (asked at each first
        #: admission, spec/manager.md §3.6) tells ``sliding_window`` from ``evicted`` (else None)
        kinds = {lid: spec.kind.value for lid, spec in leaves.items()}
        full = [lid for lid, kind in kinds.items() if kind == "full"]
        self.full_leaves = full if full and "sliding_window" in kinds.values() else None
        self.window_pages = None  # the full leaves' hit for the admission under way
        self._zero_metrics = None
        # speculative decoding: drafts per forward and the seeded acceptance draws
        self.drafts = config.draft_tokens
        #: the drafts a decode verifies count in the token budget (all but the schedule-preserving mode)
        self.draft_cost = bool(self.drafts) and config.draft_acceptance != "none"
        mode = config.draft_acceptance
        self.accept = np.random.default_rng(config.draft_seed) if self.drafts and mode == "random" else None
        self.accept_all = mode == "all"

    # -- the loop

    def run(self) -> dict:
        cfg = self.config
        R = cfg.replicas
        limit = cfg.inflight_limit()
        t_start = time.perf_counter()
        step = 0
        idle_waits = 0
        interrupted = False
        try:
            while self.waiting or self.running or self.cordoned:
                self.call.seconds = 0.0
                if self.cordoned:
                    self._uncordon()
                batches: list[list[_Live]] = [[] for _ in range(R)]
                budget = self._schedule_running(batches, cfg.max_batch_tokens)
                if self.waiting and budget > 0 and len(self.running) + len(self.cordoned) < limit:
                    budget = self._admit(batches, budget)
                rows = [live for b in batches for live in b] if R > 1 else batches[0]
                if rows:
                    if self.build_inputs:
                        self.call("runtime_inputs", [[live.ctx for live in b] for b in batches])
                    tokens = cfg.max_batch_tokens - budget
                    self._forward(rows)
                    idle_waits = 0
                else:
                    tokens = 0
                    idle_waits = self._wait_for_transfers(idle_waits)
                self._record(step, len(rows), tokens)
                step += 1
                if self.progress is not None:
                    self.progress(self.done, len(self.requests), step)
        except KeyboardInterrupt:
            interrupted = True
        wall = time.perf_counter() - t_start
        s = self.series
        used = np.asarray(s["blocks_used"], dtype=np.int64)
        bk = np.asarray(s["bookkeeping_us"], dtype=np.float64)
        admitted = np.fromiter(sorted(self.hits), dtype=np.int64, count=len(self.hits))
        reqs = [self.requests[i] for i in admitted] if interrupted else self.requests
        leaves = {}
        if self.leaf_series is not None:
            params = cfg.params()
            for lid, spec in params.leaves().items():
                pages = np.asarray(self.leaf_series[lid], dtype=np.int64)
                s[f"pages_used:{lid}"] = self.leaf_series[lid]
                leaves[lid] = dict(kind=spec.kind.value, window=int(spec.window), page_bytes=params.page_bytes(lid),
                                   pages_peak=int(pages.max()) if pages.size else 0,
                                   pages_mean=float(pages.mean()) if pages.size else 0.0)
        return dict(
            requests=len(reqs),
            prompt_tokens=sum(r.prompt_length for r in reqs),
            output_tokens=sum(r.output_length for r in reqs),
            page_size=cfg.page_size,
            replicas=R,
            device_hit_tokens=sum(d for d, _ in self.hits.values()),
            external_hit_tokens=sum(e for _, e in self.hits.values()),
            peak_blocks_used=int(used.max()) if used.size else 0,
            mean_blocks_used=float(used.mean()) if used.size else 0.0,
            preemptions=self.preemptions,
            load_failures=self.load_failures,
            steps=step,
            bookkeeping_s_total=float(bk.sum()) / 1e6,
            bookkeeping_us_p50=float(np.percentile(bk, 50)) if bk.size else 0.0,
            bookkeeping_us_p99=float(np.percentile(bk, 99)) if bk.size else 0.0,
            wall_s=wall,
            series=s,
            interrupted=interrupted,
            leaves=leaves,
            admitted=admitted,
        )

    # -- phases of a step

    def _uncordon(self) -> None:
        still = []
        for live in self.cordoned:
            if self._landed(live, live.transfer):
                live.transfer = None
                self.running.append(live)
            else:
                still.append(live)
        if len(still) != len(self.cordoned):
            self.running.sort(key=lambda live: live.admitted_at)
        self.cordoned = still

    def _landed(self, live: _Live, transfer) -> bool:
        """Whether ``live`` may leave the cordon: its onload (if any) completed or failed.

        A failed onload (``KVLoadFailed`` from ``is_complete``) is counted, its
        tokens leave the request's first-admission hit, and ``live.failed_load``
        asks for another ``alloc`` (which undoes the splice) before the forward.
        """
        if transfer is None:
            return True
        try:
            done = transfer.is_complete()
        except KVLoadFailed:
            self._load_failed(live)
            return True
        if done:
            live.transfer_is_first = False
        return done

    def _load_failed(self, live: _Live) -> None:
        self.load_failures += 1
        live.failed_load = True
        if live.transfer_is_first:
            # The first admission's external tokens never arrived: not a hit.
            dev, ext = self.hits[live.index]
            self.hits[live.index] = (dev, 0)
            self.hit_tokens -= ext
            self.lost.load_failed(ext)
            live.transfer_is_first = False

    def _schedule_running(self, batches, budget: int) -> int:
        """Schedule running requests oldest first; returns the token budget left."""
        i = 0
        if not self.tiers or not any(map(_FAILED_LOAD, self.running)):
            # (a failed onload's row allocs again until its splice is undone: the loop below)
            i, budget = self._schedule_allocs(batches, budget)
        cap = self.config.max_batch_size
        running = self.running
        while i < len(running):
            live = running[i]
            batch = batches[live.replica]
            if budget == 0 or len(batch) >= cap:
                i += 1
                continue
            if not self._alloc_running(live):
                continue  # live left the running set; self.running shrank at i
            ctx = live.ctx
            n = ctx.active_length
            if self.draft_cost and live.decoding:
                budget = self._take_drafts(live, batch, budget)
            elif n <= budget:  # a decode, or a prefill that fits: no chunking
                batch.append(live)
                budget -= n
            else:
                budget = self._take(live, batches, budget)
            i += 1
        return budget

    def _take_drafts(self, live: _Live, batch: list, budget: int) -> int:
        """Put a speculative decode in ``batch``: it costs its token and the drafts it verifies
        (vLLM's rule: ``num_tokens_with_spec - num_computed_tokens``); when the budget left is
        smaller, its drafts are cut to fit, as vLLM trims ``spec_token_ids`` (docs/replay.md)."""
        state = live.ctx.spec_decoding_state
        drafts = state.draft_tokens_to_verify
        if 1 + len(drafts) > budget:
            state.draft_tokens_to_verify = drafts = drafts[: budget - 1]
        batch.append(live)
        return budget - 1 - len(drafts)

    def _schedule_allocs(self, batches, budget: int) -> tuple[int, int]:
        """``_schedule_running`` where ``alloc`` of a running request returns a completed transfer
        or raises ``InsufficientBlocksError`` and changes no context: always without tiers; with
        tiers while no running request has a failed onload to undo (its ``alloc`` may start a
        transfer, which ``_alloc_running`` cordons).

        The requests the loop would ``alloc`` (those met while the budget lasts and their batch has
        room) are found first, then allocated in one timed loop, then batched (a chunked prefill
        is chunked after its ``alloc``, as in the loop). The manager sees the same calls in the same
        order. Returns where the loop resumes (``len(self.running)`` when every ``alloc`` fitted;
        else the request whose ``alloc`` raised, for the loop to preempt) and the budget left.
        """
        cap = self.config.max_batch_size
        align = self.align
        running = self.running
        # 1. who gets an alloc (the loop below, without changing anything)
        room = [cap - len(b) for b in batches]
        left = budget
        start = 0
        end = len(running)
        if len(batches) == 1 and not self.drafts:
            # One replica: the leading decodes (oldest first, one token each) take an alloc each
            # while the budget and the batch have room; the loop below goes on from the first
            # request still prefilling, unless nothing more fits.
            if running.dirty:
                self._find_lead()
            lead = self._lead
            start = min(lead, room[0], left)
            room[0] -= start
            left -= start
            if not left or room[0] <= 0:
                end = start  # the budget or the batch is full: nobody after gets an alloc
        todo: list[_Live] = running[:start]
        at: list[int] = []  # where todo[start:] stand in running
        for i in range(start, end):
            live = running[i]
            r = live.replica
            if left == 0 or room[r] <= 0:
                continue
            todo.append(live)
            at.append(i)
            n = live.ctx.active_length
            if self.draft_cost and live.decoding:  # _take_drafts: its drafts count, cut to the budget
                n = min(n + len(live.ctx.spec_decoding_state.draft_tokens_to_verify), left)
            elif n > left:  # _take: chunked to an aligned piece of the budget, if any
                n = left - left % align if align else left
                if n == 0:
                    continue
            room[r] -= 1
            left -= n
        # 2. the allocs, in order: one alloc_many (spec/manager.md §17: the loop's effect, or its
        # error with nothing changed); when one of them is short of pages, the loop of single
        # allocs, which allocates those before it and raises at it
        ctxs = self._lead_ctxs[:start] if start else []
        if len(todo) > start:
            ctxs += map(_CTX, todo[start:])
        pc = time.perf_counter
        t0 = pc()
        try:
            transfers = self.mgr.alloc_many(ctxs)
            done = len(ctxs)
        except InsufficientBlocksError:
            it = iter(ctxs)
            try:
                collections.deque(map(self.mgr.alloc, it), 0)  # the calls in order, at C speed
                raise ReplayError("replay: alloc_many refused a batch that its loop of alloc accepted")
            except InsufficientBlocksError:
                done = len(ctxs) - operator.length_hint(it) - 1  # the one that raised was taken from it
            transfers = None
        self.call.seconds += pc() - t0
        if self.tiers and transfers and set(map(type, transfers)) != {CompletedTransfer}:
            # a running request's alloc sizes its rows only: a transfer of its own would need the cordon
            raise ReplayError("replay: a running request's alloc started a transfer")
        # 3. batch those allocated (the leading decodes: one token each, no chunking)
        fast = self._fast_rows = min(start, done)
        if fast:
            batches[0].extend(todo[:fast])
            budget -= fast
        for live in todo[fast:done]:
            n = live.ctx.active_length
            if self.draft_cost and live.decoding:
                budget = self._take_drafts(live, batches[live.replica], budget)
            elif n <= budget:  # a decode, or a prefill that fits: no chunking
                batches[live.replica].append(live)
                budget -= n
            else:
                budget = self._take(live, batches, budget)
        if done == len(todo):
            return len(running), budget
        return (done if done < start else at[done - start]), budget

    def _find_lead(self) -> None:
        """Count the leading decodes of ``running`` and list their contexts and feeds."""
        running = self.running
        flags = list(map(_DECODING, running))
        try:
            lead = flags.index(False)
        except ValueError:
            lead = len(flags)
        self._lead = lead
        self._lead_ctxs = list(map(_CTX, running[:lead]))
        self._lead_feeds = list(map(_FEED, running[:lead]))
        running.dirty = False

    def _alloc_running(self, live: _Live) -> bool:
        """``alloc`` a running request, preempting the youngest of its replica until
        it fits; False if it left the running set (preempted itself, or cordoned).

        After a failed onload ``alloc`` runs again first: it undoes the splice."""
        # Timed inline rather than through ``self.call``: this runs once per running row per step.
        timed, alloc, pc = self.call, self.mgr.alloc, time.perf_counter
        while True:
            live.failed_load = False
            t0 = pc()
            try:
                transfer = alloc(live.ctx)
            except InsufficientBlocksError:
                timed.seconds += pc() - t0
                victim = next(v for v in reversed(self.running) if v.replica == live.replica)
                self._preempt(victim)
                if victim is live:
                    return False
                continue
            timed.seconds += pc() - t0
            if not self._landed(live, transfer):
                self.running.remove(live)
                self._cordon(live, transfer)
                return False
            if not live.failed_load:
                return True

    def _cordon(self, live: _Live, transfer) -> None:
        # Spec (manager-semantics §9): an onload in flight keeps the request out of
        # the batch (its pages stay pinned) until the transfer completes.
        live.transfer = transfer
        self.cordoned.append(live)

    def _preempt(self, live: _Live) -> None:
        # Spec (manager-semantics §9): preemption = release + ctx.reset() + front of the queue.
        self.lost.preempt(live.index, live.ctx.processed_length)
        live.committed = 0
        if live.feed is not None:  # the feed ran ahead of live.generated
            live.generated = len(live.ctx) - live.prompt_length
            live.feed = None
        live.decoding = False
        self.call("release", live.ctx)
        live.ctx.reset()
        self.running.remove(live)
        self.waiting.appendleft(live)
        self.preemptions += 1

    def _admit(self, batches, budget: int) -> int:
        cfg = self.config
        limit = cfg.inflight_limit()
        while self.waiting and budget > 0 and len(self.running) + len(self.cordoned) < limit:
            live = self.waiting[0]
            if live.follows >= 0 and not self.finished[live.follows]:
                # Causality (docs/replay.md): the head holds the answer of a request still in flight, so it
                # has not arrived yet; the queue is in arrival order, so neither has anything behind it.
                break
            if live.replica < 0 or not self.call("contains", live.ctx):
                live.replica = self._route(live, batches)
                if live.replica < 0:
                    break
                self.call("claim", live.ctx, live.replica)
            if len(batches[live.replica]) >= cfg.max_batch_size:
                break
            before = self._load_counts() if self.tiers and not live.recorded else None
            if self.full_leaves is not None and not live.recorded:
                # before alloc, which may evict what the full leaves hold past the joint hit
                self.window_pages = self.call("get_prefix_cache_hit_counts_per_leaf", live.ctx,
                                              self.full_leaves)[live.replica]
            try:
                transfer = self.call("alloc", live.ctx)
            except InsufficientBlocksError:
                if not (self.running or self.cordoned or any(batches)):
                    self._require_progress(live)
                break  # first come, first served: the head waits for room
            self.waiting.popleft()
            if live.out is None:
                live.out = live.req.output.tolist()
            live.admitted_at = self.admissions
            self.admissions += 1
            if not live.recorded:
                self._settle_hit(live, self._load_outcome(before))
            if not self._landed(live, transfer):
                self._cordon(live, transfer)
                continue
            self.running.append(live)
            if live.failed_load:
                continue  # runs after its next alloc (next step), which undoes the splice
            budget = self._take(live, batches, budget)
        return budget

    def _load_counts(self) -> tuple[int, int]:
        m = self.mgr.get_metrics_aggregated()
        return m.connector_loads_refused, m.connector_load_failures

    def _load_outcome(self, before) -> str | None:
        """``"load_failed"`` / ``"load_refused"`` when the admission's ``alloc`` saw its load fail or refused."""
        if before is None:
            return None
        refused, failed = self._load_counts()
        if failed > before[1]:
            return "load_failed"
        if refused > before[0]:
            return "load_refused"
        return None

    def _route(self, live: _Live, batches) -> int:
        """Replica for a new request: most prefix hits, then fewest in flight, then lowest index."""
        R = self.config.replicas
        if R == 1:
            return 0
        hits = self.call("get_prefix_cache_hit_counts", live.ctx)
        load = [0] * R
        for other in self.running + self.cordoned:
            load[other.replica] += 1
        order = sorted(range(R), key=lambda r: (-hits[r].total_blocks, load[r], r))
        for r in order:
            if len(batches[r]) < self.config.max_batch_size:
                return r
        return -1

    def _require_progress(self, live: _Live) -> None:
        """The head does not fit an otherwise idle manager: wait for offloads, or give up."""
        r = live.replica
        if self.call("pending_transfers_exist", r):
            return
        count = self.call("block_count", r)
        raise ReplayError(
            f"replay: request {live.req.request_id} ({live.ctx.active_length} tokens to compute, "
            f"{len(live.ctx)} in all) does not fit replica {r}: {count.free} of {count.total} blocks free "
            f"and nothing else in flight"
        )

    def _settle_hit(self, live: _Live, load: str | None) -> None:
        """Record the request's hit at its first admission (device, external tokens) and attribute its loss."""
        ctx = live.ctx
        ext = ctx.cached_prefix_external_length
        hit = ctx.cached_prefix_length
        self.hits[live.index] = (hit - ext, ext)
        self.hit_tokens += hit
        self.hit_prompt_tokens += live.req.prompt_length
        live.recorded = True
        live.transfer_is_first = True
        self.lost.admit(live.index, live.replica, hit, load, window_pages=self.window_pages)

    def _take(self, live: _Live, batches, budget: int) -> int:
        """Put ``live`` in its replica's batch, chunking its prefill to ``budget``
        (at a multiple of the manager's ``chunk_alignment_tokens``: recurrent
        checkpoints are published at page boundaries, spec/manager.md §2.4)."""
        ctx = live.ctx
        if ctx.active_length > budget:
            n = budget - budget % self.align if self.align else budget
            if n == 0:
                return budget  # not this step: the budget left is smaller than one aligned chunk
            ctx.chunk(n)
        batches[live.replica].append(live)
        return budget - ctx.active_length

    def _forward(self, rows: list[_Live]) -> None:
        """The forward of ``rows``: feed each context its token (or next chunk), ``step`` it, track
        its commits, ``release`` it when done."""
        if self.drafts:
            return self._forward_drafts(rows)  # one row at a time (a speculative decode appends several tokens)
        # The rows' transfers have landed (the cordon): ``step`` changes no context, so the contexts are fed
        # (and their commits tracked) first and the manager's calls run in one timed loop, in row
        # order (a finished row is released right after its step, before the next row's step).
        lost = self.lost
        commit = lost.commit
        ps = self.config.page_size
        every = lost.recurrent  # checkpoints are tracked at every page boundary
        # The leading decodes (most rows, found by _schedule_allocs): each feed is a C-level
        # iterator that calls ctx.update(next output token) and yields the row when it needs a look
        # (a page filled, or its last token): see _start_decoding.
        lead = self._fast_rows
        self._fast_rows = 0
        ctxs = self._lead_ctxs[:lead] if lead else []
        if len(rows) > lead:
            ctxs += map(_CTX, rows[lead:])
        marked = list(filter(None, map(_MARK, map(next, self._lead_feeds[:lead])))) if lead else []
        ending: list[_Live] = []
        for live in rows[lead:]:
            if live.decoding:
                if next(live.feed)[1] is not None:
                    marked.append(live)
                continue
            ctx = live.ctx
            if ctx.pending_length:
                # spec/manager.md §5: step after every forward, a non-final chunk's included.
                ctx.advance_chunk()
            else:
                g = live.generated
                ctx.update(live.out[g])
                live.generated = g + 1
                if g + 1 == live.n_out:
                    ending.append(live)
                else:
                    self._start_decoding(live)
            processed = ctx.processed_length
            if every or processed // ps > live.committed:
                live.committed = processed // ps
                commit(live.index, live.replica, processed)
        for live in marked:  # a decode that filled a page, or fed its last token
            ctx = live.ctx
            processed = ctx.processed_length
            if every or processed // ps > live.committed:
                live.committed = processed // ps
                commit(live.index, live.replica, processed)
            if len(ctx) - live.prompt_length == live.n_out:
                live.generated = live.n_out
                live.feed = None
                ending.append(live)
        step = self.mgr.step
        pc = time.perf_counter
        if not ending:
            t0 = pc()
            self.mgr.step_many(ctxs)
            self.call.seconds += pc() - t0
            return
        release = self.mgr.release
        last = {id(live.ctx) for live in ending}
        t0 = pc()
        for ctx in ctxs:
            step(ctx)
            if id(ctx) in last:
                release(ctx)
        self.call.seconds += pc() - t0
        for live in ending:
            self.running.remove(live)
            self.finished[live.index] = 1
            self.done += 1
            if self.preemptions:
                lost.finish(live.index)

    def _start_decoding(self, live: _Live) -> None:
        """``live`` fed its first output token (its prompt is computed) and has more to generate:
        from now on it decodes one token per forward. Its ``feed`` calls ``ctx.update`` with each
        next output token and yields, beside ``None``, the row itself where the attribution needs
        it: a decode that fills a page (``processed_length`` a multiple of the page size) and the
        last token. ``live.generated`` is brought up to date from the context when it is needed
        (the last token, a preemption)."""
        live.decoding = True
        self.running.dirty = True
        g = live.generated  # tokens fed so far; the feed starts at out[g]
        n = live.n_out - g
        marks: list = [None] * n
        ps = self.config.page_size
        # After out[k] is fed, processed_length = prompt_length + k.
        first = (-(live.prompt_length + g)) % ps
        marks[first::ps] = [live] * len(range(first, n, ps))
        marks[-1] = live
        live.feed = zip(map(live.ctx.update, live.out[g:]), marks)

    def _forward_drafts(self, rows: list[_Live]) -> None:
        """``_forward`` with speculative decoding: row by row, each verifying forward appending its
        accepted drafts and the bonus token, then its ``step`` (and ``release`` when done)."""
        timed, lost = self.call, self.lost
        step = self.mgr.step
        pc = time.perf_counter
        ps = self.config.page_size
        every = lost.recurrent  # checkpoints are tracked at every page boundary
        drafts = self.drafts
        commit = lost.commit
        spent = 0.0
        for live in rows:
            ctx = live.ctx
            decoded = not ctx.pending_length
            if decoded:
                g = live.generated
                if drafts:
                    # a verifying forward (after the prefill's) appends its accepted drafts, then the bonus token
                    n = 1
                    if live.decoding:
                        verified = len(ctx.spec_decoding_state.draft_tokens_to_verify)
                        if self.accept is not None:  # random: 0..verified accepted, uniformly
                            n += int(self.accept.integers(0, verified + 1))
                        elif self.accept_all:
                            n += verified
                    for t in live.out[g : min(g + n, live.n_out)]:
                        ctx.update(t)
                        g += 1
                    ctx.spec_decoding_state.draft_tokens_to_verify = [0] * drafts
                elif g < live.n_out:  # one token per forward: no slice, no inner loop
                    ctx.update(live.out[g])
                    g += 1
                live.generated = g
                live.decoding = True
            else:
                # spec/manager.md §5: step after every forward, a non-final chunk's included.
                ctx.advance_chunk()
            t0 = pc()
            step(ctx)
            spent += pc() - t0
            processed = ctx.processed_length
            if every or processed // ps > live.committed:
                live.committed = processed // ps
                commit(live.index, live.replica, processed)
            if decoded and live.generated == live.n_out:
                t0 = pc()
                self.mgr.release(ctx)
                spent += pc() - t0
                self.running.remove(live)
                self.finished[live.index] = 1
                self.done += 1
                if self.preemptions:
                    lost.finish(live.index)
        timed.seconds += spent

    def _wait_for_transfers(self, idle_waits: int) -> int:
        """Nothing could run this step: poll the manager, block on an onload if any."""
        self.call("poll_transfers")
        if self.cordoned:
            live = self.cordoned[0]
            try:
                live.transfer.synchronize()
            except KVLoadFailed:
                live.transfer = None  # resolved: _uncordon lets it through to its next alloc
                self._load_failed(live)
        else:
            time.sleep(min(0.001 * (idle_waits + 1), 0.05))
            if idle_waits > 2000:
                raise ReplayError("replay: no progress after 2000 idle steps (transfers never finish)")
        return idle_waits + 1

    def _record(self, step: int, rows: int, tokens: int) -> None:
        mgr = self.mgr
        if self.tiers:
            m = mgr.get_metrics_aggregated()
            moved = (m.h2d_bytes_copied, m.d2h_bytes_copied, m.disk_bytes_written, m.disk_bytes_read)
        else:
            moved = _NOTHING_MOVED
        R = self.config.replicas
        used = mgr.block_count(0).used if R == 1 else sum(mgr.block_count(r).used for r in range(R))
        prompt_done, hit = self.hit_prompt_tokens, self.hit_tokens
        (step_, batch_requests, batch_tokens, running, waiting, cordoned, blocks_used, hit_rate, preemptions,
         h2d, d2h, written, read, bookkeeping) = self._appends
        step_(step)
        batch_requests(rows)
        batch_tokens(tokens)
        running(len(self.running))
        waiting(len(self.waiting))
        cordoned(len(self.cordoned))
        blocks_used(used)
        hit_rate(hit / prompt_done if prompt_done else 0.0)
        preemptions(self.preemptions)
        h2d(moved[0])
        d2h(moved[1])
        written(moved[2])
        read(moved[3])
        bookkeeping(1e6 * self.call.seconds)
        if self.leaf_series is not None:
            self._record_leaves()

    def _record_leaves(self) -> None:
        """Pages each leaf holds for the requests in flight (distinct, null excluded, over every
        replica), from ``get_req_blocks_per_leaf``: a page shared by several requests (a prefix
        hit) counts once."""
        get = self.mgr.get_req_blocks_per_leaf
        held: dict = {}
        for live in self.running + self.cordoned:
            for lid, row in get(live.ctx).items():
                key = (live.replica, lid)
                pages = held.get(key)
                if pages is None:
                    held[key] = pages = set()
                pages.update(row)
        counts = dict.fromkeys(self.leaf_series, 0)
        for (_, lid), pages in held.items():
            counts[lid] += len(pages) - (0 in pages)
        for lid, series in self.leaf_series.items():
            series.append(counts[lid])
