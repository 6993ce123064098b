"""``SlotKVCache``'s one-token forwards of slot 0 run on a block chunk: one ``prepare_step`` of the
tokens left in the current block, then each forward writes the next of its rows and commits it with
``update_position`` (``spec/slot-cache.md`` §2.8, "a step's rows stay its rows").

The oracle is the slot cache itself: after every forward, ``ops.gather_kv`` (which reads through the
block table) must return exactly the K/V fed so far, for every layer. Every path that changes a slot
between forwards (``reset``, ``release``/``admit``, ``crop``, a packed step of other slots, a slot
emptied behind the integration's back on ``cache.kv``) must leave no stale chunk behind.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import LlamaConfig  # noqa: E402

from kvcache.integrations.transformers import SlotKVCache  # noqa: E402
from kvspec import CapacityError  # noqa: E402

LAYERS, HEADS, DIM = 2, 2, 8


def _config(max_positions: int = 64):
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                       num_attention_heads=4, num_key_value_heads=HEADS, head_dim=DIM,
                       max_position_embeddings=max_positions)


class _Feeder:
    """Feeds random K/V through ``update`` and keeps what slot 0 must hold, per layer."""

    def __init__(self, cache: SlotKVCache, seed: int = 0):
        self.cache, self.gen = cache, torch.Generator().manual_seed(seed)
        self.k = [torch.zeros(0, HEADS, DIM) for _ in range(LAYERS)]
        self.v = [torch.zeros(0, HEADS, DIM) for _ in range(LAYERS)]

    def forward(self, S: int) -> None:
        for layer in range(LAYERS):
            k, v = (torch.randn(1, HEADS, S, DIM, generator=self.gen) for _ in range(2))
            keys, values = self.cache.update(k, v, layer)
            self.k[layer] = torch.cat([self.k[layer], k[0].transpose(0, 1)])
            self.v[layer] = torch.cat([self.v[layer], v[0].transpose(0, 1)])
            # what the model's attention reads: the whole history of the row, this forward's last
            assert torch.equal(keys[0].transpose(0, 1), self.k[layer])
            assert torch.equal(values[0].transpose(0, 1), self.v[layer])
        self.check()

    def crop(self, n: int) -> None:
        self.cache.crop(-n)
        self.k = [k[:-n] for k in self.k]
        self.v = [v[:-n] for v in self.v]
        self.check()

    def restart(self) -> None:
        self.k = [k[:0] for k in self.k]
        self.v = [v[:0] for v in self.v]

    def check(self) -> None:
        """The slot cache's own read of slot 0 (through its block table) is what was fed."""
        cache = self.cache
        ops = cache._pkg.ops
        for layer in range(LAYERS):
            K, V = ops.gather_kv(cache.kv, layer, 0)
            assert np.array_equal(np.asarray(K), self.k[layer].numpy()), f"layer {layer} K"
            assert np.array_equal(np.asarray(V), self.v[layer].numpy()), f"layer {layer} V"
        cache.kv.check_invariants()


def _count_prepares(cache: SlotKVCache) -> list:
    """A spy on the real slot cache's ``prepare_step`` (the calls go through)."""
    calls = []
    real = cache.kv.prepare_step

    def prepare_step(cu, past, slots):
        calls.append((list(np.asarray(cu)), list(np.asarray(past))))
        return real(cu, past, slots)

    cache.kv.prepare_step = prepare_step
    return calls


@pytest.mark.parametrize("mode", ["paged", "contiguous"])
@pytest.mark.parametrize("backend", ["kvfast", "kvref"])
def test_decode_prepares_once_per_block_and_stores_every_token(backend, mode):
    cache = SlotKVCache(_config(), backend=backend, mode=mode, block_size=4, max_batch_size=1,
                        dtype=torch.float32)
    calls = _count_prepares(cache)
    f = _Feeder(cache)
    f.forward(3)                           # prefill: positions 0..2
    for _ in range(13):                    # decode positions 3..15: the block of 3, then blocks 4.., 8.., 12..
        f.forward(1)
    assert cache.get_seq_length() == 16
    # one prefill step, then one chunk per block: [3, 4), [4, 8), [8, 12), [12, 16)
    assert calls == [([0, 3], [0]), ([0, 1], [3]), ([0, 4], [4]), ([0, 4], [8]), ([0, 4], [12])]


