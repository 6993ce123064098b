"""Issue 11, manager items: regression tests, each run on both packages.

(1) twin dedup verifies the parent chain; (6) the device hit is re-ranked in
the tiers after an external load; (14) the salted-root cache is bounded;
(17) calls after ``shutdown`` raise with state unchanged; (18) ``alloc``
checks ``defer_lookup`` before replacing the stored context; (19) every
integer argument is bounded before arithmetic or allocation.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from _pool_sizes import holdable
from test_manager import PAGE, DictConnector, forward

import kvfast
import kvref
from kvspec.hashing import collide_hashes
from kvspec import KVCacheParams, LeafSpec, TextContext

PKGS = pytest.mark.parametrize("pkg", [kvref, kvfast], ids=["kvref", "kvfast"])


def _mgr(pkg, *, page=2, num_blocks=17, **kw):  # 16 pages hold max_seq_len=32 (spec/manager.md §1.6)
    params = KVCacheParams(page_size=page, num_layers=1, kv_heads=1, head_dim=1, dtype="float32",
                           leaves=kw.pop("leaves", None))
    seq = kw.pop("max_seq_len", None)
    if seq is None:  # the longest the pool holds, at most 32 (spec/manager.md §1.6)
        seq = holdable(pkg.PagedKVCacheManager, params, num_blocks, 32)
    return pkg.PagedKVCacheManager(params, num_blocks=num_blocks, max_batch_size=4, max_seq_len=seq, **kw)


def _run(m, rid, prompt, release=True, steps=1):
    ctx = TextContext(rid, prompt)
    m.claim(ctx)
    m.alloc(ctx)
    hit = ctx.cached_prefix_length
    for _ in range(steps):
        ctx.update(1)
        m.step(ctx)
        m.alloc(ctx)
    row = m.get_req_blocks_per_leaf(ctx)
    if release:
        m.release(ctx)
    m.check_invariants()
    return ctx, hit, row


def _state(m):
    return (sorted(m._requests), m._free_order(), m.get_metrics_aggregated(),
            {rid: m.get_req_blocks_per_leaf(req.ctx) for rid, req in m._requests.items()})


# --------------------------------------------------------------------------- (1) twin dedup


@PKGS
@pytest.mark.parametrize("leaves", [None, {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(4)}])
def test_twin_dedup_never_switches_to_a_twin_of_another_chain(pkg, leaves):
    """Every hash collides: block 1 of "c" equals "a"'s block 1 in tokens, but its prefix differs."""
    with collide_hashes():
        m = _mgr(pkg, leaves=leaves)
        _, _, ra = _run(m, "a", [1, 2, 3, 4, 5])
        c, _, rc = _run(m, "c", [7, 7, 3, 4, 5], release=False)
        for lid in rc:
            assert rc[lid][1] != ra[lid][1], "switched to a page computed after another prefix"
        m.release(c)
        m.check_invariants()
        # a true continuation of "a" still hits its whole chain
        _, hit, rg = _run(m, "g", [1, 2, 3, 4, 9])
        assert hit == 4 and rg["full"][:2] == ra["full"][:2]


@PKGS
def test_a_page_under_a_collided_parent_is_never_published(pkg):
    """"b"'s block 0 loses the collision to "a"'s; its block 1 (computed after [7, 7]) must not
    become hittable under the hash chain of [1, 2]."""
    with collide_hashes():
        m = _mgr(pkg)
        _run(m, "a", [1, 2, 9])
        _run(m, "b", [7, 7, 5, 5, 9], steps=3)
        _, hit, _ = _run(m, "g", [1, 2, 5, 5, 1])
        assert hit == 2


@PKGS
def test_decode_fill_under_a_collided_parent_is_not_published(pkg):
    with collide_hashes():
        m = _mgr(pkg)
        _run(m, "a", [1, 2, 9])
        # "b" fills its block 1 one decode token at a time (the fast lane's one-block commit)
        _run(m, "b", [7, 7, 5], steps=4)
        _, hit, _ = _run(m, "g", [1, 2, 5, 1, 1])
        assert hit == 2


