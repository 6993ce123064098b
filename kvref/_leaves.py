"""Per-leaf rules of the request manager: hits, sizing and commits (spec/manager.md §3, §4, §5).

A leaf is one kind of page with its own pool per replica. Every full and
sliding-window leaf keeps a row of block ids of equal length (index ``i``
holds tokens ``[i*page, (i+1)*page)`` in every leaf); a recurrent leaf keeps
``[live]`` or ``[live, successor]``.

Each kind is a class (:class:`FullLeaf`, :class:`SlidingWindowLeaf`,
:class:`RecurrentLeaf`, built by :meth:`Leaf.make`) holding its rules, so the
policy in ``kvref._manager`` asks the leaf and never branches on its kind.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from kvspec import LeafKind, LeafSpec
from kvspec._dtypes import STATE_DTYPES
from kvspec._manager_types import LUT_ALIGN, KVCacheParams
from kvspec.engine import NULL_BLOCK, BlockPool

if TYPE_CHECKING:
    from ._request import _AllocPlan, _Load, _Request


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

    def span(self, lo: int, k: int) -> int:
        """How many blocks from ``lo`` on, at most ``k - lo``, are resident in a row: the
        blocks already answered, then one ``lookup_run`` over the rest (which stops where
        ``lookup`` would first miss; the pages found and that miss are memoised)."""
        i = lo
        pages, run = self._pages, self._run
        while i < k:
            if i < len(run):
                i += 1
                continue
            if i not in pages:
                break
            if pages[i] is None:
                return i - lo
            i += 1
        if i < k:
            p = self.page_size
            found = self.pool.lookup_run(self.hashes[i:k], self.tokens[i * p : k * p])
            for j, b in enumerate(found):
                pages[i + j] = b
            i += len(found)
            if i < k:
                pages[i] = None
        return i - lo

    def deepest(self, k: int) -> int:
        """The largest ``j <= k`` whose block ``j - 1`` is resident, else 0: the pool names the
        deepest indexed hash below ``j`` (one batched probe, :meth:`BlockPool.last_indexed`),
        whose tokens are then verified; a hash held by other tokens (a collision) moves the
        search below it. A scan over a long chain without a checkpoint costs one probe per
        block, not a ``lookup`` each."""
        j = k
        while j > 0:
            i = self.pool.last_indexed(self.hashes, j)
            if i < 0:
                return 0
            if self(i):
                return i + 1
            j = i
        return 0

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

    def span(self, lo: int, k: int) -> int:
        """How many blocks from ``lo`` on, at most ``k - lo``, are held in a row."""
        i = lo
        while i < k and self(i):
            i += 1
        return i - lo

    def deepest(self, k: int) -> int:
        """The largest ``j <= k`` whose block ``j - 1`` is held, else 0."""
        for j in range(k, 0, -1):
            if self(j - 1):
                return j
        return 0

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


class Leaf(ABC):
    """One leaf's geometry and rules, the base of the three leaf kinds (spec/manager.md §3.2, §4.6, §5).

    The policy (``kvref._manager``) asks a leaf, never its kind: how many pages it needs to
    grow, which blocks a hit needs and which hit it accepts, where a hit's pages go, what
    its buffer and lookup-table column hold. :class:`FullLeaf`, :class:`SlidingWindowLeaf`
    and :class:`RecurrentLeaf` answer; build one with :meth:`Leaf.make`.

    Parameters
    ----------
    leaf_id : str
    spec : LeafSpec
        Its ``kind`` must be the class's ``KIND``.
    page_size : int

    Attributes
    ----------
    KIND : LeafKind
        The kind of ``LeafSpec`` the class serves.
    is_recurrent, is_sliding : bool
        The kind, as class attributes (for readers outside the policy).
    hit_order : int
        Where ``joint_hit`` asks the leaf: full leaves first (one batched run), then
        sliding, then recurrent.
    binds_rows : bool
        ``runtime_inputs`` of the leaf needs at least one row (spec/manager.md §8 check 2).
    """

    __slots__ = ("leaf_id", "spec", "kind", "page_size", "blocks_in_window")

    KIND: LeafKind
    is_recurrent: bool = False
    is_sliding: bool = False
    hit_order: int = 0
    binds_rows: bool = False

    def __new__(cls, *args, **kwargs):
        if "KIND" not in cls.__dict__:
            raise TypeError(f"{cls.__name__} is the base of the leaf kinds; build a leaf with Leaf.make(leaf_id, "
                            "spec, page_size)")
        return super().__new__(cls)

    def __init__(self, leaf_id: str, spec: LeafSpec, page_size: int):
        if spec.kind is not self.KIND:
            raise ValueError(f"{type(self).__name__}: leaf {leaf_id!r} has kind {spec.kind.value!r}, the class "
                             f"serves {self.KIND.value!r}; build it with Leaf.make")
        self.leaf_id = leaf_id
        self.spec = spec
        self.kind = spec.kind
        self.page_size = page_size
        self.blocks_in_window = 0

    @staticmethod
    def make(leaf_id: str, spec: LeafSpec, page_size: int) -> Leaf:
        """The leaf of ``spec.kind``: a :class:`FullLeaf`, :class:`SlidingWindowLeaf` or :class:`RecurrentLeaf`.

        Parameters
        ----------
        leaf_id : str
        spec : LeafSpec
        page_size : int

        Returns
        -------
        Leaf
        """
        return _LEAF_CLASSES[spec.kind](leaf_id, spec, page_size)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.leaf_id!r}, {self.spec!r}, {self.page_size})"

    # ---------------------------------------------------------------- geometry

    @property
    def tier_tag(self) -> bytes:
        """The leaf's name and layout in its tier keys (spec/tiers.md §12)."""
        sp = self.spec
        return (f"{self.leaf_id}|{self.kind.value}|{sp.window}|{','.join(map(str, sp.state_shape))}|"
                f"{sp.state_dtype}").encode()

    @abstractmethod
    def dtype(self, params: KVCacheParams) -> np.dtype:
        """The dtype of the leaf's buffer: ``params.np_dtype`` for K/V pages, the state dtype for a state."""

    @abstractmethod
    def page_shape(self, params: KVCacheParams) -> tuple[int, ...]:
        """The shape of one page of the leaf's buffer (``params.page_shape``, or ``spec.state_shape``)."""

    def row_bytes(self, params: KVCacheParams) -> int:
        """Bytes of one row of a page, the last axis (spec/manager.md §13.1: a padded slab page stays a
        whole number of rows: ``head_dim`` elements, or the state's last axis)."""
        return self.dtype(params).itemsize * self.page_shape(params)[-1]

    @abstractmethod
    def tier_units(self, params: KVCacheParams, unit: int) -> int:
        """Tier units of ``unit`` bytes one page of the leaf takes (spec/tiers.md §12)."""

    # ---------------------------------------------------------------- sizing

    @abstractmethod
    def pages_to_hold(self, max_seq_len: int) -> int:
        """Pages of this leaf one request of ``max_seq_len`` tokens must hold at once (spec/manager.md §1.6).

        Full: ``ceil(max_seq_len / page_size)``; sliding: the window's pages plus the
        current one once the slots below it are nulled, ``min(ceil(max_seq_len /
        page_size), biw + 1)`` (a prefill chunked at the window); recurrent: 1.
        """

    def pages_to_admit(self, seq_len: int, caching: bool) -> int:
        """Pages of this leaf a request of ``seq_len`` tokens draws on an empty pool (spec/manager.md
        §13.5): :meth:`pages_to_hold`, or a state's live page and, with prefix caching, its successor."""
        return self.pages_to_hold(seq_len)

    def grow_need(self, have: int, required: int, caching: bool) -> int:
        """Pages the sizing draws for a row that holds ``have`` pages when the forward needs
        ``required`` blocks (spec/manager.md §4.6); negative: pages past the need (a paged row
        of a speculating request, spec/manager.md §15).

        Full/sliding: ``required - have``; recurrent: the live page when the row is empty, and
        with prefix caching a successor, ``(0 if have else 1) + (1 if caching and have < 2 else 0)``.
        """
        return required - have

    def fresh_states(self, row: list[int], drawn: int) -> list[int]:
        """Pages of ``row`` that start at zero after the sizing drew ``drawn`` pages into it
        (spec/manager.md §4.7: a fresh live state); none for K/V pages."""
        return []

    # ---------------------------------------------------------------- hits

    def window_start(self, k: int) -> int:
        """First row index a sliding leaf still needs when ``k`` blocks are processed (0 for the others)."""
        return 0

    @abstractmethod
    def needed_blocks(self, k0: int, k: int) -> list[int]:
        """Blocks past ``k0`` this leaf must hold for a hit of ``k`` blocks (spec/manager.md §3.2):
        full ``k0 .. k-1``; sliding the window's part of them; recurrent the checkpoint ``k-1``."""

    @abstractmethod
    def best(self, k: int, resident: Residency) -> int:
        """The longest hit ``j <= k`` (in blocks) this leaf accepts (spec/manager.md §3.2).

        ``resident(i)``: the leaf holds a page published under hash ``h_i``
        with block ``i``'s tokens; ``resident.run(k)``: the resident run from the root.
        """

    @abstractmethod
    def hit_pages(self, k: int, resident: Residency) -> list[int]:
        """The resident pages of :meth:`needed_blocks` ``(0, k)``, in block order (a local hit of ``k``)."""

    @abstractmethod
    def plan_hit(self, plan: _AllocPlan, k: int, pages: list[int | None]) -> None:
        """Put a hit of ``k`` blocks into ``plan`` (spec/manager.md §4.5): ``pages`` are the pages of
        :meth:`needed_blocks` ``(0, k)`` in block order, None where a peer copy fills it
        (spec/manager.md §7.3; ``plan.leaf_peer`` names the source)."""

    @abstractmethod
    def commit_hit(self, req: _Request, plan: _AllocPlan, pool: BlockPool, local: int) -> None:
        """Take the planned hit: touch its locally held pages below ``local`` and hand the request
        what :meth:`plan_hit` planned (spec/manager.md §4.5)."""

    def first_state_copy(self, row: list[int], pages: list[int], plan: _AllocPlan,
                         req: _Request) -> tuple | None:
        """The copy that fills the first of the sizing's ``pages`` when ``row`` was empty (spec/manager.md
        §4.7, §7.3): ``("restore", leaf_id, checkpoint or NULL_BLOCK, page)`` or ``("leafpeer", (leaf_id,
        source replica), source page, page)``; None for K/V pages (the forward writes them)."""
        return None

    # ---------------------------------------------------------------- tiers

    @abstractmethod
    def load_destinations(self, row: list[int], blocks: list[int]) -> list[int]:
        """The pages of ``row`` a tier load of ``blocks`` (:meth:`needed_blocks`) lands in
        (spec/manager.md §9.8)."""

    @abstractmethod
    def land_load(self, pool: BlockPool, row: list[int] | None, load: _Load, pages: list[int],
                  publish_or_twin: Callable[[BlockPool, int, bytes, np.ndarray], int]) -> None:
        """A landed tier load's ``pages`` of this leaf join the request (spec/manager.md §9.8); ``row``
        is the request's row, None when the request is gone."""

    def published_pages(self, pool: BlockPool, hashes: list[bytes], toks: np.ndarray,
                        flat: np.ndarray) -> list[tuple[int, int]]:
        """``(j, page)`` of the blocks of one committed run this leaf still publishes, for an offload
        (spec/manager.md §9.8): each block looked up on its own; ``toks`` int32 ``[n, page]``,
        ``flat`` the same tokens flat."""
        return [(j, b) for j, h in enumerate(hashes) if (b := pool.lookup(h, toks[j])) is not None]

    # ---------------------------------------------------------------- runtime inputs

    def row_width(self, blocks: int) -> int:
        """The row slots a forward of ``blocks`` blocks reads (spec/manager.md §8): ``blocks``, or the
        live state page."""
        return blocks

    def table_widths(self, widths: list[int]) -> list[int]:
        """The lookup-table entries of each row, given the rows' required blocks (spec/manager.md §8):
        :meth:`row_width` of each."""
        return widths

    def table_columns(self, columns: int) -> int:
        """The lookup table's column count, given the paged leaves' ``columns`` (spec/manager.md §8)."""
        return columns

    @abstractmethod
    def row_shortfall(self, row: list[int], reach: int, what: str) -> str | None:
        """Why ``row`` cannot serve a forward reaching ``reach`` tokens (``what`` names that length),
        the tail of ``runtime_inputs``'s message (spec/manager.md §8 check 3); None when it can."""

    # ---------------------------------------------------------------- invariants

    @abstractmethod
    def check_row(self, p: str, rid: str, row: list[int], nulled: dict[str, int]) -> int:
        """Assert the shape of a live ``row`` (``AssertionError`` prefixed ``p``); returns the first
        slot that must hold a live page."""

    @abstractmethod
    def committed_blocks(self, lo: int, committed: int) -> range:
        """The blocks below ``committed`` whose pages the row holds published, from slot ``lo``
        (spec/manager.md §10.4)."""


