"""Workloads for ``kvcache replay``: the built-in chat workload and Mooncake traces.

A workload is a list of :class:`Request` in arrival order. Each request
carries its prompt token ids and the token ids the replay feeds back as the
"sampled" output, so a later turn whose prompt contains an earlier answer
hits the blocks that answer filled.

Two sources:

* :func:`synthetic_workload` — seeded multi-turn chat: a few shared system
  prompts, conversations that grow turn by turn (each prompt holds every
  earlier question and answer), and a few long documents asked about
  several times.
* :func:`read_mooncake_trace` — Mooncake JSONL (``timestamp``,
  ``input_length``, ``output_length``, ``hash_ids``). Each hash id stands for
  one 512-token block *and every block before it*; it is mapped to 512
  deterministic token ids seeded from the id, so two prompts that share an
  id share those tokens and prefix identity holds at any page size.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvspec._config import check_int

__all__ = [
    "Request",
    "WorkloadError",
    "MOONCAKE_BLOCK_TOKENS",
    "synthetic_workload",
    "read_mooncake_trace",
    "with_retention",
    "without_retention",
]

#: Tokens per Mooncake ``hash_ids`` block.
MOONCAKE_BLOCK_TOKENS = 512

#: Vocabulary of the built-in workload (token ids ``1 .. CHAT_VOCAB-1``).
CHAT_VOCAB = 32000

# Trace tokens cover the positive int32 range, so two different hash ids
# practically never agree on a leading token (prefix identity at page size 1).
_TRACE_TOKEN_MOD = 2**31 - 2  # tokens are 1 .. 2**31 - 2

# Key domains of the token mapping: shared blocks vs tokens private to one request.
_DOMAIN_BLOCK = 0
_DOMAIN_PRIVATE = 1

_U64 = np.uint64


class WorkloadError(ValueError):
    """A workload could not be read or built; the message names the file and line."""


@dataclass(frozen=True, slots=True, eq=False)
class Request:
    """One request of a workload.

    Attributes
    ----------
    request_id : str
    prompt : int32 [P]
        Prompt token ids, ``P >= 1``.
    output : int32 [O]
        Token ids generated, in order, ``O >= 1``; the replay feeds them to
        ``TextContext.update`` one per forward.
    arrival : float
        Arrival time in seconds; orders the workload only (the replay is a
        closed loop, see ``docs/replay.md``).
    cache_salt : str, optional
        The request's ``TextContext.cache_salt``: requests with different
        salts never share pages (tenant isolation).
    retention_priority, retention_seconds : optional
        The request's retention claim (``TextContext``'s keywords,
        spec/manager.md §14); None: none (the defaults, 35 and no expiry).
    model : str, optional
        The model (or LoRA adapter) serving the request, when several share
        one pool: requests for different models never share pages (the
        replay keys the request's hash root by model and salt, as vLLM keys
        blocks by adapter); None: the pool's one model.
    follows : str, optional
        The ``request_id`` of an earlier request whose answer this prompt
        contains (the previous turn of a conversation). The request cannot
        arrive before that one has finished, and the replay admits it no
        sooner (``docs/replay.md``, "Causality"); None: no such request.
    """

    request_id: str
    prompt: np.ndarray
    output: np.ndarray
    arrival: float
    cache_salt: str | None = None
    retention_priority: int | None = None
    retention_seconds: float | None = None
    model: str | None = None
    follows: str | None = None

    @property
    def cache_key(self) -> str | bytes | None:
        """The ``TextContext.cache_salt`` the replay gives the request: ``cache_salt`` alone
        without a ``model``; with one, bytes naming both (``b"model\\0<model>\\0salt\\0<salt>"``),
        so two models never share a hash root, whatever their salts."""
        if self.model is None:
            return self.cache_salt
        salt = b"\0salt\0" + self.cache_salt.encode("utf-8", "surrogatepass") if self.cache_salt is not None else b""
        return b"model\0" + self.model.encode("utf-8", "surrogatepass") + salt

    @property
    def retention(self) -> dict:
        """The ``TextContext`` keywords of the request's retention claim (empty without one)."""
        out = {}
        if self.retention_priority is not None:
            out["retention_priority"] = self.retention_priority
        if self.retention_seconds is not None:
            out["retention_seconds"] = self.retention_seconds
        return out

    @property
    def prompt_length(self) -> int:
        """Tokens in ``prompt``."""
        return int(self.prompt.size)

    @property
    def output_length(self) -> int:
        """Tokens in ``output`` (the tokens the replay decodes)."""
        return int(self.output.size)

    @property
    def total_length(self) -> int:
        """Tokens the request holds at its end: prompt plus output."""
        return int(self.prompt.size + self.output.size)


