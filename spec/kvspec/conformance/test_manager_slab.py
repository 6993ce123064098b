"""The slab of a multi-leaf manager (``spec/manager.md`` §13): MAX's Jenga numbers, in lockstep.

A manager with a full and a sliding-window leaf carves one slab of huge
blocks per replica: each leaf's pages come from the huge blocks it claims,
so block ids, ``block_count`` (huge blocks) and the pages a leaf can still
draw follow the claim rule of spec/manager.md §13.2. Each test drives the backend and kvref
together (``ManagerPair``) and checks the spec's absolute numbers, which are
those of MAX's ``test_jenga_block_manager.py`` / ``test_jenga_cache_manager.py``.
"""

from __future__ import annotations

from kvspec import BlockCount, InsufficientBlocksError, KVCacheParams
from kvspec._manager_types import LeafSpec
from kvspec.conformance._harness import ManagerPair, ManualConnector
from kvspec.conformance.plugin import require

FULL_SWA = {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(4)}


def _pair(backend, oracle, num_blocks: int, max_seq_len: int, caching: bool = True) -> ManagerPair:
    require(backend, "manager", "prefix_caching", "sliding_window")
    params = KVCacheParams(page_size=1, num_layers=1, kv_heads=1, head_dim=2, dtype="float32", leaves=FULL_SWA,
                           enable_prefix_caching=caching)
    return ManagerPair(backend, oracle, params, num_blocks=num_blocks, max_batch_size=4, max_seq_len=max_seq_len)


def _admit(p: ManagerPair, rid: str, tokens) -> dict:
    p.new(rid, tokens)
    p.ok(f"manager.claim(ctx_{rid})", lambda m, cs: m.claim(cs[rid]))
    p.ok(f"manager.alloc(ctx_{rid}).is_complete()", lambda m, cs: m.alloc(cs[rid]).is_complete())
    return _rows(p, rid)


def _rows(p: ManagerPair, rid: str) -> dict:
    return p.ok(f"manager.get_req_blocks_per_leaf(ctx_{rid})", lambda m, cs: m.get_req_blocks_per_leaf(cs[rid]))[1]


def _count(p: ManagerPair) -> BlockCount:
    return p.ok("manager.block_count(0)", lambda m, cs: m.block_count(0))[1]


def _step(p: ManagerPair, rid: str, token: int = 42) -> None:
    for cs in (p.ctx_ref, p.ctx_sut):
        cs[rid].update(token)
    p.ok(f"manager.step(ctx_{rid})", lambda m, cs: m.step(cs[rid]))


def test_block_count_counts_huge_blocks(kv_backend, kv_oracle):
    """MAX: ``block_count`` free 9 -> 3 after a 3-token request on 10 huge blocks (each leaf takes 3),
    ``total = huge - 1``; the leaves' pages are ids of their own views."""
    p = _pair(kv_backend, kv_oracle, 10, 4)
    assert _count(p) == BlockCount(9, 9)
    assert _admit(p, "a", [1, 2, 3]) == {"full": [1, 2, 3], "swa": [4, 5, 6]}
    assert _count(p) == BlockCount(3, 9)
    p.agree()


def test_full_and_sliding_resume_from_the_same_block(kv_backend, kv_oracle):
    """MAX test_full_and_swa_share_one_block_index / _resume_from_the_same_block (20 huge blocks)."""
    p = _pair(kv_backend, kv_oracle, 20, 8)
    assert _admit(p, "a", range(6)) == {"full": [1, 2, 3, 4, 5, 6], "swa": [7, 8, 9, 10, 11, 12]}
    _step(p, "a")
    assert _rows(p, "a") == {"full": [1, 2, 3, 4, 5, 6], "swa": [0, 0, 0, 10, 11, 12]}
    p.ok("manager.release(ctx_a)", lambda m, cs: m.release(cs["a"]))
    # both leaves resume at block 5; the fresh pages come from pristine huge blocks, the cached ones kept
    assert _admit(p, "b", range(6)) == {"full": [1, 2, 3, 4, 5, 13], "swa": [0, 0, 9, 10, 11, 14]}
    assert p.ctx_sut["b"].processed_length == 5
    p.agree()


