"""The ``.cu`` sources of kvfast and the kernel entry points each one defines."""

from __future__ import annotations

from pathlib import Path

__all__ = ["KERNEL_DIR", "KERNELS", "ELEM_SUFFIX", "source", "header_sources", "entry_name"]

#: Directory holding the ``.cu`` files and ``common.cuh``.
KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"

#: ``.cu`` file -> kernel base names (each instantiated as ``<name>_u8/_u16/_u32``).
KERNELS: dict[str, tuple[str, ...]] = {
    "append_kv.cu": ("append_kv_kernel",),
    "append_kv_fp8.cu": ("fp8_scale_kernel", "fp8_requant_kernel", "fp8_append_kernel", "fp8_gather_kernel"),
    "gather_kv.cu": ("gather_kv_kernel",),
    "copy_blocks.cu": ("copy_blocks_kernel",),
    "stage.cu": ("stage_gather_kernel", "stage_scatter_kernel"),
    "state.cu": ("state_copy_kernel", "state_zero_kernel"),
    "paged_attention.cu": ("paged_append_kernel", "paged_attention_kernel"),
}

#: Element size in bytes -> entry-point suffix (kernels copy bit patterns).
ELEM_SUFFIX = {1: "u8", 2: "u16", 4: "u32"}


def source(filename: str) -> str:
    """Text of one ``.cu`` file of ``kvfast/kernels``."""
    return (KERNEL_DIR / filename).read_text()


def header_sources() -> dict[str, str]:
    """``{include name: text}`` of the headers the ``.cu`` files include."""
    return {p.name: p.read_text() for p in sorted(KERNEL_DIR.glob("*.cuh"))}


def entry_name(base: str, itemsize: int) -> str:
    """``append_kv_kernel`` + 2-byte elements -> ``append_kv_kernel_u16``."""
    try:
        return f"{base}_{ELEM_SUFFIX[itemsize]}"
    except KeyError:
        raise ValueError(f"{base}: itemsize={itemsize}, must be one of {sorted(ELEM_SUFFIX)}") from None
