"""The server's tier pump: moves chunk bytes between the host slab and the lower tiers.

:class:`TierPump` is the only code on the server that submits backend jobs and
polls backends. Each round (:meth:`TierPump.pump_once`) it sends the
manager's queued deletes to their backends, starts the write-through/write-back
demotions the manager plans, and polls every backend, reporting finished
demotions to the manager and finished staged reads to the get waiting for
them. :meth:`TierPump.stage` starts the staged reads of a get (lower-tier
hits read into host staging slots). :meth:`TierPump.run` repeats rounds until
:meth:`TierPump.stop`; :meth:`TierPump.flush` runs them until nothing is in flight.

Only :class:`~tiercache.server.store.ChunkStore` creates and calls a pump;
the store owns the manager, the slab and the backends it is handed, and the
pump counts tier failures into the store's ``counters``.

Threading: the event loop thread only; the manager is never locked. Backends
run their own I/O threads on the slot views they are given, and drop them
when they report the job.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass

from tiercache.backend import Backend
from tiercache.manager.offloading import OffloadingManager
from tiercache.server.slab import Slab

logger = logging.getLogger(__name__)

_IDLE_PUMP_S = 0.05
_BUSY_PUMP_S = 0.0005


@dataclass
class _TierJob:
    kind: str  # "demote" or "stage"
    tier: str
    keys: tuple[bytes, ...]
    future: asyncio.Future[set[bytes]] | None = None  # stage: resolves to the failed keys


class TierPump:
    def __init__(
        self, manager: OffloadingManager, backends: dict[str, Backend], slab: Slab,
        counters: dict[str, int],
    ) -> None:
        self.manager = manager
        self.backends = backends
        self.slab = slab
        self.counters = counters
        self._jobs: dict[int, _TierJob] = {}
        self._job_ids = itertools.count(1)
        self._wake: asyncio.Event | None = None
        self._stopping = False

    async def stage(self, staged: list[tuple[bytes, str, int]]) -> set[bytes]:
        """Read lower-tier chunks into their host staging slots; the keys that failed."""
        by_tier: dict[str, list[tuple[bytes, int]]] = {}
        for key, tier, slot in staged:
            by_tier.setdefault(tier, []).append((key, slot))
        futures = []
        loop = asyncio.get_running_loop()
        for tier, items in by_tier.items():
            keys = tuple(k for k, _ in items)
            fut: asyncio.Future[set[bytes]] = loop.create_future()
            job_id = next(self._job_ids)
            self._jobs[job_id] = _TierJob("stage", tier, keys, fut)
            try:
                self.backends[tier].submit_get(job_id, list(keys), [self.slab.slot(s) for _, s in items])
            except Exception:
                logger.exception("server tier %s: a staged read failed to start", tier)
                del self._jobs[job_id]
                fut.set_result(set(keys))
            futures.append(fut)
        self.wake()
        results = await asyncio.gather(*futures)
        return set().union(*results)

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def run(self) -> None:
        """Deletes, demotions and backend polling, until :meth:`stop`."""
        self._wake = asyncio.Event()
        while not self._stopping:
            busy = self.pump_once()
            if busy:
                await asyncio.sleep(_BUSY_PUMP_S)
                continue
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), _IDLE_PUMP_S)
            except asyncio.TimeoutError:
                pass

    def pump_once(self) -> bool:
        """One round; True while backend jobs are in flight."""
        manager = self.manager
        for tier, keys in manager.deletes.take().items():
            try:
                self.backends[tier].delete(keys)
            except Exception:
                logger.exception("server tier %s: deleting %d chunks failed", tier, len(keys))
        if self.backends:
            for plan in manager.cascade.prepare_demotions():
                job_id = next(self._job_ids)
                self._jobs[job_id] = _TierJob("demote", plan.tier, plan.keys)
                try:
                    self.backends[plan.tier].submit_put(
                        job_id, list(plan.keys), [self.slab.slot(s) for s in plan.host_slots]
                    )
                except Exception:
                    logger.exception("server tier %s: a demotion failed to start", plan.tier)
                    del self._jobs[job_id]
                    manager.cascade.complete_demotion(plan.tier, plan.keys, failed=set(plan.keys))
        for name, backend in self.backends.items():
            try:
                results = backend.poll()
            except Exception:
                logger.exception("server tier %s: poll failed", name)
                continue
            for result in results:
                job = self._jobs.pop(result.job_id, None)
                if job is None:
                    continue
                if result.failed_keys:
                    self.counters["tier_failures"] += len(result.failed_keys)
                if job.kind == "demote":
                    manager.cascade.complete_demotion(job.tier, job.keys, failed=set(result.failed_keys))
                elif job.future is not None and not job.future.done():
                    job.future.set_result(set(result.failed_keys))
        manager.events.take()  # nobody subscribes on the server; keep the list bounded
        return bool(self._jobs)

    async def flush(self, timeout: float) -> bool:
        """Copy everything queued down to the lower tiers and wait for every job; True if done.

        ``pump_once`` plans the next demotions itself, so the queue is empty
        once a round ends with no job in flight.
        """
        deadline = time.monotonic() + timeout
        while self.pump_once():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(_BUSY_PUMP_S)
        return True

    def stop(self) -> None:
        self._stopping = True
        self.wake()
