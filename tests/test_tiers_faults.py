"""Load failures and refusals through the manager, with a fault-injecting
connector over a real ``TieredConnector`` (real files, real threads).

The deterministic scenarios pin the recovery rules of spec/tiers.md §6 (and
the manager's side, reference note §9); the state machine drives the
scheduler loop with faults armed at random and checks after every rule that
free + used + pinned pages partition the pool and that every published
page's K/V equals what the model wrote for its tokens.
"""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest
from _fault_connector import (
    CONNECTOR_BUG,
    LOAD_FAULTS,
    ConnectorBug,
    FaultConnector,
    flush_device,
    kv_values,
    manager_state,
    next_token,
    request_state,
    run_request,
    settle_manager,
    write_forward,
)
from _hybrid_model import flush as flush_leaves
from _hybrid_model import published_ok, register_prefixes, write_leaves
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvref import KVCacheParams, KVLoadFailed, PagedKVCacheManager, TextContext, TieredConnector
from kvspec.errors import InsufficientBlocksError
from kvspec.hashing import block_hashes

PS = 2


def make_params(**kw) -> KVCacheParams:
    return KVCacheParams(page_size=PS, num_layers=1, kv_heads=1, head_dim=2, dtype="float16", **kw)


def published_kv_ok(m: PagedKVCacheManager, registry: dict) -> None:
    """Every published page holds the K/V the model wrote for its tokens."""
    pool = m._pools[0]["full"]
    buf = m.get_device_buffer(0)
    for b, h in enumerate(pool.block_hash):
        if h is None:
            continue
        assert h in registry, f"page {b} published under a hash no request produced"
        i = registry[h]
        want = kv_values(pool.block_tokens[b], np.arange(i * PS, (i + 1) * PS), buf.shape[1:], buf.dtype)
        assert np.array_equal(buf[b].transpose(2, 0, 1, 3, 4), want), f"page {b} (block {i}) holds wrong K/V"


def register(registry: dict, tokens) -> None:
    for i, h in enumerate(block_hashes(np.asarray(tokens), PS)):
        registry[h] = i


def no_leak(m: PagedKVCacheManager) -> None:
    m.check_invariants()
    assert not m.pending_transfers_exist()
    assert m.block_count().free == m.block_count().total


PROMPT = np.array([5, 6, 7, 8, 9, 10, 11, 12, 13], dtype=np.int32)  # 4 full hashed blocks


@pytest.fixture
def primed(tmp_path):
    """A disk directory holding PROMPT's blocks (written by a first manager),
    and a fresh manager over it behind a gated FaultConnector."""
    p = make_params()
    first = PagedKVCacheManager(
        p, num_blocks=12, max_batch_size=2, max_seq_len=22,
        connector=TieredConnector(0, 10**6, tmp_path / "kv"),
    )
    run_request(first, TextContext("prime", PROMPT))
    first.shutdown()
    fc = FaultConnector(TieredConnector(0, 10**6, tmp_path / "kv"), gated=True)
    m = PagedKVCacheManager(p, num_blocks=12, max_batch_size=2, max_seq_len=22, connector=fc)
    yield m, fc
    m.shutdown()


def test_clean_load_lands_and_publishes_after_landing(primed):
    m, fc = primed
    ctx = TextContext("r", PROMPT)
    m.claim(ctx)
    t = m.alloc(ctx)
    assert not t.is_complete() and m.pending_transfers_exist()
    assert ctx.cached_prefix_external_length == 8
    pool = m._pools[0]["full"]
    row = m.get_req_blocks_per_leaf(ctx)["full"]
    assert all(pool.block_hash[b] is None for b in row[:4])  # not published before landing
    fc.land()
    m.poll_transfers()
    assert all(pool.block_hash[b] is not None for b in row[:4])
    registry = {}
    register(registry, PROMPT)
    published_kv_ok(m, registry)
    m.release(ctx)
    no_leak(m)


