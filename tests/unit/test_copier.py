"""Unit tests of the host copier (tiercache/transfer/device.py) on CPU-resident KV caches.

Stores copy engine blocks into host slots, loads copy them back; the expected
slot bytes are computed here from the engine tensors directly (not through
the layout), so a store is checked against the slot format itself:
region-major, region ``r`` of a chunk at ``sum(page[:r]) * blocks_per_chunk``,
block ``i`` of the chunk at ``i * page`` inside it. Every scenario runs on the
three copy paths (the rep-movsb kernel where it works, numpy gathers, per-run
copies) and with one and two copy threads.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence

import pytest
import torch

from tiercache.layout import KVBlockLayout
from tiercache.transfer import host_copier, host_kernel
from tiercache.transfer.copiers import make_copier
from tiercache.transfer.device import CopyDone, CopyJob, CopySegment, copy_segments, zero_blocks
from tiercache.transfer.host_copier import HostThreadCopier
from tiercache.transfer.host_gather import GIL_FREE_ITEMS, MIN_LOAD_ITEM_BYTES, HostSegmentCopier

NUM_BLOCKS = 48
BPC = 4  # blocks per chunk
LAYERS = 3
BLOCK, HEADS, HEAD_DIM = 4, 2, 16


# ------------------------------------------------------------------------------ helpers
def random_kv(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def make_kvs(dtype: torch.dtype, kv_split: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """LAYERS separately allocated layers, FlashInfer (N, 2, ...) or FlashAttention (2, N, ...)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS) if kv_split else (NUM_BLOCKS, 2)
    return {
        f"layer.{i}": random_kv((*shape, BLOCK, HEADS, HEAD_DIM), dtype, gen) for i in range(LAYERS)
    }


def carved_layers(page: int, gap: int) -> dict[str, torch.Tensor]:
    """LAYERS layers of (NUM_BLOCKS, page) bytes carved from one buffer, ``gap`` bytes apart."""
    layer = page * NUM_BLOCKS + gap
    buffer = torch.randint(0, 256, (LAYERS * layer,), dtype=torch.uint8)
    return {
        f"l{i}": buffer[i * layer : i * layer + page * NUM_BLOCKS].view(NUM_BLOCKS, page)
        for i in range(LAYERS)
    }


