"""Per-leaf rules of the request manager: hit acceptance and sizing (spec/manager.md §3, §4).

A leaf is one kind of page with its own pool per replica. Every full and
sliding-window leaf keeps a row of block ids of equal length (index ``i``
holds tokens ``[i*page, (i+1)*page)`` in every leaf); a recurrent leaf keeps
``[live]`` or ``[live, successor]``.
"""

from __future__ import annotations

import math
import numpy as np

from kvspec import LeafKind, LeafSpec


class Residency:
    """Which blocks of one chain a leaf's pool holds (spec/manager.md §3.2), asked lazily.

    ``residency(i)``: the pool holds a page published under ``h_i`` whose stored tokens
    are block ``i``'s; :meth:`page` is that page (or None); :meth:`run` the resident run
    from the root (one ``lookup_run`` of the pool). Answers are memoised: one lookup per
    block at most.

    Parameters
    ----------
    pool : kvspec.engine.BlockPool
    hashes : list of bytes
        The chain ``h_0 ..``.
    tokens : int32 [>= len(hashes) * page_size]
        The context's tokens.
    page_size : int
    """

    __slots__ = ("pool", "hashes", "tokens", "page_size", "_pages", "_run", "_run_cap")

    def __init__(self, pool, hashes: list[bytes], tokens: np.ndarray, page_size: int):
        self.pool, self.hashes, self.tokens, self.page_size = pool, hashes, tokens, page_size
        self._pages: dict[int, int | None] = {}
        self._run: list[int] = []
        self._run_cap = 0  # the run was looked up for this many blocks

    def page(self, i: int) -> int | None:
        """The page holding block ``i``, else None."""
        if i < len(self._run):
            return self._run[i]
        if i not in self._pages:
            p = self.page_size
            self._pages[i] = self.pool.lookup(self.hashes[i], self.tokens[i * p : (i + 1) * p])
        return self._pages[i]

    def __call__(self, i: int) -> bool:
        return self.page(i) is not None

    def run(self, k: int) -> int:
        """The resident run from the root, at most ``k`` blocks (one batched lookup)."""
        if k > self._run_cap and len(self._run) == self._run_cap:
            self._run = self.pool.lookup_run(self.hashes[:k], self.tokens[: k * self.page_size])
            self._run_cap = k
        return min(k, len(self._run))

    def pages(self, lo: int, k: int) -> list[int]:
        """The pages of blocks ``lo .. k-1`` (all resident)."""
        if k <= len(self._run):
            return self._run[lo:k]
        return [self.page(i) for i in range(lo, k)]


class Leaf:
    """One leaf's geometry and prefix-hit rule.

    Parameters
    ----------
    leaf_id : str
    spec : LeafSpec
    page_size : int
    """

    __slots__ = ("leaf_id", "spec", "kind", "page_size", "blocks_in_window")

    def __init__(self, leaf_id: str, spec: LeafSpec, page_size: int):
        self.leaf_id = leaf_id
        self.spec = spec
        self.kind = spec.kind
        self.page_size = page_size
        # spec/manager.md §3.2: the query token is inside its own window, so the hit needs
        # the last window-1 tokens before it: ceil((window-1)/page) blocks.
        self.blocks_in_window = math.ceil((spec.window - 1) / page_size) if spec.kind is LeafKind.SLIDING_WINDOW else 0

    @property
    def is_recurrent(self) -> bool:
        return self.kind is LeafKind.RECURRENT

    @property
    def is_sliding(self) -> bool:
        return self.kind is LeafKind.SLIDING_WINDOW

    def window_start(self, k: int) -> int:
        """First row index a sliding leaf still needs when ``k`` blocks are processed."""
        return max(0, k - self.blocks_in_window) if self.is_sliding else 0

    def best(self, k: int, resident: "Residency") -> int:
        """The longest hit ``j <= k`` (in blocks) this leaf accepts.

        ``resident(i)``: the leaf holds a page published under hash ``h_i``
        with block ``i``'s tokens; ``resident.run(k)``: the resident run from the root.
        """
        if self.kind is LeafKind.FULL:
            # spec/manager.md §3.2 full: the resident run from the root.
            return resident.run(k)
        if self.is_sliding:
            # spec/manager.md §3.2 sliding: a complete resident window before the stop
            # (a resident root run when the stop is inside the first window).
            for j in range(k, 0, -1):
                if all(resident(i) for i in range(self.window_start(j), j)):
                    return j
            return 0
        # spec/manager.md §3.2 recurrent: the deepest boundary holding a state checkpoint.
        for j in range(k, 0, -1):
            if resident(j - 1):
                return j
        return 0


def joint_hit(leaves: list[Leaf], cap: int, resident: dict[str, "Residency"]) -> int:
    """The fixed point of the leaves' rules: the longest hit ``<= cap`` every leaf accepts.

    spec/manager.md §3.2: not the minimum of the per-leaf hits; narrowing one leaf can
    break another's window, so iterate until all accept one length.
    """
    k = cap
    while True:
        k2 = min(leaf.best(k, resident[leaf.leaf_id]) for leaf in leaves)
        if k2 == k:
            return k
        k = k2
