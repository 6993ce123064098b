"""kvcache replay as a capacity planner: model presets, bookkeeping-only sizes, sweeps (processes and
Dask's local cluster), the JSON document and the plots."""

from __future__ import annotations

import json
import os

import pytest

from kvcache.cli import main
from kvcache.models import MODELS, get_model, model_table
from kvcache.replay import ReplayConfig, replay
from kvcache.report import SCHEMA_VERSION, json_document
from kvcache.sweep import sweep
from kvcache.workload import synthetic_workload
from kvspec import LeafKind

TRACES = "/work/shared/traces"
SYNTHETIC = os.path.join(TRACES, "synthetic_trace.jsonl")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------- presets


def test_presets_cover_the_architectures_asked_for():
    kinds = {m.kind for m in MODELS.values()}
    assert kinds == {"dense", "sliding+full", "mla", "hybrid"}
    for name in ("llama-3.1-8b", "llama-3.1-70b", "qwen3-8b", "mistral-7b-v0.3", "mixtral-8x7b", "gemma-3-27b",
                 "deepseek-v3", "jamba-v0.1"):
        assert name in MODELS
    # Published K/V bytes per token: Llama-3.1-8B 128 KiB in bf16, 70B 320 KiB; DeepSeek-V3's MLA latent
    # 576 values x 61 layers x 2 bytes.
    assert get_model("Llama-3.1-8B").kv_bytes_per_token() == 128 * 1024
    assert get_model("llama-3.1-70b").kv_bytes_per_token() == 320 * 1024
    assert get_model("deepseek-v3").kv_bytes_per_token() == 576 * 61 * 2
    with pytest.raises(ValueError, match=r"model='gpt-9' is not a preset; known: llama-3.1-8b"):
        get_model("gpt-9")


def test_preset_leaves_and_page_bytes():
    g = ReplayConfig(model="gemma-3-27b", page_size=16)
    leaves = g.params().leaves()
    assert [leaf.kind for leaf in leaves.values()] == [LeafKind.FULL, LeafKind.SLIDING_WINDOW]
    assert leaves["swa"].window == 1024
    # 62 layers split over the two leaves: 31 + 31 layers x 16 heads x 128 x 2 (K, V) x 2 bytes x 16 tokens
    assert g.page_bytes() == 2 * 31 * 16 * 16 * 128 * 2 * 2
    j = ReplayConfig(model="jamba-v0.1", page_size=16).params()
    assert j.leaves()["state"].kind is LeafKind.RECURRENT and j.model_id == "ai21labs/Jamba-v0.1"
    llama = ReplayConfig(model="llama-3.1-8b", page_size=512, device_bytes=120 * 2**30)
    assert llama.page_bytes() == 64 * 2**20 and llama.blocks_per_replica() == 1920
    assert llama.capacity_tokens() == 1919 * 512
    assert llama.params().dtype == "bfloat16" and llama.params().allocate_buffers is False
    assert ReplayConfig(model="llama-3.1-8b", dtype="float32").params().dtype == "float32"


def test_list_models(capsys):
    code, out, err = run(capsys, "replay", "--list-models")
    assert code == 0 and err == ""
    assert out.strip() == model_table()
    assert "deepseek-v3" in out and "jamba-v0.1" in out and "hybrid" in out


@pytest.mark.parametrize("model", ["gemma-3-12b", "jamba-v0.1", "deepseek-v3"])
def test_every_leaf_kind_replays_under_the_ceiling(model):
    w = synthetic_workload(12, seed=3)
    s = replay(w, ReplayConfig(model=model, page_size=64, num_blocks=400, backend="kvref"))
    assert 0 <= s.hit_tokens <= s.ceiling_hit_tokens
    assert s.lost_hit_total == s.ceiling_hit_tokens - s.hit_tokens and s.attribution_mismatches == 0
    assert s.model == model and s.model_id == get_model(model).model_id