def test_the_full_leaf_grows_into_the_sliding_leafs_blocks(kv_backend, kv_oracle):
    """spec/manager.md §13.2-13.3: the leaves are sized jointly, and the huge blocks the sliding leaf slid out of
    serve the full leaf (per-leaf pools of the same bytes would stop it at 6 pages)."""
    p = _pair(kv_backend, kv_oracle, 14, 9, caching=False)
    _admit(p, "a", range(6))
    p.new("x", range(7))
    p.ok("manager.claim(ctx_x)", lambda m, cs: m.claim(cs["x"]))
    msg = p.raises("manager.alloc(ctx_x)", lambda m, cs: m.alloc(cs["x"]), InsufficientBlocksError)
    assert "needs 7 blocks of leaf 'full', 1 free or evictable" in msg, msg
    p.ok("manager.release(ctx_x)", lambda m, cs: m.release(cs["x"]))
    _step(p, "a")
    for _ in range(3):
        p.ok("manager.alloc(ctx_a).is_complete()", lambda m, cs: m.alloc(cs["a"]).is_complete())
        _step(p, "a", 1)
    assert len(_rows(p, "a")["full"]) == 9
    assert _count(p) == BlockCount(1, 13)
    p.agree()


class _BrokenLoad(ManualConnector):
    """A ``ManualConnector`` whose ``load`` raises an unexpected exception while ``broken`` (a bug of
    the connector, not ``KVLoadRefused`` / ``KVLoadFailed``)."""

    broken = False

    def load(self, block_ids, hashes, tokens, replica_idx: int = 0):
        if self.broken:
            raise RuntimeError("connector bug")
        return super().load(block_ids, hashes, tokens, replica_idx)


def test_a_connector_error_during_a_hybrid_load_changes_nothing(kv_backend, kv_oracle):
    """spec/manager.md §9.8, §11.22: a tier hit of a full + sliding manager that also draws pages posts
    its load into the pages the slab's joint peek predicts, before anything changes; an unexpected
    exception of ``connector.load`` leaves every observable (rows, huge blocks, free order, metrics,
    device bytes, the context) as it was, and the next ``alloc`` loads the whole hit."""
    require(kv_backend, "manager", "prefix_caching", "sliding_window", "tiers")
    conns = (_BrokenLoad(), _BrokenLoad())
    params = KVCacheParams(page_size=2, num_layers=1, kv_heads=1, head_dim=2, dtype="float32", leaves=FULL_SWA)
    p = ManagerPair(kv_backend, kv_oracle, params, connectors=conns, num_blocks=12, max_batch_size=4, max_seq_len=16)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    p.new("a", prompt)
    p.ok("manager.claim(ctx_a)", lambda m, cs: m.claim(cs["a"]))
    p.forward("a", token=0, seed=21)
    p.ok("manager.poll_transfers()  # posts the offload", lambda m, cs: m.poll_transfers())
    p.ok("manager.release(ctx_a)", lambda m, cs: m.release(cs["a"]))
    p.ok("manager.reset_prefix_cache()", lambda m, cs: m.reset_prefix_cache())
    p.new("b", prompt)
    p.ok("manager.claim(ctx_b)", lambda m, cs: m.claim(cs["b"]))
    for c in conns:
        c.broken = True
    p.raises("manager.alloc(ctx_b)  # connector.load raises", lambda m, cs: m.alloc(cs["b"]), RuntimeError)
    assert _rows(p, "b") == {"full": [], "swa": []}, "the failed alloc kept pages"
    for c in conns:
        c.broken = False
    p.ok("manager.alloc(ctx_b).synchronize()", lambda m, cs: m.alloc(cs["b"]).synchronize())
    p.ok("manager.poll_transfers()  # lands the load", lambda m, cs: m.poll_transfers())
    assert p.ctx_sut["b"].cached_prefix_external_length == 8, "the next alloc loads the whole hit from the tier"
    p.agree()
