"""Continuous batching over kvcache: the decoder served by a slot cache or by the request manager.

Both servers run the same scheduler shape as vLLM or SGLang, shrunk to a
page of code each:

* waiting requests are admitted while there is room (a free slot or batch
  row), taking their cached prefix (``KVCache.admit`` /
  ``PagedKVCacheManager.alloc``);
* every step batches all running requests: a prefill chunk of at most
  ``chunk_size`` tokens for a request still reading its prompt, one token for
  a decoding one;
* out of blocks (``CapacityError`` / ``InsufficientBlocksError``, which
  change nothing), the youngest running request is preempted: its full blocks
  are published (``retire`` / ``release`` after ``step``), it goes back to the
  front of the queue and is re-admitted later, recomputing only what the
  cache no longer holds;
* a follow-up turn (``Request.parent``) starts once its parent has finished,
  with the parent's whole conversation as its prompt, so it hits the blocks
  the parent published.

Sampling is greedy. Each server records every request's tokens and the
logits each token was chosen from, and :class:`ServeStats` counts what the
cache did (prefix hits, evictions seen, preemptions, chunked prefills) so a
test can assert that they happened.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .model import Decoder, PagedTableAttention, SlotCacheAttention, layer_specs_for, to_host

__all__ = ["Request", "ServeStats", "ServeResult", "SlotCacheServer", "ManagerServer",
           "reference_run", "compare", "chat_workload", "ngram_drafter"]


@dataclass(frozen=True)
class Request:
    """One request (one conversation turn).

    Parameters
    ----------
    request_id : str
    prompt : sequence of int
        First turn: the whole prompt. Follow-up: the new user tokens only.
    max_new_tokens : int
        Tokens to generate (greedy), >= 1.
    parent : str, optional
        A follow-up of this request: its prompt is the parent's tokens
        (prompt and generated) followed by ``prompt``.
    """

    request_id: str
    prompt: tuple
    max_new_tokens: int
    parent: Optional[str] = None


@dataclass
class ServeStats:
    """What the cache did in a run (counted by the server, from public API observations)."""

    steps: int = 0                     #: forwards run
    prefix_hit_tokens: int = 0         #: tokens taken from the cache at admissions
    admissions_with_hit: int = 0       #: admissions whose hit was > 0
    evicted_admissions: int = 0        #: admissions whose device hit was below what an infinite cache would hold
    preemptions: int = 0               #: running requests sent back to the queue for lack of blocks
    readmissions: int = 0              #: admissions of a preempted request
    chunked_prefill_steps: int = 0     #: forwards in which a row read only part of its remaining prompt
    external_hit_blocks: int = 0       #: blocks loaded from an offload tier (manager with tiers)
    draft_tokens: int = 0              #: speculative tokens proposed by the drafter
    accepted_draft_tokens: int = 0     #: of those, tokens the target model confirmed


@dataclass
class ServeResult:
    """Per request: the prompt served, the generated tokens, and float32 logits ``[max_new_tokens, vocab]``."""

    prompts: dict = field(default_factory=dict)
    tokens: dict = field(default_factory=dict)
    logits: dict = field(default_factory=dict)
    stats: ServeStats = field(default_factory=ServeStats)


class _Live:
    """Scheduler state of one request."""

    def __init__(self, req: Request, prompt: list[int]):
        self.req = req
        self.prompt = list(prompt)
        self.tokens = list(prompt)        # prompt + generated; the last generated one is not yet fed
        self.generated: list[int] = []
        self.logits: list[np.ndarray] = []
        self.computed = 0                 # tokens whose K/V are in the cache (slot server)
        self.preempted = False
        self.ctx = None                   # TextContext (manager server)
        self.replica = 0                  # data-parallel replica (manager server)

    @property
    def done(self) -> bool:
        return len(self.generated) == self.req.max_new_tokens

    def sample(self, logits: np.ndarray) -> int:
        tok = int(np.argmax(logits))
        self.generated.append(tok)
        self.logits.append(np.asarray(logits, np.float32).copy())
        self.tokens.append(tok)
        return tok


def _prompt_of(req: Request, finished: dict) -> list[int]:
    if req.parent is None:
        return list(req.prompt)
    parent = finished[req.parent]
    return list(parent.tokens) + list(req.prompt)


class _PrefixLedger:
    """Every block-aligned prefix ever published: the hit an infinite cache would give."""

    def __init__(self, block: int):
        self.block = block
        self.keys: set = set()

    def publish(self, tokens: Sequence[int], n_blocks: int) -> None:
        for i in range(1, n_blocks + 1):
            self.keys.add(tuple(tokens[: i * self.block]))

    def ideal_hit(self, tokens: Sequence[int]) -> int:
        k = 0
        while (k + 1) * self.block <= len(tokens) - 1 and tuple(tokens[: (k + 1) * self.block]) in self.keys:
            k += 1
        return k * self.block


def _validate_requests(requests: Sequence[Request]) -> list[Request]:
    seen = set()
    for r in requests:
        if not isinstance(r, Request):
            raise TypeError(f"serve: requests contains {type(r).__name__}, must be Request")
        if r.request_id in seen:
            raise ValueError(f"serve: request_id={r.request_id!r} appears twice")
        if r.parent is not None and r.parent not in seen:
            raise ValueError(f"serve: request_id={r.request_id!r} has parent={r.parent!r}, which must come earlier")
        if r.max_new_tokens < 1:
            raise ValueError(f"serve: request_id={r.request_id!r} max_new_tokens={r.max_new_tokens} must be >= 1")
        seen.add(r.request_id)
    return list(requests)


class SlotCacheServer:
    """Serve the decoder through a ``KVCache`` (paged with prefix reuse, or contiguous).

    Parameters
    ----------
    kvpkg : module
        ``kvref`` or ``kvfast``.
    model : Decoder
    mode : {"paged", "contiguous"}
    max_seqs, max_seq_len : int
        Slots and tokens per slot.
    block_size, num_blocks : int
        Paged geometry (``num_blocks`` small enough to evict).
    dtype : {"float32", "bfloat16", "float16"}
        K/V storage dtype.
    chunk_size : int
        Largest prefill chunk of one row in one step.
    past_offset : int
        Fault injection: added to the rotary position of every token that has
        cached history before it (an engine that miscounts the cached length).
    on_admit : callable, optional
        Fault injection: ``on_admit(cache, slot, hit)`` after each admission.
    device : str
        ``"cpu"`` or ``"cuda[:N]"`` (kvfast): the cache's device; the model
        stays in NumPy and the binding copies q/k/v over.
    drafter : callable, optional
        Speculative decoding: ``drafter(request_id, tokens) -> proposed next
        tokens``. A decoding row then feeds its last token plus up to
        ``num_draft`` drafts in one forward; the target's greedy choices are
        taken while they equal the drafts (plus one), and ``update_position``
        commits only the verified length (the rejected drafts' K/V are
        overwritten later). Greedy output is the same as without drafts.
    num_draft : int
        Most draft tokens per step (>= 1 with a drafter).
    """

    def __init__(self, kvpkg, model: Decoder, *, mode: str = "paged", max_seqs: int = 4, max_seq_len: int = 64,
                 block_size: int = 4, num_blocks: int = 0, dtype: str = "float32", chunk_size: int = 8,
                 past_offset: int = 0, on_admit: Optional[Callable] = None, device: str = "cpu",
                 drafter: Optional[Callable] = None, num_draft: int = 3):
        if mode not in ("paged", "contiguous"):
            raise ValueError(f"SlotCacheServer: mode={mode!r}, must be 'paged' or 'contiguous'")
        if chunk_size < 1:
            raise ValueError(f"SlotCacheServer: chunk_size={chunk_size} must be >= 1")
        if drafter is not None and not callable(drafter):
            raise TypeError(f"SlotCacheServer: drafter={drafter!r}, must be callable or None")
        if drafter is not None and num_draft < 1:
            raise ValueError(f"SlotCacheServer: num_draft={num_draft} must be >= 1 with a drafter")
        self.drafter, self.num_draft = drafter, num_draft
        cfg = model.config
        self.kv, self.model, self.chunk_size = kvpkg, model, chunk_size
        self.past_offset, self.on_admit = past_offset, on_admit
        self.paged = mode == "paged"
        kmode = kvpkg.KVCacheMode.PAGED if self.paged else kvpkg.KVCacheMode.CONTIGUOUS
        self.cache = kvpkg.KVCache.make(
            kvpkg.KVCacheConfig(num_layers=cfg.num_layers, max_seqs=max_seqs, max_seq_len=max_seq_len,
                                mode=kmode, block_size=block_size, num_blocks=num_blocks, dtype=dtype,
                                device=device),
            layer_specs_for(kvpkg, cfg))
        self.block_size = block_size

    def serve(self, requests: Sequence[Request]) -> ServeResult:
        """Serve every request to completion; return tokens, logits and stats."""
        requests = _validate_requests(requests)
        cache, kv, res, stats = self.cache, self.kv, ServeResult(), ServeResult().stats
        res.stats = stats
        ledger = _PrefixLedger(self.block_size)
        waiting: deque = deque(requests)
        running: dict[int, _Live] = {}            # slot -> request, in admission order
        finished: dict[str, _Live] = {}
        max_seqs = cache.config.max_seqs
        while waiting or running:
            # 1. admit: a free slot and a finished parent
            for item in list(waiting):
                if len(running) == max_seqs:
                    break
                live = item if isinstance(item, _Live) else None
                req = live.req if live else item
                if req.parent is not None and req.parent not in finished:
                    continue
                if live is None:
                    live = _Live(req, _prompt_of(req, finished))
                slot = min(set(range(max_seqs)) - set(running))
                hit = 0
                if self.paged:
                    ideal = ledger.ideal_hit(live.tokens)
                    hit = cache.admit(slot, live.tokens)           # longest cached run of whole blocks
                    stats.evicted_admissions += hit < ideal
                stats.prefix_hit_tokens += hit
                stats.admissions_with_hit += hit > 0
                stats.readmissions += live.preempted
                live.computed = hit
                if self.on_admit is not None:
                    self.on_admit(cache, slot, hit)
                running[slot] = live
                waiting.remove(item)
            # 2. schedule and reserve; out of blocks -> preempt the youngest and retry
            while True:
                rows = [(slot, live, self._feed(live, stats)) for slot, live in running.items()]
                try:
                    step = cache.prepare_step(np.concatenate([[0], np.cumsum([len(f) for _, _, f in rows])]),
                                              [live.computed for _, live, _ in rows], [s for s, _, _ in rows])
                    break
                except kv.CapacityError:
                    if len(running) == 1:
                        raise RuntimeError("SlotCacheServer: one request does not fit the pool; "
                                           f"num_blocks={cache.config.num_blocks} is too small") from None
                    slot, victim = list(running.items())[-1]
                    self._preempt(slot, victim, ledger)
                    del running[slot]
                    waiting.appendleft(victim)
                    stats.preemptions += 1
            # 3. forward: write K/V and attend through the cache
            feed = np.concatenate([f for _, _, f in rows])
            positions = to_host(step.positions).astype(np.int64)
            if self.past_offset:
                positions = positions + self.past_offset * (positions >= 1)
            # logits of the last token of each row; of every token of a row that carries draft tokens
            cu = to_host(step.cu_seqlens_q).astype(np.int64)
            wanted = [np.arange(cu[b], cu[b + 1]) if len(f) > 1 and live.computed + 1 == len(live.tokens)
                      else np.array([cu[b + 1] - 1]) for b, (_, live, f) in enumerate(rows)]
            logits = self.model.forward(feed, positions, SlotCacheAttention(kv.ops, cache, step),
                                        logits_rows=np.concatenate(wanted))
            stats.steps += 1
            stats.chunked_prefill_steps += any(live.computed + len(f) < len(live.tokens) for _, live, f in rows)
            # 4. commit, sample (verify drafts), finish
            at = 0
            for slot, live, f in rows:
                row_logits = logits[at: at + (len(f) if live.computed + 1 == len(live.tokens) and len(f) > 1 else 1)]
                at += len(row_logits)
                if live.computed + len(f) < len(live.tokens):          # a prefill chunk: nothing sampled
                    live.computed += len(f)
                    cache.update_position(slot, live.computed)
                    continue
                drafts = list(f[len(live.tokens) - live.computed:])    # tokens fed after the real ones
                for i, lg in enumerate(row_logits[-(len(drafts) + 1):]):
                    tok = live.sample(lg)                              # greedy: the target's own choice
                    if live.done or i == len(drafts) or tok != drafts[i]:
                        break
                    stats.accepted_draft_tokens += 1
                # every token but the last sampled one has been fed and verified; rejected drafts
                # are rolled back by committing a shorter length (their K/V are overwritten later)
                live.computed = len(live.tokens) - 1
                cache.update_position(slot, live.computed)
                if live.done:
                    self._finish(slot, live, ledger)
                    del running[slot]
                    finished[live.req.request_id] = live
            kv.check_invariants(cache)
        for rid, live in finished.items():
            res.prompts[rid], res.tokens[rid], res.logits[rid] = live.prompt, live.generated, np.stack(live.logits)
        return res

    def _feed(self, live: _Live, stats: ServeStats) -> np.ndarray:
        """This step's tokens of a row: a prefill chunk, or the last sampled token plus drafts."""
        remaining = len(live.tokens) - live.computed
        if remaining > 1 or self.drafter is None:
            return np.asarray(live.tokens[live.computed: live.computed + min(remaining, self.chunk_size)])
        room = min(self.num_draft, live.req.max_new_tokens - len(live.generated) - 1,
                   self.cache.config.max_seq_len - len(live.tokens))
        drafts = [int(t) for t in self.drafter(live.req.request_id, list(live.tokens))][: max(room, 0)]
        stats.draft_tokens += len(drafts)
        return np.asarray(live.tokens[live.computed:] + drafts)

    def _preempt(self, slot: int, live: _Live, ledger: _PrefixLedger) -> None:
        self._finish(slot, live, ledger)       # publish what it computed; re-admission hits it
        live.computed = 0
        live.preempted = True

    def _finish(self, slot: int, live: _Live, ledger: _PrefixLedger) -> None:
        if self.paged:
            self.cache.retire(slot, live.tokens)   # publishes the full blocks below seq_len, frees the slot
            ledger.publish(live.tokens, live.computed // self.block_size)
        else:
            self.cache.evict_batch(slot)


class ManagerServer:
    """Serve the decoder through a ``PagedKVCacheManager`` and its ``runtime_inputs``.

    Parameters
    ----------
    kvpkg : module
        ``kvref`` or ``kvfast``.
    model : Decoder
    num_blocks, max_batch_size, max_seq_len, page_size : int
    dtype : {"float32", "bfloat16", "float16"}
    host_bytes : int
        Host tier size (a ``TieredConnector`` is built from the params); 0 = none.
    disk_bytes : int
        Disk tier size; 0 = none.
    disk_dir : str, optional
        Directory of the disk tier (needed when ``disk_bytes > 0``).
    replicas : int
        Data-parallel replicas (``data_parallel_degree``), each with its own
        pages and its own batch of at most ``max_batch_size`` requests and its
        own forward; requests are placed round-robin, so a prefix that only the
        other replica holds is copied across (``cross_replica_blocks_copied``).
    chunk_size : int
        Largest prefill chunk of one request in one step.
    past_offset : int
        Fault injection, as in :class:`SlotCacheServer`.
    on_admit : callable, optional
        Fault injection: ``on_admit(mgr, ctx)`` after each admission's ``alloc``.
    device : str
        ``"cpu"`` or ``"cuda[:N]"`` (kvfast): where the manager's pages live.
    """

    def __init__(self, kvpkg, model: Decoder, *, num_blocks: int = 24, max_batch_size: int = 4,
                 max_seq_len: int = 64, page_size: int = 4, dtype: str = "float32", host_bytes: int = 0,
                 chunk_size: int = 8, past_offset: int = 0, on_admit: Optional[Callable] = None,
                 device: str = "cpu", disk_bytes: int = 0, disk_dir: Optional[str] = None, replicas: int = 1):
        if chunk_size < 1:
            raise ValueError(f"ManagerServer: chunk_size={chunk_size} must be >= 1")
        if replicas < 1:
            raise ValueError(f"ManagerServer: replicas={replicas} must be >= 1")
        self.replicas, self._next_replica = replicas, 0
        cfg = model.config
        self.kv, self.model, self.chunk_size = kvpkg, model, chunk_size
        self.past_offset, self.on_admit = past_offset, on_admit
        self.page_size, self.max_batch_size = page_size, max_batch_size
        # one leaf per kind of layer: "full", and "swa<w>" for each sliding window w
        self.layer_leaf = ["full" if w is None else f"swa{w}" for w in cfg.windows]
        leaves = None
        if any(w is not None for w in cfg.windows):
            leaves = {leaf: (kvpkg.LeafSpec.full() if w is None else kvpkg.LeafSpec.sliding_window(w))
                      for leaf, w in zip(self.layer_leaf, cfg.windows)}
        params = kvpkg.KVCacheParams(page_size=page_size, num_layers=cfg.num_layers, kv_heads=cfg.kv_heads,
                                     head_dim=cfg.head_dim, dtype=dtype, host_offload_bytes=host_bytes,
                                     disk_offload_bytes=disk_bytes, disk_offload_dir=disk_dir, leaves=leaves,
                                     data_parallel_degree=replicas)
        self.mgr = kvpkg.PagedKVCacheManager(params, num_blocks=num_blocks, max_batch_size=max_batch_size,
                                             max_seq_len=max_seq_len, device=device)

    def _chunk(self, ctx) -> None:
        if ctx.active_length > self.chunk_size:
            ctx.chunk(self.chunk_size)

    def _admit(self, live: _Live, ledger: _PrefixLedger, stats: ServeStats) -> bool:
        mgr, ps = self.mgr, self.page_size
        ctx = live.ctx
        mgr.claim(ctx, live.replica)
        # chunk after the hit: the hit is taken at the first alloc, capped by the active length
        hits = mgr.get_prefix_cache_hit_counts(ctx)[live.replica]
        if self.replicas > 1:   # a peer's blocks are copied over at the hit (a single full leaf)
            hits = max(mgr.get_prefix_cache_hit_counts(ctx), key=lambda h: h.total_blocks)
        expect = min(hits.total_blocks, (ctx.active_length - 1) // ps) * ps
        if expect + self.chunk_size < ctx.active_length:
            ctx.chunk(expect + self.chunk_size)
        ideal = ledger.ideal_hit(ctx.tokens)
        try:
            transfer = mgr.alloc(ctx)
        except self.kv.InsufficientBlocksError:
            mgr.release(ctx)
            ctx.reset()
            return False
        if not transfer.is_complete():
            transfer.synchronize()             # a tier load: the forward must wait for it
        hit, external = ctx.cached_prefix_length, ctx.cached_prefix_external_length
        stats.prefix_hit_tokens += hit
        stats.admissions_with_hit += hit > 0
        stats.evicted_admissions += hit - external < ideal
        stats.external_hit_blocks += external // ps
        stats.readmissions += live.preempted
        if self.on_admit is not None:
            self.on_admit(mgr, ctx)
        return True

    def _wait_for_pages(self, waiting) -> None:
        """The only request (the head of ``waiting``) does not fit: only in-flight tier transfers
        (which pin pages) can free pages now; wait for them, else the pool is too small."""
        mgr = self.mgr
        if not any(mgr.pending_transfers_exist(r) for r in range(self.replicas)):
            head = waiting[0].req if isinstance(waiting[0], _Live) else waiting[0]
            raise RuntimeError(f"ManagerServer: request_id={head.request_id!r} does not fit an idle pool of "
                               f"{mgr.block_count().total} blocks")
        deadline = time.monotonic() + 30.0
        while any(mgr.pending_transfers_exist(r) for r in range(self.replicas)):
            if time.monotonic() > deadline:
                raise RuntimeError("ManagerServer: tier transfers still pending after 30 s")
            time.sleep(0.001)
            mgr.poll_transfers()

    def serve(self, requests: Sequence[Request]) -> ServeResult:
        """Serve every request to completion; return tokens, logits and stats."""
        requests = _validate_requests(requests)
        kv, mgr, ps = self.kv, self.mgr, self.page_size
        res = ServeResult()
        stats = res.stats
        ledger = _PrefixLedger(ps)
        waiting: deque = deque(requests)
        running: list[_Live] = []
        finished: dict[str, _Live] = {}
        try:
            while waiting or running:
                mgr.poll_transfers()
                # 1. admit while rows and pages last
                for item in list(waiting):
                    free = [r for r in range(self.replicas)
                            if sum(l.replica == r for l in running) < self.max_batch_size]
                    if not free:
                        break
                    live = item if isinstance(item, _Live) else None
                    req = live.req if live else item
                    if req.parent is not None and req.parent not in finished:
                        continue
                    if live is None:
                        live = _Live(req, _prompt_of(req, finished))
                        live.ctx = kv.TextContext(req.request_id, live.tokens)
                    live.replica = min(free, key=lambda r: (r - self._next_replica) % self.replicas)
                    self._next_replica = (live.replica + 1) % self.replicas   # round-robin placement
                    if not self._admit(live, ledger, stats):
                        break
                    running.append(live)
                    waiting.remove(item)
                if not running:
                    self._wait_for_pages(waiting)
                    continue
                # 2. pages for this step's tokens; out of pages -> preempt the youngest
                i = 0
                while i < len(running):
                    live = running[i]
                    self._chunk(live.ctx)                       # a prefill reads at most chunk_size tokens
                    try:
                        mgr.alloc(live.ctx)
                        i += 1
                    except kv.InsufficientBlocksError:
                        peers = [l for l in running if l.replica == live.replica]
                        if len(peers) == 1:
                            self._wait_for_pages([live])   # only pinned pages can come back
                            continue
                        victim = peers[-1]                 # the youngest on this replica
                        if running.index(victim) < i:
                            i -= 1
                        running.remove(victim)
                        mgr.release(victim.ctx)         # its committed pages stay cached
                        victim.ctx.reset()
                        victim.preempted = True
                        waiting.appendleft(victim)
                        stats.preemptions += 1
                # 3. forward over the lookup table (one forward per replica: its own batch and pages)
                batches = [[l for l in running if l.replica == r] for r in range(self.replicas)]
                inputs = mgr.runtime_inputs([[l.ctx for l in batch] for batch in batches]).inputs
                row_logits = {}
                for r, batch in enumerate(batches):
                    if not batch:
                        continue
                    q_lens = [l.ctx.active_length for l in batch]
                    feed = np.concatenate([l.ctx.active_tokens for l in batch])
                    attend = PagedTableAttention(inputs[r], q_lens, self.model.config.windows, self.layer_leaf)
                    positions = attend.positions
                    if self.past_offset:
                        positions = positions + self.past_offset * (positions >= 1)
                    logits = self.model.forward(feed, positions, attend, logits_rows=np.cumsum(q_lens) - 1)
                    row_logits.update({id(l): logits[b] for b, l in enumerate(batch)})
                stats.steps += 1
                stats.chunked_prefill_steps += any(l.ctx.pending_length for l in running)
                # 4. commit, sample, finish
                for live in list(running):
                    ctx = live.ctx
                    if ctx.pending_length:
                        ctx.advance_chunk()
                    else:
                        ctx.update(live.sample(row_logits[id(live)]))
                    mgr.step(ctx)                       # publish the pages the forward filled
                    ledger.publish(ctx.tokens, min(ctx.processed_length, len(ctx) - 1) // ps)
                    if live.done:
                        mgr.release(ctx)
                        running.remove(live)
                        finished[live.req.request_id] = live
                kv.check_invariants(mgr)
        finally:
            mgr.shutdown()
        for rid, live in finished.items():
            res.prompts[rid], res.tokens[rid], res.logits[rid] = live.prompt, live.generated, np.stack(live.logits)
        return res


def reference_run(ort_decoder, requests: Sequence[Request]) -> ServeResult:
    """Each request on its own through ONNX Runtime (its own K/V cache), follow-ups after their parents."""
    requests = _validate_requests(requests)
    res = ServeResult()
    done: dict[str, _Live] = {}
    for req in requests:
        live = _Live(req, _prompt_of(req, done))
        toks, logits = ort_decoder.generate(live.prompt, req.max_new_tokens)
        live.tokens += toks
        done[req.request_id] = live
        res.prompts[req.request_id], res.tokens[req.request_id], res.logits[req.request_id] = live.prompt, toks, logits
    return res


def compare(result: ServeResult, reference: ServeResult, atol: float = 1e-4) -> float:
    """Assert that every request's prompt and greedy tokens are equal and its logits agree within ``atol``.

    Returns
    -------
    float
        The largest absolute logit difference over all requests and steps.

    Raises
    ------
    AssertionError
        Naming the first request and step that differ.
    """
    if set(result.tokens) != set(reference.tokens):
        raise AssertionError(f"compare: requests {sorted(result.tokens)} != {sorted(reference.tokens)}")
    worst = 0.0
    for rid in reference.tokens:
        if list(result.prompts[rid]) != list(reference.prompts[rid]):
            raise AssertionError(f"compare: request {rid!r} served another prompt")
        a, b = result.logits[rid], reference.logits[rid]
        for s, (ta, tb) in enumerate(zip(result.tokens[rid], reference.tokens[rid])):
            d = float(np.max(np.abs(a[s] - b[s])))
            if d > atol:
                raise AssertionError(f"compare: request {rid!r} step {s}: logits differ by {d:.3g} > atol={atol}")
            if ta != tb:
                raise AssertionError(f"compare: request {rid!r} step {s}: token {ta} != reference {tb}")
            worst = max(worst, d)
    return worst


def ngram_drafter(n: int = 2, k: int = 3) -> Callable:
    """Prompt-lookup drafting: find the latest earlier occurrence of the last ``n`` tokens and
    propose the ``k`` tokens that followed it (nothing when there is none)."""

    def draft(request_id: str, tokens: list) -> list:
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start: start + n] == tail:
                return tokens[start + n: start + n + k]
        return []

    return draft


def chat_workload(vocab_size: int, seed: int = 0, new_tokens: int = 4) -> list[Request]:
    """Two shared system prompts, six first turns and three follow-up turns (prefix hits by construction)."""
    rng = np.random.default_rng(seed)

    def toks(n):
        return tuple(int(t) for t in rng.integers(1, vocab_size, n))

    systems = [toks(13), toks(10)]
    reqs = [Request(f"r{i}", systems[i % 2] + toks(3 + i % 4), new_tokens) for i in range(6)]
    reqs += [Request(f"r{i}.2", toks(4), new_tokens, parent=f"r{i}") for i in (0, 1, 3)]
    reqs += [Request("r0.3", toks(3), new_tokens, parent="r0.2")]
    return reqs
