"""One memory slab per replica, cut into huge blocks that the leaves carve into pages
(spec/manager.md §13; MAX's "Jenga" pool).

Every leaf of a multi-leaf manager tiles the same bytes at its own page size: a
huge block is ``ratio[leaf]`` pages of that leaf, so leaf ``c``'s page ``b``
lies in huge block ``b // ratio[c]`` (page ids are indices into the leaf's own
view of the slab). Huge block 0 is the null block: page 0 of every leaf is the
null page, the rest of huge block 0 is never handed out::

    huge block    |     0     |     1     |     2     |     3     |
    full   (x2)   |  N  |  .  |  2  |  3  |  4  |  5  |  6  |  7  |
    state  (x4)   | N| .| .| .| 4| 5| 6| 7| 8| 9|10|11|12|13|14|15|

A huge block is always in one of two states:

* **parked** (no page of it is referenced): on the slab's parked queue, any
  leaf may claim it. It may still be *typed* to the leaf that used it last,
  whose pages in it stay on that leaf's free list and in its prefix index
  (that leaf can still hit and re-use them without a claim);
* **claimed** by leaf ``c`` (some page of it referenced): only ``c``
  allocates from it; each of ``c``'s pages in it is referenced or on ``c``'s
  free list, never both, never neither.

The policy (spec/manager.md §13.2), written once here for every engine:

* ``allocate`` for leaf ``c`` claims the huge block at the front of the
  parked queue when ``c`` has no free page, **or** when ``c``'s next free page
  is published (popping it would evict a cached block) while a pristine
  (never typed) huge block exists. Claiming a huge block typed to another
  leaf evicts that leaf's published pages in it and takes them off its free
  list; the claimed block's pages join ``c``'s free list at the front in
  ascending order. Then the front page is popped (popping a published page
  evicts it, as in every pool).
* ``free``: a page reaching ref count 0 goes to the front (unpublished) or
  back (published) of its leaf's free list; when its huge block holds no
  referenced page any more it is **parked** at the back of the queue, still
  typed, commits kept.
* ``touch`` of a free page whose huge block is parked takes the block back
  (un-parks it) for its own leaf.
* The parked queue starts with huge blocks ``1 .. H-1`` (pristine) in
  ascending order; pristine blocks therefore always form its front.

The mechanism under this policy is a :class:`kvspec.engine.SlabTable` (the
parked queue, owners and live counts; :class:`ReferenceSlabTable` here, an
int32-array one in ``kvfast``) plus one ``kvspec.engine.BlockPool`` per leaf
over ``H * ratio`` page ids whose free list holds only the pages the leaf was
granted (``BlockPool.grant`` / ``BlockPool.revoke``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import islice

from kvspec.engine import PRISTINE
from kvspec.errors import CapacityError

__all__ = [
    "MAX_HUGE_BYTES",
    "MAX_PADDING_FRACTION",
    "MAX_TILING_RATIO",
    "PRISTINE",
    "ReferenceSlabTable",
    "Slab",
    "SlabGeometry",
    "SlabLeafPool",
    "plan_slab_geometry",
]

#: A padded page spends at most this share of itself on padding (MAX's ``_MAX_PADDING_FRACTION``).
MAX_PADDING_FRACTION = 0.25
#: Largest huge block the geometry takes (MAX's ``_MAX_HUGE_PAGE_BYTES``).
MAX_HUGE_BYTES = 128 * 1024 * 1024
#: Most pages of one leaf a huge block holds (MAX's ``_MAX_TILING_RATIO``).
MAX_TILING_RATIO = 256


# --------------------------------------------------------------------------- geometry


@dataclass(frozen=True)
class SlabGeometry:
    """How one huge block is cut: ``ratios[leaf]`` pages of ``padded_bytes[leaf]`` bytes each.

    Attributes
    ----------
    huge_bytes : int
        Bytes of one huge block; every ``padded_bytes[leaf]`` divides it.
    ratios : dict of str to int
        Pages of each leaf one huge block holds (``huge_bytes // padded_bytes``).
    page_bytes : dict of str to int
        Data bytes of one page of each leaf.
    padded_bytes : dict of str to int
        Page stride of each leaf in the slab (``>= page_bytes``; equal unless the
        least common multiple was too large, then at most 25% more).
    """

    huge_bytes: int
    ratios: dict
    page_bytes: dict
    padded_bytes: dict

    def padding_fraction(self, leaf_id: str) -> float:
        """Share of a page of ``leaf_id`` that is padding (``padded / data - 1``)."""
        return self.padded_bytes[leaf_id] / self.page_bytes[leaf_id] - 1


def _smallest_tiling_page(huge: int, data: int, row: int) -> int | None:
    """The smallest page >= ``data`` that divides ``huge`` and is a whole number of rows."""
    for ratio in range(huge // data, 0, -1):
        if huge % ratio == 0 and (huge // ratio) % row == 0:
            return huge // ratio
    return None


def plan_slab_geometry(page_bytes: Mapping[str, int], row_bytes: Mapping[str, int]) -> SlabGeometry:
    """The huge-block geometry of a set of leaves (spec/manager.md §13.1).

    The huge block is the least common multiple of the page sizes (every leaf
    tiles it exactly) when that keeps every ratio ``<= MAX_TILING_RATIO`` and
    the block ``<= MAX_HUGE_BYTES``. Otherwise (a coprime factor made the
    multiple too coarse), each page is padded to a divisor of a smaller block:
    the candidates are MAX's (for each leaf and ratio ``1 .. 256``, the smallest
    multiple of ``lcm(row_bytes)`` at or above ``ratio * page``), each page padded
    to the smallest whole number of its rows that divides the candidate, at most
    ``MAX_PADDING_FRACTION`` over its data; the **smallest** candidate that fits
    wins (finest allocation quantum; MAX also prices the byte budget it strands,
    which a pool sized in huge blocks does not have).

    Parameters
    ----------
    page_bytes : mapping of str to int
        Data bytes of one page per leaf (> 0).
    row_bytes : mapping of str to int
        Granularity each padded page must be a multiple of (> 0, divides the page).

    Returns
    -------
    SlabGeometry

    Raises
    ------
    ValueError
        Empty or non-positive sizes, mismatched leaves, a page that is not a
        whole number of rows, or no geometry within the bounds.
    """
    o = "plan_slab_geometry"
    if not page_bytes:
        raise ValueError(f"{o}: page_bytes={dict(page_bytes)!r}, must name at least one leaf")
    if set(page_bytes) != set(row_bytes):
        raise ValueError(f"{o}: page_bytes leaves {sorted(page_bytes)} != row_bytes leaves {sorted(row_bytes)}")
    for lid, n in page_bytes.items():
        if n <= 0 or row_bytes[lid] <= 0:
            raise ValueError(f"{o}: leaf {lid!r} page_bytes={n}, row_bytes={row_bytes[lid]}, must be > 0")
        if n % row_bytes[lid]:
            raise ValueError(f"{o}: leaf {lid!r} page_bytes={n} is not a multiple of row_bytes={row_bytes[lid]}")
    exact = math.lcm(*page_bytes.values())
    if exact <= MAX_HUGE_BYTES and all(exact // n <= MAX_TILING_RATIO for n in page_bytes.values()):
        return SlabGeometry(exact, {lid: exact // n for lid, n in page_bytes.items()}, dict(page_bytes),
                            dict(page_bytes))
    grid = math.lcm(*row_bytes.values())
    floor = max(page_bytes.values())
    candidates = set()
    for n in page_bytes.values():
        for ratio in range(1, MAX_TILING_RATIO + 1):
            size = -(-ratio * n // grid) * grid
            if size > MAX_HUGE_BYTES:
                break
            if size >= floor:
                candidates.add(size)
    for huge in sorted(candidates):
        padded = {}
        for lid, n in page_bytes.items():
            p = _smallest_tiling_page(huge, n, row_bytes[lid])
            if p is None or p / n - 1 > MAX_PADDING_FRACTION:
                break
            padded[lid] = p
        else:
            return SlabGeometry(huge, {lid: huge // p for lid, p in padded.items()}, dict(page_bytes), padded)
    raise ValueError(f"{o}: no huge block <= {MAX_HUGE_BYTES} bytes tiles pages {dict(page_bytes)} with at most "
                     f"{MAX_PADDING_FRACTION:.0%} padding (exact tiling needs {exact} bytes)")


# --------------------------------------------------------------------------- mechanism (reference)


class ReferenceSlabTable:
    """The huge blocks of one slab: owners, live page counts and the parked queue (plain Python).

    Satisfies ``kvspec.engine.SlabTable``. Huge block 0 (the null block) is never
    parked, owned or counted.

    Parameters
    ----------
    num_huge_blocks : int
        Huge blocks including the null block (>= 2).
    num_leaves : int
        Leaves sharing the slab (owners are ``0 .. num_leaves-1``).
    """

    def __init__(self, num_huge_blocks: int, num_leaves: int):
        if num_huge_blocks < 2:
            raise ValueError(f"SlabTable: num_huge_blocks={num_huge_blocks}, must be >= 2 (huge block 0 is null)")
        self.num_huge_blocks = num_huge_blocks
        self.num_leaves = num_leaves
        #: owner[h]: the leaf huge block h is typed to, or PRISTINE
        self.owner = [PRISTINE] * num_huge_blocks
        #: live[h]: referenced pages of huge block h
        self.live = [0] * num_huge_blocks
        self._parked: OrderedDict[int, None] = OrderedDict((h, None) for h in range(1, num_huge_blocks))
        self._parked_typed = [0] * num_leaves

    @property
    def num_parked(self) -> int:
        """Huge blocks on the parked queue."""
        return len(self._parked)

    def parked_typed(self, leaf: int) -> int:
        """Parked huge blocks still typed to ``leaf``."""
        return self._parked_typed[leaf]

    def front(self) -> int:
        """The huge block a claim would take (the parked queue's front); 0 when none is parked."""
        return next(iter(self._parked), 0)

    def is_parked(self, h: int) -> bool:
        return h in self._parked

    def park(self, h: int) -> None:
        """Append ``h`` (no live page, typed) to the back of the parked queue."""
        self._parked[h] = None
        self._parked_typed[self.owner[h]] += 1

    def unpark(self, h: int) -> None:
        """Take parked ``h`` off the queue (a claim or a page of it referenced again)."""
        del self._parked[h]
        if self.owner[h] != PRISTINE:
            self._parked_typed[self.owner[h]] -= 1

    def set_owner(self, h: int, leaf: int) -> None:
        """Type unparked ``h`` to ``leaf``."""
        self.owner[h] = leaf

    def take(self, hs) -> None:
        """For each huge block of ``hs`` in order, a page of it referenced again: off the parked queue
        if parked, ``live += 1``."""
        for h in hs:
            if h in self._parked:
                self.unpark(h)
            self.live[h] += 1

    def drop(self, hs) -> None:
        """For each huge block of ``hs`` in order, a page of it went idle: ``live -= 1``; at 0 the
        block is parked at the back of the queue."""
        for h in hs:
            self.live[h] -= 1
            if not self.live[h]:
                self.park(h)

    def claim_pristine(self, leaf: int, k: int) -> range:
        """Take up to ``k`` pristine huge blocks off the queue's front and type them to ``leaf``;
        returns them (consecutive ids: pristine blocks only ever leave from the front)."""
        first = self.front()
        taken = 0
        while taken < k and self._parked:
            h = self.front()
            if self.owner[h] != PRISTINE:
                break
            assert h == first + taken, f"ReferenceSlabTable: pristine block {h} after {first + taken - 1}"
            self.unpark(h)
            self.set_owner(h, leaf)
            taken += 1
        return range(first, first + taken)

    def claim_pristine_pages(self, leaf: int, n: int, ratio: int) -> range:
        """:meth:`claim_pristine` of the blocks ``n`` pages of ``ratio`` per block fill, then
        :meth:`take_pages` of the first ``n`` pages of the blocks taken (all of them when fewer)."""
        hs = self.claim_pristine(leaf, -(-n // ratio))
        self.take_pages(range(hs.start * ratio, min(hs.stop * ratio, hs.start * ratio + n)), ratio)
        return hs

    def claim_front(self, leaf: int, k: int) -> tuple[list[int], list[int]]:
        """Take the ``k`` front blocks off the queue and type them to ``leaf``; returns them and their
        previous owners, front first."""
        hs, prevs = [], []
        for _ in range(k):
            h = self.front()
            hs.append(h)
            prevs.append(self.owner[h])
            self.unpark(h)
            self.set_owner(h, leaf)
        return hs, prevs

    def take_pages(self, pages, ratio: int) -> None:
        """``take`` of the huge block of each page of ``pages`` (allocated pages)."""
        self.take(b // ratio for b in pages)

    def take_idle(self, pages, ratio: int, ref_count) -> None:
        """``take`` of the huge block of each page of ``pages`` whose ref count is 0 (about to be touched)."""
        self.take(b // ratio for b in pages if ref_count[b] == 0)

    def drop_idle(self, pages, ratio: int, ref_count) -> None:
        """``drop`` of the huge block of each page ``!= 0`` of ``pages`` whose ref count is 0 (just freed)."""
        self.drop(b // ratio for b in pages if b and ref_count[b] == 0)

    def free_pages(self, pool, pages, ratio: int, claim: tuple[int, float] | None = None) -> None:
        """A leaf's ``pages`` let go: ``pool.free(pages)`` (with a retention claim ``(priority,
        expiry)``: ``pool.retain_free(pages, priority, expiry)``), then :meth:`drop_idle` of them
        against the pool's ref counts."""
        if claim is None:
            pool.free(pages)
        else:
            pool.retain_free(pages, *claim)
        self.drop_idle(pages, ratio, pool.ref_count)

    def allocate_pages(self, pool, n: int, ratio: int) -> list[int]:
        """A leaf's draw: ``pool.allocate(n)``, then :meth:`take_pages` of the pages drawn; returns them."""
        got = pool.allocate(n)
        self.take_pages(got, ratio)
        return got

    def touch_pages(self, pool, pages, ratio: int) -> int:
        """A leaf's ``pages`` referenced once more: :meth:`take_idle` of them against the pool's ref
        counts, then ``pool.touch_many(pages)``; returns what it returns."""
        self.take_idle(pages, ratio, pool.ref_count)
        return pool.touch_many(pages)

    def parked_order(self, limit: int | None = None) -> list[int]:
        """The parked queue, front first; its first ``limit`` blocks when given."""
        return list(self._parked) if limit is None else list(islice(self._parked, limit))

    def owners(self) -> list[int]:
        """``owner[h]`` for every huge block (a copy)."""
        return list(self.owner)

    def live_counts(self) -> list[int]:
        """``live[h]`` for every huge block (a copy)."""
        return list(self.live)


# --------------------------------------------------------------------------- policy


class _Prefix:
    """The front of a sequence read on demand: ``get(i)`` is item ``i`` or None past the end;
    ``fetch(k)`` returns the first ``k`` items (fewer at the end), and each refetch doubles."""

    __slots__ = ("_fetch", "_items", "_complete")

    def __init__(self, fetch: Callable[[int], list[int]]):
        self._fetch = fetch
        self._items: list[int] = []
        self._complete = False

    def get(self, i: int) -> int | None:
        while i >= len(self._items) and not self._complete:
            want = max(16, 2 * len(self._items), i + 1)
            self._items = self._fetch(want)
            self._complete = len(self._items) < want
        return self._items[i] if i < len(self._items) else None


class Slab:
    """One replica's slab: the huge-block policy over a :class:`kvspec.engine.SlabTable` and one
    grant-able ``BlockPool`` per leaf (spec/manager.md §13.2).

    Parameters
    ----------
    table : kvspec.engine.SlabTable
        Fresh: every huge block but 0 parked and pristine.
    pools : dict of str to kvspec.engine.BlockPool
        Per leaf, in leaf order, a fresh pool over ``num_huge_blocks * ratios[leaf]``
        ids; the slab takes every page out of circulation (``revoke``) until a
        claim grants it.
    ratios : dict of str to int
        Pages of each leaf per huge block.
    """

    def __init__(self, table, pools: Mapping[str, object], ratios: Mapping[str, int]):
        self.table = table
        self.ratios = dict(ratios)
        self.leaf_ids = list(pools)
        self.num_huge_blocks = table.num_huge_blocks
        self._index = {lid: i for i, lid in enumerate(self.leaf_ids)}
        self.inner = dict(pools)
        for pool in self.inner.values():
            pool.revoke(range(1, pool.num_blocks))
        self.pools = {lid: SlabLeafPool(self, lid) for lid in self.leaf_ids}

    # ------------------------------------------------------------------ counts

    def num_free(self, leaf_id: str) -> int:
        """Pages ``leaf_id`` can still draw: its free pages plus ``ratio`` per parked huge block
        not typed to it (not additive across leaves: the parked blocks are shared)."""
        t, i = self.table, self._index[leaf_id]
        return self.inner[leaf_id].num_free + (t.num_parked - t.parked_typed(i)) * self.ratios[leaf_id]

    def free_huge_blocks(self) -> int:
        """Parked huge blocks (``block_count().free``: free and cached-unreferenced bytes)."""
        return self.table.num_parked

    def shortfall(self, demand: Mapping[str, int], taken: Mapping[str, Iterable[int]] | None = None
                  ) -> tuple[str, int, int] | None:
        """The first leaf a joint demand cannot be served for, or None when it can.

        ``demand[leaf]`` pages are to be drawn after the pages in ``taken[leaf]``
        (hit pages about to be referenced) left the free lists. Leaves are
        charged in slab order: leaf ``c`` fits when ``demand[c]`` pages fit in its
        free pages plus what the parked huge blocks still hold after the earlier
        leaves' shortfalls (MAX's ``can_satisfy_demand``: a parked block typed to
        a leaf counts for it only while that leaf needs it).

        Returns
        -------
        (leaf_id, needed, available) or None
            ``available``: pages that leaf could still draw after the earlier leaves.
        """
        t = self.table
        # Plenty of room: even if every page drawn or taken took a parked block of its own (a page of
        # a parked block un-parks it; a claim takes one), the parked blocks suffice. O(leaves).
        worst = 0
        for n in demand.values():
            if n > 0:
                worst += n
        if t.num_parked - (sum(map(len, taken.values())) if taken else 0) >= worst:
            return None
        carved, parked_typed = {}, {}
        unparked = set()
        for lid in self.leaf_ids:
            inner, ratio, i = self.inner[lid], self.ratios[lid], self._index[lid]
            pages = [b for b in (taken or {}).get(lid, ()) if b]
            carved[lid] = inner.num_free - inner.count_free(pages)
            # a taken page of a parked huge block takes the block back for its own leaf
            back = {b // ratio for b in pages if inner.ref_count[b] == 0 and t.is_parked(b // ratio)}
            unparked |= back
            parked_typed[lid] = t.parked_typed(i) - len(back)
        claimable = t.num_parked - len(unparked)
        wants = {lid: n for lid, n in demand.items() if n > 0}
        # The same bound with the blocks the taken pages really un-park: a page drawn takes at most one
        # parked block (a claim serves `ratio` pages with one). When every leaf that draws has one page
        # per huge block it is exact (each free page is a parked block of its own), and the counts
        # below agree with it: the replay runs only when a leaf of several pages per block draws near
        # a full slab.
        if worst <= claimable:
            return None
        # MAX: a parked block typed to a leaf stays its own only while that leaf needs it.
        for lid in self.leaf_ids:
            n, ratio = wants.get(lid, 0), self.ratios[lid]
            fixed = carved[lid] - parked_typed[lid] * ratio
            claimable -= min(parked_typed[lid], -(-max(0, n - fixed) // ratio))
        slack = claimable
        for lid in self.leaf_ids:
            n, ratio = wants.get(lid, 0), self.ratios[lid]
            short = n - carved[lid]
            cost = -(-short // ratio) if short > 0 else 0
            if cost > slack:
                return lid, n, carved[lid] + max(slack, 0) * ratio
            slack -= cost
        # The counts above are what an ideal split can draw; the draw itself may spend more blocks (a
        # pristine claim while a leaf still had published pages, one page un-parking a block whose
        # other pages it does not use): replay it exactly (O(pages drawn); only near a full slab).
        return self._replay(wants, taken or {})

    def peek(self, wants: Mapping[str, int], taken: Mapping[str, Iterable[int]] | None = None
             ) -> dict[str, list[int]]:
        """The pages a joint draw hands out, changing nothing: after the pages in ``taken[leaf]`` are
        touched, ``wants[leaf]`` pages are drawn for each leaf in turn, in the order of ``wants`` (as
        one ``allocate`` per leaf would, claims of huge blocks included). ``CapacityError`` when a leaf
        runs dry (``shortfall`` says which first). O(pages drawn, plus pages and blocks skipped): the
        manager predicts the pages a load goes into before anything is drawn (spec/manager.md §9.8)."""
        drawn: dict[str, list[int]] = {lid: [] for lid in wants}
        short = self._replay(wants, taken or {}, drawn)
        if short is not None:
            lid, n, got = short
            raise CapacityError(f"Slab.peek: needs {n} blocks of leaf {lid!r}, {got} can be drawn")
        return drawn

    def _replay(self, wants: Mapping[str, int], taken: Mapping[str, Iterable[int]],
                drawn: dict[str, list[int]] | None = None) -> tuple[str, int, int] | None:
        """Replay the touches of ``taken`` and the draws of ``wants`` (in its order) on the free lists
        and the parked queue, changing nothing; the first leaf that runs dry, or None.
        ``drawn[leaf]`` (when given) receives each leaf's pages in draw order.

        Each list is read from its front only as far as the draws reach (``BlockPool.peek``,
        ``SlabTable.parked_order(limit)``, a longer prefix when one runs out), so the replay costs
        O(draws + pages and blocks skipped), not O(pool). A claimed block's pages go to the front of
        the leaf's list (they are unpublished, so a leaf claims only once its earlier grants are
        drawn); a claim of a block another leaf owns kills that leaf's pages in it; a page drawn or
        touched takes its parked block back (it leaves the queue)."""
        t = self.table
        owner = {}  # huge block -> its owner in the replay, where it changed
        parked = _Prefix(t.parked_order)
        left: set[int] = set()  # blocks that left the parked queue (taken back) before reaching its front
        at = 0  # the replay's front of the parked queue
        dead: set[tuple[str, int]] = set()
        skip: dict[str, set[int]] = {}
        for lid in self.leaf_ids:
            inner, ratio = self.inner[lid], self.ratios[lid]
            skip[lid] = pages = {b for b in taken.get(lid, ()) if b}
            for b in pages:
                if inner.ref_count[b] == 0:  # a touched free page of a parked block takes it back
                    left.add(b // ratio)
        for lid, n in wants.items():
            me, ratio, inner = self._index[lid], self.ratios[lid], self.inner[lid]
            own = _Prefix(lambda k, _inner=inner, _skip=skip[lid]: _inner.peek(k, skip=_skip))
            i = 0  # the leaf's next own free page
            granted: list[int] = []  # pages of blocks it claimed in the replay, to pop first
            for got in range(n):
                if granted:
                    nxt = granted[-1]
                else:
                    nxt = own.get(i)
                    while nxt is not None and (lid, nxt) in dead:
                        i += 1
                        nxt = own.get(i)
                first = parked.get(at)
                while first is not None and first in left:
                    at += 1
                    first = parked.get(at)
                pristine = first is not None and owner.get(first, t.owner[first]) == PRISTINE
                if nxt is None or (pristine and not granted and inner.block_hash[nxt] is not None):
                    if first is None:
                        return lid, n, got
                    at += 1
                    prev = owner.get(first, t.owner[first])
                    if prev != PRISTINE:
                        old = self.leaf_ids[prev]
                        dead.update((old, b) for b in self._pages_of(old, first))
                    owner[first] = me
                    granted = list(reversed(self._pages_of(lid, first)))  # popped from the end: ascending
                if granted:
                    b = granted.pop()
                else:
                    b = nxt
                    i += 1
                left.add(b // ratio)  # a drawn page of a parked block takes it back
                if drawn is not None:
                    drawn[lid].append(b)
        return None

    # ------------------------------------------------------------------ claims

    def _pages_of(self, leaf_id: str, h: int) -> range:
        r = self.ratios[leaf_id]
        return range(h * r, (h + 1) * r)

    def _claim(self, leaf_id: str, k: int = 1) -> None:
        """Claim the parked queue's ``k`` front huge blocks for ``leaf_id`` (spec/manager.md §13.2),
        as ``k`` claims in a row would: the caller pops every page of one before the next claim,
        so all their pages join the leaf's free list at the front, block by block, ascending."""
        hs, prevs = self.table.claim_front(self._index[leaf_id], k)
        # The bytes change hands: the previous leaf's pages in them (all free) leave its free list
        # and its prefix index (evicted), block by block (one call per run of one previous owner).
        i = 0
        while i < len(hs):
            j = i + 1
            while j < len(hs) and prevs[j] == prevs[i]:
                j += 1
            if prevs[i] != PRISTINE:
                old = self.leaf_ids[prevs[i]]
                self.inner[old].revoke(self._pages_of_many(old, hs[i:j]))
            i = j
        self.inner[leaf_id].grant(self._pages_of_many(leaf_id, hs))

    def _pages_of_many(self, leaf_id: str, hs) -> range | list[int]:
        """The pages of ``leaf_id`` in huge blocks ``hs``, block by block, ascending."""
        r = self.ratios[leaf_id]
        if len(hs) == 1:
            return range(hs[0] * r, (hs[0] + 1) * r)
        return [b for h in hs for b in range(h * r, (h + 1) * r)]

    def _wants_claim(self, leaf_id: str) -> bool:
        """MAX's rule: claim when the leaf has no free page, or its next free page is published
        while a pristine huge block exists (a claim then saves a cached block)."""
        inner, t = self.inner[leaf_id], self.table
        if inner.num_free == 0:
            return True
        if not t.num_parked or t.owner[t.front()] != PRISTINE:
            return False
        return inner.unpublished_run(1) == 0

    def allocate_one(self, leaf_id: str) -> int:
        inner, ratio, t = self.inner[leaf_id], self.ratios[leaf_id], self.table
        free, parked = inner.num_free, t.num_parked
        if not free and (parked - t.parked_typed(self._index[leaf_id])) * ratio < 1:  # num_free(leaf_id) < 1
            raise CapacityError(f"BlockPool.allocate: needs 1 blocks of leaf {leaf_id!r}, 0 free or evictable")
        # _wants_claim, inlined (a decode step's page)
        if not free or (parked and t.owner[t.front()] == PRISTINE and inner.unpublished_run(1) == 0):
            self._claim(leaf_id)
        b = inner.allocate_one()
        t.take([b // ratio])  # un-parks a block typed to this leaf: taken back
        return b

    def allocate(self, leaf_id: str, n: int) -> list[int]:
        """``n`` pages of ``leaf_id``, exactly as ``n`` calls of :meth:`allocate_one` would draw them,
        in runs: between two claim decisions the leaf pops its own pages in one batch (all it needs
        when no pristine block is left, else the unpublished run at its front), and consecutive
        pristine claims are one table call. The caller checked ``n`` fit."""
        inner, ratio, t = self.inner[leaf_id], self.ratios[leaf_id], self.table
        if n <= inner.num_free and not (t.num_parked and t.owner[t.front()] == PRISTINE):
            return t.allocate_pages(inner, n, ratio)  # the loop's one pass: the leaf's own pages, no claim
        out: list[int] = []
        while len(out) < n:
            rest, free = n - len(out), inner.num_free
            pristine = bool(t.num_parked) and t.owner[t.front()] == PRISTINE
            # With a pristine block parked, the unpublished run at the leaf's front is what it may pop
            # before the next claim; none (its next free page is published) is _wants_claim's claim.
            run = inner.unpublished_run(min(rest, free)) if pristine and free else 0
            taken = 0  # leading pages of the draw the table already counts (a pristine claim's)
            if run:
                k = run
            elif free and not pristine:
                k = min(rest, free)
            elif pristine:
                # each pristine block's pages are popped before the next claim (they are
                # unpublished): claim as many as the rest needs at once, their pages in block
                # order at the front; the draw pops them first, so the claim counts them too
                hs = t.claim_pristine_pages(self._index[leaf_id], rest, ratio)
                inner.grant(range(hs.start * ratio, hs.stop * ratio))
                taken = min(rest, len(hs) * ratio)
                k = min(rest, inner.num_free)
                if len(hs) * ratio < rest and t.num_parked and t.owner[t.front()] == PRISTINE:
                    k = max(1, inner.unpublished_run(k))  # (not reached: fewer pristine blocks than asked)
            else:
                # No pristine block is left (they would be at the front), so the leaf claims
                # because its list is empty (no parked block is typed to it): it claims front
                # blocks until the rest is served, popping each whole before the next claim.
                self._claim(leaf_id, -(-rest // ratio))
                k = min(rest, inner.num_free)
            if taken:
                got = inner.allocate(k)
                if k > taken:
                    t.take_pages(got[taken:], ratio)
            else:
                got = t.allocate_pages(inner, k, ratio)
            out += got
        return out

    def free(self, leaf_id: str, blocks: Iterable[int]) -> None:
        if type(blocks) is not list:
            blocks = list(blocks)
        if blocks:
            # spec/manager.md §13.2: a block whose last page went idle parks (typed, commits kept), in
            # order (the inner pool skips the null page)
            self.table.free_pages(self.inner[leaf_id], blocks, self.ratios[leaf_id])

    def retain_free(self, leaf_id: str, blocks: Iterable[int], priority: int, expiry: float) -> None:
        """:meth:`free` after the claim ``(priority, expiry)`` on ``blocks`` (the inner pool does both)."""
        if type(blocks) is not list:
            blocks = list(blocks)
        if blocks:
            # spec/manager.md §13.2: as free, the claim merged first (spec/manager.md §14.2)
            self.table.free_pages(self.inner[leaf_id], blocks, self.ratios[leaf_id], (priority, expiry))

    def touch(self, leaf_id: str, b: int) -> None:
        inner = self.inner[leaf_id]
        if b != 0 and inner.ref_count[b] == 0:
            self.table.take([b // self.ratios[leaf_id]])
        inner.touch(b)

    def touch_many(self, leaf_id: str, blocks: Sequence[int]) -> int:
        # spec/manager.md §13.2: a touched page of a parked block takes the block back
        return self.table.touch_pages(self.inner[leaf_id], blocks, self.ratios[leaf_id])

    # ------------------------------------------------------------------ invariants and bytes

    def page_states(self) -> dict[str, int]:
        """Pages of every leaf by state, as huge-block fractions summed into page units of the
        huge block: ``{"free": f, "cached": c, "in_use": u}`` with ``f + c + u == (H - 1) *
        lcm_units`` where each page of leaf ``l`` weighs ``units // ratio[l]`` (so the three
        partition the slab's allocatable bytes exactly, spec/manager.md §13.4)."""
        units = math.lcm(*self.ratios.values())
        out = {"free": 0, "cached": 0, "in_use": 0}
        t = self.table
        for h in range(1, self.num_huge_blocks):
            owner = t.owner[h]
            if owner == PRISTINE:
                out["free"] += units
                continue
            lid = self.leaf_ids[owner]
            inner, w = self.inner[lid], units // self.ratios[lid]
            for b in self._pages_of(lid, h):
                if inner.ref_count[b] > 0:
                    out["in_use"] += w
                elif inner.block_hash[b] is not None:
                    out["cached"] += w
                else:
                    out["free"] += w
        return out

    def check_invariants(self, table_refs: Mapping[str, dict[int, int]] | None = None) -> None:
        """``AssertionError`` naming the first inconsistency (spec/manager.md §13.4)."""
        p = "check_invariants"
        t = self.table
        for lid in self.leaf_ids:
            self.inner[lid].check_invariants(None if table_refs is None else table_refs.get(lid, {}))
        free_sets = {lid: set(self.inner[lid].free_order()) for lid in self.leaf_ids}
        typed = [0] * len(self.leaf_ids)
        for lid in self.leaf_ids:
            assert not any(b in free_sets[lid] for b in self._pages_of(lid, 0)), f"{p}: leaf {lid!r} holds a page of huge block 0"
        for h in range(1, self.num_huge_blocks):
            owner, parked = t.owner[h], t.is_parked(h)
            live = 0
            for i, lid in enumerate(self.leaf_ids):
                inner = self.inner[lid]
                for b in self._pages_of(lid, h):
                    rc = inner.ref_count[b]
                    if i == owner:
                        live += rc > 0
                        assert (rc == 0) == (b in free_sets[lid]), (
                            f"{p}: huge block {h} page {b} of leaf {lid!r} ref_count={rc} but free={b in free_sets[lid]}")
                    else:
                        assert rc == 0 and b not in free_sets[lid] and inner.block_hash[b] is None, (
                            f"{p}: huge block {h} (owner {owner}) page {b} of leaf {lid!r} is in circulation")
            assert t.live[h] == live, f"{p}: huge block {h} live={t.live[h]} but {live} pages referenced"
            assert parked == (live == 0), f"{p}: huge block {h} live={live} but parked={parked}"
            if parked and owner != PRISTINE:
                typed[owner] += 1
        for i, lid in enumerate(self.leaf_ids):
            assert t.parked_typed(i) == typed[i], (
                f"{p}: leaf {lid!r} parked_typed={t.parked_typed(i)} but {typed[i]} parked blocks typed to it")
        order = t.parked_order()
        pristine = [t.owner[h] == PRISTINE for h in order]
        assert pristine == sorted(pristine, reverse=True), f"{p}: a pristine huge block behind a typed one"


class SlabLeafPool:
    """One leaf's view of a :class:`Slab`: a ``kvspec.engine.BlockPool`` whose pages come from
    the shared huge blocks (spec/manager.md §13.2).

    Allocation, free and touch follow the slab's policy; the prefix index and
    the leaf's own free list are the inner pool's. ``free_order()`` is the
    leaf's own free list (pages of huge blocks typed to it), front first.
    """

    def __init__(self, slab: Slab, leaf_id: str):
        self.slab = slab
        self.leaf_id = leaf_id
        self.ratio = slab.ratios[leaf_id]
        self.inner = inner = slab.inner[leaf_id]
        self.num_blocks = inner.num_blocks
        # The prefix index is the inner pool's: its calls are the inner pool's own (bound here, no
        # forwarding frame on the hot path).
        self.lookup, self.lookup_run = inner.lookup, inner.lookup_run
        self.publish, self.publish_run = inner.publish, inner.publish_run
        self.count_free = inner.count_free
        # The slab's policy calls for this leaf (partials: no forwarding frame per page drawn or freed).
        self.allocate_one = partial(slab.allocate_one, leaf_id)
        self.free = partial(slab.free, leaf_id)
        self.retain_free = partial(slab.retain_free, leaf_id)

    # -- the inner pool's state, read-only
    block_hash = property(lambda self: self.inner.block_hash)
    block_tokens = property(lambda self: self.inner.block_tokens)
    hash_to_block = property(lambda self: self.inner.hash_to_block)
    ref_count = property(lambda self: self.inner.ref_count)

    # -- retention (spec/manager.md §14): the inner pool orders the leaf's cached pages
    @property
    def clock(self):
        """The inner pool's clock (``time.monotonic`` unless injected)."""
        return self.inner.clock

    @clock.setter
    def clock(self, clock) -> None:
        self.inner.clock = clock

    def set_retention(self, blocks, priority: int, expiry: float) -> None:
        """The inner pool's ``set_retention`` (same arguments, checks and errors)."""
        self.inner.set_retention(blocks, priority, expiry)

    def retention(self, block: int) -> tuple[int, float]:
        """The inner pool's claim of ``block``."""
        return self.inner.retention(block)

    @property
    def num_free(self) -> int:
        """Pages ``allocate`` can hand out (the leaf's free pages plus parked huge blocks' worth)."""
        return self.slab.num_free(self.leaf_id)

    @property
    def num_usable(self) -> int:
        """Pages of this leaf outside huge block 0: ``(num_huge_blocks - 1) * ratio``."""
        return (self.slab.num_huge_blocks - 1) * self.ratio

    def allocate(self, n: int) -> list[int]:
        """Draw ``n`` pages (claiming huge blocks as the policy says); ``CapacityError``, state
        unchanged, when fewer than ``n`` can be drawn."""
        free = self.num_free
        if n > free:
            raise CapacityError(f"BlockPool.allocate: needs {n} blocks, {free} free or evictable")
        return self.slab.allocate(self.leaf_id, n)

    def allocate_one(self) -> int:
        return self.slab.allocate_one(self.leaf_id)

    def free(self, blocks: Iterable[int]) -> None:
        self.slab.free(self.leaf_id, blocks)

    def retain_free(self, blocks: Iterable[int], priority: int, expiry: float) -> None:
        self.slab.retain_free(self.leaf_id, blocks, priority, expiry)

    def touch(self, block: int) -> None:
        if block == 0:
            raise ValueError("BlockPool.touch: block 0 is the null block")
        self.slab.touch(self.leaf_id, block)

    def touch_many(self, blocks: Sequence[int]) -> int:
        return int(self.slab.touch_many(self.leaf_id, blocks))

    def count_free(self, blocks: Sequence[int]) -> int:
        return self.inner.count_free(blocks)

    def peek(self, n: int, skip=()) -> list[int]:
        """The first ``n`` pages ``allocate`` would hand out once the pages in ``skip`` were taken
        (fewer when fewer can be drawn); changes nothing: the slab's replay (:meth:`Slab.peek`) of
        this leaf's draws alone, O(pages drawn)."""
        drawn: dict[str, list[int]] = {self.leaf_id: []}
        self.slab._replay({self.leaf_id: n}, {self.leaf_id: skip}, drawn)
        return drawn[self.leaf_id]

    def free_order(self) -> list[int]:
        return self.inner.free_order()

    def lookup(self, block_hash: bytes, tokens):
        return self.inner.lookup(block_hash, tokens)

    def lookup_run(self, hashes, tokens):
        return self.inner.lookup_run(hashes, tokens)

    def last_indexed(self, hashes, stop: int) -> int:
        return self.inner.last_indexed(hashes, stop)

    def publish(self, block: int, block_hash: bytes, tokens) -> int:
        return self.inner.publish(block, block_hash, tokens)

    def publish_run(self, blocks, hashes, tokens):
        return self.inner.publish_run(blocks, hashes, tokens)

    def reset_prefix_cache(self) -> list[int]:
        return self.inner.reset_prefix_cache()

    def _unpublish(self, block: int) -> None:
        """Drop one free page's hash (tests emulate an eviction with it, as on a plain pool)."""
        self.inner._unpublish(block)

    def check_invariants(self, table_refs: dict[int, int] | None = None) -> None:
        self.inner.check_invariants(table_refs)

    def snapshot(self):
        """An opaque copy of the leaf's pool and the slab's huge-block state (for tests that check
        a raising call changed nothing)."""
        t = self.slab.table
        return self.inner.snapshot(), t.owners(), t.live_counts(), t.parked_order()
