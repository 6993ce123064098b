"""Adapters of the peer bookkeeping workload (``../shared/peers/WORKLOAD.md``) for
``kvfast.PagedKVCacheManager`` (and, for the kvfast/kvref replay ratio,
``kvref.PagedKVCacheManager``).

Run side by side with vLLM's own ``KVCacheManager`` (same process, interleaved)::

    .peer-venv/bin/python ../shared/peers/vllm_bookkeeping.py --other benchmarks/kvfast_adapter.py:KvfastAdapter
    python ../shared/peers/vllm_bookkeeping.py --only-other --other benchmarks/kvfast_adapter.py:KvfastAdapter

The adapter drives the manager's public API the way a scheduler does, one
request = one ``TextContext``:

* ``admit``: ``claim`` + ``alloc`` (prefix lookup with verified hits, all
  prompt pages drawn), then the prefill is marked computed up to its last
  token (``skip_processing``) and ``step`` publishes the prompt's full
  blocks, so a later request of the same wave hits them (as vLLM registers
  them at admission); the hit is ``ctx.cached_prefix_length``;
* ``append_token``: ``ctx.update(token)`` + ``step`` (publishes a block when
  it fills);
* ``decode_alloc``: ``alloc`` (a page when the newest token starts one);
* ``free``: ``release`` (tail first).

``decode_alloc`` and ``free`` are the manager's bound ``alloc`` and
``release`` themselves (set per instance), so those phases time the manager,
not an adapter frame around it.

Hashing happens inside ``alloc`` (sha256 over each block's int32 token
bytes, chained; DESIGN §6), so ``hash_prompt`` returns 0 and the figure to
compare is "admission incl. hashing" and the whole lifecycle.
"""

from __future__ import annotations

import numpy as np

from kvspec import KVCacheParams, TextContext

__all__ = ["KvfastAdapter", "KvfastXxh3Adapter", "KvrefAdapter", "ManagerAdapter"]


class ManagerAdapter:
    """Workload adapter over any ``PagedKVCacheManager`` class (``manager_cls``)."""

    name = "manager"
    manager_cls = None
    hash_algo = "sha256"

    def __init__(self, block_size: int, num_blocks: int):
        params = KVCacheParams(page_size=block_size, num_layers=1, kv_heads=1, head_dim=1, hash_algo=self.hash_algo)
        # +1: the manager's block 0 is the null page, as vLLM's num_blocks=8193.
        # max_seq_len: at most what the pool holds (spec/manager.md §1.6 refuses more)
        self.m = self.manager_cls(params, num_blocks=num_blocks + 1, max_batch_size=64,
                                  max_seq_len=min(1 << 16, num_blocks * block_size))
        # The one-call phases go straight to the manager's bound methods (no adapter frame).
        self.decode_alloc = self.m.alloc
        self.free = self.m.release
        self._step = self.m.step

    def new_request(self, rid: int, prompt, max_new_tokens: int) -> TextContext:
        return TextContext(str(rid), np.asarray(prompt, dtype=np.int64))

    def hash_prompt(self, ctx: TextContext) -> int:
        return 0  # hashing happens in alloc

    def admit(self, ctx: TextContext) -> int:
        m = self.m
        m.claim(ctx)
        m.alloc(ctx)
        ctx.skip_processing(ctx.active_length - 1)
        m.step(ctx)
        return ctx.cached_prefix_length

    def append_token(self, ctx: TextContext, token: int) -> None:
        ctx.update(token)
        self._step(ctx)

    def decode_alloc(self, ctx: TextContext) -> None:  # replaced per instance by ``m.alloc``
        self.m.alloc(ctx)

    def free(self, ctx: TextContext) -> None:  # replaced per instance by ``m.release``
        self.m.release(ctx)

    def num_free_blocks(self) -> int:
        return self.m.block_count().free

    def tokens_hashed(self, ctx: TextContext) -> int:
        return (len(ctx) - 1) // self.m.params.page_size * self.m.params.page_size


class KvfastAdapter(ManagerAdapter):
    """``kvfast.PagedKVCacheManager`` on the peer workload."""

    name = "kvfast"

    def __init__(self, block_size: int, num_blocks: int):
        from kvfast import PagedKVCacheManager

        self.manager_cls = PagedKVCacheManager
        super().__init__(block_size, num_blocks)


class KvfastXxh3Adapter(KvfastAdapter):
    """``kvfast.PagedKVCacheManager`` with ``hash_algo="xxh3_128"`` (a cheaper hash than
    vLLM's sha256: WORKLOAD.md §6 asks to report it next to the figures)."""

    name = "kvfast-xxh3"
    hash_algo = "xxh3_128"


class KvrefAdapter(ManagerAdapter):
    """``kvref.PagedKVCacheManager`` on the peer workload (for the replay ratio)."""

    name = "kvref"

    def __init__(self, block_size: int, num_blocks: int):
        from kvref import PagedKVCacheManager

        self.manager_cls = PagedKVCacheManager
        super().__init__(block_size, num_blocks)