def test_refused_load_is_a_clean_miss_counted_once(primed):
    m, fc = primed
    fc.arm("refuse")
    ctx = TextContext("r", PROMPT)
    m.claim(ctx)
    assert m.alloc(ctx).is_complete()
    assert (ctx.processed_length, ctx.cached_prefix_external_length) == (0, 0)
    assert m.get_metrics_aggregated().connector_loads_refused == 1
    m.release(ctx)
    no_leak(m)


def test_lookup_refused_is_a_miss_without_a_load(primed):
    m, fc = primed
    fc.refuse_next_lookup()
    ctx = TextContext("r", PROMPT)
    m.claim(ctx)
    assert m.alloc(ctx).is_complete()
    assert ctx.cached_prefix_length == 0 and fc.loads == 0
    m.release(ctx)
    no_leak(m)


@pytest.mark.parametrize("fault", ["fail_post", "fail_first_poll"])
def test_failure_at_post_or_first_poll_is_a_miss_and_skips_the_connector(primed, fault):
    m, fc = primed
    fc.arm(fault)
    ctx = TextContext("r", PROMPT)
    m.claim(ctx)
    assert m.alloc(ctx).is_complete()
    assert (ctx.processed_length, ctx.cached_prefix_external_length) == (0, 0)
    assert m.get_metrics_aggregated().connector_load_failures == 1
    lookups = fc.lookups
    # the request runs on without asking the connector again
    buf = m.get_device_buffer(0)
    write_forward(buf, m.get_req_blocks_per_leaf(ctx)["full"], ctx.tokens, 0, ctx.current_position)
    m.runtime_inputs([[ctx]])
    ctx.update(next_token(ctx.tokens))
    m.step(ctx)
    m.alloc(ctx)
    assert fc.lookups == lookups
    registry = {}
    register(registry, ctx.tokens)
    published_kv_ok(m, registry)
    m.release(ctx)
    settle_manager(m, land=fc.land)
    no_leak(m)


def test_failure_seen_later_unpins_unpublished_and_resplices_device_hit(primed):
    m, fc = primed
    fc.arm("fail_later")
    ctx = TextContext("r", PROMPT)
    m.claim(ctx)
    t = m.alloc(ctx)
    assert not t.is_complete()
    row = m.get_req_blocks_per_leaf(ctx)["full"]
    fc.land()
    m.poll_transfers()  # the failure is seen here
    pool = m._pools[0]["full"]
    assert all(pool.block_hash[b] is None for b in row[:4])  # garbage never published
    assert m.get_metrics_aggregated().connector_load_failures == 1
    m.alloc(ctx)  # undoes the splice: only the device hit (none) stays
    assert (ctx.processed_length, ctx.cached_prefix_external_length) == (0, 0)
    buf = m.get_device_buffer(0)
    write_forward(buf, m.get_req_blocks_per_leaf(ctx)["full"], ctx.tokens, 0, ctx.current_position)
    m.runtime_inputs([[ctx]])
    ctx.update(next_token(ctx.tokens))
    m.step(ctx)
    registry = {}
    register(registry, ctx.tokens)
    published_kv_ok(m, registry)
    m.release(ctx)
    settle_manager(m, land=fc.land)
    no_leak(m)


def test_release_during_a_failing_load_leaks_nothing(primed):
    m, fc = primed
    fc.arm("fail_later")
    ctx = TextContext("r", PROMPT)
    m.claim(ctx)
    assert not m.alloc(ctx).is_complete()
    m.release(ctx)
    assert m.pending_transfers_exist()  # the pages stay pinned until the copy ends
    fc.land()
    m.poll_transfers()
    no_leak(m)
    assert all(h is None for h in m._pools[0]["full"].block_hash)


