"""Bug: a reservation that runs out of blocks keeps the rows that did fit."""

import numpy as np

from kvref import CapacityError, KVCache

from ._common import backend_like_kvref


class NonAtomicCache(KVCache):
    def reserve(self, slot_ids, n_new_per_seq):
        try:
            return super().reserve(slot_ids, n_new_per_seq)
        except CapacityError:
            for s, n in zip(np.asarray(slot_ids).tolist(), np.asarray(n_new_per_seq).tolist()):
                try:
                    super().reserve([s], [n])
                except CapacityError:
                    break
            raise

    def prepare_step(self, cu_seqlens_q, past_len, slot_ids):
        try:
            return super().prepare_step(cu_seqlens_q, past_len, slot_ids)
        except CapacityError:
            cu = np.asarray(cu_seqlens_q).tolist()
            for i, (p, s) in enumerate(zip(np.asarray(past_len).tolist(), np.asarray(slot_ids).tolist())):
                try:
                    super().prepare_step([0, cu[i + 1] - cu[i]], [p], [s])
                except CapacityError:
                    break
            raise


def factory():
    return backend_like_kvref("broken-non-atomic-reserve", cache_cls=NonAtomicCache)
