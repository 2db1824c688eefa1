"""A load whose chunks find no host slot to be staged through fails visibly (a counted fault), not silently.

Chunks that live only in a lower tier are staged through host-tier slots. When
every slot is pinned (stores whose copies are still under way, write-through
copies not yet written), the manager's plan stops early and the rest of the load
fails: vLLM recomputes it. Before the fault was recorded this path left no trace
in logs or metrics (a CI run once saw a request looked up twice with no
explanation). Scheduler half only, no engine: a real disk tier under a host tier
of two slots.
"""

from __future__ import annotations

import pathlib

from tests.unit.disk_scheduler import BLOCK, blocks, disk_scheduler, request, step_output
from tiercache import faults


def test_a_load_without_staging_slots_records_a_fault_and_fails_the_rest(tmp_path: pathlib.Path) -> None:
    faults.reset_for_tests()
    sched = disk_scheduler(tmp_path, host_slots=2)
    wanted = request("r", 3, salt=1)
    keys = sched.keys.chunk_keys(wanted.block_hashes)
    sched.manager.cascade.learn("ssd", keys)  # the disk tier holds the request's 3 chunks
    # both host slots taken by stores whose copies are under way (not evictable)
    other = request("o", 2, salt=2)
    assert sched.manager.prepare_store(sched.keys.chunk_keys(other.block_hashes)) is not None

    assert sched.get_num_new_matched_tokens(wanted, 0) == (3 * BLOCK, False)
    sched.update_state_after_alloc(wanted, blocks(), 3 * BLOCK)
    assert faults.take().get(faults.STAGING_NO_SLOT) == 1  # once per load, however many chunks it lacks
    meta = sched.build_connector_meta(step_output())
    assert sorted(meta.invalid_block_ids) == [1, 2, 3]  # all three chunks' blocks: vLLM recomputes them


def test_a_load_with_room_records_no_fault(tmp_path: pathlib.Path) -> None:
    """The control: the same load with the host tier's slots free stages every chunk."""
    faults.reset_for_tests()
    sched = disk_scheduler(tmp_path, host_slots=2)
    wanted = request("r", 2, salt=1)
    sched.manager.cascade.learn("ssd", sched.keys.chunk_keys(wanted.block_hashes))
    assert sched.get_num_new_matched_tokens(wanted, 0) == (2 * BLOCK, False)
    sched.update_state_after_alloc(wanted, blocks(), 2 * BLOCK)
    assert faults.STAGING_NO_SLOT not in faults.take()
    meta = sched.build_connector_meta(step_output())
    assert meta.invalid_block_ids == [] and len(meta.loads[0].chunks) == 2
