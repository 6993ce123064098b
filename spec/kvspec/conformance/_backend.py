"""The ``Backend`` contract: how a kvcache implementation plugs into the suite.

A backend package exposes a *factory*: a zero-argument callable returning a
:class:`Backend`. The suite finds it through ``--kv-backend=module:factory``,
``--kv-backend=NAME`` (an entry point of the ``kvcache.backends`` group) or the
``KVCACHE_BACKEND`` environment variable, and builds every object it tests
through the backend's constructors, comparing each step with ``kvref``.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, ContextManager

from .._config import parse_device

__all__ = ["Backend", "CAPABILITIES", "ENTRY_POINT_GROUP", "ENV_BACKEND", "resolve_backend", "backend_names", "spec_of"]

#: The ``resolve_backend`` spec each backend name was built from (for reproductions).
_SPECS: dict[str, str] = {}


def spec_of(backend: "Backend") -> str:
    """The spec ``resolve_backend`` built ``backend`` from (``""`` when it was built otherwise)."""
    return _SPECS.get(backend.name, "")

#: Entry-point group in which packages register backend factories.
ENTRY_POINT_GROUP = "kvcache.backends"

#: Environment variable read when ``--kv-backend`` is not given.
ENV_BACKEND = "KVCACHE_BACKEND"

#: Every capability a backend may declare, with what declaring it promises.
CAPABILITIES: dict[str, str] = {
    "contiguous": "make_cache builds KVCacheMode.CONTIGUOUS caches",
    "paged": "make_cache builds KVCacheMode.PAGED caches (reserve/admit/retire, prefix reuse)",
    "state": "KVLayerSpec.state layers (conv and recurrent slabs, checkpoints on admit/retire)",
    "cross": "KVLayerSpec.cross_attention layers (fill, cross planes)",
    "sliding_window": "KVLayerSpec.sliding_window layers in the slot cache",
    "manager": "make_manager builds a PagedKVCacheManager",
    "tiers": "the manager accepts connector= and drives it (load, offload, publish on landing)",
    "replicas": "the manager supports data_parallel_degree > 1",
    "prefix_caching": "the manager's prefix cache (hits, publish at step, twin dedup)",
    "recurrent_leaf": "manager leaves of LeafKind.RECURRENT",
    "strict_block_ids": "block ids and free order equal kvref's (spec/slot-cache.md); exposes _free_order()",
    "invariants": "objects have check_invariants() raising AssertionError",
    "slot_fp8": "slot caches with dtype float8_e4m3fn / float8_e5m2: scales(layer), quantising append_kv "
                "(spec/slot-cache.md §10)",
    "slot_spec_decode": "slot-cache checkpoint_state / restore_state / state_checkpoint_position "
                        "(spec/slot-cache.md §11)",
    "spec_decode": "the manager's speculative decoding: KVCacheParams.num_draft_tokens, spec_decoding_state "
                   "(spec/manager.md §15)",
    "fp8_kv": "the manager's FP8 pages with per-page scales: get_device_scales_buffer, scale runtime inputs "
              "(spec/manager.md §16)",
    "attention_options": "ops.varlen_attention and ops.paged_attention take softcap= and sinks= "
                         "(spec/slot-cache.md §7.3)",
}


def _fmt_caps(caps) -> str:
    return ", ".join(sorted(caps)) or "(none)"


@dataclass(frozen=True)
class Backend:
    """A kvcache implementation under test.

    Parameters
    ----------
    name : str
        Short name shown in the report header.
    version : str
        The implementation's version string.
    make_cache : callable(config, layer_specs) -> KVCache, optional
        Builds a slot cache (``KVCache.make``); required when ``"contiguous"``
        or ``"paged"`` is declared.
    make_manager : callable(params, *, num_blocks, max_batch_size, max_seq_len, device="cpu", connector=None, clock=None), optional
        Builds a ``PagedKVCacheManager``; required when ``"manager"`` is declared.
    ops : module, optional
        Provides ``append_kv``, ``gather_kv`` and ``varlen_attention`` (see
        ``spec/slot-cache.md``) for the backend's caches. Without it the suite writes K/V
        through ``StepIndices.slot_mapping`` into the live ``keys()``/``values()``
        views and skips the attention tests.
    capabilities : frozenset of str
        Subset of :data:`CAPABILITIES`; tests needing an undeclared one skip.
    devices : tuple of str
        Devices the backend runs on (``"cpu"``, ``"cuda:0"``). The suite builds
        its objects on the first (``device``); the plugin puts ``"cpu"`` first
        unless ``--kv-device`` picks another. Inputs (K/V, queries) are host
        NumPy arrays on every device.
    collide_hashes : callable() -> context manager, optional
        While the context is active, the backend's block hash ignores the
        block's tokens (``h_i = H(h_{i-1})``), so every prompt collides with
        every other at each depth. The collision test uses it to prove that
        hits verify stored tokens (spec/hashing.md). Without it that test skips.

    Raises
    ------
    ValueError
        An unknown capability, a bad device, or a declared API without its
        constructor.
    TypeError
        A field of the wrong type.
    """

    name: str
    version: str
    make_cache: Callable[..., Any] | None = None
    make_manager: Callable[..., Any] | None = None
    ops: ModuleType | Any | None = None
    capabilities: frozenset = frozenset()
    devices: tuple = ("cpu",)
    collide_hashes: Callable[[], ContextManager] | None = None

    def __post_init__(self):
        o = "Backend"
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"{o}: name={self.name!r}, must be a non-empty str")
        if not isinstance(self.version, str):
            raise TypeError(f"{o}: version={self.version!r}, must be a str")
        caps = frozenset(self.capabilities)
        for c in sorted(caps):
            if c not in CAPABILITIES:
                raise ValueError(f"{o}: capabilities has {c!r}, must be one of {sorted(CAPABILITIES)}")
        object.__setattr__(self, "capabilities", caps)
        devices = tuple(self.devices)
        if not devices:
            raise ValueError(f"{o}: devices=(), must name at least one device")
        for i, d in enumerate(devices):
            parse_device(f"{o}: devices[{i}]", d)
        object.__setattr__(self, "devices", devices)
        if caps & {"contiguous", "paged"} and not callable(self.make_cache):
            raise ValueError(f"{o}: make_cache={self.make_cache!r} but capabilities declare a slot cache")
        if "manager" in caps and not callable(self.make_manager):
            raise ValueError(f"{o}: make_manager={self.make_manager!r} but capabilities declare 'manager'")
        for fn in ("append_kv", "gather_kv", "varlen_attention"):
            if self.ops is not None and not callable(getattr(self.ops, fn, None)):
                raise ValueError(f"{o}: ops={self.ops!r} has no callable {fn}")
        if self.collide_hashes is not None and not callable(self.collide_hashes):
            raise TypeError(f"{o}: collide_hashes={self.collide_hashes!r}, must be callable or None")

    @property
    def device(self) -> str:
        """The device the suite builds objects on (the first of ``devices``)."""
        return self.devices[0]

    def build_cache(self, config, layer_specs):
        """``make_cache`` with ``config.device`` set to :attr:`device`."""
        import dataclasses

        return self.make_cache(dataclasses.replace(config, device=self.device), layer_specs)

    def build_manager(self, params, **kw):
        """``make_manager(params, device=self.device, **kw)``."""
        return self.make_manager(params, device=self.device, **kw)

    def on_device(self, device: str) -> "Backend":
        """This backend with ``device`` first in ``devices`` (``ValueError`` if not declared)."""
        import dataclasses

        if device not in self.devices:
            raise ValueError(f"Backend.on_device: device={device!r} not in devices={self.devices}")
        return dataclasses.replace(self, devices=(device, *[d for d in self.devices if d != device]))

    def supports(self, *caps: str) -> bool:
        """True when every capability in ``caps`` is declared."""
        return all(c in self.capabilities for c in caps)

    def missing(self, *caps: str) -> list[str]:
        """The capabilities of ``caps`` that are not declared."""
        return [c for c in caps if c not in self.capabilities]

    def describe(self) -> str:
        """One line for the report header."""
        return (
            f"kvcache backend: {self.name} {self.version}; capabilities: {_fmt_caps(self.capabilities)}; "
            f"devices: {', '.join(self.devices)}; ops: {'yes' if self.ops is not None else 'no'}"
        )


def backend_names() -> dict[str, str]:
    """``{name: "module:attr"}`` of the factories registered in :data:`ENTRY_POINT_GROUP`."""
    from importlib.metadata import entry_points

    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _load_target(target: str):
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"resolve_backend: backend={target!r}, must be 'module:factory' or a registered name")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def resolve_backend(spec: str | None = None) -> Backend:
    """Build the backend named by ``spec``.

    Parameters
    ----------
    spec : str, optional
        ``"module:factory"`` (a callable returning a ``Backend``, or a
        ``Backend`` instance), or the name of a ``kvcache.backends`` entry
        point. Default: ``$KVCACHE_BACKEND``, else ``"kvref"``.

    Returns
    -------
    Backend

    Raises
    ------
    ValueError
        An unknown name (the message lists the registered ones).
    TypeError
        The factory did not return a ``Backend``.
    """
    if spec is None:
        spec = os.environ.get(ENV_BACKEND) or "kvref"
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"resolve_backend: backend={spec!r}, must be a non-empty str")
    if ":" in spec:
        target = spec
    else:
        names = backend_names()
        if spec not in names:
            raise ValueError(
                f"resolve_backend: backend={spec!r} is not registered in {ENTRY_POINT_GROUP!r} "
                f"(registered: {sorted(names)}); use module:factory"
            )
        target = names[spec]
    obj = _load_target(target)
    backend = obj() if callable(obj) and not isinstance(obj, Backend) else obj
    if not isinstance(backend, Backend):
        raise TypeError(f"resolve_backend: {target} returned {type(backend).__name__}, must return a kvspec.conformance.Backend")
    _SPECS[backend.name] = spec
    return backend


class BackendBound:
    """Mixin of the comparison state machines: ``for_backend`` binds a backend
    (and the ``kvref`` oracle) into a runnable subclass; the unbound class refuses to run."""

    backend: Backend | None = None
    oracle: Backend | None = None

    @classmethod
    def for_backend(cls, backend: Backend, oracle: Backend | None = None) -> type:
        """A runnable subclass bound to ``backend`` (and ``oracle``, default kvref)."""
        if not isinstance(backend, Backend):
            raise TypeError(f"{cls.__name__}.for_backend: backend={backend!r}, must be a kvspec.conformance.Backend")
        if oracle is None:
            import kvref

            oracle = kvref.conformance_backend()
        return type(f"{cls.__name__}_{backend.name}", (cls,), {"backend": backend, "oracle": oracle})

    def _require_backend(self) -> None:
        if self.backend is None:
            name = type(self).__name__
            raise TypeError(f"{name}: use {name}.for_backend(backend)")
