"""The conformance suite as a product: it passes on kvref, fails on every
deliberately broken backend, its plugin options work, and the golden vectors
regenerate byte-identically.

The suite runs in subprocesses (``python -m pytest --pyargs kvspec.conformance``)
exactly as a backend author runs it, from the installed package.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvref
from kvspec import vectors
from kvspec.conformance import CAPABILITIES, Backend, resolve_backend

ROOT = Path(__file__).resolve().parents[1]

#: Each broken backend and the spec rule it breaks (tests/broken_backends/<module>.py).
BROKEN = {
    "off_by_one_slot_mapping": "slot_mapping of a step's last token",
    "unverified_prefix_hit": "prefix hit without token verification under a forced hash collision",
    "non_atomic_reserve": "a failed reservation keeps the rows that fit",
    "head_first_eviction": "release frees head first",
    "no_state_zeroing": "evict_batch keeps state slabs",
    "publish_before_onload": "a loaded page is published before its onload lands",
    "lut_padded_with_live_block": "lookup table padded with a live block instead of the null block",
    "last_token_hashed": "the prompt's last token counts toward a prefix hit",
}


def run_suite(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m pytest --pyargs kvspec.conformance ARGS`` from the repository root."""
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "kvspec.conformance", "-p", "no:cacheprovider",
           "-p", "no:randomly", "--kv-quick", "--kv-no-shrink", "--hypothesis-seed=0", *args]
    drop = ("KVCACHE_BACKEND", "KVCACHE_XFAIL", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")
    full_env = {k: v for k, v in os.environ.items() if k not in drop}
    full_env.update(env or {})
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=600)


def _tail(proc: subprocess.CompletedProcess, n: int = 40) -> str:
    return "\n".join((proc.stdout + proc.stderr).splitlines()[-n:])


# ---------------------------------------------------------------- the suite on kvref and on broken backends


def test_suite_passes_on_kvref():
    proc = run_suite("--kv-backend=kvref")
    assert proc.returncode == 0, _tail(proc)
    assert "kvcache backend: kvref" in proc.stdout, "report header must name the backend"
    caps = re.search(r"capabilities: ([a-z0-9_, ]+);", proc.stdout)
    assert caps, proc.stdout[:2000]
    assert {"contiguous", "cross", "invariants", "manager", "paged"} <= set(caps.group(1).split(", ")), caps.group(1)
    assert " passed" in proc.stdout and " failed" not in proc.stdout


def test_suite_passes_on_kvfast():
    """kvfast, by its registered name, must agree with kvref everywhere."""
    from kvspec.conformance import backend_names

    if "kvfast" not in backend_names():
        pytest.skip("kvfast is not registered in the kvcache.backends entry-point group")
    proc = run_suite("--kv-backend=kvfast")
    assert proc.returncode == 0, _tail(proc)
    assert "kvcache backend: kvfast" in proc.stdout


_DRIVER = """
import json, sys
import numpy as np
import pytest
common = json.loads(sys.argv[1])
results = {}
for module in json.loads(sys.argv[2]):
    results[module] = int(pytest.main([*common, f"--kv-backend=tests.broken_backends.{module}:factory"]))
print("KV-RESULTS " + json.dumps(results))
"""