def pages_of(kvs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each region as (num_blocks, page) bytes, derived from the shapes, not from KVBlockLayout."""
    out = []
    for t in kvs.values():
        subs = [t[0], t[1]] if t.shape[0] == 2 and t.shape[1] == NUM_BLOCKS else [t]
        out.extend(s.reshape(NUM_BLOCKS, -1).view(torch.uint8) for s in subs)
    return out


def expected_slot(kvs: dict[str, torch.Tensor], seg: CopySegment, slot_bytes: int) -> torch.Tensor:
    """The slot after storing ``seg`` into a zeroed slot."""
    slot = torch.zeros(slot_bytes, dtype=torch.uint8)
    base = 0
    for pages in pages_of(kvs):
        page = pages.shape[1]
        for pos, block in enumerate(seg.block_ids):
            start = base + (seg.first_block + pos) * page
            slot[start : start + page] = pages[block]
        base += page * BPC
    return slot


def engine_bytes(kvs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [t.view(torch.uint8).clone() for t in kvs.values()]


def block_bytes(kvs: dict[str, torch.Tensor], block: int) -> list[torch.Tensor]:
    return [pages[block].clone() for pages in pages_of(kvs)]


@pytest.fixture(params=["kernel", "numpy", "per-run"])
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """kernel: every copy by the compiled copy-plan executor (tiercache/transfer/host_kernel.py);
    numpy: the gathers; per-run: one memmove per plan run (neither executor nor gathers)."""
    if request.param == "kernel":
        if host_kernel.run_kernel(force=True) is None:
            pytest.skip("the copy executor was not built here (no C compiler)")
        monkeypatch.setattr(host_copier, "run_kernel", lambda: host_kernel.run_kernel(force=True))
        monkeypatch.setattr(host_copier, "KERNEL_MIN_BYTES", 0)
    else:
        monkeypatch.setattr(host_copier, "run_kernel", lambda: None)
    if request.param == "per-run":
        monkeypatch.setattr(HostSegmentCopier, "build", classmethod(lambda cls, *a: None))
    return str(request.param)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> int:
    return int(request.param)


def new_copier(kvs: dict[str, torch.Tensor], num_slots: int, threads: int) -> HostThreadCopier:
    layout = KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)
    slab = torch.zeros(num_slots, layout.slot_bytes(BPC), dtype=torch.uint8)
    return HostThreadCopier(layout, slab, BPC, threads=threads)


@pytest.fixture
def closing() -> Iterator[list[HostThreadCopier]]:
    copiers: list[HostThreadCopier] = []
    yield copiers
    for copier in copiers:
        copier.close()


SEGMENTS = [
    CopySegment(0, 0, (5, 17, 2, 40)),  # scattered
    CopySegment(1, 0, (8, 9, 10, 11)),  # consecutive: one run
    CopySegment(2, 1, (30, 31)),  # partial: from position 1, two blocks
    CopySegment(3, 0, (44,)),  # partial: first block only
    CopySegment(4, 2, (3, 47)),  # partial, at the end of the chunk
]


# --------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_split", [False, True], ids=["kv-in-block", "kv-apart"])
def test_store_then_load_round_trip(
    dtype: torch.dtype, kv_split: bool, copy_path: str, threads: int, closing: list
) -> None:
    kvs = make_kvs(dtype, kv_split)
    copier = new_copier(kvs, len(SEGMENTS), threads)
    closing.append(copier)
    slot_bytes = copier.slab.shape[1]
    original = engine_bytes(kvs)

    copier.submit(CopyJob(1, "store", tuple(SEGMENTS)))
    (done,) = copier.wait_all()
    assert done == CopyDone(
        1, True, sum(len(s.block_ids) for s in SEGMENTS) * slot_bytes // BPC, done.secs
    )
    for seg in SEGMENTS:
        assert torch.equal(copier.slab[seg.slot], expected_slot(kvs, seg, slot_bytes)), seg
    assert all(torch.equal(a, t.view(torch.uint8)) for a, t in zip(original, kvs.values()))

    before = {name: t.clone() for name, t in kvs.items()}
    for t in kvs.values():
        t.zero_()
    copier.submit(CopyJob(2, "load", tuple(SEGMENTS)))
    (done,) = copier.wait_all()
    assert done.ok and done.job_id == 2
    loaded = {b for seg in SEGMENTS for b in seg.block_ids}
    for block in range(NUM_BLOCKS):
        got = block_bytes(kvs, block)
        if block in loaded:
            assert all(torch.equal(g, w) for g, w in zip(got, block_bytes(before, block))), block
        else:
            assert all(int(g.count_nonzero()) == 0 for g in got), f"block {block} was written"


def test_round_trip_over_one_allocation_with_the_slab_inside(threads: int, closing: list) -> None:
    """Layers carved from one buffer with the slab between them (windows must not span it)."""
    page = 2 * BLOCK * HEADS * HEAD_DIM * 4
    layer_bytes = NUM_BLOCKS * page
    slot_bytes = LAYERS * page * BPC
    slots = 3
    buffer = torch.zeros(LAYERS * layer_bytes + slots * slot_bytes, dtype=torch.uint8)
    offsets = [0, layer_bytes + slots * slot_bytes, 2 * layer_bytes + slots * slot_bytes]
    kvs = {
        f"layer.{i}": buffer[o : o + layer_bytes]
        .view(torch.float32)
        .view(NUM_BLOCKS, 2, BLOCK, HEADS, HEAD_DIM)
        for i, o in enumerate(offsets)
    }
    for t in kvs.values():
        t.copy_(torch.randn(t.shape))
    slab = buffer[layer_bytes : layer_bytes + slots * slot_bytes].view(slots, slot_bytes)
    layout = KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)
    segment_copier = HostSegmentCopier.build(layout, slab, BPC)
    assert segment_copier is not None
    assert len(segment_copier.groups) == 2  # below and above the slab
    copier = HostThreadCopier(layout, slab, BPC, threads=threads)
    closing.append(copier)
    segs = (CopySegment(0, 0, (1, 7, 3, 40)), CopySegment(2, 1, (20, 21, 22)))
    copier.submit(CopyJob(1, "store", segs))
    assert copier.wait_all()[0].ok
    for seg in segs:
        assert torch.equal(slab[seg.slot], expected_slot(kvs, seg, slot_bytes))
    before = [t.clone() for t in kvs.values()]
    for t in kvs.values():
        t.zero_()
    copier.submit(CopyJob(2, "load", segs))
    assert copier.wait_all()[0].ok
    for want, got in zip(before, kvs.values()):
        for block in (1, 7, 3, 40, 20, 21, 22):
            assert torch.equal(want[block], got[block])
        assert float(got[0].abs().sum()) == 0.0


def test_page_aligned_layers_share_one_numpy_call() -> None:
    """Equally aligned layers (a real engine's large tensors) are one group: one take a segment."""
    page = 4096
    big = torch.zeros(LAYERS, 4 * page * NUM_BLOCKS + page, dtype=torch.uint8)
    kvs = {f"l{i}": big[i, : page * NUM_BLOCKS].view(NUM_BLOCKS, page) for i in range(LAYERS)}
    layout = KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)
    slab = torch.zeros(2, layout.slot_bytes(BPC), dtype=torch.uint8)
    copier = HostSegmentCopier.build(layout, slab, BPC)
    assert copier is not None and len(copier.groups) == 1 and copier.item_bytes == page


def test_large_pages_are_cut_so_all_layers_share_one_window(closing: list) -> None:
    """32 KiB pages in layers 4 KiB apart: 4 KiB items, one group, and still exact copies."""
    gap = 4096
    kvs = carved_layers(32768, gap)
    layout = KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)
    slab = torch.zeros(2, layout.slot_bytes(BPC), dtype=torch.uint8)
    segment_copier = HostSegmentCopier.build(layout, slab, BPC)
    assert segment_copier is not None
    assert len(segment_copier.groups) == 1 and segment_copier.item_bytes in (gap, 2 * gap, 4 * gap)
    copier = HostThreadCopier(layout, slab, BPC, threads=2)
    closing.append(copier)
    seg = CopySegment(1, 1, (40, 3, 17))
    copier.submit(CopyJob(1, "store", (seg,)))
    assert copier.wait_all()[0].ok
    assert torch.equal(slab[1], expected_slot(kvs, seg, slab.shape[1]))


