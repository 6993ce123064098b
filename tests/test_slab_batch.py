"""The slab's batched calls equal their per-page definitions (spec/manager.md §13.2;
``kvspec.engine.SlabTable``).

``Slab.allocate(leaf, n)`` is defined as ``n`` calls of ``allocate_one``,
``free(leaf, pages)`` / ``touch_many(leaf, pages)`` as the per-page frees and
touches, and the table's ``claim_pristine`` / ``claim_front`` / ``take_pages`` /
``take_idle`` / ``drop_idle`` and the pool's ``unpublished_run`` as loops of single-block
calls (``claim_pristine_pages`` / ``free_pages`` / ``allocate_pages`` / ``touch_pages`` as the two calls
they stand for). Hypothesis drives one program through a batched slab and a per-page
slab of each engine and compares every page id, free order, prefix index and
huge-block state, and the two engines with each other.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvspec.engine import PRISTINE
from kvspec.errors import CapacityError

from kvfast._block_pool import BlockPool as FastPool
from kvfast._slab import FastSlabTable
from kvref._block_pool import BlockPool as RefPool
from kvref._slab import ReferenceSlabTable, Slab

ENGINES = {"kvref": (ReferenceSlabTable, RefPool), "kvfast": (FastSlabTable, FastPool)}
LEAVES = ("a", "b", "c")


def make_slab(engine: str, num_huge: int, ratios: dict[str, int]) -> Slab:
    table, pool = ENGINES[engine]
    return Slab(table(num_huge, len(ratios)), {lid: pool(num_huge * r) for lid, r in ratios.items()}, ratios)


def state(slab: Slab):
    """Everything observable: per leaf free order, ref counts and prefix index; the huge blocks."""
    t = slab.table
    leaves = {}
    for lid in slab.leaf_ids:
        inner = slab.inner[lid]
        leaves[lid] = (inner.free_order(), [int(c) for c in inner.ref_count], list(inner.block_hash),
                       sorted(inner.hash_to_block.items()), slab.num_free(lid))
    return leaves, t.parked_order(), [int(o) for o in t.owners()], [int(v) for v in t.live_counts()], t.num_parked


# One step of a program: (op, leaf index, amount, pick seed).
steps = st.lists(
    st.tuples(st.sampled_from(["alloc", "free", "touch", "publish"]), st.integers(0, 2), st.integers(1, 9),
              st.integers(0, 2**16)),
    max_size=40,
)


class Run:
    """One slab and the pages its program holds, driven either batched or page by page."""

    def __init__(self, engine: str, num_huge: int, ratios: dict[str, int], batched: bool):
        self.slab = make_slab(engine, num_huge, ratios)
        self.batched = batched
        self.held = {lid: [] for lid in ratios}
        self.log = []

    def apply(self, op: str, lid: str, n: int, seed: int) -> None:
        slab, held = self.slab, self.held[lid]
        rng = np.random.default_rng(seed)
        if op == "alloc":
            n = min(n, slab.num_free(lid))
            if self.batched:
                got = slab.allocate(lid, n)
            else:
                got = [slab.allocate_one(lid) for _ in range(n)]
            held += got
            self.log.append(got)
        elif op == "free" and held:
            k = int(rng.integers(1, len(held) + 1))
            pick = sorted(rng.choice(len(held), size=k, replace=False).tolist(), reverse=True)
            pages = [held.pop(i) for i in pick]  # distinct pages, in a shuffled order
            if self.batched:
                slab.free(lid, pages)
            else:
                for b in pages:
                    slab.free(lid, [b])
        elif op == "touch":
            inner = slab.inner[lid]
            cands = [b for b in inner.free_order() if inner.block_hash[b] is not None]
            pages = cands[: min(n, len(cands))]
            if self.batched:
                revived = slab.touch_many(lid, pages)
            else:
                revived = 0
                for b in pages:
                    revived += int(inner.ref_count[b] == 0)
                    slab.touch(lid, b)
            held += pages
            self.log.append(int(revived))
        elif op == "publish":
            inner = slab.inner[lid]
            for b in held[: n]:
                if inner.block_hash[b] is None:
                    inner.publish(b, bytes([b % 256, b // 256, seed % 256]) * 8, np.array([b, seed], np.int32))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_huge=st.integers(2, 9), ratios=st.lists(st.integers(1, 4), min_size=1, max_size=3), program=steps)
def test_batched_slab_calls_equal_the_per_page_sequence(num_huge, ratios, program):
    ratios = {LEAVES[i]: r for i, r in enumerate(ratios)}
    lids = list(ratios)
    runs = {(e, b): Run(e, num_huge, ratios, b) for e in ENGINES for b in (True, False)}
    for op, li, n, seed in program:
        lid = lids[li % len(lids)]
        for run in runs.values():
            run.apply(op, lid, n, seed)
        states = {key: state(run.slab) for key, run in runs.items()}
        ref = states[("kvref", False)]
        for key, s in states.items():
            assert s == ref, (key, op, lid, n)
        logs = {key: run.log for key, run in runs.items()}
        assert all(v == logs[("kvref", False)] for v in logs.values()), logs
    for run in runs.values():
        run.slab.check_invariants()


@settings(max_examples=80, deadline=None)
@given(num_huge=st.integers(2, 12), leaf=st.integers(0, 2), ks=st.lists(st.integers(0, 5), max_size=6),
       ratio=st.integers(1, 4), pages=st.lists(st.integers(0, 40), max_size=12))
def test_table_batches_equal_their_loops(num_huge, leaf, ks, ratio, pages):
    """claim_pristine = unpark + set_owner from the front; take_pages / take_idle / drop_idle = take /
    drop of each page's huge block, in order; on both tables."""
    for engine, (Table, _) in ENGINES.items():
        a, b = Table(num_huge, 3), Table(num_huge, 3)
        for k in ks:
            got = a.claim_pristine(leaf, k)
            want = []
            while len(want) < k and b.num_parked and b.owner[b.front()] == PRISTINE:
                h = b.front()
                b.unpark(h)
                b.set_owner(h, leaf)
                want.append(h)
            assert list(got) == want, engine
        assert (a.parked_order(), a.owners(), a.live_counts()) == (b.parked_order(), b.owners(), b.live_counts())
        held = [h for h in range(1, num_huge) if a.owner[h] != PRISTINE]
        ps = [p for p in pages if p // ratio in held]  # pages of claimed blocks
        if not ps:
            continue
        a.take_pages(ps, ratio)
        b.take([p // ratio for p in ps])
        rc = np.zeros(max(ps) + 1, np.int32)
        rc[ps[::2]] = 1  # every other page stays referenced
        refs = rc if engine == "kvfast" else rc.tolist()
        a.drop_idle(ps, ratio, refs)
        b.drop([p // ratio for p in ps if p and rc[p] == 0])
        assert (a.parked_order(), a.owners(), a.live_counts(), a.num_parked) == \
            (b.parked_order(), b.owners(), b.live_counts(), b.num_parked), engine
        distinct = list(dict.fromkeys(ps))
        a.take_idle(distinct, ratio, refs)
        b.take([p // ratio for p in distinct if rc[p] == 0])
        assert (a.parked_order(), a.live_counts(), a.num_parked) == (b.parked_order(), b.live_counts(), b.num_parked)
        for t in (a, b):
            assert all(t.parked_typed(i) == sum(1 for h in t.parked_order() if t.owner[h] == i) for i in range(3))
        k = min(len(ks) + 1, a.num_parked)  # the front blocks, pristine or typed, to another leaf
        got = a.claim_front((leaf + 1) % 3, k)
        want = ([], [])
        for _ in range(k):
            h = b.front()
            want[0].append(h)
            want[1].append(int(b.owner[h]))
            b.unpark(h)
            b.set_owner(h, (leaf + 1) % 3)
        assert (list(got[0]), [int(o) for o in got[1]]) == want, engine
        assert (a.parked_order(), a.owners(), a.num_parked) == (b.parked_order(), b.owners(), b.num_parked)
        assert all(a.parked_typed(i) == b.parked_typed(i) for i in range(3))


@settings(max_examples=80, deadline=None)
@given(num_huge=st.integers(2, 12), leaf=st.integers(0, 2), asks=st.lists(st.integers(0, 9), max_size=5),
       ratio=st.integers(1, 4), seed=st.integers(0, 2**16), retain=st.booleans())
def test_table_page_calls_equal_their_definitions(num_huge, leaf, asks, ratio, seed, retain):
    """claim_pristine_pages = claim_pristine + take_pages of the first pages; free_pages = the pool's
    free (or retain_free) + drop_idle; touch_pages = take_idle + the pool's touch_many;
    allocate_pages = the pool's allocate + take_pages; on both tables, with each engine's pool."""
    rng = np.random.default_rng(seed)
    for engine, (Table, Pool) in ENGINES.items():
        a, b = Table(num_huge, 3), Table(num_huge, 3)
        pa, pb = Pool(num_huge * ratio), Pool(num_huge * ratio)
        held = []
        for n in asks:
            got = a.claim_pristine_pages(leaf, n, ratio)
            want = b.claim_pristine(leaf, -(-n // ratio))
            pages = list(range(want.start * ratio, min(want.stop * ratio, want.start * ratio + n)))
            b.take_pages(pages, ratio)
            assert list(got) == list(want), engine
            assert (a.parked_order(), a.owners(), a.live_counts(), a.num_parked) == \
                (b.parked_order(), b.owners(), b.live_counts(), b.num_parked), engine
            held += pages
        if not held:
            continue
        for p in (pa, pb):  # the pages the claims took, referenced in their pools
            p.revoke(range(1, p.num_blocks))
            p.grant(held)
            assert p.allocate(len(held)) == held
        k = int(rng.integers(1, len(held) + 1))
        pages = [held[i] for i in rng.permutation(len(held))[:k].tolist()]
        claim = (int(rng.integers(0, 101)), float("inf")) if retain else None
        a.free_pages(pa, pages, ratio, claim)
        if retain:
            pb.retain_free(pages, *claim)
        else:
            pb.free(pages)
        b.drop_idle(pages, ratio, pb.ref_count)
        assert (a.parked_order(), a.owners(), a.live_counts(), a.num_parked) == \
            (b.parked_order(), b.owners(), b.live_counts(), b.num_parked), engine
        assert (pa.free_order(), [int(c) for c in pa.ref_count], pa.num_free) == \
            (pb.free_order(), [int(c) for c in pb.ref_count], pb.num_free), engine
        assert all(a.parked_typed(i) == b.parked_typed(i) for i in range(3))
        back = pages[: int(rng.integers(1, len(pages) + 1))]  # some freed pages referenced again
        got = a.touch_pages(pa, back, ratio)
        b.take_idle(back, ratio, pb.ref_count)
        assert int(got) == int(pb.touch_many(back)), engine
        assert (a.parked_order(), a.owners(), a.live_counts(), a.num_parked) == \
            (b.parked_order(), b.owners(), b.live_counts(), b.num_parked), engine
        assert (pa.free_order(), [int(c) for c in pa.ref_count], pa.num_free) == \
            (pb.free_order(), [int(c) for c in pb.ref_count], pb.num_free), engine
        assert all(a.parked_typed(i) == b.parked_typed(i) for i in range(3)), engine
        # allocate_pages = the pool's allocate + take_pages of the pages drawn (a draw past the free
        # pages: the pool's CapacityError, neither the pool nor the table changed); a published free
        # page the draw reaches is evicted (index entry dropped, on_evict told)
        evicted = {id(pa): [], id(pb): []}
        for p in (pa, pb):
            p.on_evict = evicted[id(p)].append
        extra = pa.allocate(min(2, pa.num_free))
        assert pb.allocate(len(extra)) == extra
        for j, blk in enumerate(extra):
            for p in (pa, pb):
                p.publish(blk, bytes([j + 1, seed % 256]) * 16, [blk])
        pa.free(extra)
        pb.free(extra)
        before = (a.parked_order(), a.owners(), a.live_counts(), a.num_parked, pa.free_order())
        with pytest.raises(CapacityError):
            a.allocate_pages(pa, pa.num_free + 1, ratio)
        assert (a.parked_order(), a.owners(), a.live_counts(), a.num_parked, pa.free_order()) == before, engine
        k = int(rng.integers(0, pa.num_free + 1))
        got = a.allocate_pages(pa, k, ratio)
        want = pb.allocate(k)
        b.take_pages(want, ratio)
        assert got == want and all(type(x) is int for x in got), engine
        assert (a.parked_order(), a.owners(), a.live_counts(), a.num_parked) == \
            (b.parked_order(), b.owners(), b.live_counts(), b.num_parked), engine
        assert (pa.free_order(), [int(c) for c in pa.ref_count], pa.num_free, list(pa.block_hash),
                dict(pa.hash_to_block), evicted[id(pa)]) == \
            (pb.free_order(), [int(c) for c in pb.ref_count], pb.num_free, list(pb.block_hash),
             dict(pb.hash_to_block), evicted[id(pb)]), engine


@settings(max_examples=80, deadline=None)
@given(n=st.integers(2, 40), program=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2**16)), max_size=30),
       ask=st.integers(0, 30))
def test_pool_unpublished_run_and_grant_revoke(n, program, ask):
    """unpublished_run(k) = the leading unpublished run of peek(k); grant / revoke of many pages equal
    their one-page loops; the two pools agree."""
    pools = {e: (P(n), P(n)) for e, (_, P) in ENGINES.items()}
    evicted = {key: [] for key in [(e, i) for e in ENGINES for i in (0, 1)]}
    for e, pair in pools.items():
        for i, p in enumerate(pair):
            p.on_evict = evicted[(e, i)].append
    held: list[int] = []
    off: list[int] = []
    for op, seed in program:
        rng = np.random.default_rng(seed)
        any_pool = pools["kvref"][0]
        if op == 0 and any_pool.num_free:
            k = int(rng.integers(1, any_pool.num_free + 1))
            got = {e: (a.allocate(k), b.allocate(k)) for e, (a, b) in pools.items()}
            assert len({tuple(x) for pair in got.values() for x in pair}) == 1
            held += got["kvref"][0]
            for e, (a, b) in pools.items():
                for blk in got["kvref"][0][k // 4 :]:
                    h = bytes([blk, seed % 256]) * 16
                    a.publish(blk, h, [blk])
                    b.publish(blk, h, [blk])
        elif op == 1 and held:
            k = int(rng.integers(1, len(held) + 1))
            pages = [held.pop(int(rng.integers(0, len(held)))) for _ in range(k)]
            for a, b in pools.values():
                a.free(pages)
                b.free(pages)
        elif op == 2:
            free = any_pool.free_order()
            # up to 9 pages: both the few-page loop and the kernel pass of kvfast
            size = min(int(rng.integers(1, 10)), len(free))
            pages = [free[i] for i in rng.permutation(len(free))[:size].tolist()]
            for a, b in pools.values():
                a.revoke(pages)
                for blk in pages:
                    b.revoke([blk])
            off += pages
        elif op == 3 and off:
            pages = off[: int(rng.integers(1, len(off) + 1))]
            del off[: len(pages)]
            for a, b in pools.values():
                a.grant(pages)
                for blk in reversed(pages):
                    b.grant([blk])
        runs = set()
        for a, b in pools.values():
            for p in (a, b):
                want = 0
                for blk in p.peek(ask):
                    if p.block_hash[blk] is not None:
                        break
                    want += 1
                assert p.unpublished_run(ask) == want
                runs.add((want, tuple(p.free_order()), p.num_free, tuple(p.block_hash)))
        assert len(runs) == 1, runs
    assert len({tuple(v) for v in evicted.values()}) == 1


def test_a_short_draw_raises_and_changes_nothing():
    """The batched draw keeps the check-then-commit rule: ``SlabLeafPool.allocate`` refuses a draw
    larger than ``num_free`` before touching anything."""
    for engine in ENGINES:
        slab = make_slab(engine, 3, {"a": 1, "b": 2})
        before = state(slab)
        try:
            slab.pools["a"].allocate(3)
        except CapacityError as e:
            assert "needs 3 blocks, 2 free or evictable" in str(e)
        else:
            raise AssertionError("allocate(3) of 2 pages did not raise")
        assert state(slab) == before


def test_a_batched_draw_stops_claiming_at_a_published_front_page():
    """spec/manager.md §13.2: while a pristine huge block exists, a published front page makes the
    next draw claim; the batched draw must split its run there exactly as page-by-page draws do."""
    for engine in ENGINES:
        out = []
        for batched in (True, False):
            slab = make_slab(engine, 8, {"a": 1, "b": 2})
            inner = slab.inner["a"]
            pages = slab.allocate("a", 3)  # pages 1, 2, 3
            for b in pages:
                inner.publish(b, bytes([b]) * 32, np.array([b], np.int32))
            slab.free("a", pages[::-1])  # published: to the back
            (fresh,) = slab.allocate("a", 1)  # front published, pristine left: claims huge block 4
            slab.free("a", [fresh])  # unpublished: to the front, ahead of the published pages
            got = slab.allocate("a", 3) if batched else [slab.allocate_one("a") for _ in range(3)]
            out.append((got, state(slab)))
        assert out[0] == out[1], engine
        assert out[0][0] == [4, 5, 6], engine  # page 4, then pristine blocks 5 and 6, no cached page evicted


def test_a_batched_draw_claims_parked_blocks_of_other_leaves_in_queue_order():
    """spec/manager.md §13.2: with no pristine block left and an empty free list, each page drawn
    past the claimed block's pages claims the next front block (evicting the other leaf's cached
    pages in it); the batched draw claims them in one table call, in queue order."""
    for engine in ENGINES:
        out = []
        for batched in (True, False):
            slab = make_slab(engine, 9, {"a": 1, "b": 2, "c": 3})
            evicted = []
            for lid in ("a", "c"):
                slab.inner[lid].on_evict = evicted.append
            a = slab.allocate("a", 4)  # huge blocks 1 .. 4
            c = slab.allocate("c", 12)  # huge blocks 5 .. 8: no pristine block left
            for i, b in enumerate(a):
                slab.inner["a"].publish(b, bytes([1, i]) * 16, np.array([b], np.int32))
            slab.inner["c"].publish(c[0], bytes([3, 0]) * 16, np.array([c[0]], np.int32))
            slab.free("a", [a[2], a[0]])  # parks 3 then 1
            slab.free("c", c[:3][::-1])  # parks 5
            slab.free("a", [a[3]])  # parks 4
            got = slab.allocate("b", 7) if batched else [slab.allocate_one("b") for _ in range(7)]
            out.append((got, evicted, state(slab)))
        assert out[0] == out[1], engine
        # blocks 3, 1, 5, 4 in queue order: pages 6, 7, 2, 3, 10, 11, 8 (block 4's page 9 stays free)
        assert out[0][0] == [6, 7, 2, 3, 10, 11, 8], (engine, out[0][0])
        assert len(out[0][1]) == 4, engine  # a's three cached pages and c's one, evicted


@pytest.mark.parametrize("engine", list(ENGINES))
def test_free_pages_refused_as_its_two_calls(engine):
    """free_pages with a claim over a run (one kernel call for kvfast's pool and table) refuses as
    ``retain_free`` then ``drop_idle`` do: a bad claim changes nothing; a page without a reference
    raises the pool's AssertionError after the pages before it were freed, and the table is not
    touched (the definition never reaches ``drop_idle``)."""
    Table, Pool = ENGINES[engine]

    def setup():
        t, p = Table(8, 1), Pool(8)
        pages = list(t.claim_pristine_pages(0, 5, 1))
        p.revoke(range(1, p.num_blocks))
        p.grant(pages)
        assert p.allocate(len(pages)) == pages
        return t, p, pages

    def seen(t, p):
        return (t.parked_order(), t.owners(), t.live_counts(), t.num_parked, p.free_order(),
                [int(c) for c in p.ref_count], p.num_free)

    t, p, pages = setup()
    before = seen(t, p)
    with pytest.raises(ValueError, match="priority"):
        t.free_pages(p, pages, 1, (101, float("inf")))
    assert seen(t, p) == before
    a, pa, pages = setup()
    b, pb, _ = setup()
    a.free_pages(pa, [pages[2]], 1, (40, float("inf")))  # page 3 loses its only reference
    pb.retain_free([pages[2]], 40, float("inf"))
    b.drop_idle([pages[2]], 1, pb.ref_count)
    with pytest.raises(AssertionError, match="ref_count=0"):
        a.free_pages(pa, pages[::-1], 1, (40, float("inf")))
    with pytest.raises(AssertionError, match="ref_count=0"):
        pb.retain_free(pages[::-1], 40, float("inf"))
    assert seen(a, pa) == seen(b, pb)