def run_broken(modules, *args: str) -> dict[str, int]:
    """Run the suite once per broken backend inside one Python process (pytest.main
    per backend: one interpreter start instead of eight). Returns exit codes."""
    import json

    common = ["--pyargs", "kvspec.conformance", "-q", "-p", "no:cacheprovider", "--kv-quick", "--kv-no-shrink",
              "--hypothesis-seed=0", "-x", *args]
    drop = ("KVCACHE_BACKEND", "KVCACHE_XFAIL", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(common), json.dumps(sorted(modules))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    line = [l for l in proc.stdout.splitlines() if l.startswith("KV-RESULTS ")]
    assert line, _tail(proc)
    return json.loads(line[-1][len("KV-RESULTS "):]), proc


def test_suite_catches_every_broken_backend():
    codes, proc = run_broken(BROKEN)
    missed = {m: BROKEN[m] for m, rc in codes.items() if rc != 1}
    assert not missed, f"the suite passed (or errored) on broken backends {missed}: {codes}\n{_tail(proc, 60)}"


def test_state_machines_alone_catch():
    """The differential state machines find these bugs without any directed test."""
    codes, proc = run_broken(["off_by_one_slot_mapping", "head_first_eviction"], "-k", "machine")
    assert codes == {"head_first_eviction": 1, "off_by_one_slot_mapping": 1}, f"{codes}\n{_tail(proc, 60)}"


# ---------------------------------------------------------------- plugin behaviour


def contiguous_only() -> Backend:
    """kvref declaring only the contiguous slot cache (a capability-skip fixture)."""
    return dataclasses.replace(kvref.conformance_backend(), name="kvref-contiguous-only",
                               capabilities=frozenset({"contiguous", "strict_block_ids", "invariants"}),
                               collide_hashes=None)


def test_undeclared_capabilities_skip_with_a_reason():
    proc = run_suite("--kv-backend=tests.test_conformance:contiguous_only", "-rs", "-k", "not machine")
    assert proc.returncode == 0, _tail(proc)
    assert "does not declare paged" in proc.stdout and "does not declare manager" in proc.stdout, _tail(proc, 80)
    assert "kvcache backend: kvref-contiguous-only" in proc.stdout


def test_expected_failures_file(tmp_path):
    xfail = tmp_path / "xfail.txt"
    xfail.write_text(
        "# known departures of this backend\n"
        "test_slot_cache.py::test_last_token_is_never_a_hit   # hashes the whole prompt\n"
        "~test_manager.py::test_repeat_prompt   # a substring entry\n"
        "~test_vectors.py::test_replay\n"
        "~test_manager_paths.py::\n"
        "test_nothing.py::test_gone\n",
        encoding="utf-8",
    )
    proc = run_suite("--kv-backend=tests.broken_backends.last_token_hashed:factory", f"--kv-xfail={xfail}",
                     "-k", "not machine")
    assert proc.returncode == 0, _tail(proc)
    assert " xfailed" in proc.stdout and " failed" not in proc.stdout, _tail(proc)
    assert "1 entries matched no collected test" in proc.stdout and "test_nothing.py::test_gone" in proc.stdout


def test_backend_from_environment():
    proc = run_suite("-k", "test_make_starts_empty", env={"KVCACHE_BACKEND": "tests.test_conformance:contiguous_only"})
    assert proc.returncode == 0, _tail(proc)
    assert "kvcache backend: kvref-contiguous-only" in proc.stdout


def test_unknown_backend_is_a_usage_error():
    proc = run_suite("--kv-backend=no_such_backend")
    assert proc.returncode == 4, _tail(proc)
    assert "not registered in 'kvcache.backends'" in proc.stderr + proc.stdout


# ---------------------------------------------------------------- the Backend contract


def test_backend_validation():
    base = kvref.conformance_backend()
    with pytest.raises(ValueError, match=r"capabilities has 'paging'"):
        dataclasses.replace(base, capabilities=frozenset({"paging"}))
    with pytest.raises(ValueError, match=r"make_cache=None but capabilities declare a slot cache"):
        dataclasses.replace(base, make_cache=None)
    with pytest.raises(ValueError, match=r"make_manager=None but capabilities declare 'manager'"):
        dataclasses.replace(base, make_manager=None)
    with pytest.raises(ValueError, match=r"devices\[0\]"):
        dataclasses.replace(base, devices=("tpu",))
    with pytest.raises(TypeError, match=r"name=''"):
        dataclasses.replace(base, name="")
    with pytest.raises(ValueError, match="has no callable append_kv"):
        dataclasses.replace(base, ops=object())
    assert base.capabilities == frozenset(CAPABILITIES) and base.device == "cpu"
    assert base.missing("paged", "tiers") == [] and base.supports("manager")


def test_resolve_backend():
    assert resolve_backend("kvref").name == "kvref"
    assert resolve_backend("kvref:conformance_backend").name == "kvref"
    assert resolve_backend("tests.test_conformance:contiguous_only").capabilities == {"contiguous", "strict_block_ids", "invariants"}
    with pytest.raises(ValueError, match="not registered"):
        resolve_backend("nope")
    with pytest.raises(TypeError, match="must return a kvspec.conformance.Backend"):
        resolve_backend("kvref:__version__")
    with pytest.raises(ValueError, match="module:factory"):
        resolve_backend("kvref:")


# ---------------------------------------------------------------- golden vectors


def _generator():
    spec = importlib.util.spec_from_file_location("gen_vectors", ROOT / "spec" / "tools" / "gen_vectors.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_vectors_regenerate_byte_identically():
    files = _generator().build_all()
    assert sorted(files) == vectors.names(), f"generator writes {sorted(files)}, kvspec.vectors has {vectors.names()}"
    for name, text in files.items():
        assert vectors.read_bytes(name) == text.encode("utf-8"), f"spec/vectors/{name} differs from a fresh kvref run"


def test_vectors_ship_as_package_data():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert '"kvspec.vectors" = "spec/vectors"' in text and '"kvspec.vectors" = ["*.json"]' in text
    assert 'kvspec_conformance = "kvspec.conformance.plugin"' in text


# ---------------------------------------------------------------- building blocks


def test_assert_same_names_the_first_difference():
    import numpy as np

    from kvspec.conformance._compare import Outcome, assert_same, assert_same_outcome

    a = np.zeros((2, 3), np.float16)
    b = a.copy()
    b[1, 2] = -0.0  # same value, different bytes
    with pytest.raises(AssertionError, match=r"x: differs at index \(1, 2\) \(1 of 6 elements differ\)"):
        assert_same(a, b, "x")
    with pytest.raises(AssertionError, match="dtype=float32, kvref has float16"):
        assert_same(a, a.astype(np.float32), "x")
    with pytest.raises(AssertionError, match=r"x\['k'\]\[1\]: True, kvref gives 1"):
        assert_same({"k": [0, 1]}, {"k": [0, True]}, "x")
    assert_same({"k": [np.int32(3), (1, 2)]}, {"k": [3, [1, 2]]}, "x")
    with pytest.raises(AssertionError, match="message 'b', kvref says 'a'"):
        assert_same_outcome("call", Outcome(exc=ValueError("a")), Outcome(exc=ValueError("b")))
    with pytest.raises(AssertionError, match="backend raised IndexError"):
        assert_same_outcome("call", Outcome(exc=ValueError("a")), Outcome(exc=IndexError("a")))
    with pytest.raises(AssertionError, match="backend returned 1, kvref raised"):
        assert_same_outcome("call", Outcome(exc=ValueError("a")), Outcome(value=1))


def test_strategies_respect_capabilities():
    from hypothesis import given, settings

    from kvspec import KVCacheMode, LayerKind
    from kvspec.strategies import cache_configs, exact_values, manager_setups

    @settings(max_examples=30, deadline=None)
    @given(cfg=cache_configs(frozenset({"contiguous"})), setup=manager_setups(frozenset({"manager"})))
    def check(cfg, setup):
        config, specs = cfg
        assert config.mode is KVCacheMode.CONTIGUOUS and len(specs) == config.num_layers
        assert all(s.kind is LayerKind.ATTENTION for s in specs), specs
        assert 2 <= config.block_size <= 4
        assert setup["params"].data_parallel_degree == 1 and not setup["params"].enable_prefix_caching

    check()
    v = exact_values((4, 4), "bfloat16", 3)
    assert (v.astype("float64") * 8 == np.round(v.astype("float64") * 8)).all()
    assert (exact_values((3,), "float16", 1) == exact_values((3,), "float16", 1)).all()


def test_vectors_package_errors():
    with pytest.raises(ValueError, match=r"kvspec.vectors.read_bytes: name='nope.json' not in"):
        vectors.read_bytes("nope.json")


def test_backend_device_selection():
    base = kvref.conformance_backend()
    gpu = dataclasses.replace(base, devices=("cuda:0", "cpu"))
    assert gpu.on_device("cpu").devices == ("cpu", "cuda:0") and gpu.device == "cuda:0"
    with pytest.raises(ValueError, match=r"device='cuda:1' not in devices=\('cuda:0', 'cpu'\)"):
        gpu.on_device("cuda:1")
    proc = run_suite("--kv-backend=kvref", "--kv-device=cuda:0")
    assert proc.returncode == 4 and "--kv-device=cuda:0" in proc.stderr + proc.stdout, _tail(proc)


def test_notes_are_python_source():
    """The state machines note() configs as source that rebuilds the same objects."""
    from hypothesis import given, settings

    import kvspec

    ns = {n: getattr(kvspec, n) for n in ("KVCacheConfig", "KVCacheMode", "KVCacheParams", "KVLayerSpec", "LeafSpec")}
    from kvspec.conformance._compare import config_source, params_source, specs_source
    from kvspec.strategies import cache_configs, manager_setups

    caps = frozenset(CAPABILITIES)

    @settings(max_examples=25, deadline=None)
    @given(cfg=cache_configs(caps), setup=manager_setups(caps))
    def check(cfg, setup):
        config, specs = cfg
        assert eval(config_source(config), ns) == config, config_source(config)
        assert eval(specs_source(specs), ns) == specs, specs_source(specs)
        assert eval(params_source(setup["params"]), ns) == setup["params"], params_source(setup["params"])

    check()


# ---------------------------------------------------------------- conformance as a product (issue 18)


def test_xfail_entries_match_exactly_unless_marked_substring(tmp_path):
    """A plain entry is one exact id: ``test_vectors.py::test_replay`` (no params)
    matches nothing, so it is reported unused and the failures stay failures."""
    from kvspec.conformance.plugin import matches

    tid = "test_slot_cache.py::test_admit_hit[paged]"
    assert matches(tid, tid) and not matches("test_slot_cache.py::test_admit_hit", tid)
    assert not matches("test_slot_cache.py::test_admit_hit[pag", tid)
    assert matches("~test_admit_hit", tid) and matches("~[paged]", tid) and not matches("~[contiguous]", tid)
    xfail = tmp_path / "xfail.txt"
    xfail.write_text("test_manager.py::test_repeat_prompt\n", encoding="utf-8")
    proc = run_suite("--kv-backend=tests.broken_backends.last_token_hashed:factory", f"--kv-xfail={xfail}",
                     "-k", "test_repeat_prompt")
    assert proc.returncode == 1 and " failed" in proc.stdout and "xfailed" not in proc.stdout, _tail(proc)
    assert "test_manager.py::test_repeat_prompt (--kv-xfail)" in proc.stdout, _tail(proc)


def test_skips_file(tmp_path):
    skips = tmp_path / "skips.txt"
    skips.write_text("~test_vectors.py::\ntest_slot_cache.py::test_accessor_errors[paged]  # not yet\n",
                     encoding="utf-8")
    proc = run_suite("--kv-backend=kvref", f"--kv-skips={skips}", "-rs", "-k", "vectors or accessor_errors")
    assert proc.returncode == 0, _tail(proc)
    assert "listed in the skips file: not yet" in proc.stdout, _tail(proc)
    assert "test_accessor_errors[contiguous]" not in proc.stdout and "1 passed" in proc.stdout, _tail(proc)
    assert "kvcache skips: 2 entries" in proc.stdout


def test_suite_and_spec_version_options():
    from kvspec.conformance import plugin

    proc = run_suite("--kv-backend=kvref", "-k", "accessor_errors", f"--kv-spec-version={plugin.SPEC_VERSION}",
                     "--kv-max-examples=2")
    assert proc.returncode == 0, _tail(proc)
    assert f"kvcache conformance suite {plugin.SUITE_VERSION}; spec version {plugin.SPEC_VERSION}" in proc.stdout
    bad = run_suite("--kv-backend=kvref", "--kv-spec-version=0.0")
    assert bad.returncode == 4 and "--kv-spec-version=0.0: not one of" in bad.stdout + bad.stderr, _tail(bad)
    bad = run_suite("--kv-backend=kvref", "--kv-max-examples=0")
    assert bad.returncode == 4 and "--kv-max-examples=0: must be >= 1" in bad.stdout + bad.stderr, _tail(bad)


def _repro_of(proc) -> str:
    marker = "---- reproduction: paste into repro.py and run `python repro.py` ----\n"
    assert marker in proc.stdout, _tail(proc, 80)
    return proc.stdout.split(marker, 1)[1].split("---- end of reproduction ----", 1)[0]


@pytest.mark.parametrize("module,select", [
    ("off_by_one_slot_mapping", "kvcache_comparison"),   # a state machine, shrunk
    ("head_first_eviction", "manager_comparison"),
    ("no_state_zeroing", "test_slot_cache.py"),           # a method test's own assert
])
def test_failure_prints_a_reproduction_that_runs(tmp_path, module, select):
    """The report has no harness frames and ends in a script that, saved to a
    file and run as printed, fails with the same AssertionError."""
    proc = run_suite(f"--kv-backend=tests.broken_backends.{module}:factory", "-x", "-k", select,
                     "--kv-shrink-seconds=2")
    assert proc.returncode == 1, _tail(proc)
    assert "_compare.py:" not in proc.stdout and "def assert_same" not in proc.stdout, _tail(proc, 80)
    script = _repro_of(proc)
    path = tmp_path / "repro.py"
    path.write_text(script, encoding="utf-8")
    r = subprocess.run([sys.executable, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "AssertionError" in r.stderr, (script, r.stderr[-3000:])


def test_reproduction_renders_arrays_exactly():
    import ml_dtypes

    from kvspec.conformance._compare import array_source

    ns = {"np": np, "ml_dtypes": ml_dtypes}
    for a in (np.array([[1.5, -0.0], [65504, 2**-24]], np.float16), np.arange(6, dtype=np.int32).reshape(2, 3),
              np.array([1.0, 3.140625], ml_dtypes.bfloat16), np.array([np.nan, np.inf], np.float32)):
        b = eval(array_source(a), ns)
        assert b.dtype == a.dtype and b.shape == a.shape and b.tobytes() == a.tobytes(), array_source(a)
