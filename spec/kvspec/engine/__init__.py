"""The engine protocol: the mechanisms a kvcache policy runs on (DESIGN §7).

The spec's decisions (allocation order, hit rules, atomicity, messages) are
written once, in the policy; the mechanisms they need sit behind the small
protocols of this package, so ``kvref`` (policy + reference engine) and
``kvfast`` (policy + fast engine) differ in mechanisms only.

Modules
-------
``_pool``     block pool, prefix index and chain hasher (manager and slot cache)
``_manager``  page store factory and lookup-table builder (request manager)
``_slab``     slab table: huge blocks shared by a manager's leaves (request manager)
``_slot``     slot arrays, step-index builder and copy kernels (slot cache)

Each module adds its names to ``__all__`` below.
"""

from .._page_store import HostPageStore, PageStore
from . import _slot
from ._slot import *  # noqa: F401,F403  (slot-cache engine: SlotEngine, WriteSets, STEP_* codes)

from . import _manager, _pool
from ._manager import *  # noqa: F401,F403  (request-manager engine: ManagerEngine)
from ._pool import *  # noqa: F401,F403  (block pool protocol: BlockPool, NULL_BLOCK)
from . import _slab
from ._slab import *  # noqa: F401,F403  (slab table protocol: SlabTable, PRISTINE)

__all__ = ["PageStore", "HostPageStore"]
__all__ += _slot.__all__
__all__ += _pool.__all__ + _manager.__all__ + _slab.__all__
