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


class ExtendedResidency:
    """Residency of one leaf's blocks from a further source (spec/manager.md §3.2 applied to
    device + tiers in spec/manager.md §9.3, local + peer replicas in spec/manager.md §7.3), asked lazily
    and memoised.

    Blocks below ``k0`` count as held (the request's rows hold them); block ``i >= k0``
    when ``ask(i)`` is true. ``run_from(k0, k)``, when given, answers the held run of
    blocks ``k0 .. k-1`` in one call (a tier's batched lookup).
    """

    __slots__ = ("k0", "_ask", "_run_from", "_memo")

    def __init__(self, k0: int, ask, run_from=None):
        self.k0, self._ask, self._run_from = k0, ask, run_from
        self._memo: dict[int, bool] = {}

    def __call__(self, i: int) -> bool:
        if i < self.k0:
            return True
        got = self._memo.get(i)
        if got is None:
            got = self._memo[i] = bool(self._ask(i))
        return got

    def run(self, k: int) -> int:
        """The held run from the root, at most ``k`` blocks."""
        if k <= self.k0:
            return k
        if self._run_from is not None:
            return min(k, self.k0 + self._run_from(self.k0, k))
        j = self.k0
        while j < k and self(j):
            j += 1
        return j


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
    def tier_tag(self) -> bytes:
        """The leaf's name and layout in its tier keys (spec/tiers.md §12)."""
        sp = self.spec
        return (f"{self.leaf_id}|{self.kind.value}|{sp.window}|{','.join(map(str, sp.state_shape))}|"
                f"{sp.state_dtype}").encode()

    def needed_blocks(self, k0: int, k: int) -> list[int]:
        """Blocks past ``k0`` this leaf must hold for a hit of ``k`` blocks (spec/manager.md §3.2):
        full ``k0 .. k-1``; sliding the window's part of them; recurrent the checkpoint ``k-1``."""
        if k <= k0:
            return []
        if self.is_recurrent:
            return [k - 1]
        return list(range(max(k0, self.window_start(k)), k))

    @property
    def is_recurrent(self) -> bool:
        return self.kind is LeafKind.RECURRENT

    @property
    def is_sliding(self) -> bool:
        return self.kind is LeafKind.SLIDING_WINDOW

    def window_start(self, k: int) -> int:
        """First row index a sliding leaf still needs when ``k`` blocks are processed."""
        return max(0, k - self.blocks_in_window) if self.is_sliding else 0

    def pages_to_hold(self, max_seq_len: int) -> int:
        """Pages of this leaf one request of ``max_seq_len`` tokens must hold at once (spec/manager.md §1.6).

        Full: ``ceil(max_seq_len / page_size)``; sliding: the window's pages plus the
        current one once the slots below it are nulled, ``min(ceil(max_seq_len /
        page_size), biw + 1)`` (a prefill chunked at the window); recurrent: 1.
        """
        if self.is_recurrent:
            return 1
        n = math.ceil(max_seq_len / self.page_size)
        return min(n, self.blocks_in_window + 1) if self.is_sliding else n

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
    break another's window, so iterate until all accept one length. Each leaf starts from
    the length the leaves before it accepted (full leaves first: one batched run), which
    reaches the same fixed point (the longest length every leaf accepts) with fewer
    residency questions, each a tier lookup in spec/manager.md §9.8.
    """
    order = sorted(leaves, key=lambda leaf: (leaf.kind is not LeafKind.FULL, leaf.is_recurrent))
    k = cap
    while True:
        k2 = k
        for leaf in order:
            k2 = leaf.best(k2, resident[leaf.leaf_id])
        if k2 == k:
            return k
        k = k2