# --------------------------------------------------------------------------- built-in chat


def synthetic_workload(num_requests: int = 300, seed: int = 0) -> list[Request]:
    """The built-in, seeded multi-turn chat workload.

    Sessions start at random times and send turns separated by a think time.
    A chat session's turn ``t`` prompt is ``system + q_0 + a_0 + ... + q_t``
    (the answers are the previous turns' outputs, so turn ``t`` ``follows``
    turn ``t - 1``: it arrives once that turn has finished); one session in ten asks
    about one of three long documents (``system + document + q_0 + a_0 ...``).
    Four system prompts are shared by every session.

    Parameters
    ----------
    num_requests : int
        Requests to return (the first ones by arrival), >= 1.
    seed : int
        Seed of every random choice, >= 0; the same seed gives the same tokens.

    Returns
    -------
    list of Request
        In arrival order; prompts are at most about 10k tokens.
    """
    check_int("synthetic_workload", "num_requests", num_requests, low=1)
    check_int("synthetic_workload", "seed", seed, low=0)
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> np.ndarray:
        return rng.integers(1, CHAT_VOCAB, size=int(n), dtype=np.int32)

    systems = [tokens(rng.integers(300, 900)) for _ in range(4)]
    documents = [tokens(rng.integers(3000, 6000)) for _ in range(3)]
    # Sessions start over a horizon that grows with the request count, so the
    # number of conversations open at once does not depend on num_requests.
    horizon = 4.0 * num_requests
    events: list[tuple[float, int, int]] = []  # (arrival, session, turn)
    sessions: list[dict] = []
    while len(events) < num_requests * 1.3 + 8:
        sid = len(sessions)
        turns = int(rng.integers(2, 9))
        head = [systems[int(rng.integers(len(systems)))]]
        if rng.random() < 0.1:
            head.append(documents[int(rng.integers(len(documents)))])
        t = float(rng.uniform(0.0, horizon))
        q = [tokens(rng.integers(16, 200)) for _ in range(turns)]
        a = [tokens(rng.integers(16, 160)) for _ in range(turns)]
        sessions.append({"head": head, "q": q, "a": a})
        for k in range(turns):
            events.append((t, sid, k))
            t += float(rng.exponential(30.0)) + 1.0
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    out = []
    last_turn: dict[int, str] = {}  # session -> request_id of its latest turn so far
    for i, (t, sid, k) in enumerate(events[:num_requests]):
        s = sessions[sid]
        parts = list(s["head"])
        for j in range(k):
            parts += [s["q"][j], s["a"][j]]
        parts.append(s["q"][k])
        rid = f"chat-{i:05d}-s{sid}-t{k}"
        out.append(Request(rid, np.concatenate(parts), s["a"][k], t, follows=last_turn.get(sid)))
        last_turn[sid] = rid
    return out


# --------------------------------------------------------------------------- Mooncake traces

_TRACE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")

#: Bounds of trace values (issue 11: hostile values are one error line, never an
#: internal error). Lengths: 4 Mi tokens per prompt or output (beyond any
#: published context); hash ids and timestamps: exact in a float64 / JSON
#: number; the whole trace: 2**31 tokens (8 GiB of int32 token ids).
MAX_TRACE_LENGTH = 2**22
MAX_TRACE_ID = 2**53
MAX_TRACE_TOKENS = 2**31
MAX_SALT_BYTES = 1024


