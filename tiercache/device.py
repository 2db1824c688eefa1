"""Device copiers: move blocks between the engine's KV cache and host-tier slots.

Two implementations behind one small interface:

* :class:`HostThreadCopier` (CPU platform, or any host-resident KV cache):
  copies run on a dedicated thread (torch releases the GIL), so submitting
  never blocks the forward pass.
* :class:`CudaStreamCopier`: stores and loads run on two dedicated CUDA
  streams; each job waits on an event recorded on the compute stream at
  submit time (so a store reads the KV the forward pass just wrote), and
  records a done-event that ``poll`` queries without blocking.

The ordering contract, the bug class of vLLM issue 45704:

* a block is not reused by the engine until its store copy is done:
  :meth:`fence_stores` is called before every forward pass (vLLM's
  ``handle_preemptions`` hook); on CUDA it makes the compute stream wait on the
  last store event (no host sync), on the CPU it waits for the copy thread;
* a loaded block is not read by attention until its copy is done: a load is
  reported finished only once its copy completed (thread done / event
  reached), and vLLM schedules the request only after that report.

Threading: ``submit``, ``poll``, ``fence_stores`` and ``close`` are called from
the worker's main thread only.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch

from tiercache.layout import KVBlockLayout, block_runs

Direction = Literal["store", "load"]


@dataclass(frozen=True, slots=True)
class CopySegment:
    """Blocks ``block_ids`` of the engine <-> positions ``first_block..`` of chunk slot ``slot``."""

    slot: int
    first_block: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CopyJob:
    job_id: int
    direction: Direction
    segments: tuple[CopySegment, ...]


@dataclass(frozen=True, slots=True)
class CopyDone:
    job_id: int
    ok: bool
    bytes: int
    secs: float
    error: str = ""


def copy_segments(
    layout: KVBlockLayout,
    slab: torch.Tensor,
    blocks_per_chunk: int,
    job: CopyJob,
    non_blocking: bool = False,
) -> int:
    """Run every copy of ``job`` on the current thread/stream; return bytes moved.

    Consecutive block ids are coalesced, so a chunk whose blocks are adjacent in
    the engine costs one copy per region.
    """
    offsets = layout.region_offsets(blocks_per_chunk)
    store = job.direction == "store"
    moved = 0
    for seg in job.segments:
        slot = slab[seg.slot]
        runs = block_runs(seg.block_ids)
        for region, page, base in zip(layout.regions, layout.page_bytes, offsets):
            for pos, first_id, length in runs:
                start = base + (seg.first_block + pos) * page
                host = slot[start : start + length * page].view(length, page)
                engine = region[first_id : first_id + length]
                if store:
                    host.copy_(engine, non_blocking=non_blocking)
                else:
                    engine.copy_(host, non_blocking=non_blocking)
                moved += length * page
    return moved


def zero_blocks(layout: KVBlockLayout, block_ids: list[int]) -> None:
    """Overwrite engine blocks with zeros (fault injection: negative controls only)."""
    if not block_ids:
        return
    ids = torch.tensor(block_ids, dtype=torch.long, device=layout.device)
    for region in layout.regions:
        region.index_fill_(0, ids, 0)


class BlockCopier(ABC):
    """Runs :class:`CopyJob` s asynchronously between engine blocks and host slots."""

    def __init__(self, layout: KVBlockLayout, slab: torch.Tensor, blocks_per_chunk: int) -> None:
        self.layout = layout
        self.slab = slab
        self.blocks_per_chunk = blocks_per_chunk

    @abstractmethod
    def submit(self, job: CopyJob) -> None: ...

    @abstractmethod
    def poll(self) -> list[CopyDone]: ...

    @abstractmethod
    def fence_stores(self) -> None: ...

    @abstractmethod
    def wait_all(self) -> list[CopyDone]: ...

    def close(self) -> None:
        return None


class HostThreadCopier(BlockCopier):
    """Copies on one background thread; completion polled through futures, FIFO."""

    def __init__(self, layout: KVBlockLayout, slab: torch.Tensor, blocks_per_chunk: int) -> None:
        super().__init__(layout, slab, blocks_per_chunk)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiercache-copy")
        self._inflight: deque[tuple[CopyJob, Future[CopyDone]]] = deque()

    def _run(self, job: CopyJob) -> CopyDone:
        start = time.perf_counter()
        try:
            moved = copy_segments(self.layout, self.slab, self.blocks_per_chunk, job)
        except Exception as exc:  # a failed copy is a failed job, never a crash
            return CopyDone(job.job_id, False, 0, time.perf_counter() - start, repr(exc))
        return CopyDone(job.job_id, True, moved, time.perf_counter() - start)

    def submit(self, job: CopyJob) -> None:
        self._inflight.append((job, self._pool.submit(self._run, job)))

    def poll(self) -> list[CopyDone]:
        done: list[CopyDone] = []
        # One thread, FIFO: the first unfinished job bounds what can be done.
        while self._inflight and self._inflight[0][1].done():
            done.append(self._inflight.popleft()[1].result())
        return done

    def fence_stores(self) -> None:
        for job, fut in list(self._inflight):
            if job.direction == "store":
                fut.exception()  # waits; exceptions are reported by poll()

    def wait_all(self) -> list[CopyDone]:
        for _, fut in list(self._inflight):
            fut.exception()
        return self.poll()

    def close(self) -> None:
        self.wait_all()
        self._pool.shutdown(wait=True)


class CudaStreamCopier(BlockCopier):
    """Copies on dedicated CUDA streams, ordered against the compute stream by events."""

    def __init__(self, layout: KVBlockLayout, slab: torch.Tensor, blocks_per_chunk: int) -> None:
        super().__init__(layout, slab, blocks_per_chunk)
        device = layout.device
        self._store_stream = torch.cuda.Stream(device=device)
        self._load_stream = torch.cuda.Stream(device=device)
        self._inflight: deque[tuple[CopyJob, torch.cuda.Event, float, int, str]] = deque()
        self._last_store_done: torch.cuda.Event | None = None

    def submit(self, job: CopyJob) -> None:
        compute = torch.cuda.current_stream(self.layout.device)
        ready = torch.cuda.Event()
        ready.record(compute)
        stream = self._store_stream if job.direction == "store" else self._load_stream
        done = torch.cuda.Event()
        error = ""
        moved = 0
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            try:
                moved = copy_segments(
                    self.layout, self.slab, self.blocks_per_chunk, job, non_blocking=True
                )
            except Exception as exc:
                error = repr(exc)
            done.record(stream)
        if job.direction == "store":
            self._last_store_done = done
        self._inflight.append((job, done, time.perf_counter(), moved, error))

    def poll(self) -> list[CopyDone]:
        out: list[CopyDone] = []
        keep: deque[tuple[CopyJob, torch.cuda.Event, float, int, str]] = deque()
        for item in self._inflight:
            job, done, started, moved, error = item
            if done.query():
                out.append(CopyDone(job.job_id, not error, moved, time.perf_counter() - started, error))
            else:
                keep.append(item)
        self._inflight = keep
        return out

    def fence_stores(self) -> None:
        if self._last_store_done is not None:
            torch.cuda.current_stream(self.layout.device).wait_event(self._last_store_done)

    def wait_all(self) -> list[CopyDone]:
        self._store_stream.synchronize()
        self._load_stream.synchronize()
        return self.poll()

    def close(self) -> None:
        self.wait_all()


def make_copier(layout: KVBlockLayout, slab: torch.Tensor, blocks_per_chunk: int) -> BlockCopier:
    """The right copier for where the engine's KV lives."""
    if layout.device.type == "cuda":
        return CudaStreamCopier(layout, slab, blocks_per_chunk)
    return HostThreadCopier(layout, slab, blocks_per_chunk)