# --------------------------------------------------------------------------- (6) tier recency


class _RankingConnector(DictConnector):
    """Records the tier's LRU order as spec/tiers.md §3 defines it: ``load`` and ``touch``
    rank the hashes of a call tail first, so the head of the call ends most recent."""

    def __init__(self):
        super().__init__()
        self.order: list[bytes] = []

    def _rank(self, hashes):
        for h in reversed([bytes(x) for x in hashes]):
            if h in self.order:
                self.order.remove(h)
            self.order.append(h)

    def load(self, block_ids, hashes, tokens, replica_idx=0):
        h = super().load(block_ids, hashes, tokens, replica_idx)
        self._rank(hashes)
        return h

    def touch(self, hashes, replica_idx=0):
        super().touch(hashes, replica_idx)
        self._rank(hashes)


@PKGS
def test_chain_head_ranks_newer_than_its_loaded_tail(pkg):
    conn = _RankingConnector()
    params = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=2, dtype="float32")
    m = pkg.PagedKVCacheManager(params, num_blocks=16, max_batch_size=4, max_seq_len=32, connector=conn)
    prompt = list(range(1, 14))  # 3 hashed blocks
    ctx = TextContext("a", prompt)
    m.claim(ctx)
    m.alloc(ctx)
    forward(m, ctx)
    m.release(ctx)
    m.poll_transfers()
    conn.land_all()
    m.poll_transfers()
    chain = list(conn.store)  # the three offloaded hashes, head first
    assert len(chain) == 3
    # keep only the head on the device: evict everything, then re-admit one block
    kept = dict(conn.store)
    m.reset_prefix_cache()
    conn.store = kept  # the tier keeps what it had
    head = TextContext("h", prompt[: PAGE + 1])
    m.claim(head)
    m.alloc(head)
    forward(m, head)
    m.release(head)
    conn.order.clear()
    b = TextContext("b", prompt)
    m.claim(b)
    m.alloc(b)
    assert b.cached_prefix_length == 3 * PAGE and b.cached_prefix_external_length == 2 * PAGE
    # least recently used first: the tail is evicted before the head
    ranks = [conn.order.index(h) for h in chain]
    assert ranks == sorted(ranks, reverse=True), "the chain's head would be evicted before its tail"
    m.release(b)


# --------------------------------------------------------------------------- (14) root cache


@PKGS
def test_salted_root_cache_is_bounded(pkg):
    m = _mgr(pkg, num_blocks=8, max_seq_len=14)
    for i in range(300):
        ctx = TextContext(f"r{i}", [1, 2, 3], cache_salt=f"tenant-{i}")
        m.claim(ctx)
        m.alloc(ctx)
        ctx.update(1)
        m.step(ctx)
        m.release(ctx)
    assert len(m._salted_roots) <= 64
    # a bounded cache still serves hits: the same salt hits again
    ctx = TextContext("again", [1, 2, 3], cache_salt="tenant-299")
    m.claim(ctx)
    m.alloc(ctx)
    assert ctx.cached_prefix_length == 2


# --------------------------------------------------------------------------- (17) after shutdown


@PKGS
def test_calls_after_shutdown_raise_with_state_unchanged(pkg):
    m = _mgr(pkg, connector=DictConnector())
    ctx, _, _ = _run(m, "a", [1, 2, 3, 4, 5], release=False)
    m.shutdown()
    before = _state(m)
    calls = {
        "release": lambda: m.release(ctx),
        "release": lambda: m.release("a"),  # noqa: F601 - both spellings
        "alloc": lambda: m.alloc(ctx),
        "step": lambda: m.step(ctx),
        "claim": lambda: m.claim(TextContext("z", [1, 2])),
        "alloc_dummy": lambda: m.alloc_dummy(TextContext("z", [1, 2])),
        "runtime_inputs": lambda: m.runtime_inputs([[ctx]]),
        "poll_transfers": m.poll_transfers,
        "reset_prefix_cache": m.reset_prefix_cache,
        "start_lookup": lambda: m.start_lookup(ctx),
        "hand_back_lookup": lambda: m.hand_back_lookup(ctx),
    }
    for op, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"^{op}: the manager is shut down$"):
            call()
        assert _state(m) == before
    m.shutdown()  # idempotent
    assert m.contains("a") and m.block_count().used > 0  # queries still answer


