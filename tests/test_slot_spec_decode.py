"""Speculative decoding through the slot cache (``spec/slot-cache.md`` §11).

The accept/reject cycle: ``prepare_step`` (or ``reserve``) for ``k + 1``
tokens, ``append_kv``, ``update_position`` to the accepted length; STATE
layers checkpoint before the speculative step (``checkpoint_state``) and
roll back with ``restore_state``, then re-feed the accepted tokens. A
speculative run ends in exactly the state of the plain run that fed only the
accepted tokens (K/V, state slabs, lengths, block tables, published blocks,
prefix hits), in kvref, kvfast and kvfast on the emulated CUDA device.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvfast
import kvref
from kvspec import CapacityError, KVCacheConfig, KVCacheMode, KVLayerSpec

PKGS = [kvref, kvfast]
H, D, W = 2, 4, 3


def host(x) -> np.ndarray:
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


def make(pkg, *, mode=KVCacheMode.PAGED, state=True, device="cpu", dtype="float32", num_blocks=0, max_seqs=2):
    specs = [KVLayerSpec.attention(H, D)]
    if state:
        specs.append(KVLayerSpec.state((3,), W, recurrent=(1, 2, 2)))
    cfg = KVCacheConfig(num_layers=len(specs), max_seqs=max_seqs, max_seq_len=32, mode=mode, block_size=4,
                        dtype=dtype, device=device, num_blocks=num_blocks)
    return pkg.KVCache.make(cfg, specs)


def kv_of(tokens, positions):
    """Deterministic K/V of tokens at positions: the same token at the same position is the same row."""
    t = np.asarray(tokens, np.float32)[:, None, None]
    p = np.asarray(positions, np.float32)[:, None, None]
    base = np.arange(H * D, dtype=np.float32).reshape(1, H, D)
    return (t * 0.25 + p * 0.0625 + base * 0.125), (t * -0.5 + p * 0.125 - base * 0.25)


def model_state(cache, b, tokens):
    """A toy state-space update through the live slabs: the conv window shifts in each token,
    the recurrent state accumulates it (what a model's state kernels do in place)."""
    if len(cache.layer_specs) < 2:
        return
    conv, rec = cache.conv_state(1, 0), cache.recurrent_state(1)
    c = host(conv[b]).copy()
    r = host(rec[b]).copy()
    for tok in tokens:
        c = np.roll(c, -1, axis=-1)
        c[:, -1] = tok + np.arange(3)
        r = r * np.float32(0.5) + np.float32(tok)
    if not isinstance(conv, np.ndarray):  # the (emulated) CUDA device: write device arrays
        from kvfast._cuda._module import cupy

        c, r = cupy().asarray(c), cupy().asarray(r)
    conv[b] = c
    rec[b] = r


def forward(pkg, cache, b, tokens):
    """One forward over ``tokens`` after slot b's committed length; returns the length before it."""
    n = int(cache.seq_lens()[b])
    step = cache.prepare_step([0, len(tokens)], [n], [b])
    k, v = kv_of(tokens, range(n, n + len(tokens)))
    pkg.ops.append_kv(cache, 0, k, v, step)
    model_state(cache, b, tokens)
    return n


def plain(pkg, cache, b, tokens):
    n = forward(pkg, cache, b, tokens)
    cache.update_position(b, n + len(tokens))


def speculate(pkg, cache, b, last, drafts, accepted, bonus, use_reserve=False):
    """Verify ``drafts`` after the last sampled token ``last``: ``accepted`` drafts pass, then ``bonus``.

    Returns the tokens the sequence gained (``[last] + drafts[:accepted]``; ``bonus`` is the next ``last``).
    """
    cache.checkpoint_state(b)
    tokens = [last] + list(drafts)
    if use_reserve:
        n = int(cache.reserve([b], [len(tokens)])[0])  # reserves and advances; returns the write offset
        cache.update_position(b, n)  # back to the offset: the forward's prepare_step draws no new block
        forward(pkg, cache, b, tokens)
    else:
        n = forward(pkg, cache, b, tokens)
    gained = tokens[: 1 + accepted]
    if accepted == len(drafts):
        cache.update_position(b, n + len(tokens))  # all accepted: the state is already right
    else:
        assert cache.restore_state(b) == n
        plain(pkg, cache, b, gained)  # re-feed the accepted tokens: state and K/V at the last accepted token
    return gained


def snapshot(cache):
    out = [cache.seq_lens(), cache.paged_block_table(), np.asarray(cache._free_order())]
    out.append(host(cache.keys(0)).copy())
    if len(cache.layer_specs) > 1:
        out += [host(cache.conv_state(1, 0)).copy(), host(cache.recurrent_state(1)).copy()]
    return out


def live(cache, b):
    """What a later step reads: slot b's gathered K/V and its state rows."""
    mod = kvfast if isinstance(cache, kvfast.KVCache) else kvref
    K, V = mod.ops.gather_kv(cache, 0, b)
    out = [host(K), host(V)]
    if len(cache.layer_specs) > 1:
        out += [host(cache.conv_state(1, 0))[b], host(cache.recurrent_state(1))[b]]
    return out


SCHEDULE = [  # (drafts, accepted, bonus)
    ([5, 6, 7], 1, 9),
    ([1, 2], 2, 3),
    ([4, 4, 4, 4], 0, 8),
    ([2], 1, 6),
    ([7, 7, 1], 2, 0),
]


@pytest.mark.parametrize("state", [True, False], ids=["hybrid", "attention"])
@pytest.mark.parametrize("mode", [KVCacheMode.PAGED, KVCacheMode.CONTIGUOUS])
@pytest.mark.parametrize("pkg", PKGS, ids=["kvref", "kvfast"])
def test_speculative_run_ends_where_the_plain_run_of_accepted_tokens_ends(pkg, mode, state):
    spec, ref = make(pkg, mode=mode, state=state), make(pkg, mode=mode, state=state)
    prompt = [3, 1, 4, 1, 5]
    plain(pkg, spec, 0, prompt)
    plain(pkg, ref, 0, prompt)
    last = 2
    for drafts, acc, bonus in SCHEDULE:
        gained = speculate(pkg, spec, 0, last, drafts, acc, bonus)
        plain(pkg, ref, 0, gained)
        last = bonus
        for a, b in zip(live(spec, 0), live(ref, 0)):
            np.testing.assert_array_equal(a, b)
        assert spec.seq_lens()[0] == ref.seq_lens()[0]
        spec.check_invariants()


@pytest.mark.parametrize("pkg", PKGS, ids=["kvref", "kvfast"])
def test_reserve_cycle_and_rollback_keep_blocks_as_capacity(pkg):
    c = make(pkg, state=False)
    plain(pkg, c, 0, [1, 2, 3])
    assert c.reserve([0], [6]).tolist() == [3]  # verify 5 drafts + 1: advances to 9, 3 blocks
    assert c.seq_lens()[0] == 9 and (c.paged_block_table()[0] > 0).sum() == 3
    c.update_position(0, 5)  # 1 draft accepted + bonus: roll back, blocks stay as capacity
    assert (c.paged_block_table()[0] > 0).sum() == 3
    free = c._free_order()
    step = c.prepare_step([0, 4], [5], [0])  # the next verification fits the kept blocks: nothing drawn
    assert c._free_order() == free and step.slot_mapping.shape == (4,)
    c.check_invariants()


@pytest.mark.parametrize("pkg", PKGS, ids=["kvref", "kvfast"])
def test_prepare_step_reserves_the_whole_verification_or_nothing(pkg):
    c = make(pkg, state=False, num_blocks=4)  # 3 usable blocks = 12 positions
    plain(pkg, c, 0, [1] * 7)
    before = snapshot(c)
    with pytest.raises(CapacityError, match=r"prepare_step: needs 2 blocks, 1 free or evictable"):
        c.prepare_step([0, 6], [7], [0])  # 7 + 6 = 13 positions: 4 blocks
    for a, b in zip(before, snapshot(c)):
        np.testing.assert_array_equal(a, b)
    c.prepare_step([0, 5], [7], [0])  # 12 positions: fits exactly


@pytest.mark.parametrize("pkg", PKGS, ids=["kvref", "kvfast"])
def test_rejected_drafts_are_never_published_and_reuse_is_not_lost(pkg):
    """A speculative request publishes exactly the plain request's blocks: same prefix hits."""
    hits = []
    for speculative in (False, True):
        c = make(pkg, state=False)  # attention only: a hybrid hit also needs an aligned state checkpoint
        prompt = [3, 1, 4, 1, 5, 9, 2]
        plain(pkg, c, 0, prompt)
        seq = list(prompt)
        last = 6
        for drafts, acc, bonus in SCHEDULE:
            gained = speculate(pkg, c, 0, last, drafts, acc, bonus) if speculative else [last] + drafts[:acc]
            if not speculative:
                plain(pkg, c, 0, gained)
            seq += gained
            last = bonus
        assert int(c.seq_lens()[0]) == len(seq)
        c.retire(0, seq + [last])
        # the same conversation continued: whole blocks below len - 1 hit; a rejected draft never does
        hits.append(c.admit(1, seq + [last, 1]))
        wrong = seq[:8] + [7]  # the first speculative step's rejected draft 6 -> 7 diverges here
        c.evict_batch(1)
        hits.append(c.admit(1, wrong + [0] * 4))
        c.check_invariants()
    assert hits[0] == hits[2] and hits[1] == hits[3]
    assert hits[0] == len(seq) // 4 * 4 and hits[1] == 8


@pytest.mark.parametrize("pkg", PKGS, ids=["kvref", "kvfast"])
def test_restore_state_errors_and_lifetime(pkg):
    c = make(pkg)
    before = snapshot(c)
    with pytest.raises(ValueError, match=r"restore_state: batch_idx=1 has no state checkpoint"):
        c.restore_state(1)
    with pytest.raises(IndexError, match=r"checkpoint_state: batch_idx=2 out of range \[0, 2\)"):
        c.checkpoint_state(2)
    with pytest.raises(TypeError, match=r"restore_state: batch_idx=True, must be an int"):
        c.restore_state(True)
    for a, b in zip(before, snapshot(c)):
        np.testing.assert_array_equal(a, b)
    plain(pkg, c, 0, [1, 2, 3, 4, 5])
    assert c.checkpoint_state(0) == 5 and c.state_checkpoint_position(0) == 5
    saved = live(c, 0)
    forward(pkg, c, 0, [6, 7])
    c.update_position(0, 7)
    assert c.restore_state(0) == 5 and c.restore_state(0) == 5  # kept: restoring twice is allowed
    for a, b in zip(live(c, 0), saved):
        np.testing.assert_array_equal(a, b)
    c.evict_batch(0)
    assert c.state_checkpoint_position(0) == -1
    with pytest.raises(ValueError, match=r"restore_state: batch_idx=0 has no state checkpoint"):
        c.restore_state(0)
    plain(pkg, c, 1, [1, 2, 3, 4, 5])
    c.checkpoint_state(1)
    c.retire(1, [1, 2, 3, 4, 5])
    assert c.state_checkpoint_position(1) == -1
    c.checkpoint_state(1)  # an empty slot: position 0
    assert c.admit(1, [1, 2, 3, 4, 5]) == 0 and c.state_checkpoint_position(1) == -1  # no state checkpoint at 4
    c.checkpoint_state(0)
    c.reset()
    assert c.state_checkpoint_position(0) == -1
    c.check_invariants()


def test_attention_only_cache_checkpoints_the_length():
    for pkg in PKGS:
        c = make(pkg, state=False, mode=KVCacheMode.CONTIGUOUS)
        plain(pkg, c, 1, [1, 2])
        assert c.checkpoint_state(1) == 2
        forward(pkg, c, 1, [3, 4, 5])
        c.update_position(1, 5)
        assert c.restore_state(1) == 2 and c.seq_lens().tolist() == [0, 2]


def test_kvfast_matches_kvref_operation_by_operation():
    caches = [make(pkg, max_seqs=2) for pkg in PKGS]
    for pkg, c in zip(PKGS, caches):
        plain(pkg, c, 0, [3, 1, 4])
        plain(pkg, c, 1, [2, 7])
        last = [5, 5]
        for i, (drafts, acc, bonus) in enumerate(SCHEDULE):
            b = i % 2
            speculate(pkg, c, b, last[b], drafts, acc, bonus, use_reserve=(i == 3))
            last[b] = bonus
    for a, b in zip(snapshot(caches[0]), snapshot(caches[1])):
        np.testing.assert_array_equal(a, b)


def test_emulated_cuda_state_rollback(emulated):
    ref, dev = make(kvref), make(kvfast, device="cuda:0")
    for pkg, c in ((kvref, ref), (kvfast, dev)):
        plain(pkg, c, 0, [3, 1, 4, 1, 5])
        last = 2
        for drafts, acc, bonus in SCHEDULE[:3]:
            speculate(pkg, c, 0, last, drafts, acc, bonus)
            last = bonus
    for a, b in zip(live(ref, 0), live(dev, 0)):
        np.testing.assert_array_equal(a, b)
    dev.check_invariants()


@pytest.mark.parametrize("pkg", PKGS, ids=["kvref", "kvfast"])
def test_fp8_speculation_rolls_back_with_exact_dequantisation(pkg):
    c = make(pkg, state=False, dtype="float8_e4m3fn")
    plain(pkg, c, 0, [1, 2, 3])
    n = forward(pkg, c, 0, [4, 90, 91])  # large rejected drafts grow the block's scale
    c.update_position(0, n + 1)
    K, _ = pkg.ops.gather_kv(c, 0, 0)
    blk = c.paged_block_table()[0, 0]
    s = c.scales(0)[0][blk]
    # the kept tokens read back as stored bits times the (grown) scale: exact dequantisation
    raw = host(c.keys(0))[blk, :4].astype(np.float32) * s[None, :, None]
    np.testing.assert_array_equal(K, raw)
    kt, _ = kv_of([1, 2, 3, 4], range(4))
    assert np.abs(K - kt).max() <= 2.0**-4 * np.abs(kt).max() + 2.0**-9 * s.max()
