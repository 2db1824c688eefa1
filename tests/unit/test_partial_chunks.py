"""Partial chunks (connector/partial_chunks.py): a request's blocks past its last full chunk.

The pure key functions, then the real scheduler half with a real host tier and
no engine: a prompt of two chunks and two blocks stores those two blocks under
a partial-chunk key in the step that computes it; a later request with the same
prefix and more hits them as the last two blocks of its hit, loaded in place of
the chunk's key, and drops them once it stores the whole chunk; a decode step
that fills a block supersedes the last partial chunk. Controls: with the option
off the hit stops at the last full chunk; with the negative-control fault the
store is one block short of its key; no partial chunk mid-prefill; a window
group's load reaches back from the partial chunk's own end.
"""

from __future__ import annotations

import pathlib
from types import SimpleNamespace
from typing import Any

import pytest
from tiercache.connector.engine_info import ChunkGeometry, EngineGeometry
from tiercache.connector.kv_groups import FULL, SLIDING_WINDOW, KVGroup, load_segments
from tiercache.connector.metadata import JobReport, TierCacheWorkerMetadata
from tiercache.connector.partial_chunks import (
    partial_candidates,
    partial_keys_from,
    partial_to_store,
)
from tiercache.connector.scheduler import TierCacheScheduler

from tests.unit.test_shared_lookup import SlowTier
from tiercache.config.schema import load_config
from tiercache.jobs import CopySegment, FromHost
from tiercache.keys import KeySpace, Namespace
from tiercache.tiers.shared_lookup import SharedLookup

BLOCK = 32
BPC = 4  # 128-token chunks
TABLE = list(range(100, 116))  # the request's 16 engine blocks


def keyspace() -> KeySpace:
    ns = Namespace(model="m", kv_dtype="f32", kv_layout="NHD", block_size=BLOCK, chunk_tokens=BPC * BLOCK,
                   tp_size=1, bytes_per_chunk=1, hash_algo="sha256")
    return KeySpace(ns, BPC)


def hashes(n: int, salt: int = 1) -> list[bytes]:
    return [bytes([salt, i]) * 16 for i in range(n)]


def test_the_partial_to_store_ends_at_the_last_full_computed_block() -> None:
    keys = keyspace()
    h = hashes(11)
    assert partial_to_store(h, 8 * BLOCK, keys, BLOCK) is None  # on a chunk boundary: the chunk store took it
    assert partial_to_store(h, 8 * BLOCK + 31, keys, BLOCK) is None  # a partly computed block is not hashed
    p = partial_to_store(h, 10 * BLOCK + 5, keys, BLOCK)
    assert (p.chunk, p.end_block, p.key) == (2, 10, keys.partial_key(h[9]))
    assert partial_to_store(h, 40 * BLOCK, keys, BLOCK).end_block == 11  # no further than the hashed blocks
    assert partial_to_store(h[:2], 2 * BLOCK, keys, BLOCK).chunk == 0  # inside the first chunk too


def test_candidates_are_the_blocks_of_the_chunk_a_hit_stops_in_longest_first() -> None:
    keys = keyspace()
    h = hashes(11)
    assert [(p.chunk, p.end_block) for p in partial_candidates(h, keys, 2)] == [(2, 11), (2, 10), (2, 9)]
    assert [p.end_block for p in partial_candidates(h, keys, 1)] == [7, 6, 5]  # block 8 ends the chunk key
    assert partial_candidates(h[:8], keys, 2) == []
    assert partial_keys_from(h, keys, 1) == [p.key for c in (1, 2) for p in partial_candidates(h, keys, c)]
    # never a chunk key or a state key, though the hash is the engine's block hash
    chunk_keys = set(keys.chunk_keys(h)) | {keys.state_key(k) for k in keys.chunk_keys(h)}
    assert not chunk_keys & set(partial_keys_from(h, keys, 0))
    assert keys.partial_key(h[9]) != keys.partial_key(hashes(11, salt=2)[9])


