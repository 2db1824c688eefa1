"""A lookup whose hit stops at a chunk still being written into the host tier waits a step for it.

connector/lookup_hold.py: another request's load staging the chunk from a lower
tier, or an earlier load's late report after a stall, makes the chunk busy for a
step or two; the lookup asks vLLM to come back instead of recomputing it and
everything after it. Checked on the rule itself (a shared tier's chunk, with its
bounds) and on the real scheduler half over a real disk tier (two requests with
the same prefix in async load mode, no engine). Then the hold for staging room:
a hit whose lower-tier chunks the host tier cannot stage now (its slots being
written by this step's other loads) waits a step instead of staging part of it
and recomputing the rest. Both share one budget: ``MIN_HOLDS`` holds whatever
the clock says (a step may outlast the deadline), then ``deadlines.lookup_s``.
"""

from __future__ import annotations

import pathlib
import time

from tiercache.connector.lookup_hold import MIN_HOLDS, hold_for_busy_chunk, hold_for_staging_room
from tiercache.connector.metadata import JobReport, TierCacheWorkerMetadata
from tiercache.connector.scheduler import TierCacheScheduler
from tiercache.connector.scheduler_state import RequestState

from tests.unit.disk_scheduler import BLOCK, blocks, disk_scheduler, request, step_output
from tiercache.manager.offloading import OffloadingManager, TierSpec


def k(i: int) -> bytes:
    return bytes([i]) * 44


def fresh() -> RequestState:
    return RequestState(request=None)  # type: ignore[arg-type]


def test_a_hit_stopping_at_a_chunk_being_staged_is_held_until_it_lands() -> None:
    manager = OffloadingManager([TierSpec("host", 4), TierSpec("redis", 8, shared=True)])
    keys = [k(0), k(1)]
    manager.cascade.learn("redis", keys)
    staging = manager.prepare_load(keys[:1])  # an earlier request's load, still staging k(0)
    assert staging.staged == (True,) and manager.busy_in_host(k(0))
    assert manager.lookup(keys) == 0  # why: a lookup now stops at the busy chunk
    st = fresh()
    assert hold_for_busy_chunk(manager, st, keys, 0, own_chunks=0, limit_s=1.0, now=10.0)
    assert hold_for_busy_chunk(manager, st, keys, 0, own_chunks=0, limit_s=1.0, now=10.5)
    manager.complete_load(keys[:1])  # the report lands
    assert manager.lookup(keys) == 2
    assert not hold_for_busy_chunk(manager, st, keys, 2, own_chunks=0, limit_s=1.0, now=10.6)


def test_no_hold_inside_vllms_own_cache_past_the_deadline_or_at_a_plain_miss() -> None:
    manager = OffloadingManager([TierSpec("host", 4), TierSpec("redis", 8, shared=True)])
    keys = [k(0), k(1), k(2)]
    manager.cascade.learn("redis", keys[:2])
    manager.prepare_load(keys[1:2])  # k(1) busy
    assert manager.lookup(keys) == 1
    # vLLM's own prefix cache holds the first two chunks: it serves the busy one itself
    assert not hold_for_busy_chunk(manager, fresh(), keys, 1, own_chunks=2, limit_s=1.0)
    # bounded: held from t=10 for a second (four holds), no longer at t=11
    st = fresh()
    for now in (10.0, 10.3, 10.6, 10.9):
        assert hold_for_busy_chunk(manager, st, keys, 1, own_chunks=0, limit_s=1.0, now=now)
    assert not hold_for_busy_chunk(manager, st, keys, 1, own_chunks=0, limit_s=1.0, now=11.0)
    # steps longer than the budget: MIN_HOLDS holds all the same, then no more
    st = fresh()
    for held in range(MIN_HOLDS):
        assert hold_for_busy_chunk(manager, st, keys, 1, own_chunks=0, limit_s=1.0, now=10.0 + 2 * held)
    assert not hold_for_busy_chunk(manager, st, keys, 1, own_chunks=0, limit_s=1.0, now=10.0 + 2 * MIN_HOLDS)
    # a miss that is nobody's write is not waited for
    assert not hold_for_busy_chunk(manager, fresh(), keys, 2, own_chunks=0, limit_s=1.0)
    assert not hold_for_busy_chunk(manager, fresh(), keys, 3, own_chunks=0, limit_s=1.0)  # a full hit


def waits(sched: TierCacheScheduler, reason: str) -> float:
    """tiercache_lookup_waits_total{reason} on the scheduler's registry (what /metrics shows)."""
    return sched.metrics.sample("tiercache_lookup_waits_total", reason=reason) or 0


