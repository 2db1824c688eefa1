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
