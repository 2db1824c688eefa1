"""The worker pipeline: device <-> host chained with host <-> a real disk tier.

A staged load reads chunks from the disk tier into host staging slots and then
copies them into engine blocks, in one job; a chunk whose read fails (here: a
corrupted file, caught by its checksum) is left out and reported failed; a
demotion writes host slots to disk; deletes remove files (on the housekeeping lane).
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
import torch

from tiercache.jobs import DemoteJob
from tiercache.testing.job_builders import make_job
from tiercache.backend import BackendContext, JobResult
from tiercache.backends.disk.backend import DiskBackend, DiskSettings
from tiercache.transfer.device import CopySegment
from tiercache.layout import KVBlockLayout
from tiercache.transfer.pipeline import WorkerPipeline
from tiercache.tiers.tier_io import TierIO
from tiercache.transfer.engine import TransferEngine

NUM_BLOCKS = 16
BPC = 2
SLOTS = 4
NS = b"\x07" * 8


def key(i: int) -> bytes:
    return NS + bytes([i]) * 32 + b"\x00\x00\x00\x00"


@pytest.fixture
def setup(tmp_path: pathlib.Path) -> Iterator[tuple[WorkerPipeline, dict[str, torch.Tensor], DiskBackend]]:
    gen = torch.Generator().manual_seed(0)
    kvs = {f"l{i}": torch.randn(NUM_BLOCKS, 2, 32, 2, 16, generator=gen) for i in range(2)}
    layout = KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)
    engine = TransferEngine(layout, BPC, SLOTS)
    chunk_bytes = layout.slot_bytes(BPC)
    disk = DiskBackend(
        DiskSettings(root=tmp_path / "disk", io_threads=2, fsync="none"),
        BackendContext("disk", NS, chunk_bytes, capacity_bytes=64 * (chunk_bytes + 8192)),
    )
    pipe = WorkerPipeline(engine, TierIO({"disk": disk}, engine.host.slab))
    yield pipe, kvs, disk
    pipe.shutdown()


def blocks(kvs: dict[str, torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    return [t[ids].clone() for t in kvs.values()]


def test_store_demote_then_staged_load_restores_bytes(setup) -> None:  # type: ignore[no-untyped-def]
    pipe, kvs, disk = setup
    src_ids = [3, 4]
    expected = blocks(kvs, src_ids)
    pipe.submit(make_job(1, "r", "store", (key(1),), (CopySegment(0, 0, tuple(src_ids)),)))
    assert pipe.wait_for([1])[0].ok
    pipe.submit_demote(DemoteJob(2, "disk", (key(1),), (0,)))
    (demoted,) = pipe.wait_for([2])
    assert demoted.ok and demoted.ok_keys == (key(1),)
    pipe.engine.host.slab.zero_()  # the host copy is gone: only disk has it now
    for t in kvs.values():
        t[[9, 10]] = 0
    pipe.submit(make_job(3, "r", "load", (key(1),), (CopySegment(2, 0, (9, 10)),), ("disk",)))
    (loaded,) = pipe.wait_for([3])
    assert loaded.ok
    for got, want in zip(blocks(kvs, [9, 10]), expected):
        assert torch.equal(got, want)


def test_failed_staged_read_is_left_out_and_reported(setup) -> None:  # type: ignore[no-untyped-def]
    pipe, kvs, disk = setup
    pipe.submit(make_job(1, "r", "store", (key(1), key(2)), (CopySegment(0, 0, (1, 2)), CopySegment(1, 0, (5, 6)))))
    pipe.wait_for([1])
    pipe.submit_demote(DemoteJob(2, "disk", (key(1), key(2)), (0, 1)))
    pipe.wait_for([2])
    before = blocks(kvs, [12, 13])
    pipe.submit(make_job(3, "r", "load", (key(1), key(9)), (CopySegment(2, 0, (11,)), CopySegment(3, 0, (12, 13))), ("disk", "disk")))
    (res,) = pipe.wait_for([3])
    assert res.ok_keys == (key(1),) and res.failed_keys == (key(9),)  # key 9 was never stored
    for got, want in zip(blocks(kvs, [12, 13]), before):
        assert torch.equal(got, want)  # the failed chunk's blocks were not written


def test_delete_removes_from_the_tier(setup) -> None:  # type: ignore[no-untyped-def]
    pipe, kvs, disk = setup
    pipe.submit(make_job(1, "r", "store", (key(1),), (CopySegment(0, 0, (1, 2)),)))
    pipe.wait_for([1])
    pipe.submit_demote(DemoteJob(2, "disk", (key(1),), (0,)))
    pipe.wait_for([2])
    assert list(disk.recover()) == [key(1)]
    pipe.delete({"disk": [key(1)]})  # on the tier's housekeeping lane, off this thread
    assert pipe.tier_io is not None and pipe.tier_io.wait_deletes(10.0)
    assert list(disk.recover()) == []


def test_without_lower_tiers_staged_jobs_fail_cleanly(tmp_path: pathlib.Path) -> None:
    kvs = {"l": torch.zeros(NUM_BLOCKS, 2, 32, 2, 16)}
    engine = TransferEngine(KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS), BPC, SLOTS)
    pipe = WorkerPipeline(engine)
    pipe.submit(make_job(1, "r", "load", (key(1),), (CopySegment(0, 0, (1,)),), ("disk",)))
    pipe.submit_demote(DemoteJob(2, "disk", (key(1),), (0,)))
    results = {r.job_id: r for r in pipe.wait_for([1, 2])}
    assert results[1].failed_keys == (key(1),) and results[2].failed_keys == (key(1),)
    pipe.shutdown()


class CopyingBlockReader:
    """A direct tier for the pipeline's contract: "reads" chunks from a dict into the engine blocks.

    The real one (NIXL READs from a producer) is tested in tests/integration/test_pd_direct.py.
    """

    def __init__(self, kvs: dict[str, torch.Tensor], source: dict[bytes, list[torch.Tensor]]) -> None:
        self.kvs, self.source = kvs, source
        self.done: list = []

    def read_chunks(self, job_id, chunks) -> None:  # type: ignore[no-untyped-def]
        ok, failed, moved = [], [], 0
        for k, seg in ((c.key, c.segment()) for c in chunks):
            if k not in self.source:
                failed.append(k)
                continue
            for t, src in zip(self.kvs.values(), self.source[k]):
                t[list(seg.block_ids)] = src[seg.first_block:seg.first_block + len(seg.block_ids)]
                moved += src[0].numel() * src.element_size() * len(seg.block_ids)
            ok.append(k)
        self.done.append(JobResult(job_id, tuple(ok), tuple(failed), moved, 0.0))

    def poll_blocks(self) -> list:
        out, self.done = self.done, []
        return out


def test_direct_chunks_load_beside_host_chunks_in_one_job(setup) -> None:  # type: ignore[no-untyped-def]
    pipe, kvs, _disk = setup
    gen = torch.Generator().manual_seed(5)
    remote = [torch.randn(BPC, 2, 32, 2, 16, generator=gen) for _ in kvs]
    pipe.block_readers["peer_direct"] = CopyingBlockReader(kvs, {key(7): remote})
    expected_host = blocks(kvs, [1, 2])
    pipe.submit(make_job(1, "r", "store", (key(1),), (CopySegment(0, 0, (1, 2)),)))
    assert pipe.wait_for([1])[0].ok
    before_failed = blocks(kvs, [14, 15])
    spec = make_job(2, "r", "load", (key(1), key(7), key(8)),
                    (CopySegment(0, 0, (9, 10)), CopySegment(-1, 0, (11, 12)), CopySegment(-1, 0, (14, 15))),
                    (None, "peer_direct", "peer_direct"))
    pipe.submit(spec)
    (res,) = pipe.wait_for([2])
    assert set(res.ok_keys) == {key(1), key(7)} and res.failed_keys == (key(8),)
    for got, want in zip(blocks(kvs, [9, 10]), expected_host):
        assert torch.equal(got, want)  # the host chunk was copied
    for got, want in zip(blocks(kvs, [11, 12]), remote):
        assert torch.equal(got, want)  # the direct chunk was read straight into its blocks
    for got, want in zip(blocks(kvs, [14, 15]), before_failed):
        assert torch.equal(got, want)
    assert res.bytes > sum(t[0].numel() * 4 * 2 for t in kvs.values())  # both parts counted


def test_a_job_of_direct_chunks_only_never_touches_the_host_tier(setup) -> None:  # type: ignore[no-untyped-def]
    pipe, kvs, _disk = setup
    remote = [torch.full((BPC, 2, 32, 2, 16), 3.0) for _ in kvs]
    pipe.block_readers["peer_direct"] = CopyingBlockReader(kvs, {key(4): remote})
    pipe.submit(make_job(3, "r", "load", (key(4),), (CopySegment(-1, 1, (6,)),), ("peer_direct",)))
    (res,) = pipe.wait_for([3])
    assert res.ok_keys == (key(4),) and all(torch.equal(t[6], r[1]) for t, r in zip(kvs.values(), remote))
