"""Per-request state of the request manager, and its transfers (spec/manager.md §2, §4, §9).

``_Request``: what the manager keeps for a claimed context (its rows per leaf,
its hash chain, how far it is committed, where it stands in the external
stage of its admission); ``_Load`` / ``_Offload``: transfers in flight;
``_AllocPlan``: what an ``alloc`` will do, decided before anything changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvspec._manager_types import TextContext

__all__ = ["_Request", "_Load", "_Offload", "_AllocPlan"]


@dataclass(eq=False)
class _Load:
    """An onload in flight: pages pinned, published only when it lands. A record is compared by
    identity (``list.remove`` of one load never compares fields, or another load's token arrays)."""

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


@dataclass(eq=False)
class _Offload:
    """An offload in flight: its source pages are pinned until it completes (compared by identity)."""

    replica: int
    pages: list[int]
    handle: Any
    leaf_pages: dict[str, list[int]] | None = None  # several leaves (spec/manager.md §9.8): leaf -> pinned pages


class _Request:
    """Per-request state of a claimed context.

    Its lifecycle (:attr:`phase`) is one of ``"dummy"`` (a padding row,
    spec/manager.md §7.2), ``"admitting"`` (no pages yet, or the external stage
    of its admission still due: ``ext_point``, a deferred ``lookup`` or
    ``lookup_pending``, spec/manager.md §9.3), ``"loading"`` (a load of its
    own in flight, or failed and not yet undone, spec/manager.md §9.6) and
    ``"running"`` (admitted, nothing in flight: a forward only grows its rows
    and a step only commits). ``settled`` is true exactly outside ``"dummy"``,
    ``"loading"`` and the admission's flags: it is kept by the setters of those
    fields, so the decode paths read one attribute instead of five.
    """

    __slots__ = ("ctx", "replica", "rows", "_dummy", "hashes", "committed", "nulled", "restore", "_ext_point",
                 "_lookup", "_lookup_pending", "skip_connector", "_load", "stepped_during_load", "ran_past",
                 "step_gen", "counted_gen", "counted_active", "settled", "shared_floor")

    def __init__(self, ctx: TextContext, replica: int, rows: dict[str, list[int]], dummy: bool = False):
        self.ctx = ctx
        self.replica = replica
        self.rows = rows
        self.hashes: list[bytes] = []
        self.committed = 0  # leading row blocks published (or loading)
        # spec/manager.md §19: tokens below which the rows hold pages shared with a fork (never rewound into)
        self.shared_floor = 0
        self.nulled: dict[str, int] = {}  # sliding: leading null slots
        self.restore: dict[str, int] = {}  # recurrent: checkpoint page to resume from
        self.skip_connector = False
        self.stepped_during_load = False
        self.ran_past = False
        self.step_gen = 0
        self.counted_gen = -1
        self.counted_active = 0
        self._dummy = dummy
        self._ext_point = False  # the external stage may still run for this admission
        self._lookup: tuple[int, int] | None = None  # (first block, blocks held) from start_lookup
        self._lookup_pending = False  # a deferred alloc left the external stage to do
        self._load: _Load | None = None
        self.settled = not dummy

    def count_forward(self, active: int) -> int:
        """The input tokens an ``alloc`` adds for the forward it sizes, ``active`` tokens wide
        (spec/manager.md §4.9): a forward is counted once however often ``alloc`` sizes it, so a
        repeated ``alloc`` before the same step adds only the difference."""
        if self.counted_gen == self.step_gen:
            n = active - self.counted_active
        else:
            n = active
            self.counted_gen = self.step_gen
        self.counted_active = active
        return n

    def end_admission(self) -> None:
        """The first ``step`` after an admission: the admission's flags (``ext_point``, a held
        ``lookup``, ``lookup_pending``) cleared, each write only where one is set (spec/manager.md §2,
        §9.3)."""
        if self._ext_point or self._lookup is not None or self._lookup_pending:
            self._ext_point, self._lookup, self._lookup_pending = False, None, False
            self._settle()

    def _settle(self) -> None:
        self.settled = not (self._dummy or self._load is not None or self._ext_point or self._lookup is not None
                            or self._lookup_pending)

    @property
    def phase(self) -> str:
        """``"dummy"``, ``"loading"``, ``"admitting"`` or ``"running"`` (see the class doc)."""
        if self._dummy:
            return "dummy"
        if self._load is not None:
            return "loading"
        if not self.settled or not any(self.rows.values()):
            return "admitting"
        return "running"

    @property
    def dummy(self) -> bool:
        return self._dummy

    @property
    def ext_point(self) -> bool:
        return self._ext_point

    @ext_point.setter
    def ext_point(self, value: bool) -> None:
        self._ext_point = value
        self._settle()

    @property
    def lookup(self) -> tuple[int, int] | None:
        return self._lookup

    @lookup.setter
    def lookup(self, value: tuple[int, int] | None) -> None:
        self._lookup = value
        self._settle()

    @property
    def lookup_pending(self) -> bool:
        return self._lookup_pending

    @lookup_pending.setter
    def lookup_pending(self, value: bool) -> None:
        self._lookup_pending = value
        self._settle()

    @property
    def load(self) -> _Load | None:
        return self._load

    @load.setter
    def load(self, value: _Load | None) -> None:
        self._load = value
        self._settle()

    def __repr__(self) -> str:
        return (f"_Request({self.ctx.request_id if self.ctx is not None else None!r}, replica={self.replica}, "
                f"phase={self.phase!r}, committed={self.committed})")


class _AllocPlan:
    """What ``alloc`` will do, decided before anything changes (spec/manager.md §4)."""

    __slots__ = ("undo_load", "splice", "local", "k", "hashes", "rows", "nulled", "restore", "peer", "need",
                 "lookup_pending", "ext_ran", "load", "load_done", "load_failed", "drawn", "leaf_peer",
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
        # spec/manager.md §9.8: leaf -> the pages the sizing will draw, predicted when a load was posted
        # into them (the sizing checks it draws exactly those)
        self.drawn: dict[str, list[int]] | None = None
        # spec/manager.md §7.3 with several leaves: (leaf, block) -> (source replica, source page), the
        # row slot is None until the sizing draws its page; recurrent leaf -> (source replica, checkpoint)
        self.leaf_peer: dict[tuple[str, int], tuple[int, int]] = {}
        self.restore_peer: dict[str, tuple[int, int]] = {}
