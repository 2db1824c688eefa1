"""The compiled copy-plan executor (tiercache/transfer/host_kernel.py) and how the CPU copier uses it.

The executor runs copy plans (tiercache/transfer/copy_plan.py); every case compares
the bytes it leaves with a naive reference written here (one slice assignment
per page, from the engine tensors' shapes, not from the plan): scattered ids,
consecutive runs, ids out of order, a single page, partial chunks, several
segments, and the largest job (every block of the engine into every slot), for
stores and loads, with pages of 2 KiB (the small-model case of issue 22) and
of odd sizes. Negative controls: a plan with two runs swapped is caught, and
``TIERCACHE_HOST_KERNEL=0`` turns the executor off. ``copy_segments`` (each
segment's plan made in C) against the same reference, its index checks and a
malformed geometry, ``copy_segments`` (many segments in one call) likewise. The
copier: a thread copies the parts queued behind it as one batch, every part of a
slab of slots in C (one call per batch); without that (planes), parts of
``KERNEL_MIN_BYTES`` and more by the executor, smaller ones by the numpy
gathers, one by one; a bad part fails alone, also inside a batch.
Where ``TIERCACHE_REQUIRE_NATIVE=1`` (CI: scripts/test.sh) the executor must
have been built: a missing compiler fails the run instead of skipping these.
"""

from __future__ import annotations

import os
import random
import threading

import numpy as np
import pytest
import torch

from tiercache.layout import KVBlockLayout
from tiercache.transfer import host_copier, host_kernel
from tiercache.transfer.copy_plan import CopyPlan, PlanGeometry, plan_copy
from tiercache.transfer.device import CopyJob, CopySegment
from tiercache.transfer.host_copier import HostThreadCopier

run = host_kernel.run_kernel(force=True)  # on by default where built; TIERCACHE_HOST_KERNEL=0 turns it off
# both functions: streaming stores (the default on x86-64) and cached stores (TIERCACHE_HOST_STREAM_STORES=0)
EXECUTORS = {"stream": host_kernel.run_kernel(force=True, stream=True),
             "cached": host_kernel.run_kernel(force=True, stream=False)}
needs_kernel = pytest.mark.skipif(run is None, reason="the copy executor was not built here (no C compiler)")

NUM_BLOCKS = 40
BPC = 4
SLOTS = NUM_BLOCKS // BPC


