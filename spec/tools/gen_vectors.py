"""Regenerate the golden vectors in ``spec/vectors/`` from kvref.

Usage::

    python spec/tools/gen_vectors.py            # rewrite spec/vectors/*.json
    python spec/tools/gen_vectors.py --check    # exit 1 if a file would change
    python spec/tools/gen_vectors.py --out DIR  # write elsewhere

Every trace is a fixed script (or a seeded NumPy RNG), every value is exact,
and the JSON text is canonical (``kvspec.conformance._vectors.dumps``), so an
unchanged kvref regenerates byte-identical files. The format is
``spec/vectors.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import kvref
from kvspec import hashing
from kvspec.conformance._vectors import FORMAT, dumps, encode_array, run_trace
from kvspec.strategies import exact_values

VECTOR_DIR = Path(__file__).resolve().parents[1] / "vectors"
GENERATOR = "spec/tools/gen_vectors.py"


def _kv(shape, dtype, seed):
    return encode_array(exact_values(shape, dtype, seed))


def _op(op, **args):
    return {"op": op, "args": args}


def _trace(name, api, description, ops, **fields):
    return {"format": FORMAT, "name": name, "api": api, "description": description,
            "generator": GENERATOR, "ops": ops, **fields}


def _layer(kind, **kw):
    return {"kind": kind, **kw}


def _config(mode, **kw):
    base = dict(num_layers=1, max_seqs=2, max_seq_len=8, mode=mode, block_size=2, num_blocks=0,
                dtype="float16", state_dtype="float32", device="cpu", enable_prefix_caching=True,
                hash_algo="sha256", hash_seed=0, num_state_checkpoints=None)
    base.update(kw)
    return base


class _Writer:
    """Builds a step's ops: prepare_step, append_kv per attention layer, update_position."""

    def __init__(self, layers, dtype):
        self.layers, self.dtype, self.seed = layers, dtype, 1000

    def step(self, rows):
        """rows: [(slot, past, q)] -> ops."""
        cu = [0]
        for _, _, q in rows:
            cu.append(cu[-1] + q)
        ops = [_op("prepare_step", cu_seqlens_q=cu, past_len=[p for _, p, _ in rows], slot_ids=[s for s, _, _ in rows])]
        for l, layer in enumerate(self.layers):
            if layer["kind"] in ("ATTENTION", "SLIDING_WINDOW"):
                shape = (cu[-1], layer["kv_heads"], layer["head_dim"])
                ops.append(_op("append_kv", layer=l, k=_kv(shape, self.dtype, self.seed), v=_kv(shape, self.dtype, self.seed + 1)))
                self.seed += 2
        ops += [_op("update_position", batch_idx=s, new_pos=p + q) for s, p, q in rows]
        return ops


def contiguous_trace():
    layers = [_layer("ATTENTION", kv_heads=1, head_dim=2), _layer("SLIDING_WINDOW", kv_heads=1, head_dim=2, window=3)]
    w = _Writer(layers, "float16")
    ops = w.step([(1, 0, 3), (0, 0, 1)]) + w.step([(1, 3, 1), (0, 1, 1)])
    ops += [
        _op("prepare_step", cu_seqlens_q=[0, 1], past_len=[3], slot_ids=[0]),
        _op("prepare_step", cu_seqlens_q=[1, 2], past_len=[2], slot_ids=[0]),
        _op("prepare_step", cu_seqlens_q=[0, 1, 2], past_len=[2, 2], slot_ids=[0, 0]),
        _op("prepare_step", cu_seqlens_q=[0, 1], past_len=[0], slot_ids=[2]),
        _op("prepare_step", cu_seqlens_q=[0, 7], past_len=[2], slot_ids=[0]),
        _op("update_position", batch_idx=0, new_pos=9),
        _op("update_position", batch_idx=0, new_pos=1),
        _op("reserve", slot_ids=[0], n_new_per_seq=[1]),
        _op("admit", batch_idx=0, prompt_ids=[1, 2], addressable_len=-1),
        _op("evict_batch", batch_idx=1),
        _op("evict_batch", batch_idx=1),
        _op("evict_batch", batch_idx=2),
    ]
    ops += w.step([(1, 0, 2)])
    ops += [_op("reset")]
    return _trace("slot_cache_contiguous", "KVCache", "Contiguous cache: steps, sliding layer, errors, evict, reset.",
                  ops, config=_config("CONTIGUOUS", num_layers=2), layers=layers)


