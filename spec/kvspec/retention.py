"""Retention claims: priority and time-to-live of cached pages (spec/manager.md §14).

A request (``TextContext``, or ``KVCache.admit`` / ``retire``) may claim that
the pages it publishes or hits be kept longer than plain LRU would:

* ``retention_priority``: int in ``0 .. 100`` (TensorRT-LLM's range),
  default :data:`DEFAULT_PRIORITY` = 35; higher is kept longer;
* ``retention_seconds``: ``None`` (no expiry) or a finite real ``> 0``
  (SGLang's name); the claim's expiry is ``clock() + retention_seconds``.

A pool page holds at most one claim ``(priority, expiry)``; :func:`merge`
is the rule every backend applies. This module holds the checks and the
rule once, so the two packages agree on values and messages.
"""

from __future__ import annotations

import math
import numbers
import time
from typing import Callable

__all__ = [
    "DEFAULT_PRIORITY", "MIN_PRIORITY", "MAX_PRIORITY", "NUM_LEVELS", "NO_CLAIM", "NEVER",
    "check_priority", "check_seconds", "check_expiry", "check_clock", "check_reading", "CheckedClock", "held", "expiry_of", "merge", "level_of",
]

#: Priority of a request that asks for nothing, and the level of a page without a claim.
DEFAULT_PRIORITY = 35
MIN_PRIORITY = 0
MAX_PRIORITY = 100
#: Number of priority levels (0 .. 100).
NUM_LEVELS = MAX_PRIORITY - MIN_PRIORITY + 1
#: Stored priority of a page without a claim.
NO_CLAIM = -1
#: Expiry of a claim without a time-to-live.
NEVER = math.inf


def _as_float(value: numbers.Real) -> float:
    """``float(value)``, infinite for an int past float's range (``10**400``): out of range, not a crash."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def check_priority(owner: str, value, name: str = "retention_priority") -> int:
    """``value`` as an int in ``0 .. 100``; ``TypeError`` / ``ValueError`` naming ``owner`` and ``name``."""
    if type(value) is int and MIN_PRIORITY <= value <= MAX_PRIORITY:
        return value  # the common case, without the ABC check (a release's claim on its pages)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}: {name}={value!r}, must be an int in {MIN_PRIORITY}..{MAX_PRIORITY}")
    v = int(value)
    if not MIN_PRIORITY <= v <= MAX_PRIORITY:
        raise ValueError(f"{owner}: {name}={v}, must be in {MIN_PRIORITY}..{MAX_PRIORITY}")
    return v


def check_seconds(owner: str, value, name: str = "retention_seconds") -> float | None:
    """``None`` or ``value`` as a finite float ``> 0``; ``TypeError`` / ``ValueError`` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {name}={value!r}, must be None or a real number of seconds > 0")
    v = _as_float(value)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{owner}: {name}={value!r}, must be None or a finite number of seconds > 0")
    return v


def check_expiry(owner: str, value) -> float:
    """An absolute expiry (``math.inf``: none) as a float; ``TypeError`` (not a real number) /
    ``ValueError`` (NaN, an int past float's range) naming ``owner`` and the value."""
    if type(value) is float and value == value:  # the managers' (a float, not NaN): no ABC checks
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: expiry={value!r}, must be a float (math.inf: none)")
    try:
        e = float(value)
    except OverflowError:
        raise ValueError(f"{owner}: expiry={value!r}, past float's range (math.inf: none)") from None
    if math.isnan(e):
        raise ValueError(f"{owner}: expiry={value!r}, must not be NaN")
    return e


def check_reading(owner: str, value) -> float:
    """A clock reading as a finite float; ``TypeError`` (not a real number) / ``ValueError``
    (NaN, infinite, past float's range) naming ``owner``'s clock and the value."""
    if type(value) is float and math.isfinite(value):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: clock() returned {value!r}, must be a finite real number of seconds")
    v = _as_float(value)
    if not math.isfinite(v):
        raise ValueError(f"{owner}: clock() returned {value!r}, must be a finite real number of seconds")
    return v


class CheckedClock:
    """A user's clock whose every reading is checked (:func:`check_reading`) before it is used.

    spec/manager.md §14.7: a call that reads the clock reads it before it changes anything, so
    a bad reading raises with the state as before the call. Inside ``with clock:`` the clock
    is read once, on entry, and every reading within returns that value: a call that lets
    pages go in several pools sees one instant, and a clock that fails on a second reading
    cannot stop it half-way.
    """

    __slots__ = ("clock", "owner", "_held", "_depth")

    def __init__(self, owner: str, clock: Callable[[], float]):
        self.owner = owner
        self.clock = clock
        self._held = None
        self._depth = 0

    def __call__(self) -> float:
        held = self._held
        if held is not None:
            return held
        return check_reading(self.owner, self.clock())

    def __enter__(self) -> float:
        if self._depth == 0:
            self._held = check_reading(self.owner, self.clock())
        self._depth += 1
        return self._held

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._held = None

    def __repr__(self) -> str:
        return f"CheckedClock({self.clock!r})"


class _Unheld:
    """``with held(time.monotonic):``: nothing to hold (the monotonic clock cannot fail)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


_UNHELD = _Unheld()


def held(clock: Callable[[], float]):
    """A context in which ``clock`` reads once: the :class:`CheckedClock` itself (its reading
    taken and checked on entry), or a no-op for ``time.monotonic``."""
    return clock if type(clock) is CheckedClock else _UNHELD


def check_clock(owner: str, clock) -> Callable[[], float]:
    """``clock`` (``None``: ``time.monotonic``) wrapped in a :class:`CheckedClock` if it is
    a user's callable, else ``TypeError``."""
    if clock is None:
        return time.monotonic
    if clock is time.monotonic or isinstance(clock, CheckedClock):
        return clock
    if not callable(clock):
        raise TypeError(f"{owner}: clock={clock!r}, must be a zero-argument callable returning seconds")
    return CheckedClock(owner, clock)


def expiry_of(seconds: float | None, clock: Callable[[], float]) -> float:
    """The absolute expiry of a claim made now: ``clock() + seconds``, or :data:`NEVER` (no clock read)."""
    return NEVER if seconds is None else float(clock()) + seconds


def merge(old_priority: int, old_expiry: float, priority: int, expiry: float, now: float) -> tuple[int, float]:
    """The claim of a page holding ``(old_priority, old_expiry)`` after a claim ``(priority, expiry)`` at ``now``.

    ``old_priority`` is :data:`NO_CLAIM` for a page without a claim. No claim or an
    expired one (``old_expiry <= now``): the new claim. Otherwise the higher priority,
    and at equal priority the later expiry (spec/manager.md §14.3).
    """
    if old_priority == NO_CLAIM or old_expiry <= now or priority > old_priority:
        return priority, expiry
    if priority == old_priority:
        return priority, max(old_expiry, expiry)
    return old_priority, old_expiry


def level_of(priority: int) -> int:
    """The free-list level of a page whose stored priority is ``priority`` (no claim: 35)."""
    return DEFAULT_PRIORITY if priority == NO_CLAIM else priority
