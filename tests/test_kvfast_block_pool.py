"""kvfast's BlockPool against kvref's, side by side (Hypothesis state machine).

After every rule both pools must agree on the returned value (or exception
type and message), the free order, ref counts, published hashes and tokens,
the prefix index and the hashes reported to ``on_evict``.
"""

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvref._block_pool as ref_mod
from kvfast._block_pool import BlockPool as FastPool
from kvspec.errors import CapacityError

NUM_BLOCKS = 9
HASHES = [bytes([i]) * 4 for i in range(6)]  # few hashes: collisions and twins happen
TOKENS = [np.array(t, np.int32) for t in ([1, 2], [1, 3], [2, 2])]


def _call(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # compared by type and message
        return ("err", type(e), str(e))


class PoolComparison(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.ref_evicted, self.fast_evicted = [], []
        self.ref = ref_mod.BlockPool(NUM_BLOCKS, on_evict=self.ref_evicted.append)
        self.fast = FastPool(NUM_BLOCKS, on_evict=self.fast_evicted.append)
        self.held: list[int] = []  # one entry per reference we hold
        self.snap = None

    def both(self, name, *args):
        a = _call(lambda: getattr(self.ref, name)(*args))
        b = _call(lambda: getattr(self.fast, name)(*args))
        assert a == b, (name, args, a, b)
        return a

    # -- mutations
    @rule(n=st.integers(0, NUM_BLOCKS))
    def allocate(self, n):
        out = self.both("allocate", n)
        if out[0] == "ok":
            self.held += out[1]
        else:
            assert out[1] is CapacityError

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_tail_first(self, data):
        k = data.draw(st.integers(1, len(self.held)))
        start = data.draw(st.integers(0, len(self.held) - k))
        chunk = self.held[start : start + k]
        del self.held[start : start + k]
        self.both("free", chunk[::-1])

    @rule(data=st.data())
    def touch(self, data):
        cands = [b for b in range(1, NUM_BLOCKS) if self.ref.ref_count[b] > 0 or self.ref.is_published(b)]
        if not cands:
            return
        b = data.draw(st.sampled_from(cands))
        self.both("touch", b)
        self.held.append(b)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), h=st.sampled_from(HASHES), t=st.sampled_from(range(len(TOKENS))))
    def publish(self, data, h, t):
        b = data.draw(st.sampled_from(self.held))
        self.both("publish", b, h, TOKENS[t])

    @precondition(lambda self: self.held)
    @rule(data=st.data(), n=st.integers(1, 4))
    def publish_run(self, data, n):
        """A run of a request's row: twins (a prefix published first), fresh blocks, collisions."""
        blocks = data.draw(st.lists(st.sampled_from(sorted(set(self.held))), min_size=1, max_size=n, unique=True))
        hashes = data.draw(st.lists(st.sampled_from(HASHES), min_size=len(blocks), max_size=len(blocks),
                                    unique=True))
        toks = np.concatenate([TOKENS[data.draw(st.sampled_from(range(len(TOKENS))))] for _ in blocks])
        self.both("publish_run", list(blocks), list(hashes), toks)

    @rule(h=st.sampled_from(HASHES), t=st.sampled_from(range(len(TOKENS))))
    def lookup(self, h, t):
        self.both("lookup", h, TOKENS[t])
        self.both("contains_hash", h)
        for stop in (0, 1, len(HASHES) // 2, len(HASHES)):
            self.both("last_indexed", list(HASHES), stop)

    @rule()
    def reset_prefix_cache(self):
        self.both("reset_prefix_cache")

    @rule()
    def take_snapshot(self):
        self.snap = (self.ref.snapshot(), self.fast.snapshot(), list(self.held))

    @precondition(lambda self: self.snap is not None)
    @rule()
    def restore_snapshot(self):
        r, f, held = self.snap
        self.ref.restore(r)
        self.fast.restore(f)
        self.held = list(held)

    @rule()
    def null_block_refused(self):
        self.both("touch", 0)
        self.both("publish", 0, HASHES[0], TOKENS[0])

    @precondition(lambda self: not self.held)
    @rule()
    def reset(self):
        self.both("reset")

    # -- comparison
    @invariant()
    def agree(self):
        r, f = self.ref, self.fast
        assert r.free_order() == f.free_order()
        assert r.num_free == f.num_free
        assert list(r.ref_count) == f.ref_count.tolist()
        assert r.block_hash == f.block_hash
        assert r.hash_to_block == f.hash_to_block
        for a, b in zip(r.block_tokens, f.block_tokens):
            assert (a is None and b is None) or np.array_equal(a, b)
        assert self.ref_evicted == self.fast_evicted
        for b in range(NUM_BLOCKS):
            assert r.is_free(b) == f.is_free(b) and r.is_published(b) == f.is_published(b)
        refs = {}
        for b in self.held:
            refs[b] = refs.get(b, 0) + 1
        r.check_invariants(refs)
        f.check_invariants(refs)


TestPoolComparison = PoolComparison.TestCase


def test_free_of_unreferenced_block_raises_like_reference():
    r, f = ref_mod.BlockPool(4), FastPool(4)
    for p in (r, f):
        p.allocate(2)
    a = _call(lambda: r.free([1, 3]))
    b = _call(lambda: f.free([1, 3]))
    assert a == b and a[1] is AssertionError
    assert r.free_order() == f.free_order()


def test_constructor_rejects_tiny_pool():
    with pytest.raises(ValueError, match=r"num_blocks=1, must be >= 2"):
        FastPool(1)


def test_check_invariants_catches_corruption():
    f = FastPool(5)
    f.allocate(2)
    f.ref_count[3] = 1  # a free block with a reference
    with pytest.raises(AssertionError, match=r"block 3 ref_count=1 but free=True"):
        f.check_invariants()


def test_bulk_order_matches_reference():
    rng = np.random.default_rng(1)
    r, f = ref_mod.BlockPool(200), FastPool(200)
    held = []
    for step in range(300):
        n = int(rng.integers(0, 8))
        if n <= r.num_free:
            a, b = r.allocate(n), f.allocate(n)
            assert a == b
            held.append(a)
        if held and rng.random() < 0.5:
            blocks = held.pop(int(rng.integers(len(held))))
            for i, blk in enumerate(blocks):
                if rng.random() < 0.5:
                    h = bytes([i % 7, step % 5])
                    assert r.publish(blk, h, [i % 3]) == f.publish(blk, h, [i % 3])
            r.free(blocks[::-1])
            f.free(blocks[::-1])
        assert r.free_order() == f.free_order()
    f.check_invariants()


def test_copies_are_independent_pools():
    """A deep copy or a pickled copy of the fast pool (its one-block paths write through
    memoryviews) owns its own arrays: changes to the copy leave the original as it was."""
    import copy
    import pickle

    p = FastPool(10)
    held = p.allocate(3)
    p.publish(held[0], b"h", [1, 2])
    before = (p.ref_count.tolist(), p.free_order(), dict(p.hash_to_block))
    for q in (copy.deepcopy(p), pickle.loads(pickle.dumps(p))):
        q.free([held[1]])
        q.touch(held[1])
        q.free([held[1]])
        fresh = q.allocate_one()
        q.check_invariants({held[0]: 1, held[2]: 1, fresh: 1})
        assert (p.ref_count.tolist(), p.free_order(), dict(p.hash_to_block)) == before


@pytest.mark.parametrize("form", ["int32", "int64", "list"])
def test_token_verification_reads_values_in_any_token_form(form):
    """The fast pool verifies stored tokens by comparing int32 runs (their bytes): tokens handed
    as an int32 array, an int64 array (or, for one block, a list) are read as the same int32
    values, so hits, twins and collisions come out as in the reference pool for every form."""
    toks = np.array([5, 6, 7, 8], np.int32)
    other = np.array([5, 6, 7, 9], np.int32)

    def run(a):
        return a.astype(np.int64) if form == "int64" else a

    def one(a):
        return {"int32": a, "int64": a.astype(np.int64), "list": a.tolist()}[form]

    hs = [b"a" * 4, b"b" * 4]
    out = []
    for pool in (ref_mod.BlockPool(12), FastPool(12)):
        mine, twins, third = pool.allocate(2), pool.allocate(2), pool.allocate(1)
        got = [pool.publish_run(mine, hs, run(toks))]
        got.append(pool.publish_run(twins, hs, run(toks)))  # same hashes and tokens: the published twins
        got.append(pool.lookup_run(hs, run(toks)))  # both blocks hit
        got.append(pool.lookup_run(hs, run(other)))  # the second block's tokens differ: one hit
        got.append([pool.lookup(h, one(toks[2 * i : 2 * i + 2])) for i, h in enumerate(hs)])
        got.append([pool.lookup(h, one(other[2 * i : 2 * i + 2])) for i, h in enumerate(hs)])
        got.append(pool.publish(third[0], hs[1], one(other[2:])))  # hs[1] held by other tokens: a collision
        # a fresh block, then one whose hash and tokens are published (the block-by-block path)
        hs2, tail = [b"c" * 4, b"d" * 4], pool.allocate(1)
        got.append(pool.publish_run(tail, hs2[1:], run(toks[2:])))
        pair = pool.allocate(2)
        got.append(pool.publish_run(pair, hs2, run(toks)))
        out.append(got)
    assert out[0] == out[1]
    assert out[1][:6] == [[1, 2], [1, 2], [1, 2], [1], [1, 2], [1, None]] and out[1][6] == 5
    assert out[1][7] == [6] and out[1][8] == [7, 6]  # the second block of the pair is the twin


def test_per_element_helpers_are_compiled_without_reference_counts():
    """The helpers the free-list and slab kernels call once per block (a link, a claim merge, a
    block's reference) are ``inner_kernel``s: compiled without NRT, whose incref/decref of every
    array argument at each call cost 15x the helper's own work (kvfast/_numba/__init__.py). A
    helper turned back into a plain ``@njit`` fails here; a Numba without the option keeps plain
    helpers (``_INNER`` is then empty) and the test says so."""
    import kvfast._numba as nb
    from kvfast import _slab
    from kvfast._numba import freelist

    if not nb._INNER:
        pytest.skip("this Numba's CPU target has no _nrt option: the helpers keep reference counts")
    helpers = [getattr(freelist, n) for n in ("_front", "insert_before", "_append", "_requeue", "_merge_claim",
                                              "_release", "unlink")] + [_slab._ref_one, _slab._unref_one]
    assert [h.targetoptions.get("_nrt") for h in helpers] == [False] * len(helpers)
    # the kernels that Python calls keep NRT (they are handed arrays from Python)
    assert freelist.free_many.targetoptions.get("_nrt", True) is True
