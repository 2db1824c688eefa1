"""The copy plan: one copy job as arrays of byte runs (engine address, host address, length).

Every copier executes the same plan, so the planning is tested on the CPU even
where the executor is a GPU call:

* :func:`plan_copy` turns a :class:`~tiercache.transfer.device.CopyJob` into a
  :class:`CopyPlan`, vectorised with numpy (no Python loop over blocks or
  regions): for each region ``r`` and each block of the job, the engine page
  ``region_base[r] + block_id * block_stride[r]`` and its host page (slot
  layout ``slots``: ``slab + slot * slot_bytes + region_offset[r] + position *
  page[r]``; layout ``planes``: ``plane_base[r] + (slot * blocks_per_chunk +
  position) * page[r]``, see :mod:`tiercache.layout`). Entries are sorted by
  host address, so a whole chunk slot (or a plane's run of slots) is one
  ascending host range, then runs contiguous on both sides are merged.
* Executors: :func:`run_plan_on_host` (CPU-resident KV where the copy kernel is
  not available: one ``memmove`` per run, GIL released); the CPU copy kernel in
  :mod:`tiercache.transfer.host_kernel` (every run in one call); the CUDA
  executors in :mod:`tiercache.transfer.cuda_batch` (one batched call per job).

Addresses are absolute (``data_ptr()``): a plan is valid only while the
engine's KV tensors and the host slab it was made from are alive, and only for
the job it was made for. Bounds are checked before planning
(:func:`~tiercache.transfer.device.check_segment`), never by the executor.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tiercache.layout import KVBlockLayout


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """Byte runs of one copy job, sorted by host address; each run one contiguous range on both sides."""

    store: bool  # engine -> host (else host -> engine)
    engine_ptrs: np.ndarray  # int64, absolute addresses in the engine's KV memory
    host_ptrs: np.ndarray  # int64, absolute addresses in the host slab
    sizes: np.ndarray  # int64 bytes per run

    @property
    def count(self) -> int:
        return int(self.sizes.size)

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())

    @property
    def src_ptrs(self) -> np.ndarray:
        return self.engine_ptrs if self.store else self.host_ptrs

    @property
    def dst_ptrs(self) -> np.ndarray:
        return self.host_ptrs if self.store else self.engine_ptrs

    def host_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, lengths)`` of the plan's host side merged into ascending contiguous ranges.

        Entries ``starts[k]`` .. of the plan cover host bytes ``host_ptrs[starts[k]]`` onwards,
        ``lengths[k]`` of them: what one DMA per range moves when the engine side is gathered.
        """
        if not self.count:
            empty = np.zeros(0, np.int64)
            return empty, empty
        joins = self.host_ptrs[1:] == self.host_ptrs[:-1] + self.sizes[:-1]
        starts = np.flatnonzero(np.concatenate(([True], ~joins)))
        return starts, np.add.reduceat(self.sizes, starts)


@dataclass(frozen=True, slots=True)
class PlanGeometry:
    """What a plan needs of the layout and the slab, read once per copier (not per job)."""

    region_base: np.ndarray  # (R,) int64: each region's block-0 address
    region_stride: np.ndarray  # (R,) int64: bytes from one engine block to the next
    page: np.ndarray  # (R,) int64: bytes per block in each region
    host_base: np.ndarray  # (R,) int64: region r's host page of (slot 0, position 0)
    slot_step: int  # host bytes from slot s to slot s + 1 (layout slots), else 0
    block_step: np.ndarray  # (R,) int64: host bytes from one chunk position (or host block) to the next
    blocks_per_chunk: int
    planes: bool

    @classmethod
    def of(cls, layout: KVBlockLayout, slab: torch.Tensor, blocks_per_chunk: int,
           planes: Sequence[torch.Tensor] | None = None) -> PlanGeometry:
        page = np.asarray(layout.page_bytes, np.int64)
        base = np.asarray([r.data_ptr() for r in layout.regions], np.int64)
        stride = np.asarray([r.stride(0) * r.element_size() for r in layout.regions], np.int64)
        if planes is not None:
            host_base = np.asarray([p.data_ptr() for p in planes], np.int64)
            return cls(base, stride, page, host_base, 0, page, blocks_per_chunk, True)
        offsets = np.asarray(layout.region_offsets(blocks_per_chunk), np.int64)
        slot_bytes = int(slab.shape[1]) * slab.element_size()
        return cls(base, stride, page, slab.data_ptr() + offsets, slot_bytes, page, blocks_per_chunk, False)


