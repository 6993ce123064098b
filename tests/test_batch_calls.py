"""The batch calls beyond the conformance suite (spec/manager.md §17): random batches
against the loop of single calls on both packages (refusals included), a guarded batch
with a host tier whose loads were posted before the failure, a replacement context, a
duplicate, and the clock read once per batch.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import kvfast
import kvref
from kvspec import InsufficientBlocksError, KVCacheParams, LeafSpec, TextContext

PKGS = [pytest.param(kvref, id="kvref"), pytest.param(kvfast, id="kvfast")]
PAGE = 4
LEAVES = {
    "full": None,
    "full+sliding": {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(8)},
    "full+recurrent": {"full": LeafSpec.full(), "rec": LeafSpec.recurrent((4, 8))},
}


def _manager(pkg, leaves=None, num_blocks=40, dp=1, host=0, **kw):
    params = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=2, dtype="float32", leaves=leaves,
                           data_parallel_degree=dp, host_offload_bytes=host)
    return pkg.PagedKVCacheManager(params, num_blocks=num_blocks, max_batch_size=16, max_seq_len=40, **kw)


def _state(m, ctxs, connector_metrics=True):
    """Everything observable, private bookkeeping and page bytes included (``connector_metrics``:
    the aggregated metrics, else the manager's own)."""
    pools = [{lid: repr(p.snapshot()) for lid, p in pools.items()} for pools in m._pools]
    rows = {rid: (q.replica, {k: list(v) for k, v in q.rows.items()}, q.committed, len(q.hashes), q.ctx.request_id)
            for rid, q in m._requests.items()}
    bufs = [{lid: hashlib.sha256(np.ascontiguousarray(b).tobytes()).hexdigest() for lid, b in d.items()}
            for d in m._buffers]
    cs = [(c.request_id, c.processed_length, c.active_length, len(c), c.cached_prefix_length,
           c.cached_prefix_external_length) for c in ctxs]
    metrics = m.get_metrics_aggregated() if connector_metrics else m._metrics
    return repr((pools, rows, metrics, bufs, cs, len(m._loads), len(m._offloads)))


def _fill(m, leaves):
    """Write a recognisable pattern into every page so a byte changed is a byte seen."""
    for d in m._buffers:
        for lid, b in d.items():
            b[...] = (np.arange(b.size, dtype=np.float64).reshape(b.shape) % 251).astype(b.dtype)


def _random_run(pkg, leaves, seed):
    """A seeded scheduler on the batch calls: each step admits a few requests (shared
    prefixes), decodes every running one, releases some; a refused ``alloc_many`` (which
    changed nothing) preempts the newest request and retries. Returns every observation."""
    rng = np.random.default_rng(seed)
    m = _manager(pkg, leaves, num_blocks=30)
    _fill(m, leaves)
    prefixes = [list(range(1000 * p, 1000 * p + 8)) for p in range(3)]
    running, seen, n = [], [], 0
    for step in range(24):
        for _ in range(int(rng.integers(0, 3))):
            p = prefixes[int(rng.integers(0, 3))] + [int(x) for x in rng.integers(0, 50, int(rng.integers(1, 9)))]
            ctx = TextContext(f"q{n}", np.asarray(p, np.int32))
            n += 1
            m.claim(ctx)
            running.append(ctx)
        while running:
            before = _state(m, running)
            try:
                m.alloc_many(running)
                break
            except InsufficientBlocksError as e:
                assert _state(m, running) == before
                seen.append(("refused", str(e)))
                m.release(running.pop())
        tokens = [int(x) for x in rng.integers(0, 50, len(running))]
        TextContext.update_many(running, np.asarray(tokens))
        m.step_many(running)
        done = [c for c in running if len(c) >= 30 or rng.random() < 0.15]
        m.release_many(done)
        running = [c for c in running if c not in done]
        m.check_invariants()
        seen.append((step, [(c.request_id, c.cached_prefix_length, len(c)) for c in running],
                     repr(m.block_count(0)), m.get_metrics_aggregated().cache_tokens))
    return seen


@pytest.mark.parametrize("leaves", list(LEAVES))
@pytest.mark.parametrize("seed", range(4))
def test_random_batches_agree_across_packages(leaves, seed):
    """kvfast's batch calls observe what kvref's do, refusals (and their messages) included."""
    want = _random_run(kvref, LEAVES[leaves], seed)
    got = _random_run(kvfast, LEAVES[leaves], seed)
    assert got == want
    assert any(x[0] == "refused" for x in want) or seed, "seed 0 runs out of pages at least once"
    if leaves != "full+recurrent":  # (a recurrent hit needs a checkpoint at the shared boundary)
        assert any(x[3] for x in want if x[0] != "refused"), "some request hit a prefix"


@pytest.mark.parametrize("pkg", PKGS)
@pytest.mark.parametrize("leaves", list(LEAVES))
def test_a_refused_batch_leaves_bookkeeping_and_bytes_as_before(pkg, leaves):
    m = _manager(pkg, LEAVES[leaves], num_blocks=40 if leaves == "full+sliding" else 24)
    _fill(m, LEAVES[leaves])
    ctxs = [TextContext(f"r{i}", np.arange(100 * i, 100 * i + 9, dtype=np.int32)) for i in range(4)]
    for c in ctxs:
        m.claim(c)
    m.alloc_many(ctxs)
    TextContext.update_many(ctxs, [1, 2, 3, 4])
    m.step_many(ctxs)
    m.release(ctxs.pop())  # published pages on the free list: the next draws evict them
    fresh = [TextContext(f"f{i}", np.arange(5000 + 100 * i, 5000 + 100 * i + 30, dtype=np.int32)) for i in range(4)]
    for c in fresh:
        m.claim(c)
    batch = ctxs + fresh
    before = _state(m, batch)
    with pytest.raises(InsufficientBlocksError) as refused:
        m.alloc_many(batch)
    assert _state(m, batch) == before
    m.check_invariants()
    # the loop raises the same error, having changed what came before it
    with pytest.raises(InsufficientBlocksError) as looped:
        for c in batch:
            m.alloc(c)
    assert str(looped.value) == str(refused.value)
    assert _state(m, batch) != before


@pytest.mark.parametrize("pkg", PKGS)
def test_a_guarded_batch_with_host_loads_puts_the_pages_back(pkg):
    """Loads posted by the batch's admissions (the host tier holds their prefix) are waited
    for, and their pages' bytes restored, when a later admission is refused."""
    m = _manager(pkg, num_blocks=14, host=1 << 20)
    _fill(m, None)
    for i in range(4):  # request 0's pages go to the host tier, then the device evicts them
        c = TextContext(f"e{i}", np.arange(1000 * i, 1000 * i + 21, dtype=np.int32))
        m.claim(c)
        m.alloc(c)
        m.runtime_inputs([[c]])  # (posts the offloads queued by earlier steps)
        c.update(5)
        m.step(c)
        m.release(c)
        m.runtime_inputs([[]])
        m.poll_transfers()
    while m.pending_transfers_exist():
        m.poll_transfers()
    assert m.host_byte_count().free < m.host_byte_count().total, "the host tier holds request 0's pages"
    again = TextContext("again", np.arange(0, 21, dtype=np.int32))
    big = [TextContext(f"big{i}", np.arange(7000 + 100 * i, 7000 + 100 * i + 36, dtype=np.int32)) for i in range(3)]
    for c in [again, *big]:
        m.claim(c)
    h2d = m.get_metrics_aggregated().h2d_bytes_copied
    before = _state(m, [again, *big], connector_metrics=False)
    with pytest.raises(InsufficientBlocksError):
        m.alloc_many([again, *big])
    assert _state(m, [again, *big], connector_metrics=False) == before
    # spec/manager.md §17.3: the load the batch posted ran; the connector counts the bytes it moved
    assert m.get_metrics_aggregated().h2d_bytes_copied > h2d
    m.check_invariants()
    m.release_many(big)
    m.alloc_many([again])
    assert again.cached_prefix_length + again.cached_prefix_external_length > 0  # served once room is made
    m.check_invariants()
    m.shutdown()


@pytest.mark.parametrize("pkg", PKGS)
def test_replacement_and_duplicates_follow_the_loop(pkg):
    m = _manager(pkg)
    a = TextContext("a", np.arange(0, 9, dtype=np.int32))
    m.claim(a)
    m.alloc_many([a, a])  # a duplicate: the second alloc has nothing to add
    TextContext.update_many([a, a], [1, 2])  # two tokens for a listed twice
    assert a.tokens[-2:].tolist() == [1, 2]
    m.step_many([a, a])
    twin = TextContext("a", a.tokens)  # a replacement context for the same request
    twin.skip_processing(a.processed_length)
    m.alloc_many([twin])
    assert m._requests["a"].ctx is twin  # adopted, as the single call adopts it
    other = TextContext("a", np.arange(50, 61, dtype=np.int32))
    before = _state(m, [twin])
    with pytest.raises(ValueError, match="alloc: request_id='a' was claimed with other tokens"):
        m.alloc_many([twin, other])
    assert _state(m, [twin]) == before
    with pytest.raises(ValueError, match="release: request_id='a' is not claimed"):
        m.release_many(["a", twin])
    assert m.contains("a")
    m.release_many(["a"])
    m.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
def test_a_batch_reads_the_clock_once(pkg):
    reads = []

    def clock():
        reads.append(1)
        return float(len(reads))

    m = _manager(pkg, LEAVES["full+sliding"], num_blocks=64, clock=clock)
    ctxs = [TextContext(f"r{i}", np.arange(100 * i, 100 * i + 9, dtype=np.int32), retention_seconds=5.0)
            for i in range(5)]
    for c in ctxs:
        m.claim(c)
    m.alloc_many(ctxs)
    TextContext.update_many(ctxs, [1] * 5)
    del reads[:]
    m.step_many(ctxs)
    assert len(reads) == 1
    del reads[:]
    m.release_many(ctxs)
    assert len(reads) == 1
    m.check_invariants()


class _SubContext(TextContext):
    """A TextContext subclass: ``update_many`` checks it one context at a time (not the batch look)."""

    __slots__ = ()


@pytest.mark.parametrize("case", ["bool token", "int32 overflow", "numpy scalar", "pending", "not a context",
                                  "subclass", "duplicate", "float token"])
def test_update_many_equals_the_loop(case):
    """``update_many`` takes one C-level look at the batch and falls back to the loop's checks for
    anything else: either way its error (type and message) is the loop's first, nothing changes on
    it, and a batch it accepts leaves the contexts as the loop leaves them."""
    def batch():
        ctxs = [TextContext(str(i), [1, 2, 3]) for i in range(4)]
        toks = [10, 11, 12, 13]
        if case == "bool token":
            toks[2] = True
        elif case == "int32 overflow":
            toks[1] = 2**31
        elif case == "numpy scalar":
            toks[3] = np.int16(7)
        elif case == "pending":
            ctxs[2].chunk(1)
        elif case == "not a context":
            ctxs[1] = "x"
        elif case == "subclass":
            ctxs[0] = _SubContext("s", [4, 5])
        elif case == "duplicate":
            ctxs[3] = ctxs[0]
        elif case == "float token":
            toks[0] = 1.5
        return ctxs, toks

    def state(ctxs):
        return [(c.tokens.tolist(), c.processed_length, c.active_length) for c in ctxs if isinstance(c, TextContext)]

    ctxs, toks = batch()
    loop_error = None
    try:  # the loop, with update_many's own type check for a non-context
        for i, (c, t) in enumerate(zip(ctxs, toks)):
            if not isinstance(c, TextContext):
                raise TypeError(f"TextContext.update_many: ctxs[{i}]={c!r}, must be a TextContext")
            c.update(t)
    except (TypeError, ValueError) as e:
        loop_error = e
    looped = state(ctxs)
    ctxs, toks = batch()
    before = state(ctxs)
    if loop_error is None:
        TextContext.update_many(ctxs, toks)
        assert state(ctxs) == looped
    else:
        with pytest.raises(type(loop_error)) as got:
            TextContext.update_many(ctxs, toks)
        assert str(got.value) == str(loop_error)
        assert state(ctxs) == before
