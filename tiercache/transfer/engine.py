"""The TransferEngine: executes load and store jobs on the worker side; never decides.

Input is a :class:`~tiercache.jobs.LoadJob` whose chunks all sit in host
slots (the pipeline has staged the others, or handed them to a reader) or a
:class:`~tiercache.jobs.StoreJob`; output is one
:class:`~tiercache.backend.JobResult` per job, failures included. Submission never blocks; :meth:`poll` collects what has
finished. The engine owns the host tier's slab and the device copier.

Fault injection (``faults`` in the config, or ``TIERCACHE_FAULTS__FAIL_LOADS=1``)
lives here, on the real path: ``fail_loads`` makes every load a failed job
(vLLM must recompute), ``corrupt_loads`` zeroes the blocks a load wrote (the
negative control of the correctness tests: the output must change).

Threading: every method is called from the worker's main thread.
"""

from __future__ import annotations

import logging

import torch

from tiercache.backend import JobResult
from tiercache.config.schema import FaultConfig
from tiercache.jobs import LoadJob, TransferJob
from tiercache.layout import KVBlockLayout, SlotLayout, slab_planes
from tiercache.transfer.copiers import make_copier
from tiercache.transfer.cuda_batch import CopyMethod
from tiercache.transfer.device import BlockCopier, CopyJob, Direction, zero_blocks
from tiercache.transfer.host_slab import HostSlab

logger = logging.getLogger(__name__)


class TransferEngine:
    """Owns the host slab and the copier; turns load and store jobs into copies and results."""

    def __init__(
        self,
        layout: KVBlockLayout,
        blocks_per_chunk: int,
        num_slots: int,
        faults: FaultConfig | None = None,
        host: HostSlab | None = None,
        copy_threads: int | None = None,
        prefault_host: bool = False,
        huge_host: bool = False,
        slot_layout: SlotLayout = "slots",
        cuda_copy: CopyMethod = "auto",
        kv_groups: int = 1,
    ) -> None:
        self.layout = layout
        self.blocks_per_chunk = blocks_per_chunk
        self.host = host or HostSlab(num_slots, layout.slot_bytes(blocks_per_chunk), prefault=prefault_host,
                                     huge_pages=huge_host)
        if self.host.slot_bytes != layout.slot_bytes(blocks_per_chunk):
            raise ValueError(
                f"host tier slot is {self.host.slot_bytes} bytes, the engine's chunk is "
                f"{layout.slot_bytes(blocks_per_chunk)} bytes"
            )
        # layout planes: the slab as one plane of pages per region (tiercache.layout), else None
        self.planes: tuple[torch.Tensor, ...] | None = (
            slab_planes(self.host.slab, layout.page_bytes, blocks_per_chunk) if slot_layout == "planes" else None
        )
        self.copier: BlockCopier = make_copier(
            layout, self.host.slab, blocks_per_chunk, copy_threads=copy_threads, planes=self.planes,
            cuda_copy=cuda_copy,
        )
        self.faults = faults or FaultConfig()
        self.group_blocks = blocks_per_chunk // kv_groups  # a chunk slot holds kv_groups runs of these
        self._inflight: dict[int, TransferJob] = {}
        self._failed_now: list[JobResult] = []
        self._corrupted: set[int] = set()  # loads corrupt_loads zeroed when ordered before compute

    def submit(self, job: TransferJob) -> None:
        """Start a job; its result arrives through :meth:`poll`. A load's chunks must all sit in host slots."""
        load = isinstance(job, LoadJob)
        if load and self.faults.fail_loads:
            self._failed_now.append(JobResult(job.job_id, (), job.keys, 0, 0.0))
            return
        self._inflight[job.job_id] = job
        direction: Direction = "load" if load else "store"
        try:
            segments = job.segments
            if any(seg.slot < 0 for seg in segments):
                raise ValueError("a chunk without a host slot reached the copier")
            self.copier.submit(CopyJob(job.job_id, direction, segments))
        except Exception as exc:  # noqa: BLE001 - a copy that cannot start is a failed job
            del self._inflight[job.job_id]
            logger.warning("tiercache %s job %d not started: %s: %s", direction, job.job_id,
                           type(exc).__name__, exc)
            self._failed_now.append(JobResult(job.job_id, (), job.keys, 0, 0.0))

    @property
    def orders_on_device(self) -> bool:
        """Whether loads can be ordered before the engine's compute without a host wait (CUDA)."""
        return self.copier.orders_on_device

    def order_before_compute(self, job_ids: set[int]) -> None:
        """The engine's next kernels run after these loads' copies (only where :attr:`orders_on_device`)."""
        if job_ids:
            self.copier.order_before_compute(job_ids)
            if self.faults.corrupt_loads:  # the negative control, ordered like the loads themselves
                for job_id in job_ids:
                    job = self._inflight.get(job_id)
                    if isinstance(job, LoadJob):
                        zero_blocks(self.layout, job.block_ids())
                        self._corrupted.add(job_id)

    def poll(self) -> list[JobResult]:
        return self._collect(self.copier.poll())

    def wait_all(self) -> list[JobResult]:
        return self._collect(self.copier.wait_all())

    def _collect(self, finished: list) -> list[JobResult]:
        results, self._failed_now = self._failed_now, []
        for done in finished:
            job = self._inflight.pop(done.job_id)
            load = isinstance(job, LoadJob)
            if not done.ok:
                logger.warning("tiercache %s job %d failed: %s", "load" if load else "store", job.job_id, done.error)
                results.append(JobResult(job.job_id, (), job.keys, 0, done.secs))
                continue
            if load and self.faults.corrupt_loads and done.job_id not in self._corrupted:
                zero_blocks(self.layout, job.block_ids())
            if load and self.faults.corrupt_loads_group is not None:
                zero_blocks(self.layout, self._group_blocks(job, self.faults.corrupt_loads_group))
            self._corrupted.discard(done.job_id)
            results.append(JobResult(job.job_id, job.keys, (), done.bytes, done.secs))
        return results

    def _group_blocks(self, job: LoadJob, group: int) -> list[int]:
        """The blocks of ``job`` that belong to KV-cache group ``group`` (chunk positions ``group * n ..``)."""
        n = self.group_blocks
        return [b for seg in job.segments if seg.first_block // n == group for b in seg.block_ids]

    def shutdown(self) -> None:
        self.copier.close()
        self.host.close()
