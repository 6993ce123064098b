"""Construction refuses a ``max_seq_len`` the pool cannot hold (spec/manager.md §1.6).

MAX refuses such a configuration at start-up; before this rule a manager
accepted it and failed later with ``InsufficientBlocksError`` on a context it
had claimed. Now every context a manager accepts fits its empty pool.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvfast
import kvref
from kvspec import KVCacheParams, LeafSpec, TextContext

PKGS = pytest.mark.parametrize("pkg", [kvref, kvfast], ids=["kvref", "kvfast"])


def params(page=4, leaves=None, **kw):
    return KVCacheParams(page_size=page, num_layers=1, kv_heads=1, head_dim=2, dtype="float32", leaves=leaves, **kw)


@PKGS
def test_full_leaf_refusal_names_the_numbers(pkg):
    pkg.PagedKVCacheManager(params(), num_blocks=9, max_batch_size=1, max_seq_len=32)  # 8 pages: fits
    with pytest.raises(ValueError) as e:
        pkg.PagedKVCacheManager(params(), num_blocks=9, max_batch_size=1, max_seq_len=33)
    assert str(e.value) == ("PagedKVCacheManager: max_seq_len=33 needs 9 pages of leaf 'full' for one request, "
                            "the pool has 8 (num_blocks=9 less the null page)")


def test_both_packages_refuse_with_the_same_message():
    msgs = []
    for pkg in (kvref, kvfast):
        with pytest.raises(ValueError) as e:
            pkg.PagedKVCacheManager(params(page=2), num_blocks=5, max_batch_size=1, max_seq_len=9)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and "max_seq_len=9" in msgs[0] and "needs 5 pages" in msgs[0]


@PKGS
def test_an_accepted_max_seq_len_context_fits_the_empty_pool(pkg):
    m = pkg.PagedKVCacheManager(params(), num_blocks=9, max_batch_size=1, max_seq_len=32)
    assert m.effective_max_seq_length == 32
    ctx = TextContext("a", np.arange(32, dtype=np.int32))
    m.claim(ctx)
    m.alloc(ctx)
    assert len(m.get_req_blocks_per_leaf(ctx)["full"]) == 8
    m.check_invariants()


@PKGS
def test_sliding_only_leaf_needs_only_its_window(pkg):
    """A sliding leaf holds the window's pages plus the current one (biw + 1): a long context is
    served in page-sized chunks by a pool of 2 usable pages (window 5, page 4: biw = 1)."""
    p = params(leaves={"swa": LeafSpec.sliding_window(5)})
    m = pkg.PagedKVCacheManager(p, num_blocks=3, max_batch_size=1, max_seq_len=1000)
    ctx = TextContext("a", np.arange(40, dtype=np.int32))
    m.claim(ctx)
    while ctx.active_length > 4:
        ctx.chunk(4)
        m.alloc(ctx)
        m.runtime_inputs([[ctx]])
        ctx.advance_chunk()
        m.step(ctx)
        m.check_invariants()
    m.alloc(ctx)
    assert sum(b != 0 for b in m.get_req_blocks_per_leaf(ctx)["swa"]) <= 2
    p1 = params(leaves={"swa": LeafSpec.sliding_window(9)})  # biw = 2: three pages
    with pytest.raises(ValueError, match=r"max_seq_len=1000 needs 3 pages of leaf 'swa' for one request, "
                                         r"the pool has 2"):
        pkg.PagedKVCacheManager(p1, num_blocks=3, max_batch_size=1, max_seq_len=1000)


@PKGS
def test_refused_construction_attaches_no_connector(pkg):
    """The refusal comes before any allocation or attach: the connector serves the next manager."""
    conn = kvref.TieredConnector(host_bytes=1 << 12)
    with pytest.raises(ValueError, match="max_seq_len=64"):
        pkg.PagedKVCacheManager(params(), num_blocks=9, max_batch_size=1, max_seq_len=64, connector=conn)
    m = pkg.PagedKVCacheManager(params(), num_blocks=17, max_batch_size=1, max_seq_len=64, connector=conn)
    assert m.host_byte_count().total > 0
    m.shutdown()


@PKGS
def test_every_leaf_is_checked(pkg):
    leaves = {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(5), "rec": LeafSpec.recurrent((2,))}
    with pytest.raises(ValueError, match=r"max_seq_len=200"):
        pkg.PagedKVCacheManager(params(leaves=leaves), num_blocks=20, max_batch_size=1, max_seq_len=200)


@given(page=st.sampled_from([1, 2, 3, 4, 16]), num_blocks=st.integers(2, 40), max_seq_len=st.integers(1, 200))
def test_accepted_exactly_when_one_request_fits(page, num_blocks, max_seq_len):
    fits = math.ceil(max_seq_len / page) <= num_blocks - 1
    for pkg in (kvref, kvfast):
        try:
            m = pkg.PagedKVCacheManager(params(page=page), num_blocks=num_blocks, max_batch_size=1,
                                        max_seq_len=max_seq_len)
        except ValueError as e:
            assert not fits, f"{pkg.__name__} refused a pool that holds the request: {e}"
            assert f"max_seq_len={max_seq_len} needs {math.ceil(max_seq_len / page)} pages" in str(e)
            continue
        assert fits, f"{pkg.__name__} accepted max_seq_len={max_seq_len} over {num_blocks - 1} pages of {page}"
        assert m.effective_max_seq_length == max_seq_len
