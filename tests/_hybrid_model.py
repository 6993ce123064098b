"""A deterministic "model" over every leaf kind, for the hybrid tier and replica tests.

Full and sliding-window leaves get K/V that depend on the token, its position
and the leaf (``leaf_kv``); a recurrent leaf's live state after ``n`` tokens
is a function of those ``n`` tokens (``state_after``). ``forward`` writes what
one forward writes into every leaf through the request's rows, so a page or
a state that came from a tier or a peer replica can be compared byte for
byte with what the model would have written.
"""

from __future__ import annotations

import numpy as np

from _fault_connector import kv_values, next_token
from kvspec import InsufficientBlocksError, LeafKind, LeafSpec, TextContext

#: Leaf configurations the hybrid tests run over (each with the default full leaf "full").
HYBRIDS = {
    "full+sliding": {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(5)},
    # 140 state bytes: three 64-byte units of the full leaf's page (the last one padded)
    "full+recurrent": {"full": LeafSpec.full(), "rec": LeafSpec.recurrent((7, 5))},
}


def leaf_kv(leaf_index: int, tokens, positions, page_shape, dtype) -> np.ndarray:
    """``kv_values`` of leaf ``leaf_index`` (the full leaf "full" is index 0: plain ``kv_values``)."""
    return kv_values(np.asarray(tokens, np.int64) + 389 * leaf_index, positions, page_shape, dtype)


def state_after(tokens, n: int, shape, dtype) -> np.ndarray:
    """The recurrent state after the first ``n`` tokens."""
    s = int(np.sum(np.asarray(tokens[:n], dtype=np.int64))) % 997
    return (np.arange(int(np.prod(shape))).reshape(shape) % 7 + s + n % 13).astype(dtype)


