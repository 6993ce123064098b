"""A shared prefix-cache tier on Redis, single node or Redis Cluster (spec/remote-tier.md).

``RemoteTier`` stores published blocks under content keys so that every
serving process bound to the same model geometry and hash algorithm can hit
blocks another process computed. It sits under the host and disk tiers of a
``TieredConnector``; on its own it is a small synchronous client:

* ``lookup(hashes)``: pipelined ``EXISTS``, the leading run of present blocks;
* ``get_many(hashes, tokens)``: pipelined ``GET``, every value verified;
* ``put_many(hashes, tokens, payloads, retain_s=None)``: pipelined ``SET NX`` (optional TTL;
  a block's known retention claim is its TTL from the write on);
* ``touch(hashes)``: pipelined ``PEXPIRE ... GT`` when a TTL is set (never shortens a claim).
* ``retain(hashes, seconds)``: pipelined ``PEXPIRE ... GT`` (a retention claim's time-to-live).

A slow or dead store is never an exception into the caller and never a wait
beyond ``timeout_s`` per socket operation: a lookup misses, a load is refused
(``KVLoadRefused``), an offload is dropped, each counted in ``metrics``. After
a transport error the tier makes no further attempt for
``reconnect_interval_s`` seconds (a dead server costs nothing per call) and
then reconnects by itself.

Key per block::

    {namespace}:{hash_algo}:{geometry_digest_hex16}:{block_hash_hex}

The geometry digest covers the model (``KVCacheParams.model_id``), so two
models never share a key. Value: a header (spec/remote-tier.md §2) then the
block's K/V bytes. Without a secret the value carries the token ids in clear
and an xxh3-128 checksum over key, header and payload (it detects accidents,
not forgery: anyone who can write to the store can poison it). With
``secret=`` every value carries an HMAC-SHA256 tag over key, header and
payload and only a keyed digest of the token ids; a value without a valid
tag is refused and counted (``auth_failures``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import json
import math
import os
import re
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence
from urllib.parse import unquote, urlsplit

import numpy as np
import xxhash

from kvspec import retention as _retention
from kvspec._config import check_int
from kvspec._dtypes import KV_DTYPES, dtype_name, is_fp8
from kvspec._manager_types import DEFAULT_LEAF_ID, KVCacheParams, LeafKind
from kvspec.errors import KVLoadRefused
from kvspec.hashing import HASH_ALGOS

__all__ = ["RemoteTier", "RemoteTierMetrics", "FORMAT_VERSION", "AUTH_FORMAT_VERSION", "MAGIC",
           "geometry_digest", "redact_url"]

#: First bytes of every stored value.
MAGIC = b"KVRT"
#: Version of the value layout without a secret (tokens in clear, xxh3-128 checksum).
FORMAT_VERSION = 2
#: Version of the authenticated layout (keyed token digest, HMAC-SHA256 tag).
AUTH_FORMAT_VERSION = 3
#: Bounds of the numeric arguments (spec/remote-tier.md §4): Redis expiries are
#: int64 milliseconds added to the server clock; a timeout beyond an hour or a
#: reconnect pause beyond a day is a typo, not a setting.
MAX_TTL_S = float(2**32)
MAX_TIMEOUT_S = 3600.0
MAX_RECONNECT_INTERVAL_S = 86400.0
#: A secret shorter than this is refused (HMAC-SHA256 wants 32 random bytes).
MIN_SECRET_BYTES = 16
_TAG_SIZE = 32
_TOKEN_DIGEST_SIZE = 32
# spec/remote-tier.md §2: one byte per hash algorithm in the value header.
_ALGO_IDS = {"sha256": 1, "xxh3_128": 2}
# magic, version, algorithm id, digest size, geometry digest, tokens per block, payload length
_FIXED = struct.Struct("<4sHBB8sIQ")
_CHECKSUM_SIZE = 16  # xxh3_128 over the header before the checksum, then the payload
_GEOMETRY_FIELDS = ("num_layers", "kv_heads", "head_dim", "page_size")
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.\-/]{1,64}$")
_DEFAULT_PORT = 6379


@dataclass(slots=True)
class RemoteTierMetrics:
    """Counters of a ``RemoteTier`` (a snapshot; ``+`` sums two).

    Blocks and bytes count what crossed the network; ``time_s`` is wall time
    spent in the store's client (connects included).
    """

    #: ``lookup`` calls with at least one hash.
    lookups: int = 0
    #: Blocks asked for by those lookups.
    lookup_blocks: int = 0
    #: Blocks found: the sum of the leading runs returned.
    hits: int = 0
    #: Blocks returned by ``get_many``, and their value bytes (headers included).
    blocks_read: int = 0
    bytes_read: int = 0
    #: Blocks newly stored by ``put_many``, and their value bytes (headers included).
    blocks_written: int = 0
    bytes_written: int = 0
    #: Blocks ``put_many`` skipped because the key already existed (``SET NX``).
    blocks_already_present: int = 0
    #: ``get_many`` calls refused because a value was missing or failed verification.
    loads_refused: int = 0
    #: Values refused for authentication: a missing or wrong tag (forged, or
    #: written with another or no secret). Also counted in ``loads_refused``.
    auth_failures: int = 0
    #: ``get_many`` calls refused because the store did not answer (down, timeout).
    loads_failed: int = 0
    #: Blocks ``put_many`` could not store because the store did not answer.
    offloads_dropped: int = 0
    #: Transport errors seen (each one starts a ``reconnect_interval_s`` pause).
    errors: int = 0
    #: Successful (re)connections.
    connects: int = 0
    #: Seconds spent talking to the store.
    time_s: float = 0.0

    def __add__(self, other: "RemoteTierMetrics") -> "RemoteTierMetrics":
        if not isinstance(other, RemoteTierMetrics):
            return NotImplemented
        return RemoteTierMetrics(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)}
        )

    def copy(self) -> "RemoteTierMetrics":
        return dataclasses.replace(self)

    def as_dict(self) -> dict[str, int | float]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- geometry


def _geometry_fields(geometry: KVCacheParams | Mapping[str, Any], leaf_id: str) -> dict[str, Any]:
    """The canonical geometry record that the digest covers."""
    o = "RemoteTier.bind"
    if isinstance(geometry, KVCacheParams):
        leaves = geometry.leaves()
        if leaf_id not in leaves:
            raise ValueError(f"{o}: leaf_id={leaf_id!r} not in params.leaves() {sorted(leaves)}")
        if leaves[leaf_id].kind is LeafKind.RECURRENT:
            raise ValueError(f"{o}: leaf_id={leaf_id!r} is a recurrent leaf, must be full or sliding-window")
        values = {f: getattr(geometry, f) for f in _GEOMETRY_FIELDS}
        values["dtype"] = geometry.dtype
        values["model_id"] = geometry.model_id
    elif isinstance(geometry, Mapping):
        missing = [f for f in (*_GEOMETRY_FIELDS, "dtype") if f not in geometry]
        if missing:
            raise ValueError(f"{o}: geometry missing {missing}, needs {[*_GEOMETRY_FIELDS, 'dtype']}")
        values = {f: check_int(o, f"geometry[{f!r}]", geometry[f], low=1) for f in _GEOMETRY_FIELDS}
        try:
            name = dtype_name(geometry["dtype"])
        except TypeError:
            name = None
        if name not in KV_DTYPES:
            raise ValueError(f"{o}: geometry['dtype']={geometry['dtype']!r}, must be one of {sorted(KV_DTYPES)}")
        values["dtype"] = name
        model_id = geometry.get("model_id", "")
        if not isinstance(model_id, str):
            raise TypeError(f"{o}: geometry['model_id']={model_id!r}, must be a str")
        values["model_id"] = model_id
    else:
        raise TypeError(f"{o}: geometry={geometry!r}, must be KVCacheParams or a mapping")
    values["leaf_id"] = leaf_id
    return values


def geometry_digest(geometry: KVCacheParams | Mapping[str, Any], leaf_id: str = DEFAULT_LEAF_ID) -> bytes:
    """8-byte digest of a block geometry: layers, heads, head dim, page size, dtype, leaf, model.

    ``sha256(b"kvcache-remote/geometry/v1" + canonical JSON)[:8]``; two models
    (``model_id``) or geometries never share a key prefix.
    """
    if not isinstance(leaf_id, str) or not leaf_id:
        raise ValueError(f"RemoteTier.bind: leaf_id={leaf_id!r}, must be a non-empty str")
    record = json.dumps(_geometry_fields(geometry, leaf_id), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(b"kvcache-remote/geometry/v1" + record.encode()).digest()[:8]


# --------------------------------------------------------------------------- url


def redact_url(url: str) -> str:
    """The URL with its credentials masked: ``redis://user:secret@host`` ->
    ``redis://user:***@host``, ``redis://:secret@host`` -> ``redis://:***@host``,
    ``redis://secret@host`` -> ``redis://***@host``. Everything up to the
    **last** ``@`` is credentials, so a password holding ``@``, ``/`` or ``:``
    never shows."""
    if not isinstance(url, str):
        return repr(type(url).__name__)
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "***" if "@" in url else url
    if "@" not in rest:
        return url
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0] if ":" in creds else None
    shown = "***" if user is None else f"{user}:***"
    return f"{scheme}://{shown}@{host}"


def _parse_url(url: str) -> dict[str, Any]:
    """``redis://[user:pw@]host[:port][/db]`` or ``redis+cluster://[user:pw@]host[:port]``;
    ``host`` may be a bracketed IPv6 literal (``redis://[::1]:6379/0``)."""
    o = "RemoteTier"
    if not isinstance(url, str):
        raise TypeError(f"{o}: url type={type(url).__name__}, must be a str")
    shown = redact_url(url)  # spec/remote-tier.md §4: messages never carry a password
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("redis", "redis+cluster"):
        raise ValueError(f"{o}: url={shown!r} scheme={scheme if sep else ''!r}, must be 'redis' or 'redis+cluster'")
    creds, at, hostpart = rest.rpartition("@")
    if not at:
        creds, hostpart = "", rest
    try:
        parts = urlsplit(f"{scheme}://{hostpart}")
        hostname, port = parts.hostname, parts.port
    except ValueError:
        raise ValueError(f"{o}: url={shown!r} has an invalid host or port, must be host[:port] with port in [1, 65535]") from None
    if not hostname:
        raise ValueError(f"{o}: url={shown!r} has no host, must be redis://host:port/db")
    if "[" in parts.netloc:
        try:
            ipaddress.IPv6Address(hostname.split("%", 1)[0])
        except ValueError:
            raise ValueError(f"{o}: url={shown!r} has a bracketed host that is not an IPv6 address") from None
    if parts.query or parts.fragment:
        raise ValueError(f"{o}: url={shown!r} has a query or fragment, must have none")
    port = _DEFAULT_PORT if port is None else port
    if not 1 <= port <= 65535:
        raise ValueError(f"{o}: url={shown!r} port={port}, must be in [1, 65535]")
    path = parts.path.strip("/")
    if path and not (path.isdigit() and path.isascii() and len(path) <= 5):
        raise ValueError(f"{o}: url={shown!r} db={path!r}, must be an integer in [0, 99999]")
    db = int(path) if path else 0
    cluster = scheme == "redis+cluster"
    if cluster and db != 0:
        raise ValueError(f"{o}: url={shown!r} db={db}, must be 0 for redis+cluster (Cluster has one database)")
    username, password = None, None
    if at:
        user, colon, pw = creds.partition(":")
        if colon:
            username, password = (unquote(user) or None), unquote(pw)
        else:
            password = unquote(user)  # redis://secret@host: redis-py reads a lone credential as the password
    return {
        "cluster": cluster, "host": hostname, "port": port, "db": db,
        "username": username, "password": password or None,
    }


def _resolve_secret(o: str, secret) -> bytes | None:
    """``secret`` as key bytes: bytes as given, a str names an environment variable."""
    if secret is None:
        return None
    if isinstance(secret, (bytes, bytearray)):
        key = bytes(secret)
        where = "remote_secret"
    elif isinstance(secret, str):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,127}", secret):
            raise ValueError(f"{o}: secret={secret!r}, a str must name an environment variable ([A-Za-z_][A-Za-z0-9_]*)")
        if secret not in os.environ:
            raise ValueError(f"{o}: secret names environment variable {secret!r}, which is not set")
        key = os.environ[secret].encode("utf-8", "surrogateescape")
        where = f"environment variable {secret!r}"
    else:
        raise TypeError(f"{o}: secret type={type(secret).__name__}, must be bytes or the name of an environment variable")
    if len(key) < MIN_SECRET_BYTES:
        # never the value itself in a message
        raise ValueError(f"{o}: secret from {where} has {len(key)} bytes, must be >= {MIN_SECRET_BYTES}")
    return key


