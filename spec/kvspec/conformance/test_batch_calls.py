"""The batch calls (spec/manager.md §17): ``alloc_many``, ``step_many``,
``release_many`` and ``TextContext.update_many`` have exactly the effect of the
loop of single calls, and a batch the loop would fail in raises the loop's
error with everything as before.

Each scenario runs twice on the backend, once through the single calls and
once through the batch calls, and once through the batch calls on kvref; all
three observation lists must be equal. Observations are public: block ids per
leaf (``get_req_blocks_per_leaf``), prefix hits, ``block_count``, metrics and
the contexts' lengths; "as before" compares them, and the page bytes, before and
after a refused batch.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvspec import InsufficientBlocksError, KVCacheParams, LeafSpec, TextContext
from kvspec.conformance._compare import capture, to_numpy
from kvspec.conformance.plugin import require

PAGE = 4

CONFIGS = {
    "full": None,
    "full+sliding": {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(8)},
    "full+recurrent": {"full": LeafSpec.full(), "rec": LeafSpec.recurrent((4, 8))},
}
#: num_blocks per configuration: the workload with room to keep the first wave's prefix; the
#: refusal scenario's four running requests with little room left
ROOMY = {"full": 40, "full+sliding": 64, "full+recurrent": 40}
TIGHT = {"full": 21, "full+sliding": 41, "full+recurrent": 19}


def _manager(backend, leaves, num_blocks=40, dp=1):
    params = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=2, dtype="float32", leaves=leaves,
                           data_parallel_degree=dp)
    return backend.build_manager(params, num_blocks=num_blocks, max_batch_size=8, max_seq_len=40)


def _observe(m, ctxs):
    """Everything public about ``ctxs`` and the pools."""
    out = []
    for c in ctxs:
        if m.contains(c.request_id):
            out.append((c.request_id, c.processed_length, c.active_length, len(c), c.cached_prefix_length,
                        {k: list(map(int, v)) for k, v in m.get_req_blocks_per_leaf(c).items()}))
        else:
            out.append((c.request_id, c.processed_length, c.active_length, len(c), c.cached_prefix_length))
    counts = [repr(m.block_count(r)) for r in range(m.params.data_parallel_degree)]
    metrics = m.get_metrics_aggregated()
    return out, counts, (metrics.input_tokens, metrics.cache_tokens)


def _prompts(n):
    shared = list(range(500, 512))  # 3 pages every request shares
    return [shared + [1000 * i + j for j in range(3 + 2 * i)] for i in range(n)]


def _workload(m, batch: bool, n=5, steps=7):
    """Admit ``n`` requests sharing a prefix (two waves: the second hits), decode ``steps`` tokens,
    release; the observations after every phase."""
    seen = []
    for wave in range(2):
        ctxs = [TextContext(f"w{wave}r{i}", np.asarray(p, np.int32)) for i, p in enumerate(_prompts(n))]
        for c in ctxs:
            m.claim(c)
        for step in range(steps):
            if batch:
                transfers = m.alloc_many(ctxs)
            else:
                transfers = [m.alloc(c) for c in ctxs]
            assert len(transfers) == len(ctxs) and all(t.is_complete() for t in transfers)
            tokens = [7 + step + i for i in range(len(ctxs))]
            if batch:
                TextContext.update_many(ctxs, np.asarray(tokens, np.int64) if step % 2 else tokens)
                m.step_many(ctxs)
            else:
                for c, t in zip(ctxs, tokens):
                    c.update(t)
                for c in ctxs:
                    m.step(c)
            seen.append(_observe(m, ctxs))
        hits = [c.cached_prefix_length for c in ctxs]
        if batch:
            m.release_many(ctxs[:2] + [c.request_id for c in ctxs[2:]])
        else:
            for c in ctxs:
                m.release(c)
        m.check_invariants()
        seen.append((hits, _observe(m, ctxs)))
    return seen


@pytest.mark.parametrize("config", list(CONFIGS))
def test_batch_calls_equal_the_loop(kv_backend, kv_oracle, config):
    require(kv_backend, "manager", "prefix_caching")
    leaves = CONFIGS[config]
    n = ROOMY[config]
    loop = _workload(_manager(kv_backend, leaves, n), batch=False)
    batch = _workload(_manager(kv_backend, leaves, n), batch=True)
    oracle = _workload(_manager(kv_oracle, leaves, n), batch=True)
    assert batch == loop, "the batch calls observed otherwise than the loop of single calls"
    assert batch == oracle, "the backend's batch calls observed otherwise than kvref's"
    if config != "full+recurrent":  # (a recurrent hit needs a checkpoint at the shared boundary)
        assert all(loop[15][0]), "the second wave must hit the shared prefix"


def _bytes(m):
    buf = m.get_device_buffer(0)
    if isinstance(buf, dict):
        return {k: to_numpy(v).tobytes() for k, v in buf.items()}
    return to_numpy(buf).tobytes()


def _running(m, n):
    ctxs = [TextContext(f"r{i}", np.asarray(p, np.int32)) for i, p in enumerate(_prompts(n))]
    for c in ctxs:
        m.claim(c)
    m.alloc_many(ctxs)
    TextContext.update_many(ctxs, [3] * n)
    m.step_many(ctxs)
    return ctxs


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_batch_the_loop_fails_in_changes_nothing(kv_backend, kv_oracle, config):
    """spec/manager.md §17.2: out of pages at the last context; an unclaimed context last; a bad
    token last; a duplicate release: each the loop's error, the state as before."""
    require(kv_backend, "manager", "prefix_caching")
    leaves = CONFIGS[config]

    def scenario(backend):
        m = _manager(backend, leaves, num_blocks=TIGHT[config])
        ctxs = _running(m, 4)
        bigs = [TextContext(f"big{i}", np.arange(9000 + 100 * i, 9040 + 100 * i, dtype=np.int32)) for i in range(4)]
        for big in bigs:
            m.claim(big)
        out = []
        for name, call in [
            ("alloc, out of pages", lambda: m.alloc_many(ctxs + bigs)),
            ("alloc, unclaimed", lambda: m.alloc_many(ctxs + [TextContext("nobody", [1, 2, 3])])),
            ("step, unclaimed", lambda: m.step_many(ctxs + [TextContext("nobody", [1, 2, 3])])),
            ("update, bad token", lambda: TextContext.update_many(ctxs, [1, 2, 3, 2**31])),
            ("update, lengths", lambda: TextContext.update_many(ctxs, [1, 2, 3])),
            ("release, twice", lambda: m.release_many([ctxs[0], ctxs[1], ctxs[0]])),
        ]:
            before = (_observe(m, ctxs + bigs), _bytes(m), [c.tokens.tolist() for c in ctxs])
            got = capture(call)
            assert got.raised, f"{name}: the batch did not raise"
            assert (_observe(m, ctxs + bigs), _bytes(m), [c.tokens.tolist() for c in ctxs]) == before, \
                f"{name}: the refused batch changed the state"
            m.check_invariants()
            out.append((name, type(got.exc).__name__, str(got.exc)))
        # the loop raises the same error at the same context (after changing what came before it)
        loop = capture(lambda: [m.alloc(c) for c in ctxs + bigs])
        out.append(("loop", type(loop.exc).__name__, str(loop.exc)))
        return out

    want = capture(lambda: scenario(kv_oracle))
    got = capture(lambda: scenario(kv_backend))
    assert not want.raised, f"kvref raised {want.exc!r}"
    assert not got.raised, f"backend raised {got.exc!r}"
    assert got.value == want.value
    kinds = [k for _, k, _ in want.value]
    assert kinds == [InsufficientBlocksError.__name__, "ValueError", "ValueError", "ValueError", "ValueError",
                     "ValueError", InsufficientBlocksError.__name__]
    assert want.value[0][1:] == want.value[-1][1:], "alloc_many's error is the loop's"
    assert "not claimed" in want.value[5][2]


def test_empty_batches_do_nothing(kv_backend):
    require(kv_backend, "manager")
    m = _manager(kv_backend, None)
    assert m.alloc_many([]) == []
    assert m.step_many([]) is None
    assert m.release_many(()) is None
    TextContext.update_many([], [])
    for call in (lambda: m.alloc_many("abc"), lambda: m.step_many(TextContext("a", [1])),
                 lambda: m.release_many(3), lambda: TextContext.update_many([TextContext("a", [1])], "x")):
        assert capture(call).raised and isinstance(capture(call).exc, TypeError)
