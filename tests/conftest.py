"""Shared test setup: Hypothesis profiles (``ci`` keeps the CI run short) and the emulated-CUDA fixture."""

import os
import sys

import pytest
from hypothesis import HealthCheck, settings

# With KVFAST_CUDA_EMULATE=1, importing kvfast registers its CPU stand-in as ``cupy`` before any
# test module imports cupy itself (without the variable this only imports kvfast).
import kvfast  # noqa: E402,F401

settings.register_profile(
    "ci",
    max_examples=30,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=1000,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture
def emulated(monkeypatch):
    """The emulated ``cupy`` module (``KVFAST_CUDA_EMULATE=1``), installed for one test; a stand-in
    for a GPU, which this machine does not have. The previous ``cupy`` modules come back after."""
    from kvfast._cuda import _module, emulate

    saved = {k: sys.modules.get(k) for k in ("cupy", "cupy.cuda")}
    monkeypatch.setenv(emulate.ENV, "1")
    _module._module.cache_clear()
    cp = emulate.install()
    try:
        yield cp
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
        _module._module.cache_clear()
