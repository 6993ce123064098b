"""kvspec configuration types: validation names the field (spec/types.md §1)."""

import pytest

from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec, LayerKind

P = KVCacheMode.PAGED


def test_defaults_and_auto_pool_size():
    c = KVCacheConfig(2, 4, 100, P, block_size=16)
    assert c.max_blocks_per_seq == 7
    assert c.resolved_num_blocks == 4 * 7 + 1
    assert c.resolved_num_state_checkpoints == 4
    assert KVCacheConfig(2, 4, 100, P, num_blocks=9).resolved_num_blocks == 9


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(num_layers=0), ValueError, "KVCacheConfig: num_layers=0, must be >= 1"),
        (dict(max_seqs=-1), ValueError, "max_seqs=-1"),
        (dict(max_seq_len=0), ValueError, "max_seq_len=0"),
        (dict(mode="paged"), ValueError, "mode='paged'"),
        (dict(block_size=0), ValueError, "block_size=0"),
        (dict(num_blocks=1), ValueError, "num_blocks=1"),
        (dict(num_blocks=-3), ValueError, "num_blocks=-3"),
        (dict(dtype="int8"), ValueError, "dtype='int8'"),
        (dict(state_dtype="float64"), ValueError, "state_dtype='float64'"),
        (dict(device="tpu"), ValueError, "device='tpu'"),
        (dict(device="cpu:1"), ValueError, "device='cpu:1'"),
        (dict(enable_prefix_caching=1), ValueError, "enable_prefix_caching=1"),
        (dict(hash_algo="md5"), ValueError, "hash_algo='md5'"),
        (dict(hash_seed=-1), ValueError, "hash_seed=-1"),
        (dict(num_state_checkpoints=-1), ValueError, "num_state_checkpoints=-1"),
        (dict(max_seqs=2.0), TypeError, "max_seqs=2.0"),
        (dict(block_size=True), TypeError, "block_size=True"),
    ],
)
def test_config_errors_name_the_field(kwargs, exc, match):
    base = dict(num_layers=1, max_seqs=2, max_seq_len=8, mode=P)
    base.update(kwargs)
    with pytest.raises(exc, match=match):
        KVCacheConfig(**base)


def test_device_forms():
    for d in ("cpu", "cuda", "cuda:3"):
        assert KVCacheConfig(1, 1, 1, KVCacheMode.CONTIGUOUS, device=d).device == d


def test_layer_spec_constructors():
    a = KVLayerSpec.attention(2, 8)
    assert (a.kind, a.kv_heads, a.head_dim, a.is_attention) == (LayerKind.ATTENTION, 2, 8, True)
    s = KVLayerSpec.sliding_window(2, 8, 4)
    assert s.kind is LayerKind.SLIDING_WINDOW and s.window == 4 and s.is_attention
    x = KVLayerSpec.cross_attention(2, 8, 5)
    assert x.kind is LayerKind.CROSS_ATTENTION and x.max_enc_len == 5 and not x.is_attention
    st = KVLayerSpec.state((3, 4), 4, recurrent=(2, 3, 5))
    assert st.conv_dims == (3, 4) and st.conv_width == 4 and st.recurrent == (2, 3, 5)
    assert KVLayerSpec.state((), 0, recurrent=(1, 2, 2)).conv_dims == ()


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: KVLayerSpec.attention(0, 8), ValueError, "kv_heads=0"),
        (lambda: KVLayerSpec.attention(1, "8"), TypeError, "head_dim='8'"),
        (lambda: KVLayerSpec.sliding_window(1, 8, 0), ValueError, "window=0"),
        (lambda: KVLayerSpec.cross_attention(1, 8, 0), ValueError, "max_enc_len=0"),
        (lambda: KVLayerSpec.state(3, 4), TypeError, "conv_dims=3"),
        (lambda: KVLayerSpec.state((3, 0), 4), ValueError, r"conv_dims\[1\]=0"),
        (lambda: KVLayerSpec.state((3,), 0), ValueError, "conv_width=0"),
        (lambda: KVLayerSpec.state((3,), 2, recurrent=(1, 2)), ValueError, "recurrent="),
        (lambda: KVLayerSpec.state((), 0), ValueError, "must store something"),
    ],
)
def test_layer_spec_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