@pytest.mark.parametrize("mode", ["paged", "contiguous"])
def test_max_seq_len_not_a_block_multiple_clips_the_last_chunk(mode):
    cache = SlotKVCache(_config(), mode=mode, block_size=4, max_seq_len=10, max_batch_size=1,
                        dtype=torch.float32)
    calls = _count_prepares(cache)
    f = _Feeder(cache)
    f.forward(1)
    for _ in range(9):
        f.forward(1)
    assert calls[-1] == ([0, 2], [8])      # positions 8, 9: the chunk stops at max_seq_len
    before = [np.asarray(cache.kv.keys(layer)).copy() for layer in range(LAYERS)]
    with pytest.raises(CapacityError, match="max_seq_len=10"):
        f.forward(1)
    for layer in range(LAYERS):
        assert np.array_equal(np.asarray(cache.kv.keys(layer)), before[layer])
    assert cache.get_seq_length() == 10


@pytest.mark.parametrize("mode", ["paged", "contiguous"])
def test_reset_release_admit_and_crop_drop_the_chunk(mode):
    cache = SlotKVCache(_config(), mode=mode, block_size=4, max_batch_size=2, dtype=torch.float32)
    f = _Feeder(cache, seed=1)
    f.forward(1)                           # a one-token prompt: the chunk of positions [0, 4)
    f.forward(1)
    cache.reset()                          # the blocks go back to the pool; position 0 again
    f.restart()
    f.forward(1)
    f.forward(1)
    f.forward(1)
    f.crop(2)                              # back to position 1, inside the same block
    f.forward(1)
    f.forward(1)
    cache.release(0)
    f.restart()
    if mode == "paged":
        assert cache.admit(0, [1, 2, 3]) == 0
    f.forward(1)
    for _ in range(6):
        f.forward(1)


def test_other_slots_taking_blocks_between_forwards_never_see_slot_0s_rows():
    """Slot 1 grows (its own steps on ``cache.kv``, K/V through ``ops.append_kv``) between slot 0's
    one-token forwards: slot 0's chunk rows stay its own, and slot 1 keeps exactly what it was given."""
    cache = SlotKVCache(_config(), block_size=4, max_batch_size=2, dtype=torch.float32)
    ops = cache._pkg.ops
    f = _Feeder(cache, seed=2)
    f.forward(2)
    rng = np.random.default_rng(9)
    mine = [[], []]
    for n in range(12):
        f.forward(1)                       # slot 0: chunks of [2, 4), [4, 8), [8, 12), [12, 14)
        step = cache.kv.prepare_step(np.array([0, 1]), np.array([n]), np.array([1]))
        for layer in range(LAYERS):
            k, v = (rng.standard_normal((1, HEADS, DIM)).astype(np.float32) for _ in range(2))
            ops.append_kv(cache.kv, layer, k, v, step)
            mine[layer].append(k)
        cache.kv.update_position(1, n + 1)
        for layer in range(LAYERS):
            K, _ = ops.gather_kv(cache.kv, layer, 1)
            assert np.array_equal(np.asarray(K), np.concatenate(mine[layer]))


def test_a_slot_emptied_on_cache_kv_is_refused_and_nothing_is_written():
    """``cache.kv.evict_batch(0)`` behind the integration's back: the next one-token forward reads
    slot 0's length back, finds it changed, and the general path refuses the step before any write."""
    cache = SlotKVCache(_config(), block_size=4, max_batch_size=2, dtype=torch.float32)
    f = _Feeder(cache, seed=3)
    f.forward(2)
    f.forward(1)                           # the chunk of positions [2, 4)
    cache.kv.evict_batch(0)
    cache.kv.prepare_step(np.array([0, 4]), np.array([0]), np.array([1]))   # slot 1 takes the freed block
    before = [np.asarray(cache.kv.keys(layer)).copy() for layer in range(LAYERS)]
    with pytest.raises(ValueError, match="past_len"):
        cache.update(torch.ones(1, HEADS, 1, DIM), torch.ones(1, HEADS, 1, DIM), 0)
    for layer in range(LAYERS):
        assert np.array_equal(np.asarray(cache.kv.keys(layer)), before[layer])


def test_a_full_pool_refuses_the_next_block_and_changes_nothing():
    # 2 usable blocks of 4 tokens: positions 0..7; the chunk at position 8 needs a third block
    cache = SlotKVCache(_config(), block_size=4, num_blocks=3, max_batch_size=1, dtype=torch.float32)
    f = _Feeder(cache, seed=4)
    f.forward(5)
    f.forward(1)
    f.forward(1)
    f.forward(1)
    before = [np.asarray(cache.kv.keys(layer)).copy() for layer in range(LAYERS)]
    with pytest.raises(CapacityError, match="blocks"):
        cache.update(torch.ones(1, HEADS, 1, DIM), torch.ones(1, HEADS, 1, DIM), 0)
    for layer in range(LAYERS):
        assert np.array_equal(np.asarray(cache.kv.keys(layer)), before[layer])
    assert cache.get_seq_length() == 8
    f.check()
    f.crop(3)                              # room again inside the second block
    f.forward(1)
    f.forward(1)