class _PagedLeaf(Leaf):
    """A leaf of K/V pages: a row of block ids, index ``i`` holding tokens ``[i*page, (i+1)*page)``."""

    __slots__ = ()

    def dtype(self, params: KVCacheParams) -> np.dtype:
        return params.np_dtype

    def page_shape(self, params: KVCacheParams) -> tuple[int, ...]:
        return params.page_shape

    def tier_units(self, params: KVCacheParams, unit: int) -> int:
        return 1  # a K/V page is the tiers' unit

    def needed_blocks(self, k0: int, k: int) -> list[int]:
        if k <= k0:
            return []
        return list(range(max(k0, self.window_start(k)), k))

    def hit_pages(self, k: int, resident: Residency) -> list[int]:
        return resident.pages(self.window_start(k), k)

    def plan_hit(self, plan: _AllocPlan, k: int, pages: list[int | None]) -> None:
        # spec/manager.md §5.3: sliding slots below the window are null
        lo = self.window_start(k)
        plan.rows[self.leaf_id], plan.nulled[self.leaf_id] = [NULL_BLOCK] * lo + pages, lo

    def commit_hit(self, req: _Request, plan: _AllocPlan, pool: BlockPool, local: int) -> None:
        lid = self.leaf_id
        row, lo = plan.rows[lid], plan.nulled[lid]
        if local > lo:
            pool.touch_many(row[lo:local])
        req.rows[lid], req.nulled[lid] = row, lo

    def load_destinations(self, row: list[int], blocks: list[int]) -> list[int]:
        return [row[i] for i in blocks]

    def land_load(self, pool: BlockPool, row: list[int] | None, load: _Load, pages: list[int],
                  publish_or_twin: Callable[[BlockPool, int, bytes, np.ndarray], int]) -> None:
        # published in block order (twin dedup); the chain stops at a collision
        for i, b in zip(load.leaf_blocks[self.leaf_id], pages):
            h, toks = load.hashes[i - load.start], load.tokens[i - load.start]
            if row is not None and row[i] == b:
                kept = row[i] = publish_or_twin(pool, b, h, toks)
            else:
                kept = pool.publish(b, h, toks)
            if pool.block_hash[kept] != h:
                break

    def row_shortfall(self, row: list[int], reach: int, what: str) -> str | None:
        if len(row) * self.page_size >= reach:
            return None
        return (f"holds {len(row)} blocks of leaf {self.leaf_id!r} ({len(row) * self.page_size} tokens) < "
                f"{what}={reach}; it does not have sufficient blocks, alloc must be called first")

    def _first_live_slot(self, nulled: dict[str, int]) -> int:
        return 0

    def check_row(self, p: str, rid: str, row: list[int], nulled: dict[str, int]) -> int:
        lid, lo = self.leaf_id, self._first_live_slot(nulled)
        assert all(b == NULL_BLOCK for b in row[:lo]), f"{p}: request {rid!r} leaf {lid!r} live page below window"
        assert NULL_BLOCK not in row[lo:], (
            f"{p}: request {rid!r} leaf {lid!r} row {row} holds block 0 at or above slot {lo}")
        return lo

    def committed_blocks(self, lo: int, committed: int) -> range:
        # spec/manager.md §10.4: a sliding leaf's slots below the window of the committed length
        # (a load moved the window past them; the next step frees them) are not checked.
        return range(max(lo, self.window_start(committed)), committed)


