"""The float64 oracle of the attention tests: causal GQA attention over one row's whole history."""

from __future__ import annotations

import numpy as np


def dense_attention(q, k, v, past: int, window: int | None = None, scale: float | None = None,
                    softcap: float | None = None, sinks=None):
    """float64 causal GQA attention of ``q`` ``[t, q_heads, d]`` (positions ``past..``) over a row's
    ``k`` / ``v`` ``[n, kv_heads, d]``, optionally within a sliding ``window``; ``scale`` defaults to
    ``1 / sqrt(d)``. ``softcap`` caps each scaled score to ``softcap * tanh(s / softcap)``; ``sinks``
    ``[q_heads]`` adds one value-less logit per head to every denominator (spec/slot-cache.md §7.3).
    Returns the output ``[t, q_heads, d]`` and the visibility mask ``[t, n]``."""
    n, t = k.shape[0], q.shape[0]
    scale = 1 / np.sqrt(k.shape[-1]) if scale is None else scale
    g = q.shape[1] // k.shape[1]
    kf = np.repeat(k.astype(np.float64), g, axis=1)
    vf = np.repeat(v.astype(np.float64), g, axis=1)
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), kf) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    qp = past + np.arange(t)[:, None]
    kp = np.arange(n)[None, :]
    mask = kp <= qp
    if window:
        mask &= kp > qp - window
    s = np.where(mask[None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    if sinks is not None:
        sink = np.asarray(sinks, np.float64)[:, None, None]
        m = np.maximum(m, sink)
    w = np.exp(s - m)
    total = w.sum(-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sink - m)
    return np.einsum("hqk,khd->qhd", w / total, vf), mask
