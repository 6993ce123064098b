"""The pytest plugin of the conformance suite (registered in ``pytest11``).

Options
-------
``--kv-backend=SPEC``
    ``module:factory`` or a ``kvcache.backends`` entry-point name; default
    ``$KVCACHE_BACKEND``, else ``kvref``.
``--kv-xfail=FILE``
    Expected failures: one test-id prefix a line (``#`` starts a comment).
    A test id is ``<file>::<test>[<params>]``, e.g.
    ``test_slot_cache.py::test_admit_hit[paged]``; the full pytest node id
    works too. Matching tests are marked ``xfail``; entries that match no
    collected test are listed at the end of the run. Default ``$KVCACHE_XFAIL``.
``--kv-device=DEVICE``
    Build the backend's objects on DEVICE (one of its declared devices;
    default ``cpu`` when declared). kvref, the oracle, always runs on the CPU.
``--kv-quick``
    Fewer Hypothesis examples and shorter state-machine runs (CI smoke runs).
``--kv-no-shrink``
    Report the first failing example as found, without shrinking it.

The plugin only acts on tests of the ``kvspec.conformance`` package: other
test runs see three unused options and nothing else.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ._backend import ENV_BACKEND, Backend, resolve_backend

ENV_XFAIL = "KVCACHE_XFAIL"
_PKG = "kvspec.conformance"
_BACKEND_KEY = pytest.StashKey[Backend]()
_XFAIL_KEY = pytest.StashKey[dict]()
_UNMATCHED_KEY = pytest.StashKey[list]()


def pytest_addoption(parser):
    g = parser.getgroup("kvcache", "kvcache conformance suite (kvspec.conformance)")
    g.addoption("--kv-backend", default=None, metavar="SPEC",
                help="backend under test: module:factory or a kvcache.backends name (default $KVCACHE_BACKEND or kvref)")
    g.addoption("--kv-xfail", default=None, metavar="FILE",
                help="file of test-id prefixes expected to fail (default $KVCACHE_XFAIL)")
    g.addoption("--kv-quick", action="store_true", default=False,
                help="fewer Hypothesis examples and shorter state machines")
    g.addoption("--kv-device", default=None, metavar="DEVICE",
                help="device to build the backend's objects on (default cpu when declared, else its first device)")
    g.addoption("--kv-no-shrink", action="store_true", default=False,
                help="report the first failing example without shrinking it (faster failures)")


def _wants_suite(config) -> bool:
    if config.getoption("--kv-backend") or config.getoption("--kv-xfail"):
        return True
    return any("conformance" in str(a) and "kvspec" in str(a).replace("/", ".") for a in config.args)


def _read_xfail(path: str) -> dict[str, str]:
    entries: dict[str, str] = {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise pytest.UsageError(f"--kv-xfail: cannot read {path!r}: {e}") from None
    for line in text.splitlines():
        body, _, reason = line.partition("#")
        body = body.strip()
        if body:
            entries[body] = reason.strip() or f"listed in {path}"
    return entries


def pytest_configure(config):
    config.addinivalue_line("markers", "kv_requires(*capabilities): skip unless the backend declares them")
    xfail_path = config.getoption("--kv-xfail") or os.environ.get(ENV_XFAIL)
    config.stash[_XFAIL_KEY] = _read_xfail(xfail_path) if xfail_path else {}
    if _wants_suite(config) or os.environ.get(ENV_BACKEND):
        get_backend(config)


def get_backend(config) -> Backend:
    """The backend under test for this run (resolved once)."""
    if _BACKEND_KEY not in config.stash:
        spec = config.getoption("--kv-backend") or os.environ.get(ENV_BACKEND) or "kvref"
        try:
            backend = resolve_backend(spec)
        except (ImportError, AttributeError, ValueError, TypeError) as e:
            raise pytest.UsageError(f"--kv-backend={spec}: {type(e).__name__}: {e}") from e
        device = config.getoption("--kv-device") or ("cpu" if "cpu" in backend.devices else backend.devices[0])
        try:
            config.stash[_BACKEND_KEY] = backend.on_device(device)
        except ValueError as e:
            raise pytest.UsageError(f"--kv-device={device}: {e}") from e
    return config.stash[_BACKEND_KEY]


def pytest_report_header(config):
    if _BACKEND_KEY not in config.stash:
        return None
    b = config.stash[_BACKEND_KEY]
    lines = [b.describe() + f"; testing on {b.device}"]
    xf = config.stash[_XFAIL_KEY]
    if xf:
        lines.append(f"kvcache expected failures: {len(xf)} entries")
    if config.getoption("--kv-quick"):
        lines.append("kvcache: quick mode (--kv-quick)")
    return lines


def kv_test_id(item) -> str:
    """``<file>::<rest of the node id>``: stable whether the package runs from
    a checkout or from site-packages."""
    path, _, rest = item.nodeid.partition("::")
    return f"{Path(path).name}::{rest}" if rest else Path(path).name


def _in_suite(item) -> bool:
    mod = getattr(item, "module", None)
    return mod is not None and getattr(mod, "__name__", "").startswith(_PKG + ".")


def pytest_collection_modifyitems(session, config, items):
    suite = [it for it in items if _in_suite(it)]
    if not suite:
        return
    backend = get_backend(config)
    xfail = config.stash[_XFAIL_KEY]
    used: set[str] = set()
    for item in suite:
        for mark in item.iter_markers("kv_requires"):
            missing = backend.missing(*mark.args)
            if missing:
                item.add_marker(pytest.mark.skip(
                    reason=f"backend {backend.name} does not declare {', '.join(missing)}"))
                break
        tid = kv_test_id(item)
        for prefix, reason in xfail.items():
            if tid.startswith(prefix) or item.nodeid.startswith(prefix):
                used.add(prefix)
                item.add_marker(pytest.mark.xfail(reason=f"expected failure: {reason}", strict=False))
                break
    config.stash[_UNMATCHED_KEY] = [p for p in xfail if p not in used]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    unmatched = config.stash.get(_UNMATCHED_KEY, None)
    if unmatched:
        terminalreporter.section("kvcache expected-failures file")
        terminalreporter.write_line(f"{len(unmatched)} entries matched no collected test:")
        for p in unmatched:
            terminalreporter.write_line(f"  {p}")


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def kv_backend(request) -> Backend:
    """The backend under test."""
    return get_backend(request.config)


@pytest.fixture(scope="session")
def kv_oracle() -> Backend:
    """``kvref``, the oracle every comparison runs against."""
    import kvref

    return kvref.conformance_backend()


@pytest.fixture(scope="session")
def kv_quick(request) -> bool:
    """True under ``--kv-quick``."""
    return bool(request.config.getoption("--kv-quick"))


@pytest.fixture(scope="session")
def kv_settings(request, kv_quick):
    """Hypothesis settings of the suite's state machines: 40 examples of up to
    40 steps (``--kv-quick``: 10 of 25), no deadline, shrinking unless
    ``--kv-no-shrink``. ``--hypothesis-seed`` and the Hypothesis database
    work as usual."""
    from hypothesis import HealthCheck, Phase, settings

    examples, steps = (10, 25) if kv_quick else (40, 40)
    phases = list(Phase)
    if request.config.getoption("--kv-no-shrink"):
        phases = [p for p in phases if p is not Phase.shrink]
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        phases=phases,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


def require(backend: Backend, *caps: str) -> None:
    """Skip the calling test unless ``backend`` declares every capability in ``caps``."""
    missing = backend.missing(*caps)
    if missing:
        pytest.skip(f"backend {backend.name} does not declare {', '.join(missing)}")
