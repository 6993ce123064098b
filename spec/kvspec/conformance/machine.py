"""``KVCacheComparison``: the differential state machine of the slot cache (STYLE §4).

Each example builds one small cache on the backend under test and the same
cache on ``kvref`` (the model), then applies random operations to both: one
rule per public method, named after it. Every call goes through
:meth:`KVCacheComparison._both`, which captures value or exception on each
side, asserts the same outcome (value, or type and message), and after a raise
asserts that neither side's observable state moved. One ``@invariant`` then
runs ``check_invariants()`` and compares lengths, block tables, the free
order, stored K/V bytes, state slabs and cross planes.

Run it for a backend with::

    from hypothesis.stateful import run_state_machine_as_test
    run_state_machine_as_test(KVCacheComparison.for_backend(backend))

Each call is recorded as Python source (``capture(source=...)``), so a failure
carries a paste-ready script that replays it (``_compare.Reproduction``).
"""

from __future__ import annotations

import numpy as np
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, multiple, precondition, rule

from .. import strategies as kst
from .._config import KVCacheMode, LayerKind
from ._backend import Backend, BackendBound
from ._compare import assert_same, assert_same_outcome, begin_reproduction, capture, data_ptr, record, to_numpy

__all__ = ["KVCacheComparison", "KVCacheFP8Comparison", "scatter_kv", "cache_snapshot", "live_kv"]

_ATTN = (LayerKind.ATTENTION, LayerKind.SLIDING_WINDOW)

#: True one draw in eight (False is the simplest value, so shrinking drops faults).
_RARE = st.sampled_from([False] * 7 + [True])

#: FP8 storage dtypes of :class:`KVCacheFP8Comparison` (spec/slot-cache.md §10).
_FP8 = ("float8_e4m3fn", "float8_e5m2")


def _is_fp8(cache) -> bool:
    cfg = getattr(cache, "config", None)
    return cfg is not None and str(cfg.dtype).startswith("float8")


def _bits(x, fp8: bool) -> np.ndarray:
    """Host copy of ``x``; FP8 storage as its uint8 bit patterns (a CUDA backend stores FP8 as uint8)."""
    a = to_numpy(x).copy()
    return a.view(np.uint8) if fp8 else a


def scatter_kv(cache, layer: int, k: np.ndarray, v: np.ndarray, step) -> None:
    """Write a step's K/V through ``step.slot_mapping`` into the live views
    (what ``append_kv`` does; used for backends that ship no ``ops``)."""
    sm = to_numpy(step.slot_mapping)
    for view, src in ((cache.keys(layer), k), (cache.values(layer), v)):
        flat = view.reshape(-1, *view.shape[2:])
        if isinstance(flat, np.ndarray):
            flat[sm] = src
        else:  # pragma: no cover - GPU arrays
            from ._compare import to_device

            flat[to_device(sm)] = to_device(src)


#: How ``append_kv`` receives K and V (the storage dtype unless the layout says otherwise).
_LAYOUTS = ("contiguous", "contiguous", "strided_v", "strided_k", "inner_strided", "float32", "float64", "same_size")

#: Edits of a step's ``slot_mapping``: padding (-1) at token 0 or the last token, exactly the
#: pool's end (one past the last row: ``IndexError``), the pool's last row (a legal write).
_EDGES = ("pad_first", "pad_last", "end_first", "end_last", "last_row_first")


def _strided(a: np.ndarray, axis: int) -> np.ndarray:
    """``a``'s values as a view with stride 2 along ``axis`` (every other element of a bigger array)."""
    shape = list(a.shape)
    shape[axis] *= 2
    big = np.zeros(shape, a.dtype)
    index = [slice(None)] * a.ndim
    index[axis] = slice(None, None, 2)
    view = big[tuple(index)]
    view[...] = a
    return view


