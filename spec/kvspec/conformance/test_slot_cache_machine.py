"""The slot-cache state machine, run on the backend under test."""

from hypothesis.stateful import run_state_machine_as_test

from kvspec.conformance.machine import KVCacheComparison, KVCacheFP8Comparison
from kvspec.conformance.plugin import require


def test_kvcache_comparison(kv_backend, kv_oracle, kv_settings):
    if not kv_backend.supports("paged"):
        require(kv_backend, "contiguous")
    run_state_machine_as_test(KVCacheComparison.for_backend(kv_backend, kv_oracle), settings=kv_settings)


def test_kvcache_fp8_comparison(kv_backend, kv_oracle, kv_settings):
    """The same machine on FP8 caches (spec/slot-cache.md §10): bytes, scales, dequantised reads."""
    require(kv_backend, "slot_fp8")
    if not kv_backend.supports("paged"):
        require(kv_backend, "contiguous")
    run_state_machine_as_test(KVCacheFP8Comparison.for_backend(kv_backend, kv_oracle), settings=kv_settings)
