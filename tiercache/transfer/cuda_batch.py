"""Executors of a :class:`~tiercache.transfer.copy_plan.CopyPlan` between device KV and the host slab.

Each executor issues one job's copies on the *current* stream (the CUDA
copier makes its store or load stream current) with a few calls whatever the
number of pages, and never waits for them:

* :class:`VllmBatchExecutor` (``vllm_batch``): vLLM's own batched swap op
  (``vllm._custom_ops.swap_blocks_batch``: one ``cuMemcpyBatchAsync`` on CUDA
  >= 12.8) over the plan's pointer arrays. Only where the installed vLLM is a
  CUDA build that has the op.
* :class:`~tiercache.transfer.cuda_driver_batch.DriverBatchExecutor` (``driver_batch``):
  the same driver call (``cuMemcpyBatchAsync``) through ctypes, where the
  driver has it (CUDA >= 12.8), with no vLLM needed.
* :class:`GatherExecutor` (``gather``): the pages are gathered on the device
  into a contiguous staging buffer by one ``index_select`` kernel per engine
  buffer (vLLM 0.32 keeps every layer of a KV-cache group in one buffer: one
  kernel), then one DMA per contiguous host range moves the staging buffer to
  the slab (a full chunk slot is one range); loads do the reverse (DMA, then
  ``index_copy_``). Costs device memory for staging (the job's bytes, taken
  from torch's caching allocator on the copy stream, so its reuse is stream
  ordered) and one device-side pass (~1/40 of the PCIe time on a Hopper).
  Runs on CPU tensors too, which is how it is tested here.
* ``per_run`` (:func:`tiercache.transfer.device.copy_segments`): one
  ``copy_`` per run of consecutive blocks per region: the old path, kept as
  the benchmark's baseline.

:func:`pick_executor` chooses. ``auto``: ``vllm_batch`` where available;
else, where the driver has ``cuMemcpyBatchAsync``, :class:`AutoExecutor`, which
sends a plan whose runs average at least ``DMA_RUN_BYTES`` to ``driver_batch``
(large pages: the copy engines read the pages in place, no device pass) and
smaller ones to ``gather`` (many small DMAs are slow, one kernel is not);
else ``gather``. See docs/PERFORMANCE.md for the measurements behind it. Who owns what: an executor holds views of the engine's KV
buffers (it never frees them) and of the slab; the plan's index tensors and
staging buffers are the caller's stream's, freed to the caching allocator once
the call returns (their reuse waits for the stream).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np
import torch

from tiercache.layout import KVBlockLayout
from tiercache.transfer.copy_plan import CopyPlan
from tiercache.transfer.cuda_driver_batch import DriverBatchExecutor, driver_batch
from tiercache.transfer.pinned_ring import PinnedRing

CopyMethod = Literal["auto", "vllm_batch", "driver_batch", "gather", "per_run"]
STAGING_PIECE_BYTES = 256 << 20  # a job larger than this is gathered in pieces (bounds device staging)
DMA_RUN_BYTES = 64 << 10  # auto: plans whose runs average this or more go to the batched DMA
INDEX_RING_ENTRIES = 1 << 20  # pinned int64 row indices (8 MiB): many jobs' uploads in flight


class PlanExecutor(Protocol):
    name: str

    def run(self, plan: CopyPlan) -> int:
        """Issue every copy of ``plan`` on the current stream; bytes moved."""
        ...


def vllm_batch_op() -> object | None:
    """vLLM's ``swap_blocks_batch`` if the installed vLLM is a CUDA build that has it, else None."""
    try:
        from vllm import _custom_ops as ops
    except Exception:  # noqa: BLE001 - no vLLM, or a build without CUDA ops
        return None
    op = getattr(ops, "swap_blocks_batch", None)
    cache_ops = getattr(torch.ops, "_C_cache_ops", None)
    if op is None or cache_ops is None or not hasattr(cache_ops, "swap_blocks_batch"):
        return None
    return op


