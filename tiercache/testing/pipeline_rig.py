"""A worker pipeline on small random KV blocks with one lower tier: the fault tests' and the kit's rig.

:class:`PipelineRig` builds what a vLLM worker builds (KV tensors, a
TransferEngine with its host slab, a TierIO with one lower tier ``tier`` and a
WorkerPipeline with deadlines), without vLLM, and offers the moves the tests
make: store blocks into a host slot and demote it, load chunks (staged or not)
into blocks, mark and read blocks and slots.

Threading: the test's thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from tiercache.backend import Backend, BackendContext, JobResult
from tiercache.jobs import DemoteJob
from tiercache.layout import KVBlockLayout
from tiercache.testing.job_builders import make_job
from tiercache.tiers.tier_io import TierIO
from tiercache.transfer.device import CopySegment
from tiercache.transfer.engine import TransferEngine
from tiercache.transfer.pipeline import WorkerPipeline

NUM_BLOCKS, BPC, SLOTS = 16, 2, 6
NAMESPACE = b"\x07" * 8
TIER = "lower"


def rig_key(i: int) -> bytes:
    return NAMESPACE + bytes([i]) * 32 + b"\x00\x00\x00\x00"


class PipelineRig:
    """Engine blocks, a host slab, and lower tier ``TIER`` (from ``make``) behind a WorkerPipeline."""

    def __init__(self, make: Callable[[BackendContext], Backend], load_s: float, store_s: float) -> None:
        gen = torch.Generator().manual_seed(0)
        self.kvs = {f"l{i}": torch.randn(NUM_BLOCKS, 2, 32, 2, 16, generator=gen) for i in range(2)}
        layout = KVBlockLayout.from_kv_caches(self.kvs, NUM_BLOCKS)
        self.transfer = TransferEngine(layout, BPC, SLOTS)
        chunk = layout.slot_bytes(BPC)
        self.backend = make(BackendContext(TIER, NAMESPACE, chunk, 64 * (chunk + 8192)))
        self.tier_io = TierIO({TIER: self.backend}, self.transfer.host.slab)
        self.pipe = WorkerPipeline(self.transfer, self.tier_io, load_deadline_s=load_s, store_deadline_s=store_s)
        self.pipe.track_reports = True
        self.next_job = 100

    def job(self) -> int:
        self.next_job += 1
        return self.next_job

    def blocks(self, ids: Sequence[int]) -> list[torch.Tensor]:
        return [t[list(ids)].clone() for t in self.kvs.values()]

    def mark(self, ids: Sequence[int], value: float = 7.0) -> None:
        for t in self.kvs.values():
            t[list(ids)] = value

    def marked(self, ids: Sequence[int], value: float = 7.0) -> bool:
        return all(bool(torch.all(b == value)) for b in self.blocks(ids))

    def slot(self, s: int) -> torch.Tensor:
        return self.transfer.host.slab[s].clone()

    def store(self, k: bytes, slot: int, block_ids: tuple[int, ...]) -> JobResult:
        job = self.job()
        self.pipe.submit(make_job(job, "r", "store", (k,), (CopySegment(slot, 0, block_ids),)))
        return self.result(job)

    def demote(self, k: bytes, slot: int) -> JobResult:
        job = self.job()
        self.pipe.submit_demote(DemoteJob(job, TIER, (k,), (slot,)))
        return self.result(job)

    def store_and_demote(self, k: bytes, slot: int, block_ids: tuple[int, ...]) -> JobResult:
        """Blocks -> host slot ``slot`` -> the lower tier; the demotion's result."""
        assert self.store(k, slot, block_ids).ok
        return self.demote(k, slot)

    def load(self, keys: tuple[bytes, ...], segments: tuple[CopySegment, ...],
             tiers: tuple[str | None, ...]) -> tuple[int, float, JobResult]:
        """Run a load to its result: (job id, seconds waited, result)."""
        job = self.job()
        start = time.perf_counter()
        self.pipe.submit(make_job(job, "r", "load", keys, segments, tiers))
        res = self.result(job)
        return job, time.perf_counter() - start, res

    def result(self, job: int) -> JobResult:
        (res,) = [r for r in self.pipe.wait_for([job]) if r.job_id == job]
        return res

    def reports(self) -> dict[int, JobResult]:
        return {r.job_id: r for r in self.pipe.take_reports()}

    def close(self) -> None:
        self.pipe.shutdown()
