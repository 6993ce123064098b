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
    "to_numpy", "attention_atol", "assert_same", "Outcome", "capture", "assert_same_outcome", "data_ptr", "describe_exc",
    "config_source", "specs_source", "params_source", "array_source",
    "begin_reproduction", "record", "reproduction", "Reproduction",
]


def attention_atol(values) -> float:
    """spec/slot-cache.md §7.3: the absolute part of two engines' agreement on attention,
    ``1e-5 * max(1, |v|max)`` over ``values`` (the arrays of V the step's queries see; the
    relative part is 1e-5)."""
    return 1e-5 * max(1.0, max(float(np.abs(v).max()) for v in values))


def to_numpy(x) -> np.ndarray:
    """A host NumPy copy of ``x`` (NumPy, CuPy, or anything with ``__array__``/DLPack)."""
    if isinstance(x, np.ndarray):
        return x
    get = getattr(x, "get", None)
    if callable(get) and type(x).__module__.startswith("cupy"):  # pragma: no cover - GPU only
        return get()
    return np.asarray(x)


def to_device(x):
    """``cupy.asarray`` of host data for a CUDA backend's buffers; bfloat16 travels as its
    uint16 bit patterns (CuPy has no bfloat16; spec/types.md)."""
    import cupy

    x = np.asarray(x)
    return cupy.asarray(x.view(np.uint16) if x.dtype.name == "bfloat16" else x)


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
    Python ones. While a state machine records a reproduction
    (:func:`begin_reproduction`), the error carries it as ``kv_repro``.

    Parameters
    ----------
    ref : Any
        kvref's value.
    got : Any
        The backend's value.
    where : str
        What is compared (names the comparison in the message).

    Raises
    ------
    AssertionError
        The first difference, ``"<where>: <backend value>, kvref gives <value>"``.
    """
    __tracebackhide__ = True
    try:
        _assert_same(ref, got, where)
    except AssertionError as e:
        _attach(e, ("same", where))
        raise


def _assert_same(ref: Any, got: Any, where: str) -> None:
    __tracebackhide__ = True
    if _is_array(ref) or _is_array(got):
        if not (_is_array(ref) and _is_array(got)):
            raise AssertionError(f"{where}: kvref gave {type(ref).__name__}, backend gave {type(got).__name__}")
        a, b = to_numpy(ref), to_numpy(got)
        if a.dtype.name == "bfloat16" and b.dtype == np.uint16:
            b = b.view(a.dtype)  # spec/types.md: CuPy has no bfloat16; a CUDA backend hands out its uint16 bit patterns
        elif a.dtype.name in ("float8_e4m3fn", "float8_e5m2") and b.dtype == np.uint8:
            b = b.view(a.dtype)  # spec/manager.md §16.1: a CUDA buffer holds FP8 as its uint8 bit patterns
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
            _assert_same(getattr(ref, f.name), getattr(got, f.name, _MISSING), f"{where}.{f.name}")
        return
    if isinstance(ref, dict):
        if not isinstance(got, dict):
            raise AssertionError(f"{where}: {type(got).__name__}, kvref gives dict")
        if list(ref) != list(got) and set(ref) != set(got):
            raise AssertionError(f"{where}: keys {sorted(map(str, got))}, kvref has {sorted(map(str, ref))}")
        for k in ref:
            _assert_same(ref[k], got[k], f"{where}[{k!r}]")
        return
    if isinstance(ref, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(ref) != len(got):
            raise AssertionError(f"{where}: {got!r}, kvref gives {ref!r}")
        for i, (a, b) in enumerate(zip(ref, got)):
            _assert_same(a, b, f"{where}[{i}]")
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


def capture(fn: Callable[[], Any], source: str | None = None, values: dict | None = None) -> Outcome:
    """Run ``fn``; return its value or the ``Exception`` it raised (never swallows
    ``KeyboardInterrupt`` or ``AssertionError`` from a backend's own checks).

    Parameters
    ----------
    fn : callable() -> Any
        The call.
    source : str, optional
        The call as Python source (``"cache.update_position(0, 3)"``, or an
        assignment ``"step = cache.prepare_step(...)"``). When given, the call
        joins the reproduction being recorded (:func:`begin_reproduction`),
        wrapped in ``try``/``except`` when it raised. Give it on one side only
        (the backend's call).
    values : dict of str -> ndarray, optional
        Arrays the source names (``{"k": k, "v": v}``), written into the
        reproduction before the call.

    Returns
    -------
    Outcome
    """
    __tracebackhide__ = True
    try:
        out = Outcome(value=fn())
    except AssertionError:
        raise
    except Exception as e:  # noqa: BLE001 - the comparison is the point
        out = Outcome(exc=e)
    if source is not None:
        record(source, _raised=out.exc, **(values or {}))
    return out


def describe_exc(e: BaseException) -> str:
    """``"Type('message')"``: how the messages name an exception."""
    return f"{type(e).__name__}({str(e)!r})"


def assert_same_outcome(label: str, ref: Outcome, got: Outcome) -> None:
    """Same value, or same exception type and message.

    Parameters
    ----------
    label : str
        The call, as Python source (names the comparison in the message).
    ref, got : Outcome
        kvref's and the backend's outcome of the call.

    Raises
    ------
    AssertionError
        The outcomes differ; carries ``kv_repro`` while a reproduction is recorded.
    """
    __tracebackhide__ = True
    try:
        if ref.raised or got.raised:
            if not ref.raised:
                raise AssertionError(f"{label}: backend raised {describe_exc(got.exc)}, kvref returned {ref.value!r}")
            if not got.raised:
                raise AssertionError(f"{label}: backend returned {got.value!r}, kvref raised {describe_exc(ref.exc)}")
            if type(ref.exc) is not type(got.exc):
                raise AssertionError(f"{label}: backend raised {describe_exc(got.exc)}, kvref raised {describe_exc(ref.exc)}")
            if str(ref.exc) != str(got.exc):
                raise AssertionError(f"{label}: message {str(got.exc)!r}, kvref says {str(ref.exc)!r}")
            return
        _assert_same(ref.value, got.value, label)
    except AssertionError as e:
        _attach(e, ("outcome", label), force=True)
        raise


# ---------------------------------------------------------------- Python source of the calls


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
    if params.num_draft_tokens:  # spec/manager.md §15: only when speculating, so older reproductions read the same
        parts += [f"speculative_method={params.speculative_method!r}", f"num_draft_tokens={params.num_draft_tokens}"]
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


def array_source(a) -> str:
    """An array as Python source that rebuilds it bit for bit.

    Finite float and integer arrays print as ``np.array([...], dtype="float16")``
    (every value round-trips exactly); others (NaN, infinities, exotic dtypes)
    as ``np.frombuffer(bytes.fromhex("..."), ...)``.
    """
    a = np.ascontiguousarray(to_numpy(a))
    name = a.dtype.name
    if a.dtype.kind in "iub" or (a.dtype.kind == "f" and name in ("float16", "float32", "float64")
                                 and bool(np.isfinite(a).all())):
        return f'np.array({a.tolist()!r}, dtype="{name}")'
    if name == "bfloat16" and bool(np.isfinite(a.astype(np.float32)).all()):
        return f'np.array({a.astype(np.float32).tolist()!r}, dtype="float32").astype(ml_dtypes.bfloat16)'
    dt = f"ml_dtypes.{name}" if name not in np.sctypeDict else f'"{name}"'
    return f"np.frombuffer(bytes.fromhex({a.tobytes().hex()!r}), dtype={dt}).reshape({a.shape!r}).copy()"


class Reproduction:
    """A state machine's example, recorded as a Python script (one per example).

    The machines call :func:`begin_reproduction` when they build their objects,
    then every call goes through :func:`capture` (``source=``) or
    :func:`record`; a failing :func:`assert_same` or :func:`assert_same_outcome`
    renders the script with :meth:`render` and attaches it to the error as
    ``kv_repro``. The script runs the recorded calls on kvref and on the
    backend, then repeats the comparison that failed.

    Parameters
    ----------
    kind : {"cache", "manager"}
        What the example builds.
    setup : list of str
        Source lines that define ``config`` and ``specs`` (cache) or ``params``,
        ``kw`` and ``use_connector`` (manager).
    backend : Backend
        The backend under test (its ``resolve_backend`` spec and device are printed).
    """

    def __init__(self, kind: str, setup: list[str], backend) -> None:
        if kind not in ("cache", "manager"):
            raise ValueError(f"Reproduction: kind={kind!r}, must be 'cache' or 'manager'")
        self.kind = kind
        self.setup = list(setup)
        self.backend = backend
        #: (source, values, exception or None) per call, in order.
        self.calls: list[tuple[str, dict, BaseException | None]] = []

    def add(self, source: str, values: dict, raised: BaseException | None = None) -> None:
        """Append one call (``raised``: the exception it raised, wrapped in ``try``)."""
        self.calls.append((source, dict(values), raised))

    # ------------------------------------------------------------ rendering

    def _header(self) -> list[str]:
        from ._backend import spec_of

        b = self.backend
        spec = spec_of(b)
        lines = [
            "# kvcache conformance reproduction: save as repro.py and run `python repro.py`",
            "# in the directory you ran pytest from; the last statement fails as the suite did.",
            "import os, sys",
            "sys.path.insert(0, os.getcwd())",
            "import numpy as np",
            "import ml_dtypes",
            "from kvspec import *",
            "from kvspec.conformance import resolve_backend",
            "from kvspec.conformance._compare import assert_same, assert_same_outcome, capture",
        ]
        if self.kind == "cache":
            lines.append("from kvspec.conformance.machine import cache_snapshot, live_kv, scatter_kv")
            lines.append("from kvspec.conformance._harness import write_step")
        else:
            lines.append("from kvspec.conformance._harness import ManualConnector")
            lines.append("from kvspec.conformance.manager_machine import manager_snapshot, write_forward")
        lines += [
            "",
            f"backend = resolve_backend({spec!r}).on_device({b.device!r})"
            + ("" if spec else "  # put your module:factory here"),
            'oracle = resolve_backend("kvref")',
            f"strict = {b.supports('strict_block_ids')!r}  # backend declares strict_block_ids",
            *self.setup,
            "",
        ]
        return lines

    @staticmethod
    def _stmt(source: str, values: dict, raised, indent: str) -> list[str]:
        out = [f"{indent}{name} = {array_source(arr)}" for name, arr in values.items()]
        if raised is None:
            out.append(f"{indent}{source}")
        else:
            out += [f"{indent}try:", f"{indent}    {source}",
                    f"{indent}except {type(raised).__name__}:",
                    f"{indent}    pass  # raised {describe_exc(raised)[:160]}"]
        return out

    @staticmethod
    def _expr(source: str) -> str:
        head, sep, rest = source.partition(" = ")
        return rest if sep and head.replace("_", "").isalnum() and "(" not in head else source

    def render(self, failing: tuple[str, str] | None = None) -> str:
        """The script: header, ``run`` (every call), both runs, the failing comparison.

        Parameters
        ----------
        failing : (str, str), optional
            ``("outcome", label)``: the last call's outcomes differ;
            ``("same", where)``: the comparison ``where`` of observable state
            failed. None: no comparison (the script stops after the calls).
        """
        obj = "cache" if self.kind == "cache" else "manager"
        arg2 = "ops" if self.kind == "cache" else "connector"
        calls = list(self.calls)
        last = None
        mode, what = failing if failing else (None, "")
        if mode == "outcome" or (mode == "same" and "state changed after" in what):
            if calls:
                last = calls.pop()
        lines = self._header()
        lines.append(f"def run({obj}, {arg2}):")
        if self.kind == "cache" and self.backend.ops is None:
            lines += ["    if ops is None:  # the backend ships no ops: the suite writes through slot_mapping",
                      "        import types",
                      "        ops = types.SimpleNamespace(append_kv=scatter_kv)"]
        for src, vals, raised in calls:
            lines += self._stmt(src, vals, raised, "    ")
        snap = ("cache_snapshot(cache, specs, free_order=strict and config.mode is KVCacheMode.PAGED)"
                if self.kind == "cache" else
                "manager_snapshot(manager, {k[4:]: v for k, v in locals().items() if k.startswith('ctx_')}, strict=strict)")
        if last is not None and mode == "outcome":
            src, vals, _ = last
            lines += [f"    {n} = {array_source(a)}" for n, a in vals.items()]
            lines.append(f"    return capture(lambda: {self._expr(src)})")
        elif last is not None:
            src, vals, raised = last
            lines.append(f"    before = {snap}")
            lines += self._stmt(src, vals, raised or Exception(), "    ")
            lines.append(f"    return before, {snap}")
        else:
            lines.append("    return locals()")
        lines.append("")
        if self.kind == "cache":
            lines += ["ref = run(oracle.make_cache(config, specs), oracle.ops)",
                      "got = run(backend.build_cache(config, specs), backend.ops)"]
        else:
            lines += ["conn_ref, conn_got = (ManualConnector(), ManualConnector()) if use_connector else (None, None)",
                      "ref = run(oracle.make_manager(params, connector=conn_ref, **kw), conn_ref)",
                      "got = run(backend.build_manager(params, connector=conn_got, **kw), conn_got)"]
        lines += self._comparison(mode, what, obj, last is not None)
        return "\n".join(lines) + "\n"

    def _comparison(self, mode, what: str, obj: str, popped: bool) -> list[str]:
        import re

        if mode is None:
            return []
        if mode == "outcome":
            return ([f"assert_same_outcome({what!r}, ref, got)"] if popped else
                    [f"# the failing call ({what}) was not recorded"])
        if popped:  # state changed after a raise
            return [f"assert_same(got[0], got[1], {what!r})"]
        m = re.fullmatch(r"([KV]) of layer (\d+) slot (\d+) positions (\[[\d, ]*\])", what)
        if m and self.kind == "cache":
            side, l, s, pos = m.group(1), m.group(2), m.group(3), m.group(4)
            i = 0 if side == "K" else 1
            return [f"n = int(ref['cache'].seq_lens()[{s}])",
                    f"assert_same(live_kv(ref['cache'], {l}, {s}, n)[{i}][{pos}], "
                    f"live_kv(got['cache'], {l}, {s}, n)[{i}][{pos}], {what!r})"]
        m = re.fullmatch(r"(\w+\([\d, ]*\))( != 0)?", what)
        if m and self.kind == "cache":
            expr = m.group(1)
            wrap = (lambda e: f"np.asarray({e}) != 0") if m.group(2) else (lambda e: f"{e}" if expr != "_free_order()" else f"list({e})")
            return [f"assert_same({wrap(f'ref[{obj!r}].{expr}')}, {wrap(f'got[{obj!r}].{expr}')}, {what!r})"]
        if self.kind == "manager":
            snap = "manager_snapshot(r['manager'], {k[4:]: v for k, v in r.items() if k.startswith('ctx_')}, strict=strict)"
            return [f"state = [{snap} for r in (ref, got)]", f"assert_same(state[0], state[1], {what!r})"]
        return ["free = strict and config.mode is KVCacheMode.PAGED",
                "assert_same(cache_snapshot(ref['cache'], specs, free_order=free), "
                f"cache_snapshot(got['cache'], specs, free_order=free), {what!r})"]


_SCRIPT: Reproduction | None = None


def begin_reproduction(kind: str, backend, **setup) -> None:
    """Start recording a new example's reproduction (the previous one is dropped).

    Parameters
    ----------
    kind : {"cache", "manager"}
    backend : Backend
        The backend under test.
    **setup
        ``config=``, ``specs=`` (cache) or ``params=``, ``kw=``,
        ``connector=`` (bool; manager): the objects the example builds.
    """
    global _SCRIPT
    if kind == "cache":
        lines = [f"config = {config_source(setup['config'])}", f"specs = {specs_source(setup['specs'])}"]
    elif kind == "manager":
        lines = [f"params = {params_source(setup['params'])}", f"kw = {setup['kw']!r}",
                 f"use_connector = {bool(setup.get('connector'))!r}"]
    else:
        raise ValueError(f"begin_reproduction: kind={kind!r}, must be 'cache' or 'manager'")
    _SCRIPT = Reproduction(kind, lines, backend)


def end_reproduction() -> None:
    """Stop recording (the plugin calls it before each test)."""
    global _SCRIPT
    _SCRIPT = None


def record(source: str, _raised: BaseException | None = None, **values) -> None:
    """Record one statement of the current reproduction (no-op when none is recorded).

    Parameters
    ----------
    source : str
        Python source run on each side (``cache``/``ops`` or ``manager``/``ctx_*``/``connector``).
    **values : ndarray
        Arrays the statement names, defined just before it.
    """
    if _SCRIPT is not None:
        _SCRIPT.add(source, values, _raised)


def reproduction(failing: tuple[str, str] | None = None) -> str | None:
    """The current reproduction rendered (see :meth:`Reproduction.render`), or None."""
    return None if _SCRIPT is None else _SCRIPT.render(failing)


#: Called once with the message of the first failure a test finds (the plugin warns that shrinking starts).
_ON_FIRST_FAILURE: Callable[[str], None] | None = None


def _attach(e: BaseException, failing: tuple[str, str], force: bool = False) -> None:
    global _ON_FIRST_FAILURE
    if _ON_FIRST_FAILURE is not None:
        hook, _ON_FIRST_FAILURE = _ON_FIRST_FAILURE, None
        hook(str(e))
    if _SCRIPT is None or (getattr(e, "kv_repro", None) and not force):
        return
    try:
        e.kv_repro = _SCRIPT.render(failing)
    except Exception as err:  # noqa: BLE001 - a rendering bug must not hide the failure
        e.kv_repro = f"# reproduction could not be rendered: {describe_exc(err)}"
