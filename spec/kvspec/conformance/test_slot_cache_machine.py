"""The slot-cache state machine, run on the backend under test."""

from hypothesis.stateful import run_state_machine_as_test

from kvspec.conformance.machine import KVCacheComparison
from kvspec.conformance.plugin import require


def test_kvcache_comparison(kv_backend, kv_oracle, kv_settings):
    if not kv_backend.supports("paged"):
        require(kv_backend, "contiguous")
    run_state_machine_as_test(KVCacheComparison.for_backend(kv_backend, kv_oracle), settings=kv_settings)
