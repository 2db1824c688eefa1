"""The host slab in layout ``planes``: copies into and out of it, lower tiers, NIXL descriptors.

A slab in layout ``planes`` holds the same chunks as one in layout ``slots``,
as one plane of pages per region (tiercache/layout.py). Everything here is
checked against the ``slots`` path, which has its own tests (test_copier.py):
the same store job must leave, per slot, exactly the bytes the ``slots`` slab
holds once gathered; a load must restore the engine blocks; a demotion must
write the chunk's usual byte format to a real disk tier, and a staged load
must bring it back; a P/D consumer's descriptors must coalesce a run of
consecutive slots into one per region.
"""

from __future__ import annotations

import pathlib
import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tiercache.jobs import DemoteJob, TransferJob
from tiercache.testing.job_builders import make_job
from tiercache.backend import BackendContext
from tiercache.backends.disk.backend import DiskBackend, DiskSettings
from tiercache.transfer.device import CopyJob, CopySegment, copy_plane_segments
from tiercache.layout import KVBlockLayout, gather_slot, region_offsets, scatter_slot, slab_planes
from tiercache.pd.blocks import BlockRegions, plane_descs
from tiercache.transfer.pipeline import WorkerPipeline
from tiercache.tiers.tier_io import TierIO
from tiercache.transfer.engine import TransferEngine

NUM_BLOCKS = 32
BPC = 2
SLOTS = 8
NS = b"\x05" * 8


def make_kvs(seed: int = 0) -> dict[str, torch.Tensor]:
    """Three layers, K and V apart ((2, blocks, ...): six regions), of unequal head counts."""
    gen = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randn(2, NUM_BLOCKS, 32, 1 + i, 16, generator=gen) for i in range(3)}


def key(i: int) -> bytes:
    return NS + bytes([i]) * 32 + b"\x00\x00\x00\x00"


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[dict[str, torch.Tensor], TransferEngine, TransferEngine]]:
    kvs = make_kvs()
    layout = KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)
    by_slots = TransferEngine(layout, BPC, SLOTS, copy_threads=request.param)
    in_planes = TransferEngine(layout, BPC, SLOTS, copy_threads=request.param, slot_layout="planes")
    yield kvs, by_slots, in_planes
    by_slots.shutdown()
    in_planes.shutdown()


def run(engine: TransferEngine, job: TransferJob) -> None:
    engine.submit(job)
    (res,) = engine.wait_all()
    assert res.ok and res.job_id == job.job_id


def test_planes_tile_the_slab_in_region_order() -> None:
    pages = [4096, 4096, 1024]
    slab = torch.zeros((SLOTS, sum(pages) * BPC), dtype=torch.uint8)
    planes = slab_planes(slab, pages, BPC)
    base = slab.data_ptr()
    for plane, page, offset in zip(planes, pages, region_offsets(pages, BPC)):
        assert plane.shape == (SLOTS * BPC, page)
        assert plane.data_ptr() == base + SLOTS * offset  # plane r after every slot's regions < r
    assert planes[-1].data_ptr() + planes[-1].numel() == base + slab.numel()  # nothing left over
    with pytest.raises(ValueError, match="do not hold"):
        slab_planes(slab, pages, BPC + 1)


def test_gather_and_scatter_are_inverse() -> None:
    pages = [512, 256]
    slab = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (SLOTS, 768 * BPC), dtype=np.uint8))
    planes = slab_planes(slab, pages, BPC)
    chunk = np.empty(768 * BPC, dtype=np.uint8)
    gather_slot(planes, 5, BPC, chunk)
    assert np.array_equal(chunk[:512 * BPC], planes[0][5 * BPC:6 * BPC].numpy().reshape(-1))
    assert np.array_equal(chunk[512 * BPC:], planes[1][5 * BPC:6 * BPC].numpy().reshape(-1))
    before = [p.clone() for p in planes]
    scatter_slot(planes, 2, BPC, chunk)
    again = np.empty_like(chunk)
    gather_slot(planes, 2, BPC, again)
    assert np.array_equal(again, chunk)
    for plane, old in zip(planes, before):  # only slot 2's pages changed
        assert torch.equal(plane[:2 * BPC], old[:2 * BPC]) and torch.equal(plane[3 * BPC:], old[3 * BPC:])


def random_segments(rng: random.Random, slots: list[int]) -> tuple[CopySegment, ...]:
    """One segment per slot: consecutive engine blocks or not, whole chunks or a partial first one."""
    segs = []
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    for slot in slots:
        first = rng.choice([0, 0, 1])
        n = BPC - first
        if rng.random() < 0.5:
            start = rng.randrange(0, NUM_BLOCKS - n)
            ids = tuple(range(start, start + n))
        else:
            ids = tuple(free.pop() for _ in range(n))
        segs.append(CopySegment(slot, first, ids))
    return tuple(segs)