@PKGS
def test_release_after_shutdown_keeps_the_request(pkg):
    m = _mgr(pkg)  # no connector: kvfast's release plan
    ctx, _, _ = _run(m, "a", [1, 2, 3, 4, 5], release=False)
    m.shutdown()
    free = m._free_order()
    with pytest.raises(RuntimeError, match="release: the manager is shut down"):
        m.release(ctx)
    assert m.contains(ctx) and m._free_order() == free


# --------------------------------------------------------------------------- (18) defer_lookup


@PKGS
def test_alloc_bad_defer_lookup_does_not_replace_the_context(pkg):
    m = _mgr(pkg)
    ctx, _, _ = _run(m, "a", [1, 2, 3, 4, 5], release=False)
    ctx2 = TextContext("a", list(ctx.tokens))
    with pytest.raises(TypeError, match=r"alloc: defer_lookup='x', must be a bool"):
        m.alloc(ctx2, defer_lookup="x")
    assert m._requests["a"].ctx is ctx


# --------------------------------------------------------------------------- (19) integer bounds


@PKGS
def test_runtime_inputs_bounds_max_cache_length_before_allocating(pkg):
    m = _mgr(pkg)
    ctx, _, _ = _run(m, "a", [1, 2, 3, 4, 5], release=False)
    before = _state(m)
    with pytest.raises(ValueError, match=r"^runtime_inputs: max_cache_length=1099511627776 > max_seq_len=32$"):
        m.runtime_inputs([[ctx]], max_cache_length=2**40)
    assert _state(m) == before
    assert m.runtime_inputs([[ctx]], max_cache_length=32).inputs[0].lookup_table.shape == (1, 16)


BIG = st.one_of(st.integers(2**31, 2**80), st.integers(-(2**80), -1))


@given(value=BIG, arg=st.sampled_from(["num_blocks", "max_batch_size", "max_seq_len"]))
def test_constructor_sizes_bounded_in_both_packages(value, arg):
    msgs = []
    for pkg in (kvref, kvfast):
        kw = dict(num_blocks=8, max_batch_size=2, max_seq_len=16)
        kw[arg] = value
        with pytest.raises(ValueError) as e:
            pkg.PagedKVCacheManager(KVCacheParams(page_size=2, num_layers=1, kv_heads=1, head_dim=1), **kw)
        assert f"{arg}={value}" in str(e.value)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1]


@given(value=st.one_of(st.integers(33, 2**90), st.integers(-(2**90), 0)), replica=st.integers(-(2**70), 2**70))
def test_integer_arguments_of_calls_bounded_in_both_packages(value, replica):
    out = []
    for pkg in (kvref, kvfast):
        m = _mgr(pkg)
        ctx = TextContext("a", [1, 2, 3])
        m.claim(ctx)
        m.alloc(ctx)
        errs = []
        for call in (lambda: m.runtime_inputs([[ctx]], max_cache_length=value),
                     lambda: m.block_count(replica), lambda: m.pressure_pct(replica),
                     lambda: m.pending_transfers_exist(replica), lambda: m.get_device_buffer(replica),
                     lambda: m.host_byte_count(replica), lambda: m.disk_byte_count(replica)):
            try:
                call()
                errs.append(None)
            except (ValueError, IndexError) as e:
                errs.append(f"{type(e).__name__}: {e}")
        assert errs[0] is not None
        out.append((errs, m._free_order()))
    assert out[0] == out[1]
