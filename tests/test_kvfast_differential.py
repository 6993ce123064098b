"""kvfast against kvref, side by side (DESIGN §7, issue 5 "Done when").

* The slot cache: the conformance state machine ``KVCacheComparison`` runs
  ``kvfast.KVCache`` (+ ``kvfast.ops``) against ``kvref`` and compares, after
  every rule, returned values / exceptions (type and message), ``seq_lens``,
  block tables, the free order, stored K/V bytes, state slabs and cross planes.
* The request manager: the conformance machine ``ManagerComparison`` (with
  tiers), and ``ManagerDiff`` below, which plays a scheduler against a
  ``kvref`` and a ``kvfast`` manager at once (the fast path's configuration and
  a two-replica, three-leaf one) and compares returned values, exceptions,
  block ids per leaf, free orders, metrics, block counts, context fields,
  runtime inputs and device buffers after every rule.

GPU variants are marked ``gpu`` and skip without a device.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

import kvfast
import kvref
from kvfast._backend import conformance_backend
from kvspec import InsufficientBlocksError, KVCacheParams, LeafSpec, TextContext


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


# --------------------------------------------------------------------------- slot cache


def test_slot_cache_differential():
    from kvspec.conformance.machine import KVCacheComparison

    run_state_machine_as_test(KVCacheComparison.for_backend(conformance_backend()))


def test_manager_conformance_machine():
    """The conformance suite's manager machine (tiers, replicas, leaves) on kvfast vs kvref."""
    from kvspec.conformance.manager_machine import ManagerComparison

    run_state_machine_as_test(ManagerComparison.for_backend(conformance_backend()))


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="no CUDA device visible (CuPy absent or no GPU)")
def test_slot_cache_differential_cuda():  # pragma: no cover - needs a GPU
    import dataclasses

    from kvspec.conformance.machine import KVCacheComparison

    backend = dataclasses.replace(conformance_backend(), devices=("cuda:0",))
    run_state_machine_as_test(KVCacheComparison.for_backend(backend))


# --------------------------------------------------------------------------- request manager

