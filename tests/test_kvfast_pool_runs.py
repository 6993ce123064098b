"""kvfast BlockPool's batch methods (``publish_run``, ``lookup_run``, ``publish`` of int32
tokens read in place, ``count_free``, ``allocate_one``) against a loop of kvref's per-block ``publish``/``lookup``.

The state machine of ``test_kvfast_block_pool`` gains rules that call a batch
method on the fast pool and the equivalent loop on the reference pool; its
invariant then compares the whole state (free order, ref counts, hashes,
index, tokens, evictions) after every rule.
"""

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from test_kvfast_block_pool import HASHES, NUM_BLOCKS, TOKENS, PoolComparison, _call

from kvfast._block_pool import BlockPool as FastPool


def _ref_publish_run(pool, blocks, hashes, toks):
    """A loop of ``publish`` that stops at the first collision (spec/manager.md §5.1 chain rule)."""
    out = []
    for b, h, t in zip(blocks, hashes, toks):
        c = pool.publish(b, h, t)
        if c == b and pool.block_hash[b] is None:
            break
        out.append(c)
    return out


def _ref_lookup_run(pool, hashes, toks):
    out = []
    for h, t in zip(hashes, toks):
        b = pool.lookup(h, t)
        if b is None:
            break
        out.append(b)
    return out


class RunComparison(PoolComparison):
    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def publish_run(self, data):
        n = data.draw(st.integers(1, 4))
        blocks = data.draw(st.lists(st.sampled_from(self.held), min_size=n, max_size=n))
        hashes = data.draw(st.lists(st.sampled_from(HASHES), min_size=n, max_size=n))
        toks = [TOKENS[i] for i in data.draw(st.lists(st.integers(0, len(TOKENS) - 1), min_size=n, max_size=n))]
        want = _ref_publish_run(self.ref, blocks, hashes, toks)
        got = self.fast.publish_run(blocks, hashes, b"".join(t.astype("<i4").tobytes() for t in toks))
        assert got == want

    @precondition(lambda self: self.held)
    @rule(data=st.data(), h=st.sampled_from(HASHES), t=st.integers(0, len(TOKENS) - 1))
    def publish_int32_in_place(self, data, h, t):
        # the fast pool reads an int32 array without converting it; what it stores must not alias
        # the caller's array (scribbled on after the call; the invariant compares stored tokens)
        b = data.draw(st.sampled_from(self.held))
        mine = TOKENS[t].copy()
        assert self.fast.publish(b, h, mine) == self.ref.publish(b, h, TOKENS[t])
        mine[:] = -7

    @rule(data=st.data())
    def lookup_run(self, data):
        n = data.draw(st.integers(0, 5))
        hashes = data.draw(st.lists(st.sampled_from(HASHES), min_size=n, max_size=n))
        toks = [TOKENS[i] for i in data.draw(st.lists(st.integers(0, len(TOKENS) - 1), min_size=n, max_size=n))]
        got = self.fast.lookup_run(hashes, b"".join(t.astype("<i4").tobytes() for t in toks))
        assert got == _ref_lookup_run(self.ref, hashes, toks)

    @rule()
    def allocate_one(self):
        a = _call(lambda: self.ref.allocate(1))
        b = _call(lambda: [self.fast.allocate_one()])
        assert a == b
        if a[0] == "ok":
            self.held += a[1]

    @rule(data=st.data())
    def count_free(self, data):
        blocks = data.draw(st.lists(st.integers(1, NUM_BLOCKS - 1), unique=True, max_size=4))
        assert self.fast.count_free(blocks) == sum(self.ref.ref_count[b] == 0 for b in blocks)


TestRunComparison = RunComparison.TestCase


