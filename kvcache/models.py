"""Model presets for ``kvcache replay --model NAME``: published K/V geometry of public architectures.

Each preset gives the layers that keep a K/V cache, their K/V heads and head
size, the K/V dtype the model ships in, sliding windows and recurrent state
sizes, taken from the model's published configuration (``config.json`` on the
Hugging Face hub, the fields named in :data:`MODELS`' notes). The replay maps a
preset onto the manager's leaves (``KVCacheParams(leaves=...)``):

* dense full-attention models: one ``"full"`` leaf with every layer;
* sliding + full (Gemma-3): a ``"full"`` leaf and a ``"swa"`` sliding-window
  leaf. The manager gives every full/sliding leaf the same page geometry and
  the same block count (``spec/manager.md`` §1), so the layers are split
  evenly over the two leaves: bytes per page pair equal the model's bytes per
  page of tokens, but the window pool is as large as the global one (a real
  engine sizes it smaller);
* MLA (DeepSeek-V3): one latent vector of ``kv_lora_rank + qk_rope_head_dim``
  = 576 values per token and layer, shared by every head. It maps exactly onto
  ``kv_heads=1, head_dim=288``: the K and V planes of a page together hold the
  576 values (one page stores ``2 * 288`` values per token and layer);
* hybrid with recurrent layers (Jamba, Qwen3-Next): the attention layers form
  the ``"full"`` leaf; every recurrent layer's state forms one ``"state"``
  recurrent leaf page per checkpoint: for Jamba's Mamba layers the SSM state
  (``d_inner x d_state``) and conv state (``d_inner x d_conv``), i.e.
  ``[mamba_layers, d_inner, d_state + d_conv]`` float32; for Qwen3-Next's
  Gated DeltaNet layers the delta-rule state (value heads x key dim x value
  dim) and the conv state, ``[36, 32, 128, 128 + 6]`` bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvspec import KVCacheParams, LeafSpec

__all__ = ["ModelPreset", "MODELS", "get_model", "model_table"]


@dataclass(frozen=True)
class ModelPreset:
    """K/V geometry of one public model.

    Attributes
    ----------
    name : str
        The ``--model`` name (lower case).
    model_id : str
        The hub id; the replay's ``KVCacheParams(model_id=...)``.
    kv_layers : int
        Layers whose K/V pages the cache holds (attention layers; all of them
        for a dense model).
    kv_heads, head_dim : int
        K/V heads and head size of those layers.
    dtype : str
        K/V dtype the model is published in.
    sliding_layers : int
        Of ``kv_layers``, how many use a sliding window.
    window : int
        The sliding window in tokens (0: none).
    state_shape : tuple of int
        Recurrent state of the non-attention layers, one checkpoint (``()``: none).
    state_dtype : str
        dtype of that state (what the serving engines keep it in).
    note : str
        Where the numbers come from and how the architecture maps.
    """

    name: str
    model_id: str
    kv_layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    sliding_layers: int = 0
    window: int = 0
    state_shape: tuple[int, ...] = ()
    state_dtype: str = "float32"
    note: str = ""

    @property
    def kind(self) -> str:
        """``"dense"``, ``"sliding+full"``, ``"mla"`` or ``"hybrid"``."""
        if self.state_shape:
            return "hybrid"
        if self.sliding_layers:
            return "sliding+full"
        if "MLA" in self.note:
            return "mla"
        return "dense"

    def leaves(self) -> dict[str, LeafSpec] | None:
        """The manager's leaves (``None``: the one default ``"full"`` leaf)."""
        out: dict[str, LeafSpec] = {"full": LeafSpec.full()}
        if self.sliding_layers:
            out["swa"] = LeafSpec.sliding_window(self.window)
        if self.state_shape:
            out["state"] = LeafSpec.recurrent(self.state_shape, self.state_dtype)
        return None if len(out) == 1 else out

    def layers_per_leaf(self) -> int:
        """``num_layers`` of each full/sliding leaf (layers split evenly over them, rounded up)."""
        n_leaves = 2 if self.sliding_layers else 1
        return -(-self.kv_layers // n_leaves)

    def params(self, page_size: int, dtype: str | None = None, **kw) -> KVCacheParams:
        """``KVCacheParams`` of this model at ``page_size`` (``dtype`` overrides the preset's)."""
        return KVCacheParams(page_size, self.layers_per_leaf(), self.kv_heads, self.head_dim,
                             dtype or self.dtype, leaves=self.leaves(), model_id=self.model_id, **kw)

    def kv_bytes_per_token(self, dtype: str | None = None) -> int:
        """K/V bytes one token costs over every attention layer (the model's published figure)."""
        itemsize = KVCacheParams(1, 1, 1, 1, dtype or self.dtype).np_dtype.itemsize
        return 2 * self.kv_layers * self.kv_heads * self.head_dim * itemsize


_M = ModelPreset
#: The built-in presets, by ``--model`` name.
MODELS: dict[str, ModelPreset] = {m.name: m for m in (
    _M("llama-3.1-8b", "meta-llama/Llama-3.1-8B", 32, 8, 128,
       note="num_hidden_layers 32, num_key_value_heads 8, head_dim 128 (GQA)"),
    _M("llama-3.1-70b", "meta-llama/Llama-3.1-70B", 80, 8, 128,
       note="num_hidden_layers 80, num_key_value_heads 8, head_dim 128 (GQA)"),
    _M("qwen3-8b", "Qwen/Qwen3-8B", 36, 8, 128,
       note="num_hidden_layers 36, num_key_value_heads 8, head_dim 128"),
    _M("qwen3-32b", "Qwen/Qwen3-32B", 64, 8, 128,
       note="num_hidden_layers 64, num_key_value_heads 8, head_dim 128"),
    _M("mistral-7b-v0.3", "mistralai/Mistral-7B-Instruct-v0.3", 32, 8, 128,
       note="num_hidden_layers 32, num_key_value_heads 8, head_dim 128, no sliding window"),
    _M("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", 32, 8, 128,
       note="num_hidden_layers 32, num_key_value_heads 8, head_dim 128 (experts do not change the K/V)"),
    _M("gemma-3-12b", "google/gemma-3-12b-it", 48, 8, 256, sliding_layers=40, window=1024,
       note="48 layers, 5 local (sliding_window 1024) per global; num_key_value_heads 8, head_dim 256"),
    _M("gemma-3-27b", "google/gemma-3-27b-it", 62, 16, 128, sliding_layers=52, window=1024,
       note="62 layers, 5 local (sliding_window 1024) per global; num_key_value_heads 16, head_dim 128"),
    _M("deepseek-v3", "deepseek-ai/DeepSeek-V3", 61, 1, 288,
       note="MLA: 61 layers cache kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values per token, "
            "mapped to kv_heads 1 x head_dim 288 in the K and V planes"),
    _M("jamba-v0.1", "ai21labs/Jamba-v0.1", 4, 8, 128, state_shape=(28, 8192, 20),
       note="32 layers, attention every 8th (4 layers, num_key_value_heads 8, head_dim 128); "
            "28 Mamba layers: d_inner 8192 (expand 2 x 4096), d_state 16 + d_conv 4, float32"),
    _M("qwen3-next-80b-a3b", "Qwen/Qwen3-Next-80B-A3B-Instruct", 12, 2, 256, state_shape=(36, 32, 128, 134),
       state_dtype="bfloat16",
       note="48 layers, full_attention_interval 4: 12 gated-attention layers (num_key_value_heads 2, head_dim 256); "
            "36 Gated DeltaNet layers, each 32 value heads (linear_num_value_heads) x 128 x 128 "
            "(linear_key_head_dim x linear_value_head_dim) of state plus a conv state of "
            "2 x 16 x 128 + 32 x 128 = 8192 channels x (linear_conv_kernel_dim 4 - 1) = 32 x 128 x 6: "
            "32 x 128 x (128 + 6) per layer, bfloat16"),
)}


def get_model(name: str) -> ModelPreset:
    """The preset called ``name`` (case-insensitive).

    Raises
    ------
    ValueError
        No such preset; the message lists the known names.
    """
    if not isinstance(name, str) or name.lower() not in MODELS:
        raise ValueError(f"model={name!r} is not a preset; known: {', '.join(MODELS)} (kvcache replay --list-models)")
    return MODELS[name.lower()]


def model_table() -> str:
    """The ``--list-models`` table: name, kind, geometry, K/V bytes per token, hub id."""
    rows = [("name", "kind", "kv layers", "kv heads x dim", "window", "state", "dtype", "KiB/token", "model id")]
    for m in MODELS.values():
        rows.append((m.name, m.kind, str(m.kv_layers), f"{m.kv_heads} x {m.head_dim}",
                     f"{m.window} ({m.sliding_layers} layers)" if m.window else "-",
                     "x".join(map(str, m.state_shape)) + f" {m.state_dtype}" if m.state_shape else "-", m.dtype,
                     f"{m.kv_bytes_per_token() / 1024:g}", m.model_id))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