def paged_trace():
    layers = [_layer("ATTENTION", kv_heads=2, head_dim=2)]
    w = _Writer(layers, "float16")
    p = [1, 2, 3, 4, 5, 6, 7]
    ops = [_op("admit", batch_idx=0, prompt_ids=p, addressable_len=-1)]
    ops += w.step([(0, 0, 7)])
    ops += [_op("retire", batch_idx=0, full_token_ids=p + [8], addressable_len=-1),
            _op("admit", batch_idx=1, prompt_ids=[1, 2, 3, 4, 5, 6, 9], addressable_len=-1)]
    ops += w.step([(1, 6, 1)])
    ops += [_op("admit", batch_idx=2, prompt_ids=[1, 2, 3, 4], addressable_len=-1),
            _op("admit", batch_idx=2, prompt_ids=[1, 2], addressable_len=-1),
            _op("reserve", slot_ids=[2], n_new_per_seq=[3]),
            _op("update_position", batch_idx=2, new_pos=1),
            _op("retire", batch_idx=1, full_token_ids=[1, 2, 3, 4, 5, 6, 9], addressable_len=9),
            _op("reserve", slot_ids=[0, 1], n_new_per_seq=[8, 8]),
            _op("reserve", slot_ids=[0], n_new_per_seq=[9]),
            _op("prepare_step", cu_seqlens_q=[0, 8, 16], past_len=[0, 7], slot_ids=[0, 1])]
    ops += w.step([(0, 0, 5)])
    ops += [_op("retire", batch_idx=1, full_token_ids=[1, 2, 3, 4, 5, 6, 9], addressable_len=-1),
            _op("retire", batch_idx=2, full_token_ids=[1, 2, 9, 9, 9], addressable_len=-1),
            _op("admit", batch_idx=1, prompt_ids=[1, 2, 3, 4, 5, 6, 9, 9], addressable_len=-1),
            _op("admit", batch_idx=2, prompt_ids=[1, 2, 3, 4, 5, 6, 9, 9], addressable_len=8),
            _op("evict_batch", batch_idx=0),
            _op("evict_batch", batch_idx=1),
            _op("evict_batch", batch_idx=2),
            _op("reset")]
    return _trace("slot_cache_paged", "KVCache", "Paged cache of 6 usable blocks: admit, retire, hits, eviction, "
                  "twin publication, CapacityError atomicity.", ops,
                  config=_config("PAGED", max_seqs=3, num_blocks=7), layers=layers)


def hybrid_trace():
    layers = [_layer("ATTENTION", kv_heads=1, head_dim=2),
              _layer("STATE", conv_dims=[2], conv_width=2, recurrent=[1, 2, 2]),
              _layer("CROSS_ATTENTION", kv_heads=1, head_dim=2, max_enc_len=3)]
    w = _Writer(layers, "float16")
    p = [4, 4, 5, 5, 6]
    ops = [_op("fill", layer=2, batch_idx=0, k=_kv((2, 1, 2), "float16", 1), v=_kv((2, 1, 2), "float16", 2)),
           _op("fill", layer=2, batch_idx=0, k=_kv((1, 1, 2), "float16", 3), v=_kv((1, 1, 2), "float16", 4)),
           _op("fill", layer=0, batch_idx=0, k=_kv((1, 1, 2), "float16", 3), v=_kv((1, 1, 2), "float16", 4)),
           _op("admit", batch_idx=0, prompt_ids=p, addressable_len=-1)]
    ops += w.step([(0, 0, 4)])
    ops += [_op("write_conv_state", layer=1, index=0, batch_idx=0, values=encode_array(exact_values((2, 2), "float32", 5))),
            _op("write_recurrent_state", layer=1, batch_idx=0, values=encode_array(exact_values((1, 2, 2), "float32", 6))),
            _op("retire", batch_idx=0, full_token_ids=p, addressable_len=-1),
            _op("admit", batch_idx=1, prompt_ids=p, addressable_len=-1),
            _op("admit", batch_idx=0, prompt_ids=[4, 4, 5], addressable_len=-1)]
    ops += w.step([(1, 4, 1)])
    ops += [_op("evict_batch", batch_idx=1), _op("reset")]
    return _trace("slot_cache_hybrid", "KVCache", "Hybrid paged cache: cross fill, state slabs, checkpoint on retire, "
                  "restore on admit.", ops, config=_config("PAGED", num_layers=3), layers=layers)


