"""The OffloadingManager: the one directory of which chunk lives where.

Scheduler side, one per engine. It owns, for every key and every tier, the
state (STORING or READY), the slot address, the pin count and the eviction
order; it never touches bytes (the worker-side TransferEngine does, following
the plans made here).

It is composed of parts, which callers name: ``manager.tiers`` (one
:class:`TierDirectory` per tier, host first), ``manager.holds`` (every pin:
:class:`~tiercache.manager.holds.Holds`), ``manager.cascade`` (demotion,
adopt, learn/forget: :class:`~tiercache.manager.cascade.Cascade`),
``manager.events`` and ``manager.deletes`` (the logs every part adds to, drained
once per step). This file holds the per-request flows: lookup, load, store,
discard, reset.

Threading: every method is called from one thread (vLLM's scheduler loop).
Nothing here locks.

Invariants, each tested in tests/unit/test_manager.py:

* a tier never holds more chunks than its slots (its byte budget / chunk bytes);
* a pinned key (a load in flight) is never evicted, and neither is a STORING one;
* a failed store leaves no trace: the key is a miss and its slot is free again;
* a full tier refuses stores (``prepare_store`` returns None), never raises;
* a store never evicts a READY key of its own offer (the prefix it extends);
* ``complete_load`` only completes a load: its staged chunks are promoted (or
  their staging slots freed) and its pins released; every other pin (a P/D
  hand-off, a write-through or demotion copy) is released with ``holds.release``;
* all in-flight loads of a key read (and pin) one tier, so a release, which only
  gets keys, always releases the pin its load took;
* a discarded key (a failed load) is a miss at once; if something still pins
  it, its slot is freed only when the last pin is released; a discarded host
  store in flight never becomes READY (its slot is freed when it completes).

Recency follows prefixes: the keys of one request are marked used last-first,
so the first chunk of a prefix is the most recent and a tier evicts chain tails
before the heads every later chunk depends on.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from tiercache.events import EventKind, EventLog
from tiercache.manager.cascade import Cascade
from tiercache.manager.deletes import DeleteQueue
from tiercache.manager.directory import ChunkState, TierDirectory, TierSpec, TierStats
from tiercache.manager.holds import Holds
from tiercache.jobs import ChunkSource, FromHost, FromReader, FromTier
from tiercache.manager.plans import LoadPlan, StorePlan, host_sources

__all__ = ["ChunkState", "ManagerStats", "OffloadingManager", "TierSpec", "TierStats"]


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
        self.lower = self.tiers[1:]
        self.events = EventLog()
        self.deletes = DeleteQueue(self.lower)
        self.holds = Holds(self.tiers)
        self.cascade = Cascade(self.tiers, self.holds, self.events, self.deletes)
        # key -> lower tier a staged load reads it from (host holds it STORING meanwhile)
        self._staged: dict[bytes, TierDirectory] = {}
        # host stores in flight discarded meanwhile: their slots are freed when they complete
        self._discarded_in_flight: set[bytes] = set()
        self._lookups = 0
        self._lookup_chunks = 0
        self._lookup_hits = 0

    # ------------------------------------------------------------------ lookup
    def lookup(self, keys: Sequence[bytes]) -> int | None:
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
            host_ready, host_storing = self.host.ready, self.host.storing
            lower_readies = [t.ready for t in self.lower]
            for i, key in enumerate(keys):
                if key in host_ready:
                    continue
                # A chunk being staged into the host tier is busy until that load ends.
                if key in host_storing or not any(key in r for r in lower_readies):
                    hits = i
                    break
        self._lookup_hits += hits
        return hits

    def busy_in_host(self, key: bytes) -> bool:
        """Whether ``key`` is being written into the host tier right now (a store, or a load
        staging it from a lower tier): :meth:`lookup` stops there until that copy is reported."""
        return key in self.host.storing

    # -------------------------------------------------------------------- load
    def load_source(self, key: bytes) -> TierDirectory:
        """The tier a load of ``key`` reads: the one already pinned, else the first READY.

        Reading every concurrent load of a key from one tier keeps a release by
        key unambiguous: it unpins the tier holding the pins.
        """
        for tier in self.tiers:
            if key in tier.pins and key in tier.ready:
                return tier
        for tier in self.tiers:
            if key in tier.ready:
                return tier
        raise KeyError(f"prepare_load: chunk {key.hex()} is not ready in any tier")

    def prepare_load(self, keys: Sequence[bytes]) -> LoadPlan:
        """Pin the source of every key and return where each one lives.

        Every key must be READY (callers pass a prefix that ``lookup`` just
        counted, in the same scheduler step); a missing key is a caller bug and
        raises KeyError before anything is pinned.
        """
        if len(self.tiers) == 1:
            return self._prepare_load_host(keys)
        host = self.host
        sources = [host if key in host.ready else self.load_source(key) for key in keys]
        if any(t is not host and key in host.storing for key, t in zip(keys, sources)):
            raise KeyError("prepare_load: a chunk is already being staged into the host tier")
        # Staging slots in the host tier for the chunks that live only below it
        # (a direct tier's chunks go straight to the engine's blocks).
        staged_count = sum(1 for t in sources if t is not host and not t.spec.direct)
        if staged_count > len(host.free_slots):
            evicted = host.evict(staged_count - len(host.free_slots), set(keys))
            self.events.add(EventKind.REMOVED, host.name, evicted)
        budget = len(host.free_slots)
        count = len(keys)
        for i, tier in enumerate(sources):
            if tier is not host and not tier.spec.direct:
                if budget == 0:
                    count = i  # no room to stage the rest: the plan stops here
                    break
                budget -= 1
        keys, sources = list(keys[:count]), sources[:count]
        planned: list[ChunkSource] = []
        for key, tier in zip(keys, sources):
            if tier is host:
                planned.append(FromHost(host.name, host.ready[key]))
            elif tier.spec.direct:
                planned.append(FromReader(tier.name))
            else:
                (slot,) = host.take_slots(1)
                host.storing[key] = slot
                self._staged[key] = tier
                planned.append(FromTier(tier.name, slot))
        hold = self.holds.hold
        for key, tier in zip(reversed(keys), reversed(sources)):
            hold(tier, (key,))
            tier.policy.access(key)
            tier.stats.hit_chunks += 1
            tier.stats.loads += 1
        return LoadPlan(tuple(keys), tuple(planned))

    def _prepare_load_host(self, keys: Sequence[bytes]) -> LoadPlan:
        tier = self.host
        ready = tier.ready
        try:
            slots = tuple([ready[key] for key in keys])
        except KeyError as missing:
            raise KeyError(
                f"prepare_load: chunk {missing.args[0].hex()} is not ready in any tier"
            ) from None
        self.holds.hold(tier, keys)
        tier.policy.access_many(keys[::-1])
        tier.stats.hit_chunks += len(keys)
        tier.stats.loads += len(keys)
        return LoadPlan(tuple(keys), host_sources(tier.name, slots))

    def complete_load(self, keys: Sequence[bytes], failed: Collection[bytes] = ()) -> None:
        """Complete the load :meth:`prepare_load` planned for ``keys`` (success or failure alike).

        A staged chunk (read from a lower tier through a host slot) becomes READY
        in the host tier when its load succeeded; a failed one gives its staging
        slot back. ``failed`` names the chunks whose load failed. The load's pins
        are released. Nothing but a load completes here: other pins are released
        with ``holds.release``.
        """
        if self._staged:
            keys = self._finish_staged(keys, failed)
        self.holds.release(keys)

    def _finish_staged(self, keys: Sequence[bytes], failed: Collection[bytes]) -> list[bytes]:
        """Close the staged chunks among ``keys`` (their source pins released); return the others."""
        host = self.host
        rest: list[bytes] = []
        promoted: list[bytes] = []
        for key in keys:
            tier = self._staged.pop(key, None)
            if tier is None:
                rest.append(key)
                continue
            self.holds.release_at(tier, (key,))
            slot = host.storing.pop(key)
            if key in failed:
                host.free_slots.append(slot)
            else:
                host.ready[key] = slot
                promoted.append(key)
        if promoted:
            host.policy.insert_many(promoted[::-1])
            self.events.add(EventKind.STORED, host.name, promoted)
        return rest

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark keys as recently used (the engine hit them in its own cache)."""
        for tier in self.tiers:
            ready = tier.ready
            present = [key for key in reversed(keys) if key in ready]
            if present:
                tier.policy.access_many(present)

    # ------------------------------------------------------------------- store
    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan | None:
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
            self.events.add(EventKind.REMOVED, tier.name, evicted)
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

    def complete_store(self, keys: Sequence[bytes], ok: bool = True) -> None:
        """Finish a store: READY on success; on failure the key vanishes and its slot frees."""
        tier = self.host
        pop = tier.storing.pop
        if self._discarded_in_flight:
            keys = self._drop_discarded_in_flight(keys)
        if not ok:
            tier.stats.store_failures += self._free_storing(keys)
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
            self.events.add(EventKind.STORED, tier.name, stored)
            if self.lower:
                self.cascade.queue_stored(stored)  # write-through copies, pinned until copied down

    def _free_storing(self, keys: Collection[bytes]) -> int:
        """End the host stores of ``keys`` without a READY copy: their slots are free again; how many."""
        freed = [slot for slot in map(self.host.storing.pop, keys, itertools.repeat(None)) if slot is not None]
        self.host.free_slots.extend(freed)
        return len(freed)

    def _drop_discarded_in_flight(self, keys: Sequence[bytes]) -> list[bytes]:
        """Free the slots of the stores among ``keys`` discarded while in flight; the other keys."""
        gone = self._discarded_in_flight.intersection(keys)
        if not gone:
            return list(keys)
        self._discarded_in_flight -= gone
        self._free_storing(gone)
        return [key for key in keys if key not in gone]

    def discard(self, keys: Sequence[bytes]) -> int:
        """Drop chunks that proved unusable (a failed load, a bad checksum) from every tier.

        They become misses at once, so the recompute vLLM schedules next does not
        look them up and fail on them again (a livelock). A slot still pinned by
        an in-flight load is freed when that load completes. Returns the number
        of (tier, key) entries dropped. An owned lower tier's copy is deleted; a
        shared tier's is only forgotten (a load that failed because the tier was
        slow or stopped says nothing about the bytes other engines share; a bad
        copy is overwritten when the recompute stores the chunk again). A host
        store still in flight never becomes READY: its slot is freed when it completes.
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
            dropped += len(removed)
            self.events.add(EventKind.REMOVED, tier.name, removed)
            self.deletes.add(tier.name, removed)  # owned lower tiers only
        host = self.host
        self._discarded_in_flight.update(k for k in keys if k in host.storing and k not in self._staged)
        self.cascade.drop_held_back(keys)
        return dropped

    # ---------------------------------------------------------------- the rest
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
        """(state, slot, pins) of a key in a tier (the host tier by default); None where it holds no copy
        (tests, inspect, and the scheduler's retry of stores the host tier refused)."""
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
        Pending write-through copies are abandoned first (their pins released).
        """
        self.cascade.drop_queued()
        dropped = 0
        for tier in self.tiers:
            if tier.spec.shared:
                continue  # other engines' chunks: a reset of this engine does not touch them
            keys = tier.drop_unpinned()
            self.events.add(EventKind.REMOVED, tier.name, keys)
            self.deletes.add(tier.name, keys)  # owned lower tiers only
            dropped += len(keys)
        return dropped

    def shutdown(self) -> None:
        for tier in self.tiers:
            tier.clear()