def test_tiny_pages_fall_back_to_per_run_copies(closing: list) -> None:
    kvs = {
        "l": torch.arange(NUM_BLOCKS * 4, dtype=torch.int32).view(NUM_BLOCKS, 4)
    }  # 16-byte pages
    layout = KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)
    slab = torch.zeros(1, layout.slot_bytes(BPC), dtype=torch.uint8)
    assert HostSegmentCopier.build(layout, slab, BPC) is None
    copier = HostThreadCopier(layout, slab, BPC)
    closing.append(copier)
    copier.submit(CopyJob(1, "store", (CopySegment(0, 0, (3, 9, 10, 11)),)))
    assert copier.wait_all()[0].ok
    assert slab[0].view(torch.int32).view(BPC, 4)[:, 0].tolist() == [12, 36, 40, 44]


def test_copy_segments_matches_the_numpy_path() -> None:
    kvs = make_kvs(torch.float32, kv_split=True, seed=3)
    layout = KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)
    generic = torch.zeros(len(SEGMENTS), layout.slot_bytes(BPC), dtype=torch.uint8)
    fast = generic.clone()
    job = CopyJob(1, "store", tuple(SEGMENTS))
    moved = copy_segments(layout, generic, BPC, job)
    segment_copier = HostSegmentCopier.build(layout, fast, BPC)
    assert segment_copier is not None
    assert segment_copier.copy(job) == moved
    assert torch.equal(generic, fast)


