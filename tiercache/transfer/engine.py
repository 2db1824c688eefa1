"""The TransferEngine: executes load and store jobs on the worker side; never decides.

Input is :class:`TransferJobSpec` (built by the scheduler-side connector from
the manager's plans); output is one :class:`~tiercache.backend.JobResult` per
job, failures included. Submission never blocks; :meth:`poll` collects what has
finished. The engine owns the host tier's slab and the device copier.

Fault injection (``faults`` in the config, or ``TIERCACHE_FAULTS__FAIL_LOADS=1``)
lives here, on the real path: ``fail_loads`` makes every load a failed job
(vLLM must recompute), ``corrupt_loads`` zeroes the blocks a load wrote (the
negative control of the correctness tests: the output must change).

Threading: every method is called from the worker's main thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tiercache.backend import JobResult
from tiercache.transfer.host_slab import HostTier
from tiercache.config.schema import FaultConfig
from tiercache.transfer.device import BlockCopier, CopyJob, CopySegment, Direction, make_copier, zero_blocks
from tiercache.layout import KVBlockLayout, SlotLayout, slab_planes

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TransferJobSpec:
    """One job: ``keys[i]`` moves between host slot and engine blocks per ``segments[i]``."""

    job_id: int
    req_id: str
    direction: Direction
    keys: tuple[bytes, ...]
    segments: tuple[CopySegment, ...]

    def block_ids(self) -> list[int]:
        return [b for seg in self.segments for b in seg.block_ids]


class TransferEngine:
    """Owns the host slab and the copier; turns job specs into copies and results."""

    def __init__(
        self,
        layout: KVBlockLayout,
        blocks_per_chunk: int,
        num_slots: int,
        faults: FaultConfig | None = None,
        host: HostTier | None = None,
        copy_threads: int | None = None,
        prefault_host: bool = False,
        huge_host: bool = False,
        slot_layout: SlotLayout = "slots",
    ) -> None:
        self.layout = layout
        self.blocks_per_chunk = blocks_per_chunk
        self.host = host or HostTier(num_slots, layout.slot_bytes(blocks_per_chunk), prefault=prefault_host,
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
            layout, self.host.slab, blocks_per_chunk, copy_threads=copy_threads, planes=self.planes
        )
        self.faults = faults or FaultConfig()
        self._inflight: dict[int, TransferJobSpec] = {}
        self._failed_now: list[JobResult] = []

    def submit(self, spec: TransferJobSpec) -> None:
        """Start a job; its result arrives through :meth:`poll`."""
        if spec.direction == "load" and self.faults.fail_loads:
            self._failed_now.append(JobResult(spec.job_id, (), spec.keys, 0, 0.0))
            return
        self._inflight[spec.job_id] = spec
        try:
            self.copier.submit(CopyJob(spec.job_id, spec.direction, spec.segments))
        except Exception as exc:  # noqa: BLE001 - a copy that cannot start is a failed job
            del self._inflight[spec.job_id]
            logger.warning("tiercache %s job %d not started: %s: %s", spec.direction, spec.job_id,
                           type(exc).__name__, exc)
            self._failed_now.append(JobResult(spec.job_id, (), spec.keys, 0, 0.0))

    def fence_stores(self) -> None:
        """Block reuse barrier: call before a forward pass may overwrite engine blocks."""
        self.copier.fence_stores()

    def poll(self) -> list[JobResult]:
        return self._collect(self.copier.poll())

    def wait_all(self) -> list[JobResult]:
        return self._collect(self.copier.wait_all())

    def _collect(self, finished: list) -> list[JobResult]:
        results, self._failed_now = self._failed_now, []
        for done in finished:
            spec = self._inflight.pop(done.job_id)
            if not done.ok:
                logger.warning("tiercache %s job %d failed: %s", spec.direction, spec.job_id, done.error)
                results.append(JobResult(spec.job_id, (), spec.keys, 0, done.secs))
                continue
            if spec.direction == "load" and self.faults.corrupt_loads:
                zero_blocks(self.layout, spec.block_ids())
            results.append(JobResult(spec.job_id, spec.keys, (), done.bytes, done.secs))
        return results

    def shutdown(self) -> None:
        self.copier.close()
        self.host.close()
