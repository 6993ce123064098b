"""Per-leaf rules of the request manager: hit acceptance and sizing (spec/manager.md §3, §4).

A leaf is one kind of page with its own pool per replica. Every full and
sliding-window leaf keeps a row of block ids of equal length (index ``i``
holds tokens ``[i*page, (i+1)*page)`` in every leaf); a recurrent leaf keeps
``[live]`` or ``[live, successor]``.
"""

from __future__ import annotations

import math
from typing import Callable

from kvspec import LeafKind, LeafSpec

__all__ = ["Leaf", "joint_hit"]


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
        # Spec §3.2: the query token is inside its own window, so the hit needs
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

    def best(self, k: int, resident: Callable[[int], bool]) -> int:
        """The longest hit ``j <= k`` (in blocks) this leaf accepts.

        ``resident(i)``: the leaf holds a page published under hash ``h_i``
        with block ``i``'s tokens.
        """
        if self.kind is LeafKind.FULL:
            # Spec §3.2 full: the resident run from the root.
            for i in range(k):
                if not resident(i):
                    return i
            return k
        if self.is_sliding:
            # Spec §3.2 sliding: a complete resident window before the stop
            # (a resident root run when the stop is inside the first window).
            for j in range(k, 0, -1):
                if all(resident(i) for i in range(self.window_start(j), j)):
                    return j
            return 0
        # Spec §3.2 recurrent: the deepest boundary holding a state checkpoint.
        for j in range(k, 0, -1):
            if resident(j - 1):
                return j
        return 0


def joint_hit(leaves: list[Leaf], cap: int, resident: dict[str, Callable[[int], bool]]) -> int:
    """The fixed point of the leaves' rules: the longest hit ``<= cap`` every leaf accepts.

    Spec §3.2: not the minimum of the per-leaf hits; narrowing one leaf can
    break another's window, so iterate until all accept one length.
    """
    k = cap
    while True:
        k2 = min(leaf.best(k, resident[leaf.leaf_id]) for leaf in leaves)
        if k2 == k:
            return k
        k = k2
