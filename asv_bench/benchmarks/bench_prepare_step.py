"""``KVCache.prepare_step``: index construction for decode and prefill steps, both packages."""

import numpy as np

from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec


class PrepareStep:
    """A step over ``rows`` slots that already hold 100 tokens (blocks reserved)."""

    params = [
        ["kvref", "kvfast"],              # package
        [KVCacheMode.PAGED, KVCacheMode.CONTIGUOUS],  # storage mode
        [(256, 1), (8, 1024)],            # (rows, tokens per row): decode / prefill
    ]
    param_names = ["package", "mode", "shape"]

    def setup(self, package, mode, shape):
        import importlib

        pkg = importlib.import_module(package)
        rows, q = shape
        cfg = KVCacheConfig(num_layers=1, max_seqs=rows, max_seq_len=2048, mode=mode, block_size=16)
        self.cache = pkg.KVCache.make(cfg, [KVLayerSpec.attention(8, 128)])
        self.slots = np.arange(rows, dtype=np.int32)
        if mode is KVCacheMode.PAGED:
            self.cache.reserve(self.slots, np.full(rows, 100))
            self.cache.reserve(self.slots, np.full(rows, q))  # blocks for the step already held
            for s in range(rows):
                self.cache.update_position(s, 100)
        else:
            for s in range(rows):
                self.cache.update_position(s, 100)
        self.cu = np.arange(rows + 1, dtype=np.int32) * q
        self.past = np.full(rows, 100, np.int32)
        self.cache.prepare_step(self.cu, self.past, self.slots)  # compile / load kernels

    def time_prepare_step(self, package, mode, shape):
        self.cache.prepare_step(self.cu, self.past, self.slots)
