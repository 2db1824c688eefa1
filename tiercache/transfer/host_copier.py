"""HostThreadCopier: block copies for host-resident KV caches on background threads.

Jobs are split into parts that a couple of threads take from one queue; results
come back in submission order. See tiercache/transfer/device.py for the ordering contract.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiercache.layout import KVBlockLayout
from tiercache.transfer.copy_plan import PlanGeometry, plan_copy, run_plan_on_host
from tiercache.transfer.device import (
    BlockCopier,
    CopyDone,
    CopyJob,
    check_segment,
    default_copy_threads,
)
from tiercache.transfer.host_gather import HostSegmentCopier
from tiercache.transfer.host_kernel import run_kernel

logger = logging.getLogger(__name__)


@dataclass
class _JobProgress:
    """A submitted job while its parts (slices of its segments) are being copied."""

    job: CopyJob
    parts: int
    moved: int = 0
    error: str = ""
    start: float = math.inf
    end: float = 0.0

    def result(self) -> CopyDone:
        secs = max(0.0, self.end - self.start)
        if self.error:
            return CopyDone(self.job.job_id, False, 0, secs, self.error)
        return CopyDone(self.job.job_id, True, self.moved, secs)


class HostThreadCopier(BlockCopier):
    """Copies on background threads; results are reported in submission order.

    A job's segments are split into up to ``threads`` parts that the threads
    take from one ``queue.SimpleQueue``; jobs in flight therefore also run side
    by side. One thread copying with regular stores gets about half of what
    the memory system gives two (a single big ``memcpy`` gets as much as two
    through non-temporal stores), hence two threads by default; they help only
    where a second core is free. The numpy copies release the GIL (see
    ``GIL_FREE_ITEMS``); each part costs about ten microseconds of Python.

    With the copy kernel (:mod:`tiercache.transfer.host_kernel`, opt-in), a thread
    that finds more parts queued takes them too, up to ``BATCH_BYTES``, and
    copies them as one job per direction (one plan, one call): the small jobs
    of a step (64-256 KiB chunks) then share the per-job cost of one. Parts in
    flight were never ordered among themselves (two threads run them side by
    side), so a batch orders nothing that was ordered; each part is still
    reported on its own, with its own bytes.

    Results are released in submission order, so :meth:`poll` is FIFO.
    """

    def __init__(
        self,
        layout: KVBlockLayout,
        slab: torch.Tensor,
        blocks_per_chunk: int,
        threads: int | None = None,
        planes: Sequence[torch.Tensor] | None = None,
    ) -> None:
        super().__init__(layout, slab, blocks_per_chunk, planes)
        # The copy plan run by the rep-movsb kernel where it works (tiercache.transfer.host_kernel) for
        # batches of parts and parts of KERNEL_MIN_BYTES and more; numpy gathers per slot for smaller
        # single parts (less Python per job); the plan with one memmove per run where neither applies
        # (no kernel, and layout planes or pages the gathers cannot address).
        self._kernel = run_kernel() if _host_resident(layout, slab, planes) else None
        self._segment_copier = None if planes is not None else HostSegmentCopier.build(layout, slab, blocks_per_chunk)
        self._geometry = PlanGeometry.of(layout, slab, blocks_per_chunk, planes)
        self._block_bytes = sum(layout.page_bytes)  # bytes one block id moves
        self.threads = threads or default_copy_threads()
        self._parts: queue.SimpleQueue[_Part | None] = queue.SimpleQueue()
        self._progress = threading.Condition()
        self._running: dict[int, _JobProgress] = {}  # by submission number, under _progress
        self._ready: deque[CopyDone] = deque()  # finished, in submission order, not yet polled
        self._submitted = 0  # jobs submitted (main thread only)
        self._finished = 0  # jobs 1.._finished are all finished (under _progress)
        self._awaited = 0  # _wait_for's target while the main thread waits, else 0 (under _progress)
        # The threads hold the copier weakly: one dropped without close() is
        # collected, and the finalizer (also run at interpreter exit) stops them
        # after their copies in flight, before the engine's memory goes away.
        me = weakref.ref(self)
        workers = [
            threading.Thread(target=_work, args=(self._parts, me), name=f"tiercache-copy-{i}")
            for i in range(self.threads)
        ]
        for worker in workers:
            worker.daemon = True
            worker.start()
        self._stop = weakref.finalize(self, _stop_workers, self._parts, workers)
        logger.info("tiercache host copier: %d thread(s), %s", self.threads, self._describe())

    def _describe(self) -> str:
        sc = self._segment_copier
        if self._kernel is not None:
            small = f"numpy gathers ({len(sc.groups)} group(s))" if sc is not None else "the kernel"
            return f"copy plan run by the rep-movsb kernel (batches, parts >= {KERNEL_MIN_BYTES} B); else {small}"
        if self.planes is not None:
            return "slab in planes: one memmove per region and run of blocks (copy plan)"
        if sc is None:
            return "copy plan: one memmove per run (layout unfit for numpy gathers)"
        return f"numpy gathers: {len(sc.groups)} group(s) of {sc.item_bytes}-byte items"

    def submit(self, job: CopyJob) -> None:
        if not self._stop.alive:
            raise RuntimeError("tiercache copier is closed")
        parts = _split(job, self.threads)
        self._submitted += 1
        seq = self._submitted
        with self._progress:
            self._running[seq] = _JobProgress(job, len(parts))
        for part in parts:
            self._parts.put((seq, part))

    def _run_parts(self, items: list[_Part]) -> None:
        """Copy the parts a thread took at once as one job per direction (see the class docstring).

        A part whose segments fail :func:`check_segment` fails alone; a failed batch fails each of its parts.
        Within a batch the stores run before the loads; the batch's time is shared out by bytes.
        """
        if len(items) == 1:
            self._run_part(*items[0])
            return
        start = time.perf_counter()
        checked: list[_Part] = []
        for seq, part in items:
            try:
                for seg in part.segments:
                    check_segment(self.layout, self.slab.shape[0], self.blocks_per_chunk, seg)
                checked.append((seq, part))
            except Exception as exc:  # noqa: BLE001 - a failed copy is a failed job, never a crash
                self._part_done(seq, 0, repr(exc), start, time.perf_counter())
        for direction in ("store", "load"):
            batch = [(seq, part) for seq, part in checked if part.direction == direction]
            if not batch:
                continue
            error = ""
            try:
                # the batch goes by its first part's job id (what a log or a test sees of it)
                segments = tuple(seg for _, part in batch for seg in part.segments)
                self._copy(CopyJob(batch[0][1].job_id, direction, segments))
            except Exception as exc:  # noqa: BLE001 - every part of a failed batch fails
                error = repr(exc)
            end = time.perf_counter()
            # the batch's time shared out by bytes, so that per-job seconds still add up to the copy's
            sizes = [_part_bytes(part, self._block_bytes) for _, part in batch]
            span, total, done = end - start, max(sum(sizes), 1), 0
            for (seq, _), size in zip(batch, sizes):
                first, done = start + span * done / total, done + size
                self._part_done(seq, 0 if error else size, error, first, start + span * done / total)
            start = end

    def _copy(self, job: CopyJob) -> int:
        small = self._kernel is None or _part_bytes(job, self._block_bytes) < KERNEL_MIN_BYTES
        if self._segment_copier is not None and small:
            return self._segment_copier.copy(job)
        # layout planes, or pages the numpy gather cannot address: the copy plan, one memmove per run
        for seg in job.segments:
            check_segment(self.layout, self.slab.shape[0], self.blocks_per_chunk, seg)
        plan = plan_copy(self._geometry, job.direction == "store", job.segments)
        return self._kernel(plan) if self._kernel is not None else run_plan_on_host(plan)

    def _run_part(self, seq: int, part: CopyJob) -> None:
        start = time.perf_counter()
        moved, error = 0, ""
        try:
            moved = self._copy(part)
        except Exception as exc:  # noqa: BLE001 - a failed copy is a failed job, never a crash
            error = repr(exc)
        self._part_done(seq, moved, error, start, time.perf_counter())

    def _part_done(self, seq: int, moved: int, error: str, start: float, end: float) -> None:
        with self._progress:
            job = self._running[seq]
            job.parts -= 1
            job.moved += moved
            job.error = job.error or error
            job.start, job.end = min(job.start, start), max(job.end, end)
            while (nxt := self._running.get(self._finished + 1)) is not None and nxt.parts == 0:
                self._ready.append(self._running.pop(self._finished + 1).result())
                self._finished += 1
            if self._awaited and self._finished >= self._awaited:
                # Wake the waiter only when its wait is over: waking it per job
                # makes it contend for the GIL with the copy threads.
                self._progress.notify_all()

    def poll(self) -> list[CopyDone]:
        done: list[CopyDone] = []
        while self._ready:
            done.append(self._ready.popleft())
        return done

    def _wait_for(self, count: int) -> None:
        with self._progress:
            self._awaited = count
            while self._finished < count:
                self._progress.wait()
            self._awaited = 0

    def wait_all(self) -> list[CopyDone]:
        self._wait_for(self._submitted)
        return self.poll()

    def close(self) -> None:
        if self._stop.alive:
            self._wait_for(self._submitted)
            self._stop()


def _host_resident(layout: KVBlockLayout, slab: torch.Tensor, planes: Sequence[torch.Tensor] | None) -> bool:
    """Whether every byte a plan addresses is host memory (the kernel dereferences raw addresses)."""
    tensors = [*layout.regions, slab, *(planes or ())]
    return all(t.device.type == "cpu" for t in tensors)


_Part = tuple[int, CopyJob]  # (submission number, the segments of a job one thread copies)


# A copy thread takes queued parts together up to this many bytes: enough to share one call's
# Python among 64 KiB jobs, small enough that the other thread gets some.
BATCH_BYTES = 1 << 20
# A single part this big or bigger goes to the kernel even where numpy gathers could copy it: below,
# the plan's ~20 us of numpy calls cost more than the faster copy saves (measured on one thread:
# numpy ahead at 64-128 KiB, even at 256 KiB, the kernel ahead from there and in every batch).
KERNEL_MIN_BYTES = 256 << 10


def _work(parts: queue.SimpleQueue[_Part | None], copier: weakref.ref[HostThreadCopier]) -> None:
    """A copy thread: run parts until told to stop or the copier is gone.

    Each thread consumes exactly one ``None`` (its stop): one met while taking
    parts in a batch ends the thread after that batch.
    """
    stop = False
    while not stop and (item := parts.get()) is not None:
        owner = copier()
        if owner is None:
            return
        batch = [item]
        # batches only with the kernel: without it they measured no faster, and each part is timed alone
        budget = BATCH_BYTES - _part_bytes(item[1], owner._block_bytes) if owner._kernel is not None else 0
        while budget > 0:
            try:
                nxt = parts.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                stop = True
                break
            batch.append(nxt)
            budget -= _part_bytes(nxt[1], owner._block_bytes)
        owner._run_parts(batch)
        del owner


def _part_bytes(part: CopyJob, block_bytes: int) -> int:
    return sum(len(seg.block_ids) for seg in part.segments) * block_bytes


def _stop_workers(parts: queue.SimpleQueue[_Part | None], workers: list[threading.Thread]) -> None:
    """Let each copy thread finish what it is copying, then end it."""
    for _ in workers:
        parts.put(None)
    for worker in workers:
        if worker is not threading.current_thread():
            worker.join()


def _split(job: CopyJob, parts: int) -> list[CopyJob]:
    """``job`` as up to ``parts`` jobs of consecutive segments, of about equal block counts."""
    segs = job.segments
    if parts <= 1 or len(segs) <= 1:
        return [job]
    total = sum(len(s.block_ids) for s in segs)
    out: list[CopyJob] = []
    start, acc = 0, 0
    for i, seg in enumerate(segs):
        acc += len(seg.block_ids)
        if acc * parts >= total * (len(out) + 1) and len(out) < parts - 1 and i + 1 < len(segs):
            out.append(CopyJob(job.job_id, job.direction, segs[start : i + 1]))
            start = i + 1
    out.append(CopyJob(job.job_id, job.direction, segs[start:]))
    return out


