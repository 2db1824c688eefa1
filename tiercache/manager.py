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
* a full tier refuses stores (``prepare_store`` returns None), never raises;
* a store never evicts a READY key of its own offer (the prefix it extends);
* all in-flight loads of a key read (and pin) one tier, so ``complete_load``,
  which only gets keys, always releases the pin its load took;
* a discarded key (a failed load) is a miss at once; if a load still pins it,
  its slot is freed only when the last such load completes.

Recency follows prefixes: the keys of one request are marked used last-first,
so the first chunk of a prefix is the most recent and a tier evicts chain tails
before the heads every later chunk depends on.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from tiercache.events import ChunkEvent, EventKind
from tiercache.plans import LoadPlan, StorePlan
from tiercache.policies import EvictionPolicy, make_policy


class ChunkState(enum.IntEnum):
    STORING = 0
    READY = 1


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

    def take_slots(self, count: int) -> list[int]:
        """Hand out ``count`` free slots (lowest first on a fresh tier)."""
        if count <= 0:
            return []
        free = self.free_slots
        slots = free[: -count - 1 : -1]
        del free[-count:]
        return slots

    def evict(self, count: int, protected: AbstractSet[bytes] = frozenset()) -> list[bytes]:
        """Evict up to ``count`` READY, unpinned keys not in ``protected``, in policy order."""
        # No pins and nothing protected: the first ``count`` candidates, in bulk.
        pins = self.pins
        if not pins and not protected:
            victims = list(itertools.islice(self.policy.candidates(), count))
        else:
            victims = []
            for key in self.policy.candidates():
                if key not in pins and key not in protected:
                    victims.append(key)
                    if len(victims) == count:
                        break
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
        hits = len(keys)
        if len(self.tiers) == 1:
            ready = self.host.ready
            for i, key in enumerate(keys):
                if key not in ready:
                    hits = i
                    break
        else:
            readies = [t.ready for t in self.tiers]
            for i, key in enumerate(keys):
                if not any(key in r for r in readies):
                    hits = i
                    break
        self._lookup_hits += hits
        return hits

    # -------------------------------------------------------------------- load
    def _load_source(self, key: bytes) -> TierDirectory:
        """The tier a load of ``key`` reads: the one already pinned, else the first READY.

        Reading every concurrent load of a key from one tier keeps
        :meth:`complete_load` unambiguous: it unpins the tier holding the pins.
        """
        for tier in self.tiers:
            if key in tier.pins and key in tier.ready:
                return tier
        for tier in self.tiers:
            if key in tier.ready:
                return tier
        raise KeyError(f"prepare_load: chunk {key.hex()} is not ready in any tier")

    def prepare_load(self, keys: Sequence[bytes], ctx: object = None) -> LoadPlan:
        """Pin the source of every key and return where each one lives.

        Every key must be READY (callers pass a prefix that ``lookup`` just
        counted, in the same scheduler step); a missing key is a caller bug and
        raises KeyError before anything is pinned.
        """
        if len(self.tiers) == 1:
            return self._prepare_load_host(keys)
        sources = [self._load_source(key) for key in keys]
        for key, tier in zip(reversed(keys), reversed(sources)):
            tier.pins[key] = tier.pins.get(key, 0) + 1
            tier.policy.access(key)
            tier.stats.hit_chunks += 1
            tier.stats.loads += 1
        return LoadPlan(
            keys=tuple(keys),
            tiers=tuple(t.name for t in sources),
            slots=tuple(t.ready[k] for k, t in zip(keys, sources)),
        )

    def _prepare_load_host(self, keys: Sequence[bytes]) -> LoadPlan:
        tier = self.host
        ready = tier.ready
        try:
            slots = tuple([ready[key] for key in keys])
        except KeyError as missing:
            raise KeyError(
                f"prepare_load: chunk {missing.args[0].hex()} is not ready in any tier"
            ) from None
        pins = tier.pins
        get = pins.get
        for key in keys:
            pins[key] = get(key, 0) + 1
        tier.policy.access_many(keys[::-1])
        tier.stats.hit_chunks += len(keys)
        tier.stats.loads += len(keys)
        return LoadPlan(keys=tuple(keys), tiers=(tier.name,) * len(keys), slots=slots)

    def complete_load(self, keys: Sequence[bytes], ctx: object = None) -> None:
        """Release the pins taken by :meth:`prepare_load` (success or failure alike)."""
        for tier in self.tiers:
            pins = tier.pins
            if not pins:
                continue
            rest: list[bytes] = []
            for key in keys:
                count = pins.get(key)
                if count is None:
                    rest.append(key)
                elif count == 1:
                    del pins[key]
                    held = tier.doomed.pop(key, None)
                    if held is not None:
                        tier.free_slots.extend(held)
                else:
                    pins[key] = count - 1
            keys = rest
            if not keys:
                return

    def touch(self, keys: Sequence[bytes], ctx: object = None) -> None:
        """Mark keys as recently used (the engine hit them in its own cache)."""
        for tier in self.tiers:
            ready = tier.ready
            present = [key for key in reversed(keys) if key in ready]
            if present:
                tier.policy.access_many(present)

    # ------------------------------------------------------------------- store
    def prepare_store(self, keys: Sequence[bytes], ctx: object = None) -> StorePlan | None:
        """Reserve host-tier slots for the keys not already there.

        Returns None when nothing needs or can be written now (all present, or
        the tier is full of pinned/storing chunks). A plan may cover only a
        leading part of the missing keys when the tier cannot make room for all.
        Present READY keys are touched, and never evicted to make room for the
        others: they are the prefix the new chunks extend.
        """
        tier = self.host
        ready, storing = tier.ready, tier.storing
        missing = [key for key in keys if key not in ready and key not in storing]
        present = len(keys) - len(missing)
        touched: list[bytes] = []
        if present:
            touched = [key for key in reversed(keys) if key in ready]
            if touched:
                tier.policy.access_many(touched)
        if not missing:
            return None
        if len(missing) > 1 and len(set(missing)) != len(missing):
            missing = list(dict.fromkeys(missing))
        free = tier.free_slots
        evicted: list[bytes] = []
        if len(missing) > len(free):
            evicted = tier.evict(len(missing) - len(free), set(touched) if touched else frozenset())
            if evicted:
                self._events.append(ChunkEvent(EventKind.REMOVED, tier.name, tuple(evicted)))
        fit = min(len(missing), len(free))
        if fit < len(missing):
            tier.stats.store_refused += len(missing) - fit
            if fit == 0:
                return None
            missing = missing[:fit]
        slots = tier.take_slots(fit)
        storing.update(zip(missing, slots))
        return StorePlan(
            tier=tier.name,
            keys=tuple(missing),
            slots=tuple(slots),
            evicted=tuple(evicted),
            skipped_present=present,
        )

    def complete_store(self, keys: Sequence[bytes], ctx: object = None, ok: bool = True) -> None:
        """Finish a store: READY on success; on failure the key vanishes and its slot frees."""
        tier = self.host
        pop = tier.storing.pop
        if not ok:
            freed = [slot for slot in map(pop, keys, itertools.repeat(None)) if slot is not None]
            tier.free_slots.extend(freed)
            tier.stats.store_failures += len(freed)
            return
        ready = tier.ready
        stored: list[bytes] = []
        for key in keys:
            slot = pop(key, None)
            if slot is not None:
                ready[key] = slot
                stored.append(key)
        if stored:
            tier.policy.insert_many(stored[::-1])
            tier.stats.stored_chunks += len(stored)
            self._events.append(ChunkEvent(EventKind.STORED, tier.name, tuple(stored)))

    def discard(self, keys: Sequence[bytes], ctx: object = None) -> int:
        """Drop chunks that proved unusable (a failed load, a bad checksum) from every tier.

        They become misses at once, so the recompute vLLM schedules next does not
        look them up and fail on them again (a livelock). A slot still pinned by
        an in-flight load is freed when that load completes. Returns the number
        of (tier, key) entries dropped.
        """
        dropped = 0
        for tier in self.tiers:
            ready, pins = tier.ready, tier.pins
            removed = [key for key in keys if key in ready]
            for key in removed:
                slot = ready.pop(key)
                tier.policy.remove(key)
                if key in pins:
                    tier.doomed.setdefault(key, []).append(slot)
                else:
                    tier.free_slots.append(slot)
            if removed:
                dropped += len(removed)
                self._events.append(ChunkEvent(EventKind.REMOVED, tier.name, tuple(removed)))
        return dropped

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
        directory = self._by_name[tier or self.host.name]
        slot = directory.ready.get(key)
        if slot is not None:
            return ChunkState.READY, slot, directory.pins.get(key, 0)
        slot = directory.storing.get(key)
        return None if slot is None else (ChunkState.STORING, slot, 0)

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
            tier.clear()
