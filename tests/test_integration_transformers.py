"""kvcache.integrations.transformers on tiny random Llama, Qwen2 (sliding layers) and Mistral (sliding) models.

Every path is checked against transformers' own ``DynamicCache``: greedy tokens equal, logits
within a per-dtype tolerance:

* float32: ``1e-4`` (measured about 1e-7: the same K/V, attention summed in another order);
* bfloat16 through ``SlotKVCache`` with transformers' ``sdpa``: ``1e-2`` (measured 0: the cache
  holds the same bfloat16 K/V and sdpa reads them as it reads DynamicCache's);
* bfloat16 through the ``"kvcache"`` attention (float32 attention over the bfloat16 cache, where
  sdpa attends in bfloat16): ``2e-2`` teacher-forced (measured 3.9e-3, one bfloat16 step at
  these logits); greedy tokens are not compared there, a random model's margins are smaller.
"""

from __future__ import annotations

import os
import re
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import (DynamicCache, Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel,  # noqa: E402
                          GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

from kvcache.integrations.transformers import (ATTENTION_NAME, ContinuousBatchingGenerator,  # noqa: E402
                                               SlotKVCache, kvcache_attention, layer_windows)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
TOL_KVCACHE_ATTN_BF16 = 2e-2
BACKENDS = ["kvfast", "kvref"]
#: gemma2: soft-capped logits, sliding and full layers; gpt_oss: attention sinks, sliding layers, MoE;
#: gpt2: every head a K/V head, whatever ``num_key_value_heads`` the config also carries.
MODELS = ["llama", "qwen2", "mistral", "gemma2", "gpt_oss", "gpt2"]
_CACHE: dict = {}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and lose a lot when the cores are shared."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def tiny_model(kind: str, dtype=torch.float32):
    """A random-initialised decoder: vocab 128, hidden 64, 3 layers, 4 query / 2 K/V heads."""
    key = (kind, dtype)
    if key not in _CACHE:
        common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
        if kind == "llama":
            cls, cfg = LlamaForCausalLM, LlamaConfig(**common)
        elif kind == "qwen2":   # layer 0 full, layers 1-2 sliding (window 6)
            cls, cfg = Qwen2ForCausalLM, Qwen2Config(use_sliding_window=True, sliding_window=6, max_window_layers=1,
                                                     **common)
        elif kind == "mistral":  # every layer sliding (window 5)
            cls, cfg = MistralForCausalLM, MistralConfig(sliding_window=5, **common)
        elif kind == "gemma2":   # attention logits soft-capped at 50 (and final logits at 30), layers sliding / full
            cls, cfg = Gemma2ForCausalLM, Gemma2Config(head_dim=16, sliding_window=5, attn_logit_softcapping=2.0,
                                                       **common)
        elif kind == "gpt_oss":  # one sink logit per query head, sliding / full layers, 4 experts
            cls, cfg = GptOssForCausalLM, GptOssConfig(head_dim=16, sliding_window=5, num_local_experts=4,
                                                       num_experts_per_tok=2, **common)
        else:                    # GPT-2: learned positions, multi-head (num_key_value_heads is not read)
            cls, cfg = GPT2LMHeadModel, GPT2Config(n_inner=128, **common)
        torch.manual_seed(0)
        model = cls(cfg).eval()
        _CACHE[key] = model.to(dtype) if dtype != torch.float32 else model
    return _CACHE[key]


def prompts(batch: int = 2, length: int = 11, seed: int = 1):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, cache, n: int = 12):
    out = model.generate(ids, max_new_tokens=n, do_sample=False, cache=cache, output_logits=True,
                         return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits).float()


class attention:
    """Run the model with another attention implementation, restored after."""

    def __init__(self, model, name):
        self.model, self.name = model, name

    def __enter__(self):
        self.saved = self.model.config._attn_implementation
        self.model.set_attn_implementation(self.name)
        return self.model

    def __exit__(self, *exc):
        self.model.set_attn_implementation(self.saved)


def test_layer_windows():
    assert layer_windows(tiny_model("llama").config) == [None, None, None]
    assert layer_windows(tiny_model("qwen2").config) == [None, 6, 6]
    assert layer_windows(tiny_model("mistral").config) == [5, 5, 5]