def read_mooncake_trace(path: str | os.PathLike, *, num_requests: int | None = None, seed: int = 0) -> list[Request]:
    """Read a Mooncake JSONL trace into requests.

    Every line is a JSON object with ``timestamp`` (int, ms, ``|t| <= 2**53``),
    ``input_length`` (int in ``[1, 2**22]``), ``output_length`` (int in
    ``[0, 2**22]``) and ``hash_ids`` (list of int in ``[0, 2**53]``,
    ``len == ceil(input_length / 512)``), and optionally ``cache_salt`` (a
    string of at most 1024 UTF-8 bytes, or null), ``model`` (the model or
    adapter serving the request when several share the pool: a non-empty
    string of at most 1024 UTF-8 bytes without NUL, or null), ``retention_priority`` (an
    int in ``0..100``, or null) and ``retention_seconds`` (a number > 0, or
    null): the request's retention claim (spec/manager.md §14). The whole trace holds at most
    ``2**31`` tokens. Requests are ordered by timestamp, file order for ties.

    Token mapping (the spec decision, see ``docs/replay.md``): token ``j`` of
    hash id ``h`` is ``splitmix64(splitmix64(2 * seed) ^ (h * 512 + j)) % (2**31 - 2) + 1``,
    so every block with id ``h`` holds the same 512 tokens; a full last
    block does too. A partial last block, and then the output tokens, take
    ``splitmix64(splitmix64(2 * seed + 1) ^ (line * 2**32 + j))`` instead, so
    they are unique to the request. A request generates ``max(output_length, 1)`` tokens (a prefill
    always samples one).

    Parameters
    ----------
    path : path-like
        The JSONL file.
    num_requests : int, optional
        Keep the first ``num_requests`` by arrival (>= 1); default all.
    seed : int
        Seed of the token mapping, >= 0.

    Returns
    -------
    list of Request

    Raises
    ------
    WorkloadError
        Missing or unreadable file, a line that is not a JSON object with the
        four fields, a wrong type or value, an empty file. The message names
        the file and the 1-based line number.
    """
    if num_requests is not None:
        check_int("read_mooncake_trace", "num_requests", num_requests, low=1)
    check_int("read_mooncake_trace", "seed", seed, low=0)
    records = []
    total = 0
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                rec = _parse_trace_line(path, lineno, line)
                total += rec["input_length"] + max(rec["output_length"], 1)
                if total > MAX_TRACE_TOKENS:
                    raise WorkloadError(f"{path}:{lineno}: the trace holds {total:,} tokens up to this line, "
                                        f"more than {MAX_TRACE_TOKENS:,} (use --num-requests on a shorter file)")
                records.append((lineno, rec))
                if num_requests is not None and len(records) >= 4 * num_requests + 100_000:
                    # Keep memory bounded on a huge file: the first num_requests by arrival are among these
                    # only if the file is sorted, so sort and trim as we go.
                    records.sort(key=lambda r: r[1]["timestamp"])
                    del records[num_requests:]
                    total = sum(r["input_length"] + max(r["output_length"], 1) for _, r in records)
    except FileNotFoundError:
        raise WorkloadError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise WorkloadError(f"{path}: is a directory, not a JSONL file") from None
    except UnicodeDecodeError as e:
        raise WorkloadError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise WorkloadError(f"{path}: cannot read ({e.strerror or e})") from None
    if not records:
        raise WorkloadError(f"{path}: no requests (empty file)")
    records.sort(key=lambda rec: rec[1]["timestamp"])  # stable: file order for ties
    if num_requests is not None:
        records = records[:num_requests]
    return _trace_requests(records, seed)


