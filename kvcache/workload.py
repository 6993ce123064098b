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

# Trace tokens are drawn from the whole positive int32 range, so two different
# hash ids never agree on a leading token by chance (prefix identity at page size 1).
_TRACE_TOKEN_HIGH = 2**31 - 1

# SeedSequence domains: shared blocks vs tokens private to one request.
_DOMAIN_BLOCK = 0
_DOMAIN_PRIVATE = 1


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
    """

    request_id: str
    prompt: np.ndarray
    output: np.ndarray
    arrival: float

    @property
    def prompt_length(self) -> int:
        return int(self.prompt.size)

    @property
    def output_length(self) -> int:
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


def read_mooncake_trace(path: str | os.PathLike, *, num_requests: int | None = None, seed: int = 0) -> list[Request]:
    """Read a Mooncake JSONL trace into requests.

    Every line is a JSON object with ``timestamp`` (int, ms), ``input_length``
    (int >= 1), ``output_length`` (int >= 0) and ``hash_ids`` (list of int >= 0,
    ``len == ceil(input_length / 512)``). Requests are ordered by timestamp,
    file order for ties.

    Token mapping (the spec decision, see ``docs/replay.md``): hash id ``h``
    becomes 512 token ids drawn from ``SeedSequence([seed, 0, h])``; a full
    last block does too; a partial last block, and the output tokens, are
    drawn from ``SeedSequence([seed, 1, line])`` and so are unique to the
    request. A request generates ``max(output_length, 1)`` tokens (a prefill
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
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                records.append((lineno, _parse_trace_line(path, lineno, line)))
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
    blocks: dict[int, np.ndarray] = {}
    return [_trace_request(lineno, rec, seed, blocks) for lineno, rec in records]


def _parse_trace_line(path, lineno: int, line: str) -> dict:
    where = f"{path}:{lineno}"
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise WorkloadError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(rec, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    for name in _TRACE_FIELDS:
        if name not in rec:
            raise WorkloadError(f"{where}: missing field {name!r} (need {', '.join(_TRACE_FIELDS)})")
    for name, low in (("timestamp", None), ("input_length", 1), ("output_length", 0)):
        v = rec[name]
        if isinstance(v, bool) or not isinstance(v, int):
            raise WorkloadError(f"{where}: {name}={v!r}, must be an int")
        if low is not None and v < low:
            raise WorkloadError(f"{where}: {name}={v}, must be >= {low}")
    ids = rec["hash_ids"]
    if not isinstance(ids, list):
        raise WorkloadError(f"{where}: hash_ids={ids!r}, must be a list of ints")
    for i, h in enumerate(ids):
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise WorkloadError(f"{where}: hash_ids[{i}]={h!r}, must be an int >= 0")
    want = math.ceil(rec["input_length"] / MOONCAKE_BLOCK_TOKENS)
    if len(ids) != want:
        raise WorkloadError(
            f"{where}: len(hash_ids)={len(ids)} but input_length={rec['input_length']} "
            f"needs ceil({rec['input_length']}/{MOONCAKE_BLOCK_TOKENS})={want}"
        )
    return rec


def _trace_block(seed: int, hash_id: int, cache: dict[int, np.ndarray]) -> np.ndarray:
    block = cache.get(hash_id)
    if block is None:
        rng = np.random.default_rng(np.random.SeedSequence([seed, _DOMAIN_BLOCK, hash_id]))
        block = rng.integers(1, _TRACE_TOKEN_HIGH, size=MOONCAKE_BLOCK_TOKENS, dtype=np.int32)
        cache[hash_id] = block
    return block


def _trace_request(lineno: int, rec: dict, seed: int, cache: dict[int, np.ndarray]) -> Request:
    n_in, ids = rec["input_length"], rec["hash_ids"]
    tail = n_in - MOONCAKE_BLOCK_TOKENS * (len(ids) - 1)  # 1 .. 512 tokens in the last block
    # Spec (replay): a partial last block is private to the request (its id
    # never appears as a non-last block), a full one keeps its id's tokens.
    shared = ids if tail == MOONCAKE_BLOCK_TOKENS else ids[:-1]
    private = np.random.default_rng(np.random.SeedSequence([seed, _DOMAIN_PRIVATE, lineno]))
    parts = [_trace_block(seed, h, cache) for h in shared]
    if tail != MOONCAKE_BLOCK_TOKENS:
        parts.append(private.integers(1, _TRACE_TOKEN_HIGH, size=tail, dtype=np.int32))
    output = private.integers(1, _TRACE_TOKEN_HIGH, size=max(rec["output_length"], 1), dtype=np.int32)
    return Request(f"trace-{lineno:06d}", np.concatenate(parts), output, rec["timestamp"] / 1000.0)

