"""The intrusive free list of :class:`kvfast._block_pool.BlockPool` as Numba kernels.

The list lives in two int32 arrays, ``prev`` and ``next``, of length
``num_blocks + NUM_LEVELS + 2``: ids ``0 .. num_blocks-1`` are blocks, the
rest sentinels, so no operation has an edge case. One chain holds every free
block (spec/manager.md §14.4)::

    HEAD -> unpublished .. -> S_0 -> level 0 .. -> S_1 -> .. -> S_100 -> level 100 .. -> TAIL

with ``HEAD = num_blocks``, ``S_p = num_blocks + 1 + p`` and ``TAIL =
num_blocks + 1 + NUM_LEVELS``; a published block freed at level ``p`` goes
just before ``S_{p+1}`` (``TAIL`` for 100), an unpublished one just after
``HEAD``. Popping takes ``next[HEAD]`` when it is a block, else the first
block of the lowest non-empty level, found from a lower bound ``lo`` (every
level below it is empty) that the pops move up and the frees move down.
A block is on the list iff its ref count is 0 (block 0, the null block,
never is). Every operation is O(1) per block (at most ``NUM_LEVELS`` hops to
find a level, amortised by ``lo``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import inner_kernel

__all__ = [
    "touch_many", "init_list", "pop_front_n", "pop_front_evict", "free_many", "walk", "walk_nodes", "unlink",
    "verify_run", "publish_rows", "set_retention", "NUM_LEVELS", "DEFAULT_LEVEL", "warm",
    "push_front_many", "unlink_many", "unpublished_run",
]

#: Retention levels (priorities 0 .. 100, spec/manager.md §14) and the level of a page without a claim.
NUM_LEVELS = 101
DEFAULT_LEVEL = 35


def list_size(num_blocks: int) -> int:
    """Length of ``prev`` / ``next`` for a pool of ``num_blocks``: blocks, HEAD, one sentinel per level, TAIL."""
    return num_blocks + NUM_LEVELS + 2


@njit(cache=True)
def init_list(prev, next_, num_blocks):
    """Blocks ``1 .. num_blocks-1`` in ascending order on the front, every level empty; block 0 off the list."""
    head = num_blocks
    tail = num_blocks + 1 + NUM_LEVELS
    last = head
    for b in range(1, num_blocks):
        next_[last] = b
        prev[b] = last
        last = b
    for s in range(num_blocks + 1, tail + 1):  # S_0 .. S_100, TAIL
        next_[last] = s
        prev[s] = last
        last = s
    prev[head] = -1
    next_[tail] = -1
    prev[0] = -1
    next_[0] = -1


@inner_kernel
def _front(next_, head, lo):
    """``(block, lo)``: the block a pop takes (the caller checked one is free) and the raised bound."""
    b = next_[head]
    if b < head:
        return b, lo
    while next_[head + 1 + lo] >= head:  # level lo is empty: its sentinel is followed by a sentinel
        lo += 1
    return next_[head + 1 + lo], lo


@inner_kernel
def insert_before(prev, next_, t, b):
    """Link ``b`` into the list just before node ``t`` (a block or a sentinel)."""
    p = prev[t]
    next_[p] = b
    prev[b] = p
    next_[b] = t
    prev[t] = b


@inner_kernel
def _append(prev, next_, head, level, b):
    """Put ``b`` at the back of ``level`` (just before the next level's sentinel, or TAIL)."""
    insert_before(prev, next_, head + 2 + level, b)


@inner_kernel
def _requeue(prev, next_, head, prio, expiry, b, lo, ttl, k):
    """Append free published ``b`` to the back of its level (the default one without a claim),
    lowering the bound ``lo``; a finite expiry is recorded in ``ttl[k]``. Returns ``(lo, k)``."""
    level = DEFAULT_LEVEL if prio[b] < 0 else prio[b]
    _append(prev, next_, head, level, b)
    if level < lo:
        lo = level
    if expiry[b] != np.inf:
        ttl[k] = b
        k += 1
    return lo, k


@inner_kernel
def _merge_claim(prio, expiry, b, priority, until, now):
    """Merge the claim ``(priority, until)`` into published ``b``'s (kvspec.retention.merge):
    no claim or an expired one takes the new claim; else the higher priority, at equal
    priority the later expiry."""
    p0 = prio[b]
    if p0 < 0 or expiry[b] <= now or priority > p0:
        prio[b] = priority
        expiry[b] = until
    elif priority == p0 and until > expiry[b]:
        expiry[b] = until


@inner_kernel
def _release(prev, next_, published, prio, expiry, head, b, lo, now, ttl, k):
    """Queue ``b``, whose ref count just reached 0: the front when unpublished, the back of its
    level when published (a claim expired by ``now`` is dropped first). Returns ``(lo, k)``."""
    if published[b]:
        if expiry[b] <= now:
            prio[b] = -1
            expiry[b] = np.inf
        return _requeue(prev, next_, head, prio, expiry, b, lo, ttl, k)
    insert_before(prev, next_, next_[head], b)  # the front: before the first node after HEAD
    return lo, k


@inner_kernel
def unlink(prev, next_, b):
    """Take block ``b`` out of the list (a prefix hit revives a free block)."""
    p = prev[b]
    n = next_[b]
    next_[p] = n
    prev[n] = p
    prev[b] = -1
    next_[b] = -1


@njit(cache=True)
def push_front_many(prev, next_, head, blocks):
    """Put ``blocks`` (off the list) at the front in the order given: ``blocks[0]`` is popped first
    (a slab leaf's pages of a huge block it claimed, spec/manager.md §13.2)."""
    nn = next_[head]
    for i in range(blocks.shape[0] - 1, -1, -1):
        b = blocks[i]
        prev[nn] = b
        next_[b] = nn
        nn = b
    next_[head] = nn
    prev[nn] = head


@njit(cache=True)
def unlink_many(prev, next_, blocks):
    """Take each of ``blocks`` (all on the list) out of it (a slab leaf's pages of a huge block
    another leaf claims, spec/manager.md §13.2)."""
    for i in range(blocks.shape[0]):
        unlink(prev, next_, blocks[i])


@njit(cache=True)
def unpublished_run(next_, published, head, tail, lo, n):
    """How many of the first ``n`` blocks a pop would take are unpublished before the first
    published one (sentinels skipped; an empty front starts at level ``lo``)."""
    b = next_[head]
    if b >= head:
        b = head + 1 + min(lo, NUM_LEVELS - 1)
    run = 0
    while run < n and b != tail:
        if b < head:
            if published[b]:
                break
            run += 1
        b = next_[b]
    return run


@njit(cache=True)
def pop_front_n(prev, next_, ref_count, head, lo, n, out):
    """Pop ``n`` blocks from the front into ``out[:n]``, each with ref count 1; returns the raised ``lo``.

    The caller checked that ``n`` blocks are free.
    """
    for i in range(n):
        b, lo = _front(next_, head, lo)
        p = prev[b]
        nn = next_[b]
        next_[p] = nn
        prev[nn] = p
        prev[b] = -1
        next_[b] = -1
        ref_count[b] = 1
        out[i] = b
    return lo


@njit(cache=True)
def pop_front_evict(prev, next_, ref_count, published, prio, expiry, head, lo, n, out, evicted):
    """:func:`pop_front_n` that also clears ``published`` (and the retention claim) of
    every popped block that had it and writes those blocks, in pop order, to
    ``evicted``; returns ``(their number, the raised lo)``.

    ``out`` and ``evicted`` are int32 ``[>= n]``; the caller checked that ``n``
    blocks are free.
    """
    k = 0
    for i in range(n):
        b, lo = _front(next_, head, lo)
        p = prev[b]
        nn = next_[b]
        next_[p] = nn
        prev[nn] = p
        prev[b] = -1
        next_[b] = -1
        ref_count[b] = 1
        out[i] = b
        if published[b]:
            published[b] = False
            prio[b] = -1
            expiry[b] = np.inf
            evicted[k] = b
            k += 1
    return k, lo


@njit(cache=True)
def free_many(prev, next_, ref_count, published, prio, expiry, head, lo, now, blocks, ttl):
    """Drop one reference from each of ``blocks`` in order (block 0 skipped).

    A block reaching 0 goes to the front when unpublished, to the back of its
    retention level when published (a claim with ``expiry <= now`` is dropped
    first: level 35). Returns ``(bad, freed, lo, k)``: ``bad`` is -1, or the
    index of the first block whose ref count was already <= 0 (blocks before
    it were freed, like the reference); ``freed`` counts blocks that reached
    0; ``lo`` the lowered bound; ``ttl[:k]`` the freed blocks whose claim has
    a finite expiry (for the caller's expiry heap), in order.
    """
    freed = 0
    k = 0
    for i in range(blocks.shape[0]):
        b = blocks[i]
        if b == 0:
            continue
        if ref_count[b] <= 0:
            return i, freed, lo, k
        ref_count[b] -= 1
        if ref_count[b] == 0:
            freed += 1
            lo, k = _release(prev, next_, published, prio, expiry, head, b, lo, now, ttl, k)
    return -1, freed, lo, k


@njit(cache=True)
def set_retention(prev, next_, ref_count, published, prio, expiry, head, lo, blocks, priority, until, now, ttl):
    """Merge the claim ``(priority, until)`` into each published block of ``blocks``
    (spec/manager.md §14.3; block 0 and unpublished blocks skipped); a free one
    moves to the back of its level. ``now`` decides whether an old claim expired.
    Returns ``(lo, k)``: the lowered bound and ``ttl[:k]``, the moved blocks with
    a finite expiry.
    """
    k = 0
    for i in range(blocks.shape[0]):
        b = blocks[i]
        if b == 0 or not published[b]:
            continue
        _merge_claim(prio, expiry, b, priority, until, now)
        if ref_count[b] == 0:
            pp = prev[b]
            nn = next_[b]
            if pp >= 0:  # on the list (a revoked block is off it)
                next_[pp] = nn
                prev[nn] = pp
                lo, k = _requeue(prev, next_, head, prio, expiry, b, lo, ttl, k)
    return lo, k


@njit(cache=True)
def retain_free(prev, next_, ref_count, published, prio, expiry, head, lo, now, blocks, priority, until, ttl):
    """:func:`set_retention` of ``(priority, until)`` then :func:`free_many`, block by block in one
    pass (a request's release, spec/manager.md §6 and §14.2). The same state as the two calls in
    sequence: a block's claim is merged while the request still references it, so the merge never
    moves it, and the free then queues it at its new level. Returns :func:`free_many`'s tuple, or
    ``(-2 - i, 0, lo, 0)`` with nothing changed when ``blocks[i]`` is the first id out of range."""
    for i in range(blocks.shape[0]):
        if blocks[i] < 0 or blocks[i] >= ref_count.shape[0]:
            return -2 - i, 0, lo, 0
    freed = 0
    k = 0
    for i in range(blocks.shape[0]):
        b = blocks[i]
        if b == 0:
            continue
        if ref_count[b] <= 0:
            return i, freed, lo, k
        if published[b]:
            _merge_claim(prio, expiry, b, priority, until, now)
        ref_count[b] -= 1
        if ref_count[b] == 0:
            freed += 1
            lo, k = _release(prev, next_, published, prio, expiry, head, b, lo, now, ttl, k)
    return -1, freed, lo, k


@njit(cache=True)
def walk(next_, head, tail, out):
    """Write the list's blocks front to back into ``out`` (sentinels skipped); returns their number."""
    k = 0
    b = next_[head]
    while b != tail:
        if b < head:
            out[k] = b
            k += 1
        b = next_[b]
    return k


@njit(cache=True)
def walk_nodes(next_, head, tail, out):
    """Write every node from ``head`` to ``tail`` (sentinels included) into ``out``; returns their number
    (stops at ``out``'s length: a broken chain cannot loop forever)."""
    k = 0
    b = head
    while k < out.shape[0]:
        out[k] = b
        k += 1
        if b == tail:
            break
        b = next_[b]
    return k


@njit(cache=True)
def touch_many(prev, next_, ref_count, blocks):
    """One more reference on each of ``blocks``; free ones leave the list.

    Returns how many were on the free list (revived).
    """
    revived = 0
    for i in range(blocks.shape[0]):
        b = blocks[i]
        if ref_count[b] == 0:
            p = prev[b]
            n = next_[b]
            next_[p] = n
            prev[n] = p
            prev[b] = -1
            next_[b] = -1
            revived += 1
        ref_count[b] += 1
    return revived


@njit(cache=True)
def verify_run(tok, tok_len, blocks, toks):
    """How many leading ``blocks[i]`` store exactly ``toks[i]`` (spec/hashing.md §4 hit check).

    ``tok`` int32 [num_blocks, W] and ``tok_len`` int32 [num_blocks] are the
    pool's token table; ``toks`` is int32 [len(blocks), w] with ``w <= W``.
    """
    w = toks.shape[1]
    for i in range(blocks.shape[0]):
        b = blocks[i]
        if tok_len[b] != w:
            return i
        for j in range(w):
            if tok[b, j] != toks[i, j]:
                return i
    return blocks.shape[0]


@njit(cache=True)
def publish_rows(tok, tok_len, published, blocks, toks):
    """Store ``toks[i]`` as the tokens of ``blocks[i]`` and mark it published.

    All or nothing: if some block is already published (before the call, or
    earlier in ``blocks``), the marks set by this call are undone and False is
    returned (token rows of unpublished blocks are don't-care). The caller
    widened ``tok`` to at least ``toks.shape[1]`` columns.
    """
    w = toks.shape[1]
    for i in range(blocks.shape[0]):
        b = blocks[i]
        if published[b]:
            for j in range(i):
                published[blocks[j]] = False
            return False
        for j in range(w):
            tok[b, j] = toks[i, j]
        tok_len[b] = w
        published[b] = True
    return True


_warmed = False


def warm() -> None:
    """Compile (or load from the disk cache) every kernel of this module once per process.

    Called when the first pool is built, so a server's first request does
    not pay the load (tens of milliseconds) inside its admission.
    """
    global _warmed
    if _warmed:
        return
    n = 4
    prev = np.empty(list_size(n), np.int32)
    nxt = np.empty(list_size(n), np.int32)
    rc = np.zeros(n, np.int32)
    pub = np.zeros(n, np.bool_)
    prio = np.full(n, -1, np.int8)
    exp = np.full(n, np.inf, np.float64)
    init_list(prev, nxt, n)
    out = np.zeros(n, np.int32)
    ev = np.zeros(n, np.int32)
    pop_front_evict(prev, nxt, rc, pub, prio, exp, n, NUM_LEVELS, 2, out, ev)  # blocks 1, 2
    pop_front_n(prev, nxt, rc, n, NUM_LEVELS, 1, out[2:])  # block 3
    blocks = np.array([1, 2, 3], np.int64)  # every block the pops handed out
    tok = np.zeros((n, 2), np.int32)
    tok_len = np.zeros(n, np.int32)
    toks = np.zeros((3, 2), np.int32)
    publish_rows(tok, tok_len, pub, blocks, toks)
    verify_run(tok, tok_len, blocks, toks)
    ttl = np.zeros(3, np.int32)
    set_retention(prev, nxt, rc, pub, prio, exp, n, NUM_LEVELS, blocks, 50, 1.0, 0.0, ttl)
    free_many(prev, nxt, rc, pub, prio, exp, n, NUM_LEVELS, 0.0, blocks, ttl)
    touch_many(prev, nxt, rc, blocks[:1])
    unpublished_run(nxt, pub, n, list_size(n) - 1, NUM_LEVELS, 2)
    unlink_many(prev, nxt, blocks[1:2])  # block 2 is free after free_many
    push_front_many(prev, nxt, n, blocks[1:2])
    walk(nxt, n, list_size(n) - 1, out)
    walk_nodes(nxt, n, list_size(n) - 1, np.zeros(list_size(n), np.int32))
    _warmed = True