def _layout(layout: str, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(k, v)`` as ``append_kv`` receives them under ``layout`` (same values)."""
    if layout == "strided_v":  # a strided V with a contiguous K
        return k, _strided(v, 0)
    if layout == "strided_k":
        return _strided(k, 0), v
    if layout == "inner_strided":  # head_dim not contiguous in K, heads not in V
        return _strided(k, 2), _strided(v, 1)
    if layout == "same_size":  # another dtype of the storage's item size: a bit copy would be wrong
        other = {"float16": "bfloat16", "bfloat16": "float16"}.get(k.dtype.name, "float16")
        layout = other
    if layout in ("float32", "float64", "float16", "bfloat16"):  # cast on write; the values are exact in each
        from .._dtypes import KV_DTYPES

        dt = KV_DTYPES.get(layout, np.dtype(layout) if layout != "bfloat16" else None)
        return k.astype(dt), v.astype(dt)
    return k, v


def _bend(step, edge: str, rows: int):
    """``step`` with its ``slot_mapping`` edited at an edge (see ``_EDGES``)."""
    import dataclasses

    sm = np.array(to_numpy(step.slot_mapping), copy=True)
    i = 0 if edge.endswith("first") else sm.shape[0] - 1
    sm[i] = {"pad_first": -1, "pad_last": -1, "end_first": rows, "end_last": rows, "last_row_first": rows - 1}[edge]
    return dataclasses.replace(step, slot_mapping=sm)


def _assign(view, index, values: np.ndarray) -> None:
    if isinstance(view, np.ndarray):
        view[index] = values
    else:  # pragma: no cover - GPU arrays
        from ._compare import to_device

        view[index] = to_device(values)


def live_kv(cache, layer: int, slot: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V of positions ``[0, n)`` of ``slot``, read through the public views
    and ``paged_block_table()`` (no ``ops`` needed)."""
    K, V = to_numpy(cache.keys(layer)), to_numpy(cache.values(layer))
    if cache.mode() is KVCacheMode.CONTIGUOUS:
        if not 0 <= n <= K.shape[1]:
            raise AssertionError(f"slot {slot} has length {n}, outside the cache's [0, {K.shape[1]}] (keys({layer}).shape={K.shape})")
        return K[slot, :n].copy(), V[slot, :n].copy()
    table = to_numpy(cache.paged_block_table())
    P = K.shape[1]
    if not 0 <= n <= table.shape[1] * P:
        raise AssertionError(
            f"slot {slot} has length {n}, outside the block table's [0, {table.shape[1] * P}] "
            f"({table.shape[1]} columns of {P} tokens)"
        )
    pos = np.arange(n)
    blocks = table[slot, pos // P]
    bad = np.flatnonzero((blocks < 0) | (blocks >= K.shape[0]))
    if bad.size:
        raise AssertionError(f"paged_block_table()[{slot}, {int(pos[bad[0]]) // P}]={int(blocks[bad[0]])} "
                             f"is not a block of the pool [0, {K.shape[0]})")
    return K[blocks, pos % P].copy(), V[blocks, pos % P].copy()


def cache_snapshot(cache, specs, *, free_order: bool) -> dict:
    """Everything observable of a cache, as host copies (for atomicity checks)."""
    snap = {"seq_lens": to_numpy(cache.seq_lens()).copy(), "mode": cache.mode()}
    fp8 = _is_fp8(cache)
    table = cache.paged_block_table()
    snap["block_table"] = None if table is None else to_numpy(table).copy()
    if free_order:
        snap["free_order"] = list(cache._free_order())
    for l, spec in enumerate(specs):
        if spec.kind is LayerKind.STATE:
            for i in range(len(spec.conv_dims)):
                snap[f"conv_state({l}, {i})"] = to_numpy(cache.conv_state(l, i)).copy()
            if spec.recurrent is not None:
                snap[f"recurrent_state({l})"] = to_numpy(cache.recurrent_state(l)).copy()
        else:
            snap[f"keys({l})"] = _bits(cache.keys(l), fp8)
            snap[f"values({l})"] = _bits(cache.values(l), fp8)
            if fp8:  # spec/slot-cache.md §10.4: a raise changes no scale either
                ks, vs = cache.scales(l)
                snap[f"scales({l})"] = (to_numpy(ks).copy(), to_numpy(vs).copy())
    return snap


class KVCacheComparison(BackendBound, RuleBasedStateMachine):
    """Differential state machine: the backend's ``KVCache`` against ``kvref.KVCache``.

    Attributes
    ----------
    backend : Backend
        Set by :meth:`for_backend`; the class itself cannot run.
    oracle : Backend
        ``kvref.conformance_backend()`` unless given.
    """

    prompts = Bundle("prompts")

    #: FP8 storage dtypes every example draws from; empty: the configuration's own dtype
    #: (:class:`KVCacheFP8Comparison` sets them).
    fp8_dtypes: tuple[str, ...] = ()

    def __init__(self):
        self._require_backend()
        super().__init__()
        self.ref = self.sut = None
        self.step = None

    # ------------------------------------------------------------------ helpers

    @property
    def strict(self) -> bool:
        return self.backend.supports("strict_block_ids")

    def _snap(self, cache, side: str) -> dict:
        return cache_snapshot(cache, self.specs, free_order=(side == "ref" or self.strict) and self.paged)

    def _both(self, label: str, fn, values: dict | None = None):
        """Apply ``fn(cache, ops)`` to both sides; same outcome; no state change after a raise.

        ``label`` is the call as Python source (recorded for the reproduction,
        with the arrays ``values`` it names). Returns the pair of values when both returned.
        """
        __tracebackhide__ = True
        before = (self._snap(self.ref, "ref"), self._snap(self.sut, "sut"))
        r = capture(lambda: fn(self.ref, self.oracle.ops))
        s = capture(lambda: fn(self.sut, self.backend.ops), source=label, values=values)
        assert_same_outcome(label, r, s)
        if r.raised:
            assert_same(before[0], self._snap(self.ref, "ref"), f"{label} [kvref state after raise]")
            assert_same(before[1], self._snap(self.sut, "sut"), f"{label}: state changed after {type(s.exc).__name__}")
            return None
        return r.value, s.value

    def _seq(self) -> list[int]:
        return [int(x) for x in to_numpy(self.ref.seq_lens())]

    def _tokens_for(self, s: int, n: int, data) -> list[int]:
        """Token ids of slot ``s`` for positions ``[0, n)``, drawing the unknown ones."""
        toks = self.seqtok[s]
        while len(toks) < n:
            toks.append(data.draw(kst.token_ids(), label="token"))
        return toks[:n]

    def _pick(self, data, good, bad, label: str):
        """Draw from ``good`` (a strategy), or one time in eight from the list ``bad``
        (out-of-range or wrong-kind arguments, to compare error paths)."""
        if bad and data.draw(_RARE, label=f"{label} fault"):
            return data.draw(st.sampled_from(bad), label=label)
        return data.draw(good, label=label)

    def _forget(self, s: int) -> None:
        self.seqtok[s] = []
        self.fresh[s] = set()

    def _layers(self, *kinds) -> list[int]:
        return [l for l, sp in enumerate(self.specs) if sp.kind in kinds]

    # ------------------------------------------------------------------ construction

    @initialize(data=st.data())
    def make(self, data):
        cfg, specs = data.draw(kst.cache_configs(self.backend.capabilities), label="config")
        if self.fp8_dtypes:  # KVCacheFP8Comparison: every example stores FP8 (no extra draw otherwise)
            import dataclasses

            cfg = dataclasses.replace(cfg, dtype=data.draw(st.sampled_from(self.fp8_dtypes), label="fp8 dtype"))
        self.cfg, self.specs = cfg, specs
        self.fp8 = cfg.dtype in _FP8
        #: what append_kv and fill are fed: float32 for FP8 caches (quantised on write), else the storage dtype
        self.kv_dtype = "float32" if self.fp8 else cfg.dtype
        self.paged = cfg.mode is KVCacheMode.PAGED
        self.S, self.L, self.P = cfg.max_seqs, cfg.max_seq_len, cfg.block_size
        begin_reproduction("cache", self.backend, config=cfg, specs=specs)
        self.ref = self.oracle.make_cache(cfg, specs)
        self.sut = self.backend.build_cache(cfg, specs)
        self.seqtok = {s: [] for s in range(self.S)}
        self.fresh = {s: set() for s in range(self.S)}
        self.ptrs = {}
        for l, sp in enumerate(specs):
            if sp.kind is LayerKind.STATE:
                for i in range(len(sp.conv_dims)):
                    self.ptrs[("conv_state", l, i)] = data_ptr(self.sut.conv_state(l, i))
                if sp.recurrent is not None:
                    self.ptrs[("recurrent_state", l)] = data_ptr(self.sut.recurrent_state(l))
            else:
                self.ptrs[("keys", l)] = data_ptr(self.sut.keys(l))
                self.ptrs[("values", l)] = data_ptr(self.sut.values(l))
        self._prefill(data)

    def _prefill(self, data) -> None:
        """Every example starts with K/V in every slot: a forward of a drawn length
        (often 1, often the whole ``max_seq_len``, so the storage's first and
        last rows are written) per slot, then a gather of each written slot."""
        if self.backend.ops is None and not self.strict:
            return
        for s in range(self.S):
            n = data.draw(st.sampled_from([0, 1, 1, self.L, self.L]) | st.integers(1, self.L), label=f"prefill {s}")
            if n == 0:
                continue
            out = self._both(
                f"step = cache.prepare_step(np.array([0, {n}], np.int32), np.array([0], np.int32), np.array([{s}], np.int32))",
                lambda c, ops, n=n, s=s: c.prepare_step(np.array([0, n], np.int32), np.array([0], np.int32),
                                                        np.array([s], np.int32)),
            )
            if out is None:  # a small pool ran out: CapacityError on both sides
                continue
            self.step = (out[0], out[1], [(s, 0, n)])
            self._tokens_for(s, n, data)
            self.append_kv(data)
            self._both(f"cache.update_position({s}, {n})", lambda c, ops, s=s, n=n: c.update_position(s, n))
        self.step = None
        if self.backend.ops is not None and self.strict:
            for s in range(self.S):
                for l in self._layers(*_ATTN):
                    self._both(f"tuple(np.asarray(x) for x in ops.gather_kv(cache, {l}, {s}))",
                               lambda c, ops, l=l, s=s: tuple(to_numpy(x).copy() for x in ops.gather_kv(c, l, s)))

    # ------------------------------------------------------------------ prompts

    @rule(target=prompts, p=kst.prompts(1, 12))
    def new_prompt(self, p):
        return p

    @rule(target=prompts, base=prompts, more=kst.prompts(1, 6))
    def extend_prompt(self, base, more):
        return base + more

    # ------------------------------------------------------------------ steps

    @rule(data=st.data())
    def prepare_step(self, data):
        seq = self._seq()
        B = data.draw(st.integers(1, min(3, self.S)), label="rows")
        slots = data.draw(st.permutations(range(self.S)), label="order")[:B]
        q = [data.draw(st.integers(1, 3), label="q_len") for _ in range(B)]
        past = [seq[s] for s in slots]
        if data.draw(_RARE, label="to the end"):  # the last row fills its slot: the pool's last storage row
            q[-1] = max(self.L - past[-1], 1)
        fault = data.draw(st.sampled_from(["ok"] * 8 + ["past", "dup", "slot", "cu0", "long", "shape"]), label="fault")
        cu = [0]
        for n in q:
            cu.append(cu[-1] + n)
        if fault == "past":
            past[0] += 1
        elif fault == "dup" and B >= 2:
            slots[1] = slots[0]
        elif fault == "slot":
            slots[-1] = self.S
        elif fault == "cu0":
            cu = [1] + cu[1:]
        elif fault == "long":
            q[0] = self.L - past[0] + 1
            cu = [0]
            for n in q:
                cu.append(cu[-1] + n)
        elif fault == "shape":
            past = past + [0]
        args = (np.array(cu, np.int32), np.array(past, np.int32), np.array(slots, np.int32))
        out = self._both(
            f"step = cache.prepare_step(np.array({cu}, np.int32), np.array({past}, np.int32), np.array({slots}, np.int32))",
            lambda c, ops: c.prepare_step(*args),
        )
        self.step = None
        if out is not None:
            self.step = (out[0], out[1], list(zip(slots, past, q)))
            for s, p, n in self.step[2]:
                self._tokens_for(s, p + n, data)
            # A forward, most of the time: real K/V into every attention layer, then the commit,
            # so stored bytes change often and are compared after each write.
            if self.backend.ops is not None or self.paged or self.strict:
                if data.draw(st.sampled_from([True, True, True, False]), label="forward"):
                    self.append_kv(data)
                    if data.draw(st.sampled_from([True, True, True, False]), label="commit"):
                        for s, p, n in list(self.step[2]):
                            self._both(f"cache.update_position({s}, {p + n})", lambda c, ops, s=s, v=p + n: c.update_position(s, v))

    @precondition(lambda self: self.step is not None)
    @rule(data=st.data())
    def append_kv(self, data):
        """Write the last step's K/V into every attention layer.

        K and V are independent non-zero draws that differ in every element
        (``kst.kv_pairs``), passed contiguous, with V (or K) strided, with a
        non-contiguous inner axis, or in a dtype other than storage's (cast on
        write). With ``strict_block_ids`` the step's ``slot_mapping`` is
        sometimes bent at its edges: token 0 or the last token made padding
        (``-1``, skipped), or pointed exactly at the pool's end (``IndexError``,
        nothing written) or at its last row.
        """
        ref_step, sut_step, rows = self.step
        T = int(sum(n for _, _, n in rows))
        layout = data.draw(st.sampled_from(_LAYOUTS), label="layout")
        edge = "none"
        if self.strict and self.backend.ops is not None and isinstance(sut_step.slot_mapping, np.ndarray):
            edge = data.draw(st.sampled_from(["none"] * 6 + list(_EDGES)), label="slot_mapping edge")
        skipped = set()
        event(f"append_kv: layout {layout}, slot_mapping edge {edge}")
        for l in self._layers(*_ATTN):
            sp = self.specs[l]
            k, v = data.draw(kst.kv_pairs((T, sp.kv_heads, sp.head_dim), self.kv_dtype), label="k, v")
            k_in, v_in = _layout(layout, k, v)
            steps = {id(self.ref): ref_step, id(self.sut): sut_step}
            if edge != "none":
                rows_total = int(np.prod(to_numpy(self.ref.keys(l)).shape[:2]))
                steps = {key: _bend(st_, edge, rows_total) for key, st_ in steps.items()}
                if edge in ("pad_first", "pad_last"):
                    skipped.add(0 if edge == "pad_first" else T - 1)

            def call(c, ops, l=l, k=k_in, v=v_in, steps=steps):
                st_ = steps[id(c)]
                if ops is None:
                    return scatter_kv(c, l, k, v, st_)
                return ops.append_kv(c, l, k, v, st_)

            values = {"k": k_in, "v": v_in}
            target = "step"
            if edge != "none":
                values["sm"] = to_numpy(steps[id(self.sut)].slot_mapping)
                target = "__import__('dataclasses').replace(step, slot_mapping=sm)"
            self._both(f"ops.append_kv(cache, {l}, k, v, {target})", call, values=values)
        t = 0
        for s, p, n in rows:
            self.fresh[s].update(p + j for j in range(n) if t + j not in skipped)
            t += n

    @rule(data=st.data())
    def update_position(self, data):
        seq = self._seq()
        if self.step is not None and data.draw(st.booleans(), label="commit"):
            s, p, n = data.draw(st.sampled_from(self.step[2]), label="row")
            new = p + n
        else:
            s = self._pick(data, st.integers(0, self.S - 1), [self.S, -1], "slot")
            base = seq[s] if 0 <= s < self.S else 0
            new = self._pick(data, st.integers(max(base - self.P, 0), base + self.P), [-1, self.L + 1], "new_pos")
        out = self._both(f"cache.update_position({s}, {new})", lambda c, ops: c.update_position(s, new))
        if out is not None:
            self._tokens_for(s, new, data)
            self.fresh[s] = {x for x in self.fresh[s] if x < new}

    @precondition(lambda self: self.paged)
    @rule(data=st.data())
    def reserve(self, data):
        seq = self._seq()
        B = data.draw(st.integers(0, min(3, self.S)), label="rows")
        slots = data.draw(st.permutations(range(self.S)), label="order")[:B]
        n = [data.draw(st.integers(0, 3), label="n_new") for _ in slots]
        if slots and data.draw(_RARE, label="fault"):
            n[0] = self.L + 1 - seq[slots[0]]
        out = self._both(
            f"cache.reserve(np.array({slots}, np.int64), np.array({n}, np.int64))",
            lambda c, ops: c.reserve(np.array(slots, np.int64), np.array(n, np.int64)),
        )
        self.step = None
        if out is not None:
            for s, k in zip(slots, n):
                self._tokens_for(s, seq[s] + k, data)

    @precondition(lambda self: self.backend.ops is not None and self.strict)
    @rule(data=st.data())
    def gather_kv(self, data):
        """``ops.gather_kv`` of one slot (exact; needs ``strict_block_ids`` because
        positions reserved but never written hold a reused block's old bytes)."""
        layers = self._layers(*_ATTN)
        l = self._pick(data, st.sampled_from(layers), [len(self.specs)], "layer")
        busy = [s for s, n in enumerate(self._seq()) if n > 0]
        # Non-empty slots, usually: a gather of an empty slot compares two empty arrays.
        s = self._pick(data, st.sampled_from(busy) if busy else st.integers(0, self.S - 1), [self.S], "slot")
        if 0 <= s < self.S and l < len(self.specs):
            n = self._seq()[s]
            event(f"gather_kv: length {'0' if n == 0 else '1' if n == 1 else '>1'}")
        self._both(f"tuple(np.asarray(x) for x in ops.gather_kv(cache, {l}, {s}))", lambda c, ops: tuple(to_numpy(x).copy() for x in ops.gather_kv(c, l, s)))

    @precondition(lambda self: self.step is not None and self.backend.ops is not None and self.strict)
    @rule(data=st.data())
    def varlen_attention(self, data):
        """``ops.varlen_attention`` through the last step: same errors, outputs within
        dtype tolerance (float32 1e-5, half precision 1e-2)."""
        ref_step, sut_step, rows = self.step
        T = int(sum(n for _, _, n in rows))
        l = data.draw(st.sampled_from(self._layers(*_ATTN, LayerKind.CROSS_ATTENTION)), label="layer")
        sp = self.specs[l]
        q = data.draw(kst.kv_arrays((T, sp.kv_heads * data.draw(st.integers(1, 2), label="group"), sp.head_dim), "float32"), label="q")
        r = capture(lambda: self.oracle.ops.varlen_attention(q, self.ref, l, ref_step))
        s = capture(lambda: self.backend.ops.varlen_attention(q, self.sut, l, sut_step),
                    source=f"ops.varlen_attention(q, cache, {l}, step)", values={"q": q})
        if r.raised or s.raised:
            assert_same_outcome(f"ops.varlen_attention(q, cache, {l}, step)", r, s)
            return
        # FP8: both sides attend over the same dequantised float32 history (spec/slot-cache.md §10.3)
        tol = 1e-5 if self.cfg.dtype == "float32" or self.fp8 else 1e-2
        np.testing.assert_allclose(to_numpy(s.value), to_numpy(r.value), rtol=tol, atol=tol,
                                   err_msg=f"ops.varlen_attention(q, cache, {l}, step)")

    # ------------------------------------------------------------------ lifecycle

    @rule(data=st.data())
    def evict_batch(self, data):
        s = self._pick(data, st.integers(0, self.S - 1), [self.S, -1], "slot")
        out = self._both(f"cache.evict_batch({s})", lambda c, ops: c.evict_batch(s))
        self.step = None
        if out is not None:
            self._forget(s)

    @rule(gate=st.sampled_from([False] * 7 + [True]))
    def reset(self, gate):
        if not gate:  # a rare rule: one draw in eight resets
            return
        self._both("cache.reset()", lambda c, ops: c.reset())
        self.step = None
        for s in range(self.S):
            self._forget(s)

    @precondition(lambda self: self._layers(LayerKind.CROSS_ATTENTION))
    @rule(data=st.data())
    def fill(self, data):
        cross = self._layers(LayerKind.CROSS_ATTENTION)
        l = self._pick(data, st.sampled_from(cross), [0, len(self.specs)], "layer")
        sp = self.specs[l] if l < len(self.specs) else self.specs[0]
        s = data.draw(st.integers(0, self.S - 1), label="slot")
        t = self._pick(data, st.integers(1, max(sp.max_enc_len, 1)), [0, sp.max_enc_len + 1], "t_enc")
        shape = (t, sp.kv_heads or 1, sp.head_dim or 1)
        k = data.draw(kst.kv_arrays(shape, self.kv_dtype), label="k")
        v = data.draw(kst.kv_arrays(shape, self.kv_dtype), label="v")
        self._both(f"cache.fill({l}, {s}, k, v)", lambda c, ops: c.fill(l, s, k, v), values={"k": k, "v": v})

    # ------------------------------------------------------------------ prefix reuse

    @precondition(lambda self: self.paged)
    @rule(data=st.data(), prompt=prompts, more=kst.prompts(0, 4))
    def admit(self, data, prompt, more):
        seq = self._seq()
        prompt = (prompt + more)[: self.L] or [0]
        table = self.ref.paged_block_table()
        empty = [s for s in range(self.S) if seq[s] == 0 and (table is None or not table[s].any())]
        if empty and not data.draw(_RARE, label="busy slot"):
            s = data.draw(st.sampled_from(empty), label="slot")
        else:
            s = data.draw(st.integers(0, self.S), label="slot")
        addr = data.draw(st.one_of(st.just(-1), st.just(-1), st.integers(-2, len(prompt) + 1)), label="addressable_len")
        out = self._both(
            f"cache.admit({s}, np.array({prompt}, np.int32), {addr})",
            lambda c, ops: c.admit(s, np.array(prompt, np.int32), addr),
        )
        self.step = None
        if out is not None:
            self.seqtok[s] = list(prompt)
            self.fresh[s] = set()

    @precondition(lambda self: self.paged)
    @rule(target=prompts, data=st.data())
    def retire(self, data):
        """Retire a slot; its tokens join the ``prompts`` bundle so later admits can hit."""
        seq = self._seq()
        s = self._pick(data, st.integers(0, self.S - 1), [self.S], "slot")
        n = seq[s] if s < self.S else 0
        toks = list(self._tokens_for(s, n + 1, data)) if s < self.S else [0]
        toks = toks[: n + data.draw(st.integers(-1, 1), label="extra")] if n else toks[:1]
        if toks and data.draw(_RARE, label="fault"):
            toks[0] = kst.VOCAB  # contradicts an adopted block, if any
        addr = data.draw(st.one_of(st.just(-1), st.just(-1), st.integers(-2, n + 1)), label="addressable_len")
        out = self._both(
            f"cache.retire({s}, np.array({toks}, np.int32), {addr})",
            lambda c, ops: c.retire(s, np.array(toks, np.int32), addr),
        )
        self.step = None
        if out is None or not toks:
            return multiple()
        self._forget(s)
        return toks

    # ------------------------------------------------------------------ accessors

    @rule(data=st.data())
    def keys(self, data):
        l = self._pick(data, st.integers(0, len(self.specs) - 1), [-1, len(self.specs)], "layer")
        self._both(f"cache.keys({l})", lambda c, ops: _bits(c.keys(l), self.fp8))

    @rule(data=st.data())
    def values(self, data):
        l = self._pick(data, st.integers(0, len(self.specs) - 1), [-1, len(self.specs)], "layer")
        self._both(f"cache.values({l})", lambda c, ops: _bits(c.values(l), self.fp8))

    @precondition(lambda self: self.backend.supports("slot_fp8"))
    @rule(data=st.data())
    def scales(self, data):
        """``scales(layer)`` (spec/slot-cache.md §10.1): the same values on both sides; a
        ``RuntimeError`` on a non-FP8 cache, ``IndexError``/``TypeError`` for a bad layer."""
        l = self._pick(data, st.integers(0, len(self.specs) - 1), [-1, len(self.specs)], "layer")
        self._both(f"cache.scales({l})", lambda c, ops: tuple(to_numpy(x).copy() for x in c.scales(l)))

    # ------------------------------------------------------------------ speculative decoding (spec/slot-cache.md §11)

    @precondition(lambda self: self.backend.supports("slot_spec_decode"))
    @rule(data=st.data())
    def checkpoint_state(self, data):
        s = self._pick(data, st.integers(0, self.S - 1), [self.S, -1], "slot")
        self._both(f"cache.checkpoint_state({s})", lambda c, ops: c.checkpoint_state(s))

    @precondition(lambda self: self.backend.supports("slot_spec_decode"))
    @rule(data=st.data())
    def restore_state(self, data):
        """Roll a slot back to its checkpoint (a ``ValueError`` without one); the rows after the
        restored length are no longer fresh."""
        s = self._pick(data, st.integers(0, self.S - 1), [self.S, -1], "slot")
        out = self._both(f"cache.restore_state({s})", lambda c, ops: c.restore_state(s))
        self._both(f"cache.state_checkpoint_position({s})", lambda c, ops: c.state_checkpoint_position(s))
        self.step = None
        if out is not None:
            new = out[0]
            self._tokens_for(s, new, data)
            self.fresh[s] = {x for x in self.fresh[s] if x < new}

    @precondition(lambda self: any(sp.conv_dims for sp in self.specs))
    @rule(data=st.data())
    def conv_state(self, data):
        """Read a conv slab (errors compared); on a valid one, write a slot's row
        through the live view on both sides, as a conv kernel would."""
        conv = [l for l, sp in enumerate(self.specs) if sp.conv_dims]
        l = self._pick(data, st.sampled_from(conv), [0, len(self.specs)], "layer")
        sp = self.specs[l] if l < len(self.specs) else None
        n_conv = len(sp.conv_dims) if sp is not None and sp.kind is LayerKind.STATE else 1
        i = self._pick(data, st.integers(0, max(n_conv - 1, 0)), [n_conv, -1], "index")
        out = self._both(f"cache.conv_state({l}, {i})", lambda c, ops: to_numpy(c.conv_state(l, i)).copy())
        if out is not None:
            s = data.draw(st.integers(0, self.S - 1), label="slot")
            row = data.draw(kst.kv_arrays(out[0].shape[1:], out[0].dtype), label="row")
            record(f"cache.conv_state({l}, {i})[{s}] = row", row=row)
            _assign(self.ref.conv_state(l, i), s, row)
            _assign(self.sut.conv_state(l, i), s, row)

    @precondition(lambda self: any(sp.recurrent for sp in self.specs))
    @rule(data=st.data())
    def recurrent_state(self, data):
        """Like ``conv_state`` for the recurrent slab."""
        rec = [l for l, sp in enumerate(self.specs) if sp.recurrent]
        l = self._pick(data, st.sampled_from(rec), [0, len(self.specs)], "layer")
        out = self._both(f"cache.recurrent_state({l})", lambda c, ops: to_numpy(c.recurrent_state(l)).copy())
        if out is not None:
            s = data.draw(st.integers(0, self.S - 1), label="slot")
            row = data.draw(kst.kv_arrays(out[0].shape[1:], out[0].dtype), label="row")
            record(f"cache.recurrent_state({l})[{s}] = row", row=row)
            _assign(self.ref.recurrent_state(l), s, row)
            _assign(self.sut.recurrent_state(l), s, row)

    # ------------------------------------------------------------------ invariant

    @invariant()
    def agrees_with_kvref(self):
        if self.ref is None:
            return
        self.ref.check_invariants()
        if self.backend.supports("invariants"):
            self.sut.check_invariants()
        assert_same(self.ref.mode(), self.sut.mode(), "mode()")
        assert_same(self.ref.seq_lens(), self.sut.seq_lens(), "seq_lens()")
        ref_table, sut_table = self.ref.paged_block_table(), self.sut.paged_block_table()
        if self.strict or ref_table is None:
            assert_same(ref_table, sut_table, "paged_block_table()")
        else:  # without strict block ids only the shape of the table and its live columns agree
            a, b = to_numpy(ref_table), to_numpy(sut_table)
            assert_same(a != 0, b != 0, "paged_block_table() != 0")
        if self.strict and self.paged:
            assert_same(self.ref._free_order(), list(self.sut._free_order()), "_free_order()")
        for key, ptr in self.ptrs.items():
            name, *idx = key
            now = data_ptr(getattr(self.sut, name)(*idx))
            assert now == ptr, f"{name}{tuple(idx)}: buffer moved (was {ptr:#x}, now {now:#x}); views must be live and stable"
        seq = self._seq()
        for l, sp in enumerate(self.specs):
            if sp.kind is LayerKind.STATE:
                for i in range(len(sp.conv_dims)):
                    assert_same(self.ref.conv_state(l, i), self.sut.conv_state(l, i), f"conv_state({l}, {i})")
                if sp.recurrent is not None:
                    assert_same(self.ref.recurrent_state(l), self.sut.recurrent_state(l), f"recurrent_state({l})")
            elif sp.kind is LayerKind.CROSS_ATTENTION or self.strict:
                assert_same(_bits(self.ref.keys(l), self.fp8), _bits(self.sut.keys(l), self.fp8), f"keys({l})")
                assert_same(_bits(self.ref.values(l), self.fp8), _bits(self.sut.values(l), self.fp8), f"values({l})")
                if self.fp8:
                    for name, a, b in zip(("K", "V"), self.ref.scales(l), self.sut.scales(l)):
                        assert_same(a, b, f"scales({l}) {name}")
            else:
                for s in range(self.S):
                    pos = sorted(p for p in self.fresh[s] if p < seq[s])
                    if pos:
                        rk, rv = live_kv(self.ref, l, s, seq[s])
                        sk, sv = live_kv(self.sut, l, s, seq[s])
                        if self.fp8:
                            rk, rv, sk, sv = (x.view(np.uint8) for x in (rk, rv, sk, sv))
                        assert_same(rk[pos], sk[pos], f"K of layer {l} slot {s} positions {pos}")
                        assert_same(rv[pos], sv[pos], f"V of layer {l} slot {s} positions {pos}")


class KVCacheFP8Comparison(KVCacheComparison):
    """:class:`KVCacheComparison` on FP8 caches (``spec/slot-cache.md`` §10): every example's
    ``config.dtype`` is ``float8_e4m3fn`` or ``float8_e5m2``, K/V are fed as float32 and
    quantised on write, and the comparison covers FP8 bytes and scales. For backends declaring
    ``slot_fp8``."""

    fp8_dtypes = _FP8
