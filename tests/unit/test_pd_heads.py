"""P/D between TP sizes (tiercache.pd.heads, backends/nixl_plans.head_plan): read plans, refusals.

Pure: no NIXL, no engine. Pages are vLLM 0.32 CPU's ``[blocks, heads, tokens, content]``
(head-major); a token-major page ``[blocks, tokens, heads, content]`` is refused.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiercache.pd.peer_tier import PeerChunk, PeerSource
from tiercache.pd.read_plans import IncompatibleBlocks, head_plan

from tiercache.transfer.device import CopySegment
from tiercache.layout import KVBlockLayout, region_head_maps
from tiercache.pd.blocks import BlockRegions
from tiercache.pd.heads import (
    WRONG_HEAD_ENV,
    HeadRun,
    PageHeads,
    head_runs,
    hetero_refusal,
    page_heads,
    page_heads_from_maps,
    readers_of,
    tp_mismatches,
)
from tiercache.shards import ShardError

BLOCKS, TOKENS, CONTENT = 8, 32, 32  # float32: one head's page = 32 * 32 * 4 = 4096 bytes
INNER = TOKENS * CONTENT * 4
BPC = 2


def kv(heads: int, token_major: bool = False) -> dict[str, torch.Tensor]:
    shape = (BLOCKS, TOKENS, heads, CONTENT) if token_major else (BLOCKS, heads, TOKENS, CONTENT)
    return {f"layer.{i}": torch.zeros(shape) for i in range(2)}


def heads_of(tp: int, rank: int, token_major: bool = False) -> PageHeads:
    return page_heads(kv(2 // tp, token_major), BLOCKS, 2, tp, rank, 2 // tp)


def test_head_runs_consumer_tp2_reads_its_head_from_producer_rank0() -> None:
    assert head_runs(2, 2, 0, 1) == [HeadRun(0, 0, 0, 1)]
    assert head_runs(2, 2, 1, 1) == [HeadRun(0, 0, 1, 1)]  # head 1: the producer page's second sub-run
    assert readers_of(2, 2, 1, 0) == 2  # producer rank 0 waits for both consumer ranks


def test_head_runs_consumer_tp1_reads_each_head_from_its_producer_rank() -> None:
    assert head_runs(2, 1, 0, 2) == [HeadRun(0, 0, 0, 1), HeadRun(1, 1, 0, 1)]
    assert readers_of(2, 1, 2, 0) == readers_of(2, 1, 2, 1) == 1
    # 4 heads, TP 4 -> 2: runs of two heads from one producer rank become one run
    assert head_runs(4, 2, 1, 4) == [HeadRun(2, 0, 0, 1), HeadRun(3, 1, 0, 1)]
    assert head_runs(4, 4, 3, 2) == [HeadRun(1, 0, 1, 1)]
    assert head_runs(4, 1, 0, 2) == [HeadRun(0, 0, 0, 2), HeadRun(1, 2, 0, 2)]


def test_replicated_consumer_heads_are_read_by_every_holder() -> None:
    # 2 heads, consumer TP 4: ranks 0, 1 hold head 0, ranks 2, 3 head 1
    assert head_runs(2, 4, 1, 1) == [HeadRun(0, 0, 0, 1)]
    assert head_runs(2, 4, 2, 1) == [HeadRun(0, 0, 1, 1)]
    assert readers_of(2, 4, 1, 0) == 4


def test_refusals() -> None:
    assert hetero_refusal(2, 1, 1) is None and hetero_refusal(2, 2, 1) is None
    assert "integer ratio" in hetero_refusal(6, 2, 3)
    assert "replicated" in hetero_refusal(2, 4, 1)  # producer TP above the head count
    assert "unknown" in hetero_refusal(0, 1, 2)
    with pytest.raises(ShardError):
        head_runs(2, 1, 0, 4)


def test_fingerprints_of_other_tp_sizes_match_only_on_everything_else() -> None:
    fp1 = {"model": "m", "kv_dtype": "f32", "kv_heads": 2, "tp_size": 1, "bytes_per_chunk": 200, "shard_bytes": 100}
    fp2 = {**fp1, "tp_size": 2, "bytes_per_chunk": 100}
    assert tp_mismatches(fp2, fp1) == [] and tp_mismatches(fp1, fp2, we_produce=True) == []
    assert any("kv_dtype" in d for d in tp_mismatches({**fp2, "kv_dtype": "bf16"}, fp1))
    assert any("shard_bytes" in d for d in tp_mismatches({**fp2, "shard_bytes": 7}, fp1))
    assert tp_mismatches({**fp2, "kv_heads": 0}, {**fp1, "kv_heads": 0})  # no head count: refused
    fp4 = {**fp1, "tp_size": 4, "bytes_per_chunk": 50}
    assert tp_mismatches(fp1, fp4)  # producer TP 4 > 2 heads, consumer TP 1
    assert tp_mismatches(fp4, fp1) == []  # consumer TP 4 (replicated heads), producer TP 1
    assert tp_mismatches(fp1, fp1) == [] and tp_mismatches(fp1, {**fp1, "model": "x"})


def test_page_heads_of_head_major_and_token_major_pages() -> None:
    assert heads_of(1, 0).inner == (INNER, INNER) and heads_of(1, 0).head_major
    assert heads_of(2, 1).inner == (INNER, INNER) and heads_of(2, 1).heads == (1,)
    bad = heads_of(1, 0, token_major=True)
    assert not bad.head_major and "not head-major" in bad.why
    maps = region_head_maps(kv(2, token_major=True), BLOCKS, 2)
    assert "region 0" in page_heads_from_maps(maps, 2, 1, 0, 2).why
    assert PageHeads.from_wire(heads_of(2, 1).to_wire()) == heads_of(2, 1)


def regions(heads: int) -> BlockRegions:
    return BlockRegions.from_layout(KVBlockLayout.from_kv_caches(kv(heads), BLOCKS))


def fake_link(their_heads: PageHeads, slots: int = 4, planes: bool = True) -> SimpleNamespace:
    page = INNER * len(their_heads.heads)
    slot_bytes = 2 * page * BPC  # two regions
    plane = BlockRegions((10_000_000, 20_000_000), (page, page), (page, page), slots * BPC, "DRAM", 0)
    return SimpleNamespace(page_heads=their_heads, address="p:1", num_slots=slots, slot_bytes=slot_bytes,
                           slot_planes=plane if planes else None, slab_addr=50_000_000, tags_addr=7,
                           blocks=None, block_tags_addr=0)


def chunk(slot: int) -> PeerChunk:
    return PeerChunk(PeerSource("h", 1, "r", 1), slot)


def test_plan_consumer_tp2_reads_its_heads_sub_run_of_every_producer_page() -> None:
    ours = regions(1)
    for rank in (0, 1):
        link = fake_link(heads_of(1, 0))
        runs = head_runs(2, 2, rank, 1)
        plan = head_plan(ours, heads_of(2, rank), link, runs, [CopySegment(-1, 0, (5, 6))], [chunk(3)],
                         2 * INNER * BPC)
        local, remote = plan.descs([0])
        assert plan.tag_index == [[3]] and plan.tags_addr == 7
        # per region, per page: one descriptor of one head's bytes, at our page start
        assert local[:, 1].tolist() == [INNER] * 4 and remote[:, 1].tolist() == [INNER] * 4
        assert local[:, 0].tolist() == [ours.addrs[r] + b * INNER for r in (0, 1) for b in (5, 6)]
        page = 2 * INNER  # the producer's page: two heads
        assert remote[:, 0].tolist() == [base + (3 * BPC + p) * page + rank * INNER
                                         for base in (10_000_000, 20_000_000) for p in (0, 1)]


def test_plan_consumer_tp1_takes_each_producer_ranks_head_into_its_offset() -> None:
    ours = regions(2)
    for prank in (0, 1):
        link = fake_link(heads_of(2, prank), planes=False)  # layout slots: region-major slots
        runs = [r for r in head_runs(2, 1, 0, 2) if r.producer_rank == prank]
        plan = head_plan(ours, heads_of(1, 0), link, runs, [CopySegment(-1, 1, (4,))], [chunk(2)], 4 * INNER * BPC)
        local, remote = plan.descs([0])
        assert local[:, 0].tolist() == [ours.addrs[r] + 4 * 2 * INNER + prank * INNER for r in (0, 1)]
        slot = 50_000_000 + 2 * link.slot_bytes
        assert remote[:, 0].tolist() == [slot + r * INNER * BPC + 1 * INNER for r in (0, 1)]
        assert local[:, 1].tolist() == remote[:, 1].tolist() == [INNER, INNER]


def test_plan_refuses_token_major_pages_and_other_head_bytes() -> None:
    seg, ch = [CopySegment(-1, 0, (0,))], [chunk(0)]
    runs = head_runs(2, 2, 0, 1)
    with pytest.raises(IncompatibleBlocks, match="not head-major"):
        head_plan(regions(1), heads_of(2, 0), fake_link(heads_of(1, 0, token_major=True)), runs, seg, ch,
                  2 * INNER * BPC)
    other = PageHeads(2, 1, 0, (INNER * 2, INNER * 2))
    with pytest.raises(IncompatibleBlocks, match="one head's bytes"):
        head_plan(regions(1), heads_of(2, 0), fake_link(other), runs, seg, ch, 2 * INNER * BPC)
    with pytest.raises(IncompatibleBlocks, match="describe its KV heads"):
        head_plan(regions(1), heads_of(2, 0), SimpleNamespace(page_heads=None, address="p:1"), runs, seg, ch,
                  2 * INNER * BPC)


def test_wrong_head_hook_reads_another_head(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WRONG_HEAD_ENV, "1")
    assert head_runs(2, 2, 0, 1) == [HeadRun(0, 0, 1, 1)]
    assert head_runs(2, 1, 0, 2) == [HeadRun(0, 1, 0, 1), HeadRun(1, 0, 0, 1)]