def make_layout(page_bytes: int, layers: int = 3, seed: int = 0) -> tuple[KVBlockLayout, list[torch.Tensor]]:
    """``layers`` separately allocated (NUM_BLOCKS, 2, page/2) byte tensors of random bytes."""
    gen = torch.Generator().manual_seed(seed)
    kvs = {f"l{i}": torch.randint(0, 256, (NUM_BLOCKS, 2, page_bytes // 2), dtype=torch.uint8, generator=gen)
           for i in range(layers)}
    layout = KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)
    return layout, [t.reshape(NUM_BLOCKS, -1) for t in kvs.values()]


def naive(pages: list[torch.Tensor], slab: torch.Tensor, job: CopyJob) -> None:
    """The reference: one copy per (segment, layer, block), slot layout ``slots``."""
    for seg in job.segments:
        base = 0
        for region in pages:
            page = region.shape[1]
            for pos, block in enumerate(seg.block_ids):
                start = base + (seg.first_block + pos) * page
                if job.direction == "store":
                    slab[seg.slot, start:start + page] = region[block]
                else:
                    region[block] = slab[seg.slot, start:start + page]
            base += page * BPC


def jobs_of(kind: str, rng: random.Random) -> list[tuple[CopySegment, ...]]:
    ids = list(range(NUM_BLOCKS))
    rng.shuffle(ids)
    if kind == "scattered":
        return [(CopySegment(3, 0, tuple(ids[:BPC])),)]
    if kind == "consecutive":
        return [(CopySegment(5, 0, (12, 13, 14, 15)),), (CopySegment(6, 0, (16, 17, 18, 19)),)]
    if kind == "out-of-order":
        return [(CopySegment(1, 0, (9, 8, 7, 6)),), (CopySegment(2, 0, (30, 2, 31, 3)),)]
    if kind == "single-page":
        return [(CopySegment(7, 2, (33,)),)]
    if kind == "partial":
        return [(CopySegment(0, 1, (4, 5)), CopySegment(9, 3, (39,)), CopySegment(4, 0, (22, 11, 23)))]
    if kind == "largest":  # every block, every slot, slots out of order: one job
        slots = list(range(SLOTS))
        rng.shuffle(slots)
        return [tuple(CopySegment(s, 0, tuple(ids[i * BPC:(i + 1) * BPC])) for i, s in enumerate(slots))]
    raise AssertionError(kind)


KINDS = ["scattered", "consecutive", "out-of-order", "single-page", "partial", "largest"]


@needs_kernel
@pytest.mark.parametrize("executor", sorted(EXECUTORS))
@pytest.mark.parametrize("page", [2048, 192, 96], ids=["2KiB-pages", "192B-pages", "96B-pages"])
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_plans_leave_the_reference_bytes(kind: str, page: int, executor: str) -> None:
    """2 KiB and 192 B pages are streamed (whole 64-byte lines, aligned), 96 B ones copied with memcpy."""
    run = EXECUTORS[executor]
    assert run is not None
    layout, pages = make_layout(page)
    slab = torch.randint(0, 256, (SLOTS, layout.slot_bytes(BPC)), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(1))
    geometry = PlanGeometry.of(layout, slab, BPC)
    rng = random.Random(kind)
    for segments in jobs_of(kind, rng):
        store, ref_slab = CopyJob(1, "store", segments), slab.clone()
        assert run(plan_copy(geometry, True, segments)) == sum(len(s.block_ids) for s in segments) * 3 * page
        naive(pages, ref_slab, store)
        assert torch.equal(slab, ref_slab)
        # load: fresh slot bytes back into the engine
        for seg in segments:
            slab[seg.slot] = torch.randint(0, 256, (slab.shape[1],), dtype=torch.uint8)
        ref_pages = [p.clone() for p in pages]
        run(plan_copy(geometry, False, segments))
        naive(ref_pages, slab, CopyJob(2, "load", segments))
        assert all(torch.equal(a, b) for a, b in zip(pages, ref_pages))


@needs_kernel
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "cached"])
@pytest.mark.parametrize("page", [2048, 192, 96], ids=["2KiB-pages", "192B-pages", "96B-pages"])
@pytest.mark.parametrize("kind", KINDS)
def test_segments_planned_in_c_leave_the_reference_bytes(kind: str, page: int, stream: bool) -> None:
    """copy_segments (host_kernel.segment_runner) makes each segment's plan itself: same reference."""
    layout, pages = make_layout(page)
    slab = torch.randint(0, 256, (SLOTS, layout.slot_bytes(BPC)), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(1))
    runner = host_kernel.segment_runner(PlanGeometry.of(layout, slab, BPC), NUM_BLOCKS, SLOTS, force=True,
                                        stream=stream)
    assert runner is not None
    for segments in jobs_of(kind, random.Random(kind)):
        ref_slab = slab.clone()
        assert runner(segments, True) == sum(len(s.block_ids) for s in segments) * 3 * page  # one call
        naive(pages, ref_slab, CopyJob(1, "store", segments))
        assert torch.equal(slab, ref_slab)
        for seg in segments:
            slab[seg.slot] = torch.randint(0, 256, (slab.shape[1],), dtype=torch.uint8)
        ref_pages = [p.clone() for p in pages]
        for seg in segments:  # one segment a call
            runner([seg], False)
        naive(ref_pages, slab, CopyJob(2, "load", segments))
        assert all(torch.equal(a, b) for a, b in zip(pages, ref_pages))


