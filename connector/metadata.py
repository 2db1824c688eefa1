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

from tiercache.pd.peer_tier import PeerChunk
from tiercache.connector.pd.scheduler_role import DirectHold
from tiercache.transfer.pipeline import DemoteJobSpec
from tiercache.transfer.engine import TransferJobSpec


@dataclass
class TierCacheConnectorMetadata(KVConnectorMetadata):
    loads: list[TransferJobSpec] = field(default_factory=list)
    stores: list[TransferJobSpec] = field(default_factory=list)
    # sync: the loads must be complete before this step's forward pass reads them;
    # async: their requests wait off the batch until get_finished reports them.
    loads_are_sync: bool = False
    # load job id -> per key: the lower tier it is staged from, or None (host tier)
    staging: dict[int, tuple[str | None, ...]] = field(default_factory=dict)
    # blocks promised to vLLM that could not be planned (no staging slot): recompute
    invalid_block_ids: list[int] = field(default_factory=list)
    demotes: list[DemoteJobSpec] = field(default_factory=list)
    deletes: dict[str, list[bytes]] = field(default_factory=dict)
    # P/D consumer: which producer slot holds each key this step loads from the peer tier
    peer_sources: dict[bytes, PeerChunk] = field(default_factory=dict)
    # P/D producer: hand-offs are held (the worker keeps its UCX progressed for consumers' READs)
    handoffs_held: bool = False
    # P/D producer, mode direct: request id -> keys and device blocks the worker marks held
    # after this step's forward pass; requests whose marks it clears (no hand-off after all:
    # vLLM frees their blocks itself); hand-offs whose tags every worker clears now and reports
    # (expired, or a notice some worker missed), after which the scheduler unpins their blocks
    direct_holds: dict[str, DirectHold] = field(default_factory=dict)
    direct_unmarks: list[str] = field(default_factory=list)
    direct_released: list[str] = field(default_factory=list)
    # async loads that failed before a job existed (an exception at planning): the worker
    # reports them finished at once (their blocks are in invalid_block_ids), so none waits forever
    failed_recvs: list[str] = field(default_factory=list)
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
    # P/D producer: request id -> the workers (TP ranks) whose consumer finished reading its hand-off
    handoffs_read: dict[str, set[int]] = field(default_factory=dict)
    # P/D producer, mode direct: request id -> the workers (TP ranks) that cleared its blocks' tags
    blocks_released: dict[str, set[int]] = field(default_factory=dict)
    # P/D consumer: its NIXL READs from producers, (metric path, bytes, seconds) each
    transfers: list[tuple[str, int, float]] = field(default_factory=list)
    # faults the worker's process contained since its last report, by reason (tiercache/faults.py)
    faults: dict[str, int] = field(default_factory=dict)
    # (pp_rank, tp_rank) -> namespace_check.WorkerIdentity, sent only while the scheduler asks for it
    namespace_reports: dict[tuple[int, int], Any] = field(default_factory=dict)

    def add(self, job_id: int, failed_keys: tuple[bytes, ...], num_bytes: int, secs: float) -> None:
        self.done[job_id] = JobReport(1, set(failed_keys), num_bytes, secs)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TierCacheWorkerMetadata)
        _merge_ranks(self.handoffs_read, other.handoffs_read)
        self.transfers += other.transfers
        for reason, n in other.faults.items():
            self.faults[reason] = self.faults.get(reason, 0) + n
        self.namespace_reports.update(other.namespace_reports)
        _merge_ranks(self.blocks_released, other.blocks_released)
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


def _merge_ranks(into: dict[str, set[int]], other: dict[str, set[int]]) -> None:
    """Union per request id of the TP ranks that reported it."""
    for rid, ranks in other.items():
        into.setdefault(rid, set()).update(ranks)
