"""Leaves as classes (issue 12, deliverable 4): each leaf kind holds its own hit, sizing and
commit rules in ``kvref/_leaves.py``, and the policy (``kvref/_manager.py`` and the files of its
halves) asks the leaf instead of branching on its kind (spec/manager.md §3.2, §4.6, §5)."""

from __future__ import annotations

import ast
import inspect

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvspec import KVCacheParams, LeafKind, LeafSpec
from kvspec.engine import NULL_BLOCK

from kvref import _allocation, _batch, _commit, _manager, _prefix_hits, _runtime_inputs, _transfers
from kvref._leaves import FullLeaf, Leaf, RecurrentLeaf, Residency, SlidingWindowLeaf, joint_hit
from kvref._request import _AllocPlan, _Request
from kvspec._manager_types import LUT_ALIGN

PAGE = 16


class Held:
    """The Residency surface: ``resident(i)``, the run from the root, the pages of blocks."""

    def __init__(self, held, base: int = 100):
        self.held, self.base = set(held), base

    def __call__(self, i: int) -> bool:
        return i in self.held

    def run(self, k: int) -> int:
        return next((i for i in range(k) if i not in self.held), k)

    def span(self, lo: int, k: int) -> int:
        return next((i for i in range(lo, k) if i not in self.held), k) - lo

    def deepest(self, k: int) -> int:
        return next((j for j in range(k, 0, -1) if j - 1 in self.held), 0)

    def page(self, i: int):
        return self.base + i if i in self.held else None

    def pages(self, lo: int, k: int) -> list:
        return [self.page(i) for i in range(lo, k)]


@pytest.fixture
def full():
    return Leaf.make("full", LeafSpec.full(), PAGE)


@pytest.fixture
def swa():
    return Leaf.make("swa", LeafSpec.sliding_window(128), PAGE)


@pytest.fixture
def rec():
    return Leaf.make("rec", LeafSpec.recurrent((4, 8)), PAGE)


# --------------------------------------------------------------------------- the factory


@pytest.mark.parametrize(("spec", "cls"), [
    (LeafSpec.full(), FullLeaf),
    (LeafSpec.sliding_window(128), SlidingWindowLeaf),
    (LeafSpec.recurrent((4,)), RecurrentLeaf),
])
def test_factory_gives_the_class_of_the_kind(spec, cls):
    leaf = Leaf.make("x", spec, PAGE)
    assert type(leaf) is cls
    assert isinstance(leaf, Leaf)
    assert leaf.kind is spec.kind is cls.KIND
    assert (leaf.leaf_id, leaf.spec, leaf.page_size) == ("x", spec, PAGE)
    assert leaf.is_recurrent is (spec.kind is LeafKind.RECURRENT)
    assert leaf.is_sliding is (spec.kind is LeafKind.SLIDING_WINDOW)


def test_every_kind_has_a_class():
    for kind in LeafKind:
        spec = {LeafKind.FULL: LeafSpec.full(), LeafKind.SLIDING_WINDOW: LeafSpec.sliding_window(8),
                LeafKind.RECURRENT: LeafSpec.recurrent((2,))}[kind]
        assert Leaf.make("x", spec, 4).KIND is kind


def test_base_class_is_not_a_leaf_and_a_class_serves_one_kind():
    with pytest.raises(TypeError, match=r"Leaf is the base of the leaf kinds; build a leaf with Leaf\.make"):
        Leaf("x", LeafSpec.full(), PAGE)
    with pytest.raises(ValueError, match=r"FullLeaf: leaf 'x' has kind 'sliding_window', the class serves 'full'"):
        FullLeaf("x", LeafSpec.sliding_window(8), PAGE)
    assert type(FullLeaf("x", LeafSpec.full(), PAGE)) is FullLeaf


def test_tier_tag_names_the_layout(swa, rec):
    assert swa.tier_tag == b"swa|sliding_window|128||float32"
    assert rec.tier_tag == b"rec|recurrent|0|4,8|float32"