def write_leaves(m, ctx: TextContext, replica: int = 0) -> None:
    """What one forward writes: every full/sliding leaf's K/V of the active tokens through the
    request's rows, the recurrent live state after ``current_position`` tokens."""
    bufs = m.get_device_buffer(replica)
    rows = m.get_req_blocks_per_leaf(ctx)
    lo, hi = ctx.processed_length, ctx.current_position
    page = m.params.page_size
    for i, (lid, spec) in enumerate(m.params.leaves().items()):
        buf = bufs[lid] if isinstance(bufs, dict) else bufs
        if spec.kind is LeafKind.RECURRENT:
            buf[rows[lid][0]] = state_after(ctx.tokens, hi, buf.shape[1:], buf.dtype)
            continue
        pos = np.arange(lo, hi)
        vals = leaf_kv(i, ctx.tokens[lo:hi], pos, buf.shape[1:], buf.dtype)
        for j, q in enumerate(pos):
            buf[rows[lid][q // page], :, :, q % page] = vals[j]


def forward(m, ctx: TextContext, replica: int = 0, *, chunk: bool = False) -> None:
    """One forward of ``ctx`` on ``replica``: ``write_leaves``, ``runtime_inputs``, then
    ``advance_chunk`` (``chunk=True``) or ``update`` with the next token, then ``step``."""
    write_leaves(m, ctx, replica)
    batches = [[] for _ in range(m.params.data_parallel_degree)]
    batches[replica] = [ctx]
    m.runtime_inputs(batches)
    if chunk:
        ctx.advance_chunk()
    else:
        ctx.update(next_token(ctx.tokens))
    m.step(ctx)


def serve(m, ctx: TextContext, replica: int = 0, *, release: bool = True):
    """Claim, then prefill in page-aligned chunks (so recurrent checkpoints publish at every
    page boundary the prompt reaches), one sampled token, release. Returns the first alloc's handle."""
    m.claim(ctx, replica)
    page = m.params.page_size
    first = None
    while True:
        aligned = (ctx.active_length - 1) // page * page
        chunked = 0 < aligned < ctx.active_length
        if chunked:
            ctx.chunk(aligned)
        t = m.alloc(ctx)
        first = t if first is None else first
        t.synchronize()
        m.poll_transfers()
        forward(m, ctx, replica, chunk=chunked)
        if not chunked:
            break
    if release:
        m.release(ctx)
    return first


def check_hit_bytes(m, ctx: TextContext, replica: int = 0) -> None:
    """Every page of ``ctx``'s hit that a leaf holds equals what the model wrote: full pages
    of every hit block, sliding pages of the window, the recurrent live state at the hit."""
    bufs = m.get_device_buffer(replica)
    rows = m.get_req_blocks_per_leaf(ctx)
    page = m.params.page_size
    k = ctx.processed_length // page
    for i, (lid, spec) in enumerate(m.params.leaves().items()):
        buf = bufs[lid] if isinstance(bufs, dict) else bufs
        if spec.kind is LeafKind.RECURRENT:
            want = state_after(ctx.tokens, ctx.processed_length, buf.shape[1:], buf.dtype)
            assert np.array_equal(buf[rows[lid][0]], want), f"leaf {lid!r}: live state differs at {k} blocks"
            continue
        lo = max(0, k - -(-(spec.window - 1) // page)) if spec.kind is LeafKind.SLIDING_WINDOW else 0
        for b in range(lo, k):
            want = leaf_kv(i, ctx.tokens[b * page : (b + 1) * page], np.arange(b * page, (b + 1) * page),
                           buf.shape[1:], buf.dtype)
            got = buf[rows[lid][b]].transpose(2, 0, 1, 3, 4)
            assert np.array_equal(got, want), f"leaf {lid!r} block {b} (page {rows[lid][b]}) holds wrong K/V"


def flush(m, replica: int = 0) -> None:
    """Evict the replica's unreferenced pages: one-page filler requests (nothing hashed, so no tier
    is asked) until a leaf runs out, then give them back unpublished."""
    page = m.params.page_size
    fillers = []
    try:
        while True:
            c = TextContext(f"__flush{len(fillers)}", np.full(page, 10**6 + len(fillers), dtype=np.int32))
            m.claim(c, replica)
            try:
                m.alloc(c)
            except InsufficientBlocksError:
                m.release(c)
                break
            fillers.append(c)
    finally:
        for c in fillers:
            m.release(c)


def register_prefixes(prefixes: dict, tokens, page: int, hash_algo: str = "sha256") -> None:
    """Remember, for each hashed block of ``tokens``, the tokens up to its end (``h_i -> prefix``)."""
    from kvspec.hashing import block_hashes

    tokens = np.asarray(tokens, dtype=np.int32)
    for i, h in enumerate(block_hashes(tokens, page, hash_algo)):
        prefixes[h] = tokens[: (i + 1) * page].copy()


def published_ok(m, prefixes: dict, replica: int = 0) -> None:
    """Every published page of every leaf holds what the model wrote: a full/sliding page the
    K/V of its block, a recurrent checkpoint the state after its block (``prefixes`` from
    ``register_prefixes``)."""
    bufs = m.get_device_buffer(replica)
    page = m.params.page_size
    for li, (lid, spec) in enumerate(m.params.leaves().items()):
        pool = m._pools[replica][lid]
        buf = bufs[lid] if isinstance(bufs, dict) else bufs
        for b, h in enumerate(pool.block_hash):
            if h is None:
                continue
            assert h in prefixes, f"leaf {lid!r} page {b} published under a hash no request produced"
            toks = prefixes[h]
            i = len(toks) // page - 1
            if spec.kind is LeafKind.RECURRENT:
                want = state_after(toks, len(toks), buf.shape[1:], buf.dtype)
                assert np.array_equal(buf[b], want), f"leaf {lid!r} checkpoint page {b} (block {i}) is wrong"
                continue
            want = leaf_kv(li, toks[i * page :], np.arange(i * page, (i + 1) * page), buf.shape[1:], buf.dtype)
            got = buf[b].transpose(2, 0, 1, 3, 4)
            assert np.array_equal(got, want), f"leaf {lid!r} page {b} (block {i}) holds wrong K/V"