# ---------------------------------------------------------------------------- in flight
def gate_first_job(copier: HostThreadCopier, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the copy of job 1 (and of any batch of parts a thread took with it) wait until the returned
    event is set."""
    release = threading.Event()
    run_parts = copier._run_parts

    def gated(batch: list) -> None:
        if any(part.job_id == 1 for _, part in batch):
            assert release.wait(10)
        run_parts(batch)

    monkeypatch.setattr(copier, "_run_parts", gated)
    return release


def test_several_jobs_in_flight_are_polled_fifo(
    copy_path: str, threads: int, closing: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    kvs = make_kvs(torch.float32, kv_split=False)
    copier = new_copier(kvs, 8, threads)
    closing.append(copier)
    release = gate_first_job(copier, monkeypatch)
    jobs = [
        CopyJob(i + 1, "store", (CopySegment(i, 0, tuple(range(4 * i, 4 * i + 4))),))
        for i in range(8)
    ]
    for job in jobs:
        copier.submit(job)
    time.sleep(0.2)  # jobs 2..8 may finish meanwhile, but job 1 holds them back
    assert copier.poll() == []
    release.set()
    done = copier.wait_all()
    assert [d.job_id for d in done] == list(range(1, 9))
    assert all(d.ok for d in done)
    assert copier.poll() == []
    for i, job in enumerate(jobs):
        assert torch.equal(
            copier.slab[i], expected_slot(kvs, job.segments[0], copier.slab.shape[1])
        )


def test_poll_drains_without_waiting(closing: list, monkeypatch: pytest.MonkeyPatch) -> None:
    copier = new_copier(make_kvs(torch.float32, kv_split=False), 2, 1)
    closing.append(copier)
    release = gate_first_job(copier, monkeypatch)
    copier.submit(CopyJob(1, "store", (CopySegment(0, 0, (0, 1, 2, 3)),)))
    start = time.perf_counter()
    assert copier.poll() == []
    assert time.perf_counter() - start < 1.0
    release.set()
    deadline = time.monotonic() + 10
    polled: list[CopyDone] = []
    while not polled and time.monotonic() < deadline:
        polled = copier.poll()
        time.sleep(0.01)
    assert [d.job_id for d in polled] == [1]


def test_jobs_split_across_threads_report_once(closing: list) -> None:
    """A job of many segments is copied in parts by both threads; it reports once, all bytes."""
    kvs = make_kvs(torch.bfloat16, kv_split=True)
    copier = new_copier(kvs, 10, 2)
    closing.append(copier)
    segs = tuple(CopySegment(i, 0, tuple(range(4 * i, 4 * i + 4))) for i in range(10))
    copier.submit(CopyJob(7, "store", segs))
    (done,) = copier.wait_all()
    assert done.ok and done.job_id == 7 and done.bytes == 10 * copier.slab.shape[1]
    for seg in segs:
        assert torch.equal(copier.slab[seg.slot], expected_slot(kvs, seg, copier.slab.shape[1]))


# ------------------------------------------------------------------------------ failures
@pytest.mark.parametrize(
    "segment",
    [
        CopySegment(99, 0, (1, 2)),  # slot out of range
        CopySegment(-1, 0, (1, 2)),  # negative slot (would silently address the last one)
        CopySegment(0, 0, (1, NUM_BLOCKS)),  # block id out of range
        CopySegment(0, 0, (-1,)),  # negative block id
        CopySegment(0, 3, (1, 2)),  # overflows the chunk
    ],
    ids=["slot", "negative-slot", "block", "negative-block", "overflow"],
)
def test_bad_copy_is_a_failed_job_not_an_exception(
    segment: CopySegment, copy_path: str, threads: int, closing: list
) -> None:
    kvs = make_kvs(torch.float32, kv_split=True)
    copier = new_copier(kvs, 2, threads)
    closing.append(copier)
    original = engine_bytes(kvs)
    copier.submit(CopyJob(1, "load", (segment,)))
    copier.submit(CopyJob(2, "store", (CopySegment(1, 0, (0, 1, 2, 3)),)))
    first, second = copier.wait_all()
    assert (first.job_id, first.ok, first.bytes) == (1, False, 0)
    assert "out of range" in first.error or "overflow" in first.error
    assert second.ok  # the copier still works
    assert all(torch.equal(a, t.view(torch.uint8)) for a, t in zip(original, kvs.values()))


def test_closed_copier_refuses_jobs() -> None:
    copier = new_copier(make_kvs(torch.float32, kv_split=False), 1, 1)
    copier.close()
    copier.close()  # idempotent
    with pytest.raises(RuntimeError):
        copier.submit(CopyJob(1, "store", (CopySegment(0, 0, (0,)),)))


def test_empty_segment_copies_nothing(copy_path: str, closing: list) -> None:
    copier = new_copier(make_kvs(torch.float32, kv_split=False), 1, 1)
    closing.append(copier)
    copier.submit(CopyJob(1, "store", (CopySegment(0, 0, ()),)))
    (done,) = copier.wait_all()
    assert done.ok and done.bytes == 0
    assert int(copier.slab.count_nonzero()) == 0


# ---------------------------------------------------------------------------- utilities
@pytest.mark.parametrize("kv_split", [False, True])
def test_zero_blocks_zeroes_exactly_those_blocks(kv_split: bool) -> None:
    kvs = make_kvs(torch.bfloat16, kv_split)
    layout = KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)
    before = [block_bytes(kvs, b) for b in range(NUM_BLOCKS)]
    zero_blocks(layout, [3, 9, 40])
    zero_blocks(layout, [])
    for block in range(NUM_BLOCKS):
        after = block_bytes(kvs, block)
        if block in (3, 9, 40):
            assert all(int(a.count_nonzero()) == 0 for a in after)
        else:
            assert all(torch.equal(a, b) for a, b in zip(after, before[block]))


def test_make_copier_on_cpu_is_the_host_thread_copier() -> None:
    kvs = make_kvs(torch.float32, kv_split=False)
    layout = KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)
    slab = torch.zeros(1, layout.slot_bytes(BPC), dtype=torch.uint8)
    copier = make_copier(layout, slab, BPC, copy_threads=1)
    try:
        assert isinstance(copier, HostThreadCopier) and copier.threads == 1
    finally:
        copier.close()


def random_segments(gen: torch.Generator, slots: list[int]) -> tuple[CopySegment, ...]:
    segs = []
    for slot in slots:
        count = int(torch.randint(0, BPC + 1, (1,), generator=gen))
        first = int(torch.randint(0, BPC - count + 1, (1,), generator=gen))
        ids = torch.randperm(NUM_BLOCKS, generator=gen)[:count].tolist()
        segs.append(CopySegment(slot, first, tuple(ids)))
    return tuple(segs)


@pytest.mark.parametrize("kv_split", [False, True])
def test_random_jobs_match_the_generic_path(kv_split: bool, threads: int, closing: list) -> None:
    """Many jobs in flight, random partial segments: same slots as sequential per-run copies."""
    kvs = make_kvs(torch.bfloat16, kv_split, seed=11)
    copier = new_copier(kvs, 60, threads)
    closing.append(copier)
    reference = copier.slab.clone()
    gen = torch.Generator().manual_seed(5)
    slots = torch.randperm(60, generator=gen).tolist()
    jobs = [CopyJob(i, "store", random_segments(gen, slots[3 * i : 3 * i + 3])) for i in range(20)]
    for job in jobs:
        copier.submit(job)
        copy_segments(copier.layout, reference, BPC, job)
    done = copier.wait_all()
    assert [d.job_id for d in done] == list(range(20)) and all(d.ok for d in done)
    assert torch.equal(copier.slab, reference)


def test_whole_chunk_loads_are_cut_to_release_the_gil() -> None:
    """numpy's scatter keeps the GIL for few items: loads of a chunk use more, smaller items."""
    layout = KVBlockLayout.from_kv_caches(carved_layers(32768, 4096), NUM_BLOCKS)
    slab = torch.zeros(1, layout.slot_bytes(BPC), dtype=torch.uint8)
    copier = HostSegmentCopier.build(layout, slab, BPC)
    assert copier is not None
    (group,) = copier.groups
    assert group.load_split > 1
    assert group.count * BPC * group.page_items * group.load_split > GIL_FREE_ITEMS
    assert copier.item_bytes // group.load_split >= MIN_LOAD_ITEM_BYTES


def test_small_chunks_are_not_cut_below_the_minimum_load_item() -> None:
    layout = KVBlockLayout.from_kv_caches(carved_layers(512, 512), NUM_BLOCKS)
    slab = torch.zeros(1, layout.slot_bytes(BPC), dtype=torch.uint8)
    copier = HostSegmentCopier.build(layout, slab, BPC)
    assert copier is not None
    assert all(group.load_split == 1 for group in copier.groups)


def test_dropped_copier_stops_its_threads() -> None:
    """A copier dropped without close() is collected and its threads end (no leaked slab)."""
    before = set(threading.enumerate())
    copier = new_copier(make_kvs(torch.float32, kv_split=False), 1, 2)
    copier.submit(CopyJob(1, "store", (CopySegment(0, 0, (0, 1, 2, 3)),)))
    assert copier.wait_all()[0].ok
    threads = [t for t in threading.enumerate() if t not in before]
    assert len(threads) == 2
    del copier
    gc.collect()
    for thread in threads:
        thread.join(5)
        assert not thread.is_alive()


EXIT_SCRIPT = """
import torch
from tiercache.transfer.device import CopyJob, CopySegment
from tiercache.transfer.host_copier import HostThreadCopier
from tiercache.layout import KVBlockLayout
kvs = {f"l{i}": torch.ones(512, 2, 16, 4, 32) for i in range(8)}
layout = KVBlockLayout.from_kv_caches(kvs, 512)
slab = torch.zeros(64, layout.slot_bytes(8), dtype=torch.uint8)
copier = HostThreadCopier(layout, slab, 8, threads=2)
for i in range(64):
    copier.submit(CopyJob(i, "store", (CopySegment(i, 0, tuple(range(8 * i, 8 * i + 8))),)))
print("exiting with copies in flight", flush=True)
"""


def test_interpreter_exit_with_copies_in_flight_is_clean() -> None:
    """Daemon copy threads must not touch freed memory while the interpreter shuts down."""
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "exiting with copies in flight" in proc.stdout
