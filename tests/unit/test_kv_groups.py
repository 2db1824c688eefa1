"""connector/kv_groups.py: which KV-cache groups tiercache serves, and one chunk's segments across them.

vLLM's own spec and config classes (vllm.v1.kv_cache_interface) build the
configs; the segments are checked against block tables shaped like vLLM's
(a sliding-window group's table holds the null block where blocks left the
window).
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from tiercache.connector.kv_groups import (
    FULL,
    SLIDING_WINDOW,
    KVGroup,
    UnsupportedKVGroups,
    chunk_segments,
    describe_groups,
    engine_groups,
    kept_from,
    load_segments,
    storable,
)
from tiercache.jobs import CopySegment

BLOCK = 32


def full(heads: int = 2) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=64, dtype=torch.float32)


def window(tokens: int = 256, heads: int = 2) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BLOCK, num_kv_heads=heads, head_size=64, dtype=torch.float32,
                             sliding_window=tokens)


def config(*specs) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layers.{i}.a", f"layers.{i}.b"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def test_one_full_group_is_as_before() -> None:
    groups, specs = engine_groups(config(full()))
    assert groups == (KVGroup(FULL),)
    assert describe_groups(groups) == ""  # the namespace digest of single-group models is unchanged
    assert len(specs) == 2


def test_full_and_sliding_window_groups_are_served() -> None:
    groups, _ = engine_groups(config(full(), window(256)))
    assert groups == (KVGroup(FULL), KVGroup(SLIDING_WINDOW, 256))
    assert describe_groups(groups) == "full,sliding_window:256"


def test_a_lone_sliding_window_group_keeps_its_window() -> None:
    groups, _ = engine_groups(config(window(512)))
    assert groups == (KVGroup(SLIDING_WINDOW, 512),)


def test_state_layers_are_declined_naming_the_group_type() -> None:
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(UnsupportedKVGroups, match="MambaSpec"):
        engine_groups(config(full(), mamba))


def test_groups_of_unequal_block_bytes_are_declined() -> None:
    with pytest.raises(UnsupportedKVGroups, match="same bytes per block"):
        engine_groups(config(full(heads=2), window(heads=4)))


def test_segments_of_a_chunk_across_groups_skip_null_blocks() -> None:
    bpc, null = 4, 0
    tables = ([11, 12, 13, 14, 15, 16, 17, 18],  # full attention: every block
              [0, 0, 0, 24, 25, 26, 27, 28])  # a window: its first three blocks left it (null)
    # chunk 0 (positions 0-3): the window group has only position 3
    assert chunk_segments(5, tables, 0, 0, 4, bpc, null) == [
        CopySegment(5, 0, (11, 12, 13, 14)), CopySegment(5, bpc + 3, (24,))]
    # chunk 1, a load of blocks 5..7 (mid-chunk): group g at positions g * bpc + 1 ..
    assert chunk_segments(2, tables, 1, 5, 8, bpc, null) == [
        CopySegment(2, 1, (16, 17, 18)), CopySegment(2, bpc + 1, (26, 27, 28))]


def test_a_null_block_inside_a_run_splits_it() -> None:
    tables = ([1, 2, 3, 4], [5, 0, 7, 8])
    assert chunk_segments(0, tables, 0, 0, 4, 4, 0) == [
        CopySegment(0, 0, (1, 2, 3, 4)), CopySegment(0, 4, (5,)), CopySegment(0, 6, (7, 8))]


def test_a_table_shorter_than_the_chunk_stops_at_its_end() -> None:
    assert chunk_segments(0, ([1, 2],), 0, 0, 4, 4, 0) == [CopySegment(0, 0, (1, 2))]


GROUPS = (KVGroup(FULL), KVGroup(SLIDING_WINDOW, 64))  # a 64-token window: two 32-token blocks


def test_a_store_keeps_a_window_groups_last_window_of_each_chunk() -> None:
    bpc = 8  # 256-token chunks
    assert kept_from(GROUPS, 0, 256, bpc, BLOCK) == (0, 6)  # tokens 192..255 of chunk 0
    assert kept_from(GROUPS, 3, 4 * 256, bpc, BLOCK) == (24, 30)
    assert kept_from(GROUPS, 2, 2 * 256 + 40, bpc, BLOCK) == (16, 16)  # a 40-token tail: the window reaches back
    assert kept_from((KVGroup(FULL), KVGroup(SLIDING_WINDOW, 1000)), 1, 512, bpc, BLOCK) == (8, 8)  # window > chunk
    tables = (list(range(1, 9)), [0] * 6 + [17, 18])  # the window group freed all but its last two blocks
    (kept,) = storable(tables, GROUPS, {b"k": (0, 256)}, bpc, BLOCK, 0).values()
    assert chunk_segments(3, tables, 0, 0, 8, bpc, 0, kept) == [
        CopySegment(3, 0, tuple(range(1, 9))), CopySegment(3, bpc + 6, (17, 18))]


def test_a_chunk_missing_a_block_a_later_hit_loads_is_not_stored() -> None:
    """vLLM's own prefix cache gives a window group only its last window: the earlier chunks lack blocks."""
    bpc, null = 4, 0
    groups = (KVGroup(FULL), KVGroup(SLIDING_WINDOW, 256))  # a window as long as two 128-token chunks
    full_table = list(range(1, 13))
    window_table = [null] * 5 + list(range(20, 27))  # a prefix hit of ~384 tokens: blocks 0-4 never given
    extent = {b"c0": (0, 128), b"c1": (1, 256), b"c2": (2, 384)}
    kept = storable((full_table, window_table), groups, extent, bpc, BLOCK, null)
    assert list(kept) == [b"c2"]  # c1 needs window blocks 4..7 (block 4 missing); c0 needs 0..3
    # control: without the check the incomplete chunks are stored, their window positions unwritten
    assert list(storable((full_table, window_table), groups, extent, bpc, BLOCK, null, incomplete_too=True)) == [
        b"c0", b"c1", b"c2"]


