"""What crosses the scheduler/worker process boundary each engine step.

Scheduler -> worker: :class:`TierCacheConnectorMetadata` (the step's load and
store jobs). Worker -> scheduler: :class:`TierCacheWorkerMetadata` (finished
jobs, summed over the workers of a TP group by ``aggregate``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from tiercache.jobs import DemoteJob, LoadJob, StoreJob

from tiercache.connector.pd.step import PDStepMeta, PDWorkerReport


@dataclass
class TierCacheConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    # sync: the loads must be complete before this step's forward pass reads them;
    # async: their requests wait off the batch until get_finished reports them.
    loads_are_sync: bool = False
    # blocks promised to vLLM that could not be planned (no staging slot): recompute
    invalid_block_ids: list[int] = field(default_factory=list)
    demotes: list[DemoteJob] = field(default_factory=list)
    deletes: dict[str, list[bytes]] = field(default_factory=dict)
    # P/D producer's instructions (tiercache.connector.pd.step); None when P/D is off
    pd: PDStepMeta | None = None
    # async loads that failed before a job existed (an exception at planning): the worker
    # reports them finished at once (their blocks are in invalid_block_ids), so none waits forever
    failed_recvs: list[str] = field(default_factory=list)
    # a hybrid model's requests whose load failed in part (vLLM takes no failed blocks for several
    # KV-cache groups): the worker reports them failed; finished once their job ends
    failed_loads: list[str] = field(default_factory=list)
    # False while the scheduler waits for the workers' identities in their step reports
    # (connector/namespace_check.py, the fallback when vLLM's start-up handshake did not bring them)
    namespace_settled: bool = True


@dataclass
class JobReport:
    """A finished job as seen by ``reports`` workers so far."""

    reports: int
    failed_keys: set[bytes]
    bytes: int
    secs: float


@dataclass
class TierCacheWorkerMetadata(KVConnectorWorkerMetadata):
    done: dict[int, JobReport] = field(default_factory=dict)
    # what P/D saw (read notices, released blocks, READ figures); empty when P/D is off
    pd: PDWorkerReport = field(default_factory=PDWorkerReport)
    # faults the worker's process contained since its last report, by reason (tiercache/faults.py)
    faults: dict[str, int] = field(default_factory=dict)
    # (pp_rank, tp_rank) -> namespace_check.WorkerIdentity, sent only while the scheduler asks for it
    namespace_reports: dict[tuple[int, int], Any] = field(default_factory=dict)
    # bytes of the worker's host tier page-locked (0: pageable), sent once, after register_kv_caches
    host_pinned_bytes: int | None = None

    def add(self, job_id: int, failed_keys: tuple[bytes, ...], num_bytes: int, secs: float) -> None:
        self.done[job_id] = JobReport(1, set(failed_keys), num_bytes, secs)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TierCacheWorkerMetadata)
        self.pd.merge(other.pd)
        for reason, n in other.faults.items():
            self.faults[reason] = self.faults.get(reason, 0) + n
        self.namespace_reports.update(other.namespace_reports)
        if other.host_pinned_bytes is not None:
            self.host_pinned_bytes = (self.host_pinned_bytes or 0) + other.host_pinned_bytes
        for job_id, rep in other.done.items():
            mine = self.done.get(job_id)
            if mine is None:
                self.done[job_id] = JobReport(rep.reports, set(rep.failed_keys), rep.bytes, rep.secs)
            else:
                mine.reports += rep.reports
                mine.failed_keys |= rep.failed_keys
                mine.bytes += rep.bytes
                mine.secs = max(mine.secs, rep.secs)
        return self

