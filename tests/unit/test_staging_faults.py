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
from types import SimpleNamespace

from tiercache import faults
from tiercache.config.schema import load_config
from tiercache.connector.engine_info import ChunkGeometry, EngineGeometry
from tiercache.connector.scheduler import TierCacheScheduler

BLOCK = 32
BLOCK_BYTES = 4096


def scheduler(tmp: pathlib.Path) -> TierCacheScheduler:
    config = load_config(chunk_tokens=BLOCK, tiers=[
        {"name": "cpu", "backend": "cpu", "capacity": 2 * BLOCK_BYTES},
        {"name": "ssd", "backend": "disk", "capacity": "1MiB", "options": {"root": str(tmp)}},
    ])
    engine = EngineGeometry(model="m", kv_dtype="torch.float32", kv_layout="NHD", block_size=BLOCK, tp_size=1,
                            world_size=1, bytes_per_block=BLOCK_BYTES, hash_algo="sha256")
    sched = TierCacheScheduler(config, ChunkGeometry.build(config, engine))
    sched.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda rid: (list(range(1, 9)),), block_pool=None))
    return sched


def request(rid: str, chunks: int, salt: int) -> SimpleNamespace:
    tokens = chunks * BLOCK + 1
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(tokens)), num_prompt_tokens=tokens,
                           num_tokens=tokens, num_computed_tokens=0, kv_transfer_params=None,
                           block_hashes=[bytes([salt, i]) * 16 for i in range(chunks)])


def test_a_load_without_staging_slots_records_a_fault_and_fails_the_rest(tmp_path: pathlib.Path) -> None:
    faults.reset_for_tests()
    sched = scheduler(tmp_path)
    wanted = request("r", 3, salt=1)
    keys = sched.keys.chunk_keys(wanted.block_hashes)
    sched.manager.cascade.learn("ssd", keys)  # the disk tier holds the request's 3 chunks
    # both host slots taken by stores whose copies are under way (not evictable)
    other = request("o", 2, salt=2)
    assert sched.manager.prepare_store(sched.keys.chunk_keys(other.block_hashes)) is not None

    assert sched.get_num_new_matched_tokens(wanted, 0) == (3 * BLOCK, False)
    sched.update_state_after_alloc(wanted, SimpleNamespace(get_block_ids=lambda: (list(range(1, 9)),)), 3 * BLOCK)
    assert faults.take().get(faults.STAGING_NO_SLOT) == 1  # once per load, however many chunks it lacks
    meta = sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}, finished_req_ids=set(),
                                                      preempted_req_ids=None))
    assert sorted(meta.invalid_block_ids) == [1, 2, 3]  # all three chunks' blocks: vLLM recomputes them


def test_a_load_with_room_records_no_fault(tmp_path: pathlib.Path) -> None:
    """The control: the same load with the host tier's slots free stages every chunk."""
    faults.reset_for_tests()
    sched = scheduler(tmp_path)
    wanted = request("r", 2, salt=1)
    sched.manager.cascade.learn("ssd", sched.keys.chunk_keys(wanted.block_hashes))
    assert sched.get_num_new_matched_tokens(wanted, 0) == (2 * BLOCK, False)
    sched.update_state_after_alloc(wanted, SimpleNamespace(get_block_ids=lambda: (list(range(1, 9)),)), 2 * BLOCK)
    assert faults.STAGING_NO_SLOT not in faults.take()
    meta = sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}, finished_req_ids=set(),
                                                      preempted_req_ids=None))
    assert meta.invalid_block_ids == [] and len(meta.loads[0].chunks) == 2
