"""Tests of the CUDA copier (tiercache/transfer/device.py, CudaStreamCopier): run only where CUDA is.

The same store/load round trip as the host copier's, between device KV
tensors and a pinned slab, plus the stream-ordering contract
(docs/architecture.md, Ownership and threads): a store reads what the compute stream wrote before it was
submitted, a store is reported only once its copy has read the blocks (the
scheduler's store pins rely on it), and a load is reported only once its copy is
done or, for a sync load, ordered before the compute stream.
``torch.cuda._sleep`` keeps a stream busy so that a missing event would show
up as a race that loses.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tiercache.transfer.cuda_batch import CopyMethod, vllm_batch_op
from tiercache.transfer.cuda_copier import CudaStreamCopier
from tiercache.transfer.cuda_driver_batch import driver_batch
from tiercache.transfer.copiers import make_copier
from tiercache.transfer.device import CopyJob, CopySegment
from tiercache.layout import KVBlockLayout, gather_slot, slab_planes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NUM_BLOCKS = 64
BPC = 4
LAYERS = 3
SLEEP_CYCLES = 200_000_000  # ~0.1 s of a busy stream on current GPUs

SEGMENTS = (
    CopySegment(0, 0, (5, 17, 2, 40)),  # scattered
    CopySegment(1, 0, (8, 9, 10, 11)),  # consecutive
    CopySegment(2, 1, (30, 31)),  # partial
    CopySegment(3, 3, (63,)),  # partial, last position
)


def make_kvs(dtype: torch.dtype, kv_split: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lead = (2, NUM_BLOCKS) if kv_split else (NUM_BLOCKS, 2)
    return {
        f"layer.{i}": torch.randn(*lead, 16, 2, 32, device="cuda", generator=gen).to(dtype)
        for i in range(LAYERS)
    }


def pages_of(kvs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each region as (num_blocks, page) bytes on the host, from the shapes alone."""
    out = []
    for t in kvs.values():
        subs = [t[0], t[1]] if t.shape[0] == 2 and t.shape[1] == NUM_BLOCKS else [t]
        out.extend(s.reshape(NUM_BLOCKS, -1).view(torch.uint8).cpu() for s in subs)
    return out


def expected_slot(kvs: dict[str, torch.Tensor], seg: CopySegment, slot_bytes: int) -> torch.Tensor:
    slot = torch.zeros(slot_bytes, dtype=torch.uint8)
    base = 0
    for pages in pages_of(kvs):
        page = pages.shape[1]
        for pos, block in enumerate(seg.block_ids):
            start = base + (seg.first_block + pos) * page
            slot[start : start + page] = pages[block]
        base += page * BPC
    return slot


@pytest.fixture
def copiers() -> Iterator[list[CudaStreamCopier]]:
    made: list[CudaStreamCopier] = []
    yield made
    for copier in made:
        copier.close()


METHODS = ["gather", "per_run", *(["vllm_batch"] if vllm_batch_op() is not None else []),
           *(["driver_batch", "auto"] if driver_batch() is not None else [])]


@pytest.fixture(params=METHODS)
def method(request: pytest.FixtureRequest) -> str:
    return request.param


def new_copier(kvs: dict[str, torch.Tensor], slots: int, made: list, method: CopyMethod = "auto") -> CudaStreamCopier:
    layout = KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)
    slab = torch.zeros(slots, layout.slot_bytes(BPC), dtype=torch.uint8, pin_memory=True)
    copier = make_copier(layout, slab, BPC, cuda_copy=method)
    assert isinstance(copier, CudaStreamCopier)
    made.append(copier)
    return copier


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_split", [False, True], ids=["kv-in-block", "kv-apart"])
def test_round_trip_through_pinned_slab(dtype: torch.dtype, kv_split: bool, copiers: list, method: str) -> None:
    kvs = make_kvs(dtype, kv_split)
    copier = new_copier(kvs, len(SEGMENTS), copiers, method)
    assert copier.method == method
    slot_bytes = copier.slab.shape[1]
    copier.submit(CopyJob(1, "store", SEGMENTS))
    (done,) = copier.wait_all()
    assert done.ok and done.bytes == sum(len(s.block_ids) for s in SEGMENTS) * slot_bytes // BPC
    for seg in SEGMENTS:
        assert torch.equal(copier.slab[seg.slot], expected_slot(kvs, seg, slot_bytes)), seg

    before = {name: t.clone() for name, t in kvs.items()}
    for t in kvs.values():
        t.zero_()
    copier.submit(CopyJob(2, "load", SEGMENTS))
    (done,) = copier.wait_all()
    assert done.ok
    loaded = sorted({b for seg in SEGMENTS for b in seg.block_ids})
    other = sorted(set(range(NUM_BLOCKS)) - set(loaded))
    for name, t in kvs.items():
        dim = 1 if kv_split else 0
        idx = torch.tensor(loaded, device="cuda")
        rest = torch.tensor(other, device="cuda")
        assert torch.equal(
            t.index_select(dim, idx).view(torch.uint8),
            before[name].index_select(dim, idx).view(torch.uint8),
        )
        assert int(t.index_select(dim, rest).view(torch.uint8).count_nonzero()) == 0


