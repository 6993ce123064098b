"""Bugs on the manager's rare paths (issue 20, "the manager under collisions",
"rare but legal sequences"). Each factory is kvref's manager with one bug; the
suite must fail on every one:

* ``hit_skips_last_token``: a prefix hit compares each block's tokens except
  the last (only a hash collision exposes it: then another prompt's K/V is served).
* ``replacement_alloc_counts_twice``: ``alloc`` with a replacement context
  counts the forward's input tokens again.
* ``deferred_alloc_counts_twice``: a repeated ``alloc(defer_lookup=True)``
  counts the forward's input tokens again.
* ``chunk_cap_whole_pages``: the hit cap of a chunk is ``active // page``
  (not ``(active - 1) // page``): a chunk of whole cached pages leaves no active token.
* ``no_publish_after_chunk``: ``step`` after a non-final chunk publishes nothing.
* ``no_twin_dedup``: a block whose twin is published keeps its own page.
* ``decode_growth_late``: a decode step that needs one more page does not get it.
* ``revived_hits_counted_free``: the capacity check counts the hit pages
  revived from the free list as still free.
* ``capacity_off_by_one``: ``InsufficientBlocksError`` when the need equals the free count.
* ``hit_run_capped``: device hits stop after 15 blocks.
* ``decode_hashes_sha256``: a block hashed when a decode step fills it uses
  sha256 whatever ``hash_algo`` says.
"""

from __future__ import annotations

import numpy as np

from kvref import PagedKVCacheManager
from kvref._block_pool import BlockPool
from kvspec import CapacityError, InsufficientBlocksError, TextContext, hashing

from ._common import backend_like_kvref, swap_pools


def _backend(name: str, cls):
    return backend_like_kvref(f"broken-{name}", manager_cls=cls)


class _LastTokenUncheckedPool(BlockPool):
    def lookup(self, block_hash, tokens):
        block = self.hash_to_block.get(block_hash)
        if block is None:
            return None
        stored, toks = self.block_tokens[block], np.asarray(tokens, np.int32)
        if stored is None or not np.array_equal(stored[:-1], toks[:-1]):
            return None
        return block


class _HitSkipsLastToken(PagedKVCacheManager):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        swap_pools(self, _LastTokenUncheckedPool)


def hit_skips_last_token():
    return _backend("hit-skips-last-token", _HitSkipsLastToken)


class _ReplacementCountsTwice(PagedKVCacheManager):
    def alloc(self, ctx, *, defer_lookup=False):
        req = self._requests.get(getattr(ctx, "request_id", None))
        replaced = req is not None and req.ctx is not ctx
        out = super().alloc(ctx, defer_lookup=defer_lookup)
        if replaced:
            self._metrics.input_tokens += ctx.active_length
        return out


def replacement_alloc_counts_twice():
    return _backend("replacement-alloc-counts-twice", _ReplacementCountsTwice)


class _DeferredCountsTwice(PagedKVCacheManager):
    def alloc(self, ctx, *, defer_lookup=False):
        req = self._requests.get(getattr(ctx, "request_id", None))
        repeated = req is not None and any(req.rows.values())
        out = super().alloc(ctx, defer_lookup=defer_lookup)
        if defer_lookup is True and repeated:
            self._metrics.input_tokens += ctx.active_length
        return out


def deferred_alloc_counts_twice():
    return _backend("deferred-alloc-counts-twice", _DeferredCountsTwice)


class _ChunkCapWholePages(PagedKVCacheManager):
    def alloc(self, ctx, *, defer_lookup=False):
        req = self._requests.get(getattr(ctx, "request_id", None))
        at_reuse = (req is not None and isinstance(ctx, TextContext) and ctx.pending_length
                    and ctx.processed_length == 0 and not any(req.rows.values()))
        if not at_reuse:
            return super().alloc(ctx, defer_lookup=defer_lookup)
        ctx._active += 1  # the hit cap sees one active token more than there is
        try:
            return super().alloc(ctx, defer_lookup=defer_lookup)
        finally:
            ctx._active -= 1


def chunk_cap_whole_pages():
    return _backend("chunk-cap-whole-pages", _ChunkCapWholePages)


