"""Device copiers: move blocks between the engine's KV cache and host-tier slots.

Two implementations behind one small interface:

* :class:`HostThreadCopier` (CPU platform, or any host-resident KV cache):
  copies run on background threads (two by default), so submitting never
  blocks the forward pass. A segment is copied by one numpy gather or
  scatter per group of alike regions (:class:`HostSegmentCopier`) rather than
  one ``copy_`` per page run: with many layers and small blocks the per-call
  cost, not memory bandwidth, would otherwise bound throughput. numpy also
  releases the GIL and copies on the calling thread only (torch's ``copy_``
  fans big copies out to its intra-op pool, which competes with the forward
  pass for the same cores and stalls when another process holds one).
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

import ctypes
import logging
import math
import os
import queue
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from tiercache.layout import KVBlockLayout, block_runs

logger = logging.getLogger(__name__)

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


def check_segment(
    layout: KVBlockLayout, num_slots: int, blocks_per_chunk: int, seg: CopySegment
) -> None:
    """Raise if ``seg`` addresses a block, slot or slot position that does not exist."""
    if not 0 <= seg.slot < num_slots:
        raise IndexError(f"slot {seg.slot} out of range [0, {num_slots})")
    if seg.first_block < 0 or seg.first_block + len(seg.block_ids) > blocks_per_chunk:
        raise IndexError(
            f"{len(seg.block_ids)} blocks from position {seg.first_block} overflow a "
            f"{blocks_per_chunk}-block chunk"
        )
    if seg.block_ids and not (0 <= min(seg.block_ids) and max(seg.block_ids) < layout.num_blocks):
        raise IndexError(f"block id out of range [0, {layout.num_blocks}) in {seg.block_ids}")


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
        check_segment(layout, slab.shape[0], blocks_per_chunk, seg)
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


# Below this item size a numpy take/put moves too few bytes per item to pay off.
MIN_ITEM_BYTES = 64
# Items are cut down to this size, if need be, so that all regions share one window.
SHARED_ITEM_BYTES = 1024
# numpy's fancy assignment releases the GIL only for more items than this
# (NPY_BEGIN_THREADS_THRESHOLDED); ``take`` always releases it.
GIL_FREE_ITEMS = 500
# Loads cut items down to this size at most to get there; smaller ones cost more
# per byte than holding the GIL through a small chunk's copy.
MIN_LOAD_ITEM_BYTES = 256


@dataclass(frozen=True)
class _RegionGroup:
    """Consecutive regions with the same page, block stride and window: one numpy call."""

    window: np.ndarray  # items of engine memory that hold every page of these regions
    first_items: np.ndarray  # (regions, 1) int64: item index of each region's block 0 in the window
    stride_items: int  # items from one block to the next
    page_items: int  # items per page
    slot_offset: int  # items from the start of a slot to this group's first region
    count: int  # regions in the group
    load_split: int  # loads address 1/load_split items, so a chunk's load releases the GIL
    load_window: np.ndarray  # the window in those smaller items


class HostSegmentCopier:
    """Copies a segment between host-resident engine blocks and a slot with a few numpy calls.

    Engine memory is seen as flat numpy arrays (*windows*, each from its lowest
    region address to the end of its highest) of fixed-size items of
    ``item_bytes``, the greatest common divisor of every page size and block
    stride; so is the slab. A segment's pages are then a list of item indices:
    a store is one ``take`` (gather into the slot), a load one fancy-index
    assignment (scatter into the engine), per group of alike regions. Regions
    whose addresses differ by a multiple of the item size share one window, so
    with the large, page-aligned tensors of a real engine one call covers all
    layers (small tensors from the heap sit at drifting offsets: more calls).

    A window never owns memory and may span gaps between allocations, so it is
    only ever touched by ``take`` (reads the indexed items) and fancy
    assignment (writes them); never by ``np.put``, which copies its whole
    destination (gaps included: a crash) when that overlaps the values. :func:`check_segment` bounds
    every index first, windows never span the slab, and the layout keeps the
    engine tensors alive for the life of the copier.
    """

    def __init__(
        self,
        layout: KVBlockLayout,
        slab: torch.Tensor,
        blocks_per_chunk: int,
        item_bytes: int,
        groups: tuple[_RegionGroup, ...],
    ) -> None:
        self.layout = layout
        self.blocks_per_chunk = blocks_per_chunk
        self.item_bytes = item_bytes
        self.groups = groups
        self._num_slots = slab.shape[0]
        slab_bytes = slab.numpy()
        # The slab in items of each size the groups use: 1 (stores), load_split (loads).
        self._slots = {
            scale: slab_bytes.view(np.dtype((np.void, item_bytes // scale)))
            for scale in {1, *(g.load_split for g in groups)}
        }
        longest = max(g.page_items * g.load_split for g in groups)
        self._item_range = np.arange(longest, dtype=np.int64)

    @classmethod
    def build(
        cls, layout: KVBlockLayout, slab: torch.Tensor, blocks_per_chunk: int
    ) -> HostSegmentCopier | None:
        """The copier for this layout and slab, or None when they do not fit the scheme."""
        if not _host_bytes(slab) or slab.dim() != 2 or not slab.is_contiguous():
            return None
        if not all(_host_bytes(r) and r.dim() == 2 and r.stride(1) == 1 for r in layout.regions):
            return None
        item = _item_bytes(layout)
        if item < MIN_ITEM_BYTES or slab.shape[1] % item:
            return None
        groups = _region_groups(layout, blocks_per_chunk, item, slab.data_ptr())
        return cls(layout, slab, blocks_per_chunk, item, groups)

    def copy(self, job: CopyJob) -> int:
        """Run every copy of ``job`` on the calling thread; return bytes moved."""
        store = job.direction == "store"
        moved = 0
        for seg in job.segments:
            check_segment(self.layout, self._num_slots, self.blocks_per_chunk, seg)
            if not seg.block_ids:
                continue
            ids = np.asarray(seg.block_ids, dtype=np.int64)
            for group in self.groups:
                moved += self._copy_group(group, seg.slot, seg.first_block, ids, store)
        return moved

    def _copy_group(
        self, group: _RegionGroup, slot_index: int, first: int, ids: np.ndarray, store: bool
    ) -> int:
        scale = 1 if store else group.load_split
        window = group.window if store else group.load_window
        slot = self._slots[scale][slot_index]
        k, n, bpc = group.page_items * scale, ids.size, self.blocks_per_chunk
        # (regions, n): the first item of each page in the window
        pages = group.first_items * scale + ids * (group.stride_items * scale)
        if k > 1:
            pages = (pages[:, :, None] + self._item_range[:k]).reshape(group.count, n * k)
        offset = group.slot_offset * scale
        span = slot[offset : offset + group.count * bpc * k]
        item_bytes = self.item_bytes // scale
        if store and n == bpc:
            # "clip" never clips here (check_segment bounded the ids) but, unlike
            # "raise", writes straight into ``out`` instead of through a temporary.
            window.take(pages.reshape(-1), out=span, mode="clip")
            return span.size * item_bytes
        part = span.reshape(group.count, bpc * k)[:, first * k : (first + n) * k]
        if store:
            part[...] = window.take(pages, mode="clip")
        else:
            window[pages.reshape(-1)] = part.reshape(-1)
        return part.size * item_bytes


def _host_bytes(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype == torch.uint8


def _item_bytes(layout: KVBlockLayout) -> int:
    """The item size: divides every page and block stride, and region offsets if it can.

    Large tensors sit at page-aligned addresses, so cutting 32 KiB pages into
    4 KiB items puts every layer in one window (one numpy call per segment);
    small tensors from the heap sit at 64-byte offsets, too fine a grid: they
    keep whole-page items and a window per offset class instead.
    """
    item = 0
    for region, page in zip(layout.regions, layout.page_bytes):
        item = math.gcd(item, page, region.stride(0) if layout.num_blocks > 1 else 0)
    low = min(r.data_ptr() for r in layout.regions)
    shared = item
    for region in layout.regions:
        shared = math.gcd(shared, region.data_ptr() - low)
    return shared if shared >= min(item, SHARED_ITEM_BYTES) else item


def _region_groups(
    layout: KVBlockLayout, blocks_per_chunk: int, item: int, slab_address: int
) -> tuple[_RegionGroup, ...]:
    """Runs of consecutive regions sharing page size, block stride and window."""
    regions, pages = layout.regions, layout.page_bytes

    def window_key(i: int) -> tuple[int, bool]:
        # Same item grid; and on the same side of the slab, which no window may span.
        return regions[i].data_ptr() % item, regions[i].data_ptr() < slab_address

    windows = _windows(layout, item, window_key)
    offsets = layout.region_offsets(blocks_per_chunk)

    def key(i: int) -> tuple[int, int, tuple[int, bool]]:
        return pages[i], regions[i].stride(0), window_key(i)

    groups: list[_RegionGroup] = []
    start = 0
    while start < len(regions):
        end = start + 1
        while end < len(regions) and key(end) == key(start):
            end += 1
        low, window = windows[window_key(start)]
        firsts = np.array([[(r.data_ptr() - low) // item] for r in regions[start:end]], np.int64)
        split = _load_split(item, (end - start) * blocks_per_chunk * pages[start] // item)
        groups.append(
            _RegionGroup(
                window=window,
                first_items=firsts,
                stride_items=regions[start].stride(0) // item,
                page_items=pages[start] // item,
                slot_offset=offsets[start] // item,
                count=end - start,
                load_split=split,
                load_window=window.view(np.dtype((np.void, item // split))),
            )
        )
        start = end
    return tuple(groups)


def _load_split(item: int, chunk_items: int) -> int:
    """Parts to cut items into so that a whole chunk's load is over GIL_FREE_ITEMS (or 1)."""
    split = 1
    while chunk_items * split <= GIL_FREE_ITEMS:
        split *= 2
    if item % split or item // split < MIN_LOAD_ITEM_BYTES:
        return 1
    return split


