"""The request record's lifecycle (spec/manager.md §2.6): a phase, and one field, ``settled``,
that the short paths of alloc and step read, kept by the setters of the flags it sums up."""

from __future__ import annotations

import numpy as np
import pytest
from kvspec import KVCacheParams, TextContext

import kvfast
import kvref
from kvref._request import _Request


def test_settled_follows_every_flag():
    q = _Request(ctx=None, replica=0, rows={"full": []})
    assert q.settled and q.phase == "admitting"  # claimed, no pages yet
    q.rows["full"].append(3)
    assert q.phase == "running"
    for name, on, off in (("ext_point", True, False), ("lookup", (0, 2), None), ("lookup_pending", True, False),
                          ("load", object(), None)):
        setattr(q, name, on)
        assert not q.settled, name
        assert q.phase == ("loading" if name == "load" else "admitting"), name
        setattr(q, name, off)
        assert q.settled and q.phase == "running", name
    d = _Request(ctx=None, replica=0, rows={"full": []}, dummy=True)
    assert not d.settled and d.phase == "dummy"


@pytest.mark.parametrize("pkg", [kvref, kvfast], ids=["kvref", "kvfast"])
def test_phases_through_a_request(pkg):
    params = KVCacheParams(page_size=4, num_layers=1, kv_heads=1, head_dim=2)
    m = pkg.PagedKVCacheManager(params, num_blocks=16, max_batch_size=4, max_seq_len=32)
    a = TextContext("a", np.arange(10))
    m.claim(a)
    assert m._requests["a"].phase == "admitting"
    m.alloc(a)
    assert m._requests["a"].phase == "admitting"  # spliced: the external stage is still due
    a.update(1)
    m.step(a)
    assert m._requests["a"].phase == "running"
    m.alloc(a)
    assert m._requests["a"].phase == "running"
    m.alloc_dummy(TextContext("pad", [1, 2]))
    assert m._requests["pad"].phase == "dummy"
    m.release(a)
    assert "a" not in m._requests