def _parse_trace_line(path, lineno: int, line: str) -> dict:
    where = f"{path}:{lineno}"
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise WorkloadError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise WorkloadError(f"{where}: JSON nested too deeply") from None
    except ValueError as e:  # e.g. an integer literal past Python's digit limit
        raise WorkloadError(f"{where}: malformed JSON ({' '.join(str(e).split())[:120]})") from None
    if not isinstance(rec, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    for name in _TRACE_FIELDS:
        if name not in rec:
            raise WorkloadError(f"{where}: missing field {name!r} (need {', '.join(_TRACE_FIELDS)})")
    for name, low, high in (("timestamp", -MAX_TRACE_ID, MAX_TRACE_ID), ("input_length", 1, MAX_TRACE_LENGTH),
                            ("output_length", 0, MAX_TRACE_LENGTH)):
        v = rec[name]
        if isinstance(v, bool) or not isinstance(v, int):
            raise WorkloadError(f"{where}: {name}={_short(v)}, must be an int")
        if v < low:
            raise WorkloadError(f"{where}: {name}={_short(v)}, must be >= {low}")
        if v > high:
            raise WorkloadError(f"{where}: {name}={_short(v)}, must be <= {high}")
    ids = rec["hash_ids"]
    if not isinstance(ids, list):
        raise WorkloadError(f"{where}: hash_ids={_short(ids)}, must be a list of ints")
    want = math.ceil(rec["input_length"] / MOONCAKE_BLOCK_TOKENS)
    if len(ids) != want:
        raise WorkloadError(
            f"{where}: len(hash_ids)={len(ids)} but input_length={rec['input_length']} "
            f"needs ceil({rec['input_length']}/{MOONCAKE_BLOCK_TOKENS})={want}"
        )
    for i, h in enumerate(ids):
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= MAX_TRACE_ID:
            raise WorkloadError(f"{where}: hash_ids[{i}]={_short(h)}, must be an int in [0, {MAX_TRACE_ID}]")
    model = rec.get("model")
    if model is not None and (not isinstance(model, str) or "\0" in model
                              or not 1 <= len(model.encode("utf-8", "surrogatepass")) <= MAX_SALT_BYTES):
        raise WorkloadError(f"{where}: model={_short(model)}, must be a non-empty string of at most "
                            f"{MAX_SALT_BYTES} UTF-8 bytes without NUL, or null")
    salt = rec.get("cache_salt")
    if salt is not None and (not isinstance(salt, str)
                             or len(salt.encode("utf-8", "surrogatepass")) > MAX_SALT_BYTES):
        raise WorkloadError(f"{where}: cache_salt={_short(salt)}, must be a string of at most "
                            f"{MAX_SALT_BYTES} UTF-8 bytes, or null")
    prio = rec.get("retention_priority")
    if prio is not None and (isinstance(prio, bool) or not isinstance(prio, int) or not 0 <= prio <= 100):
        raise WorkloadError(f"{where}: retention_priority={_short(prio)}, must be an int in 0..100, or null")
    secs = rec.get("retention_seconds")
    if secs is not None and (isinstance(secs, bool) or not isinstance(secs, (int, float))
                             or not math.isfinite(secs) or secs <= 0):
        raise WorkloadError(f"{where}: retention_seconds={_short(secs)}, must be a number > 0, or null")
    return rec


def _short(v) -> str:
    """``repr(v)`` cut to 60 characters (a hostile value must not flood the error line)."""
    try:
        text = repr(v)
    except ValueError:  # an int past the str conversion limit
        text = f"<int of about {int(v.bit_length() * 0.30103)} digits>"
    return text if len(text) <= 60 else text[:57] + "..."


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, element-wise on uint64 (a bijection, wrapping arithmetic)."""
    x = x + _U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def _trace_tokens(seed: int, domain: int, keys, length: int, stride: int) -> np.ndarray:
    """int32 [len(keys) * length]: token ``j`` of key ``k`` is a pure function of
    ``(seed, domain, k * stride + j)``; distinct ``(k, j)`` with ``j < stride`` never share an input.

    Computed by one fused Numba loop (:func:`_mix_tokens`); :func:`_trace_tokens_numpy` is the
    same function in NumPy (the tests hold them equal)."""
    base = _splitmix64(np.array([seed * 2 + domain], dtype=_U64))[0]
    keys = np.asarray(keys, dtype=_U64)
    out = np.empty(keys.size * length, dtype=np.int32)
    _mix_tokens()(keys, length, _U64(stride), base, _U64(_TRACE_TOKEN_MOD), out)
    return out


def _trace_tokens_numpy(seed: int, domain: int, keys, length: int, stride: int) -> np.ndarray:
    """:func:`_trace_tokens` in plain NumPy (the definition)."""
    base = _splitmix64(np.array([seed * 2 + domain], dtype=_U64))[0]
    idx = np.asarray(keys, dtype=_U64)[:, None] * _U64(stride) + np.arange(length, dtype=_U64)
    mixed = _splitmix64(idx.ravel() ^ base)
    return (mixed % _U64(_TRACE_TOKEN_MOD) + _U64(1)).astype(np.int32)


def _mix_tokens():
    """The Numba kernel behind :func:`_trace_tokens` (:mod:`kvcache._trace_kernels`, compiled on
    first use, cached on disk)."""
    from ._trace_kernels import mix_tokens

    return mix_tokens


def _trace_requests(records: list[tuple[int, dict]], seed: int) -> list[Request]:
    """Every request of a parsed trace, each request's tokens made by one kernel call
    (:func:`_assemble_kernel`; the mapping of :func:`_trace_request`, which the tests hold equal).

    A request's prompt and output are views of one int32 buffer, prompt then output.
    """
    B = MOONCAKE_BLOCK_TOKENS
    n = len(records)
    n_in = np.fromiter((rec["input_length"] for _, rec in records), dtype=np.int64, count=n)
    n_out = np.fromiter((max(rec["output_length"], 1) for _, rec in records), dtype=np.int64, count=n)
    n_ids = np.fromiter((len(rec["hash_ids"]) for _, rec in records), dtype=np.int64, count=n)
    tail = n_in - B * (n_ids - 1)  # 1 .. 512 tokens in the last block
    # Spec (replay): a partial last block is private to the request, a full one keeps its id's tokens.
    n_shared = np.where(tail == B, n_ids, n_ids - 1)
    ids = np.fromiter((h for _, rec in records for h in rec["hash_ids"]), dtype=np.uint64, count=int(n_ids.sum()))
    first_id = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(n_ids, out=first_id[1:])
    bases = _splitmix64(np.array([seed * 2 + _DOMAIN_BLOCK, seed * 2 + _DOMAIN_PRIVATE], dtype=_U64))
    fill = _assemble_kernel()
    mod = _U64(_TRACE_TOKEN_MOD)
    reqs = []
    for i, (lineno, rec) in enumerate(records):
        # One buffer per request (prompt, then output): memory the allocator can recycle, unlike one
        # buffer for the whole trace (whose first touch costs a page fault per 4 KiB).
        p, o = int(n_in[i]), int(n_out[i])
        buf = np.empty(p + o, dtype=np.int32)
        fill(ids[first_id[i] : first_id[i] + n_shared[i]], np.uint64(lineno), p, o, bases[0], bases[1], mod, buf)
        reqs.append(Request(f"trace-{lineno:06d}", buf[:p], buf[p:], rec["timestamp"] / 1000.0,
                            rec.get("cache_salt"), rec.get("retention_priority"), rec.get("retention_seconds"),
                            rec.get("model")))
    return reqs


def _assemble_kernel():
    """The Numba kernel of :func:`_trace_requests` (:func:`kvcache._trace_kernels.assemble_request`:
    a request's shared blocks, its private tail and its outputs, the mapping of
    :func:`_trace_request`)."""
    from ._trace_kernels import assemble_request

    return assemble_request


def _trace_request(lineno: int, rec: dict, seed: int) -> Request:
    """One request of a trace, the definition of the token mapping (:func:`_trace_requests`
    makes every request at once, the same tokens)."""
    n_in, ids = rec["input_length"], rec["hash_ids"]
    tail = n_in - MOONCAKE_BLOCK_TOKENS * (len(ids) - 1)  # 1 .. 512 tokens in the last block
    # Spec (replay): a partial last block is private to the request (its id
    # never appears as a non-last block), a full one keeps its id's tokens.
    shared = ids if tail == MOONCAKE_BLOCK_TOKENS else ids[:-1]
    n_out = max(rec["output_length"], 1)
    # Private tokens: the partial tail, then the outputs, all keyed by the line.
    private = _trace_tokens(seed, _DOMAIN_PRIVATE, [lineno], MOONCAKE_BLOCK_TOKENS + n_out, 2**32)
    B = MOONCAKE_BLOCK_TOKENS
    prompt = _trace_tokens(seed, _DOMAIN_BLOCK, shared, B, B) if shared else private[:0]
    if tail != MOONCAKE_BLOCK_TOKENS:
        prompt = np.concatenate([prompt, private[:tail]])
    output = private[MOONCAKE_BLOCK_TOKENS:]
    return Request(f"trace-{lineno:06d}", prompt, output, rec["timestamp"] / 1000.0, rec.get("cache_salt"),
                   rec.get("retention_priority"), rec.get("retention_seconds"), rec.get("model"))


# --------------------------------------------------------------------------- retention


def with_retention(requests: Sequence[Request], *, shared_tokens: int = 512, priority: int = 80) -> list[Request]:
    """The workload with retention claims (``kvcache replay --retention``, spec/manager.md §14).

    A request that carries a claim (from the trace) keeps it. Any other request whose first
    ``shared_tokens`` prompt tokens (a system prompt) start the prompt of at least one other
    request gets ``retention_priority=priority``; the rest keep the default (no claim).
    """
    if isinstance(shared_tokens, bool) or not isinstance(shared_tokens, int) or shared_tokens < 1:
        raise ValueError(f"with_retention: shared_tokens={shared_tokens!r}, must be an int >= 1")
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 100:
        raise ValueError(f"with_retention: priority={priority!r}, must be an int in 0..100")
    counts: dict[bytes, int] = {}
    keys = []
    for r in requests:
        key = r.prompt[:shared_tokens].tobytes() if r.prompt.size >= shared_tokens else None
        keys.append(key)
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    out = []
    for r, key in zip(requests, keys):
        if r.retention or key is None or counts[key] < 2:
            out.append(r)
        else:
            out.append(dataclasses.replace(r, retention_priority=priority))
    return out


def without_retention(requests: Sequence[Request]) -> list[Request]:
    """The workload with every retention claim dropped (plain LRU)."""
    return [dataclasses.replace(r, retention_priority=None, retention_seconds=None) if r.retention else r
            for r in requests]