def scheduler(*lower: dict[str, Any], **config: Any) -> TierCacheScheduler:
    cfg = load_config(chunk_tokens=BPC * BLOCK, tiers=[{"name": "cpu", "backend": "cpu", "capacity": 16 * 4096 * BPC},
                                                       *lower], **config)
    engine = EngineGeometry(model="m", kv_dtype="torch.float32", kv_layout="NHD", block_size=BLOCK, tp_size=1,
                            world_size=1, bytes_per_block=4096, hash_algo="sha256")
    sched = TierCacheScheduler(cfg, ChunkGeometry.build(cfg, engine))
    sched.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda rid: (TABLE,), block_pool=None))
    return sched


def request(rid: str, blocks: int, computed: int, salt: int = 1) -> SimpleNamespace:
    tokens = blocks * BLOCK + 1  # every block full, and one more token
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(tokens)), num_prompt_tokens=tokens,
                           num_tokens=tokens, num_computed_tokens=computed, kv_transfer_params=None,
                           block_hashes=hashes(blocks, salt))


def step(sched: TierCacheScheduler, **scheduled: int) -> Any:
    return sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens=scheduled, finished_req_ids=set(),
                                                      preempted_req_ids=None))


def report(sched: TierCacheScheduler, *job_ids: int) -> None:
    sched.update_connector_output(TierCacheWorkerMetadata(
        done={j: JobReport(reports=1, failed_keys=set(), bytes=0, secs=0.0) for j in job_ids}))


def table() -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (TABLE,))


def first_turn(sched: TierCacheScheduler) -> tuple[SimpleNamespace, Any]:
    """Request "a", a prompt of ten blocks and a token, prefilled in one step: its two full chunks and a
    partial chunk of blocks 8-9 (chunk 2) go in that step's store."""
    a = request("a", 10, computed=0)
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    (store,) = step(sched, a=a.num_prompt_tokens).stores
    return a, store


def test_the_prompts_partial_chunk_goes_with_its_chunks_and_the_next_turn_hits_it() -> None:
    sched = scheduler()
    a, store = first_turn(sched)
    keys = sched.keys
    partial = keys.partial_key(hashes(10)[9])
    assert store.keys == (*keys.chunk_keys(a.block_hashes), partial)
    assert [(s.first_block, s.block_ids) for s in store.segments][-1] == (0, (108, 109))  # positions 0-1 of chunk 2
    nxt = request("b", 12, computed=0)  # the next turn: the same ten blocks and two more
    assert sched.get_num_new_matched_tokens(nxt, 0) == (None, False)  # held: the store is still being copied
    report(sched, store.job_id)
    assert sched.take_counters()["partial_chunks_planned"] == 1
    assert sched.get_num_new_matched_tokens(nxt, 0) == (10 * BLOCK, False)
    sched.update_state_after_alloc(nxt, table(), 10 * BLOCK)
    (load,) = step(sched).loads
    assert [c.key for c in load.chunks] == [*keys.chunk_keys(nxt.block_hashes)[:2], partial]
    last = load.chunks[-1]
    assert isinstance(last.source, FromHost) and (last.first_block, last.block_ids) == (0, (108, 109))
    # b computes the rest of chunk 2 and stores it whole: a's partial chunk of it is dropped
    report(sched, load.job_id)
    nxt.num_computed_tokens = 10 * BLOCK  # vLLM counts the loaded tokens as computed
    (stored,) = step(sched, b=nxt.num_prompt_tokens - 10 * BLOCK).stores
    assert keys.chunk_keys(nxt.block_hashes)[2] in stored.keys and not sched.manager.lookup([partial])


def test_a_decode_step_that_fills_a_block_supersedes_the_last_partial_chunk() -> None:
    sched = scheduler()
    a, store = first_turn(sched)
    report(sched, store.job_id)
    a.num_computed_tokens = a.num_prompt_tokens
    assert step(sched, a=1).stores == []  # decoding inside block 10: no new full block
    a.block_hashes = hashes(11)  # the sampled tokens filled block 10
    a.num_computed_tokens = 11 * BLOCK - 1
    (decode,) = step(sched, a=1).stores
    old, new = sched.keys.partial_key(hashes(10)[9]), sched.keys.partial_key(hashes(11)[10])
    assert decode.keys == (new,) and [(s.first_block, s.block_ids) for s in decode.segments] == [(0, (108, 109, 110))]
    assert not sched.manager.lookup([old])  # superseded: dropped


