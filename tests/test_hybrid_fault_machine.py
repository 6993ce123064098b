"""The fault-injection state machine of ``tests/test_tiers_faults.py`` over a hybrid manager.

Same rules (admit, iterate, preempt, flush, land, arm a load fault, reset)
and the same checks after every rule (pool partitioned, tiers consistent,
every published page of every leaf holds the model's bytes, nothing pinned
without a transfer), by parameter: a full, a sliding-window and a recurrent
leaf (spec/manager.md §9.8). A step here moves about three times the bytes of
the single-leaf machine through real disk files, so it runs half the
profile's examples.
"""

from __future__ import annotations

from hypothesis import settings
from test_tiers_faults import TieredFaultMachine

from kvspec import LeafSpec


class HybridTieredFaultMachine(TieredFaultMachine):
    leaves = {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(3), "rec": LeafSpec.recurrent((2,))}
    num_blocks = 16  # the slab holds one max_seq_len=16 request of every leaf (spec/manager.md §1.6)
    host_pages = 12  # three leaves' units per block: three times the single-leaf machine's room
    disk_files = 24
    warm_decode = 3


HybridTieredFaultMachine.TestCase.settings = settings(
    HybridTieredFaultMachine.TestCase.settings, max_examples=max(1, settings().max_examples // 2))
test_hybrid_tiered_fault_machine = HybridTieredFaultMachine.TestCase