def _payload_bytes(o: str, i: int, payload) -> bytes:
    """The bytes of one payload (C order for arrays)."""
    if isinstance(payload, bytes):
        return payload
    if isinstance(payload, np.ndarray):
        return payload.tobytes()
    if isinstance(payload, (bytearray, memoryview)):
        return memoryview(payload).tobytes()
    raise TypeError(f"{o}: payloads[{i}] type={type(payload).__name__}, must be bytes, bytearray, memoryview or ndarray")


# --------------------------------------------------------------------------- the tier


class RemoteTier:
    """Blocks of K/V shared between processes through Redis or Redis Cluster.

    Parameters
    ----------
    url : str
        ``redis://host:port/db`` (redis-py ``Redis``) or
        ``redis+cluster://host:port`` (redis-py ``RedisCluster``, any node as
        the entry point). A password may be given as ``redis://:pw@host``.
    namespace : str
        First key component; 1-64 characters of ``[A-Za-z0-9_.-/]`` (no
        ``{``/``}``, so keys spread over every cluster slot).
    ttl_s : float, optional
        Expiry of each stored block in seconds, in ``[0.001, 2**32]``, refreshed by ``touch``;
        ``None`` keeps blocks until Redis evicts them (``maxmemory-policy
        allkeys-lru``).
    timeout_s : float
        Bound of every socket operation (connect, send, receive), > 0.
    reconnect_interval_s : float
        After a transport error, no call talks to the store for this long
        (>= 0); the next call after it reconnects.
    secret : bytes or str, optional
        Key of the HMAC-SHA256 tag every value carries (spec/remote-tier.md
        §2): bytes (at least 16), or the name of an environment variable
        holding it. With it, a value without a valid tag is refused and
        counted (``auth_failures``) and token ids are stored only as a keyed
        digest. Without it, anyone who can write to the store can forge a
        value. Never shown in any message or repr.

    Raises
    ------
    TypeError, ValueError
        A malformed URL (the message shows it with any password masked),
        namespace or number.
    ImportError
        redis-py is not installed (``pip install "kvcache[remote]"``).

    Notes
    -----
    Construction does no I/O: an unreachable store at start is a miss, not an
    error. ``bind`` must be called before the block methods. The tier is
    safe to use from several threads.

    Examples
    --------
    >>> from kvref._remote_tier import RemoteTier
    >>> tier = RemoteTier("redis://127.0.0.1:1/0", timeout_s=0.05)
    >>> tier.bind({"num_layers": 1, "kv_heads": 1, "head_dim": 4, "page_size": 2,
    ...            "dtype": "float16"}, "sha256")
    >>> tier.lookup([bytes(32)])   # nothing listens on port 1: a miss
    0
    >>> tier.metrics.errors
    1
    >>> tier.close()
    """

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "kvcache",
        ttl_s: float | None = None,
        timeout_s: float = 0.05,
        reconnect_interval_s: float = 1.0,
        secret: bytes | str | None = None,
    ):
        o = "RemoteTier"
        target = _parse_url(url)
        if not isinstance(namespace, str) or not _NAMESPACE_RE.match(namespace):
            raise ValueError(f"{o}: namespace={namespace!r}, must be 1-64 characters of [A-Za-z0-9_.-/]")
        if ttl_s is not None:
            ttl_s = self._check_seconds(o, "ttl_s", ttl_s, allow_zero=False, high=MAX_TTL_S)
            if ttl_s < 0.001:
                raise ValueError(f"{o}: ttl_s={ttl_s}, must be >= 0.001 (Redis expires in milliseconds)")
        timeout_s = self._check_seconds(o, "timeout_s", timeout_s, allow_zero=False, high=MAX_TIMEOUT_S)
        if timeout_s < 0.001:
            raise ValueError(f"{o}: timeout_s={timeout_s}, must be >= 0.001")
        reconnect_interval_s = self._check_seconds(o, "reconnect_interval_s", reconnect_interval_s, allow_zero=True,
                                                   high=MAX_RECONNECT_INTERVAL_S)
        key = _resolve_secret(o, secret)
        import redis  # noqa: F401  (fail at construction, not at the first call, when the extra is missing)

        self._secret = key
        self._url = redact_url(url)
        self._target = target
        self._namespace = namespace
        self._ttl_ms = None if ttl_s is None else max(1, math.ceil(ttl_s * 1000))
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._reconnect_interval_s = reconnect_interval_s
        self._lock = threading.Lock()
        self._client = None
        self._next_attempt = 0.0
        self._closed = False
        self._metrics = RemoteTierMetrics()
        self._last_error: str | None = None
        # Set by bind().
        self._hash_algo: str | None = None
        self._digest_size = 0
        self._geometry: dict[str, Any] | None = None
        self._geometry_digest = b""
        self._key_prefix = ""
        self._plan = False
        self._page_size = 0
        self._page_bytes = 0

    @staticmethod
    def _check_seconds(o: str, name: str, value, *, allow_zero: bool, high: float) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"{o}: {name}={value!r}, must be a number of seconds")
        try:
            value = float(value)
        except OverflowError:
            raise ValueError(f"{o}: {name}={value}, must be <= {high:g}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise ValueError(f"{o}: {name}={value}, must be {'>= 0' if allow_zero else '> 0'} and finite")
        if value > high:
            raise ValueError(f"{o}: {name}={value:g}, must be <= {high:g}")
        return value

    # ------------------------------------------------------------------ properties

    @property
    def url(self) -> str:
        """The URL given, with any password masked (``***``)."""
        return self._url

    @property
    def is_cluster(self) -> bool:
        """True for ``redis+cluster://`` URLs."""
        return self._target["cluster"]

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def authenticated(self) -> bool:
        """True when values are authenticated with ``secret`` (HMAC-SHA256)."""
        return self._secret is not None

    @property
    def ttl_s(self) -> float | None:
        return self._ttl_s

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    @property
    def reconnect_interval_s(self) -> float:
        return self._reconnect_interval_s

    @property
    def hash_algo(self) -> str | None:
        """The bound hash algorithm (None before ``bind``)."""
        return self._hash_algo

    @property
    def geometry_digest(self) -> bytes:
        """The bound 8-byte geometry digest (empty before ``bind``)."""
        return self._geometry_digest

    @property
    def page_bytes(self) -> int:
        """K/V bytes of one block: ``2 * num_layers * page_size * kv_heads * head_dim * itemsize``."""
        return self._page_bytes

    @property
    def connected(self) -> bool:
        """True while the tier holds a client that has not failed since it connected."""
        return self._client is not None

    @property
    def last_error(self) -> str | None:
        """The last transport error, as text (for logs); None if there was none."""
        return self._last_error

    @property
    def metrics(self) -> RemoteTierMetrics:
        """A snapshot of the counters."""
        with self._lock:
            return self._metrics.copy()

    def take_metrics(self) -> RemoteTierMetrics:
        """The counters, then zero them."""
        with self._lock:
            out, self._metrics = self._metrics, RemoteTierMetrics()
            return out

    # ------------------------------------------------------------------ binding

    def bind(
        self,
        geometry: KVCacheParams | Mapping[str, Any],
        hash_algo: str | None = None,
        *,
        leaf_id: str = DEFAULT_LEAF_ID,
        holds_bytes: bool = True,
    ) -> None:
        """Fix the block geometry and hash algorithm of every key and value.

        With ``holds_bytes=False`` (bookkeeping-only mode, spec/remote-tier.md
        §8) the tier stores header-only values under a separate ``plan`` key
        space: lookups, hits and counts are shared between processes, no K/V
        byte is stored, and ``get_many`` returns empty payloads.

        Parameters
        ----------
        geometry : KVCacheParams or mapping
            ``KVCacheParams``, or a mapping with ``num_layers``, ``kv_heads``,
            ``head_dim``, ``page_size`` (ints > 0) and ``dtype`` (one of
            ``float16``, ``bfloat16``, ``float32``).
        hash_algo : {"sha256", "xxh3_128"}, optional
            Default: ``geometry.hash_algo`` for ``KVCacheParams``; required
            for a mapping.
        leaf_id : str
            The leaf whose pages are stored (enters the digest).
        holds_bytes : bool
            False: bookkeeping-only (header-only values, ``plan`` keys).

        Raises
        ------
        TypeError, ValueError
            A malformed geometry or algorithm; state is unchanged.
        RuntimeError
            Already bound to another geometry or algorithm, or closed; state is unchanged.
        """
        o = "RemoteTier.bind"
        if hash_algo is None:
            if not isinstance(geometry, KVCacheParams):
                raise ValueError(f"{o}: hash_algo=None, must be given with a geometry mapping")
            hash_algo = geometry.hash_algo
        if hash_algo not in HASH_ALGOS:
            raise ValueError(f"{o}: hash_algo={hash_algo!r}, must be one of {sorted(HASH_ALGOS)}")
        if not isinstance(holds_bytes, bool):
            raise TypeError(f"{o}: holds_bytes={holds_bytes!r}, must be a bool")
        digest = geometry_digest(geometry, leaf_id)
        fields = _geometry_fields(geometry, leaf_id)
        self._check_open(o)
        if self._hash_algo is not None:
            if (hash_algo, digest, holds_bytes) != (self._hash_algo, self._geometry_digest, not self._plan):
                raise RuntimeError(
                    f"{o}: already bound to hash_algo={self._hash_algo!r} geometry={self._geometry} "
                    f"holds_bytes={not self._plan}, got hash_algo={hash_algo!r} geometry={fields} "
                    f"holds_bytes={holds_bytes}"
                )
            return
        page_bytes = 2 * math.prod(fields[f] for f in _GEOMETRY_FIELDS) * KV_DTYPES[fields["dtype"]].itemsize
        if is_fp8(fields["dtype"]):  # spec/manager.md §16: the payload carries the page's float32 scales too
            page_bytes += 4 * 2 * fields["num_layers"] * fields["kv_heads"]
        # spec/remote-tier.md §1: the key carries namespace, algorithm and geometry,
        # so two models or geometries never collide.
        # spec/remote-tier.md §8: bookkeeping entries live apart, never read as K/V.
        self._key_prefix = f"{self._namespace}:{hash_algo}:{digest.hex()}:" + ("" if holds_bytes else "plan:")
        self._plan = not holds_bytes
        self._geometry = fields
        self._geometry_digest = digest
        self._digest_size = HASH_ALGOS[hash_algo]
        self._page_size = fields["page_size"]
        self._page_bytes = page_bytes
        self._hash_algo = hash_algo

    def key_for(self, block_hash: bytes) -> str:
        """The Redis key of ``block_hash``: ``{namespace}:{algo}:{geometry16}:{hash_hex}``."""
        self._check_bound("RemoteTier.key_for")
        return self._key_prefix + self._check_hashes("RemoteTier.key_for", [block_hash])[0].hex()

    # ------------------------------------------------------------------ block methods

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Number of leading blocks of ``hashes`` the store holds.

        One pipelined round trip of ``EXISTS``; the count stops at the first
        miss. Advisory: a later ``get_many`` may still be refused (eviction,
        expiry, a value that fails verification).

        Parameters
        ----------
        hashes : sequence of bytes [n]
            Chained block hashes of the bound algorithm, in chain order.

        Returns
        -------
        int
            In ``[0, n]``; 0 when the store is down or slow.

        Raises
        ------
        TypeError, ValueError
            A hash of the wrong type or length; state is unchanged.
        RuntimeError
            Not bound, or closed; state is unchanged.
        """
        o = "RemoteTier.lookup"
        self._check_bound(o)
        hashes = self._check_hashes(o, hashes)
        if not hashes:
            return 0
        keys = [self._key_prefix + h.hex() for h in hashes]

        def run(client):
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return pipe.execute()

        found = self._io(run)
        hit = 0
        if found is not _DOWN:
            # spec/remote-tier.md §3: leading run only, a gap ends the hit.
            for present in found:
                if not present:
                    break
                hit += 1
        with self._lock:
            self._metrics.lookups += 1
            self._metrics.lookup_blocks += len(keys)
            self._metrics.hits += hit
        return hit

    def get_many(self, hashes: Sequence[bytes], tokens: np.ndarray) -> list[bytes]:
        """The K/V bytes of every block, each value verified.

        Parameters
        ----------
        hashes : sequence of bytes [n]
            Block hashes of the bound algorithm.
        tokens : int [n, page_size]
            Token ids of each block, compared with the stored ones.

        Returns
        -------
        list of bytes [n]
            ``page_bytes`` each, in the layout the writer gave
            (``[2, num_layers, page_size, kv_heads, head_dim]`` for a manager's block).

        Raises
        ------
        KVLoadRefused
            A value is missing (evicted, expired), fails verification (magic,
            version, algorithm, geometry, block hash, tokens, length,
            checksum), or the store did not answer in time. Nothing is
            returned; the refusal is counted (``loads_refused`` or
            ``loads_failed``) and nothing else changes.
        TypeError, ValueError
            Malformed arguments; state is unchanged.
        RuntimeError
            Not bound, or closed; state is unchanged.
        """
        o = "RemoteTier.get_many"
        self._check_bound(o)
        hashes = self._check_hashes(o, hashes)
        rows = self._check_tokens(o, tokens, len(hashes))
        if not hashes:
            return []
        keys = [self._key_prefix + h.hex() for h in hashes]

        def run(client):
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            return pipe.execute()

        values = self._io(run)
        if values is _DOWN:
            with self._lock:
                self._metrics.loads_failed += 1
            raise KVLoadRefused(
                f"{o}: store {self._redacted_url()} unreachable or slower than timeout_s={self._timeout_s}"
                f" ({self._last_error})",
                block_hash=hashes[0],
            )
        payloads = []
        for i, (k, h, value) in enumerate(zip(keys, hashes, values)):
            problem, auth = self._verify(k, h, rows[i], value)
            if problem is not None:
                with self._lock:
                    self._metrics.loads_refused += 1
                    self._metrics.auth_failures += int(auth)
                raise KVLoadRefused(f"{o}: hashes[{i}]={h.hex()[:16]}… {problem}", block_hash=h)
            payloads.append(b"" if self._plan else value[len(value) - self._page_bytes :])
        with self._lock:
            self._metrics.blocks_read += len(values)
            self._metrics.bytes_read += sum(len(v) for v in values)
        return payloads

    def put_many(self, hashes: Sequence[bytes], tokens: np.ndarray, payloads: Sequence,
                 retain_s: Sequence[float | None] | None = None) -> int:
        """Store blocks that the store does not hold yet (``SET NX``, with the TTL if set).

        Parameters
        ----------
        hashes : sequence of bytes [n]
            Block hashes of the bound algorithm.
        tokens : int [n, page_size]
            Token ids of each block (stored in the header, checked on load).
        payloads : sequence [n] of bytes-like or ndarray
            ``page_bytes`` bytes each (arrays are taken in C order).
        retain_s : sequence [n] of float or None, optional
            Each block's retention claim known at the write (seconds left, ``None``: none;
            spec/tiers.md §3.1). With a TTL, a claimed block is written with the longer of
            the TTL and its claim, and a block already stored gets ``PEXPIRE key ms GT``
            in the same round trip, so its bytes never sit in the store under a shorter
            TTL than their claim. Without a TTL claims change nothing (keys never expire).

        Returns
        -------
        int
            Blocks newly stored. Blocks already present are skipped (counted
            in ``blocks_already_present``); when the store does not answer
            the blocks are dropped (``offloads_dropped``) and 0 is returned —
            never an exception.

        Raises
        ------
        TypeError, ValueError
            Malformed arguments (a payload of the wrong size included); state is unchanged.
        RuntimeError
            Not bound, or closed; state is unchanged.
        """
        o = "RemoteTier.put_many"
        self._check_bound(o)
        hashes = self._check_hashes(o, hashes)
        rows = self._check_tokens(o, tokens, len(hashes))
        if not isinstance(payloads, Sequence) and not isinstance(payloads, np.ndarray):
            raise TypeError(f"{o}: payloads type={type(payloads).__name__}, must be a sequence")
        if len(payloads) != len(hashes):
            raise ValueError(f"{o}: len(payloads)={len(payloads)} but len(hashes)={len(hashes)}")
        claim_ms = self._claims_ms(o, retain_s, len(hashes))
        data = []
        for i, p in enumerate(payloads):
            if self._plan:
                data.append(b"")  # spec/remote-tier.md §8: bookkeeping-only stores no K/V byte
                continue
            b = _payload_bytes(o, i, p)
            if len(b) != self._page_bytes:
                raise ValueError(f"{o}: payloads[{i}] has {len(b)} bytes, must be page_bytes={self._page_bytes}")
            data.append(b)
        if not hashes:
            return 0
        keys = [self._key_prefix + h.hex() for h in hashes]
        values = [self._encode(k, h, rows[i], data[i]) for i, (k, h) in enumerate(zip(keys, hashes))]
        ttl_ms = self._ttl_ms

        def run(client):
            pipe = client.pipeline(transaction=False)
            at, n = [], 0  # the SET replies' places among the pipeline's n replies
            for k, v, ms in zip(keys, values, claim_ms):
                # spec/remote-tier.md §3: SET NX — the first writer wins, a value is never overwritten.
                # spec/tiers.md §3.1: a claim known now is the key's TTL from the write on.
                at.append(n)
                n += 1 if ms is None else 2
                pipe.set(k, v, nx=True, px=ttl_ms if ms is None else max(ttl_ms, ms))
                if ms is not None:
                    pipe.execute_command("PEXPIRE", k, ms, "GT")  # a key already stored
            # A server before Redis 7.0 refuses GT: that reply alone is ignored (a new key
            # already carries its claim); a refused SET is the store's error, as before.
            replies = pipe.execute(raise_on_error=False)
            sets = [replies[i] for i in at]
            for r in sets:
                if isinstance(r, Exception):
                    raise r
            return sets

        stored = self._io(run)
        with self._lock:
            if stored is _DOWN:
                # spec/remote-tier.md §4: a failing store drops offloads, counted, never raised.
                self._metrics.offloads_dropped += len(keys)
                return 0
            written = [bool(s) for s in stored]
            self._metrics.blocks_written += sum(written)
            self._metrics.bytes_written += sum(len(v) for v, w in zip(values, written) if w)
            self._metrics.blocks_already_present += len(written) - sum(written)
            return sum(written)

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Refresh the TTL of stored blocks (``PEXPIRE key ttl GT``); no I/O without a TTL.

        A longer expiry stays (a retention claim's, spec/tiers.md §3.1: a touch may run
        after a claim landed, and never cuts it back to the TTL), a key without a TTL keeps
        none. Missing blocks are ignored; a failing store is ignored (counted in ``errors``).

        Raises
        ------
        TypeError, ValueError
            A hash of the wrong type or length; state is unchanged.
        RuntimeError
            Not bound, or closed; state is unchanged.
        """
        o = "RemoteTier.touch"
        self._check_bound(o)
        hashes = self._check_hashes(o, hashes)
        if not hashes or self._ttl_ms is None:
            return None
        keys = [self._key_prefix + h.hex() for h in hashes]
        ttl_ms = self._ttl_ms

        def run(client):
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.execute_command("PEXPIRE", k, ttl_ms, "GT")
            replies = pipe.execute(raise_on_error=False)
            if not any(isinstance(r, Exception) for r in replies):
                return replies
            pipe = client.pipeline(transaction=False)  # a server before Redis 7.0 has no GT
            for k in keys:
                pipe.pexpire(k, ttl_ms)
            return pipe.execute()

        self._io(run)
        return None

    def retain(self, hashes: Sequence[bytes], seconds: float) -> None:
        """A retention claim with a time-to-live (spec/tiers.md §3.1): extend the expiry of each
        stored key to at least ``seconds`` from now (pipelined ``PEXPIRE key ms GT``: a longer
        TTL stays, a key without a TTL keeps none). Missing keys and a failing store are
        ignored (counted in ``errors``), like :meth:`touch`.

        Raises
        ------
        TypeError, ValueError
            A hash of the wrong type or length, ``seconds`` not a finite number > 0; state is unchanged.
        RuntimeError
            Not bound, or closed; state is unchanged.
        """
        o = "RemoteTier.retain"
        self._check_bound(o)
        hashes = self._check_hashes(o, hashes)
        seconds = _retention.check_seconds(o, seconds, "seconds")
        if seconds is None:
            raise TypeError(f"{o}: seconds=None, must be a real number of seconds > 0")
        if not hashes:
            return None
        keys = [self._key_prefix + h.hex() for h in hashes]
        ms = max(1, math.ceil(seconds * 1000))

        def run(client):
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.execute_command("PEXPIRE", k, ms, "GT")
            return pipe.execute()

        self._io(run)
        return None

    def close(self) -> None:
        """Close the connections; later calls raise ``RuntimeError``. Idempotent."""
        with self._lock:
            client, self._client, self._closed = self._client, None, True
        if client is not None:
            _close_quietly(client)

    def __enter__(self) -> "RemoteTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("connected" if self._client is not None else "disconnected")
        return (
            f"RemoteTier({self._redacted_url()!r}, namespace={self._namespace!r}, ttl_s={self._ttl_s}, "
            f"timeout_s={self._timeout_s}, hash_algo={self._hash_algo!r}, "
            f"authenticated={self._secret is not None}, {state})"
        )

    # ------------------------------------------------------------------ values

    def _token_field(self, key: bytes, tokens: np.ndarray) -> bytes:
        """The stored token field: the ids in clear, or with a secret their keyed
        digest (spec/remote-tier.md §2: prompts are not stored in clear)."""
        raw = np.asarray(tokens).astype("<i4", copy=False).tobytes()
        if self._secret is None:
            return raw
        return hmac.new(self._secret, b"kvcache-remote/tokens/v1\0" + key + b"\0" + raw, hashlib.sha256).digest()

    def _tag(self, key: bytes, head: bytes, payload) -> bytes:
        """The integrity field over key, header and payload: xxh3-128 (accidents
        only) or, with a secret, HMAC-SHA256 (forgery too)."""
        if self._secret is None:
            h = xxhash.xxh3_128(key)
        else:
            h = hmac.new(self._secret, key, hashlib.sha256)
        h.update(head)
        h.update(payload)
        return h.digest()

    def _encode(self, key: str, block_hash: bytes, tokens: np.ndarray, payload: bytes) -> bytes:
        """Header (spec/remote-tier.md §2) + payload."""
        version = FORMAT_VERSION if self._secret is None else AUTH_FORMAT_VERSION
        kb = key.encode()
        head = (
            _FIXED.pack(
                MAGIC, version, _ALGO_IDS[self._hash_algo], self._digest_size,
                self._geometry_digest, self._page_size, self._page_bytes,
            )
            + block_hash
            + self._token_field(kb, tokens)
        )
        return head + self._tag(kb, head, payload) + payload

    def _header_size(self) -> int:
        if self._secret is None:
            return _FIXED.size + self._digest_size + 4 * self._page_size + _CHECKSUM_SIZE
        return _FIXED.size + self._digest_size + _TOKEN_DIGEST_SIZE + _TAG_SIZE

    def _verify(self, key: str, block_hash: bytes, tokens: np.ndarray, value) -> tuple[str | None, bool]:
        """``(why value must not be served, is it an authentication failure)``; ``(None, False)`` if it may."""
        if value is None:
            return "not in the store (evicted or expired since the lookup)", False
        if not isinstance(value, bytes):
            return f"value type={type(value).__name__}, must be bytes", False
        header = self._header_size()
        want_version = FORMAT_VERSION if self._secret is None else AUTH_FORMAT_VERSION
        if len(value) < _FIXED.size:
            return f"value length={len(value)} < fixed header {_FIXED.size}", self._secret is not None
        magic, version, algo, dsize, geo, page_size, length = _FIXED.unpack_from(value)
        if magic != MAGIC:
            return f"magic={magic!r} but expected {MAGIC!r}", self._secret is not None
        if version != want_version:
            if version == AUTH_FORMAT_VERSION:
                return "authenticated value (format version=3) but this tier has no remote_secret", True
            if self._secret is not None and version == FORMAT_VERSION:
                return "unauthenticated value (format version=2): this tier requires a valid tag", True
            return f"format version={version} but expected {want_version}", self._secret is not None
        kb = key.encode()
        if self._secret is not None:
            # spec/remote-tier.md §2: the tag is checked before any other field is believed.
            want_len = header + (0 if self._plan else self._page_bytes)
            if len(value) != want_len:
                return f"value length={len(value)} but expected {want_len} (truncated or padded)", True
            at = header - _TAG_SIZE
            want = self._tag(kb, value[:at], memoryview(value)[header:])
            if not hmac.compare_digest(value[at:header], want):
                return "authentication tag does not match (forged, or written with another secret or key)", True
        if algo != _ALGO_IDS[self._hash_algo] or dsize != self._digest_size:
            return f"hash algorithm id={algo} (digest {dsize} B) but expected {self._hash_algo!r}", False
        if geo != self._geometry_digest:
            return f"geometry digest={geo.hex()} but expected {self._geometry_digest.hex()}", False
        if page_size != self._page_size:
            return f"tokens per block={page_size} but expected {self._page_size}", False
        if length != self._page_bytes:
            return f"payload length={length} but expected page_bytes={self._page_bytes}", False
        stored = 0 if self._plan else length
        if len(value) != header + stored:
            return f"value length={len(value)} but header says {header + stored} (truncated or padded)", False
        at = _FIXED.size
        if value[at : at + dsize] != block_hash:
            return f"stored block hash={value[at : at + dsize].hex()[:16]}… differs", False
        at += dsize
        field = self._token_field(kb, tokens)
        if not hmac.compare_digest(value[at : at + len(field)], field):
            return "stored token ids differ from the requested ones", False
        at += len(field)
        if self._secret is None:
            checksum = self._tag(kb, value[:at], memoryview(value)[header:])
            if value[at : at + _CHECKSUM_SIZE] != checksum:
                return f"checksum={value[at : at + _CHECKSUM_SIZE].hex()} but computed {checksum.hex()}", False
        return None, False

    # ------------------------------------------------------------------ checks

    def _claims_ms(self, o: str, retain_s, n: int) -> list[int | None]:
        """``put_many``'s ``retain_s`` as milliseconds per block (``None``: no claim, or no TTL)."""
        if retain_s is None:
            return [None] * n
        if isinstance(retain_s, (bytes, bytearray, str)) or not isinstance(retain_s, (Sequence, np.ndarray)):
            raise TypeError(f"{o}: retain_s type={type(retain_s).__name__}, must be None or a sequence")
        if len(retain_s) != n:
            raise ValueError(f"{o}: len(retain_s)={len(retain_s)} but len(hashes)={n}")
        secs = [_retention.check_seconds(o, s, f"retain_s[{i}]") for i, s in enumerate(retain_s)]
        if self._ttl_ms is None:
            return [None] * n  # keys without a TTL never expire: nothing to extend
        return [None if s is None else max(1, math.ceil(min(s, MAX_TTL_S) * 1000)) for s in secs]

    def _check_open(self, o: str) -> None:
        if self._closed:
            raise RuntimeError(f"{o}: the tier is closed")

    def _check_bound(self, o: str) -> None:
        self._check_open(o)
        if self._hash_algo is None:
            raise RuntimeError(f"{o}: not bound; call bind(geometry, hash_algo) first")

    def _check_hashes(self, o: str, hashes) -> list[bytes]:
        if isinstance(hashes, (bytes, bytearray, str)) or not isinstance(hashes, (Sequence, np.ndarray)):
            raise TypeError(f"{o}: hashes type={type(hashes).__name__}, must be a sequence of bytes")
        out = []
        for i, h in enumerate(hashes):
            if not isinstance(h, (bytes, bytearray)):
                raise TypeError(f"{o}: hashes[{i}] type={type(h).__name__}, must be bytes")
            if len(h) != self._digest_size:
                raise ValueError(
                    f"{o}: hashes[{i}] length={len(h)}, must be {self._digest_size} ({self._hash_algo})"
                )
            out.append(bytes(h))
        return out

    def _check_tokens(self, o: str, tokens, n: int) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{o}: tokens dtype={arr.dtype}, must be an integer type")
        if arr.shape != (n, self._page_size):
            raise ValueError(f"{o}: tokens shape={arr.shape}, must be ({n}, {self._page_size})")
        if arr.size and (arr.min() < -(2**31) or arr.max() > 2**31 - 1):
            raise ValueError(f"{o}: tokens value out of int32 range")
        return arr

    def _redacted_url(self) -> str:
        t = self._target
        scheme = "redis+cluster" if t["cluster"] else "redis"
        host = f"[{t['host']}]" if ":" in t["host"] else t["host"]
        return f"{scheme}://{host}:{t['port']}" + ("" if t["cluster"] else f"/{t['db']}")

    # ------------------------------------------------------------------ transport

    def _connect(self):
        """A new client, checked with one round trip; raises on failure."""
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        t = self._target
        # spec/remote-tier.md §4: no client-side retries, every socket operation bounded by timeout_s.
        common = dict(
            username=t["username"],
            password=t["password"],
            socket_timeout=self._timeout_s,
            socket_connect_timeout=self._timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        if t["cluster"]:
            from redis.cluster import RedisCluster

            # Building the cluster client reads the slot map (one round trip).
            return RedisCluster(host=t["host"], port=t["port"], require_full_coverage=False, **common)
        import redis

        client = redis.Redis(host=t["host"], port=t["port"], db=t["db"], health_check_interval=0, **common)
        try:
            client.ping()
        except BaseException:
            _close_quietly(client)
            raise
        return client

    def _client_or_none(self):
        """The live client, a fresh one when the pause is over, or None (down)."""
        with self._lock:
            self._check_open("RemoteTier")
            if self._client is not None:
                return self._client
            now = time.monotonic()
            if now < self._next_attempt:
                return None
            self._next_attempt = now + self._reconnect_interval_s
            try:
                client = self._connect()
            except Exception as e:  # any failure to reach the store is a miss
                self._metrics.errors += 1
                self._last_error = f"{type(e).__name__}: {e}"
                return None
            self._client = client
            self._metrics.connects += 1
            return client

    def _io(self, run):
        """``run(client)``, or ``_DOWN`` when the store is down, slow or failing."""
        start = time.perf_counter()
        try:
            client = self._client_or_none()
            if client is None:
                return _DOWN
            try:
                return run(client)
            except Exception as e:  # the region holds only client calls: any error is the store's
                self._mark_down(client, e)
                return _DOWN
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                self._metrics.time_s += elapsed

    def _mark_down(self, client, error: Exception) -> None:
        """Drop a failed client; no call talks to the store for ``reconnect_interval_s``."""
        with self._lock:
            self._metrics.errors += 1
            self._last_error = f"{type(error).__name__}: {error}"
            if self._client is client:
                self._client = None
                self._next_attempt = time.monotonic() + self._reconnect_interval_s
            else:
                client = None
        if client is not None:
            _close_quietly(client)


def _close_quietly(client) -> None:
    try:
        client.close()
    except Exception:  # closing a broken connection may itself fail; nothing to recover
        return


class _Down:
    """Marker: the store did not answer."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<store down>"


_DOWN = _Down()
