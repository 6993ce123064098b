"""Wrong or stale K/V under speculative decoding, hybrid leaves and tiers (kvref and kvfast).

A deterministic "model" writes, for token ``t`` at position ``p``, K/V that depend on ``t``,
``p``, the leaf and a code of the whole prefix ``tokens[: p + 1]`` (``kv_at``), and a
recurrent state that is a hash of the prefix (``state_of``): any page that holds another
request's bytes, a rejected draft's bytes, an older page's bytes or nothing shows, even when
the token and position match. The state machine (``SpecHybridMachine``) drives a scheduler
loop over a full + sliding + recurrent manager (one slab) with speculative decoding, a host
tier behind a gated fault-injecting connector and deferred lookups, and checks at every
``runtime_inputs`` that every lookup-table page up to ``cache_lengths`` holds exactly the bytes
the forward wrote for those tokens (and the recurrent live page the state after
``processed_length`` tokens), and after every rule that every published page of every leaf
holds its block's bytes. Requests carry random retention priorities and time-to-lives and a
rule moves the clock (retention may change what is evicted, never which bytes are served).
Forwards may run overlapped (spec/manager.md §15.2): the drafts of a forward in flight are
``maybe_accepted_draft_tokens`` while the next forward is allocated and its inputs checked
(``cache_lengths`` counts them, the rows are sized with them), then they resolve.

Variants (class attributes): kvref and kvfast; FP8 pages (each checked page's scales too);
a padded slab (spec/manager.md §13.1); one full leaf without drafts, with and without a
tier (kvfast's lanes); kvfast on the emulated CUDA device (``CudaPageStore`` staging).
Scenarios that pin one case each are in ``test_stale_kv_{fp8,slab,hybrid_tiers}.py``.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from typing import ClassVar

import numpy as np
from _fault_connector import LOAD_FAULTS, FaultConnector, settle_manager
from _hybrid_model import flush as flush_leaves
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from kvspec import (
    InsufficientBlocksError,
    KVCacheParams,
    KVLoadFailed,
    LeafKind,
    LeafSpec,
    TextContext,
)
from kvspec.hashing import block_hashes

import kvfast
import kvref

PS = 2
VOCAB = 3
MAX_LEN = 14
K = 2  # drafts per forward


# ------------------------------------------------------------------ the model


def _prefix_codes(tokens) -> np.ndarray:
    """``code[p]``: a number that depends on every token of ``tokens[: p + 1]`` and its place."""
    t = np.asarray(tokens, dtype=np.int64)
    w = (t + 1) * (np.arange(t.size, dtype=np.int64) * 7 + 3)
    return np.cumsum(w) % 89


def kv_at(tokens, lo: int, hi: int, leaf_index: int, page_shape, dtype) -> np.ndarray:
    """K/V of positions ``lo .. hi - 1`` of ``tokens``: ``[n, 2, num_layers, kv_heads, head_dim]``
    of small integers (exact in float16), distinct per prefix, position, leaf, K/V, layer, head, lane."""
    _, layers, _, heads, dim = page_shape
    t = np.asarray(tokens[lo:hi], dtype=np.int64).reshape(-1, 1, 1, 1, 1)
    c = _prefix_codes(tokens)[lo:hi].reshape(-1, 1, 1, 1, 1)
    p = np.arange(lo, hi, dtype=np.int64).reshape(-1, 1, 1, 1, 1)
    kv = np.arange(2).reshape(1, 2, 1, 1, 1)
    ly = np.arange(layers).reshape(1, 1, layers, 1, 1)
    hd = np.arange(heads).reshape(1, 1, 1, heads, 1)
    ln = np.arange(dim).reshape(1, 1, 1, 1, dim)
    v = (t * 131 + p * 17 + c * 29 + leaf_index * 389 + kv * 7 + ly * 5 + hd * 3 + ln) % 1021
    if np.dtype(dtype).itemsize == 1:  # FP8: small integers, exact in e4m3fn and e5m2
        v = v % 17 - 8
    return v.astype(dtype)


def scale_at(tokens, i: int, leaf_index: int, shape) -> np.ndarray:
    """FP8: the scales ``[2, num_layers, kv_heads]`` of block ``i``'s page, a power of two set by
    the prefix through the block's first token (whoever writes that position writes the scales)."""
    c = int(_prefix_codes(tokens)[i * PS])
    e = (c + leaf_index * 3 + np.arange(int(np.prod(shape))).reshape(shape)) % 9 - 4
    return np.exp2(e).astype(np.float32)


