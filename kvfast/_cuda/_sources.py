"""The ``.cu`` sources of kvfast and the kernel entry points each one defines."""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["KERNEL_DIR", "KERNELS", "ELEM_SUFFIX", "source", "header_sources", "module_code", "entry_name"]

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


def module_code(filename: str) -> str:
    """The text kvfast hands CuPy's ``RawModule`` for one ``.cu`` file: the file, then a comment
    naming the sha256 of every header of ``kvfast/kernels``.

    CuPy caches compiled modules on disk (``~/.cupy/kernel_cache``) keyed by the code text and
    the options, not by the headers an ``#include`` reads through ``-I``: without the comment, a
    changed ``common.cuh`` would keep loading the cubins built from the old one."""
    digest = hashlib.sha256()
    for name, text in header_sources().items():
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    return f"{source(filename)}\n// kvfast headers sha256 {digest.hexdigest()}\n"


def entry_name(base: str, itemsize: int) -> str:
    """``append_kv_kernel`` + 2-byte elements -> ``append_kv_kernel_u16``."""
    try:
        return f"{base}_{ELEM_SUFFIX[itemsize]}"
    except KeyError:
        raise ValueError(f"{base}: itemsize={itemsize}, must be one of {sorted(ELEM_SUFFIX)}") from None