def _windows(
    layout: KVBlockLayout, item: int, window_key: Callable[[int], Hashable]
) -> dict[Hashable, tuple[int, np.ndarray]]:
    """One item array per window key: key -> (base address, window over its regions)."""
    spans: dict[Hashable, tuple[int, int]] = {}
    for i, (region, page) in enumerate(zip(layout.regions, layout.page_bytes)):
        low = region.data_ptr()
        high = low + (layout.num_blocks - 1) * region.stride(0) + page
        old_low, old_high = spans.get(window_key(i), (low, high))
        spans[window_key(i)] = (min(old_low, low), max(old_high, high))
    dtype = np.dtype((np.void, item))
    return {
        key: (low, np.frombuffer((ctypes.c_char * (high - low)).from_address(low), dtype=dtype))
        for key, (low, high) in spans.items()
    }


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


def default_copy_threads() -> int:
    """Copy threads for host-resident KV: two where two CPUs are usable (see HostThreadCopier)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count() or 1
    return max(1, min(2, usable))


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

    Results are released in submission order, so :meth:`poll` is FIFO and
    :meth:`fence_stores` waits for every store submitted so far (and whatever
    was submitted before it).
    """

    def __init__(
        self,
        layout: KVBlockLayout,
        slab: torch.Tensor,
        blocks_per_chunk: int,
        threads: int | None = None,
    ) -> None:
        super().__init__(layout, slab, blocks_per_chunk)
        self._segment_copier = HostSegmentCopier.build(layout, slab, blocks_per_chunk)
        self.threads = threads or default_copy_threads()
        self._parts: queue.SimpleQueue[_Part | None] = queue.SimpleQueue()
        self._progress = threading.Condition()
        self._running: dict[int, _JobProgress] = {}  # by submission number, under _progress
        self._ready: deque[CopyDone] = deque()  # finished, in submission order, not yet polled
        self._submitted = 0  # jobs submitted (main thread only)
        self._finished = 0  # jobs 1.._finished are all finished (under _progress)
        self._last_store = 0  # submission number of the latest store
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
        if sc is None:
            return "per-run copies (layout unfit for numpy gathers)"
        return f"numpy gathers: {len(sc.groups)} group(s) of {sc.item_bytes}-byte items"

    def submit(self, job: CopyJob) -> None:
        if not self._stop.alive:
            raise RuntimeError("tiercache copier is closed")
        parts = _split(job, self.threads)
        self._submitted += 1
        seq = self._submitted
        if job.direction == "store":
            self._last_store = seq
        with self._progress:
            self._running[seq] = _JobProgress(job, len(parts))
        for part in parts:
            self._parts.put((seq, part))

    def _copy(self, job: CopyJob) -> int:
        if self._segment_copier is not None:
            return self._segment_copier.copy(job)
        return copy_segments(self.layout, self.slab, self.blocks_per_chunk, job)

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

    def fence_stores(self) -> None:
        self._wait_for(self._last_store)  # failures are reported by poll()

    def wait_all(self) -> list[CopyDone]:
        self._wait_for(self._submitted)
        return self.poll()

    def close(self) -> None:
        if self._stop.alive:
            self._wait_for(self._submitted)
            self._stop()


_Part = tuple[int, CopyJob]  # (submission number, the segments of a job one thread copies)


def _work(parts: queue.SimpleQueue[_Part | None], copier: weakref.ref[HostThreadCopier]) -> None:
    """A copy thread: run parts until told to stop or the copier is gone."""
    while (item := parts.get()) is not None:
        owner = copier()
        if owner is None:
            return
        owner._run_part(*item)
        del owner


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
            except Exception as exc:  # noqa: BLE001 - a failed copy is a failed job
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


def make_copier(
    layout: KVBlockLayout,
    slab: torch.Tensor,
    blocks_per_chunk: int,
    copy_threads: int | None = None,
) -> BlockCopier:
    """The right copier for where the engine's KV lives (``copy_threads``: host KV only)."""
    if layout.device.type == "cuda":
        return CudaStreamCopier(layout, slab, blocks_per_chunk)
    return HostThreadCopier(layout, slab, blocks_per_chunk, threads=copy_threads)
