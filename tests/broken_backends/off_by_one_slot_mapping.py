"""Bug: the last token of every step is written one storage row too far."""

import dataclasses

from kvref import KVCache

from ._common import backend_like_kvref


class OffByOneCache(KVCache):
    def prepare_step(self, cu_seqlens_q, past_len, slot_ids):
        step = super().prepare_step(cu_seqlens_q, past_len, slot_ids)
        sm = step.slot_mapping.copy()
        sm[-1] += 1
        return dataclasses.replace(step, slot_mapping=sm)


def factory():
    return backend_like_kvref("broken-off-by-one-slot-mapping", cache_cls=OffByOneCache)
