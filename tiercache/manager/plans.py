"""Plans the manager hands to the transfer side: which key moves where.

A plan names slots (addresses inside a tier), never bytes. Plans are built by
the scheduler-side manager and executed by the worker-side TransferEngine; they
are plain frozen data, cheap to pickle across the process boundary.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Load ``keys[i]`` into the engine from host slot ``slots[i]``. Sources are pinned.

    ``tiers[i]`` names where the chunk lives. When it is a lower tier,
    ``staged[i]`` is True: the chunk is first read from that tier into host
    slot ``slots[i]`` (reserved as staging), then copied to the engine, in one
    job. After the job the chunk stays in the host tier (promoted). A chunk of
    a direct tier (TierSpec.direct) is read straight into the engine's blocks:
    its slot is -1 and it is not staged. A plan may
    cover only a leading part of the keys asked for (no host slot could be
    freed for staging the rest): the caller treats the rest as failed loads.
    """

    keys: tuple[bytes, ...]
    tiers: tuple[str, ...]
    slots: tuple[int, ...]
    staged: tuple[bool, ...] = ()

    def is_staged(self, i: int) -> bool:
        return bool(self.staged) and self.staged[i]


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


@dataclass(frozen=True, slots=True)
class DemotePlan:
    """Copy ``keys[i]`` from host slot ``host_slots[i]`` down into lower tier ``tier``.

    The host copies are pinned until :meth:`OffloadingManager.complete_demotion`,
    so the slots are not reused while the backend reads them.
    """

    tier: str
    keys: tuple[bytes, ...]
    host_slots: tuple[int, ...]
