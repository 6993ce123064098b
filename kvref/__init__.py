"""kvref: the reference kvcache, pure NumPy and the standard library.

It is the executable definition of every behaviour in ``spec/``: readable
before fast, strict about its inputs, and never wrong. ``kvfast`` must agree
with it bit for bit.

Public surface: ``KVCache`` (slot cache), ``PagedKVCacheManager`` (request
manager), ``ops`` (``append_kv``, ``gather_kv``, ``varlen_attention``),
``check_invariants``, the tiers (``TieredConnector``), and every ``kvspec``
name re-exported.
"""

from __future__ import annotations

import importlib

from kvspec import *  # noqa: F401,F403  (the shared names, DESIGN §3)
from kvspec import __all__ as _spec_all

__version__ = "0.1.0"

# Public name -> private module; loaded on first use (PEP 562).
_LAZY = {
    "KVCache": "._slot_cache",
    "PagedKVCacheManager": "._manager",
    "TieredConnector": "._tiers",
    "RemoteTier": "._remote_tier",
    "ops": ".ops",
    "conformance_backend": "._backend",
    "ReferenceSlotEngine": "._slot_engine",
    "ReferenceManagerEngine": "._manager_engine",
    "BlockPool": "._block_pool",
}

__all__ = sorted(set(_spec_all) | set(_LAZY) | {"check_invariants"})


def check_invariants(obj) -> None:
    """Raise ``AssertionError`` naming the first broken invariant of a
    ``KVCache`` or ``PagedKVCacheManager``; return None when all hold."""
    obj.check_invariants()


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'kvref' has no attribute {name!r}")
    module = importlib.import_module(mod, __name__)
    value = module if name == "ops" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
