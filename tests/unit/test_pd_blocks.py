"""BlockRegions and paired_descs: the KV blocks a mode-direct READ moves, as NIXL descriptors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiercache.layout import KVBlockLayout
from tiercache.pd_blocks import BlockRegions, paired_descs

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
