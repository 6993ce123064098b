"""A Hypothesis state machine that plays a scheduler against PagedKVCacheManager.

Two replicas, three leaves (full, sliding window, recurrent state), a tiny
vocabulary so prefixes collide, a small pool so eviction and
``InsufficientBlocksError`` happen. The "forward" writes K/V (and state) that
depend on every token up to the position, so any page served from the prefix
cache that holds the wrong bytes is caught the next time it is read.
After every rule: ``check_invariants()``.
"""

import numpy as np
from hypothesis import event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvref import PagedKVCacheManager
from kvspec import InsufficientBlocksError, KVCacheParams, KVLoadFailed, LeafSpec, TextContext

PAGE = 2
WINDOW = 3
MAX_SEQ = 16
LEAVES = {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(WINDOW), "rec": LeafSpec.recurrent((2,))}
VOCAB = st.integers(1, 3)


def kv_value(tokens, p: int) -> float:
    """K/V of position p: a function of tokens[: p + 1] (exact in float32)."""
    t = np.asarray(tokens[: p + 1], dtype=np.int64)
    return float(int(np.sum(t * np.arange(1, p + 2))) % 1009 + 1)


def state_value(tokens, n: int) -> np.ndarray:
    """Recurrent state after n tokens."""
    t = np.asarray(tokens[:n], dtype=np.int64)
    return np.array([int(np.sum(t * np.arange(1, n + 1))) % 997, n], dtype=np.float32)


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        params = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=1, dtype="float32",
                               data_parallel_degree=2, leaves=LEAVES)
        self.m = PagedKVCacheManager(params, num_blocks=14, max_batch_size=3, max_seq_len=MAX_SEQ)
        self.live: dict[str, TextContext] = {}
        self.dummies: dict[str, TextContext] = {}
        self.n = 0
        self.prompts: list[tuple[int, ...]] = []

    @property
    def paged(self):
        return [lid for lid in ("full", "swa") if lid in self.m.params.leaves()]

    @property
    def has_rec(self):
        return "rec" in self.m.params.leaves()

    def _bufs(self, r):
        b = self.m.get_device_buffer(r)
        return b if isinstance(b, dict) else {"full": b}

    def _inputs(self, out, r):
        x = out.inputs[r]
        return x if isinstance(x, dict) else {"full": x}

    # ------------------------------------------------------------------ helpers

    def _new_id(self) -> str:
        self.n += 1
        return f"r{self.n}"

    def _covered(self, ctx) -> bool:
        rows = self.m.get_req_blocks_per_leaf(ctx)
        return len(rows["full"]) * PAGE >= ctx.current_position and (not self.has_rec or len(rows["rec"]) >= 1)

    def _check_kv(self, ctx) -> None:
        """Every processed position the request can still read holds its K/V; the live state matches."""
        r = self.m._requests[ctx.request_id].replica
        bufs = self._bufs(r)
        rows = self.m.get_req_blocks_per_leaf(ctx)
        toks = ctx.tokens
        for lid in self.paged:
            for p in range(ctx.processed_length):
                b = rows[lid][p // PAGE]
                if b == 0:
                    assert lid == "swa" and p < ctx.processed_length - WINDOW + 1, (lid, p)
                    continue
                got = bufs[lid][b, 0, 0, p % PAGE, 0, 0]
                assert got == kv_value(toks, p), f"{ctx.request_id} leaf {lid} pos {p}: {got} != {kv_value(toks, p)}"
        if not self.has_rec:
            return
        live = rows["rec"][0]
        assert np.array_equal(bufs["rec"][live], state_value(toks, ctx.processed_length)), ctx.request_id

    def _fingerprint(self, ctx):
        m = self.m
        pools = [{lid: p.snapshot() for lid, p in pools.items()} for pools in m._pools]
        return repr((pools, m.get_metrics_aggregated(), ctx.processed_length, ctx.active_length,
                     ctx.cached_prefix_length, m.get_req_blocks_per_leaf(ctx)))

    # ------------------------------------------------------------------ scheduler rules

    def _prompt(self, data) -> list[int]:
        """A prompt that often shares a prefix with an earlier one (tiny vocabulary)."""
        kind = data.draw(st.sampled_from(["again", "again", "extend", "extend", "new"])) if self.prompts else "new"
        if kind == "new":
            toks = data.draw(st.lists(VOCAB, min_size=1, max_size=10))
        else:
            base = data.draw(st.sampled_from(self.prompts))
            cut = data.draw(st.one_of(st.just(len(base)), st.integers(1, len(base))))
            more = data.draw(st.lists(VOCAB, min_size=0 if kind == "again" else 1, max_size=5))
            toks = list(base[:cut] if kind == "extend" else base) + more
        toks = toks[: MAX_SEQ - 4]
        self.prompts.append(tuple(toks))
        return toks

    @precondition(lambda self: len(self.live) < 5)
    @rule(data=st.data(), replica=st.integers(0, 1), admit=st.booleans())
    def claim(self, data, replica, admit):
        """claim a new request (and, as a scheduler does, usually alloc it at once)."""
        ctx = TextContext(self._new_id(), self._prompt(data))
        note(f"m.claim(TextContext({ctx.request_id!r}, {ctx.tokens.tolist()}), {replica})")
        self.m.claim(ctx, replica)
        self.live[ctx.request_id] = ctx
        if admit:
            self._alloc(ctx)

    def _alloc(self, ctx, defer_lookup: bool = False) -> bool:
        """alloc; True when the request may run its forward now."""
        # alloc lands finished transfers first (not rolled back); do that here so
        # the fingerprint below compares only what a failing alloc may touch.
        self.m._drain()
        before = self._fingerprint(ctx)
        self.out_of_blocks = False
        note(f"m.alloc({ctx.request_id!r}, defer_lookup={defer_lookup})")
        try:
            transfer = self.m.alloc(ctx, defer_lookup=defer_lookup)
        except InsufficientBlocksError:
            assert self._fingerprint(ctx) == before
            self.out_of_blocks = True
            event("alloc: out of blocks, rolled back")
            return False
        if ctx.cached_prefix_length and ctx.processed_length == ctx.cached_prefix_length:
            event("alloc: prefix hit")
        assert self._covered(ctx)
        assert ctx.active_length >= 1
        try:
            landed = transfer.is_complete()
        except KVLoadFailed:
            landed = False  # the next alloc sees the failure and re-splices
        if not landed:
            event("alloc: load in flight, request cordoned")
            return False
        self._check_kv(ctx)
        return True

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def alloc(self, data):
        self._alloc(self.live[data.draw(st.sampled_from(sorted(self.live)))])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def chunk(self, data):
        """Chunked prefill: cut the active region (at page boundaries when it can)."""
        rid = data.draw(st.sampled_from(sorted(self.live)))
        ctx = self.live[rid]
        if ctx.active_length <= 1:
            return
        align = self.m.chunk_alignment_tokens
        n = data.draw(st.integers(1, ctx.active_length - 1))
        if align and n >= align:
            n -= (ctx.processed_length + n) % align
        note(f"{rid}.chunk({n})")
        ctx.chunk(n)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=VOCAB)
    def forward(self, data, token):
        """runtime_inputs, write K/V and state, then update (or advance_chunk) and step."""
        rid = data.draw(st.sampled_from(sorted(self.live)))
        ctx = self.live[rid]
        if len(ctx) >= MAX_SEQ or not self._alloc(ctx):  # a scheduler allocs before every forward
            return
        m = self.m
        r = m._requests[rid].replica
        batches = [[], []]
        batches[r].append(ctx)
        inp = self._inputs(m.runtime_inputs(batches), r)
        rows = m.get_req_blocks_per_leaf(ctx)
        n_req = m.num_req_blocks(ctx)
        assert inp["full"].lookup_table[0, :n_req].tolist() == rows["full"][:n_req]
        assert int(inp["full"].cache_lengths[0]) == ctx.processed_length
        self._check_kv(ctx)
        bufs = self._bufs(r)
        toks = ctx.tokens
        for p in range(ctx.processed_length, ctx.current_position):
            for lid in self.paged:
                b = rows[lid][p // PAGE]
                assert b != 0 and m._pools[r][lid].ref_count[b] == 1, "a shared page in the write set"
                bufs[lid][b, 0, 0, p % PAGE, 0, 0] = kv_value(toks, p)
        if self.has_rec:
            bufs["rec"][rows["rec"][0]] = state_value(toks, ctx.current_position)
        if ctx.pending_length:
            note(f"{rid}.advance_chunk(); m.step({rid})")
            ctx.advance_chunk()
        else:
            note(f"{rid}.update({token}); m.step({rid})")
            ctx.update(token)
        m.step(ctx)
        self._check_kv(ctx)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        note(f"m.release({rid!r})")
        ctx = self.live.pop(rid)
        self.prompts.append(tuple(ctx.tokens.tolist()))  # a finished conversation is a future prefix
        self.m.release(ctx)

    @rule(dice=st.integers(0, 7))
    def reset_prefix_cache(self, dice):
        if dice:  # a rare event: keep caches alive long enough to be hit
            return
        note("m.reset_prefix_cache()")
        self.m.reset_prefix_cache()

    @precondition(lambda self: len(self.dummies) < 2)
    @rule(n=st.integers(1, 6), replica=st.integers(0, 1))
    def alloc_dummy(self, n, replica):
        ctx = TextContext(self._new_id(), [0] * n)
        counts = [self.m.block_count(r) for r in range(2)]
        note(f"m.alloc_dummy(TextContext({ctx.request_id!r}, [0] * {n}), {replica})")
        self.m.alloc_dummy(ctx, replica)
        assert [self.m.block_count(r) for r in range(2)] == counts
        self.dummies[ctx.request_id] = ctx

    @precondition(lambda self: self.dummies)
    @rule(data=st.data())
    def release_dummy(self, data):
        rid = data.draw(st.sampled_from(sorted(self.dummies)))
        counts = [self.m.block_count(r) for r in range(2)]
        self.m.release(self.dummies.pop(rid))
        assert [self.m.block_count(r) for r in range(2)] == counts

    @rule()
    def batch_inputs(self):
        """A padded DP batch: every covered request plus the dummies, per replica."""
        batches = [[], []]
        for ctx in list(self.live.values()) + list(self.dummies.values()):
            q = self.m._requests[ctx.request_id]
            if (q.dummy or self._covered(ctx)) and len(batches[q.replica]) < 3:
                batches[q.replica].append(ctx)
        if not any(batches):
            return
        out = self.m.runtime_inputs(batches)
        for r, batch in enumerate(batches):
            lid = self.paged[-1]
            lut = self._inputs(out, r)[lid].lookup_table
            assert lut.shape[1] % 8 == 0
            for i, ctx in enumerate(batch):
                row = self.m.get_req_blocks_per_leaf(ctx)[lid]
                n = self.m.num_req_blocks(ctx)
                assert lut[i, :n].tolist() == row[:n] and not lut[i, n:].any()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def invariants_hold(self):
        self.m.check_invariants()
        for r in range(2):
            bc = self.m.block_count(r)
            assert 0 <= bc.free <= bc.total == self.m._num_blocks - 1
            assert 0.0 <= self.m.pressure_pct(r) <= 100.0

    def teardown(self):
        for ctx in list(self.live.values()) + list(self.dummies.values()):
            self.m.release(ctx)
        self.m.check_invariants()
        for r in range(2):
            assert self.m.block_count(r).used == 0, "pages leaked after every request was released"


# Long runs so conversations finish and get reused; the profile sets the example count.
ManagerMachine.TestCase.settings = settings(settings.default, stateful_step_count=60)
TestManagerMachine = ManagerMachine.TestCase


class FullOnlyMachine(ManagerMachine):
    """The same scheduler over a single full-attention leaf (cross-replica copies)."""

    def __init__(self):
        RuleBasedStateMachine.__init__(self)
        params = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=1, dtype="float32",
                               data_parallel_degree=2)
        self.m = PagedKVCacheManager(params, num_blocks=10, max_batch_size=3, max_seq_len=MAX_SEQ)
        self.live, self.dummies, self.n, self.prompts = {}, {}, 0, []