def _scales(m, r: int = 0):
    if not m.params.page_scales_shape:
        return None
    s = m.get_device_scales_buffer(r)
    return s if isinstance(s, dict) else {next(iter(m.params.leaves())): s}


def state_of(tokens, n: int, shape, dtype) -> np.ndarray:
    """The recurrent state after the first ``n`` tokens (zeros before any)."""
    if n == 0:
        return np.zeros(shape, dtype)
    d = hashlib.sha256(np.asarray(tokens[:n], dtype=np.int32).tobytes()).digest()
    return ((np.arange(int(np.prod(shape))).reshape(shape) + int.from_bytes(d[:4], "little")) % 1999 + n
            ).astype(dtype)


def truth(tokens) -> int:
    """The model's next token after ``tokens`` (greedy, deterministic)."""
    t = np.asarray(tokens, dtype=np.int64)
    return int((int(np.sum(t * (np.arange(t.size) % 5 + 1))) + t.size) % VOCAB)


def _host(x) -> np.ndarray:
    """A NumPy copy of a (possibly device) array."""
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


def _put(buf, idx, value) -> None:
    """``buf[idx] = value`` on the host or the (emulated) device."""
    if not isinstance(buf, np.ndarray):
        from kvfast._cuda._module import cupy

        value = cupy().asarray(np.ascontiguousarray(value))
    buf[idx] = value


def _bufs(m, r: int = 0):
    b = m.get_device_buffer(r)
    return b if isinstance(b, dict) else {"full": b}