def test_forward_past_a_failed_load_makes_alloc_raise(primed):
    m, fc = primed
    fc.arm("fail_later")
    ctx = TextContext("r", PROMPT)
    m.claim(ctx)
    m.alloc(ctx)
    # a buggy scheduler runs the forward without waiting for the load
    buf = m.get_device_buffer(0)
    write_forward(buf, m.get_req_blocks_per_leaf(ctx)["full"], ctx.tokens, ctx.processed_length, ctx.current_position)
    ctx.update(next_token(ctx.tokens))
    m.step(ctx)
    fc.land()
    with pytest.raises(RuntimeError, match="ran past") as info:
        m.alloc(ctx)
    assert isinstance(info.value.__cause__, KVLoadFailed)
    m.release(ctx)
    settle_manager(m, land=fc.land)
    no_leak(m)


def test_kth_load_fails_and_kth_lookup_misses(tmp_path):
    """Fail the 2nd load and miss the 3rd lookup; the others are served from the tiers."""
    p = make_params()
    first = PagedKVCacheManager(p, num_blocks=12, max_batch_size=2, max_seq_len=22,
                                connector=TieredConnector(0, 10**6, tmp_path / "kv"))
    run_request(first, TextContext("prime", PROMPT))
    first.shutdown()
    fc = FaultConnector(TieredConnector(0, 10**6, tmp_path / "kv"), load_faults={2: "fail_later"},
                        lookup_misses={3})
    m = PagedKVCacheManager(p, num_blocks=12, max_batch_size=2, max_seq_len=22, connector=fc)
    ext = []
    for i in range(4):
        ctx = TextContext(f"r{i}", PROMPT)
        m.claim(ctx)
        try:
            m.alloc(ctx).synchronize()
        except KVLoadFailed:
            m.alloc(ctx)  # re-splices the device hit only
        ext.append(ctx.cached_prefix_external_length)
        m.release(ctx)
        settle_manager(m)
        flush_device(m)  # the next request must go to the tiers again
    assert fc.loads == 3 and fc.lookups == 4
    assert ext == [8, 0, 0, 8]
    assert m.get_metrics_aggregated().connector_load_failures == 1
    no_leak(m)
    m.shutdown()


# --------------------------------------------------------------------------- the state machine


VOCAB = 3
MAX_LEN = 12
#: Prompt stems; prompts are a stem plus a short tail, so prefixes collide often.
STEMS = ((0, 1, 2, 0), (0, 1, 2, 1, 1, 0), (2, 2, 1), (1, 0))
PROMPT_ST = st.builds(
    lambda stem, tail: (STEMS[stem] + tuple(tail))[: MAX_LEN - 3],
    st.integers(0, len(STEMS) - 1),
    st.lists(st.integers(0, VOCAB - 1), max_size=4),
)


