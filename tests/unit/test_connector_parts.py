"""Connector pieces that need vLLM's types but no engine: stats, worker metadata (events: test_kv_events.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tiercache.connector.metadata import TierCacheWorkerMetadata  # noqa: E402
from tiercache.connector.stats import TierCacheStats  # noqa: E402

NS = b"\x01" * 8


def key(i: int) -> bytes:
    return NS + bytes([i]) * 32 + (0).to_bytes(4, "big")


def test_stats_aggregate_and_reduce() -> None:
    a = TierCacheStats.from_counters({"hit_tokens": 10, "load_bytes": 2e9, "load_secs": 1.0})
    b = TierCacheStats.from_counters({"hit_tokens": 5, "load_bytes": 2e9, "load_secs": 1.0})
    merged = a.aggregate(b)
    assert merged.data["hit_tokens"] == 15
    assert merged.reduce()["load_GBps"] == 2.0
    assert not merged.is_empty()
    merged.reset()
    assert merged.is_empty()


def test_worker_metadata_aggregates_over_tp_ranks() -> None:
    rank0, rank1 = TierCacheWorkerMetadata(), TierCacheWorkerMetadata()
    rank0.add(7, (), 100, 0.5)
    rank1.add(7, (key(3),), 100, 0.7)
    rank1.add(8, (), 50, 0.1)
    merged = rank0.aggregate(rank1)
    assert isinstance(merged, TierCacheWorkerMetadata)
    job7 = merged.done[7]
    assert (job7.reports, job7.failed_keys, job7.bytes, job7.secs) == (2, {key(3)}, 200, 0.7)
    assert merged.done[8].reports == 1


def test_worker_metadata_keeps_which_ranks_heard_a_read_and_cleared_blocks() -> None:
    rank0, rank1 = TierCacheWorkerMetadata(), TierCacheWorkerMetadata()
    rank0.pd.handoffs_read["a"] = {0}
    rank1.pd.handoffs_read.update({"a": {1}, "b": {1}})
    rank1.pd.blocks_released["a"] = {1}
    merged = rank0.aggregate(rank1)
    assert isinstance(merged, TierCacheWorkerMetadata)
    assert merged.pd.handoffs_read == {"a": {0, 1}, "b": {1}} and merged.pd.blocks_released == {"a": {1}}


def test_worker_metadata_keeps_every_ranks_peer_transfers() -> None:
    rank0, rank1 = TierCacheWorkerMetadata(), TierCacheWorkerMetadata()
    rank0.pd.transfers.append(("peer_device_to_device", 1000, 0.002))
    rank1.pd.transfers += [("peer_device_to_device", 1000, 0.003), ("peer_host_to_device", 10, 0.001)]
    merged = rank0.aggregate(rank1)
    assert isinstance(merged, TierCacheWorkerMetadata)
    assert sorted(merged.pd.transfers) == [("peer_device_to_device", 1000, 0.002), ("peer_device_to_device", 1000, 0.003),
                                        ("peer_host_to_device", 10, 0.001)]