class FullLeaf(_PagedLeaf):
    """A full-attention leaf: every page of the context, a hit is the resident run from the root.

    Parameters
    ----------
    leaf_id : str
    spec : LeafSpec
        ``LeafSpec.full()``.
    page_size : int
    """

    __slots__ = ()
    KIND = LeafKind.FULL

    def pages_to_hold(self, max_seq_len: int) -> int:
        return math.ceil(max_seq_len / self.page_size)

    def best(self, k: int, resident: Residency) -> int:
        # spec/manager.md §3.2 full: the resident run from the root.
        return resident.run(k)

    def published_pages(self, pool: BlockPool, hashes: list[bytes], toks: np.ndarray,
                        flat: np.ndarray) -> list[tuple[int, int]]:
        """The run up to the first evicted hash (one batched lookup; spec/manager.md §9.8)."""
        return list(enumerate(pool.lookup_run(hashes, flat)))


class SlidingWindowLeaf(_PagedLeaf):
    """A sliding-window leaf: only the last ``window`` tokens are read; the slots below the window
    are freed and nulled in place (spec/manager.md §5.3).

    Parameters
    ----------
    leaf_id : str
    spec : LeafSpec
        ``LeafSpec.sliding_window(window)``.
    page_size : int
    """

    __slots__ = ()
    KIND = LeafKind.SLIDING_WINDOW
    is_sliding = True
    hit_order = 1

    def __init__(self, leaf_id: str, spec: LeafSpec, page_size: int):
        super().__init__(leaf_id, spec, page_size)
        # spec/manager.md §3.2: the query token is inside its own window, so the hit needs
        # the last window-1 tokens before it: ceil((window-1)/page) blocks.
        self.blocks_in_window = math.ceil((spec.window - 1) / page_size)

    def window_start(self, k: int) -> int:
        return max(0, k - self.blocks_in_window)

    def pages_to_hold(self, max_seq_len: int) -> int:
        return min(math.ceil(max_seq_len / self.page_size), self.blocks_in_window + 1)

    def best(self, k: int, resident: Residency) -> int:
        # spec/manager.md §3.2 sliding: a complete resident window before the stop
        # (a resident root run when the stop is inside the first window). The longest such
        # stop, found window by window: when block m of stop j's window is missing, every
        # stop in (m, j] has m in its window (window_start never decreases), so the next
        # candidate is m.
        j = k
        while j > 0:
            lo = self.window_start(j)
            held = resident.span(lo, j)
            if held == j - lo:
                return j
            j = lo + held
        return 0

    def _first_live_slot(self, nulled: dict[str, int]) -> int:
        return nulled.get(self.leaf_id, 0)


