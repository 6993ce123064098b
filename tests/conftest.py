"""Shared test setup: Hypothesis profiles (``ci`` keeps the CI run short)."""

import os

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
