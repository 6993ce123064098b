"""The pytest plugin of the conformance suite (registered in ``pytest11``).

Options
-------
``--kv-backend=SPEC``
    ``module:factory`` or a ``kvcache.backends`` entry-point name; default
    ``$KVCACHE_BACKEND``, else ``kvref``.
``--kv-xfail=FILE``
    Expected failures, one test id a line (``#`` starts a comment). A test id
    is ``<file>::<test>[<params>]``, e.g. ``test_slot_cache.py::test_admit_hit[paged]``
    (the full pytest node id works too) and matches **exactly**; a line
    ``~TEXT`` matches every test whose id contains ``TEXT``. Matching tests are
    marked ``xfail``; entries that match no collected test are listed at the
    end of the run. Default ``$KVCACHE_XFAIL``.
``--kv-skips=FILE``
    Tests not to run, in the same format (exact ids, ``~`` substrings).
    Default ``$KVCACHE_SKIPS``.
``--kv-device=DEVICE``
    Build the backend's objects on DEVICE (one of its declared devices;
    default ``cpu`` when declared). kvref, the oracle, always runs on the CPU.
``--kv-quick``
    Fewer Hypothesis examples and shorter state-machine runs (CI smoke runs).
``--kv-max-examples=N``
    Hypothesis examples per state machine (overrides ``--kv-quick``'s 10 and the default 40).
``--kv-shrink-seconds=S``
    Time the shrinker may spend on a failure (default 5): the first report
    comes after at most the search time plus S. A warning is printed when a
    failure is found and shrinking starts.
``--kv-no-shrink``
    Report the first failing example as found, without shrinking it.
``--kv-spec-version=V``
    The spec version the backend targets (default: the newest,
    :data:`SPEC_VERSION`); tests marked ``kv_spec("W")`` with ``W`` newer than
    ``V`` are skipped with the reason.

A failure in the suite is reported without the harness's frames: the
comparison that failed, then a paste-ready Python script that replays the
example on kvref and on the backend and repeats the comparison.

The plugin only acts on tests of the ``kvspec.conformance`` package: other
test runs see unused options and nothing else.
"""

from __future__ import annotations

import builtins
import os
import re
import time
from pathlib import Path

import pytest

from . import _compare
from ._backend import ENV_BACKEND, Backend, resolve_backend

#: Version of the conformance suite (its tests and harness), reported in the header.
SUITE_VERSION = "1.1.0"

#: Spec versions the suite knows, oldest first; the last is the current spec.
SPEC_VERSIONS = ("1.0",)

#: The newest spec version (the default ``--kv-spec-version``).
SPEC_VERSION = SPEC_VERSIONS[-1]

#: Default ``--kv-shrink-seconds``.
SHRINK_SECONDS = 5.0

ENV_XFAIL = "KVCACHE_XFAIL"
ENV_SKIPS = "KVCACHE_SKIPS"
_PKG = "kvspec.conformance"
_BACKEND_KEY = pytest.StashKey[Backend]()
_XFAIL_KEY = pytest.StashKey[dict]()
_SKIPS_KEY = pytest.StashKey[dict]()
_UNMATCHED_KEY = pytest.StashKey[list]()


def pytest_addoption(parser):
    g = parser.getgroup("kvcache", "kvcache conformance suite (kvspec.conformance)")
    g.addoption("--kv-backend", default=None, metavar="SPEC",
                help="backend under test: module:factory or a kvcache.backends name (default $KVCACHE_BACKEND or kvref)")
    g.addoption("--kv-xfail", default=None, metavar="FILE",
                help="file of test ids expected to fail: exact ids, '~TEXT' for a substring (default $KVCACHE_XFAIL)")
    g.addoption("--kv-skips", default=None, metavar="FILE",
                help="file of test ids not to run: exact ids, '~TEXT' for a substring (default $KVCACHE_SKIPS)")
    g.addoption("--kv-max-examples", default=None, type=int, metavar="N",
                help="Hypothesis examples per state machine (default 40, 10 with --kv-quick)")
    g.addoption("--kv-shrink-seconds", default=SHRINK_SECONDS, type=float, metavar="S",
                help=f"time budget of the shrinker per failure (default {SHRINK_SECONDS:g} s)")
    g.addoption("--kv-spec-version", default=None, metavar="V",
                help=f"spec version the backend targets, one of {', '.join(SPEC_VERSIONS)} (default {SPEC_VERSION})")
    g.addoption("--kv-quick", action="store_true", default=False,
                help="fewer Hypothesis examples and shorter state machines")
    g.addoption("--kv-device", default=None, metavar="DEVICE",
                help="device to build the backend's objects on (default cpu when declared, else its first device)")
    g.addoption("--kv-no-shrink", action="store_true", default=False,
                help="report the first failing example without shrinking it (faster failures)")


