"""Bug: a prefix hit trusts the hash and never compares the stored tokens.

Harmless while sha256 never collides; the suite forces collisions through the
backend's ``collide_hashes`` hook (kvref's) and then this backend serves
another prompt's K/V.
"""

from kvref import KVCache
from kvref._block_pool import BlockPool

from ._common import backend_like_kvref, swap_pools


class UnverifiedPool(BlockPool):
    def lookup(self, block_hash, tokens):
        return self.hash_to_block.get(block_hash)


class UnverifiedCache(KVCache):
    @classmethod
    def make(cls, config, layer_specs):
        cache = super().make(config, layer_specs)
        swap_pools(cache, UnverifiedPool)
        return cache


def factory():
    return backend_like_kvref("broken-unverified-prefix-hit", cache_cls=UnverifiedCache)