class RecurrentLeaf(Leaf):
    """A recurrent (state-space) leaf: a row ``[live]`` or ``[live, successor]`` of state pages; a
    checkpoint is published at each page boundary (spec/manager.md §5.2).

    Parameters
    ----------
    leaf_id : str
    spec : LeafSpec
        ``LeafSpec.recurrent(state_shape, state_dtype)``.
    page_size : int
    """

    __slots__ = ()
    KIND = LeafKind.RECURRENT
    is_recurrent = True
    hit_order = 2
    binds_rows = True

    def dtype(self, params: KVCacheParams) -> np.dtype:
        return STATE_DTYPES[self.spec.state_dtype]

    def page_shape(self, params: KVCacheParams) -> tuple[int, ...]:
        return tuple(self.spec.state_shape)

    def tier_units(self, params: KVCacheParams, unit: int) -> int:
        return -(-params.page_bytes(self.leaf_id) // unit)

    def pages_to_hold(self, max_seq_len: int) -> int:
        return 1

    def pages_to_admit(self, seq_len: int, caching: bool) -> int:
        return 2 if caching else 1

    def grow_need(self, have: int, required: int, caching: bool) -> int:
        return (0 if have else 1) + (1 if caching and have < 2 else 0)

    def fresh_states(self, row: list[int], drawn: int) -> list[int]:
        return [row[0]] if len(row) == drawn else []

    def needed_blocks(self, k0: int, k: int) -> list[int]:
        return [k - 1] if k > k0 else []

    def best(self, k: int, resident: Residency) -> int:
        # spec/manager.md §3.2 recurrent: the deepest boundary holding a state checkpoint.
        return resident.deepest(k)

    def hit_pages(self, k: int, resident: Residency) -> list[int]:
        return [resident.page(k - 1)] if k else []

    def plan_hit(self, plan: _AllocPlan, k: int, pages: list[int | None]) -> None:
        # spec/manager.md §4.5: the checkpoint, copied into the new live page (or a peer's, spec/manager.md §7.3)
        if not k:
            return
        lid = self.leaf_id
        if pages[-1] is None:
            plan.restore_peer[lid] = plan.leaf_peer.pop((lid, k - 1))
        else:
            plan.restore[lid] = pages[-1]

    def commit_hit(self, req: _Request, plan: _AllocPlan, pool: BlockPool, local: int) -> None:
        c = plan.restore.get(self.leaf_id)
        if c is not None:
            pool.touch(c)
            req.restore[self.leaf_id] = c

    def first_state_copy(self, row: list[int], pages: list[int], plan: _AllocPlan,
                         req: _Request) -> tuple | None:
        if row:
            return None
        lid = self.leaf_id
        if lid in plan.restore_peer:  # spec/manager.md §7.3: a peer's checkpoint into the new live page
            src_r, src = plan.restore_peer[lid]
            return ("leafpeer", (lid, src_r), src, pages[0])
        src = req.restore.get(lid)
        return ("restore", lid, src if src is not None else NULL_BLOCK, pages[0])

    def load_destinations(self, row: list[int], blocks: list[int]) -> list[int]:
        # the successor page receives the checkpoint (the live page keeps the device state)
        return [row[1]]

    def land_load(self, pool: BlockPool, row: list[int] | None, load: _Load, pages: list[int],
                  publish_or_twin: Callable[[BlockPool, int, bytes, np.ndarray], int]) -> None:
        # the checkpoint loaded into the successor becomes the live state
        if row is not None and len(row) == 2 and row[1] == pages[0]:
            row.reverse()  # [loaded state, old live page as the next successor]

    def row_width(self, blocks: int) -> int:
        return 1

    def table_widths(self, widths: list[int]) -> list[int]:
        return [1] * len(widths)  # spec/manager.md §8: one column, the live state page

    def table_columns(self, columns: int) -> int:
        return LUT_ALIGN

    def row_shortfall(self, row: list[int], reach: int, what: str) -> str | None:
        if row:
            return None
        return f"holds no state page of leaf {self.leaf_id!r}; alloc must be called first"

    def check_row(self, p: str, rid: str, row: list[int], nulled: dict[str, int]) -> int:
        assert len(row) <= 2 and NULL_BLOCK not in row, f"{p}: request {rid!r} state row {row}"
        return 0

    def committed_blocks(self, lo: int, committed: int) -> range:
        return range(0)  # a state row is not indexed by block


_LEAF_CLASSES: dict[LeafKind, type[Leaf]] = {cls.KIND: cls for cls in (FullLeaf, SlidingWindowLeaf, RecurrentLeaf)}


def joint_hit(leaves: list[Leaf], cap: int, resident: dict[str, Residency]) -> int:
    """The fixed point of the leaves' rules: the longest hit ``<= cap`` every leaf accepts.

    spec/manager.md §3.2: not the minimum of the per-leaf hits; narrowing one leaf can
    break another's window, so the leaves are asked in turn until all accept one length.
    ``best(k)`` is the longest length ``<= k`` a leaf accepts, so the leaf that answers ``j``
    accepts ``j`` and every leaf answers at least the longest length all accept: asking
    in a cycle stops as soon as every leaf in a row has answered the same length, which is
    the fixed point. Full leaves are asked first (one batched run), then the others,
    which reaches it with fewer residency questions, each a tier lookup in spec/manager.md §9.8.
    """
    order = sorted(leaves, key=lambda leaf: leaf.hit_order)
    k, agreed, i = cap, 0, 0
    while agreed < len(order):
        j = order[i].best(k, resident[order[i].leaf_id])
        agreed = agreed + 1 if j == k else 1  # the leaf that narrowed accepts its answer
        k = j
        i = (i + 1) % len(order)
    return k