class VllmBatchExecutor:
    """One ``swap_blocks_batch`` call per plan (pointer arrays on the host, read during the call)."""

    name = "vllm_batch"

    def __init__(self, op: object) -> None:
        self._op = op

    def run(self, plan: CopyPlan) -> int:
        if plan.count:
            self._op(torch.from_numpy(np.ascontiguousarray(plan.src_ptrs)),  # type: ignore[operator]
                     torch.from_numpy(np.ascontiguousarray(plan.dst_ptrs)),
                     torch.from_numpy(np.ascontiguousarray(plan.sizes)))
        return plan.nbytes


class _Window:
    """One engine buffer (a storage holding some regions) as a flat byte tensor."""

    def __init__(self, storage_tensor: torch.Tensor) -> None:
        self.bytes = storage_tensor
        self.base = storage_tensor.data_ptr()
        self.end = self.base + storage_tensor.numel()


def engine_windows(layout: KVBlockLayout) -> list[_Window]:
    """The distinct storages under the layout's regions, each as a flat uint8 tensor, by address."""
    seen: dict[int, _Window] = {}
    for region in layout.regions:
        storage = region.untyped_storage()
        if storage.data_ptr() not in seen:
            flat = torch.empty(0, dtype=torch.uint8, device=region.device)
            flat.set_(storage, 0, (storage.nbytes(),), (1,))
            seen[storage.data_ptr()] = _Window(flat)
    return sorted(seen.values(), key=lambda w: w.base)


class GatherExecutor:
    """Device gather/scatter through a staging buffer, one DMA per contiguous host range."""

    name = "gather"

    def __init__(self, layout: KVBlockLayout, slab: torch.Tensor) -> None:
        self.device = layout.device
        self.windows = engine_windows(layout)
        self._bases = np.asarray([w.base for w in self.windows], np.int64)
        self.slab = slab.view(-1)
        self.slab_base = self.slab.data_ptr()
        # row indices go up through one pinned ring (tiercache/transfer/pinned_ring.py)
        self._ring = PinnedRing(INDEX_RING_ENTRIES, self.device) if self.device.type == "cuda" else None

    def run(self, plan: CopyPlan) -> int:
        for piece in _pieces(plan, STAGING_PIECE_BYTES):
            self._run_piece(piece)
        return plan.nbytes

    def _run_piece(self, plan: CopyPlan) -> None:
        which = np.searchsorted(self._bases, plan.engine_ptrs, side="right") - 1
        offsets = plan.engine_ptrs - self._bases[which]
        item = _item_bytes(plan.sizes, offsets)
        rows = plan.sizes // item
        total_rows = int(rows.sum())
        width, dtype = _row_format(item)
        staging = torch.empty((total_rows, width), dtype=dtype, device=self.device)
        stage_bytes = staging.view(torch.uint8).view(-1)
        starts, lengths = plan.host_runs()
        stage_offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        if not plan.store:
            for off, start, length in zip(stage_offsets.tolist(), starts.tolist(), lengths.tolist()):
                host = int(plan.host_ptrs[start]) - self.slab_base
                stage_bytes[off:off + length].copy_(self.slab[host:host + length], non_blocking=True)
        first_rows = offsets // item
        for w in (np.unique(which).tolist() if len(self.windows) > 1 else [0]):
            mine = which == w
            src_rows = _expand(first_rows[mine], rows[mine])
            window = self.windows[w].bytes
            usable = window.numel() // item * item
            window_rows = window[:usable].view(dtype).view(-1, width)
            engine_idx = self._indices(src_rows)
            if mine.all():
                if plan.store:
                    torch.index_select(window_rows, 0, engine_idx, out=staging)
                else:
                    window_rows.index_copy_(0, engine_idx, staging)
                continue
            stage_first = np.concatenate(([0], np.cumsum(rows)[:-1]))[mine]
            stage_idx = self._indices(_expand(stage_first, rows[mine]))
            if plan.store:
                staging.index_copy_(0, stage_idx, window_rows.index_select(0, engine_idx))
            else:
                window_rows.index_copy_(0, engine_idx, staging.index_select(0, stage_idx))
        if plan.store:
            for off, start, length in zip(stage_offsets.tolist(), starts.tolist(), lengths.tolist()):
                host = int(plan.host_ptrs[start]) - self.slab_base
                self.slab[host:host + length].copy_(stage_bytes[off:off + length], non_blocking=True)


    def _indices(self, rows: np.ndarray) -> torch.Tensor:
        """Row indices on the device, uploaded from the pinned ring: a copy from pageable memory
        would first wait for the whole copy stream, i.e. for the forward pass the job follows."""
        if self._ring is None:
            return torch.from_numpy(rows)
        return self._ring.upload(rows)