@pytest.mark.parametrize("kv_split", [False, True], ids=["kv-in-block", "kv-apart"])
def test_round_trip_through_a_pinned_slab_in_planes(kv_split: bool, copiers: list, method: str) -> None:
    """Layout planes (a via_host producer's): the slab gathered per slot holds what layout slots holds."""
    kvs = make_kvs(torch.float32, kv_split)
    layout = KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)
    slab = torch.zeros(len(SEGMENTS), layout.slot_bytes(BPC), dtype=torch.uint8, pin_memory=True)
    planes = slab_planes(slab, layout.page_bytes, BPC)
    copier = make_copier(layout, slab, BPC, planes=planes, cuda_copy=method)
    assert isinstance(copier, CudaStreamCopier)
    copiers.append(copier)
    copier.submit(CopyJob(1, "store", SEGMENTS))
    assert copier.wait_all()[0].ok
    chunk = np.empty(slab.shape[1], dtype=np.uint8)
    for seg in SEGMENTS:
        gather_slot(planes, seg.slot, BPC, chunk)
        assert np.array_equal(chunk, expected_slot(kvs, seg, slab.shape[1]).numpy()), seg  # both zero elsewhere
    before = {name: t.clone() for name, t in kvs.items()}
    for t in kvs.values():
        t.zero_()
    copier.submit(CopyJob(2, "load", SEGMENTS))
    assert copier.wait_all()[0].ok
    loaded = torch.tensor(sorted({b for seg in SEGMENTS for b in seg.block_ids}), device="cuda")
    for name, t in kvs.items():
        dim = 1 if kv_split else 0
        assert torch.equal(t.index_select(dim, loaded).view(torch.uint8),
                           before[name].index_select(dim, loaded).view(torch.uint8))


def test_bad_segment_is_a_failed_job(copiers: list, method: str) -> None:
    copier = new_copier(make_kvs(torch.float32, False), 1, copiers, method)
    copier.submit(CopyJob(1, "load", (CopySegment(5, 0, (1,)),)))
    copier.submit(CopyJob(2, "store", (CopySegment(0, 0, (1, 2)),)))
    done = {d.job_id: d for d in copier.wait_all()}
    assert not done[1].ok and done[1].bytes == 0 and "out of range" in done[1].error
    assert done[2].ok


def test_store_sees_what_the_compute_stream_wrote_before_submit(copiers: list, method: str) -> None:
    kvs = make_kvs(torch.float32, False)
    copier = new_copier(kvs, 1, copiers, method)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the compute stream is busy...
    for t in kvs.values():
        t[:BPC].fill_(3.0)  # ...then writes the blocks
    copier.submit(CopyJob(1, "store", (CopySegment(0, 0, tuple(range(BPC))),)))
    assert copier.wait_all()[0].ok
    assert bool((copier.slab[0].view(torch.float32) == 3.0).all())


def test_store_reported_only_after_its_copy_read_the_blocks(copiers: list, method: str) -> None:
    """The CUDA half of the store pins (connector/store_pins.py): the scheduler lets vLLM reuse a
    store's blocks once the store is reported, so a report must mean the device finished reading.
    Negative control: blocks overwritten before the report (an unpinned reuse, as vLLM 0.32's V2
    runner zeroes new blocks before any connector hook) corrupt the stored chunk."""
    for reuse_before_report in (False, True):
        kvs = make_kvs(torch.float32, False)
        for t in kvs.values():
            t.fill_(1.0)
        copier = new_copier(kvs, 1, copiers, method)
        torch.cuda.synchronize()
        with torch.cuda.stream(copier._store_stream):
            torch.cuda._sleep(SLEEP_CYCLES)  # the store's copy starts late
        copier.submit(CopyJob(1, "store", (CopySegment(0, 0, tuple(range(BPC))),)))
        if not reuse_before_report:
            assert copier.poll() == []  # not reported while its copy has not run
            done = []
            while not done:
                done = copier.poll()
            assert done[0].ok
        for t in kvs.values():
            t[:BPC].zero_()  # the runner zeroes the reallocated blocks on the compute stream
        copier.wait_all()
        stored = copier.slab[0].view(torch.float32)
        if reuse_before_report:
            assert not bool((stored == 1.0).all())  # the race is real
        else:
            assert bool((stored == 1.0).all())


def test_load_reported_only_after_its_copy(copiers: list) -> None:
    kvs = make_kvs(torch.float32, False)
    copier = new_copier(kvs, 1, copiers)
    copier.slab[0].view(torch.float32).fill_(5.0)
    for t in kvs.values():
        t.zero_()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the load waits for the compute stream
    copier.submit(CopyJob(1, "load", (CopySegment(0, 0, tuple(range(BPC))),)))
    assert copier.poll() == []  # not done while the compute stream still sleeps
    done = []
    while not done:
        done = copier.poll()
    assert done[0].ok
    # Reported done: attention on the compute stream now reads the loaded values.
    for t in kvs.values():
        assert bool((t[:BPC] == 5.0).all())
        assert int(t[BPC:].count_nonzero()) == 0