def test_table_shows_model_sizes_and_capacity(capsys):
    code, out, err = run(capsys, "replay", "--num-requests", "20", "--model", "llama-3.1-8b", "--page-size", "16",
                         "--num-blocks", "1024", "--no-progress")
    assert code == 0, err
    assert "llama-3.1-8b (meta-llama/Llama-3.1-8B), bfloat16, 2.0 MiB per page" in out
    assert "device pool             2.00 GiB over 1 replica(s), 16,368 tokens of capacity" in out
    assert "lost hits" in out


def test_bookkeeping_only_plans_a_120gib_pool_and_1tib_host_tier(capsys):
    # The acceptance command, on a short workload; a machine without 1 TiB must not allocate it.
    code, out, err = run(capsys, "replay", "--model", "llama-3.1-8b", "--device-bytes", "120GiB",
                         "--host-bytes", "1TiB", "--page-size", "512", "--num-requests", "30", "--no-progress")
    if code != 0 and "does not implement bookkeeping-only mode" in err:
        pytest.skip("the manager does not implement allocate_buffers=False yet: " + err.strip())
    assert code == 0, err
    assert "1,919 per replica" in out and "host 1,024.00 GiB" in out and "bookkeeping only" in out


def test_real_bytes_are_bounded_by_the_machine(capsys):
    code, out, err = run(capsys, "replay", "--model", "llama-3.1-70b", "--device-bytes", "8TiB", "--real-bytes",
                         "--page-size", "512", "--no-progress")
    assert code == 2 and out == ""
    assert err.startswith("kvcache: error: --device-bytes=")
    assert "GiB of real buffers, must be <=" in err and "half this machine's memory" in err


def test_bookkeeping_hit_rate_equals_real_bytes_at_the_same_pages():
    # Same pages, bookkeeping-only or real buffers: the same replay, figure for figure.
    w = synthetic_workload(40, seed=5)
    base = dict(model="llama-3.1-8b", page_size=64, num_blocks=300, backend="kvref")
    a = replay(w, ReplayConfig(**base))
    b = replay(w, ReplayConfig(**base, allocate_buffers=True))
    assert (a.hit_tokens, a.preemptions, a.steps, a.lost_hit_tokens) == \
           (b.hit_tokens, b.preemptions, b.steps, b.lost_hit_tokens)


# --------------------------------------------------------------------------- sweeps


def _configs(values):
    return [ReplayConfig(page_size=16, num_blocks=v, num_layers=1, kv_heads=1, head_dim=2, backend="kvref")
            for v in values]


def test_sweep_in_processes_matches_serial_runs():
    w = synthetic_workload(30, seed=2)
    cfgs = _configs([420, 600, 900])
    par = sweep(w, cfgs, workers=2)
    ser = sweep(w, cfgs, workers=1)
    assert [v for _, v in par] == [420, 600, 900]
    assert [s.hit_tokens for s, _ in par] == [s.hit_tokens for s, _ in ser]
    assert [s.lost_hit_tokens for s, _ in par] == [s.lost_hit_tokens for s, _ in ser]
    rates = [s.hit_rate for s, _ in par]
    assert rates == sorted(rates)  # more blocks never lose hits on this workload
    doc = json_document(par, {"x": 1}, "num_blocks")
    assert doc["schema_version"] == SCHEMA_VERSION and [r["sweep_value"] for r in doc["runs"]] == [420, 600, 900]
    for r in doc["runs"]:
        assert sum(r["lost_hit_tokens"].values()) == r["ceiling_hit_tokens"] - r["hit_tokens"]


def test_sweep_on_dask_local_cluster():
    pytest.importorskip("distributed", reason="the cluster extra (distributed) is not installed")
    w = synthetic_workload(20, seed=4)
    cfgs = _configs([450, 2048])
    got = sweep(w, cfgs, cluster="local")
    ref = sweep(w, cfgs, workers=1)
    assert [(s.hit_tokens, v) for s, v in got] == [(s.hit_tokens, v) for s, v in ref]


def test_sweep_validates():
    with pytest.raises(ValueError, match=r"sweep: configs is empty"):
        sweep(synthetic_workload(2), [])
    with pytest.raises(ValueError, match=r"sweep: workers=0, must be an int >= 1"):
        sweep(synthetic_workload(2), _configs([300]), workers=0)


