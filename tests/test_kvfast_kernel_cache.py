"""Compiled kernels never outlive their sources: kvfast's Numba kernel cache goes stale as a whole
when any file of the package changes (``kvfast/_numba/_cache.py``), and a CUDA module's cache key
covers the headers it includes (``kvfast/_cuda/_sources.py``'s ``module_code``).

Numba alone keys a cached function by its own file: a kernel that calls a compiled function of
another file keeps that callee's old code after only the callee's file changed. Here a real
package on disk, a caller and a callee in two files, both ``cache=True``, run in fresh
interpreters (real cache files under its ``__pycache__``): with the package registered through
``stamp_package_caches``, an unchanged package loads from the cache, and a change to the callee
alone is compiled anew into the caller.

The same class on the GPU path: CuPy's on-disk module cache is keyed by the code text, so the
code kvfast hands ``RawModule`` carries the digest of ``kvfast/kernels``' headers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import kvfast._numba  # noqa: F401  (registers kvfast's own package)
from kvfast._numba._cache import _ROOTS

CALLER = """
from numba import njit
from .callee import f

@njit(cache=True)
def g(x):
    return f(x) * 10
"""

RUN = """
import json, sys
from kvfast._numba._cache import stamp_package_caches
assert stamp_package_caches({pkg!r})
from pkg.caller import g
value = g(1)
print(json.dumps({{"value": int(value), "hits": sum(g.stats.cache_hits.values()),
                  "misses": sum(g.stats.cache_misses.values())}}))
"""


def _run(root: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", RUN.format(pkg=str(root / "pkg"))], env=env, check=True,
                         capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_callee_change_recompiles_its_callers(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "caller.py").write_text(textwrap.dedent(CALLER))
    callee = pkg / "callee.py"
    callee.write_text("from numba import njit\n\n@njit(cache=True)\ndef f(x):\n    return x + 1\n")
    first = _run(tmp_path)
    assert first == {"value": 20, "hits": 0, "misses": 1}
    again = _run(tmp_path)
    assert again == {"value": 20, "hits": 1, "misses": 0}  # unchanged: the cached code
    callee.write_text("from numba import njit\n\n@njit(cache=True)\ndef f(x):\n    return x + 22\n")
    changed = _run(tmp_path)
    assert changed == {"value": 230, "hits": 0, "misses": 1}  # only the callee's file changed


def test_kvfast_itself_is_registered():
    root = os.path.dirname(os.path.dirname(os.path.abspath(kvfast._numba.__file__)))
    assert root in _ROOTS


def test_cupy_module_code_names_the_headers(monkeypatch):
    """CuPy's on-disk module cache is keyed by the code text, not by what ``#include`` reads
    through ``-I``: the code kvfast compiles carries its headers' digest, so a changed header
    is a new cache key (and the emulated device still recognises the code)."""
    from kvfast._cuda import _sources

    code = _sources.module_code("append_kv.cu")
    assert code.startswith(_sources.source("append_kv.cu"))
    headers = _sources.header_sources()
    assert headers and any(f'#include "{name}"' in _sources.source(f) for name in headers for f in _sources.KERNELS)
    changed = {name: text + "\n// changed\n" for name, text in headers.items()}
    monkeypatch.setattr(_sources, "header_sources", lambda: changed)
    assert _sources.module_code("append_kv.cu") != code
    monkeypatch.undo()
    assert _sources.module_code("append_kv.cu") == code
