"""Bugs in the bytes ``append_kv``/``gather_kv`` move (issue 20, "K/V bytes").

Each factory is kvref with one op replaced; the suite must fail on every one:

* ``v_written_as_k``: V storage receives K.
* ``gather_drops_single_token``: a 1-token paged slot gathers as empty.
* ``unchecked_first_token``: a ``slot_mapping`` past the storage is refused
  for every token but token 0, which is dropped silently.
* ``pool_end_accepted``: ``slot_mapping == rows`` (exactly the pool's end) is
  not refused; the token is written into the last row instead.
* ``v_stride_ignored``: a strided V is read as if it were contiguous (the
  first rows of its underlying buffer).
* ``dtype_bits_reinterpreted``: K/V of another dtype with the storage's item
  size are stored by bit pattern, not cast.
* ``large_step_drops_last_token``: a step of 128 tokens or more loses its
  last token (the shape of a bug in a parallel scatter path).
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np

from kvref import ops as _ops

from ._common import backend_like_kvref


def _with_ops(name: str, **fns):
    ops = types.SimpleNamespace(append_kv=_ops.append_kv, gather_kv=_ops.gather_kv,
                                varlen_attention=_ops.varlen_attention)
    for k, v in fns.items():
        setattr(ops, k, v)
    return backend_like_kvref(name, ops=ops)


def _rows(cache, layer):
    K = cache.keys(layer)
    return K.shape[0] * K.shape[1]


def v_written_as_k():
    def append_kv(cache, layer, k, v, step):
        return _ops.append_kv(cache, layer, k, k, step)

    return _with_ops("broken-v-written-as-k", append_kv=append_kv)


def gather_drops_single_token():
    def gather_kv(cache, layer, slot):
        k, v = _ops.gather_kv(cache, layer, slot)
        if k.shape[0] == 1 and cache.paged_block_table() is not None:
            return k[:0], v[:0]
        return k, v

    return _with_ops("broken-gather-drops-single-token", gather_kv=gather_kv)


def unchecked_first_token():
    def append_kv(cache, layer, k, v, step):
        sm = np.array(step.slot_mapping, dtype=np.int64)
        if sm.size and sm[0] >= _rows(cache, layer):
            sm[0] = -1  # dropped instead of refused
            step = dataclasses.replace(step, slot_mapping=sm)
        return _ops.append_kv(cache, layer, k, v, step)

    return _with_ops("broken-unchecked-first-token", append_kv=append_kv)


def pool_end_accepted():
    def append_kv(cache, layer, k, v, step):
        sm = np.array(step.slot_mapping, dtype=np.int64)
        rows = _rows(cache, layer)
        if (sm == rows).any():  # off by one: `> rows` refused, `== rows` clamped into the last row
            sm[sm == rows] = rows - 1
            step = dataclasses.replace(step, slot_mapping=sm)
        return _ops.append_kv(cache, layer, k, v, step)

    return _with_ops("broken-pool-end-accepted", append_kv=append_kv)


def v_stride_ignored():
    def append_kv(cache, layer, k, v, step):
        v = np.asarray(v)
        if not v.flags.c_contiguous and v.base is not None and np.asarray(v.base).size >= v.size:
            v = np.asarray(v.base).reshape(-1)[: v.size].reshape(v.shape)  # the stride is lost
        return _ops.append_kv(cache, layer, k, v, step)

    return _with_ops("broken-v-stride-ignored", append_kv=append_kv)


def dtype_bits_reinterpreted():
    def append_kv(cache, layer, k, v, step):
        dt = cache.keys(layer).dtype
        k, v = np.asarray(k), np.asarray(v)
        if k.dtype != dt and k.dtype.itemsize == dt.itemsize:
            k, v = np.ascontiguousarray(k).view(dt), np.ascontiguousarray(v).view(dt)
        return _ops.append_kv(cache, layer, k, v, step)

    return _with_ops("broken-dtype-bits-reinterpreted", append_kv=append_kv)


def large_step_drops_last_token():
    def append_kv(cache, layer, k, v, step):
        sm = np.array(step.slot_mapping, dtype=np.int64)
        if sm.shape[0] >= 128:
            sm[-1] = -1
            step = dataclasses.replace(step, slot_mapping=sm)
        return _ops.append_kv(cache, layer, k, v, step)

    return _with_ops("broken-large-step-drops-last-token", append_kv=append_kv)