FullOnlyMachine.TestCase.settings = settings(settings.default, stateful_step_count=60)
TestFullOnlyMachine = FullOnlyMachine.TestCase


class ConnectorMachine(FullOnlyMachine):
    """The scheduler over a dict-backed connector with asynchronous, refused and failing transfers.

    Checks after every rule that pages never leak (pool invariants with pins),
    never publish before landing, and that every page read back holds the
    K/V its tokens produce (a load that served other bytes fails the K/V check).
    """

    def __init__(self):
        RuleBasedStateMachine.__init__(self)
        from test_manager import DictConnector

        self.conn = DictConnector(asynchronous=True, offload_async=True)
        params = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=1, dtype="float32",
                               data_parallel_degree=2)
        self.m = PagedKVCacheManager(params, num_blocks=10, max_batch_size=3, max_seq_len=MAX_SEQ,
                                     connector=self.conn)
        self.live, self.dummies, self.n, self.prompts = {}, {}, 0, []

    def _pending(self):
        return [h for h in self.conn.handles if not h.done and not h.fail]

    @precondition(lambda self: self._pending())
    @rule(data=st.data())
    def land(self, data):
        h = data.draw(st.sampled_from(self._pending()))
        note("handle.land()")
        h.land()

    @precondition(lambda self: self.m._loads)
    @rule(data=st.data())
    def fail_a_load(self, data):
        load = data.draw(st.sampled_from(self.m._loads))
        note("load handle fails")
        load.handle.fail = True

    @rule(kind=st.sampled_from(["refuse", "fail_post", "fail_poll"]))
    def inject(self, kind):
        note(f"conn.{kind} = 1")
        setattr(self.conn, kind, 1)

    @rule()
    def poll_transfers(self):
        note("m.poll_transfers()")
        self.m.poll_transfers()

    @rule(dice=st.integers(0, 3))
    def evict_device(self, dice):
        """Device-only eviction of unreferenced pages, so prompts come back from the connector."""
        if dice:
            return
        note("evict unreferenced device pages")
        for pools in self.m._pools:
            for pool in pools.values():
                pool.reset_prefix_cache()

    @precondition(lambda self: len(self.live) < 5)
    @rule(data=st.data(), replica=st.integers(0, 1), hand_back=st.booleans())
    def claim_deferred(self, data, replica, hand_back):
        """claim, alloc(defer_lookup=True), start_lookup, then alloc or hand the lookup back."""
        ctx = TextContext(self._new_id(), self._prompt(data))
        note(f"m.claim(TextContext({ctx.request_id!r}, {ctx.tokens.tolist()}), {replica})")
        self.m.claim(ctx, replica)
        self.live[ctx.request_id] = ctx
        self._alloc(ctx, defer_lookup=True)
        if not self.m.contains(ctx) or not self.m.starts_lookup(ctx):
            return
        used = [self.m.block_count(r) for r in range(2)]
        assert self.m.start_lookup(ctx) and self.m.awaits_lookup(ctx)
        assert [self.m.block_count(r) for r in range(2)] == used  # a lookup reserves nothing
        if hand_back:
            assert self.m.hand_back_lookup(ctx)
        self._alloc(ctx)
        assert self.m.awaits_lookup(ctx) == (self.out_of_blocks and not hand_back)

    def teardown(self):
        for ctx in list(self.live.values()) + list(self.dummies.values()):
            self.m.release(ctx)
        self.live.clear()
        self.dummies.clear()
        self.m.shutdown()
        self.m.check_invariants()
        for r in range(2):
            assert not self.m.pending_transfers_exist(r)
            assert self.m.block_count(r).used == 0, "pages leaked after every request was released"


ConnectorMachine.TestCase.settings = settings(settings.default, stateful_step_count=60)
TestConnectorMachine = ConnectorMachine.TestCase