def step(sched: TierCacheScheduler) -> list[int]:
    return [job.job_id for job in sched.build_connector_meta(step_output()).loads]


def test_the_scheduler_holds_a_second_request_while_the_first_stages_their_prefix(tmp_path: pathlib.Path) -> None:
    """Two requests with the same 3-chunk prefix on the disk tier, async loads (vLLM caches the first
    one's blocks only once its load is done): the second waits for the staging instead of
    recomputing the prefix, then hits all of it."""
    sched = disk_scheduler(tmp_path, host_slots=8, load_mode="async")
    first, second = request("a", 3, salt=7), request("b", 3, salt=7)
    keys = sched.keys.chunk_keys(first.block_hashes)
    sched.manager.cascade.learn("ssd", keys)
    assert sched.get_num_new_matched_tokens(first, 0) == (3 * BLOCK, True)
    sched.update_state_after_alloc(first, blocks(), 3 * BLOCK)
    assert sched.manager.lookup(keys) == 0  # why: all three chunks are being staged into the host tier
    assert sched.get_num_new_matched_tokens(second, 0) == (None, False)
    assert sched.take_counters().get("lookups_held") == 1
    assert waits(sched, "chunk_being_written") == 1
    (job_id,) = step(sched)
    assert sched.get_num_new_matched_tokens(second, 0) == (None, False)  # still staging: asked again
    sched.update_connector_output(TierCacheWorkerMetadata(
        done={job_id: JobReport(reports=1, failed_keys=set(), bytes=0, secs=0.0)}))
    assert sched.get_num_new_matched_tokens(second, 0) == (3 * BLOCK, True)  # from the host tier now


def test_control_a_prefix_nobody_is_writing_is_answered_at_once(tmp_path: pathlib.Path) -> None:
    """The same second request with the prefix on disk and no load in flight: a hit at once, no hold;
    and a prefix nowhere: a miss at once."""
    sched = disk_scheduler(tmp_path, host_slots=8, load_mode="async")
    wanted = request("b", 3, salt=7)
    assert sched.get_num_new_matched_tokens(wanted, 0) == (0, False)
    sched.manager.cascade.learn("ssd", sched.keys.chunk_keys(wanted.block_hashes))
    assert sched.get_num_new_matched_tokens(wanted, 0) == (3 * BLOCK, True)
    assert "lookups_held" not in sched.take_counters()


def test_a_shared_answer_later_than_the_first_wait_defers_the_request_and_is_counted(tmp_path: pathlib.Path) -> None:
    """A shared tier that answers after ``lookup_wait_s``: vLLM is asked to come back (counted as
    ``lookups_deferred``, the figure that tells a slow store from a held chunk), then the hit
    lands; control: the same tier answering at once is not deferred."""
    from tests.unit.test_shared_lookup import SlowTier
    from tiercache.tiers.shared_lookup import SharedLookup

    for delay_s, deferred in ((0.3, True), (0.0, False)):
        sched = disk_scheduler(tmp_path / str(delay_s), host_slots=8)
        wanted = request("r", 3, salt=9)
        keys = sched.keys.chunk_keys(wanted.block_hashes)
        tier = SlowTier(delay_s)
        tier.submit_put(1, keys, [memoryview(bytearray(8))] * 3)
        sched._shared = SharedLookup({"ssd": tier}, timeout_s=5.0, first_wait_s=0.05)
        first = sched.get_num_new_matched_tokens(wanted, 0)
        assert first == ((None, False) if deferred else (3 * BLOCK, False))
        assert sched.take_counters().get("lookups_deferred", 0) == int(deferred)
        assert waits(sched, "shared_tier_pending") == int(deferred)
        if deferred:  # vLLM's next steps: the answer lands within the lookup deadline
            deadline = time.monotonic() + 5
            again = sched.get_num_new_matched_tokens(wanted, 0)
            while again == (None, False) and time.monotonic() < deadline:
                time.sleep(0.02)
                again = sched.get_num_new_matched_tokens(wanted, 0)
            assert again == (3 * BLOCK, False)
        sched._shared.close()


