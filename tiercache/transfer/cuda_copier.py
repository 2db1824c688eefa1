"""CudaStreamCopier: one batched copy per job on dedicated CUDA streams, ordered and timed by events.

See tiercache/transfer/device.py for the ordering contract it implements. Per job:

1. an event recorded on the compute stream at submit time, which the job's
   stream (stores or loads) waits on: a store reads the KV the forward pass
   just wrote, a load writes blocks nothing before it still reads;
2. a start event, the job's copies (a :class:`~tiercache.transfer.copy_plan.CopyPlan`
   run by one executor of :mod:`tiercache.transfer.cuda_batch`: a few calls
   per job, whatever its page count), a done event;
3. :meth:`poll` queries done events without blocking; a job's time is the
   CUDA-event time between start and done (what the device spent, not
   how long the host took to notice);
4. :meth:`order_before_compute` makes the compute stream wait on given loads'
   done events: vLLM's next kernels run after the blocks hold their KV, and the
   host never blocks for a host-tier hit.

Threading: worker main thread only (submit, poll, order_before_compute, close).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from tiercache.layout import KVBlockLayout
from tiercache.transfer.copy_plan import PlanGeometry, plan_copy
from tiercache.transfer.cuda_batch import CopyMethod, PlanExecutor, pick_executor
from tiercache.transfer.device import BlockCopier, CopyDone, CopyJob, check_segment, copy_segments


@dataclass(slots=True)
class _InFlight:
    job: CopyJob
    start: torch.cuda.Event
    done: torch.cuda.Event
    moved: int
    error: str
    submitted: float


class CudaStreamCopier(BlockCopier):
    """Copies on dedicated CUDA streams, ordered against the compute stream by events."""

    def __init__(self, layout: KVBlockLayout, slab: torch.Tensor, blocks_per_chunk: int,
                 planes: Sequence[torch.Tensor] | None = None, method: CopyMethod = "auto") -> None:
        super().__init__(layout, slab, blocks_per_chunk, planes)
        device = layout.device
        self.executor: PlanExecutor | None = pick_executor(method, layout, slab)
        self.method = self.executor.name if self.executor is not None else "per_run"
        self._geometry = PlanGeometry.of(layout, slab, blocks_per_chunk, planes)
        self._store_stream = torch.cuda.Stream(device=device)
        self._load_stream = torch.cuda.Stream(device=device)
        self._inflight: deque[_InFlight] = deque()

    def _run(self, job: CopyJob) -> int:
        if self.executor is None:
            return copy_segments(self.layout, self.slab, self.blocks_per_chunk, job, non_blocking=True,
                                 planes=self.planes)
        for seg in job.segments:
            check_segment(self.layout, self.slab.shape[0], self.blocks_per_chunk, seg)
        return self.executor.run(plan_copy(self._geometry, job.direction == "store", job.segments))

    def submit(self, job: CopyJob) -> None:
        compute = torch.cuda.current_stream(self.layout.device)
        ready = torch.cuda.Event()
        ready.record(compute)
        stream = self._store_stream if job.direction == "store" else self._load_stream
        start = torch.cuda.Event(enable_timing=True)
        done = torch.cuda.Event(enable_timing=True)
        error = ""
        moved = 0
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            start.record(stream)
            try:
                moved = self._run(job)
            except Exception as exc:  # noqa: BLE001 - a failed copy is a failed job
                error = repr(exc)
            done.record(stream)
        self._inflight.append(_InFlight(job, start, done, moved, error, time.perf_counter()))

    def poll(self) -> list[CopyDone]:
        out: list[CopyDone] = []
        keep: deque[_InFlight] = deque()
        for item in self._inflight:
            if item.done.query():
                out.append(self._result(item))
            else:
                keep.append(item)
        self._inflight = keep
        return out

    @staticmethod
    def _result(item: _InFlight) -> CopyDone:
        try:
            secs = item.start.elapsed_time(item.done) / 1e3  # CUDA-event milliseconds
        except RuntimeError:  # an event that was never reached on the device (a failed submit)
            secs = time.perf_counter() - item.submitted
        return CopyDone(item.job.job_id, not item.error, item.moved, secs, item.error)

    def order_before_compute(self, job_ids: Iterable[int]) -> None:
        """The compute stream waits for these jobs' copies (no host wait); unknown or polled ids are done."""
        wanted = set(job_ids)
        compute = torch.cuda.current_stream(self.layout.device)
        for item in self._inflight:
            if item.job.job_id in wanted:
                compute.wait_event(item.done)

    @property
    def orders_on_device(self) -> bool:
        return True

    def wait_all(self) -> list[CopyDone]:
        self._store_stream.synchronize()
        self._load_stream.synchronize()
        return self.poll()

    def close(self) -> None:
        self.wait_all()
