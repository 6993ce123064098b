"""``SlotKVCache.update`` on one-token steps (batch 1, one new token): the K/V row is copied into its
storage row by address, and the history comes back as ``torch.as_strided`` views of the storage.

Checked against the torch path that inputs needing grad take (``index_copy_``, ``index_select``):
same bytes stored, same history returned, for every K/V dtype and both modes, and with inputs that
are not dense (a strided view: the NumPy path instead of the copy by address).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import Qwen2Config  # noqa: E402

from kvcache.integrations.transformers import SlotKVCache  # noqa: E402


def _config():
    """One full layer and two sliding layers (window 6), 2 K/V heads of 16."""
    return Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       use_sliding_window=True, sliding_window=6, max_window_layers=1)


def _rows(gen, S, dtype, dense):
    """A ``[1, 2, S, 16]`` K (or V) of ``dtype``: dense, or a strided view of a wider tensor."""
    if dense:
        return torch.randn(1, 2, S, 16, generator=gen).to(dtype)
    return torch.randn(1, 2, S, 32, generator=gen).to(dtype)[..., ::2]


@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["paged", "contiguous"])
@pytest.mark.parametrize("backend", ["kvfast", "kvref"])
def test_one_token_steps_store_and_return_what_the_torch_path_does(backend, mode, dtype, dense):
    config = _config()
    gen = torch.Generator().manual_seed(5)
    fast, slow = (SlotKVCache(config, backend=backend, mode=mode, block_size=4, max_batch_size=1, dtype=dtype)
                  for _ in range(2))
    for S in (5, 1, 1, 1, 1, 2, 1, 1, 1, 1):           # a prefill, decodes across blocks, a chunk, decodes
        for layer in range(3):
            k, v = _rows(gen, S, dtype, dense), _rows(gen, S, dtype, dense)
            got = fast.update(k, v, layer)
            want = slow.update(k.clone().requires_grad_(), v.clone().requires_grad_(), layer)
            for a, b in zip(got, want):
                assert a.dtype == dtype and a.shape == b.shape and torch.equal(a, b.detach())
            assert torch.equal(got[0][:, :, -S:], k) and torch.equal(got[1][:, :, -S:], v)
    for layer in range(3):
        for a, b in ((fast.kv.keys(layer), slow.kv.keys(layer)), (fast.kv.values(layer), slow.kv.values(layer))):
            assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    assert fast.seq_lens().tolist() == slow.seq_lens().tolist() == [15]


def test_a_one_token_step_that_raises_leaves_the_cache_as_it_was():
    config = _config()
    cache = SlotKVCache(config, mode="contiguous", max_batch_size=1, dtype=torch.float32)
    for layer in range(3):
        cache.update(torch.ones(1, 2, 3, 16), torch.ones(1, 2, 3, 16), layer)
    before = [np.asarray(cache.kv.keys(layer)).copy() for layer in range(3)]
    with pytest.raises(TypeError, match="dtype"):
        cache.update(torch.ones(1, 2, 1, 16, dtype=torch.float16), torch.ones(1, 2, 1, 16), 0)
    with pytest.raises(ValueError, match="key_states.shape"):
        cache.update(torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8), 0)
    assert cache.get_seq_length() == 3
    for layer in range(3):
        assert np.array_equal(np.asarray(cache.kv.keys(layer)), before[layer])
