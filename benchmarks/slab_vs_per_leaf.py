"""One shared slab against per-leaf pools of the same bytes, on a hybrid sliding-window model.

spec/manager.md §13.6. A Gemma-3-like model (a full-attention leaf beside a
sliding-window leaf of ``--window`` tokens; the model's 5:1 sliding:full layer
split changes the bytes of a page, not which leaf needs how many pages) is
served by a small FCFS scheduler: admit waiting requests while ``alloc``
succeeds (prefill in chunks of ``--chunk`` tokens), decode every running
request, preempt the newest on ``InsufficientBlocksError``, release finished
ones. Requests share one of a few system prompts, so prefix hits happen.

Layouts at **equal bytes** (``--pages`` pages of each leaf for per-leaf pools):

* ``per_leaf``: each leaf its own pool of ``pages`` pages (null included),
  the layout before the slab; this script rebuilds it by turning the slab off
  (``kvref._manager._slab_geometry`` -> None, the single-leaf path);
* ``slab``: one slab of ``2 * pages - 1`` huge blocks (one null instead of
  two), pages flowing to whichever leaf needs them.

Reports the peak and mean number of requests running, scheduler steps to
drain the queue, preemptions, and the token hit rate (cached prompt tokens /
prompt tokens). Bookkeeping-only managers (``allocate_buffers=False``): block
ids, hits and evictions are exactly those of a manager with bytes.

    python benchmarks/slab_vs_per_leaf.py [--requests 96] [--pages 512] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager

import numpy as np


def workload(n: int, seed: int, page: int) -> list[tuple[list[int], int]]:
    """(prompt, tokens to generate): 4 system prompts of 512 tokens, then 256..3072 own tokens."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(1, 30000, 512).tolist() for _ in range(4)]
    out = []
    for _ in range(n):
        own = rng.integers(1, 30000, int(rng.integers(256, 3072))).tolist()
        out.append((systems[int(rng.integers(0, 4))] + own, int(rng.integers(16, 96))))
    return out


@contextmanager
def per_leaf_pools():
    """The pre-slab layout: every leaf its own pool of ``num_blocks`` pages."""
    import kvref._manager as mgr

    saved = mgr._slab_geometry
    mgr._slab_geometry = lambda params, leaves: None
    try:
        yield
    finally:
        mgr._slab_geometry = saved


def serve(manager, requests, chunk: int, max_running: int) -> dict:
    """FCFS: admit while alloc succeeds, decode all, preempt the newest when short; returns counters."""
    from kvspec import InsufficientBlocksError, TextContext

    waiting = list(range(len(requests)))
    running: list[tuple[int, TextContext, int]] = []  # (request, ctx, tokens generated)
    steps = preemptions = prompt_tokens = hit_tokens = computed = 0
    admitted: set[int] = set()
    concurrency = []
    serial = 0
    while waiting or running:
        steps += 1
        # admissions, in order, while they fit
        while waiting and len(running) < max_running:
            i = waiting[0]
            serial += 1
            ctx = TextContext(f"{i}.{serial}", list(requests[i][0]))
            manager.claim(ctx)
            if ctx.active_length > chunk:
                ctx.chunk(chunk)
            try:
                manager.alloc(ctx)
            except InsufficientBlocksError:
                manager.release(ctx)
                break
            waiting.pop(0)
            if i not in admitted:  # the hit rate counts first admissions (a re-admission hits itself)
                admitted.add(i)
                prompt_tokens += len(ctx)
                hit_tokens += ctx.cached_prefix_length
            running.append((i, ctx, 0))
        concurrency.append(len(running))
        # one forward over every running request
        nxt = []
        for i, ctx, done in running:
            computed += ctx.active_length
            if ctx.pending_length:
                ctx.advance_chunk()
            else:
                ctx.update(7)
                done += 1
            manager.step(ctx)
            if done >= requests[i][1]:
                manager.release(ctx)
                continue
            nxt.append((i, ctx, done))
        running = []
        while nxt:  # the next forward's pages, oldest first; short: preempt the newest (recompute later)
            i, ctx, done = nxt.pop(0)
            if ctx.active_length > chunk:
                ctx.chunk(chunk)
            while True:
                try:
                    manager.alloc(ctx)
                except InsufficientBlocksError:
                    vi, vctx, _ = nxt.pop() if nxt else (i, ctx, done)
                    manager.release(vctx)
                    waiting.insert(0, vi)
                    preemptions += 1
                    if vctx is ctx:
                        break
                    continue
                running.append((i, ctx, done))
                break
    return {
        "steps": steps, "preemptions": preemptions, "peak_running": max(concurrency),
        "mean_running": round(float(np.mean(concurrency)), 2),
        "hit_rate": round(hit_tokens / max(prompt_tokens, 1), 4), "computed_tokens": computed,
    }


def capacity(manager, length: int, chunk: int) -> int:
    """How many requests of ``length`` distinct tokens are resident at once after their chunked
    prefill (admitted in order until one no longer fits; nothing preempted)."""
    from kvspec import InsufficientBlocksError, TextContext

    n = 0
    while True:
        ctx = TextContext(f"c{n}", list(range(n * length + 1, (n + 1) * length + 1)))
        manager.claim(ctx)
        try:
            while True:
                if ctx.active_length > chunk:
                    ctx.chunk(chunk)
                manager.alloc(ctx)
                if not ctx.pending_length:
                    break
                ctx.advance_chunk()
                manager.step(ctx)
        except InsufficientBlocksError:
            manager.release(ctx)
            return n
        n += 1


def build(layout: str, args):
    from kvspec import KVCacheParams, LeafSpec

    import kvfast

    params = KVCacheParams(page_size=args.page, num_layers=4, kv_heads=2, head_dim=64, dtype="bfloat16",
                           leaves={"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(args.window)},
                           allocate_buffers=False)
    kw = {"max_batch_size": 256, "max_seq_len": 4096}
    if layout == "slab":
        return kvfast.PagedKVCacheManager(params, num_blocks=2 * args.pages - 1, **kw)
    with per_leaf_pools():
        return kvfast.PagedKVCacheManager(params, num_blocks=args.pages, **kw)


def run(layout: str, args) -> dict:
    out = {f"resident_{n}": capacity(build(layout, args), n, args.chunk) for n in (1024, 2048, 4096)}
    out.update(serve(build(layout, args), workload(args.requests, args.seed, args.page), args.chunk,
                     args.max_running))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--pages", type=int, default=512, help="pages per leaf of the per-leaf layout")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = {layout: run(layout, args) for layout in ("per_leaf", "slab")}
    g = build("slab", args).slab_geometry
    out["geometry"] = {"huge_bytes": g.huge_bytes, "ratios": g.ratios, "page_bytes": g.page_bytes,
                       "padded_bytes": g.padded_bytes}
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        print()
    else:
        for layout, r in out.items():
            print(f"{layout:10s} " + "  ".join(f"{k}={v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