class TieredFaultMachine(RuleBasedStateMachine):
    """The scheduler loop over a manager whose connector injects faults.

    Rules are whole scheduler actions (admit, one iteration over the batch,
    preempt, flush the device cache, land transfers, arm a fault, reset), so
    a short run still offloads, evicts and reloads.

    Parameters (class attributes, so a subclass runs the same machine over
    another manager): ``leaves`` (``None``: one full leaf; else the leaves,
    "full" first: every leaf is written by ``_hybrid_model.write_leaves`` and
    every published page of every leaf checked), ``num_blocks``, and the
    tiers' room in pages: ``host_pages`` and ``disk_files``, and
    ``warm_decode``, the decode steps each warm-up prompt runs (a recurrent
    leaf hits only at a checkpoint a decode step published).
    """

    leaves = None
    num_blocks = 12
    host_pages = 4
    disk_files = 8
    warm_decode = 0

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvtiers-")
        p = make_params(leaves=self.leaves)
        page = p.page_bytes()
        from kvref._disk_tier import header_len

        inner = TieredConnector(self.host_pages * page, self.disk_files * (header_len(PS) + page), self.dir,
                                num_workers=2)
        self.fc = FaultConnector(inner, gated=True)
        self.m = PagedKVCacheManager(p, num_blocks=self.num_blocks, max_batch_size=4, max_seq_len=16,
                                     connector=self.fc)
        self.prefixes: dict[bytes, np.ndarray] = {}  # h_i -> tokens up to block i's end (hybrid checks)
        self.live: dict[str, tuple[TextContext, object]] = {}
        self.registry: dict[bytes, int] = {}
        self.served: list[tuple[int, ...]] = []
        self.n = 0

    def teardown(self):
        try:
            # never leaks a page: release everything, land everything, the pool is whole
            for rid in sorted(self.live):
                self._release(rid)
            settle_manager(self.m, land=self.fc.land)
            no_leak(self.m)
            self._published_ok()
        finally:
            try:
                self.m.shutdown()
            finally:
                shutil.rmtree(self.dir, ignore_errors=True)

    # -- warm tiers: every run starts with served prompts offloaded and the device cache flushed
    @initialize(prompts=st.lists(PROMPT_ST, min_size=1, max_size=3))
    def warm_tiers(self, prompts):
        for prompt in prompts:
            self._admit(prompt)
        while self.live:
            for _ in range(1 + self.warm_decode):
                self.iterate()
            for rid in sorted(self.live):
                self._release(rid)
        settle_manager(self.m, land=self.fc.land)
        self.flush_device()

    # -- admission (then one scheduler iteration, as a serving loop would run)
    @precondition(lambda self: len(self.live) < 3)
    @rule(prompt=PROMPT_ST)
    def admit(self, prompt):
        self._admit(prompt)
        self.iterate()

    @precondition(lambda self: len(self.live) < 3 and bool(self.served))
    @rule(data=st.data(), fault=st.sampled_from((None,) + LOAD_FAULTS + (CONNECTOR_BUG,)))
    def readmit(self, data, fault):
        """A prompt served before comes back (where tier hits happen), with a
        fault armed for the next load."""
        if fault is not None:
            note(f"arm: {fault}")
            self.fc.arm(fault)
        self._admit(data.draw(st.sampled_from(self.served)))
        self.iterate()

    @precondition(lambda self: len(self.live) < 3 and bool(self.served))
    @rule(data=st.data())
    def readmit_into_a_connector_bug(self, data):
        """A served prompt comes back once the device cache was flushed (its blocks are in the tiers, so
        the admission loads) and the connector's load raises an exception of no ``KVLoad*`` type."""
        self.flush_device()
        note(f"arm: {CONNECTOR_BUG}")
        self.fc.arm(CONNECTOR_BUG)
        self._admit(data.draw(st.sampled_from(self.served)))
        self.iterate()

    def _admit(self, prompt):
        rid = f"r{self.n}"
        self.n += 1
        ctx = TextContext(rid, np.array(prompt, dtype=np.int32))
        note(f"m.claim({rid}); m.alloc({rid})  # {list(prompt)}")
        self.m.claim(ctx)
        try:
            t = self._alloc(ctx)
        except InsufficientBlocksError:
            note("  -> InsufficientBlocksError; release")
            self.m.release(ctx)
            return
        note(f"  -> prefix {ctx.cached_prefix_length} (external {ctx.cached_prefix_external_length})")
        self.live[rid] = (ctx, t)

    # -- one scheduler iteration: every live request runs a forward unless cordoned
    @rule()
    def iterate(self):
        for rid in sorted(self.live):
            if rid in self.live:
                self._forward(rid)
        self.m.poll_transfers()

    def _forward(self, rid):
        ctx, t = self.live[rid]
        try:
            done = t.is_complete()
        except KVLoadFailed:
            note(f"{rid}: load failed; alloc again")
            self._realloc(rid)
            return
        if not done:
            note(f"{rid}: cordoned (load in flight)")
            return
        note(f"{rid}: forward over [{ctx.processed_length}, {ctx.current_position})")
        if self.leaves is None:
            row = self.m.get_req_blocks_per_leaf(ctx)["full"]
            write_forward(self.m.get_device_buffer(0), row, ctx.tokens, ctx.processed_length, ctx.current_position)
        else:
            write_leaves(self.m, ctx)
        self.m.runtime_inputs([[ctx]])
        ctx.update(next_token(ctx.tokens, VOCAB))
        self.m.step(ctx)
        register(self.registry, ctx.tokens)
        if self.leaves is not None:
            register_prefixes(self.prefixes, ctx.tokens, PS)
        prompt = tuple(int(x) for x in ctx.tokens[:-1])
        if prompt not in self.served:
            self.served.append(prompt)
        if len(ctx) >= MAX_LEN:
            self._release(rid)
            return
        self._realloc(rid)

    def _alloc(self, ctx):
        """``alloc``; when an armed connector bug raises in it, every pool, pin, row, metric and the
        context are as before the call (spec/manager.md §9.8, §11.22), and the alloc runs again. What
        a raise keeps (spec/manager.md §4 step 6, §11.6): the drain that starts an alloc (run first
        here, so the snapshot is the state a raise must leave) and a wait for in-flight offloads
        (then the context, its rows and the other requests' rows are checked)."""
        self.m._drain()
        offloads = list(self.m._offloads)
        ctxs = [c for c, _ in self.live.values()] + [ctx]
        before, requests = manager_state(self.m, ctxs), request_state(self.m, ctxs)
        try:
            return self.m.alloc(ctx)
        except ConnectorBug:
            note("  -> the connector's load raised; alloc again")
            if self.m._offloads == offloads:
                assert manager_state(self.m, ctxs) == before
            else:  # the alloc waited for offloads first (their pins dropped): the requests are as before
                assert request_state(self.m, ctxs) == requests
            return self.m.alloc(ctx)

    def _realloc(self, rid):
        ctx, _ = self.live[rid]
        try:
            self.live[rid] = (ctx, self._alloc(ctx))
        except InsufficientBlocksError:
            note(f"{rid}: InsufficientBlocksError; preempt")
            self._release(rid)

    def _release(self, rid):
        ctx, _ = self.live.pop(rid)
        self.m.release(ctx)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def preempt(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        note(f"m.release({rid})")
        self._release(rid)

    @rule()
    def flush_device(self):
        """Evict every unreferenced page from the device prefix cache, so the
        next admissions can only hit in the tiers."""
        note(f"flush the device cache ({self.m.block_count().free} free blocks)")
        if self.leaves is None:
            flush_device(self.m)
        else:
            flush_leaves(self.m)

    @rule()
    def land(self):
        note("the connector lands every transfer; m.poll_transfers()")
        self.fc.land()
        self.m.poll_transfers()

    @rule(fault=st.sampled_from(LOAD_FAULTS + (CONNECTOR_BUG, "lookup_miss")))
    def arm(self, fault):
        note(f"arm: {fault}")
        if fault == "lookup_miss":
            self.fc.refuse_next_lookup()
        else:
            self.fc.arm(fault)

    @rule()
    def reset_prefix_cache(self):
        note("m.reset_prefix_cache()")
        self.m.reset_prefix_cache()

    # -- checks after every rule
    @invariant()
    def pool_partitioned_and_kv_correct(self):
        self.m.check_invariants()
        self.fc.inner.check_invariants()
        self._published_ok()
        bc = self.m.block_count()
        assert 0 <= bc.free <= bc.total

    def _published_ok(self):
        """Every published page holds the model's bytes (every leaf's, with several leaves)."""
        if self.leaves is None:
            published_kv_ok(self.m, self.registry)
        else:
            published_ok(self.m, self.prefixes)

    @invariant()
    def nothing_pinned_without_a_transfer(self):
        assert self.m.pending_transfers_exist() == bool(self.m._loads or self.m._offloads)


TieredFaultMachine.TestCase.settings = settings(TieredFaultMachine.TestCase.settings)
test_tiered_fault_machine = TieredFaultMachine.TestCase

