"""One tier's directory: which keys it holds, in which state, at which slot, pinned how often.

Used only by :class:`tiercache.manager.offloading.OffloadingManager` and its parts
(scheduler thread); split out so the manager's files hold the flows (lookup, load,
store in offloading.py, demotion in cascade.py) and this one the per-tier
bookkeeping they share. Pin counts live here but change only through
:class:`tiercache.manager.holds.Holds`.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Literal

from tiercache.manager.policies import EvictionPolicy, make_policy

TierMode = Literal["write_through", "write_back", "read_only"]


class ChunkState(enum.IntEnum):
    STORING = 0
    READY = 1


@dataclass(frozen=True)
class TierSpec:
    """What the manager needs to know about a tier: its name, slots and policy."""

    name: str
    num_slots: int
    policy: str = "lru"
    # Lower tiers only: write_through receives every chunk the host tier stores;
    # write_back receives the host tier's coldest chunks when it runs full;
    # read_only receives nothing (a P/D producer seen from its consumer).
    mode: TierMode = "write_through"
    # Shared tiers (Redis, the cache server) are looked up, not owned: the
    # directory only remembers which chunks were seen there (bounded by
    # num_slots); forgetting one deletes nothing, and a reset leaves them alone.
    shared: bool = False
    # A direct tier's chunks load straight into engine blocks (a P/D producer in
    # mode direct): no host staging slot; the load plan gives them slot -1.
    direct: bool = False


@dataclass
class TierStats:
    """Counters of one tier; read with :meth:`OffloadingManager.stats`."""

    hit_chunks: int = 0
    stored_chunks: int = 0
    store_failures: int = 0
    store_refused: int = 0
    evictions: int = 0
    loads: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class TierDirectory:
    """The directory of one tier: which keys it holds, where, pinned how often.

    A key is in exactly one of ``storing`` (STORING: slot reserved, bytes being
    written) or ``ready`` (READY: loadable); both map the key to its slot. Pins
    (loads in flight) are counted in ``pins`` for READY keys only. The policy
    orders READY keys; STORING keys never enter it, so they are never candidates.
    Plain dicts, no per-key objects: the scheduler calls this every step.
    """

    def __init__(self, spec: TierSpec) -> None:
        if spec.num_slots < 0:
            raise ValueError(f"tier {spec.name}: num_slots must be >= 0")
        self.spec = spec
        self.name = spec.name
        self.ready: dict[bytes, int] = {}
        self.storing: dict[bytes, int] = {}
        self.pins: dict[bytes, int] = {}
        # Discarded while pinned: no longer READY, slots held until the last unpin
        # (a list: the key may be stored again and discarded again meanwhile).
        self.doomed: dict[bytes, list[int]] = {}
        # Pop from the end: slot 0 is handed out first.
        self.free_slots: list[int] = list(range(spec.num_slots - 1, -1, -1))
        self.policy: EvictionPolicy = make_policy(spec.policy, spec.num_slots)
        self.stats = TierStats()

    @property
    def used_slots(self) -> int:
        return self.spec.num_slots - len(self.free_slots)

    def slots_of(self, keys: Sequence[bytes]) -> list[int]:
        """The slot of each key (READY or STORING); KeyError for a key the tier lacks.

        A held key's slot is stable until its hold is released (P/D hand-off params name them).
        """
        ready, storing = self.ready, self.storing
        return [ready[k] if k in ready else storing[k] for k in keys]

    def take_slots(self, count: int) -> list[int]:
        """Hand out ``count`` free slots (lowest first on a fresh tier)."""
        if count <= 0:
            return []
        free = self.free_slots
        slots = free[: -count - 1 : -1]
        del free[-count:]
        return slots

    def _evictable(self, protected: AbstractSet[bytes]) -> Iterator[bytes]:
        """READY unpinned keys outside ``protected``, in policy order (consume before evicting)."""
        pins = self.pins
        return (key for key in self.policy.candidates() if key not in pins and key not in protected)

    def has_room(self, count: int, protected: AbstractSet[bytes] = frozenset()) -> bool:
        """Whether ``count`` slots could be had now (free, or READY unpinned keys outside ``protected``
        to evict), without evicting anything."""
        short = count - len(self.free_slots)
        return short <= 0 or sum(1 for _ in itertools.islice(self._evictable(protected), short)) == short

    def evict(self, count: int, protected: AbstractSet[bytes] = frozenset()) -> list[bytes]:
        """Evict up to ``count`` READY, unpinned keys not in ``protected``, in policy order."""
        # No pins and nothing protected: the first ``count`` candidates, in bulk.
        if not self.pins and not protected:
            victims = list(itertools.islice(self.policy.candidates(), count))
        else:
            victims = list(itertools.islice(self._evictable(protected), count))
        if victims:
            self.policy.evicted_many(victims)
            self.free_slots.extend(map(self.ready.pop, victims))
            self.stats.evictions += len(victims)
        return victims

    def drop_unpinned(self) -> list[bytes]:
        """Forget every READY unpinned key (reset); return them."""
        pins = self.pins
        dropped = [k for k in self.ready if k not in pins]
        remove = self.policy.remove
        for key in dropped:
            remove(key)
        self.free_slots.extend(map(self.ready.pop, dropped))
        return dropped

    def clear(self) -> None:
        self.ready.clear()
        self.storing.clear()
        self.pins.clear()
        self.doomed.clear()
        self.policy.clear()
        self.free_slots = list(range(self.spec.num_slots - 1, -1, -1))


