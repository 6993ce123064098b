"""``kvcache bench``: the kvfast / kvref ratio table, measured in one run (issue 5).

Each row times two things in the same process, interleaved, and reports
their ratio (best of ``repeat`` timings of each):

* ``append_kv decode`` / ``append_kv prefill``: ``kvfast.ops.append_kv`` on
  the CPU for a decode step (256 rows x 1 token) and a prefill step (8 rows x
  1024 tokens), 8 KV heads x 128, float16, paged storage; the ratio is its
  effective bandwidth over ``numpy.copyto`` of the same bytes (K and V)
  between two contiguous buffers (target >= 0.6).
* ``prepare_step decode``: ``prepare_step`` for 256 decode rows, kvref time
  over kvfast time, inputs as NumPy int32 arrays (target >= 30) and as
  Python lists (target >= 20) (issue 12).
* ``manager replay``: the peer bookkeeping workload (``WORKLOAD.md`` of the
  peers folder: 20 shared 1024-token system prompts, waves of 64, 64 decode
  steps, 8192 blocks of 16 tokens) driven through ``PagedKVCacheManager`` the
  way ``benchmarks/kvfast_adapter.py`` drives it, on the first
  ``replay_requests`` requests; kvref time over kvfast time (target >= 10).
  Hit tokens and peak blocks of both are reported and must agree.
* ``manager <configuration>`` (issue 12): one row per configuration (one
  full leaf; ``data_parallel_degree=2``; host tier; full + sliding window;
  full + recurrent), a scheduler loop calling ``claim``, ``alloc``,
  ``runtime_inputs`` every step, ``step`` and ``release``; kvref time over
  kvfast time (target >= 10) and kvfast's per-request time over its one-full-
  leaf figure (target <= 2); hits and peak blocks must agree.
* ``decode step batch, <configuration>`` (issue 32): a decode step of 256
  running requests through the batch calls (``alloc_many`` +
  ``TextContext.update_many`` + ``step_many``, spec/manager.md §17), one row
  per configuration of :data:`BATCH_CONFIGS`: kvref's batch calls over
  kvfast's (target >= 30), and kvfast's per-request loop of the same calls
  over its batch calls (target >= 10); hits must agree.
* ``transformers decode, <cache>`` (issue 33): a tiny random Llama (2 layers,
  hidden 64, 4 query / 2 K/V heads), a 32-token prompt, 50 greedy decode
  steps of batch 1, torch on one thread: the model forward per decode step
  with transformers' ``DynamicCache`` over the same with each ``SlotKVCache``
  of :data:`TRANSFORMERS_VARIANTS` (target >= 1/1.1: a step at most 1.1x
  ``DynamicCache``'s), ``generate``'s per-step cost in the detail; every
  variant timed interleaved in the one run; tokens must agree. Skipped, with
  a message, where torch or transformers is not installed.

Run ``kvcache bench`` (or ``python -m kvcache.bench``); ``--quick`` shrinks
the repetitions for a smoke run; ``--json PATH`` writes ``{"metadata": ..., "rows": [...]}``
(machine and versions: ``kvcache.metadata.machine_metadata``).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from typing import Callable, Sequence

import numpy as np

__all__ = ["run_bench", "print_table", "main", "peer_workload", "replay_manager", "decode_batch",
           "transformers_decode", "tiny_llama"]

#: The sections of the table, in order (``--only`` picks some).
SECTIONS = ("append", "prepare", "attention", "replay", "configs", "retention", "batch", "transformers")

# Peer workload constants (WORKLOAD.md §1).
SEED = 20260601
NUM_REQUESTS = 2000
NUM_PREFIXES = 20
PREFIX_LEN = 1024
VOCAB = 32000
BLOCK_SIZE = 16
POOL_BLOCKS = 8192
WAVE = 64
DECODE_STEPS = 64


def _best(fn: Callable[[], object], repeat: int, number: int = 1) -> float:
    """Best wall time of ``number`` calls of ``fn``, over ``repeat`` runs, in seconds per call."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best


def _interleaved(a: Callable[[], object], b: Callable[[], object], repeat: int, number: int) -> tuple[float, float]:
    """Best per-call times of ``a`` and ``b``, timed alternately (A B / B A ...)."""
    ta = tb = float("inf")
    for r in range(repeat):
        for which in ((0, 1) if r % 2 == 0 else (1, 0)):
            t = _best(a if which == 0 else b, 1, number)
            if which == 0:
                ta = min(ta, t)
            else:
                tb = min(tb, t)
    return ta, tb


# --------------------------------------------------------------------------- append_kv