@needs_kernel
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "cached"])
def test_segments_planned_in_c_with_regions_of_other_pages(stream: bool) -> None:
    """A hybrid model's layout: regions of different page sizes and block strides (a state layer's large
    page beside attention pages), every job shape, against the same reference."""
    gen = torch.Generator().manual_seed(3)
    kvs = {name: torch.randint(0, 256, (NUM_BLOCKS, 2, half), dtype=torch.uint8, generator=gen)
           for name, half in (("attn0", 1024), ("state", 3072), ("attn1", 48))}
    layout = KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)
    pages = [t.reshape(NUM_BLOCKS, -1) for t in kvs.values()]
    slab = torch.zeros(SLOTS, layout.slot_bytes(BPC), dtype=torch.uint8)
    runner = host_kernel.segment_runner(PlanGeometry.of(layout, slab, BPC), NUM_BLOCKS, SLOTS, force=True,
                                        stream=stream)
    assert runner is not None
    for kind in KINDS:
        for segments in jobs_of(kind, random.Random(kind)):
            ref_slab = slab.clone()
            for seg in segments:
                runner([seg], True)
            naive(pages, ref_slab, CopyJob(1, "store", segments))
            assert torch.equal(slab, ref_slab), kind
            for seg in segments:  # fresh slot bytes back into the engine
                slab[seg.slot] = torch.randint(0, 256, (slab.shape[1],), dtype=torch.uint8, generator=gen)
            ref_pages = [p.clone() for p in pages]
            runner(segments, False)
            naive(ref_pages, slab, CopyJob(2, "load", segments))
            assert all(torch.equal(a, b) for a, b in zip(pages, ref_pages)), kind


@needs_kernel
def test_copy_segment_refuses_bad_indices_and_geometry_before_copying() -> None:
    """Every index is checked in C (the messages of check_segment), nothing is written, also where the
    bad segment follows good ones in one call; a geometry of the wrong length and malformed segments are
    refused; a planes slab gets no runner (its plan stays in numpy)."""
    from tiercache.transfer._copy_runs import copy_segments

    layout, _ = make_layout(2048)
    slab = torch.zeros(SLOTS, layout.slot_bytes(BPC), dtype=torch.uint8)
    geometry = PlanGeometry.of(layout, slab, BPC)
    runner = host_kernel.segment_runner(geometry, NUM_BLOCKS, SLOTS, force=True)
    assert runner is not None
    good = [CopySegment(1, 0, (3, 4)), CopySegment(2, 1, (9,))]
    for seg, message in ((CopySegment(SLOTS, 0, (1,)), "slot"), (CopySegment(-1, 0, (1,)), "slot"),
                         (CopySegment(0, 0, (NUM_BLOCKS,)), "block id"), (CopySegment(0, 0, (2, -1)), "block id"),
                         (CopySegment(0, BPC - 1, (1, 2)), "overflow"),
                         (CopySegment(0, 2**63 - 1, (1,)), "overflow")):  # no int64 overflow in the check
        for store in (False, True):  # a load: engine bytes would be overwritten
            with pytest.raises(IndexError, match=message):
                runner([seg], store)
            with pytest.raises(IndexError, match=message):
                runner([*good, seg], store)  # the good ones before it are not copied either
        assert not slab.any()
    with pytest.raises(ValueError, match="malformed geometry"):
        copy_segments(b"\x01" * 40, True, False, [(0, 0, (1,))])
    with pytest.raises(TypeError):
        copy_segments(b"", True, False)  # type: ignore[call-arg]
    packed = host_kernel.segment_geometry(geometry, NUM_BLOCKS, SLOTS)
    for malformed in ([(0, 0)], [[0, 0, (1,)]], [(0, 0, 5)], [(0, "0", (1,))], 7):
        with pytest.raises(TypeError):
            copy_segments(packed, True, False, malformed)
    assert not slab.any()
    assert runner([], True) == 0
    planes = PlanGeometry.of(layout, slab, BPC, [slab.view(-1)[: 8]] * 3)
    assert host_kernel.segment_runner(planes, NUM_BLOCKS, SLOTS, force=True) is None


@needs_kernel
def test_a_build_older_than_copy_segments_keeps_the_numpy_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    """An editable install compiled before copy_segments existed: no runner (a warning), and the copier
    still copies (numpy gathers / plans), where it used to fail to import."""
    from tiercache.transfer import _copy_runs

    monkeypatch.delattr(_copy_runs, "copy_segments")
    layout, pages = make_layout(2048)
    slab = torch.zeros(SLOTS, layout.slot_bytes(BPC), dtype=torch.uint8)
    assert host_kernel.segment_runner(PlanGeometry.of(layout, slab, BPC), NUM_BLOCKS, SLOTS, force=True) is None
    copier = HostThreadCopier(layout, slab, BPC, threads=1)
    try:
        job = CopyJob(1, "store", (CopySegment(2, 0, (20, 3, 11, 7)),))
        copier.submit(job)
        assert all(d.ok for d in copier.wait_all())
        reference = torch.zeros_like(slab)
        naive(pages, reference, job)
        assert torch.equal(slab, reference)
    finally:
        copier.close()


