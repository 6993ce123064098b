"""``conformance_backend()``: kvref as a ``kvspec.conformance.Backend``.

Registered in the ``kvcache.backends`` entry-point group as ``kvref``, so
``pytest --pyargs kvspec.conformance --kv-backend=kvref`` runs the suite on
the reference (against itself: a check of the suite and of kvref's
invariants).
"""

from __future__ import annotations

from kvspec.hashing import collide_hashes
from kvspec.conformance import CAPABILITIES, Backend

__all__ = ["conformance_backend", "collide_hashes"]


def _make_cache(config, layer_specs):
    from ._slot_cache import KVCache

    return KVCache.make(config, layer_specs)


def _make_manager(params, *, num_blocks, max_batch_size, max_seq_len, device="cpu", connector=None, clock=None):
    from ._manager import PagedKVCacheManager

    return PagedKVCacheManager(
        params, num_blocks=num_blocks, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
        device=device, connector=connector, clock=clock,
    )


def conformance_backend() -> Backend:
    """kvref with every capability declared (it is the oracle).

    Returns
    -------
    kvspec.conformance.Backend
    """
    from . import __version__, ops

    return Backend(
        name="kvref",
        version=__version__,
        make_cache=_make_cache,
        make_manager=_make_manager,
        ops=ops,
        capabilities=frozenset(CAPABILITIES),
        devices=("cpu",),
        collide_hashes=collide_hashes,
    )