PAGE = 2
MAX_SEQ = 14
CONFIGS = {
    # the fast path: one full leaf, one replica, no connector
    "fast": dict(leaves=None, data_parallel_degree=1, enable_prefix_caching=True),
    "fast_nocache": dict(leaves=None, data_parallel_degree=1, enable_prefix_caching=False),
    "xxh3": dict(leaves=None, data_parallel_degree=1, enable_prefix_caching=True, hash_algo="xxh3_128"),
    # the reference paths over fast pools: replicas and hybrid leaves
    "hybrid": dict(
        leaves={"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(3), "rec": LeafSpec.recurrent((2,))},
        data_parallel_degree=2, enable_prefix_caching=True,
    ),
    "replicas": dict(leaves=None, data_parallel_degree=2, enable_prefix_caching=True),
    # the decode lanes with several leaves on one replica (issue 12): slab growth, the quiet step
    "sliding": dict(leaves={"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(3)},
                    data_parallel_degree=1, enable_prefix_caching=True),
    "recurrent": dict(leaves={"full": LeafSpec.full(), "rec": LeafSpec.recurrent((2,))},
                      data_parallel_degree=1, enable_prefix_caching=True),
    "sliding_only": dict(leaves={"swa": LeafSpec.sliding_window(3)}, data_parallel_degree=1,
                         enable_prefix_caching=False),
    # a host tier of 6 pages (bookkeeping only: every transfer is accounted at its post, so both
    # sides see the same tier at every call): the admission lane's external stage, loads, offloads
    "tiered": dict(leaves=None, data_parallel_degree=1, enable_prefix_caching=True, allocate_buffers=False,
                   host_offload_bytes=6 * 2 * PAGE * 4),
    # MAX's speculative decoding (spec/manager.md §15: seq_len sizing, draft lengths, rollback) and FP8
    # scales (spec/manager.md §16): the lanes serve both (the ``drafts`` rule sets the lists)
    "spec": dict(leaves=None, data_parallel_degree=1, enable_prefix_caching=True, speculative_method="eagle",
                 num_draft_tokens=2),
    "spec_sliding": dict(leaves={"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(3)},
                         data_parallel_degree=1, enable_prefix_caching=True, speculative_method="dflash",
                         num_draft_tokens=2),
    "fp8": dict(leaves=None, data_parallel_degree=2, enable_prefix_caching=True, dtype="float8_e4m3fn"),
}


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as e:
        return ("err", type(e).__name__, str(e))


def _norm(v):
    """Comparable form of a manager result."""
    if isinstance(v, np.ndarray):
        return ("nd", v.dtype.str, v.shape, v.tobytes())
    if isinstance(v, (list, tuple)):
        return tuple(_norm(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _norm(x)) for k, x in v.items()))
    if hasattr(v, "__dataclass_fields__"):
        return (type(v).__name__,) + tuple(_norm(getattr(v, f)) for f in v.__dataclass_fields__ if f != "kv_blocks")
    if type(v).__name__ == "CompletedTransfer":
        return "CompletedTransfer"
    return v


def _kv_value(tokens, p: int) -> float:
    t = np.asarray(tokens[: p + 1], dtype=np.int64)
    return float(int(np.sum(t * np.arange(1, p + 2))) % 1009 + 1)


class ManagerDiff(RuleBasedStateMachine):
    """A scheduler driving a kvref and a kvfast manager with the same calls."""

    @initialize(cfg=st.sampled_from(["fast", "fast", "fast", "fast_nocache", "xxh3", "hybrid", "replicas",
                                     "sliding", "recurrent", "sliding_only", "tiered", "tiered", "spec", "spec",
                                     "spec_sliding", "fp8"]),
                num_blocks=st.integers(8, 14))
    def setup(self, cfg, num_blocks):
        if CONFIGS[cfg]["leaves"] is not None:  # spec/manager.md §1.6: the pool holds one MAX_SEQ request of every leaf
            num_blocks = max(num_blocks, 11)
        kw = dict(CONFIGS[cfg])
        if kw.get("num_draft_tokens"):  # and the draft slack (spec/manager.md §15.8)
            num_blocks = max(num_blocks, 13 if kw["leaves"] is None else 22)
        self.num_blocks = num_blocks
        kw.setdefault("dtype", "float32")
        self.cfg = cfg
        self.params = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=1, **kw)
        self.sides = []
        for mod in (kvref, kvfast):
            self.sides.append(mod.PagedKVCacheManager(
                self.params, num_blocks=num_blocks, max_batch_size=3, max_seq_len=MAX_SEQ))
        self.ctxs: dict[str, tuple[TextContext, TextContext]] = {}
        self.prompts: list[list[int]] = [[1, 2, 1, 2, 1]]
        self.n = 0
        note(f"# config {cfg}: {self.params!r}, num_blocks={num_blocks}")

    # -- helpers
    def both(self, what, fn):
        a = _outcome(lambda: fn(self.sides[0], 0))
        b = _outcome(lambda: fn(self.sides[1], 1))
        note(f"{what} -> {a[0]}{'' if a[0] == 'ok' else ': ' + a[2]}")
        assert _norm(a) == _norm(b), (what, a, b)
        return a

    def pair(self, data):
        rid = data.draw(st.sampled_from(sorted(self.ctxs)), label="request")
        return rid, self.ctxs[rid]

    # -- rules
    @rule(data=st.data(), extend=st.lists(st.integers(1, 3), min_size=0, max_size=7),
          salt=st.sampled_from([None, None, "s"]), replica=st.integers(0, 2))
    def claim(self, data, extend, salt, replica):
        base = data.draw(st.sampled_from(self.prompts), label="base prompt")
        cut = data.draw(st.integers(0, len(base)), label="prefix kept")
        prompt = base[:cut] + extend
        if not prompt:
            prompt = [1]
        self.prompts.append(prompt)
        rid = f"r{self.n}"
        self.n += 1
        pair = (TextContext(rid, prompt, salt), TextContext(rid, prompt, salt))
        a = self.both(f"claim({rid}, {prompt}, salt={salt!r}, replica={replica})",
                      lambda m, i: m.claim(pair[i], replica))
        if a[0] == "ok":
            self.ctxs[rid] = pair

    @rule(data=st.data(), extend=st.lists(st.integers(1, 3), max_size=4), decode=st.integers(0, 4))
    def serve(self, data, extend, decode):
        """A whole request: claim, alloc, prefill, decode steps, release (prefix hits happen here)."""
        base = data.draw(st.sampled_from(self.prompts), label="base prompt")
        prompt = base + extend
        rid = f"s{self.n}"
        self.n += 1
        pair = (TextContext(rid, prompt), TextContext(rid, prompt))
        if self.both(f"claim({rid}, {prompt})", lambda m, i: m.claim(pair[i]))[0] != "ok":
            return
        self.prompts.append(prompt)
        for s_ in range(decode + 1):
            if self.both(f"alloc({rid})", lambda m, i: m.alloc(pair[i]))[0] != "ok":
                break
            self._same_ctx(pair)
            if len(pair[0]) >= MAX_SEQ:
                break
            for ctx in pair:
                ctx.update(1 + (len(ctx) % 3))
            self.both(f"update; step({rid})", lambda m, i: m.step(pair[i]))
        self.both(f"release({rid})", lambda m, i: m.release(pair[i]))

    @rule(data=st.data(), replica=st.integers(0, 1))
    def alloc_dummy(self, data, replica):
        rid = f"d{self.n}"
        self.n += 1
        pair = (TextContext(rid, [1, 2, 3]), TextContext(rid, [1, 2, 3]))
        a = self.both(f"alloc_dummy({rid}, {replica})", lambda m, i: m.alloc_dummy(pair[i], replica))
        if a[0] == "ok":
            self.ctxs[rid] = pair

    @precondition(lambda self: self.ctxs)
    @rule(data=st.data())
    def alloc(self, data):
        rid, pair = self.pair(data)
        self.both(f"alloc({rid})", lambda m, i: m.alloc(pair[i]))
        self._same_ctx(pair)

    @precondition(lambda self: self.ctxs)
    @rule(data=st.data(), token=st.integers(1, 3))
    def forward(self, data, token):
        """Write the active tokens' K/V (both sides alike), then update + step."""
        rid, pair = self.pair(data)
        for i, m in enumerate(self.sides):
            ctx = pair[i]
            req = m._requests.get(rid)
            if req is None or req.dummy:
                continue
            for lid, row in req.rows.items():
                if self.params.leaves()[lid].kind.name == "RECURRENT":
                    continue
                buf = m._buffers[req.replica][lid]
                if buf is None:  # bookkeeping-only mode: no bytes to write
                    continue
                for p in range(ctx.processed_length, ctx.current_position):
                    if p // PAGE < len(row) and row[p // PAGE]:
                        buf[row[p // PAGE], :, 0, p % PAGE] = _kv_value(ctx.tokens, p)
        if len(pair[0]) >= MAX_SEQ or pair[0].pending_length:
            return
        for ctx in pair:
            ctx.update(token)
        self.both(f"update({token}); step({rid})", lambda m, i: m.step(pair[i]))
        self._same_ctx(pair)

    @precondition(lambda self: self.ctxs)
    @rule(data=st.data())
    def prefill_then_step(self, data):
        """The peer adapter's admission: everything but the last token computed, then step."""
        rid, pair = self.pair(data)
        if pair[0].active_length < 2:
            return
        for ctx in pair:
            ctx.skip_processing(ctx.active_length - 1)
        self.both(f"skip + step({rid})", lambda m, i: m.step(pair[i]))

    @precondition(lambda self: self.ctxs)
    @rule(data=st.data(), verify=st.lists(st.integers(1, 3), max_size=3),
          maybe=st.lists(st.integers(1, 3), max_size=3), as_tuple=st.booleans())
    def drafts(self, data, verify, maybe, as_tuple):
        """The next forward's drafts and those in flight (spec/manager.md §15.2); up to one more than
        ``num_draft_tokens`` and sometimes tuples, so the refusals and the policy's paths run too."""
        rid, pair = self.pair(data)
        if not self.params.num_draft_tokens:
            verify, maybe = verify[:1] if as_tuple else [], []  # a draft without speculative decoding: refused
        for ctx in pair:
            ctx.spec_decoding_state.draft_tokens_to_verify = tuple(verify) if as_tuple else list(verify)
            ctx.spec_decoding_state.maybe_accepted_draft_tokens = list(maybe)
        note(f"drafts({rid}): verify={verify} maybe={maybe} tuple={as_tuple}")

    @precondition(lambda self: self.ctxs)
    @rule(data=st.data(), n=st.integers(1, 4))
    def chunk(self, data, n):
        rid, pair = self.pair(data)
        for ctx in pair:
            if 1 <= n < ctx.active_length:
                ctx.chunk(n)

    @precondition(lambda self: self.ctxs)
    @rule(data=st.data())
    def release(self, data):
        rid, pair = self.pair(data)
        self.both(f"release({rid})", lambda m, i: m.release(pair[i]))
        self.ctxs.pop(rid)

    @rule()
    def release_unknown(self):
        self.both("release('nope')", lambda m, i: m.release("nope"))
        self.both("alloc(unclaimed)", lambda m, i: m.alloc(TextContext("nope", [1])))

    @precondition(lambda self: self.ctxs)
    @rule(data=st.data())
    def hit_counts(self, data):
        rid, pair = self.pair(data)
        self.both(f"get_prefix_cache_hit_counts({rid})", lambda m, i: m.get_prefix_cache_hit_counts(pair[i]))
        self.both(f"num_req_blocks({rid})", lambda m, i: m.num_req_blocks(pair[i]))

    @rule(data=st.data(), mcl=st.sampled_from([None, 1, 8, 16]))
    def runtime_inputs(self, data, mcl):
        dp = self.params.data_parallel_degree
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.ctxs)), unique=True, max_size=4)
                           if self.ctxs else st.just([]), label="batch")
        batches = []
        for r in range(dp):
            batches.append([rid for rid in chosen if self.sides[0]._requests[rid].replica == r])
        self.both(f"runtime_inputs({batches}, max_cache_length={mcl})",
                  lambda m, i: m.runtime_inputs([[self.ctxs[rid][i] for rid in b] for b in batches],
                                                max_cache_length=mcl))

    @rule()
    def reset_prefix_cache(self):
        self.both("reset_prefix_cache()", lambda m, i: m.reset_prefix_cache())

    @rule()
    def take_metrics(self):
        self.both("take_metrics_aggregated()", lambda m, i: m.take_metrics_aggregated())

    # -- comparison
    def _same_ctx(self, pair):
        a, b = pair
        assert (a.processed_length, a.active_length, a.cached_prefix_length, a.cached_prefix_external_length,
                a.tokens.tobytes()) == (b.processed_length, b.active_length, b.cached_prefix_length,
                                        b.cached_prefix_external_length, b.tokens.tobytes())

    @invariant()
    def agree(self):
        if not hasattr(self, "sides"):
            return
        ref, fast = self.sides
        ref.check_invariants()
        fast.check_invariants()
        for m in self.sides:  # spec/manager.md §2.6: one field keeps the lifecycle's test
            for q in m._requests.values():
                assert q.settled == (not q.dummy and q.load is None and not q.ext_point and q.lookup is None
                                     and not q.lookup_pending), q
                assert q.phase in ("dummy", "admitting", "loading", "running"), q
                assert (q.phase == "running") == (q.settled and any(q.rows.values())), q
        for r in range(self.params.data_parallel_degree):
            assert ref.block_count(r) == fast.block_count(r)
            assert ref.pressure_pct(r) == fast.pressure_pct(r)
            for lid in self.params.leaves():
                assert ref._free_order(r, lid) == fast._free_order(r, lid), (r, lid)
            if not self.params.allocate_buffers:
                assert ref.host_byte_count(r) == fast.host_byte_count(r)
                continue
            a, b = ref.get_device_buffer(r), fast.get_device_buffer(r)
            if isinstance(a, dict):
                assert all(a[k].tobytes() == b[k].tobytes() for k in a)
            else:
                assert a.tobytes() == b.tobytes()
        assert ref.get_metrics_aggregated() == fast.get_metrics_aggregated()
        for rid, pair in self.ctxs.items():
            assert ref.get_req_blocks_per_leaf(pair[0]) == fast.get_req_blocks_per_leaf(pair[1]), rid
            self._same_ctx(pair)


