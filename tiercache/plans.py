"""Plans the manager hands to the transfer side: which key moves where.

A plan names slots (addresses inside a tier), never bytes. Plans are built by
the scheduler-side manager and executed by the worker-side TransferEngine; they
are plain frozen data, cheap to pickle across the process boundary.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Load ``keys[i]`` from ``tiers[i]`` at address ``slots[i]``. Sources are pinned."""

    keys: tuple[bytes, ...]
    tiers: tuple[str, ...]
    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StorePlan:
    """Write ``keys[i]`` into ``tier`` at address ``slots[i]``.

    ``keys`` is a prefix of what was asked (the rest did not fit or was already
    there); ``evicted`` lists what left the tier to make room.
    """

    tier: str
    keys: tuple[bytes, ...]
    slots: tuple[int, ...]
    evicted: tuple[bytes, ...]
    skipped_present: int
