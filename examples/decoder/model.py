"""A small Llama-style decoder in NumPy whose attention reads and writes through kvcache.

The model is deliberately plain: token embedding, then per layer RMSNorm ->
grouped-query attention with rotary positions -> residual, RMSNorm -> SwiGLU
MLP -> residual, and a final RMSNorm and output projection (tied to the
embedding or not). Weights are random from a seed. Everything is float32.

The one place the model meets the KV cache is the ``attend`` callback of
:meth:`Decoder.forward`: the model computes this step's query, key and value
for every layer (rotary already applied) and hands them to the engine's
binding, which writes K/V into the cache and returns attention over the
cached history. Two bindings are here:

* :class:`SlotCacheAttention` for a ``KVCache`` (``ops.append_kv`` then
  ``ops.varlen_attention`` over the step's ``StepIndices``);
* :class:`PagedTableAttention` for a ``PagedKVCacheManager``: writes into the
  manager's ``kv_blocks`` and attends through its ``lookup_table`` and
  ``cache_lengths`` (a small paged attention in NumPy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import ml_dtypes
import numpy as np

__all__ = [
    "DecoderConfig", "DecoderWeights", "Decoder", "rope_tables", "apply_rope",
    "SlotCacheAttention", "PagedTableAttention", "layer_specs_for", "to_host",
]


def to_host(a) -> np.ndarray:
    """A NumPy copy of a host or device array (CuPy arrays on ``device="cuda"`` caches: ``.get()``)."""
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "get") and hasattr(a, "__cuda_array_interface__"):
        return a.get()
    return np.asarray(a)


def _device_module(device: str):
    """CuPy for a ``"cuda[:N]"`` device, else None (the model itself stays in NumPy)."""
    if str(device).startswith("cuda"):
        import cupy

        return cupy
    return None


@dataclass(frozen=True)
class DecoderConfig:
    """Geometry of the toy decoder.

    Parameters
    ----------
    vocab_size, hidden, q_heads, kv_heads, head_dim, intermediate, num_layers : int
        ``hidden == q_heads * head_dim``; ``q_heads`` a multiple of ``kv_heads`` (GQA).
    windows : tuple of (int or None)
        One entry per layer: ``None`` for full attention, ``w`` for a sliding
        window that counts the current token (position ``p`` sees keys
        ``[p - w + 1, p]``, kvcache's convention, which is also what ONNX
        Runtime's ``local_window_size=w`` attends).
    rope_theta, rms_eps : float
    tie_embeddings : bool
        Output projection = embedding matrix (transposed) when True.
    max_positions : int
        Length of the rotary tables.
    seed : int
        Seed of the random weights.
    """

    vocab_size: int = 256
    hidden: int = 64
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    num_layers: int = 3
    windows: tuple = (None, None, None)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = False
    max_positions: int = 256
    seed: int = 0

    def __post_init__(self):
        if self.hidden != self.q_heads * self.head_dim:
            raise ValueError(f"DecoderConfig: hidden={self.hidden} != q_heads*head_dim={self.q_heads * self.head_dim}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"DecoderConfig: q_heads={self.q_heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"DecoderConfig: head_dim={self.head_dim} must be even (rotary halves)")
        if len(self.windows) != self.num_layers:
            raise ValueError(f"DecoderConfig: len(windows)={len(self.windows)} != num_layers={self.num_layers}")
        for w in self.windows:
            if w is not None and (not isinstance(w, int) or w < 2):
                raise ValueError(f"DecoderConfig: window={w!r}, must be None or an int >= 2")


@dataclass
class DecoderWeights:
    """Random float32 weights (``x @ W`` convention: ``W`` is ``[in, out]``)."""

    embed: np.ndarray            # [vocab, hidden]
    attn_norm: list              # per layer [hidden]
    wq: list                     # per layer [hidden, q_heads*head_dim]
    wk: list                     # per layer [hidden, kv_heads*head_dim]
    wv: list                     # per layer [hidden, kv_heads*head_dim]
    wo: list                     # per layer [q_heads*head_dim, hidden]
    mlp_norm: list               # per layer [hidden]
    w_gate: list                 # per layer [hidden, intermediate]
    w_up: list                   # per layer [hidden, intermediate]
    w_down: list                 # per layer [intermediate, hidden]
    final_norm: np.ndarray       # [hidden]
    lm_head: np.ndarray          # [hidden, vocab]

    @classmethod
    def random(cls, cfg: DecoderConfig) -> "DecoderWeights":
        rng = np.random.default_rng(cfg.seed)

        def mat(n_in, n_out, gain=1.0):
            return (rng.standard_normal((n_in, n_out)) * gain / np.sqrt(n_in)).astype(np.float32)

        def norm():
            return (1.0 + 0.1 * rng.standard_normal(cfg.hidden)).astype(np.float32)

        L, H = cfg.num_layers, cfg.hidden
        embed = rng.standard_normal((cfg.vocab_size, H)).astype(np.float32)
        w = cls(
            embed=embed,
            attn_norm=[norm() for _ in range(L)],
            # a larger gain on q/k makes attention weights far from uniform, so a
            # wrong position or a stale key changes the output visibly
            wq=[mat(H, cfg.q_heads * cfg.head_dim, 2.0) for _ in range(L)],
            wk=[mat(H, cfg.kv_heads * cfg.head_dim, 2.0) for _ in range(L)],
            wv=[mat(H, cfg.kv_heads * cfg.head_dim) for _ in range(L)],
            wo=[mat(cfg.q_heads * cfg.head_dim, H) for _ in range(L)],
            mlp_norm=[norm() for _ in range(L)],
            w_gate=[mat(H, cfg.intermediate) for _ in range(L)],
            w_up=[mat(H, cfg.intermediate) for _ in range(L)],
            w_down=[mat(cfg.intermediate, H) for _ in range(L)],
            final_norm=norm(),
            lm_head=(embed.T.copy() if cfg.tie_embeddings else mat(H, cfg.vocab_size, 4.0)),
        )
        return w


def rope_tables(cfg: DecoderConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: float32 ``[max_positions, head_dim // 2]`` (ONNX Runtime's ``cos_cache``/``sin_cache``)."""
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim))
    ang = np.arange(cfg.max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rope(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotary embedding, half-split (Llama / ``rotary_interleaved=0``) layout.

    Parameters
    ----------
    x : float32 [T, heads, head_dim]
    positions : int [T]
    cos, sin : float32 [max_positions, head_dim // 2]

    Returns
    -------
    float32 [T, heads, head_dim]
    """
    half = x.shape[-1] // 2
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(np.float32)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis, float32."""
    var = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(var + np.float32(eps)) * weight).astype(np.float32)


# attend(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
AttendFn = Callable[[int, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


class Decoder:
    """The NumPy decoder. One :meth:`forward` per engine step.

    Parameters
    ----------
    config : DecoderConfig
    weights : DecoderWeights, optional
        Default: ``DecoderWeights.random(config)``.
    """

    def __init__(self, config: DecoderConfig, weights: Optional[DecoderWeights] = None):
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"Decoder: config={type(config).__name__}, must be a DecoderConfig")
        self.config = config
        self.weights = weights if weights is not None else DecoderWeights.random(config)
        self.cos, self.sin = rope_tables(config)

    def forward(self, tokens, positions, attend: AttendFn, logits_rows=None) -> np.ndarray:
        """Run the decoder over a step's tokens (all rows of a batch, concatenated).

        Parameters
        ----------
        tokens : int [T]
            Token ids of the step, rows concatenated in step order.
        positions : int [T]
            Absolute position of each token in its sequence (rotary angle).
        attend : callable
            ``attend(layer, q, k, v) -> out``: the engine's cache binding;
            writes this step's K/V and returns attention over each row's
            cached history, ``float32 [T, q_heads, head_dim]``.
        logits_rows : int [B], optional
            Token indices whose logits are wanted (``step.logits_indices``);
            default every token.

        Returns
        -------
        float32 [len(logits_rows), vocab_size]
        """
        cfg, w = self.config, self.weights
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        if tokens.ndim != 1 or positions.shape != tokens.shape:
            raise ValueError(f"Decoder.forward: tokens.shape={tokens.shape} and positions.shape={positions.shape} "
                             "must be equal and 1-D")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= cfg.vocab_size):
            bad = int(tokens[(tokens < 0) | (tokens >= cfg.vocab_size)][0])
            raise ValueError(f"Decoder.forward: token id {bad} out of range [0, vocab_size={cfg.vocab_size})")
        if positions.size and (positions.min() < 0 or positions.max() >= cfg.max_positions):
            bad = int(positions[(positions < 0) | (positions >= cfg.max_positions)][0])
            raise ValueError(f"Decoder.forward: position {bad} out of range [0, max_positions={cfg.max_positions})")
        T = tokens.size
        x = w.embed[tokens]
        for layer in range(cfg.num_layers):
            h = rms_norm(x, w.attn_norm[layer], cfg.rms_eps)
            q = (h @ w.wq[layer]).reshape(T, cfg.q_heads, cfg.head_dim)
            k = (h @ w.wk[layer]).reshape(T, cfg.kv_heads, cfg.head_dim)
            v = (h @ w.wv[layer]).reshape(T, cfg.kv_heads, cfg.head_dim)
            q = apply_rope(q, positions, self.cos, self.sin)
            k = apply_rope(k, positions, self.cos, self.sin)
            a = np.asarray(attend(layer, q, k, v), dtype=np.float32)
            x = x + a.reshape(T, cfg.hidden) @ w.wo[layer]
            h = rms_norm(x, w.mlp_norm[layer], cfg.rms_eps)
            g = h @ w.w_gate[layer]
            x = x + ((g / (1.0 + np.exp(-g))) * (h @ w.w_up[layer])) @ w.w_down[layer]
        if logits_rows is not None:
            x = x[np.asarray(logits_rows, dtype=np.int64)]
        return (rms_norm(x, w.final_norm, cfg.rms_eps) @ w.lm_head).astype(np.float32)


def layer_specs_for(kvpkg, cfg: DecoderConfig) -> list:
    """The ``KVLayerSpec`` list of a ``KVCache`` for this model (sliding layers as ``sliding_window``)."""
    return [kvpkg.KVLayerSpec.attention(cfg.kv_heads, cfg.head_dim) if w is None
            else kvpkg.KVLayerSpec.sliding_window(cfg.kv_heads, cfg.head_dim, w)
            for w in cfg.windows]


class SlotCacheAttention:
    """Binds a ``KVCache`` step: write with ``ops.append_kv``, read with ``ops.varlen_attention``.

    Parameters
    ----------
    ops : module
        ``kvref.ops`` or ``kvfast.ops``.
    cache : KVCache
    step : StepIndices
        From ``cache.prepare_step`` for this forward.
    """

    def __init__(self, ops, cache, step):
        self.ops, self.cache, self.step = ops, cache, step
        self.xp = _device_module(cache.config.device)   # on a GPU cache: copy q/k/v over, the output back

    def __call__(self, layer, q, k, v):
        if self.xp is not None:
            q, k, v = self.xp.asarray(q), self.xp.asarray(k), self.xp.asarray(v)
        self.ops.append_kv(self.cache, layer, k, v, self.step)        # scatter through slot_mapping
        out = self.ops.varlen_attention(q, self.cache, layer, self.step)  # causal, GQA, window-aware
        return to_host(out)


class PagedTableAttention:
    """Binds a manager's ``runtime_inputs``: a paged attention over the lookup table, in NumPy.

    Token ``j`` of row ``b`` sits at position ``p = cache_lengths[b] + j``; its
    K/V go to page ``lookup_table[b, p // page_size]``, offset ``p % page_size``
    of ``kv_blocks[page, 0 (K) / 1 (V), layer]``. It attends keys ``[0, p]``
    (or the layer's window ``[p - w + 1, p]``) read back through the same table.

    With several leaves (a full-attention leaf and a sliding-window leaf,
    ``runtime_inputs(...).inputs[0]`` is then a dict keyed by leaf id), each
    layer reads and writes the pages of its own leaf; a sliding leaf's table
    holds the null page 0 below the window, which is never read.

    Parameters
    ----------
    inputs : KVCacheInputsPerDevice or dict of str to KVCacheInputsPerDevice
        ``mgr.runtime_inputs([batch]).inputs[0]``.
    q_lens : int [B]
        Active tokens of each row this step (``ctx.active_length``).
    windows : sequence of (int or None)
        Per layer, the model's sliding window (None = full attention).
    layer_leaf : sequence of str, optional
        Per layer, its leaf id when ``inputs`` is a dict.
    """

    def __init__(self, inputs, q_lens: Sequence[int], windows: Sequence[Optional[int]],
                 layer_leaf: Optional[Sequence[str]] = None):
        if isinstance(inputs, dict):
            if layer_leaf is None or len(layer_leaf) != len(windows):
                raise ValueError(f"PagedTableAttention: layer_leaf={layer_leaf!r} must name a leaf for each of "
                                 f"{len(windows)} layers")
            self.per_layer = [inputs[leaf] for leaf in layer_leaf]
        else:
            self.per_layer = [inputs] * len(windows)
        first = self.per_layer[0]
        self.past = to_host(first.cache_lengths).astype(np.int64)      # uint32 [B] = processed_length
        self.q_lens = np.asarray(q_lens, dtype=np.int64)
        self.windows = list(windows)
        self.page = first.kv_blocks.shape[3]
        if self.past.size != self.q_lens.size:
            raise ValueError(f"PagedTableAttention: cache_lengths has {self.past.size} rows "
                             f"!= len(q_lens)={self.q_lens.size}")
        cu = np.concatenate([[0], np.cumsum(self.q_lens)])
        self.row_of = np.repeat(np.arange(self.q_lens.size), self.q_lens)
        self.positions = self.past[self.row_of] + (np.arange(cu[-1]) - cu[self.row_of])
        self.cu = cu

    def __call__(self, layer, q, k, v):
        inp = self.per_layer[layer]
        kv, ps = inp.kv_blocks, self.page                                 # [blocks, 2, layers, page, heads, dim]
        lut = to_host(inp.lookup_table).astype(np.int64)                 # [B, cols], 0 = null page
        pages = lut[self.row_of, self.positions // ps]
        if not isinstance(kv, np.ndarray):                               # a GPU buffer: write and read by copies
            return self._on_device(kv, layer, lut, pages, q, k, v)
        kv[pages, 0, layer, self.positions % ps] = k                     # write (cast to the storage dtype)
        kv[pages, 1, layer, self.positions % ps] = v
        return self._attend(lambda pg, off: kv[pg, :, layer, off].astype(np.float32), layer, lut, q)

    def _on_device(self, kv, layer, lut, pages, q, k, v):
        """The same through a device buffer: scatter with device index arrays, gather each row to the host.

        CuPy has no bfloat16: a bfloat16 manager's device pages are ``uint16`` words holding
        the bfloat16 bits, so values are converted on the way in (round to nearest even) and out.
        """
        import cupy

        bits = kv.dtype == np.uint16

        def put(x):
            x = np.asarray(x, dtype=np.float32)
            return cupy.asarray(x.astype(ml_dtypes.bfloat16).view(np.uint16) if bits else x)

        def get(pg, off):
            h = to_host(kv[cupy.asarray(pg), :, layer, cupy.asarray(off)])
            return (h.view(ml_dtypes.bfloat16) if bits else h).astype(np.float32)

        offsets = cupy.asarray(self.positions % self.page)
        kv[cupy.asarray(pages), 0, layer, offsets] = put(k)
        kv[cupy.asarray(pages), 1, layer, offsets] = put(v)
        return self._attend(get, layer, lut, q)

    def _attend(self, rows_of, layer, lut, q):
        """Attention of every row; ``rows_of(pages, offsets) -> float32 [n, 2, Hkv, D]`` reads K/V slots."""
        ps = self.page
        out = np.zeros(q.shape, np.float32)
        window = self.windows[layer]
        for b in range(self.q_lens.size):
            lo, hi = int(self.cu[b]), int(self.cu[b + 1])
            n = int(self.past[b] + self.q_lens[b])                       # keys [start, n)
            start = 0 if window is None else max(0, int(self.past[b]) - window + 1)
            pos = np.arange(start, n)
            kvb = rows_of(lut[b, pos // ps], pos % ps)                  # [n - start, 2, Hkv, D]
            kb, vb = kvb[:, 0], kvb[:, 1]
            qpos = self.positions[lo:hi][:, None]
            mask = pos[None, :] <= qpos
            if window is not None:
                mask &= pos[None, :] > qpos - window
            group = q.shape[1] // kb.shape[1]
            kb, vb = np.repeat(kb, group, axis=1), np.repeat(vb, group, axis=1)
            s = np.einsum("qhd,khd->hqk", q[lo:hi], kb) / np.float32(np.sqrt(q.shape[2]))
            s = np.where(mask[None], s, -np.inf)
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            out[lo:hi] = np.einsum("hqk,khd->qhd", p, vb)
        return out
