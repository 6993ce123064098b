"""The infinite-cache hit ceiling of a workload (what no cache can beat).

Replay the requests in arrival order through an unbounded set of chained
block hashes (``kvspec.hashing``), under the manager's own reuse rules
(DESIGN §5):

* whole pages only: a request can reuse at most ``(P - 1) // page_size``
  pages of its ``P``-token prompt (the last prompt token is never reused, so
  a 100 % hit is impossible);
* a hit is the longest leading run of pages already seen;
* a page is reusable once committed: a finished request has committed every
  full page of its first ``P + O - 1`` tokens (prompt, then its ``O``
  outputs; the last sampled token is never processed), and all of them join
  the set.

A real cache can only do worse: it evicts, it serves a request before the
requests ahead of it have finished, and it counts only pages committed so
far. With an unbounded pool and one request in flight it does exactly this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import xxhash

from kvspec._config import check_int
from kvspec.hashing import block_hashes

from .workload import Request

__all__ = ["Ceiling", "infinite_cache_ceiling"]


@dataclass(frozen=True, slots=True)
class Ceiling:
    """The infinite-cache bound of a workload.

    Attributes
    ----------
    page_size : int
    prompt_tokens : int
        Sum of the prompt lengths.
    hit_tokens : int
        Sum of the reusable prompt tokens (``hit_pages * page_size`` per request).
    per_request : int64 [num_requests]
        Reusable prompt tokens of each request, in workload order.
    page_ids : list of int64 [(P + O - 1) // page_size], one per request
        An id per committed page of each request: equal ids mean equal
        chained hashes (the same tokens from the root), so ids stand in for
        hashes in :mod:`kvcache.attribution`. ``cache_salt`` is ignored here:
        the ceiling reuses identical tokens whatever the salt.
    """

    page_size: int
    prompt_tokens: int
    hit_tokens: int
    per_request: np.ndarray
    page_ids: list = field(default_factory=list, repr=False, compare=False)

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / prompt_tokens`` (0 for an empty workload)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def infinite_cache_ceiling(
    requests: Sequence[Request],
    page_size: int,
    *,
    hash_algo: str | None = None,
    hash_seed: int = 0,
) -> Ceiling:
    """Prefix hits of an unbounded cache over ``requests`` in order.

    Parameters
    ----------
    requests : sequence of Request
        The workload, in arrival order.
    page_size : int
        Tokens per page, >= 1.
    hash_algo, hash_seed
        With ``hash_algo`` (``"sha256"`` or ``"xxh3_128"``), pages are told
        apart by the chain of ``kvspec.hashing.block_hashes`` (the manager's
        own rule). Default (None): by a chain of page ids, page ``i``'s id
        keyed by page ``i - 1``'s id and the 128-bit xxh3 digest of its
        tokens, without building the hashes; the same ids up to a 128-bit
        collision (the tests hold the two equal). The hits depend on neither.

    Returns
    -------
    Ceiling

    Examples
    --------
    >>> import numpy as np
    >>> from kvcache.workload import Request
    >>> p = np.arange(1, 10, dtype=np.int32)
    >>> reqs = [Request("a", p, np.array([7], np.int32), 0.0), Request("b", p, np.array([7], np.int32), 1.0)]
    >>> c = infinite_cache_ceiling(reqs, 4)
    >>> c.per_request.tolist(), c.hit_rate
    ([0, 8], 0.4444444444444444)
    """
    check_int("infinite_cache_ceiling", "page_size", page_size, low=1)
    ids: dict[bytes, int] = {}
    seen = bytearray()  # seen[id]: committed by an earlier request
    per_request = np.zeros(len(requests), dtype=np.int64)
    page_ids = []
    prompt_tokens = 0
    for i, req in enumerate(requests):
        p, o = req.prompt_length, req.output_length
        prompt_tokens += p
        # spec/manager.md §5: pages committed by the end of the request cover its first
        # P + O - 1 tokens; the pages it may reuse cover at most P - 1.
        committed = (p + o - 1) // page_size
        reusable = (p - 1) // page_size
        if hash_algo is not None:
            tokens = np.concatenate([req.prompt, req.output])
            hashes = block_hashes(tokens, page_size, hash_algo, hash_seed=hash_seed, num_blocks=committed)
            mine = np.fromiter((ids.setdefault(h, len(ids)) for h in hashes), dtype=np.int64, count=len(hashes))
        else:
            mine = _page_ids(req, page_size, committed, ids)
        seen.extend(bytes(len(ids) - len(seen)))
        hit = 0
        while hit < reusable and seen[mine[hit]]:
            hit += 1
        per_request[i] = hit * page_size
        for j in mine.tolist():
            seen[j] = 1
        page_ids.append(mine)
    return Ceiling(page_size, prompt_tokens, int(per_request.sum()), per_request, page_ids)


def _page_ids(req: Request, page_size: int, committed: int, ids: dict) -> np.ndarray:
    """int64 [committed]: the id of each of the request's first ``committed`` pages, page ``i``'s
    keyed by ``(id of page i - 1, xxh3_128 of page i's int32 tokens)`` in ``ids`` (new keys get the
    next id); the digests read the token arrays in place."""
    digest = xxhash.xxh3_128_intdigest
    in_prompt = min(committed, req.prompt_length // page_size)
    data = np.ascontiguousarray(req.prompt[: in_prompt * page_size]).view(np.uint8).data
    step = 4 * page_size
    out = np.empty(committed, dtype=np.int64)
    parent = -1
    setdefault = ids.setdefault
    for k in range(in_prompt):
        parent = out[k] = setdefault((parent, digest(data[k * step : (k + 1) * step])), len(ids))
    if committed > in_prompt:  # pages that run into the output tokens
        rest = np.concatenate([req.prompt[in_prompt * page_size :], req.output]).view(np.uint8).data
        for k in range(committed - in_prompt):
            parent = out[in_prompt + k] = setdefault((parent, digest(rest[k * step : (k + 1) * step])), len(ids))
    return out
