"""Replay the golden vectors (``spec/vectors/``, installed as ``kvspec.vectors``).

Each trace was recorded from kvref by ``spec/tools/gen_vectors.py``; the
backend must reproduce every record: results, errors (type and message) and
the state after each operation (block ids, free order and the K/V digest only
with ``strict_block_ids``). ``spec/vectors.md`` is the format.
"""

from __future__ import annotations

import pytest

from kvspec import hashing, vectors
from kvspec.conformance._vectors import FORMAT, compare_records, run_trace
from kvspec.conformance.plugin import require

TRACES = [n for n in vectors.names() if n != "hashing.json"]

_LAYER_CAPS = {"SLIDING_WINDOW": "sliding_window", "CROSS_ATTENTION": "cross", "STATE": "state"}


def _needs(trace: dict) -> list[str]:
    if trace["api"] == "PagedKVCacheManager":
        caps = ["manager"]
        if trace["params"].get("enable_prefix_caching", True):
            caps.append("prefix_caching")
        if trace["params"].get("data_parallel_degree", 1) > 1:
            caps.append("replicas")
        return caps
    caps = ["paged" if trace["config"]["mode"] == "PAGED" else "contiguous"]
    caps += sorted({_LAYER_CAPS[l["kind"]] for l in trace["layers"] if l["kind"] in _LAYER_CAPS})
    if str(trace["config"].get("dtype", "")).startswith("float8"):
        caps.append("slot_fp8")  # spec/slot-cache.md §10
    if trace["name"].startswith("slot_cache_spec_decode"):
        caps.append("slot_spec_decode")  # spec/slot-cache.md §11
    return caps


def test_vectors_are_present():
    assert "hashing.json" in vectors.names() and TRACES, f"kvspec.vectors holds {vectors.names()}"


def test_hash_vectors():
    data = vectors.load("hashing.json")
    assert data["format"] == FORMAT
    for i, c in enumerate(data["cases"]):
        root = hashing.root_hash(c["hash_seed"], c["cache_salt"])
        assert root.hex() == c["root"], f"hashing.json case {i}: root {root.hex()} != {c['root']}"
        got = [h.hex() for h in hashing.block_hashes(c["tokens"], c["block_size"], c["hash_algo"],
                                                      hash_seed=c["hash_seed"], cache_salt=c["cache_salt"])]
        assert got == c["hashes"], f"hashing.json case {i} ({c['hash_algo']}, block_size={c['block_size']}): {got} != {c['hashes']}"


@pytest.mark.parametrize("name", TRACES)
def test_replay(kv_backend, name):
    trace = vectors.load(name)
    assert trace["format"] == FORMAT, f"{name}: format={trace['format']!r}"
    require(kv_backend, *_needs(trace))
    got = run_trace(kv_backend, trace)
    compare_records(trace["records"], got, strict=kv_backend.supports("strict_block_ids"), where=name)
