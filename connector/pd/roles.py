"""The seam between the connector and P/D: one role object per connector half, a null object when P/D is off.

The scheduler half (:class:`~tiercache.connector.scheduler.TierCacheScheduler`)
holds a :class:`SchedulerPD`, the worker half
(:class:`~tiercache.connector.worker.TierCacheWorker`) a :class:`WorkerPD`,
and call their hooks unconditionally: with P/D off they are :class:`SchedulerPD`
and :class:`WorkerPD` themselves, whose hooks do nothing and change nothing.
With P/D on (``kv_producer``, ``kv_consumer``, or ``kv_both`` with a ``pd``
section) they are :class:`tiercache.connector.pd.scheduler_role.PDScheduler`
and :class:`tiercache.connector.pd.worker_role.PDWorker`.

Scheduler hooks, in the order of a request's life: :meth:`SchedulerPD.lookup`
(before the manager's lookup), :meth:`~SchedulerPD.load_tail` and
:meth:`~SchedulerPD.reader_source` and :meth:`~SchedulerPD.keeps` (while planning a load, in
``update_state_after_alloc``: where each chunk is, whether the load is stored again), :meth:`~SchedulerPD.store_tail`,
:meth:`~SchedulerPD.states_offered` and :meth:`~SchedulerPD.scheduled` (while planning the step's stores),
:meth:`~SchedulerPD.step_meta` (the step's ``pd`` field),
:meth:`~SchedulerPD.report` and :meth:`~SchedulerPD.load_finished` (worker
reports), :meth:`~SchedulerPD.finished` (vLLM's ``request_finished``).

Worker hooks: :meth:`WorkerPD.host_slab` (how the host slab is made),
:meth:`WorkerPD.register` (after the KV caches: the block readers it adds to
the pipeline), :meth:`WorkerPD.before_loads`, :meth:`WorkerPD.before_stores`,
:meth:`WorkerPD.after_stores`,
:meth:`WorkerPD.poll` (every ``get_finished``), :meth:`WorkerPD.job_done`
(every finished job), :meth:`WorkerPD.close`.

Threading: a scheduler role on vLLM's scheduler thread, a worker role on the
worker's main thread, like the halves that hold them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tiercache.connector.pd.step import PDStepMeta, PDWorkerReport
from tiercache.connector.prompt_tail import PromptTail
from tiercache.connector.state_chunks import StateOffers

from tiercache.backend import JobResult
from tiercache.config.schema import PDConfig
from tiercache.jobs import FromReader, LoadChunk, LoadJob, StoreJob
from tiercache.layout import SlotLayout

if TYPE_CHECKING:
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request

    from tiercache.keys import KeySpace
    from tiercache.layout import KVBlockLayout
    from tiercache.transfer.engine import TransferEngine
    from tiercache.transfer.pipeline import BlockReader, WorkerPipeline

#: a request's block ids per KV-cache group (vLLM's ``get_block_ids`` / ``request_finished_all_groups``)
GroupBlockIds = Sequence[Sequence[int]]

PRODUCER_ROLES = ("kv_producer", "kv_both")
CONSUMER_ROLES = ("kv_consumer", "kv_both")


def pd_settings(kv_role: str, pd: PDConfig | None) -> PDConfig | None:
    """The P/D settings in force for this role (None: no P/D at all)."""
    if kv_role in ("kv_producer", "kv_consumer"):
        return pd or PDConfig()
    return pd  # kv_both: only when configured


class SchedulerPD:
    """The scheduler's P/D role with P/D off: every hook is a no-op."""

    keeps_received = True  # a load's chunks are offered to the host tier again afterwards

    def keeps(self, chunks: Sequence[LoadChunk]) -> bool:
        """A load of these chunks is offered to the host tier again afterwards (P/D: only verified hand-offs)."""
        return self.keeps_received

    def bind(self, kv_cache_manager: KVCacheManager) -> None:
        """vLLM's KV-cache manager, for the block pins of mode direct."""

    def lookup(self, request: Request, keys: list[bytes]) -> bytes | None:
        """Before the manager's lookup: learn the request's hand-off; its tail key, if it has one."""
        return None

    def load_tail(self, request: Request, chunks: int) -> bytes | None:
        """The tail key a load that reaches chunk ``chunks`` (the prompt's end) loads too."""
        return None

    def reader_source(self, key: bytes, source: FromReader) -> FromReader:
        """A direct tier's chunk ``key`` with its reader's address filled in."""
        return source

    def store_tail(self, request: Request) -> PromptTail | None:
        """A producer's prompt tail to store with the prompt's chunks (via_host)."""
        return None

    def scheduled(self, request: Request, num_new: int) -> None:
        """A request gets ``num_new`` tokens computed this step."""

    def states_offered(self, offers: StateOffers, request_of: Callable[[str], Request | None]) -> None:
        """A state-layer model's states vLLM offered this step, before :meth:`scheduled`
        (connector/state_chunks.py; mode direct pins a hand-off's: connector/pd/state_handoff.py)."""

    def preempted(self, request_id: str) -> None:
        """Its blocks go back to vLLM."""

    def step_meta(self) -> PDStepMeta | None:
        """The step's ``pd`` field (expires unread hand-offs, publishes the P/D metrics)."""
        return None

    def report(self, report: PDWorkerReport) -> None:
        """The workers' P/D report of a step."""

    def load_finished(self, keys: tuple[bytes, ...], failed: set[bytes]) -> None:
        """A load ended (its peer chunks are forgotten: the producer releases them)."""

    def finished(self, request: Request, tables: GroupBlockIds | None) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished_all_groups``: (delay freeing the blocks?, hand-off params)."""
        return False, None

    def has_pending(self) -> bool:
        """The engine must run another step for P/D's sake."""
        return False


@dataclass(frozen=True)
class HostSlabSettings:
    """How the worker makes its host slab (P/D's needs decide the defaults)."""

    prefault: bool
    huge_pages: bool
    layout: SlotLayout


class WorkerPD:
    """The worker's P/D role with P/D off: every hook is a no-op."""

    def host_slab(self, prefault: bool | None, layout: SlotLayout | None) -> HostSlabSettings:
        """The slab's settings: the configured ones, else plain slots, not prefaulted."""
        return HostSlabSettings(bool(prefault), False, layout or "slots")

    def register(self, kv_caches: dict[str, torch.Tensor], layout: KVBlockLayout, transfer: TransferEngine,
                 keyspace: KeySpace, num_blocks: int) -> dict[str, BlockReader]:
        """After the KV caches are known: the block readers P/D adds to the pipeline."""
        return {}

    def before_loads(self, meta: PDStepMeta | None, loads: Sequence[LoadJob], report: PDWorkerReport) -> None:
        """``start_load_kv``, before the step's loads are submitted."""

    def before_stores(self, meta: PDStepMeta | None, stores: Sequence[StoreJob]) -> None:
        """``wait_for_save``, before the step's stores are submitted."""

    def after_stores(self, stores: Sequence[StoreJob], pipeline: WorkerPipeline) -> list[JobResult]:
        """``wait_for_save``, once the step's stores are submitted; results it waited for, if any."""
        return []

    def poll(self, report: PDWorkerReport) -> None:
        """Every ``get_finished``: what the P/D side heard since (read notices, READ figures)."""

    def job_done(self, result: JobResult) -> None:
        """A job of the pipeline finished."""

    def close(self) -> None:
        """Shut down what P/D started."""


__all__ = ["CONSUMER_ROLES", "PRODUCER_ROLES", "HostSlabSettings", "SchedulerPD", "WorkerPD",
           "pd_settings"]
