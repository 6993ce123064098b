"""Tiers of kvfast: the reference ``TieredConnector`` (host arena + verified disk + remote tier).

Transfers are bounded by memory, disk and network bandwidth, not by Python, so
kvfast uses kvref's connector as is (the same class, so a warm disk directory
is shared by both packages). The device side of every transfer goes through
the page store the fast engine builds (``kvfast._cuda.page_store.CudaPageStore``
on a GPU: ``stage.cu`` into pinned host memory).
"""

from kvref import TieredConnector

__all__ = ["TieredConnector"]
