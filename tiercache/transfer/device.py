"""Device copiers: move blocks between the engine's KV cache and host-tier slots.

This module is the contract (:class:`BlockCopier`, the job types, the segment
copies every copier shares); two implementations stand behind it, each in its own
module, and :func:`tiercache.transfer.copiers.make_copier` picks one:

* :class:`~tiercache.transfer.host_copier.HostThreadCopier` (CPU platform, any host-resident KV):
  copies run on background threads (two by default), so submitting never
  blocks the forward pass. A segment is copied by one numpy gather or
  scatter per group of alike regions (:class:`HostSegmentCopier`), or a batch of
  jobs by one call of the copy kernel (:mod:`tiercache.transfer.host_kernel`),
  rather than one ``copy_`` per page run: with many layers and small blocks the per-call
  cost, not memory bandwidth, would otherwise bound throughput. numpy also
  releases the GIL and copies on the calling thread only (torch's ``copy_``
  fans big copies out to its intra-op pool, which competes with the forward
  pass for the same cores and stalls when another process holds one).
* :class:`~tiercache.transfer.cuda_copier.CudaStreamCopier`: stores and loads run on two dedicated CUDA
  streams; each job waits on an event recorded on the compute stream at
  submit time (so a store reads the KV the forward pass just wrote), and
  records a done-event that ``poll`` queries without blocking.

The ordering contract, the bug class of vLLM issue 45704:

* a block is not reused by the engine until its store copy is done: the
  scheduler pins a store's source blocks in vLLM's block pool until every rank
  reported the job (tiercache/connector/store_pins.py), so a copier reports a
  store only once its copy has finished reading (thread done / done event
  reached) and never needs to hold the forward pass back;
* a loaded block is not read by attention until its copy is done: a sync load
  is awaited on the host (CPU) or ordered before the compute stream
  (:meth:`BlockCopier.order_before_compute`, CUDA); an async load is reported
  finished only once its copy completed, and vLLM schedules the request only
  after that report.

Threading: ``submit``, ``poll``, ``order_before_compute`` and ``close`` are
called from the worker's main thread only.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from tiercache.jobs import CopySegment
from tiercache.layout import KVBlockLayout, block_runs, paired_runs, plane_blocks

logger = logging.getLogger(__name__)

Direction = Literal["store", "load"]


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
    planes: Sequence[torch.Tensor] | None = None,
) -> int:
    """Run every copy of ``job`` on the current thread/stream; return bytes moved.

    Consecutive block ids are coalesced, so a chunk whose blocks are adjacent in
    the engine costs one copy per region. ``planes``: the slab is in layout planes
    (:func:`tiercache.layout.slab_planes`), see :func:`copy_plane_segments`.
    """
    if planes is not None:
        return copy_plane_segments(layout, planes, slab.shape[0], blocks_per_chunk, job, non_blocking)
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


def copy_plane_segments(
    layout: KVBlockLayout,
    planes: Sequence[torch.Tensor],
    num_slots: int,
    blocks_per_chunk: int,
    job: CopyJob,
    non_blocking: bool = False,
) -> int:
    """:func:`copy_segments` for a slab in layout planes: engine blocks <-> host blocks of the planes.

    Chunk slot ``s`` position ``p`` is host block ``s * blocks_per_chunk + p``, so
    the whole job is one list of (host block, engine block) pairs, and every run
    consecutive on both sides (a request's chunks in consecutive slots, its
    blocks consecutive in the engine) is one copy per region, across chunks.
    Host-resident KV is copied by numpy on this thread (GIL released, no
    intra-op thread pool: see the module docstring); CUDA KV by ``copy_``.
    """
    host_ids: list[int] = []
    engine_ids: list[int] = []
    for seg in job.segments:
        check_segment(layout, num_slots, blocks_per_chunk, seg)
        host_ids.extend(plane_blocks(seg.slot, seg.first_block, len(seg.block_ids), blocks_per_chunk))
        engine_ids.extend(seg.block_ids)
    runs = paired_runs(host_ids, engine_ids)
    store = job.direction == "store"
    on_host = layout.device.type == "cpu"
    moved = 0
    for region, plane, page in zip(layout.regions, planes, layout.page_bytes):
        engine_side = region.numpy() if on_host else region
        host_side = plane.numpy() if on_host else plane
        for pos, length in runs:
            h, e = host_ids[pos], engine_ids[pos]
            src, dst = (engine_side[e:e + length], host_side[h:h + length]) if store else \
                (host_side[h:h + length], engine_side[e:e + length])
            if on_host:
                dst[...] = src
            else:
                dst.copy_(src, non_blocking=non_blocking)
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

    def __init__(self, layout: KVBlockLayout, slab: torch.Tensor, blocks_per_chunk: int,
                 planes: Sequence[torch.Tensor] | None = None) -> None:
        self.layout = layout
        self.slab = slab
        self.blocks_per_chunk = blocks_per_chunk
        self.planes = tuple(planes) if planes is not None else None  # the slab's planes, in layout planes

    @abstractmethod
    def submit(self, job: CopyJob) -> None: ...

    @abstractmethod
    def poll(self) -> list[CopyDone]: ...

    @abstractmethod
    def wait_all(self) -> list[CopyDone]: ...

    @property
    def orders_on_device(self) -> bool:
        """Whether :meth:`order_before_compute` orders the engine's next kernels after a job
        without a host wait (CUDA); else the caller waits for the job on the host (CPU)."""
        return False

    def order_before_compute(self, job_ids: Iterable[int]) -> None:
        """Make the compute stream wait for these jobs' copies (only where :attr:`orders_on_device`)."""
        raise NotImplementedError(f"{type(self).__name__} orders copies on the host: wait for them")

    def close(self) -> None:
        return None


def default_copy_threads() -> int:
    """Copy threads for host-resident KV: two where two CPUs are usable (see HostThreadCopier)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count() or 1
    return max(1, min(2, usable))