def test_a_load_of_a_block_the_store_left_out_is_refused() -> None:
    bpc = 8
    tables = (list(range(1, 9)), [0] * 6 + [17, 18])  # what vLLM allocates for a hit ending at 255: fine
    runs, kept_all = load_segments(tables, GROUPS, 0, 0, 8, bpc, BLOCK, 0)
    assert kept_all and runs[1] == CopySegment(-1, bpc + 6, (17, 18))
    runs, kept_all = load_segments((list(range(1, 9)), [0] * 5 + [16, 17, 18]), GROUPS, 0, 0, 8, bpc, BLOCK, 0)
    assert not kept_all and runs[1] == CopySegment(-1, bpc + 6, (17, 18))  # block 16 was never stored


def hybrid_scheduler(window: int, chunk_tokens: int, **faults: bool):  # type: ignore[no-untyped-def]
    """The connector's scheduler half for a full + sliding-window model (no engine)."""
    from tiercache.config.schema import load_config
    from tiercache.connector.engine_info import ChunkGeometry, EngineGeometry
    from tiercache.connector.scheduler import TierCacheScheduler

    config = load_config(chunk_tokens=chunk_tokens, tiers=[{"name": "cpu", "backend": "cpu", "capacity": "4MiB"}],
                         faults=faults)
    engine = EngineGeometry(model="m", kv_dtype="torch.float32", kv_layout="NHD", block_size=BLOCK, tp_size=1,
                            world_size=1, bytes_per_block=4096, hash_algo="sha256",
                            kv_groups=(KVGroup(FULL), KVGroup(SLIDING_WINDOW, window)))
    return TierCacheScheduler(config, ChunkGeometry.build(config, engine), kv_role="kv_both")


def store_plan(sched, tables: tuple[list[int], list[int]], tokens: int, computed: int):  # type: ignore[no-untyped-def]
    """Register a request whose first ``computed`` tokens hit vLLM's own cache, schedule the rest: its store."""
    from types import SimpleNamespace

    req = SimpleNamespace(request_id="r", prompt_token_ids=list(range(tokens)), num_prompt_tokens=tokens,
                          num_tokens=tokens, num_computed_tokens=computed, kv_transfer_params=None,
                          block_hashes=[bytes([i % 251]) * 32 for i in range(tokens // BLOCK)])
    sched.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda rid: tables, block_pool=None))
    sched.get_num_new_matched_tokens(req, computed)
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: tables), 0)
    meta = sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r": tokens - computed},
                                                      finished_req_ids=set(), preempted_req_ids=None))
    return meta.stores[0] if meta.stores else None


def test_the_scheduler_stores_no_chunk_a_prefix_hit_left_without_its_window_blocks() -> None:
    """A request that hit 384 tokens in vLLM's cache: its window table lacks blocks 0-4 (null, id 0)."""
    full_table = list(range(1, 17))
    window_table = [0] * 5 + list(range(30, 41))
    store = store_plan(hybrid_scheduler(256, 128), (full_table, window_table), 512, 384)
    assert store is not None and len(store.keys) == 2  # chunks 2 and 3; 0 and 1 lack window blocks
    assert {b for seg in store.segments for b in seg.block_ids} == set(full_table[8:]) | set(window_table[8:])
    control = store_plan(hybrid_scheduler(256, 128, store_incomplete_chunks=True), (full_table, window_table),
                         512, 384)
    assert control is not None and len(control.keys) == 4  # the bug: chunks 0 and 1 with window positions unwritten


def test_the_scheduler_stores_a_window_groups_last_window_of_a_long_chunk() -> None:
    full_table, window_table = list(range(1, 17)), list(range(20, 36))
    store = store_plan(hybrid_scheduler(64, 256), (full_table, window_table), 512, 0)
    assert store is not None and len(store.keys) == 2
    window_blocks = [b for seg in store.segments for b in seg.block_ids if b >= 20]
    assert window_blocks == [26, 27, 34, 35]  # 64 tokens = 2 blocks before each chunk's end
