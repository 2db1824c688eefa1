"""State-layer models (connector/state_chunks.py, the STATE kind of connector/kv_groups.py), without an engine.

What a store keeps and a load needs of a state group, where a hit may end, which
of vLLM's offered states become state-key stores, and where tiercache declines.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

from tiercache.connector.kv_groups import (
    FULL,
    STATE,
    KVGroup,
    UnsupportedKVGroups,
    block_bytes,
    describe_groups,
    engine_groups,
    kept_from,
    load_segments,
    refuse_unserved_state_layers,
    storable,
)
from tiercache.connector.state_chunks import state_hit_chunks, state_offers, with_state_blocks
from tiercache.keys import KeySpace, Namespace

BLOCK = 32
GROUPS = (KVGroup(STATE), KVGroup(FULL))  # LFM2's order: the conv layers' group first
NULL = 0


def mamba(mode: str = "align") -> MambaSpec:
    return MambaSpec(block_size=BLOCK, shapes=((2, 256),), dtypes=(torch.float32,), page_size_padded=32768,
                     mamba_cache_mode=mode)


def attention() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)


def config(*specs: Any) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layers.{i}.a", f"layers.{i}.b"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def test_an_align_mode_state_group_is_served_beside_attention() -> None:
    cfg = config(mamba(), attention())
    groups, specs = engine_groups(cfg)
    assert groups == GROUPS and describe_groups(groups) == "state,full"
    assert specs[0].dtype == torch.float32  # the attention group's specs name the namespace's dtype
    # what the worker's KV tensors span per block: 2 attention pages and 2 unpadded 2 KiB states
    assert block_bytes(cfg, groups, specs) == 2 * 32768 + 2 * 2048


@pytest.mark.parametrize("mode", ["none", "all"])
def test_a_state_group_outside_align_mode_is_declined_naming_the_mode(mode: str) -> None:
    with pytest.raises(UnsupportedKVGroups, match=f"MambaSpec.*align.*{mode}"):
        engine_groups(config(mamba(mode), attention()))


def test_a_model_of_state_layers_only_is_declined() -> None:
    with pytest.raises(UnsupportedKVGroups, match="state layers only"):
        engine_groups(config(mamba(), mamba()))


def test_state_layers_are_declined_with_several_pipeline_stages_only() -> None:
    refuse_unserved_state_layers(GROUPS, 1)  # served (at any TP size, P/D included)
    refuse_unserved_state_layers((KVGroup(FULL),), 2)  # no state: not ours to refuse
    with pytest.raises(UnsupportedKVGroups, match="one pipeline stage"):
        refuse_unserved_state_layers(GROUPS, 2)


def test_a_chunk_key_keeps_no_state_and_a_state_key_the_chunks_last_block() -> None:
    bpc = 4
    assert kept_from(GROUPS, 2, 12 * BLOCK, bpc, BLOCK) == (12, 8)  # state: nothing (from the chunk's end)
    assert kept_from(GROUPS, 2, 12 * BLOCK, bpc, BLOCK, with_state=True) == (11, 8)


def test_a_chunk_key_is_stored_whatever_the_state_table_holds() -> None:
    """vLLM's state table holds its null block wherever no state was kept: a chunk key needs none."""
    tables = ([NULL, NULL, NULL, NULL], [5, 6, 7, 8])
    assert set(storable(tables, GROUPS, {b"k": (1, 2 * BLOCK)}, 1, BLOCK, NULL)) == {b"k"}
    assert storable(tables, GROUPS, {b"k": (1, 2 * BLOCK)}, 1, BLOCK, NULL, with_state=True) == {}