def test_of_the_answers_partial_chunks_only_the_last_is_copied_down(tmp_path: pathlib.Path) -> None:
    """Write-through copies a request's chunks and its prompt's partial chunk down at once, but the partial
    chunks its answer fills, superseded at every block, only once it finished (the last one): a long answer
    would otherwise write up to blocks_per_chunk - 1 slots per chunk of answer into the lower tier."""
    sched = scheduler({"name": "ssd", "backend": "disk", "capacity": "1MiB", "mode": "write_through",
                       "options": {"root": str(tmp_path)}})
    keys = sched.keys
    a, store = first_turn(sched)
    report(sched, store.job_id)
    a.num_computed_tokens = a.num_prompt_tokens
    (demote,) = step(sched, a=1).demotes
    prompts = keys.partial_key(hashes(10)[9])
    assert demote.keys == (*keys.chunk_keys(a.block_hashes), prompts)  # another request may want it now
    report(sched, demote.job_id)
    a.block_hashes = hashes(11)  # a decode step fills block 10: a new partial chunk supersedes the first
    a.num_computed_tokens = 11 * BLOCK - 1
    (decode,) = step(sched, a=1).stores
    report(sched, decode.job_id)
    assert step(sched, a=1).demotes == [] and step(sched).demotes == []  # held back while a runs
    assert sched.manager.state_of(prompts, "ssd") is None  # superseded: deleted from the owned tier
    sched.request_finished(a)
    (demote,) = step(sched).demotes
    assert demote.keys == (keys.partial_key(hashes(11)[10]),)  # the one it ended with
    report(sched, demote.job_id)
    assert sched.manager.state_of(demote.keys[0], "ssd") is not None


def test_a_store_the_full_host_tier_refused_is_offered_again_next_step() -> None:
    """Every host slot being written (here: other stores; in serving, loads staging chunks from a lower
    tier in the same step) refuses a request's chunks and its partial chunk; the next step, once those
    slots are READY and evictable, stores them from the blocks the running request still holds. Before,
    they were dropped for good: a conversation's next turn missed its tail (seen at concurrency 8 with a
    small host tier in front of disk: every turn-2 partial chunk refused)."""
    sched = scheduler()
    keys = sched.keys
    others = [bytes([9, i]) * 16 for i in range(16)]
    busy = sched.manager.prepare_store(others)
    assert len(busy.keys) == 16  # every slot STORING
    a = request("a", 10, computed=0)
    sched.get_num_new_matched_tokens(a, 0)
    assert step(sched, a=a.num_prompt_tokens).stores == []
    assert sched.take_counters()["store_chunks_refused"] == 3  # two chunks and the partial chunk
    refused = sched.metrics.sample("tiercache_store_refused_chunks_total", tier=sched.manager.host.name)
    assert refused == 3  # on /metrics too (an operator's sign of a host tier too small)
    sched.manager.complete_store(list(busy.keys))  # READY now: evictable
    a.num_computed_tokens = a.num_prompt_tokens
    (store,) = step(sched, a=1).stores  # a decodes inside block 10: nothing new, the refused ones again
    assert store.keys == (*keys.chunk_keys(a.block_hashes), keys.partial_key(hashes(10)[9]))
    assert [(s.first_block, s.block_ids) for s in store.segments][-1] == (0, (108, 109))
    report(sched, store.job_id)
    assert step(sched, a=1).stores == []  # stored: not offered a third time
    assert sched.metrics.sample("tiercache_store_refused_chunks_total", tier=sched.manager.host.name) == 3


def test_a_refused_partial_chunk_of_the_answer_is_not_left_held_back() -> None:
    sched = scheduler()
    a, store = first_turn(sched)
    report(sched, store.job_id)
    busy = sched.manager.prepare_store([bytes([9, i]) * 16 for i in range(16)])
    assert busy is not None
    a.block_hashes = hashes(11)  # a decode step fills block 10: its partial chunk holds a generated token
    a.num_computed_tokens = 11 * BLOCK - 1
    assert step(sched, a=1).stores == []  # refused
    assert not sched.manager.cascade._held_back  # not left behind for a request_finished that never sees it
    sched.manager.complete_store(list(busy.keys))
    (store,) = step(sched, a=1).stores
    assert store.keys == (sched.keys.partial_key(hashes(11)[10]),)
    assert sched.manager.cascade._held_back == {store.keys[0]}  # held back again: copied down only at the end