def _scaled_kv(shape, seed, scale):
    """Exact float16 values times a power of two (still exact): later steps grow the FP8 scales."""
    return encode_array((exact_values(shape, "float16", seed).astype(np.float32) * scale).astype(np.float16))


def fp8_paged_trace():
    """spec/slot-cache.md §10: quantising append, re-quantisation, dequantising gather, scales
    through retire/admit and block reallocation (float8_e4m3fn)."""
    layers = [_layer("ATTENTION", kv_heads=2, head_dim=2), _layer("SLIDING_WINDOW", kv_heads=2, head_dim=2, window=3)]
    ops = []
    seed = 7000

    def step(rows, scale):
        nonlocal seed
        cu = [0]
        for _, _, q in rows:
            cu.append(cu[-1] + q)
        out = [_op("prepare_step", cu_seqlens_q=cu, past_len=[p for _, p, _ in rows], slot_ids=[s for s, _, _ in rows])]
        for l in range(2):
            shape = (cu[-1], 2, 2)
            out.append(_op("append_kv", layer=l, k=_scaled_kv(shape, seed, scale), v=_scaled_kv(shape, seed + 1, scale / 4)))
            seed += 2
        return out + [_op("update_position", batch_idx=s, new_pos=p + q) for s, p, q in rows]

    p = [1, 2, 3, 4, 5]
    ops += step([(0, 0, 3)], 0.5)
    ops += step([(0, 3, 2), (1, 0, 1)], 64.0)  # larger values: block of slot 0 re-quantised
    ops += [_op("gather_kv", layer=0, slot=0), _op("gather_kv", layer=1, slot=0), _op("scales", layer=0),
            _op("scales", layer=1), _op("scales", layer=2),
            _op("retire", batch_idx=0, full_token_ids=p, addressable_len=-1),
            _op("admit", batch_idx=2, prompt_ids=p + [6], addressable_len=-1),
            _op("gather_kv", layer=0, slot=2)]
    ops += step([(2, 4, 2)], 2.0**-6)
    ops += [_op("gather_kv", layer=0, slot=2), _op("evict_batch", batch_idx=2), _op("evict_batch", batch_idx=1)]
    ops += step([(1, 0, 4), (0, 0, 2)], 1.0)  # fresh slots pop the retained blocks: scales restart at 0
    ops += [_op("scales", layer=0), _op("gather_kv", layer=0, slot=1), _op("reset"), _op("scales", layer=1)]
    return _trace("slot_cache_fp8_paged", "KVCache", "Paged float8_e4m3fn cache: per-(block, head) scales, "
                  "re-quantisation, dequantising gather, scales through retire/admit and reallocation.", ops,
                  config=_config("PAGED", num_layers=2, max_seqs=3, num_blocks=6, dtype="float8_e4m3fn"),
                  layers=layers)


def fp8_contiguous_trace():
    """spec/slot-cache.md §10 on a contiguous float8_e5m2 cache with a cross layer."""
    layers = [_layer("ATTENTION", kv_heads=1, head_dim=4), _layer("CROSS_ATTENTION", kv_heads=1, head_dim=4, max_enc_len=3)]
    ops = [_op("fill", layer=1, batch_idx=0, k=_scaled_kv((3, 1, 4), 1, 8.0), v=_scaled_kv((3, 1, 4), 2, 0.25)),
           _op("gather_kv", layer=1, slot=0), _op("scales", layer=1),
           _op("prepare_step", cu_seqlens_q=[0, 3], past_len=[0], slot_ids=[0]),
           _op("append_kv", layer=0, k=_scaled_kv((3, 1, 4), 3, 1.0), v=_scaled_kv((3, 1, 4), 4, 1.0)),
           _op("update_position", batch_idx=0, new_pos=3),
           _op("prepare_step", cu_seqlens_q=[0, 1], past_len=[3], slot_ids=[0]),
           _op("append_kv", layer=0, k=_scaled_kv((1, 1, 4), 5, 4096.0), v=_scaled_kv((1, 1, 4), 6, 1.0)),
           _op("update_position", batch_idx=0, new_pos=4),
           _op("gather_kv", layer=0, slot=0), _op("scales", layer=0), _op("scales", layer=2),
           _op("evict_batch", batch_idx=0), _op("scales", layer=0), _op("scales", layer=1), _op("reset")]
    return _trace("slot_cache_fp8_contiguous", "KVCache", "Contiguous float8_e5m2 cache with a cross layer: "
                  "fill, append, re-quantisation, scales zeroed with the slot.", ops,
                  config=_config("CONTIGUOUS", num_layers=2, dtype="float8_e5m2"), layers=layers)


