"""The fast slot cache ``KVCache`` (DESIGN §4, §7): kvref's policy on a fast engine.

``kvfast.KVCache`` is ``kvref.KVCache`` (the policy of ``spec/slot-cache.md``,
written once) with one override: :meth:`KVCache.make_engine` picks a fast
``kvspec.engine.SlotEngine`` from ``config.device`` when the cache is made:

* ``"cpu"``: :class:`kvfast._slot_engine.FastSlotEngine` (intrusive int32
  block pool, Numba validation, growth, step-index and copy kernels);
* ``"cuda[:N]"``: :class:`kvfast._slot_engine.CudaSlotEngine` (CuPy storage
  and ``StepIndices``, bfloat16 as its uint16 bits, RawKernels); without CuPy
  or a visible GPU ``make`` raises ``RuntimeError`` saying so.

Every value, block id, message and byte is the policy's, so it equals kvref's
by construction; the differential tests check the engines' mechanisms.
"""

from __future__ import annotations

import kvref
from kvspec import KVCacheConfig
from kvspec._config import parse_device
from kvspec._dtypes import is_fp8
from kvspec.engine import SlotEngine

from ._slot_engine import CudaSlotEngine, FastSlotEngine, require_cuda

__all__ = ["KVCache", "require_cuda"]


class KVCache(kvref.KVCache):
    """Slot-indexed serving KV cache, contiguous or paged (``spec/slot-cache.md``); the fast path.

    Same constructor (:meth:`make`), methods, results and errors as
    ``kvref.KVCache`` (see there for the full semantics); storage may live on
    a CUDA device.

    Examples
    --------
    >>> from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec
    >>> cfg = KVCacheConfig(num_layers=1, max_seqs=2, max_seq_len=8,
    ...                     mode=KVCacheMode.PAGED, block_size=4)
    >>> cache = KVCache.make(cfg, [KVLayerSpec.attention(kv_heads=1, head_dim=2)])
    >>> cache.prepare_step([0, 3], [0], [1]).slot_mapping.tolist()
    [4, 5, 6]
    >>> type(cache.engine).__name__
    'FastSlotEngine'
    """

    @classmethod
    def make_engine(cls, config: KVCacheConfig) -> SlotEngine:
        """The fast engine for ``config.device``; called once by :meth:`make`.

        Parameters
        ----------
        config : KVCacheConfig
            ``config.device`` is ``"cpu"`` (NumPy + Numba) or ``"cuda[:N]"`` (CuPy).

        Returns
        -------
        kvspec.engine.SlotEngine

        Raises
        ------
        RuntimeError
            ``device="cuda"`` without CuPy or a visible GPU.
        """
        kind, dev = parse_device("KVCache.make", config.device)
        if kind == "cuda":
            cp = require_cuda("KVCache.make", dev)
            fp8 = config.dtype if is_fp8(config.dtype) else None
            return CudaSlotEngine(config.max_seqs, dev, cp, fp8_dtype=fp8)
        return FastSlotEngine(config.max_seqs)
