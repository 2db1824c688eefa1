"""HostThreadCopier: block copies for host-resident KV caches on background threads.

Jobs are split into parts that a couple of threads take from one queue, each
thread the parts queued behind it as one batch; results come back in submission
order. See tiercache/transfer/device.py for the ordering contract.
"""

from __future__ import annotations

import itertools
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
from tiercache.transfer.host_kernel import run_kernel, segment_runner, stores_used

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

    Where the compiled copy-plan executor (:mod:`tiercache.transfer.host_kernel`)
    was built, every part of a slab of slots goes to it, each segment's plan
    made in C (``copy_segments``: no numpy plan, no gathers); a planes slab sends
    it every part as a numpy plan. Without the executor, parts go to the numpy
    gathers (a planes slab: one memmove per run of the plan).

    Batches: a thread takes the part it waited for and its share of the parts
    queued behind it (see :func:`_work`) and, where segments are copied in C,
    copies each run of them in one direction with one call, reporting them under
    one lock. Handing a part to a thread costs Python work and a GIL hand-over
    on both sides of its copy, as much as copying a 64 KiB chunk; on the AMD
    VM (session 30) batches took 256 KiB chunks submitted one a job from
    0.68-0.80 of one memcpy to 0.87-0.96 (stores) and 0.72-0.96 to 1.01-1.28
    (loads). (With numpy plans, before ``copy_segments``, batches measured slower
    on the Intel VM: the plan of a batch cost more than its parts' hand-overs.)

    Threading: ``submit``, ``poll``, ``wait_all`` and ``close`` run on the
    worker's main thread; ``_running``, ``_ready``, ``_finished`` and ``_awaited``
    are shared with the copy threads under ``_progress``.

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
        # Where the compiled executor was built (tiercache.transfer.host_kernel): every part of a slab of
        # slots segment by segment, planned and copied in C; a planes slab's parts as numpy plans it runs.
        # Without it: numpy gathers per slot, or the plan with one memmove per run where the gathers do not
        # apply (layout planes, or pages the gathers cannot address). The gathers' windows are built only
        # where they may run.
        self._kernel = run_kernel() if _host_resident(layout, slab, planes) else None
        self._geometry = PlanGeometry.of(layout, slab, blocks_per_chunk, planes)
        self._run_segments = segment_runner(self._geometry, layout.num_blocks, slab.shape[0]) \
            if self._kernel is not None else None
        self._segment_copier = None if planes is not None or self._run_segments is not None \
            else HostSegmentCopier.build(layout, slab, blocks_per_chunk)
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
        if self._run_segments is not None:
            return f"each segment planned and copied by the compiled executor ({stores_used()} stores)"
        if self._kernel is not None:
            small = f"numpy gathers ({len(sc.groups)} group(s))" if sc is not None else "the executor"
            return f"copy plan run by the compiled executor ({stores_used()} stores, parts >= {KERNEL_MIN_BYTES} B); else {small}"
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

    def _copy(self, job: CopyJob) -> int:
        if self._run_segments is not None:
            # every segment's indices checked in C before any byte moves: a bad segment fails the job
            return self._run_segments(job.segments, job.direction == "store")
        small = self._kernel is None or _part_bytes(job, self._block_bytes) < KERNEL_MIN_BYTES
        if self._segment_copier is not None and small:
            return self._segment_copier.copy(job)
        # layout planes, or pages the numpy gather cannot address: the copy plan, one memmove per run
        for seg in job.segments:
            check_segment(self.layout, self.slab.shape[0], self.blocks_per_chunk, seg)
        plan = plan_copy(self._geometry, job.direction == "store", job.segments)
        return self._kernel(plan) if self._kernel is not None else run_plan_on_host(plan)

    def _run_parts(self, batch: list[_Part]) -> None:
        """Copy one thread's batch of parts in order, then report them all under one lock.

        Where segments are copied in C, each run of consecutive parts of one direction is one call
        (the GIL released once for all of them); a call that raises copied nothing (every index is
        checked first) and its parts are copied again one by one, so that a bad part fails alone.
        """
        done: list[_PartDone] = []
        for store, group in itertools.groupby(batch, key=lambda item: item[1].direction == "store"):
            parts = list(group)
            if self._run_segments is not None and len(parts) > 1:
                start = time.perf_counter()
                try:
                    self._run_segments([seg for _, part in parts for seg in part.segments], store)
                    done += _share_out(parts, self._block_bytes, start, time.perf_counter())
                    continue
                except Exception as exc:  # noqa: BLE001 - a bad part among them: each part alone below
                    logger.debug("tiercache copier: a batch of %d parts refused (%s); copying them one by one",
                                 len(parts), exc)
            for seq, part in parts:
                done.append(self._run_part(seq, part))
        self._parts_done(done)

    def _run_part(self, seq: int, part: CopyJob) -> _PartDone:
        start = time.perf_counter()
        moved, error = 0, ""
        try:
            moved = self._copy(part)
        except Exception as exc:  # noqa: BLE001 - a failed copy is a failed job, never a crash
            error = repr(exc)
        return seq, moved, error, start, time.perf_counter()

    def _parts_done(self, done: list[_PartDone]) -> None:
        with self._progress:
            for seq, moved, error, start, end in done:
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
_PartDone = tuple[int, int, str, float, float]  # (submission number, bytes moved, error, start, end)


# Without copy_segments (tests turn it off): a part this big or bigger goes to the compiled executor as a numpy
# plan even where numpy gathers could copy it: below,
# the plan's ~20 us of numpy calls cost more than the faster copy saves (measured on the Intel VM with
# two threads: the executor behind the gathers at 256-512 KiB parts, ahead from 1 MiB parts: jobs of
# 2 MiB and more).
KERNEL_MIN_BYTES = 1 << 20

# A copy thread's batch: at most this many parts, this many bytes of blocks (its first part whatever its size).
# Why batches: a part handed to a thread costs Python work and a GIL hand-over on each side of its copy, as much
# as the copy of a 64 KiB chunk; a batch pays them once (the segments of its parts go to C in one call).
BATCH_PARTS = 64
BATCH_BYTES = 8 << 20


def _work(parts: queue.SimpleQueue[_Part | None], copier: weakref.ref[HostThreadCopier]) -> None:
    """A copy thread: run parts until told to stop (its one ``None``) or the copier is gone.

    It takes the part it waited for and its share of the parts queued behind it (the copier's
    threads take turns; at most ``BATCH_PARTS`` parts, ``BATCH_BYTES`` of blocks) and copies them as one
    batch (:meth:`HostThreadCopier._run_parts`)."""
    while (item := parts.get()) is not None:
        owner = copier()
        if owner is None:
            return
        batch, size = [item], _part_bytes(item[1], owner._block_bytes)
        share = min(BATCH_PARTS, parts.qsize() // owner.threads)
        stop = False
        while len(batch) <= share and size < BATCH_BYTES:
            try:
                more = parts.get_nowait()
            except queue.Empty:
                break
            if more is None:  # told to stop: after this batch
                stop = True
                break
            batch.append(more)
            size += _part_bytes(more[1], owner._block_bytes)
        owner._run_parts(batch)
        del owner
        if stop:
            return


def _part_bytes(part: CopyJob, block_bytes: int) -> int:
    return sum(len(seg.block_ids) for seg in part.segments) * block_bytes


def _share_out(parts: list[_Part], block_bytes: int, start: float, end: float) -> list[_PartDone]:
    """The parts of one copy call as done, each its bytes and its share of the call's time (by bytes, in
    order), so that a job's throughput reads as if its part had been copied alone."""
    sizes = [_part_bytes(part, block_bytes) for _, part in parts]
    per_byte = (end - start) / max(1, sum(sizes))
    done: list[_PartDone] = []
    at = start
    for (seq, _), size in zip(parts, sizes):
        done.append((seq, size, "", at, at + size * per_byte))
        at += size * per_byte
    return done


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


