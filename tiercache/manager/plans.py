"""Plans the manager hands to the transfer side: which key moves where.

A plan names slots (addresses inside a tier), never bytes. Plans are built by
the scheduler-side manager and executed by the worker-side TransferEngine; they
are plain frozen data, cheap to pickle across the process boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiercache.jobs import ChunkSource, FromHost, FromReader, FromTier


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Load ``keys[i]`` into the engine from ``sources[i]``. Sources are pinned.

    Each source is one of :mod:`tiercache.jobs`' (the scheduler puts it into
    the load job as it is): :class:`~tiercache.jobs.FromHost`, the chunk's host
    slot; :class:`~tiercache.jobs.FromTier`, a lower tier the chunk is first
    read from into a host slot reserved as staging, then copied to the engine,
    in one job (after it, the chunk stays in the host tier: promoted);
    :class:`~tiercache.jobs.FromReader`, a direct tier (TierSpec.direct) whose
    reader writes the engine's blocks itself (its ``where`` is left for the
    caller, who knows the reader). A plan may cover only a leading part of the
    keys asked for (no host slot could be freed for staging the rest): the
    caller treats the rest as failed loads.
    """

    keys: tuple[bytes, ...]
    sources: tuple[ChunkSource, ...]

    @property
    def tiers(self) -> tuple[str, ...]:
        return tuple(s.tier for s in self.sources)

    @property
    def slots(self) -> tuple[int, ...]:
        """Each chunk's host slot (its own, or its staging slot); -1 for a direct tier's."""
        return tuple(-1 if isinstance(s, FromReader) else s.slot for s in self.sources)

    @property
    def staged(self) -> tuple[bool, ...]:
        return tuple(isinstance(s, FromTier) for s in self.sources)

    def is_staged(self, i: int) -> bool:
        return isinstance(self.sources[i], FromTier)


def host_sources(tier: str, slots: tuple[int, ...]) -> tuple[FromHost, ...]:
    """Sources of chunks that all sit in the host tier ``tier``, at ``slots``."""
    return tuple(FromHost(tier, slot) for slot in slots)


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

    The host copies are pinned until :meth:`~tiercache.manager.cascade.Cascade.complete_demotion`,
    so the slots are not reused while the backend reads them.
    """

    tier: str
    keys: tuple[bytes, ...]
    host_slots: tuple[int, ...]
