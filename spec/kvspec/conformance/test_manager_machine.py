"""The request-manager state machine, run on the backend under test."""

from hypothesis.stateful import run_state_machine_as_test

from kvspec.conformance.manager_machine import ManagerComparison
from kvspec.conformance.plugin import require


def test_manager_comparison(kv_backend, kv_oracle, kv_settings):
    require(kv_backend, "manager")
    run_state_machine_as_test(ManagerComparison.for_backend(kv_backend, kv_oracle), settings=kv_settings)