@pytest.mark.skipif(not os.path.isfile(SYNTHETIC), reason=f"Mooncake traces not present at {TRACES}")
def test_cli_sweep_of_six_device_sizes_over_the_synthetic_trace(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    js, png = tmp_path / "s.json", tmp_path / "s.png"
    sizes = "64MiB,96MiB,128MiB,192MiB,256MiB,512MiB"
    code, out, err = run(capsys, "replay", "--trace", SYNTHETIC, "--num-requests", "40", "--page-size", "512",
                         "--device-bytes", sizes, "--num-layers", "1", "--kv-heads", "1", "--head-dim", "32",
                         "--json", str(js), "--plot", str(png), "--no-progress", "--workers", "2")
    assert code == 0, err
    rows = [line for line in out.splitlines() if "MiB" in line and "json" not in line]
    assert len(rows) == 6
    doc = json.loads(js.read_text())
    assert doc["sweep"] == "device_bytes" and len(doc["runs"]) == 6
    assert [r["sweep_value"] for r in doc["runs"]] == [m * 2**20 for m in (64, 96, 128, 192, 256, 512)]
    for r in doc["runs"]:
        assert {"hit_tokens", "ceiling_hit_tokens", "lost_hit_tokens"} <= set(r)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_sweep_errors(capsys):
    code, out, err = run(capsys, "replay", "--num-blocks", "500,600", "--page-size", "16,32", "--no-progress")
    assert code == 2 and err == "kvcache: error: --page-size and --num-blocks are both lists; sweep one option " \
                                "at a time\n"
    code, out, err = run(capsys, "replay", "--num-blocks", "500,500", "--no-progress")
    assert code == 2 and err == "kvcache: error: --num-blocks=500,500: a value is repeated\n"
    code, out, err = run(capsys, "replay", "--cluster", "local", "--no-progress")
    assert code == 2 and "needs a sweep" in err


# --------------------------------------------------------------------------- user habits


def test_ctrl_c_returns_the_summary_so_far(capsys, monkeypatch):
    from kvcache.report import format_table

    w = synthetic_workload(30, seed=1)
    calls = []

    def progress(done, total, step):
        calls.append(step)
        if step == 40:
            raise KeyboardInterrupt

    s = replay(w, ReplayConfig(num_layers=1, kv_heads=1, head_dim=2, backend="kvref", max_inflight=2),
               progress=progress)
    assert s.interrupted and s.steps == 40 and 0 < s.requests < 30
    assert s.lost_hit_total == s.ceiling_hit_tokens - s.hit_tokens  # over the requests admitted so far
    assert "(interrupted: the work done so far)" in format_table(s)

    import kvcache.cli as cli

    real = cli._progress_bar
    monkeypatch.setattr(cli.sys.stderr, "isatty", lambda: True, raising=False)

    def bar(total):
        inner = real(total)

        def call(done, total_, step):
            if step == 30:
                raise KeyboardInterrupt
            inner(done, total_, step)

        call.close = inner.close
        return call

    monkeypatch.setattr(cli, "_progress_bar", bar)
    code, out, err = run(capsys, "replay", "--num-requests", "30", "--num-layers", "1", "--kv-heads", "1",
                         "--head-dim", "2")
    assert code == 130
    assert "prefix hit rate" in out and "interrupted" in out
    assert "kvcache: interrupted; the summary covers the work done so far" in err


def test_plot_to_stdout_and_empty_panels_left_out(capsysbinary):
    pytest.importorskip("matplotlib")
    code = main(["replay", "--num-requests", "4", "--num-blocks", "4096", "--max-inflight", "1",
                 "--num-layers", "1", "--kv-heads", "1", "--head-dim", "2", "--no-progress", "--plot", "-"])
    out, err = capsysbinary.readouterr()
    assert code == 0 and out[:8] == b"\x89PNG\r\n\x1a\n" and b"prefix hit rate" in err
    # nothing lost and no tier: two panels (blocks, hit rate), not four
    from PIL import Image
    import io

    assert Image.open(io.BytesIO(out)).size == (900, 600)