def spec_decode_trace():
    """spec/slot-cache.md §11: verify drafts, roll back, restore state, re-feed the accepted tokens."""
    layers = [_layer("ATTENTION", kv_heads=1, head_dim=2),
              _layer("STATE", conv_dims=[2], conv_width=2, recurrent=[1, 2, 2])]
    w = _Writer(layers, "float16")

    def state(seed):
        return [_op("write_conv_state", layer=1, index=0, batch_idx=0, values=encode_array(exact_values((2, 2), "float32", seed))),
                _op("write_recurrent_state", layer=1, batch_idx=0, values=encode_array(exact_values((1, 2, 2), "float32", seed + 1)))]

    ops = [_op("restore_state", batch_idx=0), _op("state_checkpoint_position", batch_idx=0)]
    ops += w.step([(0, 0, 3)]) + state(10)
    ops += [_op("checkpoint_state", batch_idx=0)]
    ops += w.step([(0, 3, 4)])[:-1] + state(20)  # verify 3 drafts + 1; 1 accepted
    ops += [_op("restore_state", batch_idx=0), _op("state_checkpoint_position", batch_idx=0)]
    ops += w.step([(0, 3, 2)]) + state(30)  # re-feed the accepted tokens
    ops += [_op("checkpoint_state", batch_idx=0), _op("reserve", slot_ids=[0], n_new_per_seq=[3]),
            _op("update_position", batch_idx=0, new_pos=6), _op("restore_state", batch_idx=0),
            _op("checkpoint_state", batch_idx=3), _op("restore_state", batch_idx=-1),
            _op("retire", batch_idx=0, full_token_ids=[1, 2, 3, 4, 5], addressable_len=-1),
            _op("state_checkpoint_position", batch_idx=0), _op("restore_state", batch_idx=0),
            _op("checkpoint_state", batch_idx=1), _op("reset"), _op("state_checkpoint_position", batch_idx=1)]
    return _trace("slot_cache_spec_decode", "KVCache", "Speculative decoding on a hybrid paged cache: "
                  "checkpoint_state before the verification step, rollback, restore_state, re-feed.", ops,
                  config=_config("PAGED", num_layers=2), layers=layers)


def random_trace(mode: str, seed: int, n_ops: int = 60):
    """A seeded random walk of valid and invalid calls, arguments chosen from the
    state of a kvref cache run alongside (the trace is then re-run to record)."""
    from kvspec.conformance._vectors import make_config, make_layer, _cache_op

    rng = np.random.default_rng(seed)
    layers = [_layer("ATTENTION", kv_heads=1, head_dim=2)]
    cfg = _config(mode, max_seqs=3, max_seq_len=8, block_size=2, num_blocks=8 if mode == "PAGED" else 0)
    cache = kvref.KVCache.make(make_config(cfg), [make_layer(d) for d in layers])
    w = _Writer(layers, "float16")
    w.seed = 5000 + seed
    ops, toks, ctx = [], {s: [] for s in range(3)}, {}
    kinds = ["step", "step", "step", "evict", "update"] + (["admit", "admit", "retire", "retire", "reserve"] if mode == "PAGED" else [])
    while len(ops) < n_ops:
        kind = kinds[int(rng.integers(len(kinds)))]
        seq = [int(x) for x in cache.seq_lens()]
        s = int(rng.integers(3))
        if kind == "step":
            slots = list(rng.permutation(3)[: int(rng.integers(1, 3))])
            rows = [(int(x), seq[int(x)], int(rng.integers(1, 4))) for x in slots]
            new = w.step(rows)
        elif kind == "evict":
            new = [_op("evict_batch", batch_idx=s)]
        elif kind == "update":
            new = [_op("update_position", batch_idx=s, new_pos=int(rng.integers(0, seq[s] + 2)))]
        elif kind == "reserve":
            new = [_op("reserve", slot_ids=[s], n_new_per_seq=[int(rng.integers(0, 4))])]
        elif kind == "admit":
            base = toks[int(rng.integers(3))] or [int(rng.integers(3))]
            prompt = (base + [int(x) for x in rng.integers(0, 3, size=int(rng.integers(1, 4)))])[:8]
            new = [_op("admit", batch_idx=s, prompt_ids=prompt, addressable_len=-1)]
        else:
            have = toks[s] + [int(x) for x in rng.integers(0, 3, size=max(0, seq[s] + 1 - len(toks[s])))]
            new = [_op("retire", batch_idx=s, full_token_ids=have[: seq[s] + 1], addressable_len=-1)]
        for o in new:
            try:
                _cache_op(cache, kvref.ops, o["op"], o["args"], ctx)
            except Exception:  # noqa: BLE001 - invalid calls are part of the walk
                continue
            if o["op"] == "admit":
                toks[o["args"]["batch_idx"]] = list(o["args"]["prompt_ids"])
            elif o["op"] in ("retire", "evict_batch"):
                b = o["args"]["batch_idx"]
                if o["op"] == "retire":
                    toks[(b + 1) % 3] = toks[(b + 1) % 3] or list(o["args"]["full_token_ids"])
                toks[b] = []
        ops += new
    name = f"slot_cache_random_{mode.lower()}_{seed}"
    return _trace(name, "KVCache", f"Seeded random walk ({mode}, seed {seed}).", ops[:n_ops],
                  config=cfg, layers=layers)


