"""The prefix hit of an admission (spec/manager.md §3, §4.5, §7.3).

The hash chain of a context (its salted root, spec/manager.md §3.1), where each of its blocks is
resident in every leaf, the joint device hit of the leaves (spec/manager.md §3.2, §4.5) and the part
of the hit a peer replica holds (spec/manager.md §7.3): the methods of ``PagedKVCacheManager``
(``kvref/_manager.py``) that decide how much of a prompt is reused.
"""

from __future__ import annotations

import numpy as np

from kvspec import hashing
from kvspec._manager_types import TextContext

from ._leaves import ExtendedResidency, Leaf, Residency, joint_hit
from ._request import _AllocPlan

__all__ = ["PrefixHits"]

#: Salted roots kept per manager, least recently used dropped first (spec/manager.md §3.1).
ROOT_CACHE_SIZE = 64


class PrefixHits:
    """The prefix-hit half of the policy, mixed into ``PagedKVCacheManager`` (its state)."""

    def _root(self, salt) -> bytes:
        """The chain root of ``salt``; at most ``ROOT_CACHE_SIZE`` roots are kept (LRU)."""
        key = hashing.salt_bytes(salt)
        cache = self._salted_roots
        root = cache.get(key)
        if root is None:
            root = hashing.root_hash(self._params.hash_seed, salt)
            cache[key] = root
            if len(cache) > ROOT_CACHE_SIZE:
                cache.popitem(last=False)
        else:
            cache.move_to_end(key)
        return root

    def _block_tokens(self, tokens: np.ndarray, i: int) -> np.ndarray:
        return tokens[i * self._page : (i + 1) * self._page]

    def _hashes_for(self, ctx: TextContext, have: list[bytes]) -> list[bytes]:
        """Chained hashes of ctx's full blocks, never covering the last token (spec/manager.md §3.1)."""
        n = (len(ctx) - 1) // self._page
        if len(have) >= n:
            return have if len(have) == n else have[:n]
        parent = have[-1] if have else self._root(ctx.cache_salt)
        # (ctx._tokens: the context's token buffer; the blocks hashed lie below len(ctx), as in ctx.tokens)
        more = self._engine.chain_hashes(parent, ctx._tokens[len(have) * self._page : n * self._page], self._page,
                                         self._params.hash_algo)
        return list(have) + more

    def _resident(self, r: int, hashes: list[bytes], tokens: np.ndarray) -> dict[str, Residency]:
        """``{leaf_id: Residency}`` of the chain over replica r's pools (spec/manager.md §3.2)."""
        return {leaf.leaf_id: Residency(self._pools[r][leaf.leaf_id], hashes, tokens, self._page)
                for leaf in self._leaves}

    def _peer_source(self, r: int, h: bytes, toks: np.ndarray, lid: str | None = None) -> tuple[int, int] | None:
        """A peer replica's published page of leaf ``lid`` (the connector leaf by default) for ``h``
        (source rotated by hash and destination)."""
        start = int.from_bytes(h[:8], "little") + r
        lid = self._conn_leaf if lid is None else lid
        for j in range(self._dp):
            src = (start + j) % self._dp
            if src == r:
                continue
            page = self._pools[src][lid].lookup(h, toks)
            if page is not None:
                return src, page
        return None

    def _device_hit(self, r: int, hashes: list[bytes], tokens: np.ndarray, cap: int,
                    resident: dict[str, Residency] | None = None, leaves: list[Leaf] | None = None) -> tuple[int, int]:
        """(local hit, peer-extendable hit) in blocks, both ``<= cap``; the joint rule over ``leaves``
        (default every leaf; a subset: spec/manager.md §3.6)."""
        leaves = self._leaves if leaves is None else leaves
        local = joint_hit(leaves, cap, resident or self._resident(r, hashes, tokens))
        reach = local
        if self._simple and self._dp > 1:
            # spec/manager.md §7.3: past the local run, each block is local (after a hole) or peer-held.
            pool = self._pools[r][self._conn_leaf]
            while reach < cap:
                h, toks = hashes[reach], self._block_tokens(tokens, reach)
                if pool.lookup(h, toks) is None and self._peer_source(r, h, toks) is None:
                    break
                reach += 1
        elif self._dp > 1:
            # spec/manager.md §7.3 with several leaves: the joint hit over local and peer residency.
            resident = resident or self._resident(r, hashes, tokens)

            def asker(lid: str):
                return lambda i: resident[lid](i) or self._peer_source(
                    r, hashes[i], self._block_tokens(tokens, i), lid) is not None

            reach = max(local, joint_hit(leaves, cap, {
                leaf.leaf_id: ExtendedResidency(0, asker(leaf.leaf_id)) for leaf in leaves}))
        return local, reach

    def _fits(self, r: int, demand: dict[str, int], taken: dict[str, set[int]]) -> bool:
        """Whether replica ``r`` can draw ``demand[leaf]`` pages after the pages in ``taken`` are referenced."""
        if self._slabs:
            return self._slabs[r].shortfall(demand, taken) is None
        pools = self._pools[r]
        return all(n <= pools[lid].num_free - pools[lid].count_free(list(taken.get(lid, ())))
                   for lid, n in demand.items())

    def _plan_peer_leaves(self, ctx, r, plan, touched, resident, hashes, tokens, local: int, reach: int) -> int:
        """spec/manager.md §7.3 with several leaves: every block a leaf needs for the hit ``reach`` is
        taken locally when held, else copied from a peer into a page the sizing draws (full/sliding:
        published locally; recurrent: the peer's checkpoint into the new live page). All or nothing:
        when the copies and the growth do not fit, the local hit ``local`` stands. Returns the hit."""
        staged, taken = _AllocPlan(), {}  # the peer part, staged: it joins plan only when it fits
        for leaf in self._leaves:
            lid = leaf.leaf_id
            taken[lid] = set()
            got = []
            for i in leaf.needed_blocks(0, reach):
                b = resident[lid].page(i)
                if b is None:
                    src = self._peer_source(r, hashes[i], self._block_tokens(tokens, i), lid)
                    if src is None:  # the residency said local or peer: nothing else can answer
                        return local
                    staged.leaf_peer[(lid, i)] = src
                else:
                    taken[lid].add(b)
                got.append(b)
            leaf.plan_hit(staged, reach, got)
        required = self._required_blocks(ctx)
        # spec/manager.md §4.6 on the staged rows: a slot a peer copy fills (None) is drawn by the sizing;
        # a leaf without a staged row (a recurrent state) holds nothing yet
        held = {lid: len(row) - row.count(None) for lid, row in staged.rows.items()}
        demand = {leaf.leaf_id: max(leaf.grow_need(held.get(leaf.leaf_id, 0), required, self._caching), 0)
                  for leaf in self._leaves}
        if not self._fits(r, demand, taken):
            return local  # best effort: the copies need free pages
        plan.rows.update(staged.rows)
        plan.nulled.update(staged.nulled)
        plan.restore, plan.leaf_peer, plan.restore_peer = staged.restore, staged.leaf_peer, staged.restore_peer
        touched.clear()
        touched.update(taken)
        return reach
