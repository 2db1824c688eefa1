"""The OffloadingManager: the one directory of which chunk lives where.

Scheduler side, one per engine. It owns, for every key and every tier, the
state (STORING or READY), the slot address, the pin count and the eviction
order; it never touches bytes (the worker-side TransferEngine does, following
the plans made here).

Threading: every method is called from one thread (vLLM's scheduler loop).
Nothing here locks.

Invariants, each tested in tests/unit/test_manager.py:

* a tier never holds more chunks than its slots (its byte budget / chunk bytes);
* a pinned key (a load in flight) is never evicted, and neither is a STORING one;
* a failed store leaves no trace: the key is a miss and its slot is free again;
* a full tier refuses stores (``prepare_store`` returns None), never raises.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from tiercache.events import ChunkEvent, EventKind
from tiercache.plans import LoadPlan, StorePlan
from tiercache.policies import EvictionPolicy, make_policy


class ChunkState(enum.IntEnum):
    STORING = 0
    READY = 1


class _Entry:
    """A key's record in one tier. Mutated only by the manager's thread."""

    __slots__ = ("state", "slot", "pins")

    def __init__(self, state: ChunkState, slot: int) -> None:
        self.state = state
        self.slot = slot
        self.pins = 0


@dataclass(frozen=True)
class TierSpec:
    """What the manager needs to know about a tier: its name, slots and policy."""

    name: str
    num_slots: int
    policy: str = "lru"


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
    """The directory of one tier: entries, free slots, eviction order."""

    def __init__(self, spec: TierSpec) -> None:
        if spec.num_slots < 0:
            raise ValueError(f"tier {spec.name}: num_slots must be >= 0")
        self.spec = spec
        self.name = spec.name
        self.entries: dict[bytes, _Entry] = {}
        # Pop from the end: slot 0 is handed out first.
        self.free_slots: list[int] = list(range(spec.num_slots - 1, -1, -1))
        self.policy: EvictionPolicy = make_policy(spec.policy, spec.num_slots)
        self.stats = TierStats()

    @property
    def used_slots(self) -> int:
        return self.spec.num_slots - len(self.free_slots)

    def evict(self, count: int) -> list[bytes]:
        """Evict up to ``count`` READY, unpinned keys in policy order; return them."""
        entries = self.entries
        victims: list[bytes] = []
        for key in self.policy.candidates():
            if entries[key].pins == 0:
                victims.append(key)
                if len(victims) == count:
                    break
        policy = self.policy
        free = self.free_slots
        for key in victims:
            policy.evicted(key)
            free.append(entries.pop(key).slot)
        self.stats.evictions += len(victims)
        return victims

    def drop_unpinned(self) -> list[bytes]:
        """Forget every READY unpinned key (reset); return them."""
        dropped = [k for k, e in self.entries.items() if e.state == ChunkState.READY and not e.pins]
        for key in dropped:
            self.policy.remove(key)
            self.free_slots.append(self.entries.pop(key).slot)
        return dropped


@dataclass
class ManagerStats:
    lookups: int = 0
    lookup_chunks: int = 0
    lookup_hit_chunks: int = 0
    tiers: dict[str, TierStats] = field(default_factory=dict)


class OffloadingManager:
    """Directory and policy of every tier; makes load and store plans."""

    def __init__(self, tiers: Sequence[TierSpec]) -> None:
        if not tiers:
            raise ValueError("at least one tier is required")
        self.tiers = [TierDirectory(spec) for spec in tiers]
        self._by_name = {t.name: t for t in self.tiers}
        if len(self._by_name) != len(self.tiers):
            raise ValueError("tier names must be unique")
        self.host = self.tiers[0]
        self._events: list[ChunkEvent] = []
        self._lookups = 0
        self._lookup_chunks = 0
        self._lookup_hits = 0

    # ------------------------------------------------------------------ lookup
    def lookup(self, keys: Sequence[bytes], ctx: object = None) -> int | None:
        """Length (in chunks) of the longest prefix of ``keys`` READY in some tier.

        Never None today: every tier is local. Shared tiers that answer
        asynchronously will return None ("ask again next step").
        """
        self._lookups += 1
        self._lookup_chunks += len(keys)
        hits = 0
        tiers = self.tiers
        ready = ChunkState.READY
        for key in keys:
            for tier in tiers:
                entry = tier.entries.get(key)
                if entry is not None and entry.state == ready:
                    break
            else:
                break
            hits += 1
        self._lookup_hits += hits
        return hits

    # -------------------------------------------------------------------- load
    def prepare_load(self, keys: Sequence[bytes], ctx: object = None) -> LoadPlan:
        """Pin the source of every key and return where each one lives.

        Every key must be READY (callers pass a prefix that ``lookup`` just
        counted, in the same scheduler step); a missing key is a caller bug and
        raises KeyError before anything is pinned.
        """
        found: list[tuple[TierDirectory, _Entry]] = []
        ready = ChunkState.READY
        for key in keys:
            for tier in self.tiers:
                entry = tier.entries.get(key)
                if entry is not None and entry.state == ready:
                    found.append((tier, entry))
                    break
            else:
                raise KeyError(f"prepare_load: chunk {key.hex()} is not ready in any tier")
        for key, (tier, entry) in zip(keys, found):
            entry.pins += 1
            tier.policy.access(key)
            tier.stats.hit_chunks += 1
            tier.stats.loads += 1
        return LoadPlan(
            keys=tuple(keys),
            tiers=tuple(t.name for t, _ in found),
            slots=tuple(e.slot for _, e in found),
        )

    def complete_load(self, keys: Sequence[bytes], ctx: object = None) -> None:
        """Release the pins taken by :meth:`prepare_load` (success or failure alike)."""
        for key in keys:
            for tier in self.tiers:
                entry = tier.entries.get(key)
                if entry is not None and entry.pins > 0:
                    entry.pins -= 1
                    break

    def touch(self, keys: Sequence[bytes], ctx: object = None) -> None:
        """Mark keys as recently used (the engine hit them in its own cache)."""
        for tier in self.tiers:
            entries = tier.entries
            access = tier.policy.access
            for key in keys:
                entry = entries.get(key)
                if entry is not None and entry.state == ChunkState.READY:
                    access(key)

    # ------------------------------------------------------------------- store
    def prepare_store(self, keys: Sequence[bytes], ctx: object = None) -> StorePlan | None:
        """Reserve host-tier slots for the keys not already there.

        Returns None when nothing needs or can be written now (all present, or
        the tier is full of pinned/storing chunks). A plan may cover only a
        leading part of the missing keys when the tier cannot make room for all.
        """
        tier = self.host
        entries = tier.entries
        missing: list[bytes] = []
        present = 0
        seen: set[bytes] = set()
        for key in keys:
            entry = entries.get(key)
            if entry is not None:
                present += 1
                if entry.state == ChunkState.READY:
                    tier.policy.access(key)
            elif key not in seen:
                seen.add(key)
                missing.append(key)
        if not missing:
            return None
        shortfall = len(missing) - len(tier.free_slots)
        evicted: list[bytes] = tier.evict(shortfall) if shortfall > 0 else []
        if evicted:
            self._events.append(ChunkEvent(EventKind.REMOVED, tier.name, tuple(evicted)))
        fit = min(len(missing), len(tier.free_slots))
        if fit < len(missing):
            tier.stats.store_refused += len(missing) - fit
        if fit == 0:
            return None
        chosen = missing[:fit]
        free = tier.free_slots
        slots: list[int] = []
        storing = ChunkState.STORING
        for key in chosen:
            slot = free.pop()
            entries[key] = _Entry(storing, slot)
            slots.append(slot)
        return StorePlan(
            tier=tier.name,
            keys=tuple(chosen),
            slots=tuple(slots),
            evicted=tuple(evicted),
            skipped_present=present,
        )

    def complete_store(self, keys: Sequence[bytes], ctx: object = None, ok: bool = True) -> None:
        """Finish a store: READY on success; on failure the key vanishes and its slot frees."""
        tier = self.host
        entries = tier.entries
        stored: list[bytes] = []
        for key in keys:
            entry = entries.get(key)
            if entry is None or entry.state != ChunkState.STORING:
                continue
            if ok:
                entry.state = ChunkState.READY
                tier.policy.insert(key)
                stored.append(key)
            else:
                del entries[key]
                tier.free_slots.append(entry.slot)
                tier.stats.store_failures += 1
        if stored:
            tier.stats.stored_chunks += len(stored)
            self._events.append(ChunkEvent(EventKind.STORED, tier.name, tuple(stored)))

    # ---------------------------------------------------------------- the rest
    def take_events(self) -> list[ChunkEvent]:
        events, self._events = self._events, []
        return events

    def stats(self) -> ManagerStats:
        return ManagerStats(
            lookups=self._lookups,
            lookup_chunks=self._lookup_chunks,
            lookup_hit_chunks=self._lookup_hits,
            tiers={t.name: TierStats(**t.stats.as_dict()) for t in self.tiers},
        )

    def usage(self) -> dict[str, tuple[int, int]]:
        """Per tier: (used slots, total slots)."""
        return {t.name: (t.used_slots, t.spec.num_slots) for t in self.tiers}

    def state_of(self, key: bytes, tier: str | None = None) -> tuple[ChunkState, int, int] | None:
        """(state, slot, pins) of a key in a tier (the host tier by default), for tests/inspect."""
        entry = self._by_name[tier or self.host.name].entries.get(key)
        return None if entry is None else (entry.state, entry.slot, entry.pins)

    def reset(self) -> int:
        """Forget every READY, unpinned chunk in every tier. Returns how many were dropped.

        Chunks being loaded (pinned) or stored stay until their job completes, so
        no in-flight copy ever reads or writes a slot that was handed out again.
        """
        dropped = 0
        for tier in self.tiers:
            keys = tier.drop_unpinned()
            if keys:
                self._events.append(ChunkEvent(EventKind.REMOVED, tier.name, tuple(keys)))
            dropped += len(keys)
        return dropped

    def shutdown(self) -> None:
        for tier in self.tiers:
            tier.entries.clear()
            tier.policy.clear()
            tier.free_slots = list(range(tier.spec.num_slots - 1, -1, -1))
