"""Tiers of kvfast: the reference ``TieredConnector`` (host arena + verified disk tier).

Transfers are bounded by memory and disk bandwidth, not by Python, so kvfast
uses kvref's connector as is (the same class, so a warm disk directory is
shared by both packages). On a GPU the device side of a transfer stages
whole blocks with ``kvfast/_cuda/stage.py``.
"""

from kvref._tiers import TieredConnector

__all__ = ["TieredConnector"]