def manager_trace():
    params = dict(page_size=2, num_layers=1, kv_heads=1, head_dim=2, dtype="float16", data_parallel_degree=1,
                  enable_prefix_caching=True, hash_algo="sha256", hash_seed=0, host_offload_bytes=0,
                  disk_offload_bytes=0, disk_offload_dir=None)
    a = [1, 2, 3, 4, 5, 6, 7]

    def kv(n, seed):
        return _kv((n, 2, 1, 1, 2), "float16", seed)

    ops = [_op("new_context", request_id="a", tokens=a, cache_salt=None),
           _op("alloc", request_id="a"),
           _op("claim", request_id="a", replica_idx=0),
           _op("claim", request_id="a", replica_idx=0),
           _op("alloc", request_id="a"),
           _op("write_kv", request_id="a", kv=kv(7, 1)),
           _op("runtime_inputs", batches=[["a"]], max_cache_length=None),
           _op("update", request_id="a", token=8),
           _op("step", request_id="a"),
           _op("alloc", request_id="a"),
           _op("write_kv", request_id="a", kv=kv(1, 2)),
           _op("runtime_inputs", batches=[["a"]], max_cache_length=14),
           _op("update", request_id="a", token=9),
           _op("step", request_id="a"),
           _op("release", request_id="a"),
           _op("release", request_id="a"),
           _op("get_prefix_cache_hit_counts", tokens=a + [8, 9], cache_salt=None),
           _op("get_prefix_cache_hit_counts", tokens=a, cache_salt="other"),
           _op("new_context", request_id="b", tokens=a + [8, 10], cache_salt=None),
           _op("claim", request_id="b", replica_idx=0),
           _op("alloc", request_id="b"),
           _op("runtime_inputs", batches=[["b"]], max_cache_length=None),
           _op("new_context", request_id="c", tokens=[9, 9, 9, 9, 9, 9, 9, 9, 9], cache_salt=None),
           _op("claim", request_id="c", replica_idx=0),
           _op("alloc", request_id="c"),
           _op("release", request_id="b"),
           _op("alloc", request_id="c"),
           _op("reset_prefix_cache"),
           _op("get_prefix_cache_hit_counts", tokens=a, cache_salt=None),
           _op("release", request_id="c")]
    return _trace("manager_basic", "PagedKVCacheManager", "Manager of 7 usable pages: claim/alloc/step/release, "
                  "runtime inputs, reuse, salts, InsufficientBlocksError atomicity.", ops,
                  params=params, manager={"num_blocks": 8, "max_batch_size": 4, "max_seq_len": 14})


