"""Deadlines of the worker pipeline, against a backend that never reports (tiercache/testing/faulty_backends.py).

A staged load whose lower-tier read is not reported within the load deadline
fails (vLLM recomputes its chunks) and the step goes on; the bytes that arrive
later land in the host staging slot only, and the manager hears of the job (and
so may hand the slot out again) only once the backend reported. A tier that
owes jobs past their deadline fails new jobs at once. A demotion past its
deadline keeps its host copy pinned until reported; one stuck behind a delete
never reaches the backend and fails at its deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import pytest
import torch

from tiercache.jobs import DemoteJob
from tiercache.testing.job_builders import make_job
from tiercache import faults
from tiercache.transfer.device import CopySegment
from tiercache.manager.offloading import OffloadingManager, TierSpec

from tiercache.testing.faulty_backends import FaultySettings, NeverReportsBackend
from tiercache.testing.pipeline_rig import SLOTS, TIER, PipelineRig
from tiercache.testing.pipeline_rig import rig_key as key


DEADLINE = 0.3
SLACK = 0.5  # scheduling noise on a 2-core machine


class Rig(PipelineRig):
    """The pipeline rig with a NeverReportsBackend (or a subclass) as its lower tier."""

    backend: NeverReportsBackend

    def __init__(self, backend_cls: type[NeverReportsBackend] = NeverReportsBackend, stall: str = "get") -> None:
        super().__init__(lambda ctx: backend_cls(FaultySettings(stall=stall), ctx),  # type: ignore[arg-type]
                         DEADLINE, DEADLINE)


@pytest.fixture
def rig() -> Iterator[Rig]:
    faults.reset_for_tests()
    r = Rig()
    yield r
    r.close()


def test_a_read_that_is_never_reported_fails_at_the_deadline_and_lands_late_in_staging_only(rig: Rig) -> None:
    assert rig.store_and_demote(key(1), 0, (3, 4)).ok
    rig.reports()
    rig.mark([9, 10])
    empty_slot = rig.slot(2)
    job, waited, res = rig.load((key(1),), (CopySegment(2, 0, (9, 10)),), (TIER,))
    assert DEADLINE <= waited < DEADLINE + SLACK
    assert res.failed_keys == (key(1),) and res.ok_keys == ()
    assert rig.marked([9, 10])  # nothing was copied into the blocks
    assert job not in rig.reports()  # the manager must not free the staging slot yet
    assert faults.take().get(faults.LOAD_DEADLINE) == 1

    assert rig.backend.finish_stuck() == 1  # the late arrival writes its view: the staging slot
    rig.pipe.poll()
    assert torch.equal(rig.slot(2), rig.slot(0)) and not torch.equal(rig.slot(2), empty_slot)
    assert rig.marked([9, 10])  # ... and never the blocks
    (late,) = rig.reports().values()
    assert late.job_id == job and late.ok_keys == (key(1),) and late.failed_keys == ()  # the slot may be kept


def test_the_manager_keeps_a_late_staging_slot_reserved_until_the_backend_reports(rig: Rig) -> None:
    manager = OffloadingManager([TierSpec("cpu", SLOTS), TierSpec(TIER, 64, shared=True)])
    k = key(1)
    (slot,) = manager.prepare_store([k]).slots  # type: ignore[union-attr]
    assert rig.store_and_demote(k, slot, (3, 4)).ok
    manager.complete_store([k])
    (plan,) = manager.cascade.prepare_demotions()
    manager.cascade.complete_demotion(TIER, plan.keys)
    manager.reset()  # the host copy goes; the shared tier keeps it
    assert manager.lookup([k]) == 1
    load = manager.prepare_load([k])
    assert load.staged == (True,)
    staging = load.slots[0]
    job, _, res = rig.load(load.keys, (CopySegment(staging, 0, (9, 10)),), (TIER,))
    assert res.failed_keys == (k,)
    for report in rig.reports().values():  # nothing about the load: only earlier jobs
        assert report.job_id != job  # type: ignore[attr-defined]
    # vLLM recomputes; meanwhile the slot is still the backend's: never handed out again
    others = [key(i) for i in range(10, 10 + SLOTS)]
    plan = manager.prepare_store(others)
    assert plan is not None and staging not in plan.slots and len(plan.slots) == SLOTS - 1
    assert manager.lookup([k]) == 0  # a miss for everyone while staged

    rig.backend.finish_stuck()
    rig.pipe.poll()
    (late,) = [r for r in rig.reports().values() if r.job_id == job]  # type: ignore[attr-defined]
    manager.complete_load(load.keys, failed=late.failed_keys)  # type: ignore[attr-defined]
    assert manager.state_of(k)[1] == staging  # type: ignore[index]  # promoted: the late bytes are k's


def test_a_job_mixing_host_and_stuck_chunks_copies_the_host_chunks_at_the_deadline(rig: Rig) -> None:
    assert rig.store_and_demote(key(1), 0, (3, 4)).ok
    expected = rig.blocks([5, 6])
    rig.store(key(2), 1, (5, 6))
    rig.mark([9, 10, 11, 12])
    _, waited, res = rig.load((key(2), key(1)), (CopySegment(1, 0, (9, 10)), CopySegment(2, 0, (11, 12))),
                                 (None, TIER))
    assert waited < DEADLINE + SLACK
    assert res.ok_keys == (key(2),) and res.failed_keys == (key(1),)
    assert all(torch.equal(got, want) for got, want in zip(rig.blocks([9, 10]), expected))
    assert rig.marked([11, 12])


def test_a_stalled_tier_fails_new_jobs_at_once_until_its_late_jobs_are_reported(rig: Rig) -> None:
    assert rig.store_and_demote(key(1), 0, (3, 4)).ok
    rig.load((key(1),), (CopySegment(2, 0, (9, 10)),), (TIER,))
    assert rig.tier_io.stalled(TIER)
    _, waited, res = rig.load((key(1),), (CopySegment(3, 0, (11, 12)),), (TIER,))
    assert waited < 0.1 and res.failed_keys == (key(1),)
    assert len(rig.backend.stuck) == 1  # the second load never reached the backend
    assert faults.take().get(faults.TIER_STALLED) == 1
    rig.backend.finish_stuck()
    rig.pipe.poll()
    assert not rig.tier_io.stalled(TIER)
    job = rig.job()
    rig.pipe.submit(make_job(job, "r", "load", (key(1),), (CopySegment(4, 0, (13,)),), (TIER,)))
    assert len(rig.backend.stuck) == 1  # handed over again


def test_a_demotion_past_its_deadline_stays_with_its_backend_until_reported() -> None:
    faults.reset_for_tests()
    rig = Rig(stall="all")
    try:
        rig.store(key(1), 0, (3, 4))
        demote = rig.job()
        rig.pipe.submit_demote(DemoteJob(demote, TIER, (key(1),), (0,)))
        time.sleep(DEADLINE + 0.05)
        assert all(r.job_id != demote for r in rig.pipe.poll())  # no result: the host copy stays pinned
        assert faults.take().get(faults.STORE_DEADLINE) == 1 and rig.tier_io.stalled(TIER)
        rig.backend.finish_stuck()
        (res,) = [r for r in rig.pipe.poll() if r.job_id == demote]
        assert res.ok_keys == (key(1),)
    finally:
        rig.close()


class BlockingDeletes(NeverReportsBackend):
    """Deletes wait for ``release`` (a stopped server); puts are reported at once."""

    release = threading.Event()

    def delete(self, keys: Sequence[bytes]) -> None:
        self.release.wait(10)
        super().delete(keys)


def test_deletes_never_block_the_worker_and_a_demotion_stuck_behind_them_fails_at_its_deadline() -> None:
    faults.reset_for_tests()
    BlockingDeletes.release.clear()
    rig = Rig(backend_cls=BlockingDeletes)
    try:
        start = time.perf_counter()
        rig.pipe.delete({TIER: [key(5)]})
        rig.store(key(1), 0, (3, 4))
        demote = rig.job()
        rig.pipe.submit_demote(DemoteJob(demote, TIER, (key(1),), (0,)))
        assert all(r.job_id != demote for r in rig.pipe.poll())
        assert time.perf_counter() - start < 0.2  # the worker thread never waited for the delete
        res = rig.result(demote)
        assert res.failed_keys == (key(1),) and key(1) not in rig.backend.chunks  # never handed over
        assert faults.take().get(faults.STORE_DEADLINE) == 1
        BlockingDeletes.release.set()
        assert rig.tier_io.wait_deletes(5.0)
        assert not rig.tier_io.stalled(TIER)
    finally:
        BlockingDeletes.release.set()
        rig.close()


def test_a_failed_load_forgets_a_shared_tiers_chunk_but_never_deletes_it() -> None:
    manager = OffloadingManager([TierSpec("cpu", SLOTS), TierSpec("disk", 8), TierSpec("redis", 8, shared=True)])
    manager.cascade.learn("redis", [key(1)])
    manager.prepare_store([key(2)])
    manager.complete_store([key(2)])
    for plan in manager.cascade.prepare_demotions():  # written through to disk and redis
        manager.cascade.complete_demotion(plan.tier, plan.keys)
    manager.reset()  # host copies gone: key 1 only in redis, key 2 on disk (and redis)
    load = manager.prepare_load([key(1), key(2)])
    manager.complete_load(load.keys, failed=load.keys)  # e.g. a stalled tier
    manager.discard(list(load.keys))
    assert manager.lookup([key(1)]) == 0 and manager.lookup([key(2)]) == 0  # both recomputed
    assert manager.deletes.take() == {"disk": [key(2)]}  # the shared copy stays for other engines