def test_control_without_partial_chunks_the_hit_stops_at_the_last_full_chunk() -> None:
    sched = scheduler(partial_chunks=False)
    a, store = first_turn(sched)
    assert store.keys == tuple(sched.keys.chunk_keys(a.block_hashes))
    report(sched, store.job_id)
    assert sched.get_num_new_matched_tokens(request("b", 12, computed=0), 0) == (8 * BLOCK, False)


def test_negative_control_fault_stores_one_block_short_of_the_key() -> None:
    sched = scheduler(faults={"partial_chunk_short_block": True})
    _, store = first_turn(sched)
    assert [(s.first_block, s.block_ids) for s in store.segments][-1] == (0, (108,))  # block 109 never copied
    report(sched, store.job_id)
    assert sched.get_num_new_matched_tokens(request("b", 12, computed=0), 0) == (10 * BLOCK, False)  # loaded whole


def test_a_prompt_shorter_than_a_chunk_hits_a_partial_chunk_too() -> None:
    sched = scheduler()
    a = request("a", 3, computed=0)
    sched.get_num_new_matched_tokens(a, 0)
    (store,) = step(sched, a=a.num_prompt_tokens).stores
    assert store.keys == (sched.keys.partial_key(hashes(3)[2]),)
    report(sched, store.job_id)
    assert sched.get_num_new_matched_tokens(request("b", 3, computed=0), 0) == (3 * BLOCK, False)
    assert sched.get_num_new_matched_tokens(request("c", 3, computed=0, salt=9), 0) == (0, False)


def test_no_partial_chunk_while_the_prompt_is_still_being_prefilled() -> None:
    sched = scheduler()
    a = request("a", 10, computed=0)
    sched.get_num_new_matched_tokens(a, 0)
    (store,) = step(sched, a=6 * BLOCK).stores  # a chunked prefill's first step ends inside chunk 1
    assert store.keys == tuple(sched.keys.chunk_keys(a.block_hashes)[:1])


@pytest.mark.parametrize("with_partial", [True, False])
def test_a_partial_chunk_another_engine_left_in_a_shared_tier_is_found(tmp_path: pathlib.Path,
                                                                      with_partial: bool) -> None:
    """The shared tier is asked about the partial keys with the chunk keys (its answer sets where the hit
    stops); control: without the partial chunk there, the hit stops at the full chunks."""
    sched = scheduler({"name": "ssd", "backend": "disk", "capacity": "1MiB", "options": {"root": str(tmp_path)}})
    wanted = request("b", 12, computed=0)
    held = [*sched.keys.chunk_keys(wanted.block_hashes)[:2]] + \
        ([sched.keys.partial_key(hashes(12)[9])] if with_partial else [])
    tier = SlowTier(0.0)
    tier.submit_put(1, held, [memoryview(bytearray(8))] * len(held))
    sched._shared = SharedLookup({"ssd": tier}, timeout_s=5.0, first_wait_s=1.0)
    try:
        assert sched.get_num_new_matched_tokens(wanted, 0) == ((10 if with_partial else 8) * BLOCK, False)
    finally:
        sched._shared.close()


def test_a_window_groups_load_reaches_back_from_the_partial_chunks_own_end() -> None:
    """A 64-token window, a partial chunk ending at block 2 of a 4-block chunk: the store kept the window
    group's blocks 0-1 (kept_from from its end); a load must write both, not only what a whole
    chunk's end would keep (none of them)."""
    groups = (KVGroup(FULL), KVGroup(SLIDING_WINDOW, 64))
    tables = ([1, 2, 3, 4], [5, 6, 0, 0])
    runs, ok = load_segments(tables, groups, 0, 0, 2, BPC, BLOCK, 0, end_token=2 * BLOCK)
    assert ok and runs == [CopySegment(-1, 0, (1, 2)), CopySegment(-1, BPC, (5, 6))]
    runs, ok = load_segments(tables, groups, 0, 0, 2, BPC, BLOCK, 0)  # as a whole chunk: floor at block 2
    assert not ok and runs == [CopySegment(-1, 0, (1, 2))]
