"""A Hypothesis state machine over the slab (spec/manager.md §13.4): no fragmentation leak.

A scheduler claims, allocates, decodes, releases and resets prefix caches on
a kvref and a kvfast manager at once (full + sliding window, full +
recurrent state with pages of another byte size). After every rule:

* every byte of each replica's slab is in exactly one of free, cached or
  in use (a byte map built from the huge blocks' owners and the pages' ref
  counts and hashes, each page covering ``padded_bytes`` at its own ratio);
* the in-use bytes are exactly the pages the live requests' rows reference;
* both managers' ``check_invariants()`` hold and they agree on rows, block
  counts, free orders and the slabs' parked queues.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvspec import InsufficientBlocksError, KVCacheParams, LeafSpec, TextContext

import kvfast
import kvref

PAGE = 2
MAX_SEQ = 10
VOCAB = st.integers(1, 3)
FREE, CACHED, IN_USE = 1, 2, 3


def byte_map(m, r: int) -> np.ndarray:
    """State of every allocatable byte of replica ``r``'s slab: FREE, CACHED or IN_USE (0 = unclaimed
    by any page: must not happen); a byte two pages claim is flagged by the coverage count."""
    slab, geo = m._slabs[r], m._geometry
    n, huge = slab.num_huge_blocks, geo.huge_bytes
    state = np.zeros(n * huge, np.int8)
    cover = np.zeros(n * huge, np.int16)
    owners = slab.table.owners()
    for h in range(1, n):
        if owners[h] < 0:  # pristine: the whole huge block is free
            state[h * huge : (h + 1) * huge] = FREE
            cover[h * huge : (h + 1) * huge] += 1
            continue
        lid = slab.leaf_ids[owners[h]]
        pool, ratio, stride = slab.inner[lid], slab.ratios[lid], geo.padded_bytes[lid]
        for b in range(h * ratio, (h + 1) * ratio):
            lo = b * stride
            if pool.ref_count[b] > 0:
                s = IN_USE
            elif pool.block_hash[b] is not None:
                s = CACHED
            else:
                s = FREE
            state[lo : lo + stride] = s
            cover[lo : lo + stride] += 1
    return state[huge:], cover[huge:]


class SlabMachine(RuleBasedStateMachine):
    LEAVES: ClassVar[dict] = {}
    NUM_BLOCKS = 9

    def __init__(self):
        super().__init__()
        params = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=2, dtype="float32",
                               data_parallel_degree=2, leaves=self.LEAVES)
        kw = {"num_blocks": self.NUM_BLOCKS, "max_batch_size": 4, "max_seq_len": MAX_SEQ}
        self.ms = [kvref.PagedKVCacheManager(params, **kw), kvfast.PagedKVCacheManager(params, **kw)]
        self.ctxs: list[dict[str, TextContext]] = [{}, {}]
        self.n = 0

    def _both(self, fn):
        """Run ``fn(manager, contexts)`` on both; same value or same exception type and message."""
        out = []
        for m, ctxs in zip(self.ms, self.ctxs):
            try:
                out.append(("ok", fn(m, ctxs)))
            except Exception as e:  # noqa: BLE001 (both sides' outcomes are compared below)
                out.append((type(e).__name__, str(e)))
        assert out[0] == out[1], out
        return out[0]

    # ------------------------------------------------------------------ rules

    @rule(tokens=st.lists(VOCAB, min_size=1, max_size=MAX_SEQ - 2), replica=st.integers(0, 1))
    def claim_and_alloc(self, tokens, replica):
        self.n += 1
        rid = f"r{self.n}"
        note(f"claim {rid} {tokens} on replica {replica}")

        def go(m, ctxs):
            ctx = ctxs[rid] = TextContext(rid, list(tokens))
            m.claim(ctx, replica)
            try:
                m.alloc(ctx)
            except InsufficientBlocksError:
                m.release(ctx)
                del ctxs[rid]
                raise
            return m.get_req_blocks_per_leaf(ctx)

        self._both(go)

    @precondition(lambda self: self.ctxs[0])
    @rule(data=st.data(), token=VOCAB)
    def decode(self, data, token):
        rid = data.draw(st.sampled_from(sorted(self.ctxs[0])))
        note(f"decode {rid} + {token}")

        def go(m, ctxs):
            ctx = ctxs[rid]
            ctx.update(token)
            m.step(ctx)
            if len(ctx) >= MAX_SEQ:
                m.release(ctx)
                del ctxs[rid]
                return "done"
            m.alloc(ctx)
            return m.get_req_blocks_per_leaf(ctx)

        def preempt(m, ctxs):
            m.release(ctxs.pop(rid))

        if self._both(go)[0] == "InsufficientBlocksError":  # preempt, as a scheduler would
            self._both(preempt)

    @precondition(lambda self: self.ctxs[0])
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(sorted(self.ctxs[0])))
        note(f"release {rid}")
        self._both(lambda m, ctxs: m.release(ctxs.pop(rid)))

    @rule()
    def reset_prefix_cache(self):
        note("reset_prefix_cache")
        self._both(lambda m, ctxs: m.reset_prefix_cache())

    # ------------------------------------------------------------------ invariants

    @invariant()
    def every_byte_in_exactly_one_state(self):
        for m, ctxs in zip(self.ms, self.ctxs):
            m.check_invariants()
            for r in range(2):
                state, cover = byte_map(m, r)
                assert (cover == 1).all(), f"replica {r}: bytes covered {sorted(set(cover.tolist()))} times"
                assert (state > 0).all()
                # the in-use bytes are exactly the pages live rows reference
                slab, geo = m._slabs[r], m._geometry
                held = {(lid, b) for c in ctxs.values() if m._requests[c.request_id].replica == r
                        for lid, row in m.get_req_blocks_per_leaf(c).items() for b in row if b}
                used = sum(geo.padded_bytes[lid] for lid, _ in held)
                assert int((state == IN_USE).sum()) == used, (int((state == IN_USE).sum()), used)
                units = slab.page_states()
                assert sum(units.values()) == (slab.num_huge_blocks - 1) * int(np.lcm.reduce(
                    list(slab.ratios.values())))

    @invariant()
    def engines_agree(self):
        a, b = self.ms
        for r in range(2):
            assert a.block_count(r) == b.block_count(r)
            assert a.pressure_pct(r) == b.pressure_pct(r)
            assert a._slabs[r].table.parked_order() == b._slabs[r].table.parked_order()
            assert a._slabs[r].table.owners() == b._slabs[r].table.owners()
            for lid in a.params.leaves():
                assert a._free_order(r, lid) == b._free_order(r, lid)
        assert sorted(self.ctxs[0]) == sorted(self.ctxs[1])
        for rid in self.ctxs[0]:
            assert a.get_req_blocks_per_leaf(self.ctxs[0][rid]) == b.get_req_blocks_per_leaf(self.ctxs[1][rid])


class FullSlidingSlab(SlabMachine):
    LEAVES: ClassVar[dict] = {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(3)}
    NUM_BLOCKS = 9


class FullRecurrentSlab(SlabMachine):
    # full page 2*1*2*1*2*4 = 32 B, state 3*4 = 12 B: huge block 96 B, ratios 3 and 8
    LEAVES: ClassVar[dict] = {"full": LeafSpec.full(), "rec": LeafSpec.recurrent((3,))}
    NUM_BLOCKS = 4


TestFullSlidingSlab = FullSlidingSlab.TestCase
TestFullRecurrentSlab = FullRecurrentSlab.TestCase
