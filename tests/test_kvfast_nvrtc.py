"""Every ``kvfast/kernels/*.cu`` compiles with NVRTC for sm_80 and sm_90 (no GPU needed).

NVRTC comes from the ``nvidia-cuda-nvrtc-cu12`` wheel of the ``test`` extra.
When it is missing these tests FAIL (they do not skip): the compile check is
part of CI.
"""

import re

import pytest

from kvfast._cuda._nvrtc import NvrtcError, compile_cu, load_nvrtc, nvrtc_version
from kvfast._cuda._sources import ELEM_SUFFIX, KERNEL_DIR, KERNELS, entry_name

CU_FILES = sorted(KERNELS)


def test_nvrtc_is_installed():
    load_nvrtc()  # raises NvrtcError naming the wheel when absent
    major, _ = nvrtc_version()
    assert major >= 12


def test_every_cu_file_is_listed():
    on_disk = sorted(p.name for p in KERNEL_DIR.glob("*.cu"))
    assert on_disk == CU_FILES


@pytest.mark.parametrize("filename", CU_FILES)
def test_ptx_compute_80_has_every_entry(filename):
    ptx = compile_cu(filename, "compute_80").image.decode()
    entries = set(re.findall(r"\.entry\s+(\w+)", ptx))
    want = {f"{base}_{suf}" for base in KERNELS[filename] for suf in ELEM_SUFFIX.values()}
    assert entries == want
    # 16-byte vectorised copies: the uint4 path lowers to v4.u32 loads/stores.
    assert "v4.u32" in ptx


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("filename", CU_FILES)
def test_cubin_compiles(filename, arch):
    out = compile_cu(filename, arch)
    assert out.image[:4] == b"\x7fELF"
    for base in KERNELS[filename]:
        for size in ELEM_SUFFIX:
            assert entry_name(base, size).encode() in out.image


def test_header_documents_layout_and_launch():
    for filename in CU_FILES:
        head = (KERNEL_DIR / filename).read_text().split("#include", 1)[0]
        assert "Layouts" in head and "Kernels:" in head and "Launch:" in head, filename


def test_compile_error_is_reported(tmp_path, monkeypatch):
    import kvfast._cuda._nvrtc as nv

    monkeypatch.setattr(nv, "source", lambda name: "extern \"C\" __global__ void broken( { }")
    with pytest.raises(NvrtcError, match="failed"):
        nv.compile_cu("broken.cu", "sm_80")


def test_entry_name_rejects_unknown_itemsize():
    with pytest.raises(ValueError, match=r"itemsize=8"):
        entry_name("append_kv_kernel", 8)