# --------------------------------------------------------------------------- geometry and sizing


def test_sliding_window_128_page_16(swa):
    # the query token is inside its own window: 127 tokens before it, ceil(127 / 16) = 8 blocks
    assert swa.blocks_in_window == 8
    assert [swa.window_start(k) for k in (0, 5, 8, 9, 20)] == [0, 0, 0, 1, 12]
    assert swa.pages_to_hold(100) == 7  # ceil(100 / 16), shorter than the window
    assert swa.pages_to_hold(1000) == 9  # the window's 8 pages and the current one
    assert swa.needed_blocks(0, 20) == list(range(12, 20))
    assert swa.needed_blocks(15, 20) == [15, 16, 17, 18, 19]
    assert swa.needed_blocks(20, 20) == []
    assert swa.needed_blocks(0, 3) == [0, 1, 2]


def test_full_leaf_sizes(full):
    assert full.blocks_in_window == 0
    assert full.window_start(20) == 0
    assert full.pages_to_hold(100) == 7
    assert full.pages_to_hold(1000) == 63
    assert full.needed_blocks(3, 6) == [3, 4, 5]
    assert full.needed_blocks(6, 6) == []
    assert full.pages_to_admit(100, True) == 7


def test_recurrent_leaf_sizes(rec):
    assert rec.pages_to_hold(10_000) == 1
    assert rec.needed_blocks(0, 5) == [4]
    assert rec.needed_blocks(5, 5) == []
    assert rec.window_start(9) == 0
    assert rec.pages_to_admit(10_000, True) == 2  # live page and successor
    assert rec.pages_to_admit(10_000, False) == 1


def test_grow_need(full, swa, rec):
    # spec/manager.md §4.6: a paged row grows to the required blocks (negative: past the need)
    assert full.grow_need(3, 5, True) == 2
    assert swa.grow_need(7, 5, False) == -2
    # recurrent: the live page when empty, and with prefix caching a successor
    assert [rec.grow_need(have, 10, True) for have in (0, 1, 2)] == [2, 1, 0]
    assert [rec.grow_need(have, 10, False) for have in (0, 1, 2)] == [1, 0, 0]


def test_fresh_states(full, rec):
    assert rec.fresh_states([7, 8], 2) == [7]  # drawn into an empty row: the live state starts at zero
    assert rec.fresh_states([7, 8], 1) == []  # a successor added to a live state
    assert full.fresh_states([1, 2, 3], 3) == []


