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

import json
import math
import os
from dataclasses import dataclass

import numpy as np

from kvspec._config import check_int

__all__ = [
    "Request",
    "WorkloadError",
    "MOONCAKE_BLOCK_TOKENS",
    "synthetic_workload",
    "read_mooncake_trace",
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
    """

    request_id: str
    prompt: np.ndarray
    output: np.ndarray
    arrival: float
    cache_salt: str | None = None

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
    (the answers are the previous turns' outputs); one session in ten asks
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
    for i, (t, sid, k) in enumerate(events[:num_requests]):
        s = sessions[sid]
        parts = list(s["head"])
        for j in range(k):
            parts += [s["q"][j], s["a"][j]]
        parts.append(s["q"][k])
        out.append(Request(f"chat-{i:05d}-s{sid}-t{k}", np.concatenate(parts), s["a"][k], t))
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
    string of at most 1024 UTF-8 bytes, or null). The whole trace holds at most
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
    return [_trace_request(lineno, rec, seed) for lineno, rec in records]


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
    salt = rec.get("cache_salt")
    if salt is not None and (not isinstance(salt, str)
                             or len(salt.encode("utf-8", "surrogatepass")) > MAX_SALT_BYTES):
        raise WorkloadError(f"{where}: cache_salt={_short(salt)}, must be a string of at most "
                            f"{MAX_SALT_BYTES} UTF-8 bytes, or null")
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


_MIX = None


def _mix_tokens():
    """The Numba kernel behind :func:`_trace_tokens` (compiled on first use, cached on disk)."""
    global _MIX
    if _MIX is None:
        import numba

        @numba.njit(cache=True, nogil=True)
        def mix(keys, length, stride, base, mod, out):  # pragma: no cover - compiled
            one = np.uint64(1)
            c0 = np.uint64(0x9E3779B97F4A7C15)
            c1 = np.uint64(0xBF58476D1CE4E5B9)
            c2 = np.uint64(0x94D049BB133111EB)
            s30, s27, s31 = np.uint64(30), np.uint64(27), np.uint64(31)
            pos = 0
            for a in range(keys.size):
                k = keys[a] * stride
                for j in range(length):
                    x = ((k + np.uint64(j)) ^ base) + c0
                    x = (x ^ (x >> s30)) * c1
                    x = (x ^ (x >> s27)) * c2
                    x = x ^ (x >> s31)
                    out[pos] = np.int32(x % mod + one)
                    pos += 1

        _MIX = mix
    return _MIX


def _trace_request(lineno: int, rec: dict, seed: int) -> Request:
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
    return Request(f"trace-{lineno:06d}", prompt, output, rec["timestamp"] / 1000.0, rec.get("cache_salt"))