def job_blocks(segments: Sequence) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(engine block ids, host slots, chunk positions)`` of every block of a job, in segment order."""
    if not segments:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    if len(segments) == 1:  # the common job: one chunk (a few microseconds less)
        seg = segments[0]
        ids = np.asarray(seg.block_ids, np.int64)
        return ids, np.full(ids.size, seg.slot, np.int64), np.arange(seg.first_block, seg.first_block + ids.size,
                                                                     dtype=np.int64)
    ids = np.concatenate([np.asarray(seg.block_ids, np.int64) for seg in segments])
    lengths = np.asarray([len(seg.block_ids) for seg in segments], np.int64)
    slots = np.repeat(np.asarray([seg.slot for seg in segments], np.int64), lengths)
    firsts = np.repeat(np.asarray([seg.first_block for seg in segments], np.int64), lengths)
    # position of each block inside its segment: a running index reset at each segment start
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    positions = firsts + np.arange(ids.size, dtype=np.int64) - starts
    return ids, slots, positions


def plan_copy(geometry: PlanGeometry, store: bool, segments: Sequence) -> CopyPlan:
    """The plan of one job's segments (already bounds-checked): see the module docstring."""
    if len(segments) == 1:
        return _plan_segment(geometry, store, segments[0])
    ids, slots, positions = job_blocks(segments)
    g = geometry
    engine = g.region_base[:, None] + ids[None, :] * g.region_stride[:, None]
    if g.planes:
        host = g.host_base[:, None] + (slots * g.blocks_per_chunk + positions)[None, :] * g.block_step[:, None]
    else:
        host = g.host_base[:, None] + (slots * g.slot_step)[None, :] + positions[None, :] * g.block_step[:, None]
    engine, host, sizes = engine.reshape(-1), host.reshape(-1), np.repeat(g.page, ids.size)
    if host.size > 1 and not (host[1:] > host[:-1]).all():  # a single chunk is in host order already
        order = np.argsort(host, kind="stable")
        engine, host, sizes = engine[order], host[order], sizes[order]
    return merge_runs(store, engine, host, sizes)


def _plan_segment(g: PlanGeometry, store: bool, seg) -> CopyPlan:
    """:func:`plan_copy` of one segment, the common job, in as few numpy calls as it takes.

    Region-major entries of one slot are in host order already, except where
    planes lie in another order (sorted then); a few microseconds per job
    matter for 64 KiB chunks on the CPU (docs/PERFORMANCE.md).
    """
    ids = np.asarray(seg.block_ids, np.int64)
    positions = np.arange(seg.first_block, seg.first_block + ids.size, dtype=np.int64)
    engine = (g.region_base[:, None] + ids * g.region_stride[:, None]).reshape(-1)
    if g.planes:
        positions += seg.slot * g.blocks_per_chunk
    host = ((g.host_base + seg.slot * g.slot_step)[:, None] + positions * g.block_step[:, None]).reshape(-1)
    sizes = np.repeat(g.page, ids.size)
    if g.planes and host.size > 1 and not (host[1:] > host[:-1]).all():
        order = np.argsort(host, kind="stable")
        engine, host, sizes = engine[order], host[order], sizes[order]
    return merge_runs(store, engine, host, sizes)


def merge_runs(store: bool, engine: np.ndarray, host: np.ndarray, sizes: np.ndarray) -> CopyPlan:
    """Merge neighbouring entries contiguous on both sides into one run each.

    Takes ownership of the arrays: a plan with nothing to merge keeps them as they are.
    """
    if engine.size == 0:
        return CopyPlan(store, engine.astype(np.int64), host.astype(np.int64), sizes.astype(np.int64))
    joins = (engine[1:] == engine[:-1] + sizes[:-1]) & (host[1:] == host[:-1] + sizes[:-1])
    if not joins.any():  # scattered pages: nothing to merge
        return CopyPlan(store, engine, host, sizes)
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return CopyPlan(store, engine[starts].copy(), host[starts].copy(), np.add.reduceat(sizes, starts))


def run_plan_on_host(plan: CopyPlan) -> int:
    """Execute a plan whose both sides are host memory: one ``memmove`` per run (GIL released); bytes moved."""
    move = ctypes.memmove
    for src, dst, size in zip(plan.src_ptrs.tolist(), plan.dst_ptrs.tolist(), plan.sizes.tolist()):
        move(dst, src, size)
    return plan.nbytes