def manager_replicas_trace():
    params = dict(page_size=2, num_layers=2, kv_heads=1, head_dim=2, dtype="float32", data_parallel_degree=2,
                  enable_prefix_caching=True, hash_algo="xxh3_128", hash_seed=3, host_offload_bytes=0,
                  disk_offload_bytes=0, disk_offload_dir=None)
    a = [5, 6, 7, 8, 9, 10]

    def kv(n, seed):
        return _kv((n, 2, 2, 1, 2), "float32", seed)

    ops = [_op("new_context", request_id="a", tokens=a, cache_salt=None),
           _op("new_context", request_id="b", tokens=a[:4] + [1, 1, 1], cache_salt=None),
           _op("claim", request_id="a", replica_idx=0),
           _op("claim", request_id="b", replica_idx=1),
           _op("claim", request_id="b", replica_idx=2),
           _op("alloc", request_id="a"),
           _op("alloc", request_id="b"),
           _op("runtime_inputs", batches=[["a"], ["b"]], max_cache_length=None),
           _op("runtime_inputs", batches=[["a", "b"], []], max_cache_length=None),
           _op("runtime_inputs", batches=[["a"]], max_cache_length=None),
           _op("write_kv", request_id="a", kv=kv(6, 7)),
           _op("update", request_id="a", token=11),
           _op("step", request_id="a"),
           _op("get_prefix_cache_hit_counts", tokens=a + [11, 12], cache_salt=None),
           _op("release", request_id="a"),
           _op("new_context", request_id="c", tokens=a + [11, 12], cache_salt=None),
           _op("claim", request_id="c", replica_idx=1),
           _op("alloc", request_id="c"),
           _op("runtime_inputs", batches=[[], ["b", "c"]], max_cache_length=None),
           _op("release", request_id="b"),
           _op("alloc", request_id="c"),
           _op("runtime_inputs", batches=[[], ["c"]], max_cache_length=8),
           _op("get_prefix_cache_hit_counts", tokens=a + [11, 12], cache_salt=None),
           _op("release", request_id="c")]
    return _trace("manager_replicas", "PagedKVCacheManager", "Two data-parallel replicas (xxh3_128, seed 3): "
                  "per-replica block ids, lookup tables and hit counts, cross-replica reuse.", ops,
                  params=params, manager={"num_blocks": 6, "max_batch_size": 2, "max_seq_len": 10})


def hashing_vectors():
    cases = []
    for algo in ("sha256", "xxh3_128"):
        for seed, salt in ((0, None), (7, None), (0, "tenant-a"), (2**64 - 1, "\u00e9")):
            for bs, tokens in ((2, [1, 2, 3, 4, 5]), (4, list(range(16))), (3, [-1, 2**31 - 1, 0, 5, 5, 5])):
                root = hashing.root_hash(seed, salt)
                hs = hashing.block_hashes(tokens, bs, algo, hash_seed=seed, cache_salt=salt)
                cases.append({"hash_algo": algo, "hash_seed": seed, "cache_salt": salt, "block_size": bs,
                              "tokens": tokens, "root": root.hex(), "hashes": [h.hex() for h in hs]})
    return {"format": FORMAT, "name": "hashing", "api": "hashing", "generator": GENERATOR,
            "description": "DESIGN §6 hash chain: root = sha256(b'kvcache/v1' + seed as 8 LE bytes + salt UTF-8); "
                           "h_i = H(h_{i-1} + block tokens as int32 LE). Digests in hex.",
            "cases": cases}


def build_all() -> dict[str, str]:
    """``{file name: canonical JSON text}`` of every vector, recorded from kvref."""
    backend = kvref.conformance_backend()
    out = {"hashing.json": dumps(hashing_vectors())}
    traces = [contiguous_trace(), paged_trace(), hybrid_trace(), manager_trace(), manager_replicas_trace(),
              random_trace("PAGED", 1), random_trace("PAGED", 2), random_trace("CONTIGUOUS", 3),
              fp8_paged_trace(), fp8_contiguous_trace(), spec_decode_trace()]
    for t in traces:
        t["records"] = run_trace(backend, t)
        del t["ops"]
        out[f"{t['name']}.json"] = dumps(t)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if any file would change")
    ap.add_argument("--out", type=Path, default=VECTOR_DIR, help="output directory (default spec/vectors)")
    args = ap.parse_args(argv)
    files = build_all()
    changed = []
    for name, text in sorted(files.items()):
        path = args.out / name
        old = path.read_bytes() if path.exists() else None
        if old != text.encode("utf-8"):
            changed.append(name)
            if not args.check:
                path.write_bytes(text.encode("utf-8"))
    stale = sorted(p.name for p in args.out.glob("*.json") if p.name not in files)
    if args.check:
        for name in changed + stale:
            print(f"{args.out / name}: out of date", file=sys.stderr)
        return 1 if changed or stale else 0
    for name in stale:
        (args.out / name).unlink()
    print(f"{len(files)} vector files in {args.out} ({len(changed)} rewritten, {len(stale)} removed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