def _append_case(rows: int, q: int, repeat: int, number: int) -> dict:
    import kvfast
    from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec

    heads, dim, bs = 8, 128, 16
    max_seq_len = 2048
    past = 0 if q > 1 else 100
    # a pool holding exactly the rows' blocks (plus the null block), as a serving pool would
    num_blocks = rows * -(-(past + q) // bs) + 1
    cfg = KVCacheConfig(num_layers=1, max_seqs=rows, max_seq_len=max_seq_len, mode=KVCacheMode.PAGED,
                        block_size=bs, num_blocks=num_blocks, dtype="float16")
    cache = kvfast.KVCache.make(cfg, [KVLayerSpec.attention(heads, dim)])
    slots = np.arange(rows, dtype=np.int32)
    if past:
        cache.reserve(slots, np.full(rows, past))
    cu = np.arange(rows + 1, dtype=np.int32) * q
    step = cache.prepare_step(cu, np.full(rows, past, np.int32), slots)
    rng = np.random.default_rng(0)
    t = rows * q
    k = rng.standard_normal((t, heads, dim)).astype(np.float16)
    v = rng.standard_normal((t, heads, dim)).astype(np.float16)
    src = np.concatenate([k.reshape(-1), v.reshape(-1)])
    dst = np.empty_like(src)
    dst[...] = 1  # touch
    cache.keys(0)[...] = 1
    cache.values(0)[...] = 1
    kvfast.ops.append_kv(cache, 0, k, v, step)  # compile / load the kernel
    t_copy, t_fast = _interleaved(lambda: np.copyto(dst, src), lambda: kvfast.ops.append_kv(cache, 0, k, v, step),
                                  repeat, number)
    nbytes = src.nbytes
    return {
        "name": f"append_kv {'prefill' if q > 1 else 'decode'} ({rows} rows x {q} tok, 8x128 fp16)",
        "metric": "bandwidth vs numpy.copyto",
        "ratio": t_copy / t_fast,
        "target": 0.6,
        "detail": (f"{nbytes / 2**20:.1f} MiB; kvfast {t_fast * 1e6:.1f} us = {nbytes / t_fast / 1e9:.2f} GB/s, "
                   f"copyto {t_copy * 1e6:.1f} us = {nbytes / t_copy / 1e9:.2f} GB/s"),
    }


# --------------------------------------------------------------------------- prepare_step


def _prepare_case(rows: int, repeat: int, number: int, as_lists: bool = False) -> dict:
    import kvfast
    import kvref
    from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec

    cfg = KVCacheConfig(num_layers=1, max_seqs=rows, max_seq_len=2048, mode=KVCacheMode.PAGED, block_size=16)
    spec = [KVLayerSpec.attention(8, 128)]
    caches = []
    slots = np.arange(rows, dtype=np.int32)
    for mod in (kvref, kvfast):
        c = mod.KVCache.make(cfg, spec)
        c.reserve(slots, np.full(rows, 100))
        caches.append(c)
    cu = np.arange(rows + 1, dtype=np.int32)
    past = np.full(rows, 100, np.int32)
    if as_lists:
        cu, past, slots = cu.tolist(), past.tolist(), slots.tolist()
    a = caches[0].prepare_step(cu, past, slots)
    b = caches[1].prepare_step(cu, past, slots)
    assert np.array_equal(a.slot_mapping, b.slot_mapping)
    t_ref, t_fast = _interleaved(lambda: caches[0].prepare_step(cu, past, slots),
                                 lambda: caches[1].prepare_step(cu, past, slots), repeat, number)
    return {
        "name": f"prepare_step decode ({rows} rows, paged, {'lists' if as_lists else 'numpy'})",
        "metric": "kvref time / kvfast time",
        "ratio": t_ref / t_fast,
        "target": 20.0 if as_lists else 30.0,
        "detail": f"kvref {t_ref * 1e6:.1f} us, kvfast {t_fast * 1e6:.1f} us",
    }


# --------------------------------------------------------------------------- attention


def attention_inputs(pkg, rows: int, q: int, *, past: int = 256, kv_heads: int = 2, q_heads: int = 8,
                     head_dim: int = 64, dtype: str = "float16"):
    """A paged slot cache of ``pkg`` whose ``rows`` slots hold ``past`` tokens of random K/V, and
    the next step of ``q`` tokens per row with its K/V appended: ``(cache, step, queries)``
    (float32 ``[rows * q, q_heads, head_dim]``). The same draws for every package."""
    from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec

    cfg = KVCacheConfig(num_layers=1, max_seqs=rows, max_seq_len=past + q, mode=KVCacheMode.PAGED, block_size=16,
                        dtype=dtype)
    cache = pkg.KVCache.make(cfg, [KVLayerSpec.attention(kv_heads, head_dim)])
    rng = np.random.default_rng(3)
    slots = np.arange(rows, dtype=np.int32)
    step = None
    for n, start in ((past, 0), (q, past)):
        step = cache.prepare_step(np.arange(rows + 1) * n, np.full(rows, start), slots)
        k, v = (rng.standard_normal((rows * n, kv_heads, head_dim)).astype(np.float32) for _ in range(2))
        pkg.ops.append_kv(cache, 0, k, v, step)
        if start == 0:
            for s in range(rows):
                cache.update_position(s, past)
    queries = rng.standard_normal((rows * q, q_heads, head_dim)).astype(np.float32)
    return cache, step, queries


def paged_attention_inputs(pkg, rows: int, q: int, *, past: int = 256, kv_heads: int = 2, q_heads: int = 8,
                           head_dim: int = 64, dtype: str = "float16"):
    """A ``pkg`` manager whose ``rows`` requests hold ``past`` tokens of random K/V in its pages, then
    the inputs of their next forward of ``q`` tokens each with its K/V appended: ``(kv_blocks,
    inputs, input_row_offsets, queries)`` for ``ops.paged_attention`` (float32 queries
    ``[rows * q, q_heads, head_dim]``). The same draws for every package."""
    from kvspec import KVCacheParams, TextContext

    params = KVCacheParams(page_size=16, num_layers=1, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    per_row = -(-(past + q) // 16)
    m = pkg.PagedKVCacheManager(params, num_blocks=rows * per_row + 1, max_batch_size=rows,
                                max_seq_len=per_row * 16)
    rng = np.random.default_rng(4)
    ctxs = [TextContext(str(i), rng.integers(0, 1000, past + q).astype(np.int32)) for i in range(rows)]
    for c in ctxs:
        m.claim(c)
        c.chunk(past)  # the history: a first chunk of the prompt; the step: its last q tokens
    for n in (past, q):
        for c in ctxs:
            m.alloc(c)
        inp = m.runtime_inputs([ctxs]).inputs[0]
        offsets = np.arange(rows + 1, dtype=np.int64) * n
        k, v = (rng.standard_normal((rows * n, kv_heads, head_dim)).astype(np.float32) for _ in range(2))
        pkg.ops.append_kv_paged(inp.kv_blocks, 0, k, v, inp, offsets)
        if n == past:
            for c in ctxs:
                m.step(c)
                c.advance_chunk()
    queries = rng.standard_normal((rows * q, q_heads, head_dim)).astype(np.float32)
    return inp.kv_blocks, inp, offsets, queries


def _attention_case(rows: int, q: int, repeat: int, number: int) -> dict:
    """``ops.varlen_attention`` of one step through a float16 paged cache, kvfast (the Numba kernel,
    keys read in place) against kvref (gather and einsum), interleaved; outputs compared first."""
    import kvfast
    import kvref

    (rc, rs, qs), (fc, fs, _) = (attention_inputs(p, rows, q) for p in (kvref, kvfast))
    want = kvref.ops.varlen_attention(qs, rc, 0, rs)
    got = kvfast.ops.varlen_attention(qs, fc, 0, fs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    t_ref, t_fast = _interleaved(lambda: kvref.ops.varlen_attention(qs, rc, 0, rs),
                                 lambda: kvfast.ops.varlen_attention(qs, fc, 0, fs), repeat, number)
    # the floor of reading the rows' history once: a plain copy of the same K/V bytes
    hist = np.concatenate([kvfast.ops.gather_kv(fc, 0, s)[i].reshape(-1) for s in range(rows) for i in (0, 1)])
    dst = np.empty_like(hist)
    t_copy = _best(lambda: np.copyto(dst, hist), repeat, max(number, 10))
    return {
        "name": f"varlen_attention {'decode' if q == 1 else 'prefill'} ({rows} rows x {q} tok, 256 past, "
                "8/2 heads x 64, fp16)",
        "metric": "kvref time / kvfast time",
        "ratio": t_ref / t_fast,
        "target": 10.0,
        "detail": (f"kvref {t_ref * 1e6:.1f} us, kvfast {t_fast * 1e6:.1f} us (outputs within rtol 1e-5); a copy "
                   f"of the {hist.nbytes / 2**20:.1f} MiB of history K/V {t_copy * 1e6:.1f} us"),
    }


def _paged_attention_case(rows: int, q: int, repeat: int, number: int) -> dict:
    """``ops.paged_attention`` of one forward through a manager's float16 pages, kvfast (the
    Numba kernel) against kvref, interleaved; outputs compared first."""
    import kvfast
    import kvref

    (rb, ri, ro, qs), (fb, fi, fo, _) = (paged_attention_inputs(p, rows, q) for p in (kvref, kvfast))
    want = kvref.ops.paged_attention(qs, rb, 0, ri, ro)
    got = kvfast.ops.paged_attention(qs, fb, 0, fi, fo)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    t_ref, t_fast = _interleaved(lambda: kvref.ops.paged_attention(qs, rb, 0, ri, ro),
                                 lambda: kvfast.ops.paged_attention(qs, fb, 0, fi, fo), repeat, number)
    return {
        "name": f"paged_attention {'decode' if q == 1 else 'prefill'} ({rows} rows x {q} tok, 256 past, "
                "8/2 heads x 64, fp16 pages)",
        "metric": "kvref time / kvfast time",
        "ratio": t_ref / t_fast,
        "target": 10.0,
        "detail": f"kvref {t_ref * 1e6:.1f} us, kvfast {t_fast * 1e6:.1f} us (outputs within rtol 1e-5)",
    }


# --------------------------------------------------------------------------- manager replay


def peer_workload(num_requests: int = NUM_REQUESTS):
    """The peer bookkeeping workload (WORKLOAD.md §2, same draws), first ``num_requests`` requests.

    Returns
    -------
    prompts : list of int64 arrays
    gen : int64 [num_requests, 65]
        Sampled tokens.
    fingerprint : str
        First 16 hex digits of the sha256 of the full workload (``11393283c391264a``).
    """
    import hashlib

    rng = np.random.default_rng(SEED)
    prefixes = rng.integers(0, VOCAB, size=(NUM_PREFIXES, PREFIX_LEN), dtype=np.int64)
    prefix_idx = rng.integers(0, NUM_PREFIXES, size=NUM_REQUESTS, dtype=np.int64)
    suffix_len = rng.integers(256, 2048, size=NUM_REQUESTS, endpoint=True, dtype=np.int64)
    prompts = []
    for i in range(NUM_REQUESTS):
        suffix = rng.integers(0, VOCAB, size=suffix_len[i], dtype=np.int64)
        prompts.append(np.concatenate([prefixes[prefix_idx[i]], suffix]))
    gen = rng.integers(0, VOCAB, size=(NUM_REQUESTS, DECODE_STEPS + 1), dtype=np.int64)
    h = hashlib.sha256()
    for p in prompts:
        h.update(p.astype("<i8").tobytes())
    h.update(gen.astype("<i8").tobytes())
    return prompts[:num_requests], gen[:num_requests], h.hexdigest()[:16]


def replay_manager(manager_cls, prompts, gen) -> dict:
    """Run the peer schedule (WORKLOAD.md §3) through ``manager_cls``; times every phase.

    Per request: ``claim`` + ``alloc`` (hashing, verified prefix hit, pages),
    prefill marked computed up to its last token and ``step`` (publishes the
    prompt's full blocks, so later requests of the wave hit them); then per
    sampled token ``ctx.update`` + ``step``, and per decode step ``alloc``;
    finally ``release``. Returns seconds spent, hit tokens and peak blocks.
    """
    from kvspec import KVCacheParams, TextContext

    params = KVCacheParams(page_size=BLOCK_SIZE, num_layers=1, kv_heads=1, head_dim=1)
    gc.collect()
    m = manager_cls(params, num_blocks=POOL_BLOCKS + 1, max_batch_size=WAVE, max_seq_len=1 << 16)
    gc.collect()
    gc.freeze()
    try:
        perf = time.perf_counter
        busy = 0.0
        hits = peak = 0
        n = len(prompts)
        for w0 in range(0, n, WAVE):
            ids = range(w0, min(w0 + WAVE, n))
            ctxs = [TextContext(str(i), prompts[i]) for i in ids]
            t0 = perf()
            for ctx in ctxs:
                m.claim(ctx)
                m.alloc(ctx)
                ctx.skip_processing(ctx.active_length - 1)
                m.step(ctx)
                hits += ctx.cached_prefix_length
            for i, ctx in zip(ids, ctxs):
                ctx.update(int(gen[i, 0]))
                m.step(ctx)
            for s in range(1, DECODE_STEPS + 1):
                for ctx in ctxs:
                    m.alloc(ctx)
                for i, ctx in zip(ids, ctxs):
                    ctx.update(int(gen[i, s]))
                    m.step(ctx)
            busy += perf() - t0
            peak = max(peak, POOL_BLOCKS - m.block_count().free)
            t0 = perf()
            for ctx in ctxs:
                m.release(ctx)
            busy += perf() - t0
        return {"seconds": busy, "hit_tokens": hits, "peak_blocks": peak, "free_at_end": m.block_count().free}
    finally:
        gc.unfreeze()


def _replay_case(num_requests: int, repeat: int) -> dict:
    import kvfast
    import kvref

    prompts, gen, fp = peer_workload(num_requests if num_requests else NUM_REQUESTS)
    replay_manager(kvfast.PagedKVCacheManager, prompts[:WAVE], gen[:WAVE])  # load the kernels
    best = {}
    res = {}
    for r in range(repeat):
        for name, cls in ((("kvref", kvref.PagedKVCacheManager), ("kvfast", kvfast.PagedKVCacheManager))
                          if r % 2 == 0 else (("kvfast", kvfast.PagedKVCacheManager),
                                              ("kvref", kvref.PagedKVCacheManager))):
            out = replay_manager(cls, prompts, gen)
            best[name] = min(best.get(name, float("inf")), out["seconds"])
            res[name] = out
    same = (res["kvref"]["hit_tokens"], res["kvref"]["peak_blocks"]) == (res["kvfast"]["hit_tokens"],
                                                                         res["kvfast"]["peak_blocks"])
    n = len(prompts)
    return {
        "name": f"manager replay (peer workload, first {n} requests)",
        "metric": "kvref time / kvfast time",
        "ratio": best["kvref"] / best["kvfast"],
        "target": 10.0,
        "detail": (f"kvref {best['kvref'] / n * 1e6:.0f} us/req, kvfast {best['kvfast'] / n * 1e6:.0f} us/req; "
                   f"hits {res['kvfast']['hit_tokens']} peak {res['kvfast']['peak_blocks']} "
                   f"({'same' if same else 'DIFFERENT'} in kvref); fingerprint {fp}"),
        "hit_tokens": res["kvfast"]["hit_tokens"],
        "peak_blocks": res["kvfast"]["peak_blocks"],
        "agree": same,
    }


# --------------------------------------------------------------------------- manager configurations

#: The configurations of issue 12's table, then MAX's speculative decoding (spec/manager.md §15:
#: the loop sets ``k`` drafts after every sampled token, all rejected, so the tokens, hits and
#: peak stay those of the other rows), FP8 K/V (spec/manager.md §16) and a manager without prefix
#: caching (no hits): ``name -> KVCacheParams keyword arguments``.
MANAGER_CONFIGS = {
    "one full leaf": {},
    "data_parallel_degree=2": {"data_parallel_degree": 2},
    "host tier": {"host_offload_bytes": 64 << 20},
    "full + sliding window": {"leaves": "swa"},
    "full + recurrent": {"leaves": "rec"},
    "speculative (eagle, k=2)": {"speculative_method": "eagle", "num_draft_tokens": 2},
    "FP8 (float8_e4m3fn)": {"dtype": "float8_e4m3fn"},
    "no prefix caching": {"enable_prefix_caching": False},
}


def manager_params(config: str, page: int = BLOCK_SIZE):
    """The ``KVCacheParams`` of one row of :data:`MANAGER_CONFIGS` (a small page geometry)."""
    from kvspec import KVCacheParams, LeafSpec

    kw = dict(MANAGER_CONFIGS[config])
    leaves = kw.pop("leaves", None)
    if leaves == "swa":
        kw["leaves"] = {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(128)}
    elif leaves == "rec":
        kw["leaves"] = {"full": LeafSpec.full(), "rec": LeafSpec.recurrent((2, 4, 4))}
    return KVCacheParams(page_size=page, num_layers=1, kv_heads=1, head_dim=8, **kw)


def config_workload(num_requests: int, seed: int = 7):
    """Requests sharing 8 system prompts of 512 tokens, suffixes of 64..512 tokens, 16 sampled
    tokens each (a routing-free mix: request ``i`` goes to replica ``i % dp``)."""
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(0, VOCAB, size=(8, 512), dtype=np.int64)
    prompts = [np.concatenate([prefixes[rng.integers(0, 8)], rng.integers(0, VOCAB, int(rng.integers(64, 513)))])
               for _ in range(num_requests)]
    return prompts, rng.integers(0, VOCAB, size=(num_requests, 17), dtype=np.int64)


#: Prefill chunk of the scheduler loop when the manager asks for page-aligned chunks (recurrent leaves).
CHUNK = 256


def scheduler_loop(manager_cls, config: str, prompts, gen, *, wave: int = 16, num_blocks: int = 1200,
                   retention: Callable[[int], dict] | None = None,
                   clock: Callable[[str], float] | None = None) -> dict:
    """Drive ``manager_cls`` the way a scheduler does (issue 12): per wave, ``claim`` + ``alloc``
    (prefix hit), then forwards until every request sampled its tokens: ``alloc`` +
    ``runtime_inputs`` + the forward (prefill in chunks ending at multiples of ``CHUNK`` tokens when
    ``chunk_alignment_tokens`` asks, so recurrent checkpoints publish; then one sampled token and,
    with ``num_draft_tokens``, that many drafts for the next forward to verify, all rejected) +
    ``step``; finally ``release``. Returns the CPU seconds of this thread spent in manager calls
    (``time.thread_time``: the bookkeeping itself, not the tiers' worker threads, and not time
    lost to other processes on a loaded machine), hit tokens and peak blocks.

    ``num_blocks`` is the room **per leaf**: several leaves share one slab of huge blocks
    (spec/manager.md §13), so the manager gets ``num_blocks * len(leaves)`` of them and each leaf
    the room of the one-full-leaf row. ``retention(i)``: the ``retention_priority`` /
    ``retention_seconds`` keywords of request ``i``'s context (spec/manager.md §14).

    ``clock(phase)`` is read at the start and the end of each timed span, ``phase`` naming it
    (``"admit"``: claim + alloc of a wave, ``"grow"``, ``"inputs"``, ``"step"``, ``"release"``);
    the default reads ``time.thread_time``. ``benchmarks/instructions.py`` passes one that
    switches callgrind's counting on and off around the spans of one phase."""
    from kvspec import TextContext

    params = manager_params(config)
    dp = params.data_parallel_degree
    k = params.num_draft_tokens
    num_blocks *= len(params.leaves())
    gc.collect()
    m = manager_cls(params, num_blocks=num_blocks, max_batch_size=wave, max_seq_len=4096)
    gc.collect()
    gc.freeze()  # as replay_manager: time the bookkeeping, not collections of the workload's arrays
    align = m.chunk_alignment_tokens
    # CPU time of this thread: the bookkeeping, robust on a shared machine
    perf = (lambda phase: time.thread_time()) if clock is None else clock
    busy = 0.0
    hits = peak = 0
    try:
        for w0 in range(0, len(prompts), wave):
            ids = list(range(w0, min(w0 + wave, len(prompts))))
            ctxs = [TextContext(str(i), prompts[i], **(retention(i) if retention else {})) for i in ids]
            t0 = perf("admit")
            for i, ctx in zip(ids, ctxs):
                m.claim(ctx, i % dp)
                m.alloc(ctx)
                hits += ctx.cached_prefix_length
            busy += perf("admit") - t0
            sampled = [0] * len(ids)  # sampled tokens so far, per request
            first = True
            while True:
                live = [j for j in range(len(ids)) if sampled[j] < gen.shape[1]]
                if not live:
                    break
                t0 = perf("grow")
                if not first:
                    for j in live:
                        m.alloc(ctxs[j])
                first = False
                busy += perf("grow") - t0
                for j in live:  # chunked prefill at page-aligned 256-token boundaries when asked
                    ctx = ctxs[j]
                    if align and ctx.active_length > 1:
                        n = CHUNK - ctx.processed_length % CHUNK
                        if n < ctx.active_length:
                            ctx.chunk(n)
                t0 = perf("inputs")
                m.runtime_inputs([[ctxs[j] for j in live if ids[j] % dp == r] for r in range(dp)])
                busy += perf("inputs") - t0
                for j in live:  # the forward
                    ctx = ctxs[j]
                    if ctx.pending_length:
                        ctx.advance_chunk()
                    else:
                        ctx.update(int(gen[ids[j], sampled[j]]))
                        sampled[j] += 1
                        if k:  # the drafter's guesses for the next forward (spec/manager.md §15.2)
                            ctx.spec_decoding_state.draft_tokens_to_verify = [int(gen[ids[j], 0])] * k
                t0 = perf("step")
                for j in live:
                    m.step(ctxs[j])
                busy += perf("step") - t0
            _settle_offloads(m, dp)  # untimed: the peak counts the requests' pages, not copies in flight
            peak = max(peak, max(m.block_count(r).used for r in range(dp)))
            t0 = perf("release")
            for ctx in ctxs:
                m.release(ctx)
            busy += perf("release") - t0
    finally:
        gc.unfreeze()
        m.shutdown()
    return {"seconds": busy, "hit_tokens": hits, "peak_blocks": peak}


def _settle_offloads(m, dp: int, timeout: float = 60.0) -> None:
    """Poll until no page of any replica is pinned by a transfer (offload sources of released
    requests count as used until their copy completes, spec/manager.md §7.4): the peak is then
    the same whatever the tiers' worker threads managed meanwhile, in both packages."""
    deadline = time.monotonic() + timeout
    while any(m.pending_transfers_exist(r) for r in range(dp)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"scheduler_loop: transfers still pending after {timeout} s")
        time.sleep(0.0005)
        m.poll_transfers()


def _configs_case(num_requests: int, repeat: int) -> list[dict]:
    """One row per configuration of :data:`MANAGER_CONFIGS`. Each of the ``repeat`` rounds runs
    every configuration in both packages (kvref and kvfast alternating first), so a slow spell
    of a shared machine falls on every row of a round alike, not on one configuration's runs;
    each figure is the best of its rounds."""
    import kvfast
    import kvref

    prompts, gen = config_workload(num_requests)
    out = []
    base = None
    for config in MANAGER_CONFIGS:
        scheduler_loop(kvfast.PagedKVCacheManager, config, prompts[:16], gen[:16])  # load the kernels
    best: dict[tuple[str, str], float] = {}
    last: dict[tuple[str, str], dict] = {}
    order = (("kvref", kvref.PagedKVCacheManager), ("kvfast", kvfast.PagedKVCacheManager))
    for r in range(repeat):
        for config in MANAGER_CONFIGS:
            for name, cls in order if r % 2 == 0 else order[::-1]:
                last[config, name] = got = scheduler_loop(cls, config, prompts, gen)
                best[config, name] = min(best.get((config, name), float("inf")), got["seconds"])
    for config in MANAGER_CONFIGS:
        best_of = {name: best[config, name] for name, _ in order}
        res = {name: last[config, name] for name, _ in order}
        same = res["kvref"]["hit_tokens"] == res["kvfast"]["hit_tokens"] and \
            res["kvref"]["peak_blocks"] == res["kvfast"]["peak_blocks"]
        fast_us = best_of["kvfast"] / num_requests * 1e6
        base = fast_us if base is None else base
        out.append({
            "name": f"manager {config}",
            "metric": "kvref time / kvfast time",
            "ratio": best_of["kvref"] / best_of["kvfast"],
            "target": 10.0,
            "detail": (f"kvref {best_of['kvref'] / num_requests * 1e6:.0f} us/req, kvfast {fast_us:.0f} us/req "
                       f"({fast_us / base:.2f}x one full leaf, target <= 2); hits {res['kvfast']['hit_tokens']} "
                       f"peak {res['kvfast']['peak_blocks']} ({'same' if same else 'DIFFERENT'} in kvref)"),
            "kvfast_us_per_request": fast_us,
            "vs_one_full_leaf": fast_us / base,
            "hit_tokens": res["kvfast"]["hit_tokens"],
            "agree": same,
        })
    return out


# --------------------------------------------------------------------------- batch calls (spec/manager.md §17)

#: Every configuration of :data:`MANAGER_CONFIGS`, the five of issue 32's targets first (one full
#: leaf, two replicas, host tier, full + sliding, full + recurrent), then speculative decoding, FP8
#: and no prefix caching.
BATCH_CONFIGS = tuple(MANAGER_CONFIGS)


def decode_batch(manager_cls, config: str, *, rows: int = 256, steps: int = 16, batch: bool = True,
                 prompt: int = 200) -> dict:
    """``steps`` decode steps of ``rows`` running requests, one token each: ``alloc_many`` +
    ``TextContext.update_many`` + ``step_many`` (``batch``), or the loop of ``alloc`` + ``update``
    + ``step`` per request. The requests (``prompt`` tokens, 8 shared prefixes of 64, so the
    admissions hit) are admitted and prefilled untimed. Returns the CPU seconds of this thread in
    the timed calls, per step, and the hit tokens of the admissions."""
    from kvspec import TextContext

    params = manager_params(config)
    dp = params.data_parallel_degree
    rng = np.random.default_rng(11)
    prefixes = rng.integers(0, VOCAB, size=(8, 64), dtype=np.int64)
    per_row = -(-(prompt + steps + 1) // BLOCK_SIZE) + 2
    m = manager_cls(params, num_blocks=(rows // dp + 1) * per_row * len(params.leaves()) + 64,
                    max_batch_size=rows, max_seq_len=prompt + steps + 2)
    try:
        ctxs = []
        for i in range(rows):
            toks = np.concatenate([prefixes[i % 8], rng.integers(0, VOCAB, prompt - 64)])
            ctx = TextContext(str(i), toks)
            m.claim(ctx, i % dp)
            m.alloc(ctx)
            ctx.update(int(rng.integers(0, VOCAB)))
            m.step(ctx)
            ctxs.append(ctx)
        hits = sum(c.cached_prefix_length for c in ctxs)
        tokens = rng.integers(0, VOCAB, size=(steps, rows), dtype=np.int64)
        gc.collect()
        gc.freeze()
        t0 = time.thread_time()
        if batch:
            for s in range(steps):
                m.alloc_many(ctxs)
                TextContext.update_many(ctxs, tokens[s])
                m.step_many(ctxs)
        else:
            for s in range(steps):
                row = tokens[s].tolist()
                for ctx in ctxs:
                    m.alloc(ctx)
                for ctx, t in zip(ctxs, row):
                    ctx.update(t)
                for ctx in ctxs:
                    m.step(ctx)
        busy = time.thread_time() - t0
        gc.unfreeze()
        committed = m.get_metrics_aggregated().input_tokens
    finally:
        m.shutdown()
    return {"seconds_per_step": busy / steps, "hit_tokens": hits, "input_tokens": committed}


def _batch_case(rows: int, steps: int, repeat: int) -> list[dict]:
    """Per configuration of :data:`BATCH_CONFIGS`: a decode step of ``rows`` requests through
    kvfast's batch calls, against kvref's batch calls and against kvfast's per-request loop of the
    same calls, interleaved round by round (the order rotates), best of ``repeat``."""
    import kvfast
    import kvref

    variants = (("kvref batch", kvref.PagedKVCacheManager, True), ("kvfast batch", kvfast.PagedKVCacheManager, True),
                ("kvfast loop", kvfast.PagedKVCacheManager, False))
    for config in BATCH_CONFIGS:
        decode_batch(kvfast.PagedKVCacheManager, config, rows=8, steps=2)  # load the kernels
    best: dict[tuple[str, str], float] = {}
    seen: dict[tuple[str, str], dict] = {}
    for r in range(repeat):
        for config in BATCH_CONFIGS:
            k = r % len(variants)
            for name, cls, batch in variants[k:] + variants[:k]:
                seen[config, name] = got = decode_batch(cls, config, rows=rows, steps=steps, batch=batch)
                best[config, name] = min(best.get((config, name), float("inf")), got["seconds_per_step"])
    out = []
    for config in BATCH_CONFIGS:
        ref, fast, loop = (best[config, v[0]] for v in variants)
        same = len({(seen[config, v[0]]["hit_tokens"], seen[config, v[0]]["input_tokens"]) for v in variants}) == 1
        detail = (f"{rows} rows x 1 token: kvref batch {ref * 1e6:.0f} us/step, kvfast batch {fast * 1e6:.0f} us/step "
                  f"({fast / rows * 1e6:.2f} us/row), kvfast loop {loop * 1e6:.0f} us/step; hits "
                  f"{seen[config, 'kvfast batch']['hit_tokens']} ({'same' if same else 'DIFFERENT'} in every variant)")
        out.append({"name": f"decode step batch, {config}", "metric": "kvref batch / kvfast batch",
                    "ratio": ref / fast, "target": 30.0, "detail": detail, "agree": same,
                    "kvfast_us_per_step": fast * 1e6})
        out.append({"name": f"decode step batch vs loop, {config}", "metric": "kvfast loop / kvfast batch",
                    "ratio": loop / fast, "target": 10.0, "detail": detail, "agree": same,
                    "kvfast_us_per_step": fast * 1e6})
    return out


def _retention_rule(i: int) -> dict:
    """Mixed claims: even requests priority 80 for 30 s, every third one priority 10."""
    if i % 2 == 0:
        return {"retention_priority": 80, "retention_seconds": 30.0}
    return {"retention_priority": 10} if i % 3 == 0 else {}


def _retention_case(num_requests: int, repeat: int) -> dict:
    """kvfast's scheduler loop with mixed retention claims vs none, timed interleaved, on a pool
    that evicts (spec/manager.md §14.8: retention within 10 % of plain LRU per request)."""
    import kvfast

    prompts, gen = config_workload(num_requests)
    cls, cfg, nb = kvfast.PagedKVCacheManager, "one full leaf", 1200
    scheduler_loop(cls, cfg, prompts[:16], gen[:16], num_blocks=nb, retention=_retention_rule)  # kernels
    best = {"off": float("inf"), "on": float("inf")}
    res = {}
    for r in range(repeat):
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            res[name] = scheduler_loop(cls, cfg, prompts, gen, num_blocks=nb,
                                       retention=_retention_rule if name == "on" else None)
            best[name] = min(best[name], res[name]["seconds"])
    on_us, off_us = (best[k] / num_requests * 1e6 for k in ("on", "off"))
    return {
        "name": "manager retention",
        "metric": "LRU time / retention time",
        "ratio": best["off"] / best["on"],
        "target": 1 / 1.1,
        "detail": (f"kvfast {on_us:.0f} us/req with mixed priorities and TTLs, {off_us:.0f} us/req without "
                   f"(pool {nb} pages, evicting); hits {res['on']['hit_tokens']} vs {res['off']['hit_tokens']}"),
        "on_us_per_request": on_us,
        "off_us_per_request": off_us,
    }


# --------------------------------------------------------------------------- transformers (issue 33)

#: ``kvcache bench --only transformers``: label -> (``SlotKVCache`` keyword arguments, or None for
#: transformers' ``DynamicCache``; ``attn_implementation`` the model runs with).
TRANSFORMERS_VARIANTS = {
    "DynamicCache": (None, "sdpa"),
    "contiguous, kvfast": (dict(mode="contiguous"), "sdpa"),
    "contiguous, kvref": (dict(mode="contiguous", backend="kvref"), "sdpa"),
    "paged, kvfast": (dict(), "sdpa"),
    "paged, kvref": (dict(backend="kvref"), "sdpa"),
    "paged, kvfast, scatter=ops": (dict(scatter="ops"), "sdpa"),
    "paged, kvfast, kvcache attention": (dict(), "kvcache"),
}


def transformers_available() -> str | None:
    """None when torch and transformers import, else why not (the section is skipped)."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return f"{e.name or e} is not installed (pip install torch transformers)"
    return None


def tiny_llama(prompt: int = 32):
    """The section's model: a random Llama, 2 layers, hidden 64, 4 query / 2 K/V heads, vocabulary
    128 (nothing downloaded), and a ``[1, prompt]`` batch of token ids."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, prompt), generator=torch.Generator().manual_seed(1))
    return model, ids


class _Attention:
    """``with _Attention(model, name):`` the model runs ``attn_implementation=name``; restored after."""

    def __init__(self, model, name: str):
        self.model, self.name = model, name

    def __enter__(self):
        self.saved = self.model.config._attn_implementation
        if self.name != self.saved:
            self.model.set_attn_implementation(self.name)

    def __exit__(self, *exc):
        if self.name != self.saved:
            self.model.set_attn_implementation(self.saved)


def _transformers_cache(model, variant: str):
    """A fresh cache of ``variant`` (a :data:`TRANSFORMERS_VARIANTS` label) for ``model``."""
    from transformers import DynamicCache

    from .integrations.transformers import SlotKVCache

    kwargs, _ = TRANSFORMERS_VARIANTS[variant]
    return DynamicCache(config=model.config) if kwargs is None else SlotKVCache(model.config, **kwargs)


def _transformers_generate(model, ids, variant: str, new_tokens: int) -> float:
    """Seconds of one greedy ``model.generate`` of ``new_tokens`` with a fresh ``variant`` cache."""
    import torch

    from .integrations.transformers import _cache_kwarg

    with _Attention(model, TRANSFORMERS_VARIANTS[variant][1]), torch.no_grad():
        c = _transformers_cache(model, variant)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, do_sample=False, **{_cache_kwarg(model): c})
        return time.perf_counter() - t0


def transformers_decode(model, ids, variant: str, *, steps: int = 50) -> dict:
    """One timing of ``variant`` (a :data:`TRANSFORMERS_VARIANTS` label) on ``model``: greedy decode
    of batch 1 after ``ids``, a fresh cache each time.

    Returns ``forward`` (seconds per decode step of a manual greedy loop: one ``model(...)`` call on the
    last token and its argmax, the prefill outside the timing), ``generate_long`` /
    ``generate_short`` (seconds of ``model.generate`` for ``steps + 1`` and 1 new tokens: their
    difference over ``steps`` is ``generate``'s cost per decode step) and ``tokens`` (the decode
    loop's tokens, equal for every variant).
    """
    import torch

    from .integrations.transformers import _cache_kwarg

    name = _cache_kwarg(model)
    with _Attention(model, TRANSFORMERS_VARIANTS[variant][1]), torch.no_grad():
        c = _transformers_cache(model, variant)
        out = model(input_ids=ids, use_cache=True, **{name: c})
        tok = out.logits[:, -1:].argmax(-1)
        tokens, n = [int(tok)], ids.shape[1]
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=tok, position_ids=torch.tensor([[n]]), use_cache=True, **{name: c})
            tok = out.logits[:, -1:].argmax(-1)
            tokens.append(int(tok))
            n += 1
        forward = (time.perf_counter() - t0) / steps
    return {"forward": forward, "generate_long": _transformers_generate(model, ids, variant, steps + 1),
            "generate_short": _transformers_generate(model, ids, variant, 1), "tokens": tokens}


def _transformers_case(repeat: int, steps: int) -> list[dict]:
    """Per decode step, every :data:`TRANSFORMERS_VARIANTS` cache against ``DynamicCache``, all
    interleaved in one run (the order reversed every other round), torch on one thread; the best of
    ``repeat`` timings of each. Target: a step at most 1.1x ``DynamicCache``'s (issue 33)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, ids = tiny_llama()
        names = list(TRANSFORMERS_VARIANTS)
        best = {v: {"forward": float("inf"), "generate_long": float("inf"), "generate_short": float("inf")}
                for v in names}
        tokens = {}
        for v in names:  # warm: kernels, allocator, the first forward of each path
            transformers_decode(model, ids, v, steps=min(steps, 4))
        for r in range(repeat):
            for v in (names if r % 2 == 0 else names[::-1]):
                got = transformers_decode(model, ids, v, steps=steps)
                tokens[v] = got.pop("tokens")
                for k, t in got.items():
                    best[v][k] = min(best[v][k], t)
    finally:
        torch.set_num_threads(threads)

    def per_step(v):
        b = best[v]
        return b["forward"], max(b["generate_long"] - b["generate_short"], 0.0) / steps

    f0, g0 = per_step("DynamicCache")
    rows = []
    for v in names[1:]:
        f, g = per_step(v)
        same = tokens[v] == tokens["DynamicCache"]
        rows.append({
            "name": f"transformers decode, {v}",
            "metric": "DynamicCache / cache per step",
            "ratio": f0 / f,
            "target": 1 / 1.1,
            "detail": (f"model forward {f * 1e6:.0f} us/step = {f / f0:.2f}x DynamicCache's {f0 * 1e6:.0f} us; "
                       f"generate {g * 1e6:.0f} us/step = {g / g0 if g0 else float('nan'):.2f}x "
                       f"{g0 * 1e6:.0f} us ({steps} steps, batch 1, 1 thread); tokens "
                       f"{'equal' if same else 'DIFFER'}"),
            "agree": same,
            "forward_us_per_step": f * 1e6,
            "generate_us_per_step": g * 1e6,
            "dynamic_forward_us_per_step": f0 * 1e6,
            "dynamic_generate_us_per_step": g0 * 1e6,
        })
    return rows


# --------------------------------------------------------------------------- table


def run_bench(*, quick: bool = False, replay_requests: int = 128, only: Sequence[str] | None = None) -> list[dict]:
    """Measure every row of the ratio table in this process.

    Parameters
    ----------
    quick : bool
        Fewer repetitions (a smoke run; ratios are noisier).
    replay_requests : int
        Requests of the peer workload replayed through both managers
        (kvref needs ~50 ms per request; 0 means all 2000).
    only : sequence of str, optional
        Subset of ``{"append", "prepare", "attention", "replay", "configs", "retention", "batch",
        "transformers"}`` (``attention``: ``ops.varlen_attention`` and ``ops.paged_attention`` of a
        decode and a prefill step, kvfast against kvref; ``retention``: kvfast with and without retention claims, interleaved; ``configs``: one
        manager row per configuration of :data:`MANAGER_CONFIGS`, the scheduler loop of issue 12;
        ``batch``: a decode step of 256 requests through the batch calls, spec/manager.md §17,
        per configuration of :data:`BATCH_CONFIGS`, against kvref's and the per-request loop;
        ``transformers``: a tiny Llama's decode step with each :data:`TRANSFORMERS_VARIANTS` cache
        against ``DynamicCache``, skipped with a message on stderr when torch or transformers is
        not installed).

    Returns
    -------
    list of dict
        One per row: ``name``, ``metric``, ``ratio``, ``target``, ``met``, ``detail``.
    """
    only = set(only or SECTIONS)
    rep = 3 if quick else 15
    rows = []
    if "append" in only:
        rows.append(_append_case(256, 1, rep, 20 if quick else 200))
        rows.append(_append_case(8, 1024, rep, 2 if quick else 10))
    if "prepare" in only:
        rows.append(_prepare_case(256, rep, 5 if quick else 50))
        rows.append(_prepare_case(256, rep, 5 if quick else 50, as_lists=True))
    if "attention" in only:
        rows.append(_attention_case(16, 1, rep, 5 if quick else 50))
        rows.append(_attention_case(2, 64, 3 if quick else rep, 1 if quick else 5))
        rows.append(_paged_attention_case(16, 1, rep, 5 if quick else 50))
        rows.append(_paged_attention_case(2, 64, 3 if quick else rep, 1 if quick else 5))
    if "replay" in only:
        rows.append(_replay_case(min(replay_requests, 64) if quick else replay_requests, 1 if quick else 3))
    if "configs" in only:
        rows += _configs_case(32 if quick else 64, 1 if quick else 5)
    if "retention" in only:
        rows.append(_retention_case(32 if quick else 128, 2 if quick else 5))
    if "batch" in only:
        rows += _batch_case(256, 4 if quick else 16, 1 if quick else 5)
    if "transformers" in only:
        missing = transformers_available()
        if missing:
            print(f"kvcache bench: skipping the transformers section: {missing}", file=sys.stderr)
        else:
            rows += _transformers_case(2 if quick else 15, 8 if quick else 50)
    for r in rows:
        r["met"] = r["ratio"] >= r["target"]
    return rows


def print_table(rows: list[dict], file=None) -> None:
    """Print the ratio table (one line per row, then its detail)."""
    w = max(len(r["name"]) for r in rows) if rows else 10
    print(f"{'benchmark':<{w}}  {'metric':<27} {'ratio':>8} {'target':>8}  met", file=file)
    for r in rows:
        print(f"{r['name']:<{w}}  {r['metric']:<27} {r['ratio']:>8.2f} {r['target']:>8.2f}  "
              f"{'yes' if r['met'] else 'NO'}", file=file)
        print(f"{'':<{w}}    {r['detail']}", file=file)


def main(argv: Sequence[str] | None = None) -> int:
    """``kvcache bench [--quick] [--replay-requests N]
    [--only append,prepare,attention,replay,configs,retention,batch,transformers] [--json PATH]``."""
    ap = argparse.ArgumentParser(prog="kvcache bench", description="kvfast vs kvref / numpy ratio table, one run")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    ap.add_argument("--replay-requests", type=int, default=128,
                    help="peer-workload requests replayed through both managers (0 = all 2000)")
    ap.add_argument("--only", default="", help=f"comma list of {','.join(SECTIONS)}")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(list(argv) if argv is not None else None)
    if args.replay_requests < 0:
        ap.error(f"--replay-requests={args.replay_requests}, must be >= 0")
    only = [x for x in args.only.split(",") if x] or None
    bad = set(only or ()) - set(SECTIONS)
    if bad:
        ap.error(f"--only: unknown {sorted(bad)}, choose from {','.join(SECTIONS)}")
    rows = run_bench(quick=args.quick, replay_requests=args.replay_requests, only=only)
    print_table(rows)
    if args.json:
        from .metadata import machine_metadata

        with open(args.json, "w") as f:
            json.dump({"metadata": machine_metadata(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":  # python -m kvcache.bench
    raise SystemExit(main())
