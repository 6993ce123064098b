"""Helpers shared by the broken backends."""

from __future__ import annotations

import dataclasses

import kvref
from kvref._block_pool import BlockPool


def backend_like_kvref(name: str, *, cache_cls=None, manager_cls=None, **changes):
    """kvref's ``Backend`` with the cache and/or manager class replaced.

    The name says which bug the backend carries; everything else (capabilities,
    ops, devices, the collision hook) is kvref's.
    """
    base = kvref.conformance_backend()
    fields = {"name": name}
    if cache_cls is not None:
        fields["make_cache"] = lambda config, layer_specs: cache_cls.make(config, layer_specs)
    if manager_cls is not None:
        def make_manager(params, *, num_blocks, max_batch_size, max_seq_len, device="cpu", connector=None,
                         clock=None):
            return manager_cls(params, num_blocks=num_blocks, max_batch_size=max_batch_size,
                               max_seq_len=max_seq_len, device=device, connector=connector, clock=clock)
        fields["make_manager"] = make_manager
    fields.update(changes)
    return dataclasses.replace(base, **fields)


def swap_pools(obj, pool_cls) -> None:
    """Give every ``BlockPool`` held by ``obj`` (directly, or nested in list,
    tuple or dict attributes) the broken class ``pool_cls``: one instance
    changes, kvref's module and the oracle stay correct."""

    def visit(value):
        if isinstance(value, BlockPool):
            value.__class__ = pool_cls
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)

    for value in vars(obj).values():
        visit(value)