@pytest.mark.parametrize("seed", range(4))
def test_store_holds_what_a_slots_slab_holds(engines, seed: int) -> None:  # type: ignore[no-untyped-def]
    _kvs, by_slots, in_planes = engines
    rng = random.Random(seed)
    slots = rng.sample(range(SLOTS), 5) if seed % 2 else [2, 3, 4, 5, 6]  # consecutive slots: runs across chunks
    segs = random_segments(rng, slots) if seed else tuple(
        CopySegment(s, 0, (10 + 2 * i, 11 + 2 * i)) for i, s in enumerate(slots))
    job = make_job(1, "r", "store", tuple(key(i) for i in range(len(segs))), segs)
    run(by_slots, job)
    run(in_planes, job)
    assert in_planes.planes is not None
    chunk = np.empty(by_slots.host.slot_bytes, dtype=np.uint8)
    for seg in segs:
        gather_slot(in_planes.planes, seg.slot, BPC, chunk)
        page_bytes = by_slots.layout.page_bytes
        written = np.concatenate([np.arange(off + seg.first_block * p, off + (seg.first_block + len(seg.block_ids)) * p)
                                  for off, p in zip(region_offsets(page_bytes, BPC), page_bytes)])
        assert np.array_equal(chunk[written], by_slots.host.slab[seg.slot].numpy()[written])


def test_load_restores_the_blocks(engines) -> None:  # type: ignore[no-untyped-def]
    kvs, _by_slots, in_planes = engines
    want = {name: t[:, 4:8].clone() for name, t in kvs.items()}
    run(in_planes, make_job(1, "r", "store", (key(1), key(2)),
                                      (CopySegment(6, 0, (4, 5)), CopySegment(7, 0, (6, 7)))))
    for t in kvs.values():
        t[:, 4:8] = 0
    run(in_planes, make_job(2, "r", "load", (key(1), key(2)),
                                      (CopySegment(6, 0, (4, 5)), CopySegment(7, 0, (6, 7)))))
    assert all(torch.equal(kvs[name][:, 4:8], w) for name, w in want.items())
    # into other blocks, out of order, and a partial chunk
    run(in_planes, make_job(3, "r", "load", (key(1), key(2)),
                                      (CopySegment(6, 0, (20, 12)), CopySegment(7, 1, (30,)))))
    for name, t in kvs.items():
        assert torch.equal(t[:, 20], want[name][:, 0]) and torch.equal(t[:, 12], want[name][:, 1])
        assert torch.equal(t[:, 30], want[name][:, 3])


def test_a_run_of_slots_and_blocks_lands_as_one_span_per_plane() -> None:
    kvs = make_kvs()
    layout = KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)
    slab = torch.zeros((SLOTS, layout.slot_bytes(BPC)), dtype=torch.uint8)
    planes = slab_planes(slab, layout.page_bytes, BPC)
    segs = tuple(CopySegment(2 + i, 0, (8 + 2 * i, 9 + 2 * i)) for i in range(4))
    moved = copy_plane_segments(layout, planes, SLOTS, BPC, CopyJob(1, "store", segs))
    assert moved == 4 * layout.slot_bytes(BPC)
    for region, plane in zip(layout.regions, planes):  # host blocks 4..11 are engine blocks 8..15
        assert torch.equal(plane[4:12], region[8:16])
        assert int(plane[:4].sum()) == 0 and int(plane[12:].sum()) == 0
    with pytest.raises(IndexError):
        copy_plane_segments(layout, planes, SLOTS, BPC, CopyJob(2, "store", (CopySegment(SLOTS, 0, (0, 1)),)))


@pytest.fixture
def disk_pipe(tmp_path: pathlib.Path) -> Iterator[tuple[WorkerPipeline, dict[str, torch.Tensor], DiskBackend, TransferEngine]]:
    kvs = make_kvs(seed=7)
    layout = KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)
    engine = TransferEngine(layout, BPC, SLOTS, slot_layout="planes")
    chunk_bytes = layout.slot_bytes(BPC)
    disk = DiskBackend(
        DiskSettings(root=tmp_path / "disk", io_threads=2, fsync="none"),
        BackendContext("disk", NS, chunk_bytes, capacity_bytes=64 * (chunk_bytes + 8192)),
    )
    by_slots = TransferEngine(layout, BPC, SLOTS)  # for the chunk's byte format
    assert engine.planes is not None
    pipe = WorkerPipeline(engine, TierIO({"disk": disk}, engine.host.slab, engine.planes, BPC))
    yield pipe, kvs, disk, by_slots
    pipe.shutdown()
    by_slots.shutdown()


