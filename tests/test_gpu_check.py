"""``kvcache gpu-check`` end to end on the emulated device, tiny sizes (what a lent GPU runs for real)."""

from __future__ import annotations

import json

import pytest

from kvcache import gpu_check
from kvcache.cli import main as cli_main


def test_gpu_check_runs_end_to_end_on_the_emulated_device(emulated, tmp_path, capsys):
    docs = tmp_path / "performance.md"
    docs.write_text(f"# Performance\n\n## GPU\n\n{gpu_check.BEGIN}\nold\n{gpu_check.END}\n\n## Reproduce\n")
    out = tmp_path / "gpu.json"
    rc = cli_main(["gpu-check", "--tiny", "--json", str(out), "--update-docs", str(docs),
                   "--test-paths", "tests/test_kvfast_gpu.py", "--pytest-args", "-k launchers",
                   "--test-timeout", "300"])
    assert rc == 0, capsys.readouterr()
    res = json.loads(out.read_text())
    assert res["emulated"] is True and res["sizes"] == "tiny"
    assert res["tests"]["returncode"] == 0 and res["tests"]["counts"].get("passed", 0) >= 2
    for key in ("append_decode", "append_prefill"):
        a = res[key]
        assert a["bytes"] > 0 and a["kernel_us"] > 0 and a["copy_us"] > 0 and a["ops_us"] > 0
        assert a["kernel_vs_copy"] > 0 and a["kernel_vs_peak"] > 0
    s = res["staging"]
    assert s["read_vs_d2h"] > 0 and s["write_vs_h2d"] > 0 and s["bytes"] > 0
    assert res["prepare_step"]["us"] > 0 and res["manager_step"]["us_per_request"] > 0
    text = docs.read_text()
    assert "old" not in text and "emulated on the CPU" in text and "## Reproduce" in text
    assert text.count(gpu_check.BEGIN) == 1 and text.count(gpu_check.END) == 1


def test_gpu_check_arguments_and_refusals(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="peak_tbps=0.0 <= 0"):
        gpu_check.run_check(peak_tbps=0.0)
    bare = tmp_path / "bare.md"
    bare.write_text("# no markers\n")
    with pytest.raises(ValueError, match="has no '<!-- gpu-check:begin -->'"):
        gpu_check.update_docs(bare, {})
    assert bare.read_text() == "# no markers\n"
    # No GPU and no emulation: a clear refusal, exit code 2.
    monkeypatch.delenv("KVFAST_CUDA_EMULATE", raising=False)
    monkeypatch.setattr("kvcache.cli.gpu_status", lambda: (False, "CuPy is not installed"))
    assert gpu_check.main(["--tiny", "--no-tests"]) == 2
