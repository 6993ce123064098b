"""The conformance suite has teeth where issue 20 found it had none.

Each gap the issue lists (K/V bytes, the manager under hash collisions, rare
but legal sequences) has a planted bug in ``tests/broken_backends/`` and the
test of the suite written for it; the suite, run exactly as a backend author
runs it (``pytest --pyargs kvspec.conformance --kv-quick``), must fail on
each. One subprocess runs every case (``pytest.main`` per backend), so the
whole file costs one interpreter start plus a few seconds per case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: (factory in tests/broken_backends, -k expression selecting the rule written for the gap, the gap).
GAPS = [
    ("kv_bytes:v_written_as_k", "test_kv_bytes", "V written as K"),
    ("kv_bytes:gather_drops_single_token", "test_gather_every_length", "gather of a 1-token paged slot"),
    ("kv_bytes:unchecked_first_token", "test_slot_mapping_edges", "slot_mapping out of range at token 0"),
    ("kv_bytes:pool_end_accepted", "test_slot_mapping_edges", "slot_mapping exactly at the pool's end"),
    ("kv_bytes:v_stride_ignored", "test_append_input_layouts", "a strided V with a contiguous K"),
    ("kv_bytes:dtype_bits_reinterpreted", "test_append_input_layouts", "K/V in a dtype other than storage's"),
    ("kv_bytes:large_step_drops_last_token", "test_large_steps", "steps of 128 tokens or more"),
    ("manager_paths:hit_skips_last_token", "test_hit_verifies_every_token_under_collisions",
     "a manager hit check that skips a block's last token"),
    ("manager_paths:replacement_alloc_counts_twice", "test_second_alloc_before_step",
     "a second alloc before step with a replacement context"),
    ("manager_paths:deferred_alloc_counts_twice", "test_second_alloc_before_step",
     "a second alloc before step with defer_lookup=True"),
    ("manager_paths:chunk_cap_whole_pages", "test_chunk_aligned_cached_prefill",
     "a chunk of whole pages fully covered by a cached prefix"),
    ("manager_paths:no_publish_after_chunk", "test_step_after_non_final_chunk_then_same_prompt",
     "step after a non-final chunk, then the same prompt"),
    ("manager_paths:no_twin_dedup", "test_twin_dedup", "twin dedup"),
    ("manager_paths:decode_growth_late", "test_decode_growth", "decode growth"),
    ("manager_paths:revived_hits_counted_free", "test_near_full_pool_revived_hits",
     "a near-full pool where reviving free hits leaves too few pages"),
    ("manager_paths:capacity_off_by_one", "test_two_block_pool", "num_blocks=2"),
    ("manager_paths:hit_run_capped", "test_long_hit_run", "hit runs longer than 15 blocks"),
    ("manager_paths:decode_hashes_sha256", "test_prefill_hashes_equal_decode_hashes",
     "xxh3 prefill hashes against decode-filled ones"),
    ("attention_options:sinks_dropped", "test_attention_softcap_and_sinks", "sinks taken and ignored"),
    ("attention_options:softcap_before_scale", "test_softcap_and_sinks_equal_kvref",
     "a soft-cap applied before the score scale"),
]

#: K/V bugs the slot-cache state machine finds alone (no directed test).
MACHINE_GAPS = ["kv_bytes:v_written_as_k", "kv_bytes:v_stride_ignored", "kv_bytes:dtype_bits_reinterpreted"]

_DRIVER = """
import json, sys
import pytest
common = json.loads(sys.argv[1])
results = {}
for target, expr in json.loads(sys.argv[2]):
    results[target] = int(pytest.main([*common, "-k", expr, f"--kv-backend=tests.broken_backends.{target}"]))