def test_load_is_ordered_before_compute_without_a_host_wait(copiers: list, method: str) -> None:
    """order_before_compute: the compute stream's next kernel sees the loaded blocks, the host
    never waited. Negative control: without it the same read, issued at once, sees zeros."""
    for ordered in (True, False):
        kvs = make_kvs(torch.float32, False)
        copier = new_copier(kvs, 1, copiers, method)
        copier.slab[0].view(torch.float32).fill_(5.0)
        for t in kvs.values():
            t.zero_()
        torch.cuda.synchronize()
        with torch.cuda.stream(copier._load_stream):
            torch.cuda._sleep(SLEEP_CYCLES)  # the load stream is busy: the copy starts late
        copier.submit(CopyJob(1, "load", (CopySegment(0, 0, tuple(range(BPC))),)))
        if ordered:
            copier.order_before_compute([1])
            assert copier.poll() == []  # the host did not wait for the copy
        seen = torch.stack([t[:BPC].float().mean() for t in kvs.values()])  # on the compute stream
        torch.cuda.synchronize()
        if ordered:
            assert bool((seen == 5.0).all()), seen
        else:
            assert bool((seen == 0.0).all()), seen  # the race is real
        copier.wait_all()


def test_transfer_time_is_device_time(copiers: list, method: str) -> None:
    """A job's seconds are CUDA-event time: a copy queued behind a busy stream is not charged the wait."""
    kvs = make_kvs(torch.float32, False)
    copier = new_copier(kvs, 1, copiers, method)
    torch.cuda.synchronize()
    with torch.cuda.stream(copier._store_stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    copier.submit(CopyJob(1, "store", (CopySegment(0, 0, tuple(range(BPC))),)))
    started = time.perf_counter()
    (done,) = copier.wait_all()
    waited = time.perf_counter() - started
    assert done.ok and 0 < done.secs < waited / 2, (done.secs, waited)


@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
@pytest.mark.parametrize("batched", [m for m in METHODS if m != "per_run"])
def test_random_jobs_match_the_per_run_path(hnd: bool, batched: str, copiers: list) -> None:
    """The batched plan on one shared device buffer (vLLM 0.32's allocation) against the per-run copies."""
    import random

    gen = torch.Generator(device="cuda").manual_seed(7)
    per_layer = 2 * NUM_BLOCKS * 4 * 16 * 32
    raw = torch.randn(LAYERS * per_layer, device="cuda", generator=gen).to(torch.bfloat16)
    kvs = {}
    for i in range(LAYERS):
        part = raw[i * per_layer:(i + 1) * per_layer]
        kvs[f"l{i}"] = (part.view(2, NUM_BLOCKS, 4, 16, 32).permute(0, 1, 3, 2, 4) if hnd
                        else part.view(2, NUM_BLOCKS, 16, 4, 32))
    copier = new_copier(kvs, 8, copiers, batched)
    reference = new_copier(kvs, 8, copiers, "per_run")
    rng = random.Random(3)
    for trial in range(20):
        ids = rng.sample(range(NUM_BLOCKS), 8 * BPC)
        segs = tuple(CopySegment(s, 0, tuple(ids[s * BPC:(s + 1) * BPC])) for s in rng.sample(range(8), 5))
        copier.submit(CopyJob(trial, "store", segs))
        reference.submit(CopyJob(trial, "store", segs))
        assert copier.wait_all()[0].ok and reference.wait_all()[0].ok
        assert torch.equal(copier.slab, reference.slab)
        # and back: loads into other blocks leave what the per-run loads leave
        targets = rng.sample(range(NUM_BLOCKS), len(segs) * BPC)
        back = tuple(CopySegment(seg.slot, 0, tuple(targets[i * BPC:(i + 1) * BPC])) for i, seg in enumerate(segs))
        saved = raw.clone()
        copier.submit(CopyJob(100 + trial, "load", back))
        assert copier.wait_all()[0].ok
        ours = raw.clone()
        raw.copy_(saved)
        reference.submit(CopyJob(100 + trial, "load", back))
        assert reference.wait_all()[0].ok
        assert torch.equal(ours.view(torch.int16), raw.view(torch.int16))


def test_pinned_ring_never_overwrites_a_queued_upload() -> None:
    """The gather executor's index uploads (tiercache/transfer/pinned_ring.py): a wrap onto an
    upload the stream has not reached yet waits for it, so every upload lands intact."""
    from tiercache.transfer.pinned_ring import PinnedRing

    ring = PinnedRing(1000, torch.device("cuda"))
    stream = torch.cuda.Stream()
    outs, wanted = [], []
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # every upload below is queued behind this
        for i in range(5):
            values = np.arange(600, dtype=np.int64) + 1000 * i
            outs.append(ring.upload(values))  # 600 + 600 > 1000: each one wraps onto the last
            wanted.append(values)
    torch.cuda.synchronize()
    for got, values in zip(outs, wanted):
        assert np.array_equal(got.cpu().numpy(), values)
    big = np.arange(5000, dtype=np.int64)  # larger than the ring: a one-off pinned copy
    assert np.array_equal(ring.upload(big).cpu().numpy(), big)
