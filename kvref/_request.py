"""Per-request state of the request manager, and its transfers (spec/manager.md §2, §4, §9).

``_Request``: what the manager keeps for a claimed context (its rows per leaf,
its hash chain, how far it is committed, where it stands in the external
stage of its admission); ``_Load`` / ``_Offload``: transfers in flight;
``_AllocPlan``: what an ``alloc`` will do, decided before anything changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvspec._manager_types import TextContext

__all__ = ["_Request", "_Load", "_Offload", "_AllocPlan"]


@dataclass
class _Load:
    """An onload in flight: pages pinned, published only when it lands."""

    replica: int
    request_id: str | None  # None once the request was released
    start: int  # row index of the first loaded block
    pages: list[int]
    hashes: list[bytes]
    tokens: np.ndarray  # int32 [n, page_size]
    handle: Any
    state: str = "pending"  # "pending" | "landed" | "failed"
    error: BaseException | None = None
    # spec/manager.md §9.8 (several leaves): leaf -> destination pages, and the block index of each;
    # ``pages`` is then empty and ``nblocks`` the blocks the load adds to the hit.
    leaf_pages: dict[str, list[int]] | None = None
    leaf_blocks: dict[str, list[int]] | None = None
    nblocks: int = 0

    @property
    def blocks(self) -> int:
        """Blocks the load adds to the request's hit."""
        return self.nblocks if self.leaf_pages is not None else len(self.pages)


@dataclass
class _Offload:
    """An offload in flight: its source pages are pinned until it completes."""

    replica: int
    pages: list[int]
    handle: Any
    leaf_pages: dict[str, list[int]] | None = None  # several leaves (spec/manager.md §9.8): leaf -> pinned pages


@dataclass
class _Request:
    """Per-request state of a claimed context."""

    ctx: TextContext
    replica: int
    rows: dict[str, list[int]]
    dummy: bool = False
    hashes: list[bytes] = field(default_factory=list)
    committed: int = 0  # leading row blocks published (or loading)
    nulled: dict[str, int] = field(default_factory=dict)  # sliding: leading null slots
    restore: dict[str, int] = field(default_factory=dict)  # recurrent: checkpoint page to resume from
    ext_point: bool = False  # the external stage may still run for this admission
    lookup: tuple[int, int] | None = None  # (first block, blocks held) from start_lookup
    lookup_pending: bool = False  # a deferred alloc left the external stage to do
    skip_connector: bool = False
    load: _Load | None = None
    stepped_during_load: bool = False
    ran_past: bool = False
    step_gen: int = 0
    counted_gen: int = -1
    counted_active: int = 0


class _AllocPlan:
    """What ``alloc`` will do, decided before anything changes (spec/manager.md §4)."""

    __slots__ = ("undo_load", "splice", "local", "k", "hashes", "rows", "nulled", "restore", "peer", "need",
                 "lookup_pending", "ext_ran", "load", "load_done", "load_failed", "tier_hit", "leaf_peer",
                 "restore_peer")

    def __init__(self):
        self.undo_load = self.splice = self.lookup_pending = self.ext_ran = False
        self.load_done = self.load_failed = False
        self.local = self.k = 0
        self.hashes: list[bytes] = []
        self.rows: dict[str, list[int]] = {}  # paged leaf -> spliced row
        self.nulled: dict[str, int] = {}
        self.restore: dict[str, int] = {}  # recurrent leaf -> checkpoint page
        self.peer: dict[int, tuple[int, int]] = {}  # block index -> (source replica, source page)
        self.need: dict[str, int] = {}  # leaf -> pages the sizing draws
        self.load: _Load | None = None
        # spec/manager.md §9.8: (first block, blocks) the tiers add, held for a second round that posts
        # the load once the sizing has drawn its pages
        self.tier_hit: tuple[int, int] | None = None
        # spec/manager.md §7.3 with several leaves: (leaf, block) -> (source replica, source page), the
        # row slot is None until the sizing draws its page; recurrent leaf -> (source replica, checkpoint)
        self.leaf_peer: dict[tuple[str, int], tuple[int, int]] = {}
        self.restore_peer: dict[str, tuple[int, int]] = {}
