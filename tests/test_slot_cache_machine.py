"""Stateful test of the whole slot API against a dense per-slot model (spec/slot-cache.md §2-§7).

The model keeps, per slot, the tokens whose K/V are committed. K/V are a pure
function of (layer, token prefix) and state slabs a pure function of the
tokens, so the model never stores K/V: it recomputes what a model would have
written. After every rule the cache must pass ``check_invariants`` and agree
with the model: ``seq_lens``, K/V gathered through the cache (bitwise), cross
planes, state slabs; every step's attention through ``StepIndices`` must equal
dense attention over the model's history. Prefix hits are checked for bounds
(whole blocks, capped), provenance (every hit block was published, every
hybrid hit was checkpointed) and content.

Small vocabulary and block sizes 2-4 make prefixes collide; a small pool
makes eviction and ``CapacityError`` happen. The configuration (mode, dtype,
layers, pool size, hashing) is drawn per run.
"""

from __future__ import annotations

import zlib

import numpy as np
from hypothesis import event, note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvref import KVCache, ops
from kvref._slot_cache import build_step_indices
from kvspec import CapacityError, KVCacheConfig, KVCacheMode, KVLayerSpec, LayerKind
from test_slot_cache import fingerprint

PAGED, CONTIG = KVCacheMode.PAGED, KVCacheMode.CONTIGUOUS
VOCAB = 3  # tiny, so prefixes collide
HEADS, DIM = 1, 2
ATTN = (LayerKind.ATTENTION, LayerKind.SLIDING_WINDOW)


def _seed(*parts) -> int:
    return zlib.crc32(np.array(parts, dtype=np.int64).tobytes())