def test_a_state_load_writes_the_state_block_at_the_hit_end_only() -> None:
    # vLLM's tables after a 4-chunk hit: the state group holds a block at the hit's last position only
    # (and possibly others it never reads); the attention group holds every block
    tables = ([NULL, 41, NULL, 40], [1, 2, 3, 4])
    runs, ok = load_segments(tables, GROUPS, 3, 3, 4, 1, BLOCK, NULL, with_state=True)
    assert ok and [(r.first_block, r.block_ids) for r in runs] == [(0, (40,)), (1, (4,))]
    runs, ok = load_segments(tables, GROUPS, 1, 1, 2, 1, BLOCK, NULL)  # inside the hit: attention only
    assert ok and [(r.first_block, r.block_ids) for r in runs] == [(1, (2,))]
    _, ok = load_segments(([NULL] * 4, [1, 2, 3, 4]), GROUPS, 3, 3, 4, 1, BLOCK, NULL, with_state=True)
    assert not ok  # no block to resume from: the load fails (recomputed), never a hit on a stale state


def keys(n: int) -> list[bytes]:
    return [bytes([i]) * 8 for i in range(n)]


def test_a_hit_ends_at_the_last_chunk_whose_state_is_stored() -> None:
    present = {b"s" + bytes([1]) * 8, b"s" + bytes([4]) * 8}

    def hit(hits: int, max_tokens: int) -> int:
        return state_hit_chunks(keys(8), hits, max_tokens, BLOCK, lambda k: b"s" + k, present.__contains__)

    assert hit(8, 1000) == 5  # states after chunks 1 and 4: the hit spans chunks 0-4
    assert hit(4, 1000) == 5  # chunks 0-3 present and chunk 4's state key: its chunk key is not needed
    assert hit(3, 1000) == 2  # chunk 3 missing: chunk 4's state is beyond the run
    assert hit(8, 5 * BLOCK - 1) == 2  # vLLM computes the last prompt token: chunk 4 ends past it
    assert hit(1, 1000) == 2  # chunk 0 from its chunk key, chunk 1 from its state key
    assert hit(0, 1000) == 0  # chunk 0 missing, its state too


def offers(entries: dict[str, list[tuple[int, int, int]]]) -> SimpleNamespace:
    return SimpleNamespace(kv_connector_block_state=SimpleNamespace(boundary_state_offloads=entries))


def test_offers_become_chunk_states_only_at_chunk_ends_within_the_stored_tokens() -> None:
    out = state_offers(offers({"r": [(0, 9, 64), (0, 10, 96), (0, 11, 100), (0, 12, 256)],
                               "gone": [(0, 13, 64)]}), 32, (0,), {"r": 200}.get)
    assert out == {"r": {1: {0: 9}, 2: {0: 10}}}  # 100: no chunk end; 256: past the limit; "gone": unknown
    two = state_offers(offers({"r": [(0, 9, 64), (2, 19, 64), (0, 10, 96)]}), 32, (0, 2), {"r": 200}.get)
    assert two == {"r": {1: {0: 9, 2: 19}}}  # chunk 2 lacks group 2's state: not offered whole
    assert state_offers(SimpleNamespace(), 32, (0,), {"r": 200}.get) == {}  # an older vLLM: no offers


def test_the_offered_block_replaces_the_state_tables_entry_in_a_copy() -> None:
    tables = ([NULL, NULL], [1, 2])
    out = with_state_blocks(tables, 3, 1, {0: 77})
    assert out[0][3] == 77 and out[1] == [1, 2] and tables[0] == [NULL, NULL]


def test_a_state_key_differs_from_its_chunk_key_only_in_the_group_field() -> None:
    space = KeySpace(Namespace(model="m", kv_dtype="f", kv_layout="d", block_size=BLOCK, chunk_tokens=BLOCK,
                               tp_size=1, bytes_per_chunk=1, hash_algo="sha256"), 1)
    chunk = space.chunk_keys([b"h" * 32])[0]
    state = space.state_key(chunk)
    assert state != chunk and len(state) == len(chunk) and state[:-4] == chunk[:-4]


# ------------------------------------------------------------- the scheduler half, without an engine
def state_scheduler():  # type: ignore[no-untyped-def]
    from tiercache.config.schema import load_config
    from tiercache.connector.engine_info import ChunkGeometry, EngineGeometry
    from tiercache.connector.scheduler import TierCacheScheduler

    config = load_config(chunk_tokens=BLOCK, tiers=[{"name": "cpu", "backend": "cpu", "capacity": "4MiB"}])
    engine = EngineGeometry(model="m", kv_dtype="torch.float32", kv_layout="NHD", block_size=BLOCK, tp_size=1,
                            world_size=1, bytes_per_block=4096, hash_algo="sha256", kv_groups=GROUPS)
    return TierCacheScheduler(config, ChunkGeometry.build(config, engine), kv_role="kv_both")


