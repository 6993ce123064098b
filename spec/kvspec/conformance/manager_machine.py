"""``ManagerComparison``: the differential state machine of ``PagedKVCacheManager``.

Each example builds one small manager on the backend under test and one on
``kvref``, creates requests (``TextContext`` pairs with equal tokens, one per
side, because the manager writes into its context) and applies random
operations: one rule per public method, named after it. ``step`` simulates a
forward: it writes deterministic K/V for the active tokens into the pages the
request holds, calls ``ctx.update(token)`` (or ``advance_chunk()`` after a
chunk) and then ``manager.step(ctx)``.

Every call goes through :meth:`ManagerComparison._both` (same outcome, no
state change after a raise); one ``@invariant`` compares the observable state:
``check_invariants()``, contexts, block rows, counts, metrics, free order and
device buffer bytes (the last two only with ``strict_block_ids``).
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule

from .. import strategies as kst
from .._manager_types import DEFAULT_LEAF_ID, TextContext
from ._backend import Backend, BackendBound
from ._compare import assert_same, assert_same_outcome, begin_reproduction, capture, record, to_numpy

__all__ = ["ManagerComparison", "write_forward", "forward_values", "replacement_context", "manager_snapshot", "context_state"]

_RARE = st.sampled_from([False] * 7 + [True])


def context_state(ctx: TextContext) -> dict:
    """The fields of a context the manager reads or writes."""
    return {
        "tokens": np.array(ctx.tokens),
        "processed_length": ctx.processed_length,
        "active_length": ctx.active_length,
        "cached_prefix_length": ctx.cached_prefix_length,
        "cached_prefix_external_length": ctx.cached_prefix_external_length,
    }


def forward_values(n: int, params, seed: int) -> np.ndarray:
    """The K/V a forward of ``n`` tokens writes: ``[n, 2, num_layers, kv_heads, head_dim]``,
    K (``[:, 0]``) and V (``[:, 1]``) non-zero and different in every element
    (``kvspec.strategies.distinct_pair``), so V stored as K never passes."""
    k, v = kst.distinct_pair((n, params.num_layers, params.kv_heads, params.head_dim), params.dtype, seed)
    return np.stack([k, v], axis=1)


def replacement_context(ctx: TextContext) -> TextContext:
    """A new ``TextContext`` object in the same state as ``ctx`` (tokens, salt, processed,
    active and pending marks, cached prefix fields): what an engine hands the
    manager when it rebuilds its request objects (spec/manager.md §2.3)."""
    new = TextContext(ctx.request_id, np.array(ctx.tokens), cache_salt=ctx.cache_salt)
    if ctx.processed_length:
        new.skip_processing(ctx.processed_length)
    if ctx.pending_length:
        new.chunk(ctx.active_length)
    new.cached_prefix_length = ctx.cached_prefix_length
    new.cached_prefix_external_length = ctx.cached_prefix_external_length
    return new


def write_forward(manager, ctx: TextContext, seed: int, replica_idx: int = 0) -> None:
    """Write K/V for ``ctx``'s active tokens into the pages it holds (the work a
    forward does through the lookup table). Values are ``forward_values(n, params, seed)``."""
    params = manager.params
    page = params.page_size
    rows = manager.get_req_blocks_per_leaf(ctx)[DEFAULT_LEAF_ID]
    buf = manager.get_device_buffer(replica_idx)
    if isinstance(buf, dict):
        buf = buf[DEFAULT_LEAF_ID]
    start, n = ctx.processed_length, ctx.active_length
    kv = forward_values(n, params, seed)
    for j in range(n):
        p = start + j
        blk = rows[p // page]
        if blk == 0:
            continue
        row = kv[j]
        if isinstance(buf, np.ndarray):
            buf[blk, :, :, p % page] = row
        else:  # pragma: no cover - GPU arrays
            from ._compare import to_device

            buf[blk, :, :, p % page] = to_device(row)


def manager_snapshot(manager, contexts, *, strict: bool) -> dict:
    """Everything observable of a manager and its contexts, as host copies."""
    dp = manager.params.data_parallel_degree
    snap = {
        "metrics": manager.get_metrics_aggregated(),
        "block_count": [manager.block_count(r) for r in range(dp)],
        "pressure_pct": [manager.pressure_pct(r) for r in range(dp)],
        "pending_transfers_exist": [manager.pending_transfers_exist(r) for r in range(dp)],
    }
    for rid, ctx in contexts.items():
        claimed = manager.contains(ctx)
        snap[f"{rid}.contains"] = claimed
        snap[f"{rid}.ctx"] = context_state(ctx)
        snap[f"{rid}.num_req_blocks"] = manager.num_req_blocks(ctx)
        if claimed:
            rows = manager.get_req_blocks_per_leaf(ctx)
            snap[f"{rid}.blocks"] = rows if strict else {k: len(v) for k, v in rows.items()}
    if strict:
        for r in range(dp):
            snap[f"free_order[{r}]"] = list(manager._free_order(r))
            buf = manager.get_device_buffer(r)
            snap[f"device_buffer[{r}]"] = {k: to_numpy(v).copy() for k, v in buf.items()} if isinstance(buf, dict) else to_numpy(buf).copy()
            if manager.params.page_scales_shape:  # spec/manager.md §16: FP8 pages carry scales
                sc = manager.get_device_scales_buffer(r)
                snap[f"device_scales[{r}]"] = ({k: to_numpy(v).copy() for k, v in sc.items()} if isinstance(sc, dict)
                                               else to_numpy(sc).copy())
    return snap


class ManagerComparison(BackendBound, RuleBasedStateMachine):
    """Differential state machine: the backend's manager against ``kvref.PagedKVCacheManager``.

    Attributes
    ----------
    backend : Backend
        Set by :meth:`for_backend`.
    oracle : Backend
        ``kvref.conformance_backend()`` unless given.
    """

    prompts = Bundle("prompts")

    def __init__(self):
        self._require_backend()
        super().__init__()
        self.ref = self.sut = None
        self.ctx_ref: dict[str, TextContext] = {}
        self.ctx_sut: dict[str, TextContext] = {}
        self.allocated: set[str] = set()
        self.replica_of: dict[str, int] = {}
        self.n_requests = 0

    # ------------------------------------------------------------------ helpers

    @property
    def strict(self) -> bool:
        return self.backend.supports("strict_block_ids")

    def _snaps(self):
        return (manager_snapshot(self.ref, self.ctx_ref, strict=True),
                manager_snapshot(self.sut, self.ctx_sut, strict=self.strict))

    def _both(self, label: str, fn, *, drains: bool = False):
        """Apply ``fn(manager, contexts)`` to both sides; same outcome; no change after a raise.

        ``drains``: the call first lands finished transfers (``alloc``, DESIGN
        §5); when transfers were pending, that landing may change state before
        a raise, so only the agreement with kvref is checked then.
        """
        __tracebackhide__ = True
        before = self._snaps()
        r = capture(lambda: fn(self.ref, self.ctx_ref))
        s = capture(lambda: fn(self.sut, self.ctx_sut), source=label)
        assert_same_outcome(label, r, s)
        if r.raised:
            after = self._snaps()
            if not (drains and any(before[0]["pending_transfers_exist"])):  # else the invariant compares the sides
                assert_same(before[0], after[0], f"{label} [kvref state after raise]")
                assert_same(before[1], after[1], f"{label}: state changed after {type(s.exc).__name__}")
            return None
        return r.value, s.value

    def _rid(self, data, *, claimed: bool | None = None, prefer=None) -> str | None:
        """A request id: claimed or not as asked, and usually one ``prefer`` likes."""
        ids = sorted(self.ctx_ref)
        if claimed is not None:
            ids = [i for i in ids if self.ref.contains(i) == claimed]
        if prefer is not None and not data.draw(_RARE, label="any request"):
            ids = [i for i in ids if prefer(i)] or ids
        if not ids:
            return None
        return data.draw(st.sampled_from(ids), label="request")

    # ------------------------------------------------------------------ construction

    @initialize(data=st.data())
    def make(self, data):
        # spec/manager.md §9.1, §9.8: tiers serve every leaf kind, so a connector comes with any leaves.
        use_tiers = self.backend.supports("tiers", "prefix_caching") and data.draw(st.booleans(), label="connector")
        setup = data.draw(kst.manager_setups(self.backend.capabilities), label="setup")
        self.params = setup["params"]
        self.max_seq_len = setup["max_seq_len"]
        self.dp = self.params.data_parallel_degree
        kw = {k: v for k, v in setup.items() if k != "params"}
        self.conns = (None, None)
        if use_tiers and self.params.enable_prefix_caching:
            from ._harness import ManualConnector

            self.conns = (ManualConnector(), ManualConnector())
        begin_reproduction("manager", self.backend, params=self.params, kw=kw, connector=self.conns[0] is not None)
        self.ref = self.oracle.make_manager(self.params, connector=self.conns[0], **kw)
        self.sut = self.backend.build_manager(self.params, connector=self.conns[1], **kw)
        self._start_requests(data)

    def _start_requests(self, data):
        """Two claimed requests sharing a prefix, so every example starts with work;
        with a connector, the first runs once and is preempted so the tier is warm."""
        for i in range(2):
            if i == 1 and self.conns[0] is not None:  # r1 extends r0, so it can load r0's blocks
                self._new(data, None, list(self.ctx_ref["r0"].tokens) + data.draw(kst.prompts(1, 4), label="more"))
            else:
                self._new(data, None)
            rid = f"r{self.n_requests - 1}"
            if self._both(f"manager.claim(ctx_{rid}, 0)", lambda m, cs: m.claim(cs[rid], 0)) is not None:
                self.replica_of[rid] = 0
        if self.conns[0] is not None and self.replica_of.get("r0") == 0:
            # Warm the tier: r0 runs one forward, its blocks are offloaded, then it is preempted.
            if self._both("manager.alloc(ctx_r0).is_complete()", lambda m, cs: m.alloc(cs["r0"]).is_complete(), drains=True) is not None:
                self._forward("r0", data)
            self._both("manager.poll_transfers()", lambda m, cs: m.poll_transfers())
            if self._both("manager.release(ctx_r0)", lambda m, cs: m.release(cs["r0"])) is not None:
                record("ctx_r0.reset()")
                self.ctx_ref["r0"].reset()
                self.ctx_sut["r0"].reset()
            # Only the tier holds r0's prefix now: the next alloc sharing it loads.
            self._both("manager.reset_prefix_cache()", lambda m, cs: m.reset_prefix_cache())

    # ------------------------------------------------------------------ requests

    @rule(target=prompts, p=kst.prompts(1, 12))
    def new_prompt(self, p):
        return p

    @rule(target=prompts, base=prompts, more=kst.prompts(1, 6))
    def extend_prompt(self, base, more):
        return base + more

    def _shared_prompt(self, data) -> list[int]:
        """A prompt that often starts with another request's tokens (so prefixes hit)."""
        fresh = data.draw(kst.prompts(1, 10), label="tokens")
        known = [list(c.tokens) for c in self.ctx_ref.values()]
        if known and data.draw(st.booleans(), label="share a prefix"):
            base = data.draw(st.sampled_from(known), label="base")
            return base[: data.draw(st.integers(0, len(base)), label="cut")] + fresh
        return fresh

    @precondition(lambda self: self.ref is not None and len(self.ctx_ref) < 6)
    @rule(data=st.data(), salt=st.sampled_from([None, None, None, "s"]))
    def new_request(self, data, salt):
        self._new(data, salt)

    def _new(self, data, salt, prompt=None):
        prompt = self._shared_prompt(data) if prompt is None else prompt
        rid = f"r{self.n_requests}"
        self.n_requests += 1
        cap = self.max_seq_len + 1 if data.draw(_RARE, label="too long") else self.max_seq_len - 1
        tokens = np.array(prompt[: max(cap, 1)], np.int32)
        record(f"ctx_{rid} = TextContext({rid!r}, np.array({tokens.tolist()}, np.int32), cache_salt={salt!r})")
        self.ctx_ref[rid] = TextContext(rid, tokens, cache_salt=salt)
        self.ctx_sut[rid] = TextContext(rid, tokens, cache_salt=salt)

    # ------------------------------------------------------------------ manager methods

    @rule(data=st.data())
    def claim(self, data):
        rid = self._rid(data, claimed=None if data.draw(_RARE) else False)
        if rid is None:
            return
        r = data.draw(st.integers(0, self.dp - 1) if not data.draw(_RARE) else st.just(self.dp), label="replica")
        if self._both(f"manager.claim(ctx_{rid}, {r})", lambda m, cs: m.claim(cs[rid], r)) is not None:
            self.replica_of[rid] = r

    @rule(data=st.data())
    def alloc(self, data):
        rid = self._rid(data, claimed=None if data.draw(_RARE) else True,
                        prefer=lambda i: i not in self.allocated)
        if rid is None:
            return
        out = self._both(f"manager.alloc(ctx_{rid}).is_complete()", lambda m, cs: m.alloc(cs[rid]).is_complete(), drains=True)
        if out is not None:
            self.allocated.add(rid)

    @precondition(lambda self: self.allocated)
    @rule(data=st.data(), how=st.sampled_from(["same", "defer_lookup", "replacement"]))
    def alloc_again(self, data, how):
        """A second ``alloc`` before ``step`` (spec/manager.md §4.9: idempotent): with
        the same context, with ``defer_lookup=True``, or with a replacement context
        object of the same tokens and marks (spec/manager.md §2.3) that ``alloc`` sees first."""
        rid = data.draw(st.sampled_from(sorted(self.allocated)), label="request")

        if how == "replacement":
            label = (f"manager.alloc(__import__('kvspec.conformance.manager_machine', fromlist=['_'])"
                     f".replacement_context(ctx_{rid})).is_complete()  # a new context object, same state")

            def fn(m, cs):
                cs[rid] = replacement_context(cs[rid])
                return m.alloc(cs[rid]).is_complete()
        else:
            kw = ", defer_lookup=True" if how == "defer_lookup" else ""
            label = f"manager.alloc(ctx_{rid}{kw}).is_complete()"
            fn = lambda m, cs: m.alloc(cs[rid], defer_lookup=(how == "defer_lookup")).is_complete()  # noqa: E731
        self._both(label, fn, drains=True)

    @rule(data=st.data())
    def chunk(self, data):
        """``ctx.chunk(n)`` on both contexts (a chunked prefill), before ``alloc``."""
        rid = self._rid(data, claimed=True)
        if rid is None or rid in self.allocated or self.ctx_ref[rid].active_length < 2:
            return
        active, page = self.ctx_ref[rid].active_length, self.params.page_size
        whole = [k * page for k in range(1, (active - 1) // page + 1)]
        if whole and data.draw(st.booleans(), label="whole pages"):  # chunk-aligned (a scheduler's usual cut)
            n = data.draw(st.sampled_from(whole), label="n")
        else:
            n = data.draw(st.integers(1, active - 1), label="n")
        record(f"ctx_{rid}.chunk({n})")
        self.ctx_ref[rid].chunk(n)
        self.ctx_sut[rid].chunk(n)

    @rule(data=st.data())
    def step(self, data):
        """A forward over the active tokens, then ``manager.step(ctx)``."""
        rid = self._rid(data, claimed=None if data.draw(_RARE) else True, prefer=lambda i: i in self.allocated)
        if rid is None:
            return
        if rid in self.allocated:
            self._forward(rid, data)
        else:
            self._both(f"manager.step(ctx_{rid})", lambda m, cs: m.step(cs[rid]))

    def _forward(self, rid: str, data) -> None:
        """Write the active tokens' K/V, ``update`` (or ``advance_chunk``), then ``step``."""
        self._write_forward(rid, data)
        self._both(f"manager.step(ctx_{rid})", lambda m, cs: m.step(cs[rid]))

    def _write_forward(self, rid: str, data) -> None:
        """Write the active tokens' K/V, then ``update`` (or ``advance_chunk``), on both sides."""
        seed = data.draw(st.integers(0, 2**16), label="kv seed")
        token = data.draw(kst.token_ids(), label="token")
        then = "advance_chunk()" if self.ctx_ref[rid].pending_length else f"update({token})"
        record(f"write_forward(manager, ctx_{rid}, {seed}, {self.replica_of[rid]}); ctx_{rid}.{then}")
        for m, cs in ((self.ref, self.ctx_ref), (self.sut, self.ctx_sut)):
            write_forward(m, cs[rid], seed, self.replica_of[rid])
            if cs[rid].pending_length:
                cs[rid].advance_chunk()
            else:
                cs[rid].update(token)
        self.allocated.discard(rid)

    @rule(data=st.data())
    def release(self, data):
        rid = self._rid(data, claimed=None if data.draw(_RARE) else True)
        if rid is None:
            return
        out = self._both(f"manager.release(ctx_{rid})", lambda m, cs: m.release(cs[rid]))
        if out is not None:
            record(f"ctx_{rid}.reset()  # preempted: recompute from scratch")
            self.ctx_ref[rid].reset()
            self.ctx_sut[rid].reset()
            self.allocated.discard(rid)

    # ------------------------------------------------------------------ batch calls (spec/manager.md §17)

    def _batch(self, data, *, claimed=True, prefer=None) -> list[str]:
        """Request ids for a batch call: a few claimed ones, now and then an unclaimed one or a
        repeat (the loop's own refusal or second call), in a drawn order."""
        ids = [i for i in sorted(self.ctx_ref) if claimed is None or self.ref.contains(i) == claimed]
        if prefer is not None:
            ids = [i for i in ids if prefer(i)] or ids
        if not ids:
            return []
        out = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=4, unique=True), label="batch")
        if data.draw(_RARE, label="an odd member"):
            out.append(data.draw(st.sampled_from(sorted(self.ctx_ref)), label="odd member"))
        return out

    @rule(data=st.data())
    def alloc_many(self, data):
        """``alloc_many``: the loop of ``alloc``, or its error with nothing changed."""
        ids = self._batch(data, prefer=lambda i: i not in self.allocated)
        if not ids:
            return
        args = ", ".join(f"ctx_{i}" for i in ids)
        out = self._both(f"[t.is_complete() for t in manager.alloc_many([{args}])]",
                         lambda m, cs: [t.is_complete() for t in m.alloc_many([cs[i] for i in ids])], drains=True)
        if out is not None:
            self.allocated.update(ids)

    @precondition(lambda self: self.allocated)
    @rule(data=st.data())
    def step_many(self, data):
        """Forwards of several allocated requests, then one ``step_many`` over them."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.allocated)), min_size=1, max_size=4, unique=True),
                        label="batch")
        for rid in ids:
            self._write_forward(rid, data)
        if data.draw(_RARE, label="an odd member"):
            ids = ids + [data.draw(st.sampled_from(sorted(self.ctx_ref)), label="odd member")]
        args = ", ".join(f"ctx_{i}" for i in ids)
        self._both(f"manager.step_many([{args}])", lambda m, cs: m.step_many([cs[i] for i in ids]))

    @rule(data=st.data())
    def release_many(self, data):
        ids = self._batch(data)
        if not ids:
            return
        args = ", ".join(f"ctx_{i}" for i in ids)
        out = self._both(f"manager.release_many([{args}])", lambda m, cs: m.release_many([cs[i] for i in ids]))
        if out is not None:
            for rid in dict.fromkeys(ids):
                record(f"ctx_{rid}.reset()  # preempted: recompute from scratch")
                self.ctx_ref[rid].reset()
                self.ctx_sut[rid].reset()
                self.allocated.discard(rid)

    @rule(data=st.data())
    def alloc_dummy(self, data):
        rid = self._rid(data, claimed=False)
        if rid is None:
            return
        r = data.draw(st.integers(0, self.dp - 1), label="replica")
        if self._both(f"manager.alloc_dummy(ctx_{rid}, {r})", lambda m, cs: m.alloc_dummy(cs[rid], r)) is not None:
            self.replica_of[rid] = r

    @rule(data=st.data())
    def runtime_inputs(self, data):
        chosen = [rid for rid in sorted(self.allocated) if data.draw(st.booleans(), label=f"batch {rid}")]
        if not chosen and not data.draw(_RARE, label="empty batch"):
            return
        batches = [[] for _ in range(self.dp)]
        for rid in chosen:
            batches[self.replica_of[rid]].append(rid)
        if data.draw(_RARE, label="fault") and batches[0]:
            batches = batches[:-1] if self.dp > 1 else batches + [[]]
        mcl = data.draw(st.one_of(st.none(), st.none(), st.integers(0, self.max_seq_len + 4)), label="max_cache_length")

        def call(m, cs):
            inputs = m.runtime_inputs([[cs[rid] for rid in b] for b in batches], max_cache_length=mcl)
            out = []
            for per in inputs.inputs:
                leaves = per if isinstance(per, dict) else {DEFAULT_LEAF_ID: per}
                view = {}
                for lid, x in leaves.items():
                    lut = to_numpy(x.lookup_table)
                    view[lid] = {
                        # without strict block ids only which entries are live (non-null) must agree
                        "lookup_table": lut if self.strict else lut != 0,
                        "cache_lengths": x.cache_lengths,
                        "max_prompt_length": x.max_prompt_length,
                        "max_cache_length": x.max_cache_length,
                    }
                out.append(view)
            return out

        ctxs = "[" + ", ".join("[" + ", ".join(f"ctx_{rid}" for rid in b) + "]" for b in batches) + "]"
        self._both(f"manager.runtime_inputs({ctxs}, max_cache_length={mcl})", call)

    @rule(data=st.data(), gate=st.booleans())
    def get_prefix_cache_hit_counts(self, data, gate):
        if not gate:
            return
        prompt = self._shared_prompt(data)
        tokens = np.array(prompt[: self.max_seq_len], np.int32)
        self._both(f"manager.get_prefix_cache_hit_counts(TextContext('probe', np.array({tokens.tolist()}, np.int32)))",
                   lambda m, cs: m.get_prefix_cache_hit_counts(TextContext("probe", tokens)))

    @precondition(lambda self: self.ref is not None and self.conns[0] is not None and self.conns[0].pending)
    @rule()
    def land_transfers(self):
        """Land every pending connector load on both sides (the copies finish)."""
        record("connector.land()")
        assert self.conns[0].land() == self.conns[1].land(), "pending loads differ between kvref and the backend"

    @precondition(lambda self: self.ref is not None and self.conns[0] is not None and self.conns[0].pending)
    @rule(gate=st.booleans())
    def fail_transfers(self, gate):
        """Fail every pending load on both sides (one draw in two): the copy broke."""
        if gate:
            record("connector.fail()")
            assert self.conns[0].fail() == self.conns[1].fail(), "pending loads differ between kvref and the backend"

    @rule(gate=_RARE)
    def reset_prefix_cache(self, gate):
        if gate or (self.conns[0] is not None and len(self.conns[0].store)):
            self._both("manager.reset_prefix_cache()", lambda m, cs: m.reset_prefix_cache())

    @rule(gate=_RARE)
    def take_metrics_aggregated(self, gate):
        if gate:
            self._both("manager.take_metrics_aggregated()", lambda m, cs: m.take_metrics_aggregated())

    @rule(gate=_RARE)
    def poll_transfers(self, gate):
        if gate or self.conns[0] is not None:  # with a connector, polling posts offloads and lands loads
            self._both("manager.poll_transfers()", lambda m, cs: m.poll_transfers())

    # ------------------------------------------------------------------ invariant

    @invariant()
    def agrees_with_kvref(self):
        if self.ref is None:
            return
        self.ref.check_invariants()
        if self.backend.supports("invariants"):
            self.sut.check_invariants()
        a = manager_snapshot(self.ref, self.ctx_ref, strict=self.strict)
        b = manager_snapshot(self.sut, self.ctx_sut, strict=self.strict)
        assert_same(a, b, "manager state")