class SlotCacheMachine(RuleBasedStateMachine):
    """One rule per public method; the model is ``self.tokens`` (+ encoder planes, publication history)."""

    # ------------------------------------------------------------------ setup

    @initialize(
        mode=st.sampled_from([PAGED, CONTIG]),
        block_size=st.integers(2, 4),
        max_seqs=st.integers(2, 3),
        max_seq_len=st.integers(6, 12),
        pool_extra=st.sampled_from([0, 2, 5, 100]),  # tight pools evict, roomy ones keep hits
        hybrid=st.booleans(),
        cross=st.booleans(),
        window=st.integers(1, 4),
        dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
        prefix_caching=st.sampled_from([True] * 7 + [False]),
        hash_algo=st.sampled_from(["sha256", "xxh3_128"]),
        num_state_checkpoints=st.sampled_from([None, 1, 2]),
        warm=st.lists(st.integers(0, VOCAB - 1), min_size=4, max_size=12),
    )
    def setup(self, mode, block_size, max_seqs, max_seq_len, pool_extra, hybrid, cross, window, dtype,
              prefix_caching, hash_algo, num_state_checkpoints, warm):
        mbps = -(-max_seq_len // block_size)
        specs = [KVLayerSpec.attention(HEADS, DIM), KVLayerSpec.sliding_window(HEADS, DIM, window)]
        if cross:
            specs.append(KVLayerSpec.cross_attention(HEADS, DIM, 3))
        if hybrid:
            specs.append(KVLayerSpec.state((2,), 2, recurrent=(1, 2, 1)))
        cfg = KVCacheConfig(
            len(specs), max_seqs, max_seq_len, mode, block_size=block_size,
            num_blocks=min(mbps + 1 + pool_extra, max_seqs * mbps + 1), dtype=dtype,
            enable_prefix_caching=prefix_caching, hash_algo=hash_algo, num_state_checkpoints=num_state_checkpoints,
        )
        note(f"cfg = {cfg!r}\nspecs = {specs!r}\ncache = KVCache.make(cfg, specs)")
        self.cache = KVCache.make(cfg, specs)
        self.cfg, self.specs = cfg, specs
        self.paged = mode is PAGED
        self.P = block_size
        self._kv_memo: dict = {}
        self.reset_model()
        warm = warm[: max_seq_len - 1]
        if self.paged and warm:
            self.warm_up(warm)

    def warm_up(self, tokens):
        """Serve one sequence in slot 0 and retire it, so the run starts with published blocks."""
        note(f"# warm up: serve {tokens} in slot 0, then retire it")
        step = self.cache.prepare_step([0, len(tokens)], [0], [0])
        self.dirty[0] = True
        self.append_and_check(step, [(0, 0, list(tokens))])
        self.cache.update_position(0, len(tokens))
        self.tokens[0] = list(tokens)
        self.write_state(0)
        self.cache.retire(0, list(tokens))
        self.record_retire(list(tokens), len(tokens), len(tokens))
        self.free_slot(0)

    def reset_model(self):
        S = self.cfg.max_seqs
        self.tokens = [[] for _ in range(S)]      # committed tokens per slot
        self.adopted = [0] * S                    # tokens adopted by admit (shared prefix)
        self.dirty = [False] * S                  # paged: slot may hold blocks
        self.plan = [[] for _ in range(S)]        # the prompt a slot was admitted with
        self.enc = [None] * S                     # (k, v) filled per cross layer
        self.published: set[tuple] = set()        # every block-aligned prefix ever published
        self.checkpointed: set[tuple] = set()     # every prefix ever checkpointed
        self.history: list[list[int]] = []        # retired token lists, to build colliding prompts

    # ------------------------------------------------------------------ model functions

    def kv_of(self, layer: int, prefix: tuple) -> tuple[np.ndarray, np.ndarray]:
        """K and V [HEADS, DIM] of the last token of ``prefix`` at layer ``layer`` (float32)."""
        key = (layer, prefix)
        if key not in self._kv_memo:
            rng = np.random.default_rng(_seed(layer, len(prefix), *prefix))
            self._kv_memo[key] = (rng.standard_normal((HEADS, DIM)).astype(np.float32),
                                  rng.standard_normal((HEADS, DIM)).astype(np.float32))
        return self._kv_memo[key]

    def dense_kv(self, layer: int, tokens, lo: int = 0):
        ks = [self.kv_of(layer, tuple(tokens[: i + 1]))[0] for i in range(lo, len(tokens))]
        vs = [self.kv_of(layer, tuple(tokens[: i + 1]))[1] for i in range(lo, len(tokens))]
        shape = (0, HEADS, DIM)
        return (np.array(ks) if ks else np.zeros(shape, np.float32)), (np.array(vs) if vs else np.zeros(shape, np.float32))

    def state_of(self, tokens) -> list[np.ndarray]:
        """State slabs after ``tokens`` (zeros for no tokens): conv [2, 2], recurrent [1, 2, 1]."""
        if not tokens:
            return [np.zeros((2, 2), np.float32), np.zeros((1, 2, 1), np.float32)]
        rng = np.random.default_rng(_seed(99, len(tokens), *tokens))
        return [rng.standard_normal((2, 2)).astype(np.float32), rng.standard_normal((1, 2, 1)).astype(np.float32)]

    def write_state(self, slot: int) -> None:
        """The caller's part: the state kernel leaves the slot's slabs at state_of(tokens)."""
        if self.has_state:
            conv, rec = self.state_of(self.tokens[slot])
            self.cache.conv_state(self.state_layer)[slot] = conv
            self.cache.recurrent_state(self.state_layer)[slot] = rec

    @property
    def has_state(self) -> bool:
        return any(s.kind is LayerKind.STATE for s in self.specs)

    @property
    def state_layer(self) -> int:
        return next(l for l, s in enumerate(self.specs) if s.kind is LayerKind.STATE)

    @property
    def cross_layer(self):
        return next((l for l, s in enumerate(self.specs) if s.kind is LayerKind.CROSS_ATTENTION), None)

    def free_slot(self, s: int) -> None:
        self.tokens[s], self.adopted[s], self.dirty[s], self.plan[s], self.enc[s] = [], 0, False, [], None

    def expect_raise(self, call, exc, match=None):
        """Run a call that must raise ``exc``; the cache must be bit-for-bit unchanged."""
        before = fingerprint(self.cache)
        try:
            call()
        except exc as e:
            assert match is None or match in str(e), f"{type(e).__name__}: {e} lacks {match!r}"
        else:
            raise AssertionError(f"expected {exc.__name__}")
        event(f"raised {exc.__name__}")
        assert fingerprint(self.cache) == before, "state changed after a raising call"

    def blocks_needed(self, slots, new_lens) -> int:
        table = self.cache.paged_block_table()
        held = [int(np.count_nonzero(table[s])) for s in slots]
        return sum(max(0, -(-n // self.P) - h) for n, h in zip(new_lens, held))

    def new_tokens(self, data, slot: int, n: int) -> list[int]:
        """The next ``n`` tokens of a slot: its admitted prompt's continuation, then random ones."""
        start = len(self.tokens[slot])
        planned = self.plan[slot][start : start + n]
        return planned + data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n - len(planned), max_size=n - len(planned)))

    def append_and_check(self, step, rows) -> None:
        """Append every attention layer's K/V for ``rows = [(slot, past, new_tokens)]`` and compare attention."""
        for l, spec in enumerate(self.specs):
            if spec.kind not in ATTN:
                continue
            parts = [self.dense_kv(l, self.tokens[s][:past] + new, lo=past) for s, past, new in rows]
            ops.append_kv(self.cache, l, np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), step)
        rng = np.random.default_rng(step.num_tokens)
        for l, spec in enumerate(self.specs):
            if spec.kind is LayerKind.STATE:
                continue
            if spec.kind is LayerKind.CROSS_ATTENTION and any(self.enc[s] is None for s, _, _ in rows):
                continue
            q = rng.standard_normal((step.num_tokens, 2 * HEADS, DIM)).astype(np.float32)
            got = ops.varlen_attention(q, self.cache, l, step)
            for b, (s, past, new) in enumerate(rows):
                lo, hi = int(step.cu_seqlens_q[b]), int(step.cu_seqlens_q[b + 1])
                if spec.kind is LayerKind.CROSS_ATTENTION:
                    k, v = self.enc[s]
                    want = _dense(q[lo:hi], k, v, past, causal=False)
                else:
                    k, v = self.dense_kv(l, self.tokens[s][:past] + new)
                    dt = self.cfg.np_dtype
                    window = spec.window if spec.kind is LayerKind.SLIDING_WINDOW else None
                    want = _dense(q[lo:hi], k.astype(dt), v.astype(dt), past, window=window)
                np.testing.assert_allclose(got[lo:hi], want, rtol=1e-4, atol=1e-4)

    # ------------------------------------------------------------------ steps

    @rule(data=st.data())
    def prepare_step(self, data):
        S, L = self.cfg.max_seqs, self.cfg.max_seq_len
        slots = data.draw(st.lists(st.integers(0, S - 1), min_size=1, max_size=S, unique=True), label="slots")
        q = [data.draw(st.integers(1, max(1, L // 2)), label="q_len") for _ in slots]
        past = [len(self.tokens[s]) for s in slots]
        cu = np.concatenate([[0], np.cumsum(q)]).tolist()
        note(f"step = cache.prepare_step({cu}, {past}, {slots})")
        call = lambda: self.cache.prepare_step(cu, past, slots)  # noqa: E731
        if any(p + n > L for p, n in zip(past, q)):
            return self.expect_raise(call, CapacityError, "max_seq_len")
        if self.paged:
            need = self.blocks_needed(slots, [p + n for p, n in zip(past, q)])
            if need > len(self.cache._free_order()):
                return self.expect_raise(call, CapacityError, f"needs {need} blocks")
        step = call()
        assert step.seqused_k.tolist() == [p + n for p, n in zip(past, q)]
        rows = [(s, p, self.new_tokens(data, s, n)) for s, p, n in zip(slots, past, q)]
        for s in slots:
            self.dirty[s] = self.paged or self.dirty[s]
        self.append_and_check(step, rows)
        how = data.draw(st.sampled_from(["all", "all", "partial", "none"]), label="commit")
        if how == "none":
            return
        for s, p, new in rows:
            r = len(new) if how == "all" else data.draw(st.integers(0, len(new)), label="accepted")
            note(f"cache.update_position({s}, {p + r})")
            self.cache.update_position(s, p + r)
            self.tokens[s] = self.tokens[s][:p] + new[:r]
            self.write_state(s)

    @precondition(lambda self: self.paged)
    @rule(data=st.data())
    def reserve(self, data):
        S, L = self.cfg.max_seqs, self.cfg.max_seq_len
        slots = data.draw(st.lists(st.integers(0, S - 1), min_size=1, max_size=S, unique=True), label="slots")
        n = [data.draw(st.integers(0, 3), label="n_new") for _ in slots]
        past = [len(self.tokens[s]) for s in slots]
        note(f"cache.reserve({slots}, {n})")
        call = lambda: self.cache.reserve(slots, n)  # noqa: E731
        if any(p + k > L for p, k in zip(past, n)):
            return self.expect_raise(call, CapacityError, "max_seq_len")
        need = self.blocks_needed(slots, [p + k for p, k in zip(past, n)])
        if need > len(self.cache._free_order()):
            return self.expect_raise(call, CapacityError, f"needs {need} blocks")
        offsets = call()
        assert offsets.dtype == np.int32 and offsets.tolist() == past
        rows = [(s, p, k) for s, p, k in zip(slots, past, n) if k]
        for s, _, _ in rows:
            self.dirty[s] = True
        if not rows:
            return
        # write the reserved positions through the same index arithmetic prepare_step uses
        step = build_step_indices(
            np.concatenate([[0], np.cumsum([k for _, _, k in rows])]), [p for _, p, _ in rows], [s for s, _, _ in rows],
            max_seq_len=L, block_size=self.P, block_table=self.cache.paged_block_table(), enc_lens=self.cache._enc,
        )
        rows = [(s, p, self.new_tokens(data, s, k)) for s, p, k in rows]
        self.append_and_check(step, rows)
        for s, p, new in rows:
            self.tokens[s] = self.tokens[s] + new
            self.write_state(s)

    @rule(data=st.data())
    def update_position(self, data):
        s = data.draw(st.integers(0, self.cfg.max_seqs - 1), label="slot")
        seq = len(self.tokens[s])
        if self.paged:
            table = self.cache.paged_block_table()
            cap = min(int(np.count_nonzero(table[s])) * self.P, self.cfg.max_seq_len)
        else:
            cap = self.cfg.max_seq_len
        new_pos = data.draw(st.one_of(st.integers(0, seq), st.just(cap + 1), st.just(-1)), label="new_pos")
        note(f"cache.update_position({s}, {new_pos})")
        call = lambda: self.cache.update_position(s, new_pos)  # noqa: E731
        if new_pos < 0 or new_pos > cap:
            return self.expect_raise(call, ValueError, "new_pos")
        if new_pos < self.adopted[s]:
            return self.expect_raise(call, ValueError, "shared prefix")
        call()
        self.tokens[s] = self.tokens[s][:new_pos]
        self.write_state(s)

    # ------------------------------------------------------------------ slot lifecycle

    @rule(data=st.data())
    def evict_batch(self, data):
        if data.draw(st.integers(0, 2), label="gate"):
            return  # a third as often as the other rules, so sequences grow long enough to share
        s = data.draw(st.integers(0, self.cfg.max_seqs - 1), label="slot")
        note(f"cache.evict_batch({s})")
        self.cache.evict_batch(s)
        self.free_slot(s)

    @precondition(lambda self: self.cross_layer is not None)
    @rule(data=st.data())
    def fill(self, data):
        s = data.draw(st.integers(0, self.cfg.max_seqs - 1), label="slot")
        t = data.draw(st.integers(1, 3), label="t_enc")
        rng = np.random.default_rng(_seed(7, s, t))
        k = rng.standard_normal((t, HEADS, DIM)).astype(np.float32)
        v = rng.standard_normal((t, HEADS, DIM)).astype(np.float32)
        note(f"cache.fill({self.cross_layer}, {s}, k{list(k.shape)}, v)")
        call = lambda: self.cache.fill(self.cross_layer, s, k, v)  # noqa: E731
        if self.enc[s] is not None and self.enc[s][0].shape[0] != t:
            return self.expect_raise(call, ValueError, "already filled")
        call()
        dt = self.cfg.np_dtype
        self.enc[s] = (k.astype(dt), v.astype(dt))

    def empty_slots(self) -> list[int]:
        return [i for i in range(self.cfg.max_seqs) if not (self.tokens[i] or self.dirty[i])]

    @precondition(lambda self: self.paged and self.empty_slots())
    @rule(data=st.data())
    def admit(self, data):
        s = data.draw(st.sampled_from(self.empty_slots()), label="slot")
        base, cut = [], 0
        if self.history and data.draw(st.integers(0, 3), label="reuse"):
            # mostly extend a whole retired sequence, sometimes a prefix of one
            base = data.draw(st.sampled_from(self.history), label="base")
            cut = data.draw(st.one_of(st.just(len(base)), st.integers(0, len(base))), label="cut")
        tail = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=0 if cut else 1, max_size=4), label="tail")
        prompt = (base[:cut] + tail)[: self.cfg.max_seq_len] or [0]
        addr = data.draw(st.one_of(st.just(-1), st.integers(0, len(prompt) + 1)), label="addressable_len")
        note(f"cache.admit({s}, {prompt}, addressable_len={addr})")
        hit = self.cache.admit(s, prompt, addressable_len=addr)
        limit = len(prompt) - 1 if addr == -1 else min(addr, len(prompt))
        assert hit % self.P == 0 and 0 <= hit <= limit, f"hit={hit} limit={limit}"
        if not self.cfg.enable_prefix_caching:
            assert hit == 0
        for i in range(hit // self.P):
            assert tuple(prompt[: (i + 1) * self.P]) in self.published, f"block {i} of the hit was never published"
        if self.has_state and hit:
            assert tuple(prompt[:hit]) in self.checkpointed, f"hybrid hit {hit} without a checkpoint"
        event(f"admit hit {'> 0' if hit else '= 0'}{' (hybrid)' if self.has_state else ''}")
        self.tokens[s] = prompt[:hit]
        self.adopted[s] = hit
        self.dirty[s] = hit > 0
        self.plan[s] = prompt

    @precondition(lambda self: self.paged)
    @rule(data=st.data())
    def retire(self, data):
        busy = [i for i in range(self.cfg.max_seqs) if self.tokens[i]]
        s = data.draw(st.sampled_from(busy) if busy else st.integers(0, self.cfg.max_seqs - 1), label="slot")
        toks = self.tokens[s]
        full = toks + data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=1), label="sampled")
        seq = len(toks)
        addr = data.draw(st.one_of(st.just(-1), st.integers(0, seq + 1)), label="addressable_len")
        note(f"cache.retire({s}, {full}, addressable_len={addr})")
        call = lambda: self.cache.retire(s, full, addressable_len=addr)  # noqa: E731
        if addr > seq:
            return self.expect_raise(call, ValueError, "addressable_len")
        call()
        a = min(len(full), seq) if addr == -1 else addr
        self.record_retire(full, seq, a)
        event(f"retire published {min(a // self.P, 2) if self.cfg.enable_prefix_caching else 0}+ blocks")
        self.free_slot(s)

    def record_retire(self, full, seq, a):
        """Model side of retire: what becomes publishable and checkpointed."""
        if self.cfg.enable_prefix_caching:
            for i in range(a // self.P):
                self.published.add(tuple(full[: (i + 1) * self.P]))
            if self.has_state and self.cfg.resolved_num_state_checkpoints and a == seq and a and a % self.P == 0:
                self.checkpointed.add(tuple(full[:a]))
        self.history.append(list(full))

    @rule(data=st.data())
    def reset(self, data):
        if data.draw(st.integers(0, 9), label="rare") != 0:
            return
        note("cache.reset()")
        self.cache.reset()
        self.reset_model()

    @rule(data=st.data())
    def misuse(self, data):
        """Wrong calls that must raise and change nothing."""
        if data.draw(st.integers(0, 2), label="gate"):
            return
        S = self.cfg.max_seqs
        s = data.draw(st.integers(0, S - 1), label="slot")
        seq = len(self.tokens[s])
        kind = data.draw(st.sampled_from(["past", "dup", "slot", "kind", "admit"]), label="misuse")
        note(f"# misuse {kind} on slot {s}")
        if kind == "admit" and self.paged and (self.tokens[s] or self.dirty[s]):
            self.expect_raise(lambda: self.cache.admit(s, [1, 2, 3]), ValueError, "must be empty")
        elif kind == "admit" and not self.paged:
            self.expect_raise(lambda: self.cache.admit(s, [1, 2, 3]), RuntimeError, "needs PAGED")
        elif kind == "past":
            self.expect_raise(lambda: self.cache.prepare_step([0, 1], [seq + 1], [s]), ValueError, "past_len[0]")
        elif kind == "dup":
            self.expect_raise(lambda: self.cache.prepare_step([0, 1, 2], [seq, seq], [s, s]), ValueError, "duplicates")
        elif kind == "slot":
            self.expect_raise(lambda: self.cache.evict_batch(S), IndexError, "out of range")
        else:
            self.expect_raise(lambda: self.cache.fill(0, s, np.zeros((1, HEADS, DIM)), np.zeros((1, HEADS, DIM))), TypeError, "ATTENTION")

    # ------------------------------------------------------------------ invariants

    @invariant()
    def agrees_with_model(self):
        cache = self.cache
        cache.check_invariants()
        assert cache.seq_lens().tolist() == [len(t) for t in self.tokens]
        dt = self.cfg.np_dtype
        for l, spec in enumerate(self.specs):
            for s in range(self.cfg.max_seqs):
                if spec.kind in ATTN:
                    k, v = ops.gather_kv(cache, l, s)
                    wk, wv = self.dense_kv(l, self.tokens[s])
                    assert k.tobytes() == wk.astype(dt).tobytes(), f"K of layer {l} slot {s} differs"
                    assert v.tobytes() == wv.astype(dt).tobytes(), f"V of layer {l} slot {s} differs"
                elif spec.kind is LayerKind.CROSS_ATTENTION:
                    k, v = ops.gather_kv(cache, l, s)
                    if self.enc[s] is None:
                        assert k.shape[0] == 0 and not cache.keys(l)[s].any()
                    else:
                        assert np.array_equal(k, self.enc[s][0]) and np.array_equal(v, self.enc[s][1])
                else:
                    conv, rec = self.state_of(self.tokens[s])
                    assert np.array_equal(cache.conv_state(l)[s], conv), f"conv state of slot {s} differs"
                    assert np.array_equal(cache.recurrent_state(l)[s], rec), f"recurrent state of slot {s} differs"


def _dense(q, k, v, first_pos, *, window=None, causal=True):
    """Per-query softmax attention in float64 (GQA by head grouping)."""
    Tq, Hq, D = q.shape
    group = Hq // k.shape[1]
    out = np.zeros((Tq, Hq, D))
    for j in range(Tq):
        p = first_pos + j
        lo = max(0, p - window + 1) if (causal and window) else 0
        hi = p + 1 if causal else k.shape[0]
        for h in range(Hq):
            kk, vv = k[lo:hi, h // group].astype(np.float64), v[lo:hi, h // group].astype(np.float64)
            sc = kk @ q[j, h].astype(np.float64) / np.sqrt(D)
            w = np.exp(sc - sc.max())
            out[j, h] = (w / w.sum()) @ vv
    return out


TestSlotCacheMachine = SlotCacheMachine.TestCase