@pytest.mark.parametrize("mode", ["paged", "contiguous"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", MODELS)
def test_generate_equals_dynamic_cache(kind, backend, mode):
    model = tiny_model(kind)
    ids = prompts()
    ref_tokens, ref_logits = greedy(model, ids, DynamicCache(config=model.config))
    cache = SlotKVCache(model.config, backend=backend, mode=mode, block_size=4)
    tokens, logits = greedy(model, ids, cache)
    assert torch.equal(tokens, ref_tokens)
    assert float((logits - ref_logits).abs().max()) <= TOL[torch.float32]
    assert cache.kv.keys(0).dtype == np.float32                  # the model's dtype, no down-cast
    assert cache.get_seq_length() == tokens.shape[1] - 1         # the last token was sampled, never fed
    assert list(cache.kv.seq_lens()[:2]) == [tokens.shape[1] - 1] * 2


@pytest.mark.parametrize("scatter", ["ops", "torch"])
def test_scatter_paths_store_the_same_bytes(scatter):
    model = tiny_model("qwen2")
    ids = prompts()
    ref_tokens, _ = greedy(model, ids, DynamicCache(config=model.config), n=6)
    cache = SlotKVCache(model.config, backend="kvref", block_size=4, scatter=scatter)
    tokens, _ = greedy(model, ids, cache, n=6)
    assert torch.equal(tokens, ref_tokens)
    other = SlotKVCache(model.config, backend="kvref", block_size=4, scatter="torch" if scatter == "ops" else "ops")
    greedy(model, ids, other, n=6)
    for layer in range(3):
        assert np.array_equal(cache.kv.keys(layer), other.kv.keys(layer))
        assert np.array_equal(cache.kv.values(layer), other.kv.values(layer))


@pytest.mark.parametrize("mode", ["paged", "contiguous"])
@pytest.mark.parametrize("kind", MODELS)
def test_generate_bfloat16(kind, mode):
    model = tiny_model(kind, torch.bfloat16)
    ids = prompts()
    ref_tokens, ref_logits = greedy(model, ids, DynamicCache(config=model.config))
    cache = SlotKVCache(model.config, mode=mode, block_size=4)
    tokens, logits = greedy(model, ids, cache)
    assert torch.equal(tokens, ref_tokens)
    assert float((logits - ref_logits).abs().max()) <= TOL[torch.bfloat16]
    assert cache.kv.keys(0).dtype.name == "bfloat16"


def test_past_key_values_is_the_same_argument():
    model = tiny_model("llama")
    ids = prompts(batch=1)
    ref = model.generate(ids, max_new_tokens=5, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # transformers 5 renames it to ``cache`` (a deprecation warning)
        out = model.generate(ids, max_new_tokens=5, do_sample=False, past_key_values=SlotKVCache(model.config))
    assert torch.equal(out, ref)


@pytest.mark.parametrize("kind", MODELS)
def test_beam_search_reorders_rows(kind):
    model = tiny_model(kind)
    ids = prompts()
    kw = dict(max_new_tokens=5, do_sample=False, num_beams=3, num_return_sequences=2)
    ref = model.generate(ids, cache=DynamicCache(config=model.config), **kw)
    assert torch.equal(model.generate(ids, cache=SlotKVCache(model.config, block_size=4), **kw), ref)


def test_crop_rolls_back():
    model = tiny_model("llama")
    ids = prompts(batch=1)
    cache = SlotKVCache(model.config, block_size=4)
    with torch.no_grad():
        first = model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1]
        model(input_ids=ids[:, :3], cache=cache, use_cache=True)          # 3 tokens too many
        cache.crop(-3)
        assert cache.get_seq_length() == ids.shape[1]
        dyn = DynamicCache(config=model.config)
        model(input_ids=ids, cache=dyn, use_cache=True)
        nxt = ids[:, :1]
        a = model(input_ids=nxt, cache=cache, use_cache=True).logits
        b = model(input_ids=nxt, cache=dyn, use_cache=True).logits
    assert first.shape == (128,)
    assert float((a - b).abs().max()) <= TOL[torch.float32]


# ------------------------------------------------------------------ the "kvcache" attention function

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", MODELS)
def test_attention_function_in_generate(kind, backend):
    model = tiny_model(kind)
    ids = prompts()
    ref_tokens, ref_logits = greedy(model, ids, DynamicCache(config=model.config))
    with attention(model, ATTENTION_NAME):
        tokens, logits = greedy(model, ids, SlotKVCache(model.config, backend=backend, block_size=4))
    assert torch.equal(tokens, ref_tokens)
    assert float((logits - ref_logits).abs().max()) <= TOL[torch.float32]


@pytest.mark.parametrize("kind", MODELS)
def test_attention_function_bfloat16_teacher_forced(kind):
    model = tiny_model(kind, torch.bfloat16)
    seq = model.generate(prompts(), max_new_tokens=8, do_sample=False)

    def run(cache):
        with torch.no_grad():
            parts = [model(input_ids=seq[:, :11], cache=cache, use_cache=True).logits]
            parts += [model(input_ids=seq[:, t:t + 1], cache=cache, use_cache=True).logits
                      for t in range(11, seq.shape[1])]
        return torch.cat(parts, 1).float()

    ref = run(DynamicCache(config=model.config))
    with attention(model, ATTENTION_NAME):
        ours = run(SlotKVCache(model.config, block_size=4))
    assert float((ours - ref).abs().max()) <= TOL_KVCACHE_ATTN_BF16


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", MODELS)
def test_packed_rows_without_padding(kind, backend):
    """Three rows of different lengths in one [1, T] forward, then one packed decode step."""
    model = tiny_model(kind)
    rows = [[5, 17, 42, 8, 99, 3, 61], [9, 8, 7], [4] * 13]
    cache = SlotKVCache(model.config, backend=backend, max_batch_size=4, block_size=4)
    with attention(model, ATTENTION_NAME), torch.no_grad():
        pos = cache.prepare_packed([2, 0, 3], [len(r) for r in rows])
        logits = model(input_ids=torch.tensor([sum(rows, [])]), position_ids=pos, cache=cache,
                       use_cache=True).logits[0]
        last = np.cumsum([len(r) for r in rows]) - 1
        nxt = [int(t) for t in logits[last].argmax(-1)]
        pos = cache.prepare_packed([2, 0, 3], [1, 1, 1])
        step2 = model(input_ids=torch.tensor([nxt]), position_ids=pos, cache=cache, use_cache=True).logits[0]
    assert pos.tolist() == [[len(r) for r in rows]]
    assert list(cache.seq_lens()) == [4, 0, 8, 14]
    for b, row in enumerate(rows):
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([row + [nxt[b]]])).logits[0]
        assert float((logits[last[b]] - ref[-2]).abs().max()) <= TOL[torch.float32]
        assert float((step2[b] - ref[-1]).abs().max()) <= TOL[torch.float32]


def test_attention_function_refuses_padding_and_a_missing_step():
    model = tiny_model("llama")
    ids = prompts()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0                                                  # left padding
    with attention(model, ATTENTION_NAME):
        with pytest.raises(ValueError, match="pad"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                           cache=SlotKVCache(model.config))
        with pytest.raises(RuntimeError, match="no kvcache step"):
            from kvcache.integrations import transformers as integ
            token = integ._ACTIVE.set(None)
            try:
                with torch.no_grad():
                    model(input_ids=ids)                              # transformers' own DynamicCache
            finally:
                integ._ACTIVE.reset(token)
    with pytest.raises(ValueError, match="dropout=0.5"):
        cache = SlotKVCache(model.config, max_batch_size=1, dtype=torch.float32)
        cache.prepare_packed([0], [2])
        model.set_attn_implementation(ATTENTION_NAME)
        try:
            k = torch.zeros(1, 2, 2, 16)
            cache.update(k, k, 0)
            kvcache_attention(model.model.layers[0].self_attn, torch.zeros(1, 4, 2, 16), k, k, None, dropout=0.5)
        finally:
            model.set_attn_implementation("sdpa")


def test_errors_name_the_argument():
    cfg = tiny_model("llama").config
    with pytest.raises(ValueError, match="backend='numpy'"):
        SlotKVCache(cfg, backend="numpy")
    with pytest.raises(ValueError, match="mode='dense'"):
        SlotKVCache(cfg, mode="dense")
    with pytest.raises(ValueError, match="scatter='cuda'"):
        SlotKVCache(cfg, scatter="cuda")
    with pytest.raises(ValueError, match="max_seq_len=0"):
        SlotKVCache(cfg, max_seq_len=0)
    with pytest.raises(TypeError, match="config=dict"):
        SlotKVCache({})
    cache = SlotKVCache(cfg, max_batch_size=2, dtype=torch.float16)
    assert cache.kv.keys(0).dtype == np.float16
    with pytest.raises(TypeError, match="dtype=torch.float32 != the cache's dtype=torch.float16"):
        k = torch.zeros(1, 2, 3, 16)
        cache.update(k, k, 0)
    with pytest.raises(ValueError, match=r"slot_ids\[1\]=5 out of range"):
        cache.prepare_packed([0, 5], [1, 1])
    with pytest.raises(ValueError, match=r"q_lens\[0\]=0"):
        cache.prepare_packed([0], [0])
    with pytest.raises(ValueError, match="max_batch_size=None"):
        SlotKVCache(cfg).prepare_packed([0], [1])
    with pytest.raises(ValueError, match="tokens_to_remove=2"):
        cache.crop(2)


# ------------------------------------------------------------------ continuous batching over the manager

def _reference(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         cache=DynamicCache(config=model.config))
    return out[0, len(prompt):].tolist()


SYSTEM = list(range(10, 22))                                          # a 12-token shared prefix: 3 pages of 4
REQUESTS = [SYSTEM + [i, i + 1, 40 + i] for i in range(5)] + [[3, 4, 5], SYSTEM + [1]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", MODELS)
def test_continuous_batching_equals_per_request_greedy(kind, backend):
    model = tiny_model(kind)
    saved = model.config._attn_implementation                       # sdpa, or eager (Gemma 2, gpt-oss)
    gen = ContinuousBatchingGenerator(model, backend=backend, num_blocks=40, page_size=4, max_batch_size=3,
                                      max_seq_len=32, chunk_size=6)
    assert model.config._attn_implementation == saved                # the geometry probe restores it
    tokens = gen.generate(REQUESTS, 6)
    assert tokens == [_reference(model, p, 6) for p in REQUESTS]
    assert gen.stats.admissions_with_hit > 0 and gen.stats.prefix_hit_tokens > 0
    assert gen.stats.chunked_prefill_steps > 0
    assert model.config._attn_implementation == saved                # restored
    assert gen.manager.block_count().used == 0                       # nothing leaked


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_continuous_batching_preempts_on_a_small_pool(kind):
    model = tiny_model(kind)
    gen = ContinuousBatchingGenerator(model, backend="kvfast", num_blocks=12, page_size=4, max_batch_size=4,
                                      max_seq_len=28, chunk_size=8)
    news = [10, 8, 12, 6, 9, 7, 11]
    tokens = gen.generate(REQUESTS, news)
    assert tokens == [_reference(model, p, n) for p, n in zip(REQUESTS, news)]
    assert gen.stats.preemptions > 0 and gen.stats.readmissions > 0
    assert gen.stats.admissions_with_hit > 0


def test_continuous_batching_bfloat16_pages():
    model = tiny_model("llama", torch.bfloat16)
    gen = ContinuousBatchingGenerator(model, num_blocks=40, page_size=4, max_batch_size=3, max_seq_len=32)
    assert gen.manager.get_device_buffer(0).dtype.name == "bfloat16"
    tokens = gen.generate(REQUESTS[:3], 4)
    assert all(len(t) == 4 for t in tokens)


def test_continuous_batching_errors():
    model = tiny_model("llama")
    gen = ContinuousBatchingGenerator(model, num_blocks=8, page_size=4, max_batch_size=2, max_seq_len=24)
    with pytest.raises(ValueError, match=r"prompts\[0\] is empty"):
        gen.generate([[]], 2)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        gen.generate([[1, 2]], 0)
    with pytest.raises(ValueError, match="max_seq_len=24"):
        gen.generate([[1] * 20], 5)
    with pytest.raises(ValueError, match="chunk_size=0"):
        ContinuousBatchingGenerator(model, chunk_size=0)


# ------------------------------------------------------------------ the docs page runs as written

def test_docs_page_runs(capsys):
    """docs/transformers.md: every python block, in order, in one namespace (as tests/test_docs.py runs pages)."""
    with open(os.path.join(ROOT, "docs", "transformers.md"), encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    assert blocks
    ns = {"__name__": "__docs__"}
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        for block in blocks:
            exec(compile(block, "docs/transformers.md", "exec"), ns)
    finally:
        os.chdir(cwd)


def test_packed_rows_need_the_kvcache_attention():
    model = tiny_model("llama")
    cache = SlotKVCache(model.config, max_batch_size=2)
    pos = cache.prepare_packed([1], [3])
    with pytest.raises(ValueError, match="packed rows .* need attn_implementation='kvcache'"):
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3]]), position_ids=pos, cache=cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["paged", "contiguous"])
def test_numpy_and_torch_writes_agree(mode, dtype):
    """``update`` writes and reads through NumPy views of the storage's words; inputs that need grad
    take the torch path (``index_copy_``, ``index_select``). Same bytes stored, same history returned."""
    config = tiny_model("qwen2").config                              # one full, two sliding layers of 6
    gen = torch.Generator().manual_seed(3)
    caches = [SlotKVCache(config, mode=mode, block_size=4, max_batch_size=2, dtype=dtype) for _ in range(2)]
    for S in (5, 1, 1, 3, 1):                                        # a prefill, decodes, a chunk, a decode
        for layer in range(3):
            k = torch.randn(2, 2, S, 16, generator=gen).to(dtype)
            v = torch.randn(2, 2, S, 16, generator=gen).to(dtype)
            got = caches[0].update(k, v, layer)
            want = caches[1].update(k.clone().requires_grad_(),
                                    v.clone().requires_grad_(), layer)
            for a, b in zip(got, want):
                assert a.dtype == dtype and torch.equal(a, b.detach())
            assert torch.equal(got[0][:, :, -S:], k) and torch.equal(got[1][:, :, -S:], v)
    for layer in range(3):
        assert np.array_equal(np.asarray(caches[0].kv.keys(layer)).view(np.uint8),
                              np.asarray(caches[1].kv.keys(layer)).view(np.uint8))
        assert np.array_equal(np.asarray(caches[0].kv.values(layer)).view(np.uint8),
                              np.asarray(caches[1].kv.values(layer)).view(np.uint8))
    assert list(caches[0].seq_lens()) == list(caches[1].seq_lens()) == [11, 11]
    with pytest.raises((RuntimeError, ValueError)):                  # a value of another shape: refused
        caches[0].update(torch.zeros(2, 2, 1, 16, dtype=dtype), torch.zeros(2, 2, 1, 8, dtype=dtype), 0)


