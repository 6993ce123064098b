"""Bugs in the attention options of spec/slot-cache.md §7.3 (``softcap``, ``sinks``).

Each factory is kvref with one op replaced; the suite must fail on every one:

* ``sinks_dropped``: ``varlen_attention`` takes ``sinks`` and ignores them (a plain softmax).
* ``softcap_before_scale``: ``paged_attention`` caps the raw ``q . k`` and scales after, so the
  cap applies at ``softcap * scale`` (the order bug of a kernel that folds the scale in late).
"""

from __future__ import annotations

import math
import types

from kvref import ops as _ops

from ._common import backend_like_kvref


def _with_ops(name: str, **fns):
    ops = types.SimpleNamespace(**{k: getattr(_ops, k) for k in dir(_ops) if not k.startswith("_")})
    for k, v in fns.items():
        setattr(ops, k, v)
    return backend_like_kvref(name, ops=ops)


def sinks_dropped():
    def varlen_attention(q, cache, layer, step, scale=None, *, layout="thd", out_dtype=None, softcap=None,
                         sinks=None):
        return _ops.varlen_attention(q, cache, layer, step, scale, layout=layout, out_dtype=out_dtype,
                                     softcap=softcap)

    return _with_ops("broken-sinks-dropped", varlen_attention=varlen_attention)


def softcap_before_scale():
    def paged_attention(q, kv_blocks, layer, inputs, input_row_offsets, *, window=None, scale=None, layout="thd",
                        out_dtype=None, kv_dtype=None, softcap=None, sinks=None):
        if softcap is not None and isinstance(softcap, float) and softcap > 0:
            softcap = softcap * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
        return _ops.paged_attention(q, kv_blocks, layer, inputs, input_row_offsets, window=window, scale=scale,
                                    layout=layout, out_dtype=out_dtype, kv_dtype=kv_dtype, softcap=softcap,
                                    sinks=sinks)

    return _with_ops("broken-softcap-before-scale", paged_attention=paged_attention)