def _wants_suite(config) -> bool:
    if config.getoption("--kv-backend") or config.getoption("--kv-xfail") or config.getoption("--kv-skips"):
        return True
    return any("conformance" in str(a) and "kvspec" in str(a).replace("/", ".") for a in config.args)


def _read_ids(path: str, option: str = "--kv-xfail") -> dict[str, str]:
    """``{entry: reason}`` of an id file (exact ids; ``~TEXT`` substring entries)."""
    entries: dict[str, str] = {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise pytest.UsageError(f"{option}: cannot read {path!r}: {e}") from None
    for line in text.splitlines():
        body, _, reason = line.partition("#")
        body = body.strip()
        if body:
            entries[body] = reason.strip() or f"listed in {path}"
    return entries


def matches(entry: str, test_id: str, nodeid: str = "") -> bool:
    """Whether an id-file ``entry`` selects a test: equal to its id (or node id),
    or, for ``~TEXT``, ``TEXT`` occurs in it."""
    if entry.startswith("~"):
        return entry[1:] in test_id or (bool(nodeid) and entry[1:] in nodeid)
    return entry == test_id or entry == nodeid


def _version_key(v: str) -> tuple:
    return tuple(int(x) for x in v.split("."))


def spec_version(config) -> str:
    """The ``--kv-spec-version`` of this run (validated; default :data:`SPEC_VERSION`)."""
    v = config.getoption("--kv-spec-version") or SPEC_VERSION
    if v not in SPEC_VERSIONS:
        raise pytest.UsageError(f"--kv-spec-version={v}: not one of {', '.join(SPEC_VERSIONS)}")
    return v


def pytest_configure(config):
    config.addinivalue_line("markers", "kv_requires(*capabilities): skip unless the backend declares them")
    config.addinivalue_line("markers", "kv_spec(version): the spec version that introduced the tested rule")
    xfail_path = config.getoption("--kv-xfail") or os.environ.get(ENV_XFAIL)
    config.stash[_XFAIL_KEY] = _read_ids(xfail_path, "--kv-xfail") if xfail_path else {}
    skips_path = config.getoption("--kv-skips") or os.environ.get(ENV_SKIPS)
    config.stash[_SKIPS_KEY] = _read_ids(skips_path, "--kv-skips") if skips_path else {}
    n = config.getoption("--kv-max-examples")
    if n is not None and n < 1:
        raise pytest.UsageError(f"--kv-max-examples={n}: must be >= 1")
    budget = config.getoption("--kv-shrink-seconds")
    if budget is not None and budget <= 0:
        raise pytest.UsageError(f"--kv-shrink-seconds={budget}: must be > 0")
    spec_version(config)
    if _wants_suite(config) or os.environ.get(ENV_BACKEND):
        get_backend(config)
        if config.getoption("tbstyle", "auto") == "auto":
            config.option.tbstyle = "short"  # failures carry their own reproduction


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
    lines = [b.describe() + f"; testing on {b.device}",
             f"kvcache conformance suite {SUITE_VERSION}; spec version {spec_version(config)}"]
    xf = config.stash[_XFAIL_KEY]
    if xf:
        lines.append(f"kvcache expected failures: {len(xf)} entries")
    sk = config.stash[_SKIPS_KEY]
    if sk:
        lines.append(f"kvcache skips: {len(sk)} entries")
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
    xfail, skips = config.stash[_XFAIL_KEY], config.stash[_SKIPS_KEY]
    target = _version_key(spec_version(config))
    used: set[str] = set()
    for item in suite:
        for mark in item.iter_markers("kv_requires"):
            missing = backend.missing(*mark.args)
            if missing:
                item.add_marker(pytest.mark.skip(
                    reason=f"backend {backend.name} does not declare {', '.join(missing)}"))
                break
        for mark in item.iter_markers("kv_spec"):
            if _version_key(str(mark.args[0])) > target:
                item.add_marker(pytest.mark.skip(
                    reason=f"spec {mark.args[0]} rule; the backend targets spec {'.'.join(map(str, target))}"))
        tid = kv_test_id(item)
        for entry, reason in skips.items():
            if matches(entry, tid, item.nodeid):
                used.add("skips:" + entry)
                item.add_marker(pytest.mark.skip(reason=f"listed in the skips file: {reason}"))
                break
        for entry, reason in xfail.items():
            if matches(entry, tid, item.nodeid):
                used.add("xfail:" + entry)
                item.add_marker(pytest.mark.xfail(reason=f"expected failure: {reason}", strict=False))
                break
    config.stash[_UNMATCHED_KEY] = ([f"{p} (--kv-xfail)" for p in xfail if "xfail:" + p not in used]
                                    + [f"{p} (--kv-skips)" for p in skips if "skips:" + p not in used])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _compare.end_reproduction()
    if _in_suite(item):
        _install_shrink_warning(item)


def _install_shrink_warning(item) -> None:
    """Print one line when a test's first failure is found (shrinking starts then)."""
    config = item.config
    tr = config.pluginmanager.get_plugin("terminalreporter")
    capman = config.pluginmanager.get_plugin("capturemanager")
    no_shrink = config.getoption("--kv-no-shrink")
    budget = config.getoption("--kv-shrink-seconds")
    start = time.perf_counter()

    def warn(message: str) -> None:
        if tr is None:
            return
        what = "reporting it unshrunk (--kv-no-shrink)" if no_shrink else (
            f"shrinking it for up to {budget:g} s (--kv-shrink-seconds=S, or --kv-no-shrink)")
        first = (message.splitlines() or ["?"])[0][:160]
        took = time.perf_counter() - start
        line = f"kvcache: {kv_test_id(item)} found a failure after {took:.1f} s ({first}); {what}"
        if capman is not None:
            with capman.global_and_fixture_disabled():
                tr.write_line(line, yellow=True)
        else:
            tr.write_line(line, yellow=True)

    _compare._ON_FIRST_FAILURE = warn


_GROUP = getattr(builtins, "BaseExceptionGroup", ())  # Python 3.11+

#: Hypothesis's message when shrinking hits its time limit (it says five minutes; the budget is ours).
_SHRINK_NOTE = re.compile(r"WARNING: Hypothesis has spent more than five minutes.*?(?=This test function|\Z)", re.S)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A suite failure is reported as the failing comparison plus its reproduction."""
    outcome = yield
    rep = outcome.get_result()
    _compare._ON_FIRST_FAILURE = None if call.when == "teardown" else _compare._ON_FIRST_FAILURE
    if not rep.failed or call.excinfo is None or not _in_suite(item):
        return
    exc = call.excinfo.value
    while isinstance(exc, _GROUP) and exc.exceptions:
        exc = next((e for e in exc.exceptions if getattr(e, "kv_repro", None)), exc.exceptions[0])
    repro = getattr(exc, "kv_repro", None)
    if repro is None and isinstance(exc, BaseException) and call.when == "call":
        repro = _compare.reproduction(("same", "observable state"))
        if repro is not None:
            repro = ("# The failure was a check of the test itself; this script replays the calls\n"
                     "# up to it and compares the whole observable state with kvref's.\n" + repro)
    if repro is None:
        return
    where = ""
    tb = call.excinfo.traceback
    for entry in reversed(tb):
        if not any(h in str(entry.path) for h in ("hypothesis", "_compare.py", "_harness.py", "pluggy", "_pytest")) \
                and entry.name != "_both":
            where = f"{entry.path}:{entry.lineno + 1}"
            break
    message = f"{type(exc).__name__}: {exc}".rstrip()
    budget = item.config.getoption("--kv-shrink-seconds")
    rep.sections = [(title, _SHRINK_NOTE.sub(f"(shrinking stopped at the {budget:g} s budget, --kv-shrink-seconds)\n", body))
                    for title, body in rep.sections]
    rep.longrepr = (f"{message}\n  (raised at {where})\n\n"
                    f"---- reproduction: paste into repro.py and run `python repro.py` ----\n{repro}"
                    f"---- end of reproduction ----")


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
    40 steps (``--kv-quick``: 10 of 25; ``--kv-max-examples`` sets the count),
    no deadline, no explain phase, shrinking for at most ``--kv-shrink-seconds``
    unless ``--kv-no-shrink``. ``--hypothesis-seed`` and the Hypothesis database
    work as usual."""
    from hypothesis import HealthCheck, Phase, settings

    examples, steps = (10, 25) if kv_quick else (40, 40)
    examples = request.config.getoption("--kv-max-examples") or examples
    phases = [p for p in Phase if p.name != "explain"]  # the explain phase re-runs the failure many times
    if request.config.getoption("--kv-no-shrink"):
        phases = [p for p in phases if p is not Phase.shrink]
    _shrink_budget(request.config.getoption("--kv-shrink-seconds"))
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        phases=phases,
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


def _shrink_budget(seconds: float) -> None:
    """Hypothesis's documented monkeypatchable limit on shrinking time."""
    from hypothesis.internal.conjecture import engine

    engine.MAX_SHRINKING_SECONDS = max(1, int(round(seconds)))


def require(backend: Backend, *caps: str) -> None:
    """Skip the calling test unless ``backend`` declares every capability in ``caps``."""
    missing = backend.missing(*caps)
    if missing:
        pytest.skip(f"backend {backend.name} does not declare {', '.join(missing)}")