def test_a_forward_that_raised_is_dropped():
    model = tiny_model("llama")
    ids = prompts(batch=1)
    cache = SlotKVCache(model.config, block_size=4)
    k = torch.zeros(1, 2, 4, 16)
    cache.update(k, k, 0)                                            # a forward that died after layer 0
    with pytest.raises(ValueError, match="layer_idx=0 out of range .* or written twice|layer_idx=1"):
        cache.update(k, k, 1)
        cache.update(k, k, 1)
    assert cache.get_seq_length() == 0                               # nothing committed
    out = model.generate(ids, max_new_tokens=6, do_sample=False, cache=cache)
    assert torch.equal(out, model.generate(ids, max_new_tokens=6, do_sample=False))


def test_continuous_batching_stops_at_eos():
    model = tiny_model("llama")
    gen = ContinuousBatchingGenerator(model, num_blocks=40, page_size=4, max_batch_size=3, max_seq_len=32)
    full = gen.generate(REQUESTS[:3], 8)
    eos = full[1][3]                                                  # the 4th token of the second request
    cut = gen.generate(REQUESTS[:3], 8, eos_token_id=eos)
    for a, b in zip(full, cut):
        n = a.index(eos) + 1 if eos in a else len(a)
        assert b == a[:n]
    assert len(cut[1]) <= 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_release_and_admit_reuse_a_prefix_in_generate(backend):
    model = tiny_model("qwen2")
    ids = prompts(batch=1)
    cache = SlotKVCache(model.config, backend=backend, block_size=4, max_batch_size=1, dtype=torch.float32)
    out = model.generate(ids, max_new_tokens=6, do_sample=False, cache=cache)
    cache.release(0, out[0, :-1].tolist())                           # publish the fed tokens' full blocks
    follow = torch.cat([out[0], torch.tensor([7, 8, 9])])[None]      # the next turn of the conversation
    assert cache.admit(0, follow[0].tolist()) == 16                  # 4 whole blocks of 4
    again = model.generate(follow, max_new_tokens=5, do_sample=False, cache=cache)   # computes only the rest
    assert torch.equal(again, model.generate(follow, max_new_tokens=5, do_sample=False))
    cache.reset()
    assert cache.get_seq_length() == 0


def test_generator_reads_the_kv_geometry_the_layers_use():
    """GPT-2 attends with all 4 heads though its config also carries num_key_value_heads=2: the
    generator's pages take the K/V the layers hand over (one probe forward), not the config's count."""
    model = tiny_model("gpt2")
    assert model.config.num_key_value_heads == 2
    gen = ContinuousBatchingGenerator(model, num_blocks=16, page_size=4, max_seq_len=32)
    params = gen.manager.params
    assert (params.kv_heads, params.head_dim, params.num_layers) == (4, 16, 3)
