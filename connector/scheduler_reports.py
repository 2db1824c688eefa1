"""The scheduler's side of the workers' reports: jobs closed in the manager, tier metrics synced.

A mixin of :class:`tiercache.connector.scheduler.TierCacheScheduler`:

* :meth:`update_connector_output` takes the step's merged worker report
  (connector/metadata.py ``TierCacheWorkerMetadata``): faults, pinned bytes,
  P/D reads, and per job the bytes, seconds and failed keys of each rank. A job
  is closed once every rank reported (``JobRecord.reports_left``): its store
  pins released (connector/store_pins.py), then :meth:`_finish_job`.
* :meth:`_finish_job` tells the manager: a load unpins its chunks (failed ones
  are dropped and offered for storing again once recomputed), a demotion lands
  or is given up, a store's chunks become READY or are dropped.
* :meth:`_sync_tier_metrics` (every step, from ``build_connector_meta``): each
  tier's used bytes, and the chunks each tier refused to store since the last
  step (``TierStats.store_refused``: every slot being written or pinned).

Threading: the scheduler thread, like the rest of the scheduler.
"""

from __future__ import annotations

from typing import Any

from tiercache.connector.engine_info import ChunkGeometry
from tiercache.connector.metadata import TierCacheWorkerMetadata
from tiercache.connector.scheduler_state import JobRecord, RequestState
from tiercache.connector.store_pins import StorePins

from tiercache.keys import KeySpace
from tiercache.manager.offloading import OffloadingManager
from tiercache.metrics import TierCacheMetrics


class SchedulerReports:
    """Closing jobs from the workers' reports; mixed into TierCacheScheduler (whose __init__ sets these fields)."""

    geometry: ChunkGeometry
    keys: KeySpace
    manager: OffloadingManager
    metrics: TierCacheMetrics
    store_pins: StorePins
    pd: Any
    _jobs: dict[int, JobRecord]
    _reqs: dict[str, RequestState]
    _refused_reported: dict[str, int]  # per tier: TierStats.store_refused already counted in the metrics

    def _count(self, name: str, value: float) -> None:
        raise NotImplementedError

    def update_connector_output(self, worker_meta: TierCacheWorkerMetadata | None) -> None:
        if worker_meta is None:
            return
        self.metrics.count_faults(worker_meta.faults)
        if worker_meta.host_pinned_bytes is not None:  # each worker's, once
            self.metrics.label(self.metrics.host_pinned_bytes).inc(worker_meta.host_pinned_bytes)
        self.pd.report(worker_meta.pd)
        for job_id, report in worker_meta.done.items():
            rec = self._jobs.get(job_id)
            if rec is None:
                continue
            rec.reports_left -= report.reports
            rec.failed |= report.failed_keys
            path = {"load": "host_to_device", "store": "device_to_host"}.get(rec.direction, f"host_to_{rec.owner}")
            self.metrics.observe_transfer(path, report.bytes, report.secs)
            self._count(f"{rec.direction}_bytes", report.bytes)
            self._count(f"{rec.direction}_secs", report.secs)
            if rec.reports_left > 0:
                continue
            del self._jobs[job_id]
            self.store_pins.release(job_id)  # a store's copies are done on every rank
            self._finish_job(rec)

    def _finish_job(self, rec: JobRecord) -> None:
        if rec.failed:
            self.metrics.label(self.metrics.failures, rec.direction).inc(len(rec.failed))
            self._count(f"failed_{rec.direction}_chunks", len(rec.failed))
        if rec.direction == "load":
            self.manager.complete_load(rec.keys, failed=rec.failed)
            self.pd.load_finished(rec.keys, rec.failed)
            if rec.failed:
                # A chunk that failed to load is dropped, so the recompute that vLLM now
                # schedules does not look it up and fail on it again (a livelock).
                self.manager.discard(list(rec.failed))
                st = self._reqs.get(rec.owner)
                if st is not None:  # stored again once vLLM recomputed them (else: misses for good)
                    st.reoffer(self.keys.chunk_keys(st.request.block_hashes), rec.failed)
            return
        if rec.direction == "demote":
            self.manager.cascade.complete_demotion(rec.owner, rec.keys, failed=rec.failed)
            return
        ok = [k for k in rec.keys if k not in rec.failed]
        self.manager.complete_store(ok, ok=True)
        if rec.failed:
            self.manager.complete_store(list(rec.failed), ok=False)

    def _sync_tier_metrics(self) -> None:
        for name, (used, _total) in self.manager.usage().items():
            self.metrics.label(self.metrics.used_bytes, name).set(used * self.geometry.slot_bytes)
        for name, stats in self.manager.stats().tiers.items():
            refused = stats.store_refused - self._refused_reported.get(name, 0)
            if refused > 0:  # (TierStats only grow; a counter must never be given less)
                self.metrics.label(self.metrics.store_refused, name).inc(refused)
            self._refused_reported[name] = stats.store_refused
