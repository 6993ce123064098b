"""Bug: the prompt's last token counts toward a prefix hit, so a prompt made
of whole published blocks is a 100% hit and nothing is left to compute.

Slot cache: ``admit`` with the default cap uses ``len(prompt)`` instead of
``len(prompt) - 1``. Manager: the hashed span is ``len(ctx)`` tokens instead
of ``len(ctx) - 1``.
"""

import numpy as np

from kvref import KVCache, PagedKVCacheManager
from kvspec import hashing

from ._common import backend_like_kvref


class LastTokenCache(KVCache):
    def admit(self, batch_idx, prompt_ids, addressable_len=-1, **retention):
        if isinstance(addressable_len, int) and addressable_len == -1:
            addressable_len = int(np.asarray(prompt_ids).shape[0]) if np.ndim(prompt_ids) == 1 else -1
        return super().admit(batch_idx, prompt_ids, addressable_len, **retention)


class LastTokenManager(PagedKVCacheManager):
    def _hashes_for(self, ctx, have):
        n = len(ctx) // self._page
        if len(have) >= n:
            return list(have[:n])
        parent = have[-1] if have else self._root(ctx.cache_salt)
        more = hashing.block_hashes(
            ctx.tokens[len(have) * self._page : n * self._page], self._page, self._params.hash_algo, parent=parent
        )
        return list(have) + list(more)


def factory():
    return backend_like_kvref("broken-last-token-hashed", cache_cls=LastTokenCache, manager_cls=LastTokenManager)