print("KV-RESULTS " + json.dumps(results))
"""


def _env(**extra) -> dict:
    drop = ("KVCACHE_BACKEND", "KVCACHE_XFAIL", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER", "KVFAST_PARALLEL_SCATTER")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra)
    return env


def run_cases(cases: list[tuple[str, str]]) -> tuple[dict, subprocess.CompletedProcess]:
    """Run the suite once per ``(factory, -k expression)`` in one Python process; exit codes by factory."""
    common = ["--pyargs", "kvspec.conformance", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
              "--kv-quick", "--kv-no-shrink", "--hypothesis-seed=0", "-x"]
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(common), json.dumps(cases)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    line = [l for l in proc.stdout.splitlines() if l.startswith("KV-RESULTS ")]
    assert line, "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
    return json.loads(line[-1][len("KV-RESULTS "):]), proc


def _tail(proc, n=60) -> str:
    return "\n".join((proc.stdout + proc.stderr).splitlines()[-n:])


def test_each_gap_has_a_rule_that_fails_on_it():
    """Exit code 1 (tests failed) for every planted bug, from the rule written for its
    gap; 5 would mean the -k expression selected nothing, 0 that the bug passed."""
    codes, proc = run_cases([(target, expr) for target, expr, _ in GAPS])
    missed = {target: (codes.get(target), gap) for target, _, gap in GAPS if codes.get(target) != 1}
    assert not missed, f"the suite did not fail on: {missed}\n{_tail(proc)}"


def test_slot_cache_machine_alone_catches_kv_byte_bugs():
    """Without the directed tests, the slot-cache state machine's own K/V writes and
    byte comparisons find V stored as K, a lost V stride and bit-reinterpreted dtypes."""
    codes, proc = run_cases([(target, "kvcache_comparison") for target in MACHINE_GAPS])
    assert codes == {t: 1 for t in MACHINE_GAPS}, f"{codes}\n{_tail(proc)}"


def test_broken_backends_are_otherwise_kvref():
    """The planted bugs hide on the default path: each broken backend passes the
    method-level tests of the slot cache or manager it does not target, so a
    failure above is the gap's rule and not a broken harness."""
    codes, proc = run_cases([("kv_bytes:v_written_as_k", "test_manager_paths"),
                             ("manager_paths:hit_skips_last_token", "test_repeat_prompt or test_twin_dedup")])
    assert codes == {"kv_bytes:v_written_as_k": 0, "manager_paths:hit_skips_last_token": 0}, f"{codes}\n{_tail(proc)}"


def test_kvfast_parallel_scatter_option():
    """kvfast's off-default option: the K/V byte tests (steps of 128 tokens and more,
    strided and converted inputs) with ``KVFAST_PARALLEL_SCATTER=1``."""
    from kvspec.conformance import backend_names

    if "kvfast" not in backend_names():
        pytest.skip("kvfast is not registered")
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "kvspec.conformance.test_kv_bytes", "-q",
           "-p", "no:cacheprovider", "--kv-quick", "--kv-backend=kvfast"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(KVFAST_PARALLEL_SCATTER="1"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, _tail(proc)


@pytest.mark.parametrize("mode", ["PAGED", "CONTIGUOUS"])
def test_live_kv_reports_a_length_past_the_storage(mode):
    """Issue 18 item 1: a backend whose ``seq_lens()`` runs past its block table (or its
    contiguous row) fails with an ``AssertionError`` naming the slot and the bound,
    not an ``IndexError`` inside the suite's own code (``machine.py:73``)."""
    import kvref
    from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec
    from kvspec.conformance.machine import live_kv

    cache = kvref.KVCache.make(KVCacheConfig(num_layers=1, max_seqs=2, max_seq_len=8, mode=KVCacheMode[mode],
                                             block_size=2), [KVLayerSpec.attention(1, 2)])
    k, v = live_kv(cache, 0, 1, 8)
    assert k.shape == (8, 1, 2) and v.shape == (8, 1, 2), f"live_kv of a full slot: {k.shape}, {v.shape}"
    with pytest.raises(AssertionError, match=r"slot 1 has length 9, outside the"):
        live_kv(cache, 0, 1, 9)
