"""Bug: ``evict_batch`` leaves the slot's conv and recurrent state in place."""

from kvref import KVCache, LayerKind

from ._common import backend_like_kvref


class StaleStateCache(KVCache):
    def evict_batch(self, batch_idx):
        saved = []
        if isinstance(batch_idx, int) and 0 <= batch_idx < self.config.max_seqs:
            for l, spec in enumerate(self.layer_specs):
                if spec.kind is LayerKind.STATE:
                    for i in range(len(spec.conv_dims)):
                        saved.append((self.conv_state(l, i), self.conv_state(l, i)[batch_idx].copy()))
                    if spec.recurrent is not None:
                        saved.append((self.recurrent_state(l), self.recurrent_state(l)[batch_idx].copy()))
        super().evict_batch(batch_idx)
        for view, row in saved:
            view[batch_idx] = row


def factory():
    return backend_like_kvref("broken-no-state-zeroing", cache_cls=StaleStateCache)