@needs_kernel
def test_one_segment_plan_equals_the_general_plan() -> None:
    """The one-segment fast path (copy_plan._plan_segment) plans exactly what the general path plans."""
    layout, _ = make_layout(2048)
    slab = torch.zeros(SLOTS, layout.slot_bytes(BPC), dtype=torch.uint8)
    geometry = PlanGeometry.of(layout, slab, BPC)
    for kind in KINDS[:-1]:
        for segments in jobs_of(kind, random.Random(kind)):
            for seg in segments:
                fast = plan_copy(geometry, True, (seg,))
                general = plan_copy(geometry, True, (seg, CopySegment(seg.slot, 0, ())))  # two segments
                for a, b in ((fast.engine_ptrs, general.engine_ptrs), (fast.host_ptrs, general.host_ptrs),
                             (fast.sizes, general.sizes)):
                    assert np.array_equal(a, b)


@needs_kernel
def test_a_plan_with_two_runs_swapped_is_caught() -> None:
    """Negative control: the comparison above notices host pages in the wrong place."""
    assert run is not None
    layout, pages = make_layout(2048)
    slab = torch.zeros(SLOTS, layout.slot_bytes(BPC), dtype=torch.uint8)
    segments = jobs_of("scattered", random.Random(0))[0]
    plan = plan_copy(PlanGeometry.of(layout, slab, BPC), True, segments)
    host = plan.host_ptrs.copy()
    host[[0, 1]] = host[[1, 0]]
    run(CopyPlan(True, plan.engine_ptrs, host, plan.sizes))
    reference = torch.zeros_like(slab)
    naive(pages, reference, CopyJob(1, "store", segments))
    assert not torch.equal(slab, reference)


def test_ci_built_the_executor() -> None:
    """CI sets TIERCACHE_REQUIRE_NATIVE=1: there a skipped executor would hide a broken build."""
    if os.environ.get("TIERCACHE_REQUIRE_NATIVE") != "1":
        pytest.skip("TIERCACHE_REQUIRE_NATIVE is not set (only CI requires the compiled executor)")
    assert host_kernel.built() and run is not None


@pytest.mark.parametrize(("setting", "vendor", "expected"), [
    (None, "AuthenticAMD", True), (None, "GenuineIntel", False), ("auto", "", False),
    ("0", "AuthenticAMD", False), ("1", "GenuineIntel", True)])
def test_streaming_stores_by_default_on_amd_only_and_either_can_be_forced(
        monkeypatch: pytest.MonkeyPatch, setting: str | None, vendor: str, expected: bool) -> None:
    monkeypatch.setattr(host_kernel, "_cpu_vendor", lambda: vendor)
    if setting is None:
        monkeypatch.delenv(host_kernel.STREAM_SWITCH, raising=False)
    else:
        monkeypatch.setenv(host_kernel.STREAM_SWITCH, setting)
    assert host_kernel.streaming() is expected