def request(rid: str, tokens: int, computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(tokens)), num_prompt_tokens=tokens,
                           num_tokens=tokens, num_computed_tokens=computed, kv_transfer_params=None,
                           block_hashes=[bytes([i]) * 32 for i in range(tokens // BLOCK)])


def step(sched, req_id: str, scheduled: int, offered: list[tuple[int, int, int]]):  # type: ignore[no-untyped-def]
    return sched.build_connector_meta(SimpleNamespace(
        num_scheduled_tokens={req_id: scheduled}, finished_req_ids=set(), preempted_req_ids=None,
        kv_connector_block_state=SimpleNamespace(boundary_state_offloads={req_id: offered})))


def finish_jobs(sched, meta) -> None:  # type: ignore[no-untyped-def]
    from tiercache.connector.metadata import JobReport, TierCacheWorkerMetadata

    done = {job.job_id: JobReport(reports=1, failed_keys=set(), bytes=0, secs=0.0) for job in meta.stores}
    sched.update_connector_output(TierCacheWorkerMetadata(done=done))


def test_a_prompt_is_stored_with_its_offered_state_and_a_repeat_resumes_there() -> None:
    sched = state_scheduler()
    state_table, attention_table = [NULL] * 4 + [50, NULL], [1, 2, 3, 4, 5, 6]
    sched.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda rid: (state_table, attention_table),
                                                block_pool=None))
    first = request("a", 190)  # 5 whole chunks and a tail; vLLM's step ended at 160 (its state in block 50)
    assert sched.get_num_new_matched_tokens(first, 0) == (0, False)
    sched.update_state_after_alloc(first, SimpleNamespace(get_block_ids=lambda: ([], [])), 0)
    meta = step(sched, "a", 160, [(0, 50, 160)])
    chunk_store, state_store = meta.stores
    assert len(chunk_store.keys) == 5 and 50 not in chunk_store.block_ids()  # attention only
    assert state_store.keys == (sched.keys.state_key(chunk_store.keys[4]),)
    assert set(state_store.block_ids()) == {50, 5}  # the chunk's attention block and its end state
    finish_jobs(sched, meta)

    repeat = request("b", 190)
    assert sched.get_num_new_matched_tokens(repeat, 0) == (160, True)  # to the stored state, not further
    tables = ([NULL] * 4 + [60], [11, 12, 13, 14, 15])
    sched.update_state_after_alloc(repeat, SimpleNamespace(get_block_ids=lambda: tables), 160)
    (load,) = step(sched, "b", 30, []).loads
    assert load.keys[-1] == state_store.keys[0] and load.keys[:4] == chunk_store.keys[:4]
    assert 60 in load.block_ids() and set(load.block_ids()) == {11, 12, 13, 14, 15, 60}


def test_chunks_without_a_stored_state_give_no_hit() -> None:
    """The control of the rule above: every chunk stored, no state offered: a hit would resume from a
    state nobody loaded, so there is none."""
    sched = state_scheduler()
    sched.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda rid: ([NULL] * 5, [1, 2, 3, 4, 5]),
                                                block_pool=None))
    first = request("a", 190)
    sched.get_num_new_matched_tokens(first, 0)
    sched.update_state_after_alloc(first, SimpleNamespace(get_block_ids=lambda: ([], [])), 0)
    meta = step(sched, "a", 160, [(0, 50, 150)])  # a state offered off a chunk end: not stored
    assert len(meta.stores) == 1
    finish_jobs(sched, meta)
    assert sched.manager.lookup(sched.keys.chunk_keys(request("b", 190).block_hashes)) == 5
    assert sched.get_num_new_matched_tokens(request("b", 190), 0) == (0, False)
