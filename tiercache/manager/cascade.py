"""Lower-tier flows of the OffloadingManager: demotion, recovery, shared-tier knowledge, deletes.

A mixin of :class:`tiercache.manager.offloading.OffloadingManager`, kept apart so each file
holds one concern: manager.py the per-request flows (lookup, load, store),
this file what moves chunks between the host tier and the tiers below it.
Same contract: scheduler thread only, no locks, no bytes touched.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from tiercache.manager.directory import TierDirectory
from tiercache.events import ChunkEvent, EventKind
from tiercache.manager.plans import DemotePlan

if TYPE_CHECKING:
    from tiercache.manager.offloading import OffloadingManager

    _Base = OffloadingManager
else:
    _Base = object


class LowerTierFlows(_Base):
    """Demotion (write-through/write-back), adopt after restart, learn (shared), deletes."""

    def prepare_demotions(self, max_keys: int = 256) -> list[DemotePlan]:
        """Plan copies of host chunks down into the lower tiers; called once per step.

        write_through tiers receive every chunk the host tier stored; write_back
        tiers receive the host tier's coldest chunks once it is fuller than
        ``write_back_watermark``. The host copies are pinned until
        :meth:`complete_demotion`; room in the lower tier comes from its own
        eviction order (the evicted keys are queued for deletion).
        """
        plans: list[DemotePlan] = []
        host = self.host
        for tier in self.lower:
            if tier.spec.mode == "read_only":
                continue
            if tier.spec.mode == "write_through":
                candidates = self._take_demote_queue(tier, max_keys)
            else:
                candidates = self._write_back_candidates(tier, max_keys)
            if not candidates:
                continue
            if tier.spec.mode != "write_through":  # queued write-through keys are pinned already
                pins = host.pins
                for key in candidates:
                    pins[key] = pins.get(key, 0) + 1
            shortfall = len(candidates) - len(tier.free_slots)
            if shortfall > 0:
                evicted = tier.evict(shortfall)
                if evicted:
                    self._events.append(ChunkEvent(EventKind.REMOVED, tier.name, tuple(evicted)))
                    if not tier.spec.shared:
                        self._deletes[tier.name].extend(evicted)
                fit = min(len(candidates), len(tier.free_slots))
                tier.stats.store_refused += len(candidates) - fit
                self.complete_load(candidates[fit:])  # given up: release their host pins
                candidates = candidates[:fit]
            if not candidates:
                continue
            tier.storing.update(zip(candidates, tier.take_slots(len(candidates))))
            plans.append(
                DemotePlan(tier.name, tuple(candidates), tuple(host.ready[k] for k in candidates))
            )
        return plans

    def _take_demote_queue(self, tier: TierDirectory, max_keys: int) -> list[bytes]:
        queue = self._demote_queue[tier.name]
        host_ready = self.host.ready
        out: list[bytes] = []
        dropped: list[bytes] = []
        while queue and len(out) < max_keys:
            key = next(iter(queue))
            del queue[key]
            if key in host_ready and key not in tier.ready and key not in tier.storing:
                out.append(key)
            else:
                dropped.append(key)
        if dropped:
            self.complete_load(dropped)  # release the pins taken when they were queued
        return out

    def _write_back_candidates(self, tier: TierDirectory, max_keys: int) -> list[bytes]:
        host = self.host
        if host.used_slots < self.write_back_watermark * host.spec.num_slots:
            return []
        out: list[bytes] = []
        for key in host.policy.candidates():  # coldest first
            if key not in tier.ready and key not in tier.storing and key not in host.pins:
                out.append(key)
                if len(out) == max_keys:
                    break
        return out

    def complete_demotion(
        self, tier_name: str, keys: Sequence[bytes], failed: Collection[bytes] = ()
    ) -> None:
        """Finish a demotion: unpin the host copies; the lower copies become READY (or vanish)."""
        tier = self._by_name[tier_name]
        self.complete_load(keys)  # releases the host pins taken by prepare_demotions
        stored: list[bytes] = []
        for key in keys:
            slot = tier.storing.pop(key, None)
            if slot is None:
                continue
            if key in failed:
                tier.free_slots.append(slot)
                tier.stats.store_failures += 1
            else:
                tier.ready[key] = slot
                stored.append(key)
        if stored:
            tier.policy.insert_many(stored[::-1])
            tier.stats.stored_chunks += len(stored)
            self._events.append(ChunkEvent(EventKind.STORED, tier.name, tuple(stored)))

    def adopt(self, tier_name: str, keys: Sequence[bytes]) -> list[bytes]:
        """Register chunks a persistent tier still holds after a restart (``Backend.recover``).

        Returns the keys that did not fit the tier's budget; the caller deletes them.
        """
        tier = self._by_name[tier_name]
        fresh = [k for k in dict.fromkeys(keys) if k not in tier.ready and k not in tier.storing]
        fit = min(len(fresh), len(tier.free_slots))
        adopted, extra = fresh[:fit], fresh[fit:]
        tier.ready.update(zip(adopted, tier.take_slots(fit)))
        tier.policy.insert_many(adopted)
        return extra

    def learn(self, tier_name: str, keys: Sequence[bytes]) -> None:
        """Record that a shared tier holds ``keys`` (an answer to an asynchronous lookup).

        The oldest knowledge is forgotten when the bound is reached; nothing is deleted.
        """
        tier = self._by_name[tier_name]
        fresh = [k for k in dict.fromkeys(keys) if k not in tier.ready and k not in tier.storing]
        shortfall = len(fresh) - len(tier.free_slots)
        if shortfall > 0:
            tier.evict(shortfall)
        fit = min(len(fresh), len(tier.free_slots))
        tier.ready.update(zip(fresh[:fit], tier.take_slots(fit)))
        tier.policy.insert_many(fresh[:fit][::-1])

    def forget(self, tier_name: str, keys: Sequence[bytes]) -> None:
        """Forget what a shared tier was said to hold (nothing is deleted; pinned keys stay)."""
        tier = self._by_name[tier_name]
        for key in keys:
            if key in tier.ready and key not in tier.pins:
                tier.free_slots.append(tier.ready.pop(key))
                tier.policy.remove(key)

    def hold(self, keys: Sequence[bytes]) -> list[bytes]:
        """Pin the leading ``keys`` the host tier holds (READY or STORING) for a hand-off.

        Stops at the first key the host tier lacks (a hand-off is a prefix).
        Held chunks are never evicted; :meth:`complete_load` releases them.
        """
        host = self.host
        held: list[bytes] = []
        for key in keys:
            if key not in host.ready and key not in host.storing:
                break
            host.pins[key] = host.pins.get(key, 0) + 1
            held.append(key)
        return held

    def host_slots(self, keys: Sequence[bytes]) -> list[int]:
        """The host slot of each key (READY or STORING); KeyError for a key it lacks.

        A held key's slot is stable until the hold ends (P/D hand-off params name them).
        """
        host = self.host
        return [host.ready[k] if k in host.ready else host.storing[k] for k in keys]

    def shared_tiers(self) -> list[str]:
        return [t.name for t in self.lower if t.spec.shared]

    def take_deletes(self) -> dict[str, list[bytes]]:
        """Keys each lower tier's backend must delete (drained)."""
        out = {name: keys for name, keys in self._deletes.items() if keys}
        for name in out:
            self._deletes[name] = []
        return out

