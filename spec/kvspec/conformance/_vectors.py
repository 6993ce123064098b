"""Run golden-vector traces (``spec/vectors.md``) on a backend.

One interpreter serves both directions: :func:`run_trace` executes a trace's
operations on a backend and returns the records (result or error, then the
state after the op). ``spec/tools/gen_vectors.py`` runs it on kvref and
writes the records; the replay test runs it on the backend under test and
compares record by record with :func:`compare_records`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from .._config import KVCacheConfig, KVCacheMode, KVLayerSpec, LayerKind
from .._manager_types import KVCacheParams, TextContext
from ._backend import Backend
from ._compare import to_numpy
from .machine import live_kv, scatter_kv

__all__ = ["FORMAT", "encode_array", "decode_array", "run_trace", "compare_records", "dumps"]

#: Value of every file's ``"format"`` key.
FORMAT = "kvcache-golden-vectors/1"

_ERRORS = ("CapacityError", "InsufficientBlocksError", "KVLoadRefused", "KVLoadFailed",
           "ValueError", "IndexError", "TypeError", "RuntimeError")


# ---------------------------------------------------------------- encoding


def encode_array(a) -> dict:
    """``{"dtype", "shape", "data"}`` with ``data`` the C-order values (bools as
    true/false, floats exact: every float in a vector is a float16 value)."""
    a = to_numpy(a)
    name = "bfloat16" if a.dtype.name == "bfloat16" else a.dtype.name
    data = a.astype(np.float64).reshape(-1).tolist() if a.dtype.kind == "f" or name == "bfloat16" else a.reshape(-1).tolist()
    return {"dtype": name, "shape": list(a.shape), "data": data}


def decode_array(d: dict) -> np.ndarray:
    """Inverse of :func:`encode_array`."""
    from .._dtypes import KV_DTYPES

    dt = KV_DTYPES.get(d["dtype"]) or np.dtype(d["dtype"])
    return np.array(d["data"], dtype=np.float64 if dt.kind == "f" or d["dtype"] == "bfloat16" else dt).astype(dt).reshape(d["shape"])


def _sha(chunks) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(np.ascontiguousarray(to_numpy(c)).tobytes())
    return h.hexdigest()


def _encode_value(v) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray) or hasattr(v, "__cuda_array_interface__"):
        return encode_array(v)
    if isinstance(v, (list, tuple)):
        return [_encode_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _encode_value(x) for k, x in v.items()}
    import dataclasses

    if dataclasses.is_dataclass(v):
        return {f.name: _encode_value(getattr(v, f.name)) for f in dataclasses.fields(v)}
    raise TypeError(f"vectors: cannot encode {type(v).__name__}")


def dumps(obj) -> str:
    """The canonical text of a vector file: sorted keys, one-space indent, a final newline."""
    return json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=True) + "\n"


# ---------------------------------------------------------------- slot cache


def make_config(d: dict) -> KVCacheConfig:
    d = dict(d)
    d["mode"] = KVCacheMode[d["mode"]]
    return KVCacheConfig(**d)


def make_layer(d: dict) -> KVLayerSpec:
    kind = d["kind"]
    if kind == "ATTENTION":
        return KVLayerSpec.attention(d["kv_heads"], d["head_dim"])
    if kind == "SLIDING_WINDOW":
        return KVLayerSpec.sliding_window(d["kv_heads"], d["head_dim"], d["window"])
    if kind == "CROSS_ATTENTION":
        return KVLayerSpec.cross_attention(d["kv_heads"], d["head_dim"], d["max_enc_len"])
    if kind == "STATE":
        return KVLayerSpec.state(tuple(d["conv_dims"]), d["conv_width"], tuple(d["recurrent"]) if d.get("recurrent") else None)
    raise ValueError(f"vectors: layer kind={kind!r} unknown")


def _cache_state(cache, specs) -> dict:
    seq = [int(x) for x in to_numpy(cache.seq_lens())]
    table = cache.paged_block_table()
    st = {"seq_lens": seq, "block_table": None if table is None else to_numpy(table).tolist()}
    if cache.mode() is KVCacheMode.PAGED:
        st["free_order"] = [int(b) for b in cache._free_order()]
    kv, state, cross = [], [], []
    for l, sp in enumerate(specs):
        if sp.kind in (LayerKind.ATTENTION, LayerKind.SLIDING_WINDOW):
            for s, n in enumerate(seq):
                k, v = live_kv(cache, l, s, n)
                kv += [k, v]
        elif sp.kind is LayerKind.CROSS_ATTENTION:
            cross += [cache.keys(l), cache.values(l)]
        else:
            state += [cache.conv_state(l, i) for i in range(len(sp.conv_dims))]
            if sp.recurrent is not None:
                state.append(cache.recurrent_state(l))
    st["kv_sha256"] = _sha(kv)
    if str(getattr(cache.config, "dtype", "")).startswith("float8"):
        # spec/slot-cache.md §10: FP8 caches record their scales (every layer with K/V, K then V)
        st["scales_sha256"] = _sha([x for l, sp in enumerate(specs) if sp.kind is not LayerKind.STATE
                                    for x in cache.scales(l)])
    if state:
        st["state_sha256"] = _sha(state)
    if cross:
        st["cross_sha256"] = _sha(cross)
    return st


def _assign(view, index, values):
    if isinstance(view, np.ndarray):
        view[index] = values
    else:  # pragma: no cover - GPU arrays
        from ._compare import to_device

        view[index] = to_device(values)


def _cache_op(cache, ops, op: str, a: dict, ctx: dict):
    i32 = lambda x: np.array(x, np.int32)  # noqa: E731
    if op == "prepare_step":
        step = cache.prepare_step(i32(a["cu_seqlens_q"]), i32(a["past_len"]), i32(a["slot_ids"]))
        ctx["step"] = step
        return step
    if op == "append_kv":
        k, v = decode_array(a["k"]), decode_array(a["v"])
        if ops is None:
            return scatter_kv(cache, a["layer"], k, v, ctx["step"])
        return ops.append_kv(cache, a["layer"], k, v, ctx["step"])
    if op == "update_position":
        return cache.update_position(a["batch_idx"], a["new_pos"])
    if op == "reserve":
        return cache.reserve(i32(a["slot_ids"]), i32(a["n_new_per_seq"]))
    if op == "admit":
        return cache.admit(a["batch_idx"], i32(a["prompt_ids"]), a["addressable_len"])
    if op == "retire":
        return cache.retire(a["batch_idx"], i32(a["full_token_ids"]), a["addressable_len"])
    if op == "evict_batch":
        return cache.evict_batch(a["batch_idx"])
    if op == "reset":
        return cache.reset()
    if op == "fill":
        return cache.fill(a["layer"], a["batch_idx"], decode_array(a["k"]), decode_array(a["v"]))
    if op == "write_conv_state":
        return _assign(cache.conv_state(a["layer"], a["index"]), a["batch_idx"], decode_array(a["values"]))
    if op == "write_recurrent_state":
        return _assign(cache.recurrent_state(a["layer"]), a["batch_idx"], decode_array(a["values"]))
    if op == "gather_kv":  # float32 (dequantised) for FP8 caches: exact in every backend
        return tuple(to_numpy(x) for x in ops.gather_kv(cache, a["layer"], a["slot"]))
    if op == "scales":
        return tuple(to_numpy(x) for x in cache.scales(a["layer"]))
    if op == "checkpoint_state":
        return cache.checkpoint_state(a["batch_idx"])
    if op == "restore_state":
        return cache.restore_state(a["batch_idx"])
    if op == "state_checkpoint_position":
        return cache.state_checkpoint_position(a["batch_idx"])
    raise ValueError(f"vectors: KVCache op={op!r} unknown")


# ---------------------------------------------------------------- manager


def make_params(d: dict) -> KVCacheParams:
    d = dict(d)
    if d.get("leaves") is not None:
        raise ValueError("vectors: manager traces use the default leaf")
    d.pop("leaves", None)
    return KVCacheParams(**d)


def _manager_state(m, contexts: dict) -> dict:
    dp = m.params.data_parallel_degree
    st = {
        "block_count": [[m.block_count(r).free, m.block_count(r).total] for r in range(dp)],
        "free_order": [[int(b) for b in m._free_order(r)] for r in range(dp)],
        "metrics": {k: getattr(m.get_metrics_aggregated(), k) for k in ("input_tokens", "cache_tokens", "device_blocks_served")},
        "contexts": {},
    }
    bufs = []
    for r in range(dp):
        b = m.get_device_buffer(r)
        bufs.append(b if not isinstance(b, dict) else b["full"])
    st["buffer_sha256"] = _sha(bufs)
    for rid in sorted(contexts):
        c = contexts[rid]
        rec = {"processed_length": c.processed_length, "active_length": c.active_length,
               "cached_prefix_length": c.cached_prefix_length, "claimed": m.contains(c)}
        if rec["claimed"]:
            rec["blocks"] = {k: [int(x) for x in v] for k, v in m.get_req_blocks_per_leaf(c).items()}
        st["contexts"][rid] = rec
    return st


def _manager_op(m, op: str, a: dict, contexts: dict):
    if op == "new_context":
        contexts[a["request_id"]] = TextContext(a["request_id"], np.array(a["tokens"], np.int32), cache_salt=a.get("cache_salt"))
        return None
    if op == "claim":
        return m.claim(contexts[a["request_id"]], a["replica_idx"])
    if op == "alloc":
        return {"is_complete": bool(m.alloc(contexts[a["request_id"]]).is_complete())}
    if op == "write_kv":
        c = contexts[a["request_id"]]
        kv = decode_array(a["kv"])  # [active, 2, num_layers, kv_heads, head_dim]
        page = m.params.page_size
        rows = m.get_req_blocks_per_leaf(c)["full"]
        buf = m.get_device_buffer(a.get("replica_idx", 0))
        buf = buf["full"] if isinstance(buf, dict) else buf
        for j in range(kv.shape[0]):
            p = c.processed_length + j
            _assign(buf, (rows[p // page], slice(None), slice(None), p % page), kv[j])
        return None
    if op == "update":
        return contexts[a["request_id"]].update(a["token"])
    if op == "step":
        return m.step(contexts[a["request_id"]])
    if op == "release":
        return m.release(contexts[a["request_id"]])
    if op == "runtime_inputs":
        out = m.runtime_inputs([[contexts[r] for r in b] for b in a["batches"]], max_cache_length=a.get("max_cache_length"))
        return [{"lookup_table": p.lookup_table, "cache_lengths": p.cache_lengths,
                 "max_prompt_length": int(p.max_prompt_length), "max_cache_length": int(p.max_cache_length)}
                for p in out.inputs]
    if op == "get_prefix_cache_hit_counts":
        hits = m.get_prefix_cache_hit_counts(TextContext("probe", np.array(a["tokens"], np.int32), cache_salt=a.get("cache_salt")))
        return [[h.device_blocks, h.external_blocks] for h in hits]
    if op == "reset_prefix_cache":
        return m.reset_prefix_cache()
    raise ValueError(f"vectors: PagedKVCacheManager op={op!r} unknown")


# ---------------------------------------------------------------- driver


def run_trace(backend: Backend, trace: dict) -> list[dict]:
    """Execute ``trace["ops"]`` on ``backend``; one record per op.

    Returns
    -------
    list of dict
        ``{"op", "args", "result"}`` or ``{"op", "args", "error": {"type", "message"}}``,
        each with ``"state"``: the observable state after the op.
    """
    api = trace["api"]
    records = []
    if api == "KVCache":
        specs = [make_layer(d) for d in trace["layers"]]
        obj = backend.build_cache(make_config(trace["config"]), specs)
        ctx: dict = {}
        run = lambda op, a: _cache_op(obj, backend.ops, op, a, ctx)  # noqa: E731
        state = lambda: _cache_state(obj, specs)  # noqa: E731
    elif api == "PagedKVCacheManager":
        contexts: dict = {}
        obj = backend.build_manager(make_params(trace["params"]), **trace["manager"])
        run = lambda op, a: _manager_op(obj, op, a, contexts)  # noqa: E731
        state = lambda: _manager_state(obj, contexts)  # noqa: E731
    else:
        raise ValueError(f"vectors: api={api!r} unknown")
    steps = trace["ops"] if "ops" in trace else [{"op": r["op"], "args": r["args"]} for r in trace["records"]]
    for step in steps:
        rec = {"op": step["op"], "args": step["args"]}
        try:
            rec["result"] = _encode_value(run(step["op"], step["args"]))
        except AssertionError:
            raise
        except Exception as e:  # noqa: BLE001 - errors are part of the trace
            name = type(e).__name__
            if name not in _ERRORS:
                raise
            rec["error"] = {"type": name, "message": str(e)}
        rec["state"] = state()
        records.append(rec)
    return records


#: Keys that depend on block ids; compared only with ``strict_block_ids``.
ID_KEYS = {"block_table", "free_order", "slot_mapping", "blocks", "lookup_table", "buffer_sha256", "kv_sha256"}


def compare_records(expected: list[dict], got: list[dict], *, strict: bool, where: str) -> None:
    """``AssertionError`` naming the first op whose record differs."""

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if strict or k not in ID_KEYS}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    assert len(expected) == len(got), f"{where}: {len(got)} records, expected {len(expected)}"
    for i, (e, g) in enumerate(zip(expected, got)):
        e, g = strip(e), strip(g)
        if e != g:
            for key in ("error", "result", "state"):
                if e.get(key) != g.get(key):
                    detail = _first_diff(e.get(key), g.get(key), key)
                    raise AssertionError(f"{where}: op {i} ({e['op']} {json.dumps(e['args'])[:200]}): {detail}")
            raise AssertionError(f"{where}: op {i} ({e['op']}): records differ")


def _first_diff(a, b, path: str) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_diff(a.get(k), b.get(k), f"{path}.{k}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_diff(x, y, f"{path}[{i}]")
    return f"{path}: backend {json.dumps(b)[:300]}, vector {json.dumps(a)[:300]}"
