"""Directed manager scenarios: the rare but legal sequences a random run seldom reaches.

Each test drives the backend and kvref in lockstep (``ManagerPair``: same
outcome per call, unchanged state after a raise, full state compared by
``agree()``, device bytes included with ``strict_block_ids``) and adds
absolute checks of the spec's numbers (``spec/manager.md``), so a scenario
also guards kvref. K and V written by each forward are non-zero and differ
in every element (``kvspec.strategies.distinct_pair``).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvspec import InsufficientBlocksError, KVCacheParams, PrefixCacheHits, TextContext
from kvspec.conformance._compare import assert_same, assert_same_outcome, capture, to_numpy
from kvspec.conformance._harness import ManagerPair
from kvspec.conformance.manager_machine import write_forward
from kvspec.conformance.plugin import require


def _pair(backend, oracle, *, page=2, num_blocks=16, max_seq_len=None, **params) -> ManagerPair:
    require(backend, "manager", "prefix_caching")
    kw = dict(page_size=page, num_layers=2, kv_heads=1, head_dim=2, dtype="float32")
    kw.update(params)
    if max_seq_len is None:  # spec/manager.md §1.6: at most what the pool holds
        max_seq_len = min(24, (num_blocks - 1) * page)
    return ManagerPair(backend, oracle, KVCacheParams(**kw), num_blocks=num_blocks, max_batch_size=4,
                       max_seq_len=max_seq_len)


def _claim(p: ManagerPair, rid: str, tokens, salt=None) -> None:
    p.new(rid, tokens, cache_salt=salt)
    p.ok(f"manager.claim(ctx_{rid})", lambda m, cs: m.claim(cs[rid]))


def _alloc(p: ManagerPair, rid: str, **kw):
    return p.ok(f"manager.alloc(ctx_{rid}, **{kw!r})", lambda m, cs: m.alloc(cs[rid], **kw).is_complete())[1]


def _run(p: ManagerPair, rid: str, token: int = 0, seed: int = 0, *, alloc: bool = True) -> None:
    """One forward of ``rid``: alloc, K/V written, ``update(token)`` (or ``advance_chunk()``
    after a non-final chunk), ``step``."""
    if alloc:
        _alloc(p, rid)
    for m, cs in ((p.ref, p.ctx_ref), (p.sut, p.ctx_sut)):
        write_forward(m, cs[rid], seed)
        if cs[rid].pending_length:
            cs[rid].advance_chunk()
        else:
            cs[rid].update(token)
    p.ok(f"manager.step(ctx_{rid})", lambda m, cs: m.step(cs[rid]))


def _release(p: ManagerPair, rid: str) -> None:
    p.ok(f"manager.release(ctx_{rid})", lambda m, cs: m.release(cs[rid]))


def _hits(p: ManagerPair, tokens, salt=None) -> list:
    return p.ok(f"manager.get_prefix_cache_hit_counts(TextContext('probe', {list(tokens)}))",
                lambda m, cs: m.get_prefix_cache_hit_counts(TextContext("probe", np.array(tokens, np.int32),
                                                                        cache_salt=salt)))[1]


def _pages(p: ManagerPair, rid: str) -> np.ndarray:
    """The backend's K/V of ``rid``'s pages, ``[n_pages, 2, layers, page, heads, dim]``."""
    rows = p.sut.get_req_blocks_per_leaf(p.ctx_sut[rid])["full"]
    return to_numpy(p.sut.get_device_buffer(0))[rows]


def _ctx(p: ManagerPair, rid: str) -> tuple[int, int, int]:
    c = p.ctx_sut[rid]
    return c.processed_length, c.active_length, c.cached_prefix_length


# ---------------------------------------------------------------- collisions


@pytest.mark.parametrize("where", ["first", "last"])
def test_hit_verifies_every_token_under_collisions(kv_backend, kv_oracle, where):
    """DESIGN §6 / spec/manager.md §3.2: with the backend's hashes made to collide, a
    prompt that differs from a cached one only in the first (or the last) token of
    block 1 hits block 0 alone; its block 1 is computed, never served from the cache."""
    if kv_backend.collide_hashes is None:
        pytest.skip(f"backend {kv_backend.name} has no collide_hashes hook")
    with kv_backend.collide_hashes():
        p = _pair(kv_backend, kv_oracle, page=4)
        a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
        _claim(p, "a", a)
        _run(p, "a", token=14, seed=3)
        cached = _pages(p, "a")
        _release(p, "a")
        b = list(a)
        b[4 if where == "first" else 7] = 99
        assert _hits(p, b) == [PrefixCacheHits(1, 0)], f"hits of a prompt differing at the {where} token of block 1"
        assert _hits(p, a) == [PrefixCacheHits(3, 0)], "hits of the cached prompt itself"
        _claim(p, "b", b)
        _alloc(p, "b")
        assert _ctx(p, "b") == (4, 9, 4), f"b after alloc: (processed, active, cached)={_ctx(p, 'b')}, expected (4, 9, 4)"
        assert_same(cached[0], _pages(p, "b")[0], "K/V of the one verified hit block")
        _run(p, "b", token=15, seed=4, alloc=False)
        # b's block 1 collides with a's (same hash, other tokens): it is not published, so a
        # probe of b's tokens still hits one block, and a's prompt still hits all three.
        assert _hits(p, b) == [PrefixCacheHits(1, 0)], "b's colliding block must not be served"
        assert _hits(p, a) == [PrefixCacheHits(3, 0)], "a's blocks stay hittable"
        p.agree()


def test_decode_filled_block_under_collisions(kv_backend, kv_oracle):
    """A block filled by decode steps whose hash collides with a published block of
    other tokens is not published (the chain stops there), and never served."""
    if kv_backend.collide_hashes is None:
        pytest.skip(f"backend {kv_backend.name} has no collide_hashes hook")
    with kv_backend.collide_hashes():
        p = _pair(kv_backend, kv_oracle, page=2)
        _claim(p, "a", [1, 2, 3, 4, 5])
        _run(p, "a", token=6, seed=1)
        _claim(p, "b", [1, 2, 7])
        _run(p, "b", token=8, seed=2)  # b's block 1 = [7, 8] fills by decode; a holds [3, 4] there
        for t in (9, 10, 11):
            _run(p, "b", token=t, seed=t)
        _release(p, "b")
        assert _hits(p, [1, 2, 7, 8, 9, 10, 11]) == [PrefixCacheHits(1, 0)], "b's chain stops at the collision"
        assert _hits(p, [1, 2, 3, 4, 5]) == [PrefixCacheHits(2, 0)], "a's chain is intact"
        p.agree()


# ---------------------------------------------------------------- repeated alloc, replacement contexts


def test_second_alloc_before_step(kv_backend, kv_oracle):
    """spec/manager.md §4.9, §2.3: a repeated ``alloc`` before ``step`` is idempotent
    (same rows, input tokens counted once), with the same context, a replacement
    context of the same tokens, or ``defer_lookup=True``; one of other tokens is refused."""
    p = _pair(kv_backend, kv_oracle)
    prompt = [3, 1, 4, 1, 5, 9, 2]
    _claim(p, "a", prompt)
    _run(p, "a", token=6, seed=1)
    _release(p, "a")
    _claim(p, "b", prompt + [8, 8])
    _alloc(p, "b")
    rows = p.sut.get_req_blocks_per_leaf(p.ctx_sut["b"])["full"]
    before = p.sut.get_metrics_aggregated().input_tokens
    _alloc(p, "b")
    _alloc(p, "b", defer_lookup=True)
    for m, cs in ((p.ref, p.ctx_ref), (p.sut, p.ctx_sut)):  # the engine hands in a new object
        old = cs["b"]
        new = TextContext("b", np.array(old.tokens), cache_salt=old.cache_salt)
        new.skip_processing(old.processed_length)
        new.cached_prefix_length = old.cached_prefix_length
        cs["b"] = new
    # Straight to alloc: any other call first (a snapshot's get_req_blocks_per_leaf) would adopt it.
    r = capture(lambda: p.ref.alloc(p.ctx_ref["b"]).is_complete())
    s = capture(lambda: p.sut.alloc(p.ctx_sut["b"]).is_complete(), source="manager.alloc(ctx_b)  # a replacement context")
    assert_same_outcome("manager.alloc(ctx_b)  # a replacement context", r, s)
    assert p.sut.get_req_blocks_per_leaf(p.ctx_sut["b"])["full"] == rows, "a repeated alloc changed the rows"
    assert p.sut.get_metrics_aggregated().input_tokens == before, "a repeated alloc counted the input tokens twice"
    p.raises("manager.alloc(TextContext('b', other tokens))",
             lambda m, cs: m.alloc(TextContext("b", np.array(prompt + [7, 7], np.int32))), ValueError)
    p.raises("manager.step(TextContext('b', other tokens))",
             lambda m, cs: m.step(TextContext("b", np.array(prompt + [7, 7], np.int32))), ValueError)
    p.raises("manager.release(TextContext('b', other tokens))",
             lambda m, cs: m.release(TextContext("b", np.array(prompt + [7, 7], np.int32))), ValueError)
    _run(p, "b", token=7, seed=2, alloc=False)
    _alloc(p, "b")
    _alloc(p, "b")
    _run(p, "b", token=5, seed=3, alloc=False)
    p.agree()


# ---------------------------------------------------------------- chunked prefill


@pytest.mark.parametrize("chunk", [2, 4, 6])
def test_chunk_aligned_cached_prefill(kv_backend, kv_oracle, chunk):
    """A chunk of whole pages fully covered by a cached prefix: the hit is capped
    inside the chunk (one token stays active), the rest of the prompt follows in
    later chunks, and every step publishes what it filled."""
    p = _pair(kv_backend, kv_oracle)
    a = [1, 2, 1, 3, 1, 4, 1, 5, 1]
    _claim(p, "a", a)
    _run(p, "a", token=0, seed=1)
    _release(p, "a")
    b = a[:8] + [2, 2, 2, 2]
    _claim(p, "b", b)
    for cs in (p.ctx_ref, p.ctx_sut):
        cs["b"].chunk(chunk)
    _alloc(p, "b")
    assert _ctx(p, "b")[2] == chunk - 2, f"cached prefix {_ctx(p, 'b')[2]} of a {chunk}-token chunk, expected {chunk - 2}"
    seed = 2
    while p.ctx_sut["b"].pending_length:
        _run(p, "b", seed=seed, alloc=seed > 2)
        if p.ctx_sut["b"].active_length > chunk:
            for cs in (p.ctx_ref, p.ctx_sut):
                cs["b"].chunk(chunk)
        seed += 1
    _run(p, "b", token=3, seed=seed)
    _release(p, "b")
    assert _hits(p, b + [3]) == [PrefixCacheHits(6, 0)], "every block of b is published after its chunks"
    p.agree()


def test_step_after_non_final_chunk_then_same_prompt(kv_backend, kv_oracle):
    """``step`` after a non-final chunk publishes the chunk's full blocks at once: the
    same prompt arriving next hits them while the first request is still running."""
    p = _pair(kv_backend, kv_oracle)
    prompt = [2, 7, 1, 8, 2, 8, 1, 8, 2]
    _claim(p, "a", prompt)
    for cs in (p.ctx_ref, p.ctx_sut):
        cs["a"].chunk(5)
    _run(p, "a", seed=1)  # processes 5 tokens: blocks 0 and 1 are full
    assert _ctx(p, "a")[:2] == (5, 4), f"a after its first chunk: {_ctx(p, 'a')}"
    assert _hits(p, prompt) == [PrefixCacheHits(2, 0)], "the first chunk's full blocks are published at its step"
    _claim(p, "b", prompt)
    _alloc(p, "b")
    assert _ctx(p, "b") == (4, 5, 4), f"b after alloc: {_ctx(p, 'b')}, expected a 2-block hit"
    rows_a = p.sut.get_req_blocks_per_leaf(p.ctx_sut["a"])["full"]
    rows_b = p.sut.get_req_blocks_per_leaf(p.ctx_sut["b"])["full"]
    assert rows_b[:2] == rows_a[:2], f"b must share a's published blocks: a {rows_a}, b {rows_b}"
    _run(p, "a", token=4, seed=2)
    _run(p, "b", token=4, seed=3, alloc=False)  # twins of a's blocks 2, 3: deduplicated
    p.agree()


# ---------------------------------------------------------------- twins, growth, capacity


def test_twin_dedup(kv_backend, kv_oracle):
    """spec/manager.md §5.1: two requests computing the same prompt at once both miss;
    the second ``step`` finds its blocks published by the first and switches to them,
    freeing its own pages to the front of the free list."""
    p = _pair(kv_backend, kv_oracle, num_blocks=12)
    prompt = [5, 4, 3, 2, 1, 0, 5]
    for rid in ("a", "b"):
        _claim(p, rid, prompt)
        _alloc(p, rid)
    free_before = p.sut.block_count().free
    _run(p, "a", token=1, seed=1, alloc=False)
    _run(p, "b", token=1, seed=2, alloc=False)
    rows_a = p.sut.get_req_blocks_per_leaf(p.ctx_sut["a"])["full"]
    rows_b = p.sut.get_req_blocks_per_leaf(p.ctx_sut["b"])["full"]
    assert rows_b[:3] == rows_a[:3], f"b's full blocks must be a's published twins: a {rows_a}, b {rows_b}"
    assert rows_b[3] != rows_a[3], "the partial last block stays b's own"
    assert p.sut.block_count().free == free_before + 3, "b's three duplicate pages go back to the free list"
    for t in range(4):
        _run(p, "b", token=t, seed=10 + t)
    p.agree()


def test_decode_growth(kv_backend, kv_oracle):
    """Decode steps grow the row one page at a time and publish each block as it
    fills; a prompt of all the tokens then hits every full block."""
    p = _pair(kv_backend, kv_oracle, page=3)
    _claim(p, "a", [1, 2])
    tokens = [1, 2]
    for t in range(11):
        _run(p, "a", token=t % 3, seed=t)
        tokens.append(t % 3)
        rows = p.sut.get_req_blocks_per_leaf(p.ctx_sut["a"])["full"]
        assert len(rows) == -(-(len(tokens) - 1) // 3), f"rows {rows} after {len(tokens) - 1} processed tokens"
    assert _hits(p, tokens) == [PrefixCacheHits((len(tokens) - 1) // 3, 0)], "every block filled by decode is published"
    _release(p, "a")
    _claim(p, "b", tokens)
    _alloc(p, "b")
    assert _ctx(p, "b")[2] == 12, f"cached prefix {_ctx(p, 'b')[2]}, expected 12 (4 blocks of 3)"
    p.agree()


@pytest.mark.parametrize("extra, fits", [(5, False), (3, True)])
def test_near_full_pool_revived_hits(kv_backend, kv_oracle, extra, fits):
    """spec/manager.md §4.6: hits revived from the free list are taken before new pages
    are counted, so when reviving them leaves too few free pages the alloc raises
    ``InsufficientBlocksError`` and changes nothing; with one page less it fits."""
    # 7 usable pages, 2 held by a live request: 5 left, and max_seq_len=14 holds b (spec/manager.md §1.6)
    p = _pair(kv_backend, kv_oracle, num_blocks=8)
    _claim(p, "hog", [50, 51, 52, 53])
    _alloc(p, "hog")
    a = [1, 1, 2, 2, 3, 3, 4]
    _claim(p, "a", a)
    _run(p, "a", token=5, seed=1)
    _release(p, "a")  # 3 published blocks + 1 fresh page, all free
    b = a[:6] + [9] * extra
    _claim(p, "b", b)
    if fits:
        _alloc(p, "b")
        assert _ctx(p, "b")[2] == 6, "the 3-block hit is taken"
        _run(p, "b", token=0, seed=2, alloc=False)
    else:
        msg = p.raises("manager.alloc(ctx_b)  # 3 hits revived, 3 new pages, 2 left",
                       lambda m, cs: m.alloc(cs["b"]), InsufficientBlocksError)
        assert "needs 3 blocks" in msg and "2 free or evictable" in msg, msg
    p.agree()


def test_hits_held_by_a_live_request_cost_no_free_page(kv_backend, kv_oracle):
    """Hit blocks still referenced by a running request are not on the free list:
    sharing them draws only the new pages (the pool is nearly full)."""
    p = _pair(kv_backend, kv_oracle, num_blocks=8)  # 7 usable
    a = [1, 1, 2, 2, 3, 3, 4]
    _claim(p, "a", a)
    _run(p, "a", token=5, seed=1)  # a holds 4 pages, 3 free
    _claim(p, "b", a[:6] + [8, 8, 8])
    _alloc(p, "b")  # 3 shared hits + 2 new pages
    assert p.sut.block_count().free == 1, f"block_count()={p.sut.block_count()}, expected 1 free"
    _run(p, "b", token=0, seed=2, alloc=False)
    p.agree()


def test_long_hit_run(kv_backend, kv_oracle):
    """A hit of more than 15 blocks (batched lookups must not stop at a fixed width)."""
    p = _pair(kv_backend, kv_oracle, num_blocks=48, max_seq_len=48)
    prompt = [(7 * i) % 5 for i in range(41)]
    _claim(p, "a", prompt)
    _run(p, "a", token=1, seed=1)
    cached = _pages(p, "a")
    _release(p, "a")
    assert _hits(p, prompt) == [PrefixCacheHits(20, 0)], "a 41-token prompt of page 2 hits 20 blocks"
    _claim(p, "b", prompt[:40] + [4])
    _alloc(p, "b")
    assert _ctx(p, "b") == (40, 1, 40), f"b after alloc: {_ctx(p, 'b')}"
    assert_same(cached[:20], _pages(p, "b")[:20], "K/V of the 20 hit blocks")
    bad = list(prompt)
    bad[35] = 4 if bad[35] != 4 else 3  # differs inside block 17
    assert _hits(p, bad) == [PrefixCacheHits(17, 0)], "the hit stops at the first differing block"
    p.agree()


def test_two_block_pool(kv_backend, kv_oracle):
    """``num_blocks=2``: one usable page besides the null block (so ``max_seq_len <= 4``, spec/manager.md §1.6)."""
    p = _pair(kv_backend, kv_oracle, page=4, num_blocks=2, max_seq_len=4)
    assert p.sut.block_count().total == 1 and p.sut.block_count().free == 1, f"block_count()={p.sut.block_count()}"
    _claim(p, "a", [1, 2, 3])
    _run(p, "a", token=4, seed=1)
    _alloc(p, "a")  # 4 tokens still fit in the page
    _claim(p, "b", [1])
    p.raises("manager.alloc(ctx_b)  # no page left", lambda m, cs: m.alloc(cs["b"]), InsufficientBlocksError)
    _release(p, "b")
    _run(p, "a", token=5, seed=2, alloc=False)
    p.raises("manager.alloc(ctx_a)  # a 5th token: len(ctx) > max_seq_len, never a second page",
             lambda m, cs: m.alloc(cs["a"]), ValueError)
    _release(p, "a")
    assert _hits(p, [1, 2, 3, 4, 5]) == [PrefixCacheHits(1, 0)], "a's one full page is published"
    _claim(p, "c", [1, 2, 3])
    _alloc(p, "c")  # evicts the published page: the only one there is
    assert _hits(p, [1, 2, 3, 4, 5]) == [PrefixCacheHits(0, 0)], "the evicted page is no longer a hit"
    _run(p, "c", token=4, seed=3, alloc=False)
    p.agree()


# ---------------------------------------------------------------- hashes: prefill against decode


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
@pytest.mark.parametrize("salt", [None, "s"])
def test_prefill_hashes_equal_decode_hashes(kv_backend, kv_oracle, algo, salt):
    """spec/hashing.md: a block's hash is the same whether a prefill hashed it in one
    run or decode steps filled it one token at a time, so each path's blocks are
    hits for the other (both hash algorithms, with and without a salt)."""
    p = _pair(kv_backend, kv_oracle, page=2, hash_algo=algo, hash_seed=3)
    _claim(p, "dec", [4, 2], salt)
    toks = [4, 2]
    for t in (1, 0, 2, 2, 1, 0, 1):
        _run(p, "dec", token=t, seed=t + 5)
        toks.append(t)
    _release(p, "dec")  # blocks 0..3 were filled by decode steps
    _claim(p, "pre", toks + [0, 0, 1], salt)
    _alloc(p, "pre")
    assert _ctx(p, "pre")[2] == 8, f"a prefill of the decoded tokens hits {_ctx(p, 'pre')[2]} tokens, expected 8"
    _run(p, "pre", token=2, seed=20, alloc=False)  # prefill publishes blocks 4 and 5 from its own hashes
    for t in (1, 1):
        _run(p, "pre", token=t, seed=21 + t)
    full = toks + [0, 0, 1, 2, 1, 1]
    _release(p, "pre")
    other = None if salt else "s"
    assert _hits(p, full, salt) == [PrefixCacheHits(7, 0)], "decode- and prefill-hashed blocks form one chain"
    assert _hits(p, full, other) == [PrefixCacheHits(0, 0)], "another salt shares nothing"
    p.agree()


def test_step_past_the_rows_is_refused(kv_backend, kv_oracle):
    """spec/manager.md §5: a forward that ran past the allocated rows (no ``alloc``
    before it, or one page short) makes ``step`` raise ``ValueError`` naming both
    counts, state unchanged; after the ``alloc`` the same step succeeds."""
    p = _pair(kv_backend, kv_oracle, page=2)
    _claim(p, "a", [1, 2, 3])
    for cs in (p.ctx_ref, p.ctx_sut):
        cs["a"].update(4)  # a "forward" of 3 tokens without alloc: no rows at all
    msg = p.raises("manager.step(ctx_a)  # no alloc", lambda m, cs: m.step(cs["a"]), ValueError)
    assert "processed_length=3 > 0 tokens" in msg, msg
    _claim(p, "b", [1, 2])
    _run(p, "b", token=3, seed=1)
    for t in (4, 5):  # decode without alloc: the second token needs a page b does not hold
        for cs in (p.ctx_ref, p.ctx_sut):
            cs["b"].update(t)
    msg = p.raises("manager.step(ctx_b)  # one page short", lambda m, cs: m.step(cs["b"]), ValueError)
    assert "processed_length=4 > 2 tokens" in msg, msg
    p.agree()


def test_runtime_inputs_short_rows_message(kv_backend, kv_oracle):
    """spec/manager.md §8 (3): a context short of blocks is refused with the counts the
    spec prints (``len(row) * page_size`` tokens pass, one more fails); after
    ``alloc`` the same batch is accepted and padded with the null block."""
    p = _pair(kv_backend, kv_oracle, page=4)
    _claim(p, "a", [1, 2, 3, 4, 5, 6, 7])
    _run(p, "a", token=8, seed=1)  # 8 tokens in 2 pages: current_position 8 passes
    p.ok("manager.runtime_inputs([[ctx_a]])", lambda m, cs: m.runtime_inputs([[cs["a"]]]).inputs[0].cache_lengths)
    for cs in (p.ctx_ref, p.ctx_sut):
        cs["a"].update(9)  # one more token, no alloc: current_position 9
    msg = p.raises("manager.runtime_inputs([[ctx_a]])  # short of blocks",
                   lambda m, cs: m.runtime_inputs([[cs["a"]]]), ValueError)
    want = ("batches[0][0] request_id='a' holds 2 blocks of leaf 'full' (8 tokens) < current_position=9; "
            "it does not have sufficient blocks, alloc must be called first")
    assert want in msg, f"message {msg!r} must contain {want!r}"
    _alloc(p, "a")
    r, s = p.ok("manager.runtime_inputs([[ctx_a]])", lambda m, cs: m.runtime_inputs([[cs["a"]]]).inputs[0])
    lut = to_numpy(s.lookup_table)
    assert lut.shape == (1, 8) and (lut[0, :3] != 0).all() and not lut[0, 3:].any(), f"lookup_table {lut}"
    assert to_numpy(s.cache_lengths).tolist() == [8], f"cache_lengths {s.cache_lengths}"
    p.agree()


def test_recurrent_checkpoint_and_restore(kv_backend, kv_oracle):
    """spec/manager.md §5.2, §4.5, §4.7: a step ending exactly on a page boundary
    checkpoints the recurrent state; a later hit restores that state's bytes into
    the new request's live page (a fresh state starts at zero); a step ending
    inside a page checkpoints nothing, so a prompt cached only there is no hit."""
    from kvspec._manager_types import LeafSpec

    require(kv_backend, "manager", "prefix_caching", "recurrent_leaf")
    leaves = {"full": LeafSpec.full(), "rec": LeafSpec.recurrent((2, 2))}
    p = _pair(kv_backend, kv_oracle, page=2, leaves=leaves)

    def set_state(rid, value):
        for m, cs in ((p.ref, p.ctx_ref), (p.sut, p.ctx_sut)):
            live = m.get_req_blocks_per_leaf(cs[rid])["rec"][0]
            buf = m.get_device_buffer(0)["rec"]
            if isinstance(buf, np.ndarray):
                buf[live] = value
            else:  # pragma: no cover - GPU arrays
                from kvspec.conformance._compare import to_device

                buf[live] = to_device(value)

    def live_state(rid):
        live = p.sut.get_req_blocks_per_leaf(p.ctx_sut[rid])["rec"][0]
        return to_numpy(p.sut.get_device_buffer(0)["rec"])[live]

    state = np.array([[1.5, -2.0], [0.25, 3.0]], np.float32)
    _claim(p, "a", [1, 2, 3, 4])
    _alloc(p, "a")
    assert not live_state("a").any(), "a fresh recurrent state starts at zero"
    set_state("a", state)
    _run(p, "a", token=5, seed=1, alloc=False)  # processed 4: a page boundary, checkpointed
    _release(p, "a")
    _claim(p, "b", [1, 2, 3, 4, 6, 6])
    _alloc(p, "b")
    assert _ctx(p, "b")[2] == 4, f"b's hit {_ctx(p, 'b')[2]} tokens, expected 4 (the checkpoint at 4)"
    assert_same(state, live_state("b"), "recurrent state restored from the checkpoint")
    _claim(p, "c", [5, 5, 5])
    _run(p, "c", token=5, seed=2)  # processed 3: inside a page, no checkpoint
    _release(p, "c")
    _claim(p, "d", [5, 5, 5, 5, 1])
    _alloc(p, "d")
    assert _ctx(p, "d")[2] == 0, f"d's hit {_ctx(p, 'd')[2]} tokens: no checkpoint backs it, expected 0"
    assert not live_state("d").any(), "without a hit the state starts at zero"
    p.agree()
