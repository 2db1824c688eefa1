"""The cascade: what moves chunks between the host tier and the tiers below it.

A part of :class:`tiercache.manager.offloading.OffloadingManager` (reached as
``manager.cascade``), kept apart so each file holds one concern: offloading.py
the per-request flows (lookup, load, store), this file demotion (write-through
and write-back copies down), adopting a persistent tier's chunks after a
restart, and what a shared tier was learnt to hold (or forgotten).
It works on the tiers' directories it is given, pins through the shared
:class:`Holds`, and records events and deletes in the shared logs.
Same contract as the manager: scheduler thread only, no locks, no bytes touched.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from tiercache.events import EventKind, EventLog
from tiercache.manager.deletes import DeleteQueue
from tiercache.manager.directory import TierDirectory
from tiercache.manager.holds import Holds
from tiercache.manager.plans import DemotePlan


class Cascade:
    """Demotion (write-through/write-back), adopt after restart, learn/forget (shared tiers)."""

    def __init__(
        self, tiers: Sequence[TierDirectory], holds: Holds, events: EventLog, deletes: DeleteQueue
    ) -> None:
        """``tiers``: every tier, host first (the same directories the manager holds)."""
        self.host = tiers[0]
        self.lower = list(tiers[1:])
        self._by_name = {t.name: t for t in tiers}
        self._holds = holds
        self._events = events
        self._deletes = deletes
        self._write_through = [t for t in self.lower if t.spec.mode == "write_through"]
        # per write-through tier: host keys waiting to be copied down, pinned meanwhile
        self._demote_queue: dict[str, dict[bytes, None]] = {t.name: {} for t in self._write_through}
        # host keys not copied down until released: a live request's partial chunks (connector/
        # partial_chunks.py), each superseded within a few steps; only the one a request ends with goes down
        self._held_back: set[bytes] = set()
        self.write_back_watermark = 0.9

    # ------------------------------------------------------------ write-through queue
    def queue_stored(self, keys: Sequence[bytes]) -> None:
        """Queue chunks the host tier just stored for every write-through tier.

        Each queued host copy is pinned until copied down (or given up): the
        host tier must not evict a chunk before its write-through copy exists.
        """
        held_back = self._held_back
        for tier in self._write_through:
            queue = self._demote_queue[tier.name]
            fresh = [key for key in keys if key not in queue and key not in held_back]
            queue.update(dict.fromkeys(fresh))
            self._holds.hold(self.host, fresh)

    def hold_back(self, keys: Sequence[bytes]) -> None:
        """Keep ``keys`` (host stores being planned) from every lower tier until :meth:`release_held_back`
        or :meth:`drop_held_back`: neither write-through nor write-back copies them down meanwhile."""
        self._held_back.update(keys)

    def release_held_back(self, keys: Sequence[bytes]) -> None:
        """Copy held-back ``keys`` down like any stored chunk from now on: queued for write-through at
        once where the host tier holds them READY, when their store completes where it is in flight;
        nothing where the host tier lost them meanwhile. Keys never held back are ignored."""
        released = [key for key in keys if key in self._held_back]
        self._held_back.difference_update(released)
        ready = [key for key in released if key in self.host.ready]
        if ready:
            self.queue_stored(ready)

    def drop_held_back(self, keys: Collection[bytes]) -> None:
        """Forget that ``keys`` were held back (discarded: they will not be released)."""
        self._held_back.difference_update(keys)

    def copies_queued(self) -> bool:
        """Whether some write-through copy waits for a step to be planned."""
        return any(self._demote_queue.values())

    def drop_queued(self) -> None:
        """Give up every pending write-through copy (a reset); their host pins are released."""
        for queue in self._demote_queue.values():
            self._holds.release(list(queue))
            queue.clear()

    # ---------------------------------------------------------------------- demotion
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
                candidates = self._take_demote_queue(tier, max_keys)  # pinned when queued
            else:
                candidates = self._write_back_candidates(tier, max_keys)
                self._holds.hold(host, candidates)
            if not candidates:
                continue
            shortfall = len(candidates) - len(tier.free_slots)
            if shortfall > 0:
                evicted = tier.evict(shortfall)
                self._events.add(EventKind.REMOVED, tier.name, evicted)
                self._deletes.add(tier.name, evicted)
                fit = min(len(candidates), len(tier.free_slots))
                tier.stats.store_refused += len(candidates) - fit
                self._holds.release(candidates[fit:])  # given up
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
        self._holds.release(dropped)  # the pins taken when they were queued
        return out

    def _write_back_candidates(self, tier: TierDirectory, max_keys: int) -> list[bytes]:
        host = self.host
        if host.used_slots < self.write_back_watermark * host.spec.num_slots:
            return []
        out: list[bytes] = []
        for key in host.policy.candidates():  # coldest first
            if key not in tier.ready and key not in tier.storing and key not in host.pins \
                    and key not in self._held_back:
                out.append(key)
                if len(out) == max_keys:
                    break
        return out

    def complete_demotion(
        self, tier_name: str, keys: Sequence[bytes], failed: Collection[bytes] = ()
    ) -> None:
        """Finish a demotion: unpin the host copies; the lower copies become READY (or vanish)."""
        tier = self._by_name[tier_name]
        self._holds.release(keys)  # the host pins taken by prepare_demotions
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
            self._events.add(EventKind.STORED, tier.name, stored)

    # ------------------------------------------------- what a lower tier is known to hold
    def adopt(self, tier_name: str, keys: Sequence[bytes]) -> list[bytes]:
        """Register chunks a persistent tier still holds after a restart (``Backend.recover``).

        Returns the keys that did not fit the tier's budget; the caller deletes them.
        """
        tier = self._by_name[tier_name]
        fresh = self._unknown(tier, keys)
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
        fresh = self._unknown(tier, keys)
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

    @staticmethod
    def _unknown(tier: TierDirectory, keys: Sequence[bytes]) -> list[bytes]:
        """``keys`` (first occurrence of each) that ``tier`` neither holds nor is storing."""
        return [k for k in dict.fromkeys(keys) if k not in tier.ready and k not in tier.storing]