def test_buffers_and_tier_units(full, rec):
    params = KVCacheParams(page_size=PAGE, num_layers=2, kv_heads=2, head_dim=8,
                           leaves={"full": LeafSpec.full(), "rec": LeafSpec.recurrent((4, 8))})
    assert full.dtype(params) == params.np_dtype
    assert full.page_shape(params) == (2, 2, PAGE, 2, 8)
    assert full.row_bytes(params) == params.np_dtype.itemsize * 8
    assert rec.page_shape(params) == (4, 8)
    assert rec.dtype(params) == np.dtype(np.float32)
    assert rec.row_bytes(params) == 4 * 8
    unit = params.page_bytes("full")
    assert full.tier_units(params, unit) == 1
    assert rec.tier_units(params, 100) == -(-params.page_bytes("rec") // 100) == 2  # 128 bytes in units of 100


# --------------------------------------------------------------------------- the hit rule


def test_hit_rule_per_kind(full, swa, rec):
    held = Held({0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 12, 13})  # a hole at block 4
    assert full.best(14, held) == 4  # the resident run from the root
    assert swa.best(14, held) == 14  # blocks 6 .. 13 form a complete window before the stop
    assert swa.best(12, held) == 4  # windows of stops 5 .. 12 hold block 4; stop 4: the root run
    assert rec.best(14, Held({2, 9})) == 10  # the deepest checkpoint: after block 9
    assert rec.best(9, Held({2, 9})) == 3
    assert rec.best(2, Held({2, 9})) == 0


def test_joint_hit_asks_full_then_sliding_then_recurrent(full, swa, rec):
    assert [leaf.hit_order for leaf in (full, swa, rec)] == [0, 1, 2]
    res = {"full": Held(range(30)), "swa": Held(set(range(30)) - {12}), "rec": Held({19, 11})}
    # rec 20 -> swa needs 12..19: hole; swa 12 -> rec 12 (checkpoint 11) -> swa needs 4..11: held
    assert joint_hit([rec, swa, full], 30, res) == 12


def _accepts(leaf: Leaf, k: int, held: set) -> bool:
    """spec/manager.md §3.2's acceptance rule of a hit of ``k`` blocks, written from the text."""
    if leaf.kind is LeafKind.FULL:
        return all(i in held for i in range(k))
    if leaf.kind is LeafKind.SLIDING_WINDOW:
        return all(i in held for i in range(max(0, k - leaf.blocks_in_window), k))
    return k == 0 or k - 1 in held


@settings(max_examples=200, deadline=None)
@given(cap=st.integers(0, 24), window=st.integers(2, 13), kinds=st.lists(st.sampled_from(list(LeafKind)), min_size=1,
       max_size=4), held=st.lists(st.sets(st.integers(0, 23)), min_size=4, max_size=4))
def test_joint_hit_is_the_longest_hit_every_leaf_accepts(cap, window, kinds, held):
    """spec/manager.md §3.2: whatever the leaves and their residency, the joint hit is the longest
    ``k <= cap`` every leaf accepts (the fixed point; asking the leaves in a cycle stops once all
    of them in a row answered the same length)."""
    specs = {LeafKind.FULL: LeafSpec.full(), LeafKind.SLIDING_WINDOW: LeafSpec.sliding_window(window),
             LeafKind.RECURRENT: LeafSpec.recurrent((2,))}
    leaves = [Leaf.make(f"l{i}", specs[kind], 2) for i, kind in enumerate(kinds)]
    res = {leaf.leaf_id: Held(held[i]) for i, leaf in enumerate(leaves)}
    want = max(k for k in range(cap + 1) if all(_accepts(leaf, k, held[i]) for i, leaf in enumerate(leaves)))
    assert joint_hit(leaves, cap, res) == want


def test_plan_and_commit_a_hit(swa, rec):
    plan = _AllocPlan()
    held = Held(range(20))
    pages = swa.hit_pages(10, held)
    assert pages == [102, 103, 104, 105, 106, 107, 108, 109]
    swa.plan_hit(plan, 10, pages)
    assert plan.rows["swa"] == [NULL_BLOCK, NULL_BLOCK, *pages]
    assert plan.nulled["swa"] == 2
    assert rec.hit_pages(10, held) == [109]
    assert rec.hit_pages(0, held) == []
    rec.plan_hit(plan, 10, [109])
    assert plan.restore == {"rec": 109}
    # a checkpoint a peer holds (None): its source moves from leaf_peer to restore_peer
    peer = _AllocPlan()
    peer.leaf_peer[("rec", 9)] = (1, 44)
    rec.plan_hit(peer, 10, [None])
    assert peer.restore_peer == {"rec": (1, 44)} and peer.leaf_peer == {}

    class Pool:
        def __init__(self):
            self.touched = []

        def touch(self, b):
            self.touched.append(b)

        def touch_many(self, bs):
            self.touched += list(bs)

    req = _Request(ctx=None, replica=0, rows={"swa": [], "rec": []})
    pool = Pool()
    swa.commit_hit(req, plan, pool, 4)
    assert pool.touched == [102, 103]  # the local part above the nulled slots
    assert req.rows["swa"] is plan.rows["swa"] and req.nulled["swa"] == 2
    pool = Pool()
    rec.commit_hit(req, plan, pool, 10)
    assert pool.touched == [109] and req.restore == {"rec": 109}
    assert rec.first_state_copy([], [5, 6], plan, req) == ("restore", "rec", 109, 5)
    assert rec.first_state_copy([3], [5], plan, req) is None
    assert rec.first_state_copy([], [5, 6], peer, req) == ("leafpeer", ("rec", 1), 44, 5)
    assert swa.first_state_copy([], [5], plan, req) is None


def test_loads_and_inputs(full, swa, rec):
    assert swa.load_destinations([0, 0, 7, 8, 9], [3, 4]) == [8, 9]
    assert rec.load_destinations([3, 4], [9]) == [4]  # the successor receives the checkpoint
    widths = [3, 5]
    assert full.table_widths(widths) == [3, 5] and full.table_columns(16) == 16
    assert rec.table_widths(widths) == [1, 1] and rec.table_columns(16) == LUT_ALIGN
    assert (full.row_width(5), rec.row_width(5)) == (5, 1)
    assert (full.binds_rows, swa.binds_rows, rec.binds_rows) == (False, False, True)
    assert full.row_shortfall([1, 2], 32, "current_position") is None
    assert full.row_shortfall([1, 2], 33, "current_position") == (
        "holds 2 blocks of leaf 'full' (32 tokens) < current_position=33; it does not have sufficient blocks, "
        "alloc must be called first")
    assert rec.row_shortfall([4], 10_000, "seq_len") is None
    assert rec.row_shortfall([], 1, "seq_len") == "holds no state page of leaf 'rec'; alloc must be called first"


def test_row_invariants(full, swa, rec):
    assert swa.check_row("p", "a", [0, 0, 5, 6], {"swa": 2}) == 2
    assert list(swa.committed_blocks(2, 4)) == [2, 3]
    assert full.check_row("p", "a", [4, 5], {"full": 3}) == 0  # a full row has no nulled slots
    with pytest.raises(AssertionError, match=r"p: request 'a' leaf 'full' row \[0, 5\] holds block 0 at or above slot 0"):
        full.check_row("p", "a", [0, 5], {})
    with pytest.raises(AssertionError, match=r"live page below window"):
        swa.check_row("p", "a", [3, 0, 5], {"swa": 2})
    assert rec.check_row("p", "a", [3, 4], {}) == 0
    assert list(rec.committed_blocks(0, 9)) == []
    with pytest.raises(AssertionError, match=r"p: request 'a' state row \[3, 4, 5\]"):
        rec.check_row("p", "a", [3, 4, 5], {})


# --------------------------------------------------------------------------- the structure holds

#: Kind tests the policy may make: membership lists built once in ``__init__``.
MAX_KIND_TESTS_IN_INIT = 5


def _kind_tests(node: ast.AST) -> list[int]:
    """Lines of ``x.is_sliding``, ``x.is_recurrent``, ``LeafKind.X`` or a leaf class named under ``node``."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and (n.attr in ("is_sliding", "is_recurrent") or (
                isinstance(n.value, ast.Name) and n.value.id == "LeafKind")) or isinstance(n, ast.Name) and n.id in ("FullLeaf", "SlidingWindowLeaf", "RecurrentLeaf"):
            out.append(n.lineno)
    return out


#: The policy: the front class and the halves it mixes in (spec/manager.md §12).
POLICY = {_manager: "PagedKVCacheManager", _prefix_hits: "PrefixHits", _allocation: "Allocation",
          _commit: "Commit", _transfers: "Transfers", _runtime_inputs: "RuntimeInputs", _batch: "BatchCalls"}


def test_the_policy_is_the_front_class_and_its_halves():
    assert _manager.PagedKVCacheManager.__mro__[1:-1] == tuple(getattr(m, name) for m, name in POLICY.items()
                                                               if m is not _manager)


@pytest.mark.parametrize("module", list(POLICY), ids=lambda m: m.__name__)
def test_the_policy_does_not_branch_on_leaf_kind(module):
    tree = ast.parse(inspect.getsource(module))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == POLICY[module]]
    in_init, elsewhere = [], []
    for n in tree.body:
        if n is cls:
            for m in cls.body:
                (in_init if getattr(m, "name", None) == "__init__" else elsewhere).extend(_kind_tests(m))
        else:
            elsewhere.extend(_kind_tests(n))
    # (the import of LeafKind is an ImportFrom, not an attribute: not counted)
    assert elsewhere == [], f"{module.__file__} branches on leaf kind outside __init__ at lines {elsewhere}"
    assert len(in_init) <= MAX_KIND_TESTS_IN_INIT, f"kind tests in __init__ at lines {in_init}"


@settings(deadline=None)
@given(window=st.integers(2, 40), page=st.sampled_from([1, 2, 4, 16]), k=st.integers(0, 30),
       held=st.sets(st.integers(0, 30)))
def test_sliding_best_is_the_longest_stop_with_a_whole_window(window, page, k, held):
    """spec/manager.md §3.2 sliding, by its definition: the largest j <= k whose window
    [window_start(j), j) is resident (the rule jumps over stops a missing block rules out)."""
    leaf = Leaf.make("swa", LeafSpec.sliding_window(window), page)
    want = next((j for j in range(k, 0, -1) if all(i in held for i in range(leaf.window_start(j), j))), 0)
    assert leaf.best(k, Held(held)) == want


def test_residency_span_memoises_one_batched_lookup():
    import kvref

    pool = kvref.BlockPool(12)
    toks = np.arange(40, dtype=np.int32)
    hashes = [bytes([i]) * 32 for i in range(10)]
    pages = [int(b) for b in pool.allocate(10)]
    for i in (0, 1, 2, 4, 5, 6, 7):
        pool.publish(pages[i], hashes[i], toks[4 * i : 4 * i + 4])
    calls = []
    real = pool.lookup_run
    pool.lookup_run = lambda h, t: calls.append(len(h)) or real(h, t)
    res = Residency(pool, hashes, toks, 4)
    assert res.span(4, 9) == 4  # blocks 4, 5, 6, 7 held, 8 missing
    assert res.span(4, 8) == 4
    assert res.span(0, 4) == 3  # 3 missing
    assert res(8) is False and res(2) is True and res.page(5) == pages[5]
    assert res.span(5, 7) == 2 and res.span(3, 5) == 0
    assert calls == [5, 4]  # [4, 9) once; [0, 4) once; everything after from the memo


@settings(deadline=None, max_examples=60)
@given(pkg=st.sampled_from(["kvref", "kvfast"]), k=st.integers(0, 24), published=st.sets(st.integers(0, 23)),
       collided=st.sets(st.integers(0, 23)))
def test_recurrent_best_is_the_deepest_checkpoint_verified(pkg, k, published, collided):
    """spec/manager.md §3.2 recurrent, by its definition (the largest j <= k whose block j - 1 is
    resident, tokens verified), over a real pool of either engine: a block in ``collided`` is
    published under its hash with other tokens (a collision), so it is indexed but not resident.
    The search asks ``lookup`` only for indexed candidates (``last_indexed`` probes the rest)."""
    import importlib

    pool = importlib.import_module(pkg).BlockPool(30)
    toks = np.arange(24 * 4, dtype=np.int32)
    hashes = [bytes([i]) * 32 for i in range(24)]
    pages = [int(b) for b in pool.allocate(24)]
    for i in sorted(published | collided):
        stored = toks[4 * i : 4 * i + 4] + (1000 if i in collided else 0)
        pool.publish(pages[i], hashes[i], stored)
    resident = {i for i in published if i not in collided}
    want = next((j for j in range(k, 0, -1) if j - 1 in resident), 0)
    leaf = Leaf.make("rec", LeafSpec.recurrent((2,)), 4)
    asked = []
    real = pool.lookup
    pool.lookup = lambda h, t: asked.append(h) or real(h, t)
    assert leaf.best(k, Residency(pool, hashes, toks, 4)) == want
    indexed = {hashes[i] for i in published | collided}
    assert set(asked) <= indexed and len(asked) <= len(collided) + 1