def test_publish_run_long_chain_then_lookup_run_and_eviction():
    f = FastPool(300)
    blocks = f.allocate(200)
    hashes = [i.to_bytes(4, "little") for i in range(200)]
    toks = np.arange(200 * 16, dtype=np.int32)
    assert f.publish_run(blocks, hashes, toks.tobytes()) == blocks
    assert f.lookup_run(hashes, toks.tobytes()) == blocks
    bad = toks.copy()
    bad[37 * 16 + 5] += 1  # block 37's tokens differ: the run stops there (Spec §6)
    assert f.lookup_run(hashes, bad.tobytes()) == blocks[:37]
    assert np.array_equal(f.block_tokens[blocks[3]], toks[48:64])
    f.free(blocks[::-1])
    f.allocate(299)  # evicts every published block
    assert f.hash_to_block == {} and f.lookup_run(hashes, toks.tobytes()) == []
    f.check_invariants()


def test_publish_run_repeated_hash_takes_the_loop():
    f = FastPool(8)
    blocks = f.allocate(3)
    toks = np.array([[1, 2], [1, 2], [3, 4]], np.int32)
    # the second block is a twin of the first (same hash, same tokens); the third collides:
    # the chain stops there (it is not in the result)
    got = f.publish_run(blocks, [b"a", b"a", b"a"], toks.tobytes())
    assert got == [blocks[0], blocks[0]]
    assert f.hash_to_block == {b"a": blocks[0]}
    assert f.block_hash[blocks[1]] is None and f.block_hash[blocks[2]] is None
    f.check_invariants({b: 1 for b in blocks})


@pytest.mark.parametrize("mid_tokens, want_stop", [([5, 6], None), ([9, 9], 2)])
def test_publish_run_undoes_the_fresh_attempt_at_a_mid_run_hash(mid_tokens, want_stop):
    """The fresh-run attempt (first hash not indexed) meets an indexed hash in the middle of the
    run: a twin (same tokens) or a collision (other tokens). It undoes its inserts and the
    result and state equal the reference loop's (spec/manager.md §5.1)."""
    from kvref._block_pool import BlockPool as RefPool

    f, r = FastPool(10), RefPool(10)
    for pool in (f, r):
        (old,) = pool.allocate(1)
        pool.publish(old, b"c", [5, 6])
    blocks = f.allocate(4)
    assert r.allocate(4) == blocks
    toks = np.array([[1, 2], [3, 4], mid_tokens, [7, 8]], np.int32)
    hashes = [b"a", b"b", b"c", b"d"]
    got = f.publish_run(blocks, hashes, toks.reshape(-1))
    assert got == _ref_publish_run(r, blocks, hashes, toks)
    if want_stop is not None:
        assert len(got) == want_stop  # the collision stops the chain: b"d" is not published
    assert f.hash_to_block == r.hash_to_block and list(f.block_hash) == list(r.block_hash)
    f.check_invariants({b: 1 for b in blocks} | {old: 1})


def test_token_table_widens_for_longer_tokens():
    f = FastPool(6)
    a, b = f.allocate(2)
    f.publish(a, b"x", [1, 2])
    f.publish(b, b"y", [1, 2, 3, 4, 5])
    assert f.lookup(b"x", [1, 2]) == a and f.lookup(b"y", [1, 2, 3, 4, 5]) == b
    assert f.lookup(b"x", [1, 2, 0]) is None
    assert f.block_tokens[a].tolist() == [1, 2] and not f.block_tokens[a].flags.writeable


def test_warm_sequence_stays_in_bounds(monkeypatch):
    # The kernels run without bounds checks; their Python originals raise IndexError on a
    # stray index, so the warm-up sequence is replayed through them.
    from kvfast._numba import freelist as fl

    for name in ("init_list", "pop_front_evict", "pop_front_n", "publish_rows", "verify_run", "free_many",
                 "touch_many", "walk"):
        monkeypatch.setattr(fl, name, getattr(fl, name).py_func)
    monkeypatch.setattr(fl, "_warmed", False)
    fl.warm()
    assert fl._warmed