def test_demotion_writes_the_usual_chunk_format_and_a_staged_load_brings_it_back(disk_pipe) -> None:  # type: ignore[no-untyped-def]
    pipe, kvs, disk, by_slots = disk_pipe
    want = {name: t[:, 3:5].clone() for name, t in kvs.items()}
    store = make_job(1, "r", "store", (key(1),), (CopySegment(4, 0, (3, 4)),))
    pipe.submit(store)
    assert pipe.wait_for([1])[0].ok
    pipe.submit_demote(DemoteJob(2, "disk", (key(1),), (4,)))
    assert pipe.wait_for([2])[0].ok_keys == (key(1),)
    # what the disk holds is what a slots engine would have demoted: read it into a plain buffer
    run(by_slots, store)
    disk.submit_get(9, [key(1)], [memoryview(buf := np.zeros(by_slots.host.slot_bytes, np.uint8))])
    while not (got := disk.poll()):
        pass
    assert got[0].ok_keys == (key(1),) and np.array_equal(buf, by_slots.host.slab[4].numpy())
    pipe.engine.host.slab.zero_()  # the host copy is gone: only disk has it now
    for t in kvs.values():
        t[:, 3:5] = 0
    pipe.submit(make_job(3, "r", "load", (key(1), key(2)),
                         (CopySegment(1, 0, (10, 11)), CopySegment(2, 0, (12, 13))), ("disk", "disk")))
    (res,) = pipe.wait_for([3])
    assert res.ok_keys == (key(1),) and res.failed_keys == (key(2),)  # key 2 was never stored
    for name, t in kvs.items():
        assert torch.equal(t[:, 10:12], want[name])
    assert int(pipe.engine.planes[0][2 * BPC:3 * BPC].sum()) == 0  # the failed chunk's slot stays untouched


def test_plane_descs_coalesce_consecutive_slots_and_blocks() -> None:
    ours = BlockRegions((1 << 20, 2 << 20), (1024, 4096), (1024, 512), 64, "DRAM", 0)
    planes = BlockRegions((8 << 20, 9 << 20), (1024, 512), (1024, 512), SLOTS * BPC, "DRAM", 0)
    local, remote = plane_descs(ours, planes, SLOTS, [3, 4, 5], [0, 0, 0], [(10, 11), (12, 13), (14, 15)])
    # region 0: contiguous pages on both sides: one descriptor; region 1: our stride 4096 > page: per block
    assert local.shape == (1 + 6, 3)
    assert tuple(local[0]) == (ours.addrs[0] + 10 * 1024, 6 * 1024, 0)
    assert tuple(remote[0]) == (planes.addrs[0] + 6 * 1024, 6 * 1024, 0)
    assert [tuple(r) for r in remote[1:3]] == [(planes.addrs[1] + 6 * 512, 512, 0), (planes.addrs[1] + 7 * 512, 512, 0)]
    local, remote = plane_descs(ours, planes, SLOTS, [3, 5], [1, 0], [(10,), (11, 12)])  # slot gap: two runs
    assert len(local) == 2 + 3 and tuple(remote[0]) == (planes.addrs[0] + 7 * 1024, 1024, 0)
    with pytest.raises(ValueError, match="overflow"):
        plane_descs(ours, planes, SLOTS, [1], [1], [(2, 3)])
    other = BlockRegions((8 << 20, 9 << 20), (2048, 512), (2048, 512), SLOTS * BPC, "DRAM", 0)
    with pytest.raises(ValueError, match="do not match"):
        plane_descs(ours, other, SLOTS, [1], [0], [(2, 3)])
    with pytest.raises(ValueError, match="divide"):
        plane_descs(ours, planes, SLOTS + 1, [1], [0], [(2, 3)])


@pytest.mark.parametrize(("role", "pd", "layout", "want"), [
    ("kv_producer", {}, None, "planes"),  # via_host is the default mode
    ("kv_producer", {"mode": "direct"}, None, "slots"),  # consumers read the KV blocks, not the slab
    ("kv_consumer", {}, None, "slots"),
    ("kv_both", None, None, "slots"),  # offloading only
    ("kv_both", {"mode": "via_host"}, None, "planes"),
    ("kv_producer", {}, "slots", "slots"),  # as configured
    ("kv_both", None, "planes", "planes"),
])
def test_the_worker_lays_out_a_via_host_producers_slab_in_planes(
        role: str, pd: dict | None, layout: str | None, want: str) -> None:
    from tiercache.config.schema import load_config
    from tiercache.connector.worker import TierCacheWorker

    tiers = [{"name": "cpu", "backend": "cpu", "capacity": "64MiB", **({"options": {"layout": layout}} if layout else {})}]
    config = load_config(tiers=tiers, **({"pd": pd} if pd is not None else {}))
    worker = TierCacheWorker(config, geometry=None, num_blocks=NUM_BLOCKS, kv_role=role)  # type: ignore[arg-type]
    host = config.host_options
    assert worker.pd.host_slab(host.prefault, host.layout).layout == want


def test_an_unknown_slab_layout_is_refused_naming_the_choices() -> None:
    from tiercache.config.schema import ConfigError, load_config

    with pytest.raises(ConfigError, match="planes"):
        load_config(tiers=[{"name": "cpu", "backend": "cpu", "capacity": "64MiB", "options": {"layout": "rows"}}])