def _item_bytes(sizes: np.ndarray, offsets: np.ndarray) -> int:
    """The largest byte count that divides every run's length and its offset in its buffer."""
    return int(np.gcd.reduce(np.concatenate((sizes, offsets)))) or int(sizes.max())


def _row_format(item: int) -> tuple[int, torch.dtype]:
    """A row of ``item`` bytes as the widest element that divides it (a faster gather kernel)."""
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if item % size == 0:
            return item // size, dtype
    return item, torch.uint8


def _expand(first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``[first[0], first[0]+1, .., first[0]+counts[0]-1, first[1], ..]`` as int64."""
    total = int(counts.sum())
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(first, counts) + np.arange(total, dtype=np.int64) - starts


def _pieces(plan: CopyPlan, limit: int) -> Sequence[CopyPlan]:
    """The plan cut between runs into pieces of at most ``limit`` bytes (a run larger than it alone)."""
    if plan.nbytes <= limit:
        return (plan,)
    ends = np.cumsum(plan.sizes)
    cuts = [0]
    while cuts[-1] < plan.count:
        base = int(ends[cuts[-1] - 1]) if cuts[-1] else 0
        nxt = int(np.searchsorted(ends, base + limit, side="right"))
        cuts.append(max(nxt, cuts[-1] + 1))
    return tuple(
        CopyPlan(plan.store, plan.engine_ptrs[a:b], plan.host_ptrs[a:b], plan.sizes[a:b])
        for a, b in zip(cuts[:-1], cuts[1:])
    )


class AutoExecutor:
    """Per plan: the batched DMA for large runs, the device gather for small ones."""

    name = "auto"

    def __init__(self, dma: PlanExecutor, gather: PlanExecutor, run_bytes: int = DMA_RUN_BYTES) -> None:
        self.dma, self.gather, self.run_bytes = dma, gather, run_bytes

    def pick(self, plan: CopyPlan) -> PlanExecutor:
        return self.dma if plan.count and plan.nbytes >= self.run_bytes * plan.count else self.gather

    def run(self, plan: CopyPlan) -> int:
        return self.pick(plan).run(plan)


def pick_executor(method: CopyMethod, layout: KVBlockLayout, slab: torch.Tensor) -> PlanExecutor | None:
    """The executor for ``method`` (None: ``per_run``, the copier's old path). ``vllm_batch``
    asked for but missing is an error; ``auto`` falls back to ``gather``."""
    if method == "per_run":
        return None
    if method == "driver_batch":
        fn = driver_batch() if layout.device.type == "cuda" else None
        if fn is None:
            raise ValueError("cuda_copy: driver_batch needs a CUDA driver with cuMemcpyBatchAsync (>= 12.8)")
        return DriverBatchExecutor(fn)
    if method in ("auto", "vllm_batch"):
        op = vllm_batch_op() if layout.device.type == "cuda" else None
        if op is not None:
            return VllmBatchExecutor(op)
        if method == "vllm_batch":
            raise ValueError("cuda_copy: vllm_batch needs a CUDA build of vLLM with swap_blocks_batch")
        fn = driver_batch() if layout.device.type == "cuda" else None
        if fn is not None:
            return AutoExecutor(DriverBatchExecutor(fn), GatherExecutor(layout, slab))
    return GatherExecutor(layout, slab)


__all__ = ["AutoExecutor", "CopyMethod", "GatherExecutor", "PlanExecutor", "VllmBatchExecutor", "pick_executor"]