def test_manager_differential():
    run_state_machine_as_test(
        ManagerDiff, settings=settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))


def test_peer_adapter_lifecycle_matches_reference():
    """The peer workload's call sequence, both managers, same hits and block ids."""
    rng = np.random.default_rng(5)
    prefixes = [rng.integers(0, 50, 24).tolist() for _ in range(3)]
    sides = [mod.PagedKVCacheManager(KVCacheParams(page_size=4, num_layers=1, kv_heads=1, head_dim=1),
                                     num_blocks=40, max_batch_size=8, max_seq_len=156) for mod in (kvref, kvfast)]
    for wave in range(6):
        reqs = []
        for j in range(6):
            prompt = prefixes[(wave + j) % 3] + rng.integers(0, 50, int(rng.integers(3, 20))).tolist()
            pair = [TextContext(f"{wave}.{j}", prompt) for _ in sides]
            out = []
            for m, ctx in zip(sides, pair):
                try:
                    m.claim(ctx)
                    m.alloc(ctx)
                    ctx.skip_processing(ctx.active_length - 1)
                    m.step(ctx)
                    out.append(("ok", ctx.cached_prefix_length, m.get_req_blocks_per_leaf(ctx)))
                except InsufficientBlocksError as e:
                    m.release(ctx)
                    out.append(("err", str(e)))
            assert out[0] == out[1]
            if out[0][0] == "ok":
                reqs.append(pair)
        for s in range(5):
            for pair in reqs:
                res = []
                token = int(rng.integers(0, 50))
                for m, ctx in zip(sides, pair):
                    try:
                        m.alloc(ctx)
                        ctx.update(token)
                        m.step(ctx)
                        res.append(m.get_req_blocks_per_leaf(ctx))
                    except InsufficientBlocksError as e:
                        res.append(str(e))
                assert res[0] == res[1]
        for pair in reqs:
            for m, ctx in zip(sides, pair):
                m.release(ctx)
        assert sides[0]._free_order() == sides[1]._free_order()
        for m in sides:
            m.check_invariants()


