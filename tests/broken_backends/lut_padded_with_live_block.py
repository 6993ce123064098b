"""Bug: the lookup table pads short rows with the row's first (live) block
instead of the null block 0, so a kernel that over-reads touches live K/V."""

import dataclasses

import numpy as np

from kvref import KVCacheInputs, PagedKVCacheManager

from ._common import backend_like_kvref


def _pad_live(per):
    lut = np.array(per.lookup_table)
    for row in lut:
        live = np.flatnonzero(row)
        if live.size and live[-1] + 1 < row.size:
            row[live[-1] + 1 :] = row[0]
    return dataclasses.replace(per, lookup_table=lut)


class LivePaddingManager(PagedKVCacheManager):
    def runtime_inputs(self, batches, *, max_cache_length=None):
        out = super().runtime_inputs(batches, max_cache_length=max_cache_length)
        fixed = []
        for per in out.inputs:
            fixed.append({k: _pad_live(v) for k, v in per.items()} if isinstance(per, dict) else _pad_live(per))
        return KVCacheInputs(tuple(fixed))


def factory():
    return backend_like_kvref("broken-lut-padded-with-live-block", manager_cls=LivePaddingManager)
