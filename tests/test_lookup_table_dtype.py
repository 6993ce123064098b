"""The manager's lookup table in a dtype torch indexes with (spec/manager.md §8, issue 33):
``lookup_table_dtype="int32"`` is a zero-copy view of the uint32 table, ``"int64"`` a
conversion; the ids are the same in every dtype, package and leaf kind."""

from __future__ import annotations

import numpy as np
import pytest

import kvfast
import kvref
from kvspec import KVCacheParams, LeafSpec, TextContext

PKGS = [pytest.param(kvref, id="kvref"), pytest.param(kvfast, id="kvfast")]
LEAVES = [None, {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(8)},
          {"full": LeafSpec.full(), "rec": LeafSpec.recurrent((4, 8))}]


def _tables(pkg, dtype, leaves, fp8=False):
    params = KVCacheParams(page_size=4, num_layers=1, kv_heads=1, head_dim=2, leaves=leaves,
                           dtype="float8_e4m3fn" if fp8 else "float16")
    m = pkg.PagedKVCacheManager(params, num_blocks=40, max_batch_size=4, max_seq_len=32, lookup_table_dtype=dtype)
    ctxs = [TextContext(str(i), np.arange(100 * i, 100 * i + 9 + 4 * i, dtype=np.int32)) for i in range(3)]
    for c in ctxs:
        m.claim(c)
    m.alloc_many(ctxs)
    inputs = m.runtime_inputs([ctxs]).inputs[0]
    per_leaf = inputs if isinstance(inputs, dict) else {"full": inputs}
    return {lid: inp for lid, inp in per_leaf.items()}


@pytest.mark.parametrize("pkg", PKGS)
@pytest.mark.parametrize("leaves", LEAVES, ids=["full", "full+sliding", "full+recurrent"])
def test_every_dtype_holds_the_same_ids(pkg, leaves):
    base = _tables(pkg, "uint32", leaves)
    for dtype in ("int32", "int64"):
        got = _tables(pkg, dtype, leaves)
        for lid, inp in got.items():
            assert inp.lookup_table.dtype == np.dtype(dtype)
            assert np.array_equal(inp.lookup_table, base[lid].lookup_table.astype(np.int64))
    assert all(inp.lookup_table.dtype == np.uint32 for inp in base.values())


@pytest.mark.parametrize("pkg", PKGS)
def test_int32_is_a_view_and_indexes_a_torch_tensor(pkg):
    torch = pytest.importorskip("torch")
    inp = _tables(pkg, "int32", None)["full"]
    table = torch.from_numpy(inp.lookup_table)  # no conversion on the caller's side
    pages = torch.from_numpy(np.asarray(inp.kv_blocks).view(np.int16))
    assert table.dtype == torch.int32
    assert pages[table].shape[:2] == tuple(inp.lookup_table.shape)
    assert inp.lookup_table.base is not None  # a view of the engine's uint32 table


@pytest.mark.parametrize("pkg", PKGS)
def test_fp8_scales_table_follows(pkg):
    inp = _tables(pkg, "int64", None, fp8=True)["full"]
    assert inp.scales_lookup_table is inp.lookup_table and inp.lookup_table.dtype == np.int64


@pytest.mark.parametrize("pkg", PKGS)
@pytest.mark.parametrize("value, exc", [("uint16", ValueError), ("int", ValueError), (np.int64, TypeError),
                                        (None, TypeError)])
def test_bad_dtype_is_refused_by_name(pkg, value, exc):
    params = KVCacheParams(page_size=4, num_layers=1, kv_heads=1, head_dim=2)
    with pytest.raises(exc, match=r"PagedKVCacheManager: lookup_table_dtype="):
        pkg.PagedKVCacheManager(params, num_blocks=9, max_batch_size=1, max_seq_len=8, lookup_table_dtype=value)