def test_a_build_without_streaming_stores_is_described_as_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A module built before copy_runs_stream runs cached stores where streaming ones were asked for: the
    copier's log line and the benchmark's header say so (before, they said "streaming")."""
    if run is None:
        pytest.skip("the executor is not built here")
    assert host_kernel.stores_used(stream=True) == "streaming" and host_kernel.stores_used(stream=False) == "cached"
    monkeypatch.setattr(host_kernel, "_stream_address", lambda: None)
    assert host_kernel.stores_used(stream=True) == "cached"


def test_the_executor_is_on_by_default_and_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(host_kernel.ENV_SWITCH, raising=False)
    assert (host_kernel.run_kernel() is None) == (run is None)  # the default: on where built
    monkeypatch.setenv(host_kernel.ENV_SWITCH, "0")
    assert host_kernel.run_kernel() is None
    monkeypatch.setenv(host_kernel.ENV_SWITCH, "1")
    assert (host_kernel.run_kernel() is None) == (run is None)


# ---------------------------------------------------------------------------- the copier
def gated_copier(monkeypatch: pytest.MonkeyPatch, kernel: bool) -> tuple[HostThreadCopier, list[CopyJob],
                                                                            threading.Event, list[torch.Tensor]]:
    """A one-thread copier whose first copy waits for the returned event; its copies are recorded
    (``kernel``: every part, whatever its size, goes to the executor)."""
    monkeypatch.setattr(host_copier, "run_kernel", lambda: host_kernel.run_kernel(force=kernel) if kernel else None)
    if kernel:
        monkeypatch.setattr(host_copier, "KERNEL_MIN_BYTES", 0)
    layout, pages = make_layout(2048)
    slab = torch.zeros(SLOTS, layout.slot_bytes(BPC), dtype=torch.uint8)
    copier = HostThreadCopier(layout, slab, BPC, threads=1)
    calls: list[CopyJob] = []
    release = threading.Event()
    copy = copier._copy

    def recorded(job: CopyJob) -> int:
        calls.append(job)
        if len(calls) == 1:
            assert release.wait(10)
        return copy(job)

    monkeypatch.setattr(copier, "_copy", recorded)
    return copier, calls, release, pages


def submit_behind_the_first(copier: HostThreadCopier, calls: list[CopyJob], jobs: list[CopyJob]) -> None:
    """Submit ``jobs[0]``, wait until the thread holds it at the gate, then queue the others."""
    copier.submit(jobs[0])
    for _ in range(1000):
        if calls:
            break
        threading.Event().wait(0.01)
    assert len(calls) == 1
    for job in jobs[1:]:
        copier.submit(job)


@pytest.mark.parametrize("kernel", [True, False], ids=["executor", "numpy"])
def test_parts_queued_behind_a_busy_thread_are_copied_as_one_batch(
    kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parts queued behind a busy thread are its next batch: where segments are copied in C, one call
    for all of them (their segments in submission order); with the numpy gathers, one by one in order.
    Either way every job reports its own bytes, in submission order."""
    if kernel and run is None:
        pytest.skip("the copy executor was not built here")
    copier, calls, release, pages = gated_copier(monkeypatch, kernel)
    batches: list[list[int]] = []
    if kernel:
        inner = copier._run_segments
        assert inner is not None
        copier._run_segments = lambda segs, store: batches.append([s.slot for s in segs]) or inner(segs, store)
    try:
        rng = random.Random(3)
        ids = list(range(NUM_BLOCKS))
        rng.shuffle(ids)
        jobs = [CopyJob(10 + s, "store", (CopySegment(s, 0, tuple(ids[s * BPC:(s + 1) * BPC])),))
                for s in range(SLOTS)]
        submit_behind_the_first(copier, calls, jobs)
        release.set()
        done = copier.wait_all()
        assert [d.job_id for d in done] == [j.job_id for j in jobs]
        assert all(d.ok and d.bytes == BPC * 3 * 2048 for d in done)
        if kernel:  # the first alone (it was the queue's only part), the nine behind it in one call
            assert [c.job_id for c in calls] == [10]
            assert batches == [[0], list(range(1, SLOTS))]
        else:
            assert [c.job_id for c in calls] == [j.job_id for j in jobs]  # each alone, in order
        reference = torch.zeros_like(copier.slab)
        for job in jobs:
            naive(pages, reference, job)
        assert torch.equal(copier.slab, reference)
    finally:
        copier.close()