def test_manager_collisions_never_serve_wrong_tokens():
    """Every block hash collides (token values ignored): hits still verify the stored tokens."""
    from kvspec.hashing import collide_hashes

    results = []
    with collide_hashes():
        for mod in (kvref, kvfast):
            m = mod.PagedKVCacheManager(KVCacheParams(page_size=2, num_layers=1, kv_heads=1, head_dim=1),
                                        num_blocks=16, max_batch_size=4, max_seq_len=30)
            out = []
            for rid, prompt in (("a", [1, 2, 3, 4, 5]), ("b", [1, 2, 9, 9, 5]), ("c", [7, 7, 3, 4, 5]),
                                ("d", [1, 2, 3, 4, 6])):
                ctx = TextContext(rid, prompt)
                m.claim(ctx)
                m.alloc(ctx)
                out.append((rid, ctx.cached_prefix_length, m.get_req_blocks_per_leaf(ctx)))
                ctx.update(1)
                m.step(ctx)
                m.release(ctx)
                m.check_invariants()
            results.append((out, m._free_order(), m.get_metrics_aggregated()))
    assert results[0] == results[1]
    hits = {rid: hit for rid, hit, _ in results[1][0]}
    assert hits == {"a": 0, "b": 2, "c": 0, "d": 4}  # only true prefixes hit


def test_slot_cache_collisions_never_serve_wrong_tokens():
    from kvspec.hashing import collide_hashes
    from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec

    cfg = KVCacheConfig(num_layers=1, max_seqs=2, max_seq_len=16, mode=KVCacheMode.PAGED, block_size=2)
    out = []
    with collide_hashes():
        for mod in (kvref, kvfast):
            c = mod.KVCache.make(cfg, [KVLayerSpec.attention(1, 2)])
            c.reserve([0], [5])
            c.retire(0, [1, 2, 3, 4, 5])
            out.append((c.admit(1, [1, 2, 9, 9, 9]), c.paged_block_table().tolist(), c._free_order()))
            c.check_invariants()
    assert out[0] == out[1] and out[1][0] == 2