def test_a_hit_the_host_tier_has_no_room_to_stage_is_held_within_its_budget() -> None:
    manager = OffloadingManager([TierSpec("host", 4), TierSpec("ssd", 16)])
    mine, others = [k(i) for i in range(3)], [k(10 + i) for i in range(3)]
    manager.cascade.adopt("ssd", mine + others)
    manager.prepare_load(others)  # another request's load stages three chunks: one slot left
    st = fresh()
    assert hold_for_staging_room(manager, st, mine, None, limit_s=1.0, now=10.0)
    assert hold_for_staging_room(manager, st, mine, None, limit_s=1.0, now=10.5)
    assert hold_for_staging_room(manager, st, mine, None, limit_s=1.0, now=12.0)  # MIN_HOLDS: a long step
    assert not hold_for_staging_room(manager, st, mine, None, limit_s=1.0, now=13.0)  # budget spent
    assert not hold_for_staging_room(manager, fresh(), mine[:1], None, limit_s=1.0)  # one chunk fits
    manager.complete_load(others)  # READY in the host tier now: evictable
    assert not hold_for_staging_room(manager, fresh(), mine, None, limit_s=1.0)
    # never for a hit the whole host tier could not stage
    manager.cascade.adopt("ssd", [k(20 + i) for i in range(5)])
    manager.prepare_load(mine)
    assert not hold_for_staging_room(manager, fresh(), [k(20 + i) for i in range(5)], None, limit_s=1.0)


def test_chunks_waiting_for_their_write_through_copy_give_no_room() -> None:
    manager = OffloadingManager([TierSpec("host", 4), TierSpec("ssd", 16)])
    manager.cascade.adopt("ssd", [k(0), k(1)])
    plan = manager.prepare_store([k(5), k(6), k(7)])
    manager.complete_store(list(plan.keys))  # READY, pinned until copied down to ssd (write-through)
    assert hold_for_staging_room(manager, fresh(), [k(0), k(1)], None, limit_s=1.0)  # one free slot for two
    (demote,) = manager.cascade.prepare_demotions()
    manager.cascade.complete_demotion("ssd", demote.keys)  # copied down: unpinned, evictable
    assert not hold_for_staging_room(manager, fresh(), [k(0), k(1)], None, limit_s=1.0)
    assert not hold_for_staging_room(manager, fresh(), [k(5), k(6), k(7)], None, limit_s=1.0)  # in the host tier


def test_the_scheduler_holds_a_request_until_this_steps_staging_lands(tmp_path: pathlib.Path) -> None:
    """Two requests with different 3-chunk prefixes on disk, sync loads, a host tier of 4 chunks: the first
    stages its three in this step, so the second would stage one chunk and recompute two
    (``staging_no_slot``); it waits a step instead and then hits all three."""
    sched = disk_scheduler(tmp_path, host_slots=4)
    first, second = request("a", 3, salt=7), request("b", 3, salt=8)
    for r in (first, second):
        sched.manager.cascade.learn("ssd", sched.keys.chunk_keys(r.block_hashes))
    assert sched.get_num_new_matched_tokens(first, 0) == (3 * BLOCK, False)
    sched.update_state_after_alloc(first, blocks(), 3 * BLOCK)
    assert sched.get_num_new_matched_tokens(second, 0) == (None, False)
    assert sched.take_counters().get("lookups_held_for_staging") == 1
    assert waits(sched, "no_staging_room") == 1 and waits(sched, "chunk_being_written") == 0
    (job_id,) = step(sched)
    sched.update_connector_output(TierCacheWorkerMetadata(
        done={job_id: JobReport(reports=1, failed_keys=set(), bytes=0, secs=0.0)}))
    assert sched.get_num_new_matched_tokens(second, 0) == (3 * BLOCK, False)
    sched.update_state_after_alloc(second, blocks(), 3 * BLOCK)
    (load,) = sched.build_connector_meta(step_output()).loads
    assert len(load.chunks) == 3  # all of it staged: nothing recomputed


def test_a_hit_inside_vllms_own_cache_is_not_held_for_staging_room(tmp_path: pathlib.Path) -> None:
    """vLLM's own prefix cache holds all three chunks: nothing would be loaded, so a host tier without room
    to stage them changes nothing and the answer is an immediate zero."""
    sched = disk_scheduler(tmp_path, host_slots=4)
    first, second = request("a", 3, salt=7), request("b", 3, salt=8)
    for r in (first, second):
        sched.manager.cascade.learn("ssd", sched.keys.chunk_keys(r.block_hashes))
    sched.get_num_new_matched_tokens(first, 0)
    sched.update_state_after_alloc(first, blocks(), 3 * BLOCK)  # three of the four slots staging
    assert sched.get_num_new_matched_tokens(second, 3 * BLOCK) == (0, False)
    assert "lookups_held_for_staging" not in sched.take_counters()
    assert waits(sched, "no_staging_room") == 0