def test_every_part_of_a_slab_of_slots_is_copied_segment_by_segment_in_c(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the executor is built, small and large parts alike go to copy_segments (counted), not to the
    numpy gathers or a numpy plan; the bytes are the reference's."""
    if run is None:
        pytest.skip("the copy executor was not built here")
    used: list[tuple[int, bool]] = []

    def counting(*args: object, **kwargs: object) -> object:
        inner = host_kernel.segment_runner(*args, force=True, **kwargs)  # type: ignore[arg-type]
        assert inner is not None
        return lambda segs, store: used.extend((seg.slot, store) for seg in segs) or inner(segs, store)

    monkeypatch.setattr(host_copier, "segment_runner", counting)
    layout, pages = make_layout(2048)
    slab = torch.zeros(SLOTS, layout.slot_bytes(BPC), dtype=torch.uint8)
    copier = HostThreadCopier(layout, slab, BPC, threads=1)
    try:
        assert "each segment planned and copied" in copier._describe()
        jobs = [CopyJob(1, "store", (CopySegment(0, 0, (7,)),)),
                CopyJob(2, "store", (CopySegment(1, 0, (20, 3, 11)), CopySegment(2, 1, (5,))))]
        for job in jobs:
            copier.submit(job)
        assert all(d.ok for d in copier.wait_all())
        assert used == [(0, True), (1, True), (2, True)]
        reference = torch.zeros_like(slab)
        for job in jobs:
            naive(pages, reference, job)
        assert torch.equal(slab, reference)
    finally:
        copier.close()


def test_parts_go_to_the_executor_from_kernel_min_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without copy_segments (a planes slab, or as here turned off): below KERNEL_MIN_BYTES a part takes the
    numpy gathers, from it the executor (counted)."""
    if run is None:
        pytest.skip("the copy executor was not built here")
    monkeypatch.setattr(host_copier, "segment_runner", lambda *a, **k: None)
    used: list[int] = []

    def counting() -> object:
        inner = host_kernel.run_kernel(force=True)
        assert inner is not None
        return lambda plan: used.append(plan.nbytes) or inner(plan)

    monkeypatch.setattr(host_copier, "run_kernel", counting)
    monkeypatch.setattr(host_copier, "KERNEL_MIN_BYTES", 2 * 3 * 2048)  # two blocks of 3 layers
    layout, pages = make_layout(2048)
    slab = torch.zeros(SLOTS, layout.slot_bytes(BPC), dtype=torch.uint8)
    copier = HostThreadCopier(layout, slab, BPC, threads=1)
    try:
        small = CopyJob(1, "store", (CopySegment(0, 0, (7,)),))
        large = CopyJob(2, "store", (CopySegment(1, 0, (20, 3, 11)),))
        copier.submit(small)
        copier.submit(large)
        assert all(d.ok for d in copier.wait_all())
        assert used == [3 * 3 * 2048]  # the large part only
        reference = torch.zeros_like(slab)
        naive(pages, reference, small)
        naive(pages, reference, large)
        assert torch.equal(slab, reference)
    finally:
        copier.close()


@needs_kernel
def test_a_bad_part_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    copier, calls, release, pages = gated_copier(monkeypatch, True)
    try:
        good = [CopyJob(i, "store", (CopySegment(i, 0, (i, i + 10, i + 20, i + 30)),)) for i in range(4)]
        bad = CopyJob(99, "store", (CopySegment(0, 0, (NUM_BLOCKS,)),))  # block out of range
        load = CopyJob(50, "load", (CopySegment(9, 0, (5, 6)),))  # blocks no store reads
        submit_behind_the_first(copier, calls, [good[0], good[1], bad, good[2], load, good[3]])
        release.set()
        done = {d.job_id: d for d in copier.wait_all()}
        assert not done[99].ok and "out of range" in done[99].error and done[99].bytes == 0
        assert all(done[j.job_id].ok and done[j.job_id].bytes == BPC * 3 * 2048 for j in good)
        assert done[50].ok and done[50].bytes == 2 * 3 * 2048
        # the stores queued behind the first were one batch, refused whole (nothing copied), then copied
        # one by one; the load and the store after it were batches of one part each
        assert [c.job_id for c in calls] == [0, 1, 99, 2, 50, 3]
        reference = torch.zeros_like(copier.slab)
        for job in good:
            naive(pages, reference, job)
        assert torch.equal(copier.slab, reference)
    finally:
        copier.close()


def test_a_batch_call_shares_its_time_out_by_bytes() -> None:
    """The parts of one batched call report their own bytes and consecutive shares of its time, so a job's
    reported throughput is the call's rather than a fraction of it."""
    parts = [(1, CopyJob(1, "store", (CopySegment(0, 0, (1,)),))),
             (2, CopyJob(2, "store", (CopySegment(1, 0, (2, 3, 4)),)))]
    done = host_copier._share_out(parts, 100, 10.0, 14.0)
    assert [(seq, moved, error) for seq, moved, error, _, _ in done] == [(1, 100, ""), (2, 300, "")]
    assert [(start, end) for *_, start, end in done] == [(10.0, 11.0), (11.0, 14.0)]
