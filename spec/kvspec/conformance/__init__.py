"""kvspec.conformance: the conformance suite any kvcache backend can run.

::

    pytest --pyargs kvspec.conformance --kv-backend=module:factory
    pytest --pyargs kvspec.conformance --kv-backend=kvref        # a registered name
    KVCACHE_BACKEND=mypkg:backend pytest --pyargs kvspec.conformance

The factory returns a :class:`Backend` (constructors, ``ops``, declared
capabilities, devices). Every test compares the backend with ``kvref``, the
oracle, after each operation. Public pieces, importable for a backend's own
test suite:

* :class:`Backend`, :func:`resolve_backend`, :data:`CAPABILITIES`;
* ``KVCacheComparison`` (``machine.py``) and ``ManagerComparison``
  (``manager_machine.py``): Hypothesis state machines; run one with
  ``run_state_machine_as_test(KVCacheComparison.for_backend(b))``;
* ``kvspec.strategies``: the Hypothesis strategies they draw from;
* golden vectors: ``kvspec.vectors`` (files in ``spec/vectors/``), replayed by
  ``test_vectors.py``.

The plugin (``kvspec.conformance.plugin``) is registered in the ``pytest11``
entry-point group, so installing the package is enough; it adds
``--kv-backend``, ``--kv-xfail`` and ``--kv-quick`` and does nothing to test
runs that do not collect this package.
"""

from __future__ import annotations

import importlib

from ._backend import CAPABILITIES, ENTRY_POINT_GROUP, Backend, backend_names, resolve_backend

_LAZY = {
    "KVCacheComparison": ".machine",
    "ManagerComparison": ".manager_machine",
}

__all__ = [
    "Backend", "CAPABILITIES", "ENTRY_POINT_GROUP", "resolve_backend", "backend_names",
    "KVCacheComparison", "ManagerComparison",
]


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'kvspec.conformance' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value
