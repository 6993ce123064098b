"""Bug: a page loaded from a tier is published the moment the load is posted,
before its bytes land, so another request can hit garbage.

Built as kvref's manager behind a connector wrapper whose load handles claim
to be complete at once (the manager then publishes at ``alloc``), while the
real copy lands later.
"""

from kvref import PagedKVCacheManager

from ._common import backend_like_kvref


class _SaysDone:
    def __init__(self, real):
        self.real = real

    def is_complete(self):
        return True

    def synchronize(self):
        self.real.synchronize()


class EagerPublishConnector:
    """Delegates to a real connector; every load handle reports completion at once."""

    def __init__(self, real):
        self.real = real
        self.name = getattr(real, "name", "eager")

    def attach(self, buffers, params, *, owner=None):
        return self.real.attach(buffers, params)

    def lookup(self, hashes, tokens, replica_idx=0):
        return self.real.lookup(hashes, tokens, replica_idx)

    def load(self, block_ids, hashes, tokens, replica_idx=0):
        return _SaysDone(self.real.load(block_ids, hashes, tokens, replica_idx))

    def offload(self, block_ids, hashes, tokens, replica_idx=0):
        return self.real.offload(block_ids, hashes, tokens, replica_idx)

    def touch(self, hashes, replica_idx=0):
        return self.real.touch(hashes, replica_idx)

    def poll_transfers(self):
        return self.real.poll_transfers()

    def reset_prefix_cache(self):
        return self.real.reset_prefix_cache()

    def shutdown(self):
        return self.real.shutdown()

    def host_byte_count(self):
        return self.real.host_byte_count()

    def disk_byte_count(self):
        return self.real.disk_byte_count()

    @property
    def metrics(self):
        return self.real.metrics

    def take_metrics(self):
        return self.real.take_metrics()


class EagerPublishManager(PagedKVCacheManager):
    def __init__(self, params, *, connector=None, **kw):
        if connector is not None:
            connector = EagerPublishConnector(connector)
        super().__init__(params, connector=connector, **kw)


def factory():
    return backend_like_kvref("broken-publish-before-onload", manager_cls=EagerPublishManager)
