"""``conformance_backend()``: kvfast as a ``kvspec.conformance.Backend``.

Registered in the ``kvcache.backends`` entry-point group as ``kvfast``, so
``pytest --pyargs kvspec.conformance --kv-backend=kvfast`` runs the
conformance suite on the fast path against ``kvref``.
"""

from __future__ import annotations

import functools

from kvspec.conformance import CAPABILITIES, Backend
from kvspec.hashing import collide_hashes

__all__ = ["conformance_backend", "collide_hashes"]


@functools.lru_cache(maxsize=None)
def _both_scatter_paths_cache():
    """The class, built once on first use (kvfast's engines load Numba: not at entry-point scan)."""
    from ._slot_cache import KVCache
    from ._slot_engine import FastSlotEngine

    class BothScatterPathsKVCache(KVCache):
        """``kvfast.KVCache`` whose CPU engine has the parallel scatter on, so the suite reaches
        both copy paths: steps of few or long runs stay serial, steps of >= 128 short runs take
        the ``prange`` path that ``KVFAST_PARALLEL_SCATTER=1`` selects in production."""

        @classmethod
        def make_engine(cls, config):
            engine = super().make_engine(config)
            if type(engine) is FastSlotEngine:
                return FastSlotEngine(config.max_seqs, parallel_scatter=True)
            return engine

    return BothScatterPathsKVCache


def _make_cache(config, layer_specs):
    return _both_scatter_paths_cache().make(config, layer_specs)


def _make_manager(params, *, num_blocks, max_batch_size, max_seq_len, device="cpu", connector=None, clock=None):
    from ._manager import PagedKVCacheManager

    return PagedKVCacheManager(
        params, num_blocks=num_blocks, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
        device=device, connector=connector, clock=clock,
    )


def conformance_backend() -> Backend:
    """kvfast with every capability declared, on the CPU (and ``cuda:0`` when CuPy sees a GPU).

    Returns
    -------
    kvspec.conformance.Backend
    """
    from . import __version__, ops

    devices = ("cpu",)
    try:  # pragma: no cover - depends on the machine
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            devices = ("cpu", "cuda:0")
    except Exception:
        pass  # no CuPy or no visible GPU: the backend declares the CPU only
    return Backend(
        name="kvfast",
        version=__version__,
        make_cache=_make_cache,
        make_manager=_make_manager,
        ops=ops,
        capabilities=frozenset(CAPABILITIES),
        devices=devices,
        collide_hashes=collide_hashes,
    )
