"""BlockRegions, paired_descs and slot_descs: what a P/D READ moves into our blocks, as NIXL descriptors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiercache.layout import KVBlockLayout
from tiercache.pd.blocks import BlockRegions, paired_descs, slot_descs

BLOCKS = 8


def regions(shape: tuple[int, ...]) -> tuple[BlockRegions, dict[str, torch.Tensor]]:
    kv = {f"l{i}": torch.zeros(shape) for i in range(2)}
    return BlockRegions.from_layout(KVBlockLayout.from_kv_caches(kv, BLOCKS)), kv


def test_regions_of_a_cpu_attention_cache() -> None:
    r, kv = regions((2, BLOCKS, 32, 2, 16))  # K and V apart: 2 regions per layer
    page = 32 * 2 * 16 * 4
    assert r.pages == (page,) * 4 and r.strides == (page,) * 4 and r.mem_type == "DRAM"
    assert r.addrs[0] == kv["l0"].data_ptr() and r.addrs[1] == kv["l0"].data_ptr() + BLOCKS * page
    assert sum(n for _, n, _, _ in r.spans()) == 2 * kv["l0"].nbytes  # K and V of a layer merge
    assert BlockRegions.from_wire(r.to_wire()) == r


def test_consecutive_blocks_on_both_sides_are_one_descriptor_per_region() -> None:
    ours, _ = regions((2, BLOCKS, 32, 2, 16))
    theirs, _ = regions((2, BLOCKS, 32, 2, 16))
    page = ours.pages[0]
    local, remote = paired_descs(ours, theirs, [2, 3, 4, 7], [5, 6, 7, 0])
    assert local.shape == (4 * 2, 3)  # 4 regions x 2 runs ([2,3,4] <- [5,6,7], [7] <- [0])
    assert local[0].tolist() == [ours.addrs[0] + 2 * page, 3 * page, 0]
    assert remote[0].tolist() == [theirs.addrs[0] + 5 * page, 3 * page, 0]
    assert local[:, 1].sum() == remote[:, 1].sum() == 4 * 4 * page


def test_pages_apart_fall_back_to_one_descriptor_per_block() -> None:
    base = torch.zeros(BLOCKS, 4, 32, 2, 16)
    kv = {"l0": base[:, :2]}  # each block's page is followed by a gap of the same size
    ours = BlockRegions.from_layout(KVBlockLayout.from_kv_caches(kv, BLOCKS))
    assert ours.strides[0] == 2 * ours.pages[0]
    local, remote = paired_descs(ours, ours, [1, 2], [3, 4])
    assert local.shape == (2, 3) and np.all(local[:, 1] == ours.pages[0])
    assert local[1, 0] - local[0, 0] == ours.strides[0]


def test_a_peer_with_other_pages_is_named_and_bad_ids_refused() -> None:
    ours, _ = regions((2, BLOCKS, 32, 2, 16))
    other, _ = regions((2, BLOCKS, 32, 4, 16))
    assert "page bytes" in (ours.mismatch(other) or "") and ours.mismatch(ours) is None
    with pytest.raises(ValueError, match="block id"):
        ours.check_blocks([0, BLOCKS])
    with pytest.raises(ValueError, match="memory type"):
        BlockRegions.from_wire({**ours.to_wire(), "mem_type": "HBM"})


def test_a_host_slot_lands_in_our_blocks_one_descriptor_per_region_per_run() -> None:
    ours, _ = regions((2, BLOCKS, 32, 2, 16))  # 4 regions
    page = ours.pages[0]
    bpc, slab = 3, 1 << 20
    slot_bytes = bpc * 4 * page
    # chunk 0: slot 5 into blocks 2,3,4 (one run); chunk 1: slot 1, positions 1.. into blocks 7, 0
    local, remote = slot_descs(ours, slab, slot_bytes, [5, 1], [0, 1], [(2, 3, 4), (7, 0)])
    assert local.shape == (4 + 4 * 2, 3)
    # region r of a slot starts at r * bpc * page (KVBlockLayout.region_offsets)
    assert local[1].tolist() == [ours.addrs[1] + 2 * page, 3 * page, 0]
    assert remote[1].tolist() == [slab + 5 * slot_bytes + 1 * bpc * page, 3 * page, 0]
    # the partial chunk: position 1 of slot 1, region 2 -> block 7, then position 2 -> block 0
    tail = [(a, n) for a, n, _ in remote[4:].tolist()]
    assert (slab + slot_bytes + 2 * bpc * page + 1 * page, page) in tail
    assert (slab + slot_bytes + 2 * bpc * page + 2 * page, page) in tail
    assert local[:, 1].sum() == remote[:, 1].sum() == 5 * 4 * page
    with pytest.raises(ValueError, match="whole number"):
        slot_descs(ours, slab, slot_bytes + 1, [0], [0], [(1,)])
    with pytest.raises(ValueError, match="overflow"):
        slot_descs(ours, slab, slot_bytes, [0], [2], [(1, 2)])