class _NoPublishAfterChunk(PagedKVCacheManager):
    def step(self, ctx):
        if ctx.active_length > 1 and self._caching:  # advance_chunk() left several active tokens
            self._caching = False
            try:
                return super().step(ctx)
            finally:
                self._caching = True
        return super().step(ctx)


def no_publish_after_chunk():
    return _backend("no-publish-after-chunk", _NoPublishAfterChunk)


class _NoDedupPool(BlockPool):
    def publish(self, block, block_hash, tokens):
        super().publish(block, block_hash, tokens)
        return block  # the twin is ignored: our page stays in the row


class _NoTwinDedup(PagedKVCacheManager):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        swap_pools(self, _NoDedupPool)


def no_twin_dedup():
    return _backend("no-twin-dedup", _NoTwinDedup)


class _DecodeGrowthLate(PagedKVCacheManager):
    def _required_blocks(self, ctx):
        need = super()._required_blocks(ctx)
        req = self._requests.get(ctx.request_id)
        held = len(req.rows.get(self._conn_leaf, ())) if req is not None else 0
        if held and need == held + 1 and ctx.active_length == 1:
            return held  # the decode step's new page is not drawn
        return need


def decode_growth_late():
    return _backend("decode-growth-late", _DecodeGrowthLate)


def _sizes(m, ctx):
    """(pages the next forward needs beyond what the request holds, free pages, at the reuse point)."""
    req = m._requests.get(ctx.request_id)
    held = len(m.get_req_blocks_per_leaf(ctx)["full"]) if req is not None else 0
    need = max(-(-ctx.current_position // m.params.page_size) - held, 0)
    reuse = req is not None and ctx.processed_length == 0 and held == 0
    return need, m.block_count(req.replica if req is not None else 0).free, reuse


class _RevivedHitsCountedFree(PagedKVCacheManager):
    """The capacity check counts the hit pages it revives from the free list as free:
    where the right answer is ``InsufficientBlocksError``, the allocation itself
    runs out (the pool's ``CapacityError``)."""

    def alloc(self, ctx, *, defer_lookup=False):
        need, free, reuse = _sizes(self, ctx) if isinstance(ctx, TextContext) and self.contains(ctx) else (0, 0, False)
        try:
            return super().alloc(ctx, defer_lookup=defer_lookup)
        except InsufficientBlocksError:
            hits = self.get_prefix_cache_hit_counts(ctx)[0].device_blocks if reuse else 0
            if reuse and hits and need - hits <= free:
                raise CapacityError(f"BlockPool.allocate: needs {need - hits} blocks, "
                                    f"{free - hits} free or evictable") from None
            raise


def revived_hits_counted_free():
    return _backend("revived-hits-counted-free", _RevivedHitsCountedFree)


class _CapacityOffByOne(PagedKVCacheManager):
    """``InsufficientBlocksError`` when a request needs exactly the free page count."""

    def alloc(self, ctx, *, defer_lookup=False):
        if isinstance(ctx, TextContext) and self.contains(ctx):
            need, free, reuse = _sizes(self, ctx)
            if reuse and self.get_prefix_cache_hit_counts(ctx)[0].device_blocks:
                need = 0  # (a hit changes the count: leave those to kvref)
            if need and need >= free:
                raise InsufficientBlocksError(
                    f"alloc: request_id={ctx.request_id!r} needs {need} blocks of leaf 'full', "
                    f"{free} free or evictable on replica 0")
        return super().alloc(ctx, defer_lookup=defer_lookup)


def capacity_off_by_one():
    return _backend("capacity-off-by-one", _CapacityOffByOne)


class _HitRunCapped(PagedKVCacheManager):
    def _device_hit(self, r, hashes, tokens, cap, *args, **kw):
        return super()._device_hit(r, hashes, tokens, min(cap, 15), *args, **kw)


def hit_run_capped():
    return _backend("hit-run-capped", _HitRunCapped)


class _DecodeHashesSha256(PagedKVCacheManager):
    def _hashes_for(self, ctx, have):
        n = (len(ctx) - 1) // self._page
        if have and n == len(have) + 1:  # one more block: a decode step filled it
            block = ctx.tokens[len(have) * self._page : n * self._page]
            return list(have) + [hashing.block_hash(have[-1], block, "sha256")]
        return super()._hashes_for(ctx, have)


def decode_hashes_sha256():
    return _backend("decode-hashes-sha256", _DecodeHashesSha256)
