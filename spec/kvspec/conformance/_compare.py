"""Outcome comparison shared by the state machines, the method tests and the vectors.

One rule for every comparison: a call on the backend and the same call on
``kvref`` must give the same *outcome*, either equal values (arrays: same
dtype, shape and bytes) or the same exception type with the same message;
after a raise, each side's observable state must be what it was before.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable

import numpy as np

__all__ = [
    "to_numpy", "assert_same", "Outcome", "capture", "assert_same_outcome", "data_ptr", "describe_exc",
    "config_source", "specs_source", "params_source",
]


def to_numpy(x) -> np.ndarray:
    """A host NumPy copy of ``x`` (NumPy, CuPy, or anything with ``__array__``/DLPack)."""
    if isinstance(x, np.ndarray):
        return x
    get = getattr(x, "get", None)
    if callable(get) and type(x).__module__.startswith("cupy"):  # pragma: no cover - GPU only
        return get()
    return np.asarray(x)


def data_ptr(x) -> int:
    """Address of the first element of an array (NumPy or CuPy): buffer identity."""
    if isinstance(x, np.ndarray):
        return int(x.__array_interface__["data"][0])
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:  # pragma: no cover - GPU only
        return int(cai["data"][0])
    return int(np.asarray(x).__array_interface__["data"][0])


def _is_array(x) -> bool:
    if isinstance(x, np.generic):
        return False
    return isinstance(x, np.ndarray) or hasattr(x, "__cuda_array_interface__") or (
        hasattr(x, "__array__") and hasattr(x, "dtype") and hasattr(x, "shape")
    )


def assert_same(ref: Any, got: Any, where: str = "value") -> None:
    """Assert ``got`` equals ``ref`` exactly; ``AssertionError`` names the first difference.

    Arrays compare dtype, shape and raw bytes (so ``-0.0`` vs ``0.0`` and NaN
    payloads count); dataclasses field by field; mappings by keys then values;
    sequences element-wise; scalars with ``==`` after NumPy scalars become
    Python ones.
    """
    if _is_array(ref) or _is_array(got):
        if not (_is_array(ref) and _is_array(got)):
            raise AssertionError(f"{where}: kvref gave {type(ref).__name__}, backend gave {type(got).__name__}")
        a, b = to_numpy(ref), to_numpy(got)
        if a.dtype != b.dtype:
            raise AssertionError(f"{where}: dtype={b.dtype}, kvref has {a.dtype}")
        if a.shape != b.shape:
            raise AssertionError(f"{where}: shape={b.shape}, kvref has {a.shape}")
        if np.ascontiguousarray(a).tobytes() != np.ascontiguousarray(b).tobytes():
            flat, count = _first_diff(a, b)
            idx = tuple(int(i) for i in np.unravel_index(flat, a.shape)) if a.ndim else ()
            raise AssertionError(
                f"{where}: differs at index {idx} ({count} of {a.size} elements differ): "
                f"backend {b[idx]!r}, kvref {a[idx]!r}"
            )
        return
    if dataclasses.is_dataclass(ref) and not isinstance(ref, type):
        if type(ref) is not type(got) and type(ref).__name__ != type(got).__name__:
            raise AssertionError(f"{where}: type {type(got).__name__}, kvref gives {type(ref).__name__}")
        for f in dataclasses.fields(ref):
            assert_same(getattr(ref, f.name), getattr(got, f.name, _MISSING), f"{where}.{f.name}")
        return
    if isinstance(ref, dict):
        if not isinstance(got, dict):
            raise AssertionError(f"{where}: {type(got).__name__}, kvref gives dict")
        if list(ref) != list(got) and set(ref) != set(got):
            raise AssertionError(f"{where}: keys {sorted(map(str, got))}, kvref has {sorted(map(str, ref))}")
        for k in ref:
            assert_same(ref[k], got[k], f"{where}[{k!r}]")
        return
    if isinstance(ref, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(ref) != len(got):
            raise AssertionError(f"{where}: {got!r}, kvref gives {ref!r}")
        for i, (a, b) in enumerate(zip(ref, got)):
            assert_same(a, b, f"{where}[{i}]")
        return
    if isinstance(ref, enum.Enum) or isinstance(got, enum.Enum):
        if getattr(ref, "name", ref) != getattr(got, "name", got):
            raise AssertionError(f"{where}: {got!r}, kvref gives {ref!r}")
        return
    a = ref.item() if isinstance(ref, np.generic) else ref
    b = got.item() if isinstance(got, np.generic) else got
    if type(a) is bool or type(b) is bool:
        ok = type(a) is type(b) and a == b
    else:
        ok = a == b
    if not ok:
        raise AssertionError(f"{where}: {b!r}, kvref gives {a!r}")


_MISSING = object()


def _first_diff(a: np.ndarray, b: np.ndarray) -> tuple[int, int]:
    """Flat index of the first element whose bytes differ, and how many differ."""
    n = max(a.size, 1)
    av = np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape(n, -1)
    bv = np.ascontiguousarray(b).reshape(-1).view(np.uint8).reshape(n, -1)
    bad = np.flatnonzero((av != bv).any(axis=1))
    return (int(bad[0]) if bad.size else 0), int(bad.size)


@dataclasses.dataclass
class Outcome:
    """The result of one call: ``value``, or the exception it raised."""

    value: Any = None
    exc: BaseException | None = None

    @property
    def raised(self) -> bool:
        return self.exc is not None


def capture(fn: Callable[[], Any]) -> Outcome:
    """Run ``fn``; return its value or the ``Exception`` it raised (never swallows
    ``KeyboardInterrupt`` or ``AssertionError`` from a backend's own checks)."""
    try:
        return Outcome(value=fn())
    except AssertionError:
        raise
    except Exception as e:  # noqa: BLE001 - the comparison is the point
        return Outcome(exc=e)


def describe_exc(e: BaseException) -> str:
    return f"{type(e).__name__}({str(e)!r})"


def assert_same_outcome(label: str, ref: Outcome, got: Outcome) -> None:
    """Same value, or same exception type and message."""
    if ref.raised or got.raised:
        if not ref.raised:
            raise AssertionError(f"{label}: backend raised {describe_exc(got.exc)}, kvref returned {ref.value!r}") from got.exc
        if not got.raised:
            raise AssertionError(f"{label}: backend returned {got.value!r}, kvref raised {describe_exc(ref.exc)}")
        if type(ref.exc) is not type(got.exc):
            raise AssertionError(f"{label}: backend raised {describe_exc(got.exc)}, kvref raised {describe_exc(ref.exc)}")
        if str(ref.exc) != str(got.exc):
            raise AssertionError(f"{label}: message {str(got.exc)!r}, kvref says {str(ref.exc)!r}")
        return
    assert_same(ref.value, got.value, label)


# ---------------------------------------------------------------- Python source for note()


def config_source(cfg) -> str:
    """``KVCacheConfig(...)`` as Python source (enums by name)."""
    parts = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        parts.append(f"{f.name}={type(v).__name__}.{v.name}" if isinstance(v, enum.Enum) else f"{f.name}={v!r}")
    return f"KVCacheConfig({', '.join(parts)})"


def specs_source(specs) -> str:
    """A list of ``KVLayerSpec`` constructor calls as Python source."""
    out = []
    for sp in specs:
        kind = sp.kind.name
        if kind == "ATTENTION":
            out.append(f"KVLayerSpec.attention({sp.kv_heads}, {sp.head_dim})")
        elif kind == "SLIDING_WINDOW":
            out.append(f"KVLayerSpec.sliding_window({sp.kv_heads}, {sp.head_dim}, {sp.window})")
        elif kind == "CROSS_ATTENTION":
            out.append(f"KVLayerSpec.cross_attention({sp.kv_heads}, {sp.head_dim}, {sp.max_enc_len})")
        else:
            out.append(f"KVLayerSpec.state({sp.conv_dims!r}, {sp.conv_width}, {sp.recurrent!r})")
    return f"[{', '.join(out)}]"


def params_source(params) -> str:
    """``KVCacheParams(...)`` as Python source (leaves as ``LeafSpec`` constructors)."""
    fields = ("page_size", "num_layers", "kv_heads", "head_dim", "dtype", "data_parallel_degree",
              "enable_prefix_caching", "hash_algo", "hash_seed")
    parts = [f"{f}={getattr(params, f)!r}" for f in fields]
    leaves = []
    for lid, leaf in params.leaves().items():
        kind = leaf.kind.name
        if kind == "FULL":
            leaves.append(f"{lid!r}: LeafSpec.full()")
        elif kind == "SLIDING_WINDOW":
            leaves.append(f"{lid!r}: LeafSpec.sliding_window({leaf.window})")
        else:
            leaves.append(f"{lid!r}: LeafSpec.recurrent({leaf.state_shape!r}, {leaf.state_dtype!r})")
    parts.append(f"leaves={{{', '.join(leaves)}}}")
    return f"KVCacheParams({', '.join(parts)})"
