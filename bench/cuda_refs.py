"""CUDA-only yardsticks for bench/host_tier.py: vLLM's batched swap op on the same pages, and calls per chunk.

* :class:`VllmBatchReference`: the store and load jobs' pages as pointer
  arrays (the copier's own :class:`~tiercache.transfer.copy_plan.CopyPlan`), each job
  one ``vllm._custom_ops.swap_blocks_batch`` call on the current stream: what
  vLLM's own offloading path does with the same bytes. None where the installed
  vLLM has no CUDA build of the op (the bench then prints n/a).
* :func:`calls_per_chunk`: how many copy calls (batched calls, gather kernels and
  index uploads, DMAs) one chunk's store job costs with the copier's method.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch

from tiercache.jobs import TransferJob
from tiercache.layout import block_runs
from tiercache.transfer.copy_plan import CopyPlan, plan_copy
from tiercache.transfer.cuda_batch import vllm_batch_op
from tiercache.transfer.engine import TransferEngine


def _plans(engine: TransferEngine, jobs: Sequence[TransferJob], store: bool) -> list[CopyPlan]:
    geometry = engine.copier._geometry
    return [plan_copy(geometry, store, job.segments) for job in jobs]


class VllmBatchReference:
    """vLLM's swap_blocks_batch over the pages of the bench's store and load jobs."""

    def __init__(self, op: object, stores: list[CopyPlan], loads: list[CopyPlan]) -> None:
        self._op = op
        self._stores = [self._tensors(p) for p in stores]
        self._loads = [self._tensors(p) for p in loads]

    @staticmethod
    def _tensors(plan: CopyPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.from_numpy(np.ascontiguousarray(plan.src_ptrs)),
                torch.from_numpy(np.ascontiguousarray(plan.dst_ptrs)),
                torch.from_numpy(np.ascontiguousarray(plan.sizes)))

    @classmethod
    def build(cls, engine: TransferEngine, stores: Sequence[TransferJob]) -> VllmBatchReference | None:
        op = vllm_batch_op()
        if op is None or not hasattr(engine.copier, "_geometry"):
            return None
        return cls(op, _plans(engine, stores, True), _plans(engine, stores, False))

    def _run(self, batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for src, dst, sizes in batches:
            self._op(src, dst, sizes)  # type: ignore[operator]
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def store(self) -> float:
        return self._run(self._stores)

    def load(self) -> float:
        return self._run(self._loads)


def calls_per_chunk(engine: TransferEngine, stores: Sequence[TransferJob]) -> float | None:
    """Mean copy calls per store job with the engine's CUDA copier method (None: not a CUDA copier)."""
    copier = engine.copier
    method = getattr(copier, "method", None)
    if method is None:
        return None
    if method == "per_run":
        regions = len(copier.layout.regions)
        return statistics.fmean(
            sum(len(block_runs(seg.block_ids)) for seg in job.segments) * regions for job in stores)
    if method in ("vllm_batch", "driver_batch"):
        return 1.0  # one batched driver call per job
    executor = copier.executor
    counts = []
    for plan in _plans(engine, stores, True):
        chosen = executor.pick(plan) if hasattr(executor, "pick") else executor
        if chosen.name in ("vllm_batch", "driver_batch"):
            counts.append(1)
            continue
        executor_bases = chosen._bases
        which = np.searchsorted(executor_bases, plan.engine_ptrs, side="right") - 1
        windows = len(np.unique(which))
        counts.append(2 * windows + len(plan.host_runs()[0]))  # index upload + kernel per window, DMAs
    return statistics.fmean(counts)
