"""Bug: a released slot frees its blocks head first, so a chain's head is
evicted before its tail (DESIGN §4.2 says tail first)."""

from kvref import KVCache, PagedKVCacheManager
from kvref._block_pool import BlockPool

from ._common import backend_like_kvref, swap_pools


class HeadFirstPool(BlockPool):
    def free(self, blocks):
        super().free(list(blocks)[::-1])


class HeadFirstCache(KVCache):
    @classmethod
    def make(cls, config, layer_specs):
        cache = super().make(config, layer_specs)
        swap_pools(cache, HeadFirstPool)
        return cache


class HeadFirstManager(PagedKVCacheManager):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        swap_pools(self, HeadFirstPool)


def factory():
    return backend_like_kvref("broken-head-first-eviction", cache_cls=HeadFirstCache, manager_cls=HeadFirstManager)