def check_inputs(m, ctx: TextContext, inputs, r: int = 0, in_flight: list[int] = ()) -> int:
    """Every page the lookup table binds up to ``cache_lengths`` holds the model's bytes for
    ``ctx.tokens``; the recurrent live page the state after ``processed_length`` tokens.
    Returns the number of positions checked.

    ``in_flight``: the drafts a forward in flight verifies (overlap scheduling: they are
    ``ctx.spec_decoding_state.maybe_accepted_draft_tokens``). ``cache_lengths`` must then be
    ``processed_length + len(in_flight)`` (spec/manager.md §15.7), and the positions from
    ``processed_length`` up to it hold what that forward wrote, computed over
    ``ctx.tokens + in_flight`` (``SpecHybridMachine._forward``, overlapped); below ``processed_length``, the verified bytes."""
    bufs, page, checked, scales = _bufs(m, r), m.params.page_size, 0, _scales(m, r)
    per = inputs.inputs[r]
    per = per if isinstance(per, dict) else {"full": per}
    seq = list(map(int, ctx.tokens)) + list(in_flight)
    for li, (lid, spec) in enumerate(m.params.leaves().items()):
        buf, inp = bufs[lid], per[lid]
        lut = _host(inp.lookup_table)[0]
        n = int(_host(inp.cache_lengths)[0])
        assert n == ctx.processed_length + len(in_flight), (
            f"{ctx.request_id}: leaf {lid!r} cache_lengths {n}, want processed_length {ctx.processed_length} "
            f"+ {len(in_flight)} drafts in flight (spec/manager.md §15.7)")
        if spec.kind is LeafKind.RECURRENT:
            # the live page holds the verified state: the in-flight forward's per-draft states are
            # the model's until the drafts resolve (spec/manager.md §15.10)
            want = state_of(ctx.tokens, ctx.processed_length, buf.shape[1:], buf.dtype)
            assert np.array_equal(_host(buf[lut[0]]), want), (
                f"{ctx.request_id}: leaf {lid!r} live page {lut[0]} is not the state after "
                f"{ctx.processed_length} tokens")
            checked += 1
            continue
        if n == 0:
            continue
        want = kv_at(seq, 0, n, li, buf.shape[1:], buf.dtype)
        # a sliding leaf's forward reads keys from n - window + 1 on; the slots below hold null or
        # (after a tier load, until the next step frees them: spec/manager.md §9.8) unread pages
        lo = max(0, n - spec.window + 1) if spec.kind is LeafKind.SLIDING_WINDOW else 0
        for p in range(lo, n):
            b = int(lut[p // page])
            assert b != 0, f"{ctx.request_id}: leaf {lid!r} position {p} bound to the null page"
            got = _host(buf[b])[:, :, p % page]
            assert np.array_equal(got, want[p]), (
                f"{ctx.request_id}: leaf {lid!r} position {p} (page {b}) holds {got.ravel()}, "
                f"want {want[p].ravel()}")
            if scales is not None and p % page == 0:
                ws = scale_at(seq, p // page, li, scales[lid].shape[1:])
                assert np.array_equal(_host(scales[lid][b]), ws), (
                    f"{ctx.request_id}: leaf {lid!r} block {p // page} (page {b}) scales {_host(scales[lid][b]).ravel()}, "
                    f"want {ws.ravel()}")
            checked += 1
    return checked


def write_forward(m, ctx: TextContext, drafts: list[int], r: int = 0) -> None:
    """What a verifying forward writes: the K/V of the active tokens then of the drafts (computed
    over ``tokens + drafts``), through the request's rows."""
    bufs, rows, page, scales = _bufs(m, r), m.get_req_blocks_per_leaf(ctx), m.params.page_size, _scales(m, r)
    seq = list(map(int, ctx.tokens)) + list(drafts)
    lo, hi = ctx.processed_length, ctx.current_position + len(drafts)
    for li, (lid, spec) in enumerate(m.params.leaves().items()):
        if spec.kind is LeafKind.RECURRENT:
            continue
        buf = bufs[lid]
        vals = kv_at(seq, lo, hi, li, buf.shape[1:], buf.dtype)
        for j, p in enumerate(range(lo, hi)):
            b = rows[lid][p // page]
            assert b != 0, f"{ctx.request_id}: leaf {lid!r} writes position {p} through the null page"
            _put(buf, (b, slice(None), slice(None), p % page), vals[j])
            if scales is not None and p % page == 0:
                _put(scales[lid], b, scale_at(seq, p // page, li, scales[lid].shape[1:]))


def write_state(m, ctx: TextContext, r: int = 0) -> None:
    """The model's live state after the accepted tokens (it rolls back past rejected drafts)."""
    bufs, rows = _bufs(m, r), m.get_req_blocks_per_leaf(ctx)
    for lid, spec in m.params.leaves().items():
        if spec.kind is LeafKind.RECURRENT:
            buf = bufs[lid]
            _put(buf, rows[lid][0], state_of(ctx.tokens, ctx.processed_length, buf.shape[1:], buf.dtype))


def verify(ctx: TextContext, drafts: list[int]) -> None:
    """Accept the drafts the model agrees with, then the bonus token: ``update`` each."""
    seq = list(map(int, ctx.tokens))
    out = []
    for d in drafts:
        g = truth(seq + out)
        if d != g:
            break
        out.append(d)
    out.append(truth(seq + out))
    for t in out:
        ctx.update(t)


def next_drafts(ctx: TextContext, right: list[bool]) -> list[int]:
    """``len(right)`` drafts after ``ctx.tokens``: the model's continuation where ``right``, else wrong."""
    seq, out = list(map(int, ctx.tokens)), []
    for ok in right:
        g = truth(seq + out)
        out.append(g if ok else (g + 1) % VOCAB)
    return out


def register(prefixes: dict, tokens) -> None:
    tokens = np.asarray(tokens, dtype=np.int32)
    for i, h in enumerate(block_hashes(tokens, PS)):
        prefixes[h] = tokens[: (i + 1) * PS].copy()


def published_ok(m, prefixes: dict, r: int = 0) -> None:
    """Every published page of every leaf holds its block's bytes (a checkpoint: the state after it)."""
    bufs, scales = _bufs(m, r), _scales(m, r)
    for li, (lid, spec) in enumerate(m.params.leaves().items()):
        buf = bufs[lid]
        for b, h in enumerate(m._pools[r][lid].block_hash):
            if h is None:
                continue
            assert h in prefixes, f"leaf {lid!r} page {b} published under a hash no verified prefix has"
            toks = prefixes[h]
            if spec.kind is LeafKind.RECURRENT:
                assert np.array_equal(_host(buf[b]), state_of(toks, len(toks), buf.shape[1:], buf.dtype)), (
                    f"leaf {lid!r} checkpoint page {b} is not the state after {len(toks)} tokens")
                continue
            want = kv_at(toks, len(toks) - PS, len(toks), li, buf.shape[1:], buf.dtype)
            got = np.moveaxis(_host(buf[b]), 2, 0)
            assert np.array_equal(got, want), f"leaf {lid!r} page {b} (block {len(toks) // PS - 1}) holds wrong K/V"
            if scales is not None:
                ws = scale_at(toks, len(toks) // PS - 1, li, scales[lid].shape[1:])
                assert np.array_equal(_host(scales[lid][b]), ws), f"leaf {lid!r} page {b} holds wrong scales"


# ------------------------------------------------------------------ the state machine

STEMS = ((0, 1, 2, 0), (0, 1, 2, 1, 1, 0), (2, 2, 1), (1, 0))
PROMPT_ST = st.builds(
    lambda stem, tail: (STEMS[stem] + tuple(tail))[: MAX_LEN - 5],
    st.integers(0, len(STEMS) - 1),
    st.lists(st.integers(0, VOCAB - 1), max_size=4),
)
RIGHT_ST = st.lists(st.booleans(), min_size=K, max_size=K)
RETAIN_ST = st.tuples(st.sampled_from((0, 35, 90)), st.sampled_from((None, 1.0, 5.0)))
LAP_ST = st.integers(0, 7)  # bit i: the i-th live request's forward runs overlapped (``_forward``)


class SpecHybridMachine(RuleBasedStateMachine):
    """A scheduler loop with speculative decoding over a hybrid (one slab), host-tiered manager.

    Rules: admit (with or without a deferred lookup, with a retention priority and time-to-live),
    readmit a served prompt (tier and device hits) with a load fault armed, move the clock, one iteration (each live request: ``runtime_inputs``, checked;
    the verifying forward writes active tokens and ``K`` drafts; accepted drafts and the bonus
    token appended; state rolled back; next drafts set; ``step``; ``alloc``), preempt, flush the
    device cache, land transfers, reset the prefix cache.

    Overlap scheduling (spec/manager.md §15.2, §15.7; chosen per request and iteration by ``lap``):
    the verifying forward is launched (it writes its K/V) and, before its verdict, the scheduler
    prepares the next forward: the drafts go to ``maybe_accepted_draft_tokens``, ``alloc`` sizes
    the rows with them and ``runtime_inputs`` counts them as cached. That forward's inputs are
    checked (it would run after the one in flight on the stream, so it reads what that one wrote;
    nothing that no forward wrote is demanded, nothing verified may be stale); then the verdict
    comes: the accepted drafts and the bonus token appended, the rest rejected, the list cleared.
    Our contexts carry no placeholders (§15: MAX's ``pending_future_count`` is 0), so the in-flight
    forward's active tokens stay unprocessed: the positions ``processed_length ..
    processed_length + len(maybe_accepted_draft_tokens)`` hold what it wrote over
    ``ctx.tokens + drafts`` (its active tokens, then its drafts).
    """

    pkg = kvref
    leaves: ClassVar[dict | None] = {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(3),
                                     "rec": LeafSpec.recurrent((2,))}
    num_blocks = 40
    host_pages = 24
    dtype = "float16"
    drafts = K  # 0: no speculative decoding (kvfast's lanes serve a single full leaf then)
    tiered = True
    device = "cpu"

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvstale-")
        spec = {"speculative_method": "eagle", "num_draft_tokens": self.drafts} if self.drafts else {}
        p = KVCacheParams(page_size=PS, num_layers=1, kv_heads=1, head_dim=2, dtype=self.dtype,
                          leaves=self.leaves, **spec)
        units = sum(-(-p.page_bytes(lid) // p.page_bytes()) for lid in p.leaves())  # spec/tiers.md §12
        self.now = 0.0  # spec/manager.md §14: retention expiries read this clock (the tiers' too)
        inner = self.pkg.TieredConnector(self.host_pages * p.kv_page_bytes * units, 0, None, num_workers=2,
                                         clock=self.clock)
        self.fc = FaultConnector(inner, gated=True) if self.tiered else None
        self.m = self.pkg.PagedKVCacheManager(p, num_blocks=self.num_blocks, max_batch_size=4, max_seq_len=MAX_LEN,
                                              connector=self.fc, clock=self.clock, device=self.device)
        self.land_all = self.fc.land if self.fc is not None else None
        self.prefixes: dict[bytes, np.ndarray] = {}
        self.live: dict[str, tuple[TextContext, object]] = {}
        self.served: list[tuple[int, ...]] = []
        self.n = 0
        self.checked = 0

    def clock(self) -> float:
        return self.now

    def teardown(self):
        try:
            for rid in sorted(self.live):
                self._release(rid)
            settle_manager(self.m, land=self.land_all)
            self.m.check_invariants()
            assert not self.m.pending_transfers_exist()
            published_ok(self.m, self.prefixes)
        finally:
            try:
                self.m.shutdown()
            finally:
                shutil.rmtree(self.dir, ignore_errors=True)

    @initialize(prompts=st.lists(PROMPT_ST, min_size=1, max_size=2), right=RIGHT_ST, lap=LAP_ST)
    def warm(self, prompts, right, lap):
        for prompt in prompts:
            self._admit(prompt, False, (35, None))
        for _ in range(3):
            self.iterate(right, lap)
        for rid in sorted(self.live):
            self._release(rid)
        settle_manager(self.m, land=self.land_all)
        self.flush_device()

    @precondition(lambda self: len(self.live) < 3)
    @rule(prompt=PROMPT_ST, defer=st.booleans(), right=RIGHT_ST, keep=RETAIN_ST, lap=LAP_ST)
    def admit(self, prompt, defer, right, keep, lap):
        self._admit(prompt, defer, keep)
        self.iterate(right, lap)

    @precondition(lambda self: len(self.live) < 3 and bool(self.served))
    @rule(data=st.data(), fault=st.sampled_from((None,) + LOAD_FAULTS), defer=st.booleans(), right=RIGHT_ST,
          keep=RETAIN_ST, lap=LAP_ST)
    def readmit(self, data, fault, defer, right, keep, lap):
        if fault is not None and self.fc is not None:
            note(f"arm: {fault}")
            self.fc.arm(fault)
        self._admit(data.draw(st.sampled_from(self.served)), defer, keep)
        self.iterate(right, lap)

    def _admit(self, prompt, defer: bool, keep: tuple):
        rid = f"r{self.n}"
        self.n += 1
        ctx = TextContext(rid, np.array(prompt, dtype=np.int32))
        ctx.retention_priority, ctx.retention_seconds = keep  # spec/manager.md §14: never which bytes
        note(f"m.claim({rid}); m.alloc({rid}, defer_lookup={defer})  # {list(prompt)}, retention {keep}")
        self.m.claim(ctx)
        try:
            t = self.m.alloc(ctx, defer_lookup=defer)
            if defer and self.m.start_lookup(ctx):
                note(f"  {rid}: start_lookup; alloc again")
                t = self.m.alloc(ctx)
        except InsufficientBlocksError:
            note("  -> InsufficientBlocksError; release")
            self.m.release(ctx)
            return
        note(f"  -> prefix {ctx.cached_prefix_length} (external {ctx.cached_prefix_external_length})")
        self._sized(ctx)
        self.live[rid] = (ctx, t)

    def _sized(self, ctx):
        """spec/manager.md §15.3: after ``alloc`` every full/sliding row holds ``ceil(seq_len /
        page_size)`` blocks, ``seq_len`` counting the drafts in flight (rows shrink after a rejection)."""
        if not self.drafts:
            return
        # eagle: no block-draft slot (D = 0)
        seq_len = ctx.current_position + len(ctx.spec_decoding_state.maybe_accepted_draft_tokens) + 2 * K
        rows = self.m.get_req_blocks_per_leaf(ctx)
        for lid, spec in self.m.params.leaves().items():
            if spec.kind is not LeafKind.RECURRENT:
                assert len(rows[lid]) == -(-seq_len // PS), (
                    f"{ctx.request_id}: leaf {lid!r} row of {len(rows[lid])} blocks, seq_len {seq_len} needs "
                    f"{-(-seq_len // PS)}")

    @rule(right=RIGHT_ST, lap=LAP_ST)
    def iterate(self, right, lap=0):
        for i, rid in enumerate(sorted(self.live)):
            if rid in self.live:
                self._forward(rid, right, bool(lap >> i & 1))
        self.m.poll_transfers()

    def _forward(self, rid, right, lap=False):
        ctx, t = self.live[rid]
        try:
            done = t.is_complete()
        except KVLoadFailed:
            note(f"{rid}: load failed; alloc again")
            self._realloc(rid)
            return
        if not done:
            note(f"{rid}: cordoned (load in flight)")
            return
        drafts = list(ctx.spec_decoding_state.draft_tokens_to_verify) if self.drafts else []
        if lap and drafts:
            note(f"{rid}: forward over [{ctx.processed_length}, {ctx.current_position}) + drafts {drafts} "
                 "launched; maybe_accepted_draft_tokens = drafts; alloc; runtime_inputs (overlap)")
            write_forward(self.m, ctx, drafts)  # through the rows of the last alloc (sized for it)
            state = ctx.spec_decoding_state
            state.maybe_accepted_draft_tokens, state.draft_tokens_to_verify = list(drafts), []
            try:
                self.live[rid] = (ctx, self.m.alloc(ctx))
            except InsufficientBlocksError:
                note(f"{rid}: InsufficientBlocksError; preempt")
                self._release(rid)
                return
            self._sized(ctx)
            inputs = self.m.runtime_inputs([[ctx]])
            self.checked += check_inputs(self.m, ctx, inputs, in_flight=drafts)
            verify(ctx, drafts)  # the verdict: accepted drafts and the bonus appended, the rest rejected
            state.maybe_accepted_draft_tokens = []
            note(f"  -> verdict: tokens {list(map(int, ctx.tokens))}")
        else:
            inputs = self.m.runtime_inputs([[ctx]])
            self.checked += check_inputs(self.m, ctx, inputs)
            note(f"{rid}: forward over [{ctx.processed_length}, {ctx.current_position}) + drafts {drafts}")
            write_forward(self.m, ctx, drafts)
            verify(ctx, drafts)
        write_state(self.m, ctx)
        if self.drafts:
            room = MAX_LEN - len(ctx)
            ctx.spec_decoding_state.draft_tokens_to_verify = next_drafts(ctx, right[: max(0, min(K, room - 1))])
        self.m.step(ctx)
        register(self.prefixes, ctx.tokens)
        prompt = tuple(int(x) for x in ctx.tokens[:-1])
        if prompt not in self.served:
            self.served.append(prompt)
        if len(ctx) >= MAX_LEN - 1:
            self._release(rid)
            return
        self._realloc(rid)

    def _realloc(self, rid):
        ctx, _ = self.live[rid]
        try:
            self.live[rid] = (ctx, self.m.alloc(ctx))
            self._sized(ctx)
        except InsufficientBlocksError:
            note(f"{rid}: InsufficientBlocksError; preempt")
            self._release(rid)

    def _release(self, rid):
        ctx, _ = self.live.pop(rid)
        self.m.release(ctx)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def preempt(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        note(f"m.release({rid})")
        self._release(rid)

    @rule()
    def flush_device(self):
        note("flush the device cache")
        flush_leaves(self.m)

    @rule(dt=st.sampled_from((0.5, 2.0, 10.0)))
    def advance_clock(self, dt):
        note(f"the clock moves {dt} s")
        self.now += dt

    @rule()
    def land(self):
        note("land every transfer; m.poll_transfers()")
        if self.fc is not None:
            self.fc.land()
        self.m.poll_transfers()

    @rule()
    def reset_prefix_cache(self):
        note("m.reset_prefix_cache()")
        self.m.reset_prefix_cache()

    @invariant()
    def published_pages_hold_their_bytes(self):
        self.m.check_invariants()
        published_ok(self.m, self.prefixes)


class FastSpecHybridMachine(SpecHybridMachine):
    pkg = kvfast


class PaddedSpecHybridMachine(SpecHybridMachine):
    """A slab whose pages are padded (spec/manager.md §13.1: full/sliding 16 -> 20 bytes): strided
    views, on the tiers as units of the full page's data (the 1340-byte state: 84 units)."""

    leaves: ClassVar[dict | None] = {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(3),
                                     "rec": LeafSpec.recurrent((5, 67))}


class FastPaddedSpecHybridMachine(PaddedSpecHybridMachine):
    pkg = kvfast


class FastPlainFullMachine(SpecHybridMachine):
    """kvfast's lanes (one full leaf, no drafts, no FP8) with a tier: decode growth and inputs."""

    pkg = kvfast
    leaves = None
    drafts = 0
    num_blocks = 16


class FastPlainFullUntieredMachine(FastPlainFullMachine):
    """kvfast's lanes without a connector: claim, splice, step and release too."""

    tiered = False


class Fp8SpecHybridMachine(SpecHybridMachine):
    """The same loop over FP8 pages: every checked page's scales are its block's too."""

    dtype = "float8_e4m3fn"


class FastFp8SpecHybridMachine(Fp8SpecHybridMachine):
    pkg = kvfast


_FEW = {"deadline": None}
SpecHybridMachine.TestCase.settings = settings(SpecHybridMachine.TestCase.settings, **_FEW)
FastSpecHybridMachine.TestCase.settings = settings(FastSpecHybridMachine.TestCase.settings, **_FEW)
Fp8SpecHybridMachine.TestCase.settings = settings(Fp8SpecHybridMachine.TestCase.settings, **_FEW)
FastPlainFullMachine.TestCase.settings = settings(FastPlainFullMachine.TestCase.settings, **_FEW)
FastPlainFullUntieredMachine.TestCase.settings = settings(FastPlainFullUntieredMachine.TestCase.settings, **_FEW)
# a padded state page is 84 tier units: a tenth of the profile's examples
_PADDED = dict(_FEW, max_examples=max(1, settings().max_examples // 10))
PaddedSpecHybridMachine.TestCase.settings = settings(PaddedSpecHybridMachine.TestCase.settings, **_PADDED)
FastPaddedSpecHybridMachine.TestCase.settings = settings(FastPaddedSpecHybridMachine.TestCase.settings, **_PADDED)
FastFp8SpecHybridMachine.TestCase.settings = settings(FastFp8SpecHybridMachine.TestCase.settings, **_FEW)
test_spec_hybrid_machine_kvref = SpecHybridMachine.TestCase
test_spec_hybrid_machine_kvfast = FastSpecHybridMachine.TestCase
test_padded_spec_hybrid_machine_kvref = PaddedSpecHybridMachine.TestCase
test_padded_spec_hybrid_machine_kvfast = FastPaddedSpecHybridMachine.TestCase
test_lanes_machine_kvfast = FastPlainFullMachine.TestCase
test_lanes_untiered_machine_kvfast = FastPlainFullUntieredMachine.TestCase
test_fp8_spec_hybrid_machine_kvref = Fp8SpecHybridMachine.TestCase
test_fp8_spec_hybrid_machine_kvfast = FastFp8SpecHybridMachine.TestCase


def test_spec_hybrid_machine_on_the_emulated_device(emulated):
    """kvfast on device="cuda" (the emulated CuPy): the tiers stage pages through ``CudaPageStore``
    on worker threads while the loop runs; every bound page still holds the model's bytes."""

    class OnDevice(FastSpecHybridMachine):
        device = "cuda"

    OnDevice.TestCase.settings = settings(OnDevice.TestCase.settings, deadline=None,
                                          max_examples=max(1, settings().max_examples // 10))
    OnDevice.TestCase().runTest()
