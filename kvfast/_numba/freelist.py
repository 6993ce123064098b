"""The intrusive free list of :class:`kvfast._block_pool.BlockPool` as Numba kernels.

The list lives in two int32 arrays, ``prev`` and ``next``, of length
``num_blocks + 2``: ids ``0 .. num_blocks-1`` are blocks, ``HEAD =
num_blocks`` and ``TAIL = num_blocks + 1`` are sentinels, so no operation
has an edge case. A block is on the list iff its ref count is 0 (block 0,
the null block, never is). Every operation is O(1) per block.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = [
    "touch_many", "init_list", "pop_front_n", "pop_front_evict", "free_many", "walk", "unlink",
    "verify_run", "publish_rows", "warm",
]


@njit(nogil=True, cache=True)
def init_list(prev, next_, num_blocks):
    """Blocks ``1 .. num_blocks-1`` in ascending order; block 0 off the list."""
    head = num_blocks
    tail = num_blocks + 1
    last = head
    for b in range(1, num_blocks):
        next_[last] = b
        prev[b] = last
        last = b
    next_[last] = tail
    prev[tail] = last
    prev[head] = -1
    next_[tail] = -1
    prev[0] = -1
    next_[0] = -1


@njit(nogil=True, cache=True)
def unlink(prev, next_, b):
    """Take block ``b`` out of the list (a prefix hit revives a free block)."""
    p = prev[b]
    n = next_[b]
    next_[p] = n
    prev[n] = p
    prev[b] = -1
    next_[b] = -1


@njit(nogil=True, cache=True)
def pop_front_n(prev, next_, ref_count, head, n, out):
    """Pop ``n`` blocks from the front into ``out[:n]``, each with ref count 1.

    The caller checked that ``n`` blocks are free.
    """
    for i in range(n):
        b = next_[head]
        nn = next_[b]
        next_[head] = nn
        prev[nn] = head
        prev[b] = -1
        next_[b] = -1
        ref_count[b] = 1
        out[i] = b


@njit(nogil=True, cache=True)
def pop_front_evict(prev, next_, ref_count, published, head, n, out, evicted):
    """:func:`pop_front_n` that also clears ``published`` of every popped block that
    had it and writes those blocks, in pop order, to ``evicted``; returns their number.

    ``out`` and ``evicted`` are int32 ``[>= n]``; the caller checked that ``n``
    blocks are free.
    """
    k = 0
    for i in range(n):
        b = next_[head]
        nn = next_[b]
        next_[head] = nn
        prev[nn] = head
        prev[b] = -1
        next_[b] = -1
        ref_count[b] = 1
        out[i] = b
        if published[b]:
            published[b] = False
            evicted[k] = b
            k += 1
    return k


@njit(nogil=True, cache=True)
def free_many(prev, next_, ref_count, published, head, tail, blocks):
    """Drop one reference from each of ``blocks`` in order (block 0 skipped).

    A block reaching 0 goes to the front when unpublished, to the back when
    published. Returns ``(bad, freed)``: ``bad`` is -1, or the index of the
    first block whose ref count was already <= 0 (blocks before it were
    freed, like the reference); ``freed`` counts blocks that reached 0.
    """
    freed = 0
    for i in range(blocks.shape[0]):
        b = blocks[i]
        if b == 0:
            continue
        if ref_count[b] <= 0:
            return i, freed
        ref_count[b] -= 1
        if ref_count[b] == 0:
            freed += 1
            if published[b]:
                p = prev[tail]
                next_[p] = b
                prev[b] = p
                next_[b] = tail
                prev[tail] = b
            else:
                nn = next_[head]
                next_[head] = b
                prev[b] = head
                next_[b] = nn
                prev[nn] = b
    return -1, freed


@njit(nogil=True, cache=True)
def walk(next_, head, tail, out):
    """Write the list front to back into ``out``; returns its length."""
    k = 0
    b = next_[head]
    while b != tail:
        out[k] = b
        k += 1
        b = next_[b]
    return k


@njit(nogil=True, cache=True)
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


@njit(nogil=True, cache=True)
def verify_run(tok, tok_len, blocks, toks):
    """How many leading ``blocks[i]`` store exactly ``toks[i]`` (Spec §6 hit check).

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


@njit(nogil=True, cache=True)
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
    prev = np.empty(n + 2, np.int32)
    nxt = np.empty(n + 2, np.int32)
    rc = np.zeros(n, np.int32)
    pub = np.zeros(n, np.bool_)
    init_list(prev, nxt, n)
    out = np.zeros(n, np.int32)
    ev = np.zeros(n, np.int32)
    pop_front_evict(prev, nxt, rc, pub, n, 2, out, ev)  # blocks 1, 2
    pop_front_n(prev, nxt, rc, n, 1, out[2:])  # block 3
    blocks = np.array([1, 2, 3], np.int64)  # every block the pops handed out
    tok = np.zeros((n, 2), np.int32)
    tok_len = np.zeros(n, np.int32)
    toks = np.zeros((3, 2), np.int32)
    publish_rows(tok, tok_len, pub, blocks, toks)
    verify_run(tok, tok_len, blocks, toks)
    free_many(prev, nxt, rc, pub, n, n + 1, blocks)
    touch_many(prev, nxt, rc, blocks[:1])
    walk(nxt, n, n + 1, out)
    _warmed = True
