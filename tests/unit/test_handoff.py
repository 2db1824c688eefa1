"""P/D building blocks without engines: hand-off params, the fingerprint check, holds, the peer tier."""

from __future__ import annotations

import pytest

from tiercache.handoff import Handoff, HandoffError, mismatches
from tiercache.manager import OffloadingManager, TierSpec

FP = {"model": "m", "kv_dtype": "torch.float32", "chunk_tokens": 32}


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_params_round_trip_in_nixl_connector_shape() -> None:
    h = Handoff("eng", "127.0.0.1", 5700, "req-1", (key(1), key(2)), (7, 3), FP)
    params = h.to_params()
    assert params["remote_block_ids"] == [7, 3]  # the producer's host slots
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert {"remote_engine_id", "remote_host", "remote_port", "remote_block_ids", "remote_request_id"} <= set(params)
    assert Handoff.from_params(params) == h


def test_other_connectors_params_are_not_ours_and_malformed_ones_are_named() -> None:
    assert Handoff.from_params({"do_remote_decode": True}) is None
    assert Handoff.from_params({"do_remote_prefill": True, "remote_block_ids": [1]}) is None
    bad = Handoff("e", "h", 1, "r", (key(1),), (0,), FP).to_params()
    bad["remote_port"] = 70000
    with pytest.raises(HandoffError, match="remote_port"):
        Handoff.from_params(bad)
    bad = Handoff("e", "h", 1, "r", (key(1),), (0,), FP).to_params()
    bad["tiercache"]["chunk_keys"] = ["zz"]
    with pytest.raises(HandoffError, match="malformed"):
        Handoff.from_params(bad)
    bad = Handoff("e", "h", 1, "r", (key(1),), (0,), FP).to_params()
    bad["remote_block_ids"] = [0, 1]  # one slot per chunk key
    with pytest.raises(HandoffError, match="remote_block_ids"):
        Handoff.from_params(bad)


def test_mismatches_name_every_differing_field() -> None:
    assert mismatches(FP, dict(FP)) == []
    diff = mismatches(FP, {**FP, "kv_dtype": "torch.bfloat16", "chunk_tokens": 64})
    assert diff == ["chunk_tokens: ours 32, peer 64", "kv_dtype: ours 'torch.float32', peer 'torch.bfloat16'"]


def test_held_chunks_survive_eviction_until_released() -> None:
    m = OffloadingManager([TierSpec("cpu", 2)])
    plan = m.prepare_store([key(1), key(2)])
    assert plan is not None
    assert m.hold([key(1), key(2), key(3)]) == [key(1), key(2)]  # a prefix: stops at the first missing
    storing_slots = m.host_slots([key(1), key(2)])
    assert storing_slots == list(plan.slots)  # the slots the hand-off params will name
    m.complete_store([key(1), key(2)])
    assert m.host_slots([key(1), key(2)]) == storing_slots  # stable while held
    assert m.prepare_store([key(3)]) is None  # both slots held: nothing evictable
    m.complete_load([key(1), key(2)])  # released (read or expired)
    assert m.prepare_store([key(3)]) is not None


def test_peer_tier_is_read_only_and_forgotten_after_the_load() -> None:
    m = OffloadingManager([TierSpec("cpu", 4), TierSpec("peer", 8, mode="read_only", shared=True)])
    m.learn("peer", [key(1), key(2)])
    assert m.lookup([key(1), key(2)]) == 2
    plan = m.prepare_load([key(1), key(2)])
    assert plan.tiers == ("peer", "peer") and all(plan.staged)
    m.complete_load(plan.keys)
    m.forget("peer", list(plan.keys))
    assert m.state_of(key(1), "peer") is None
    m.prepare_store([key(9)])
    m.complete_store([key(9)])
    assert m.prepare_demotions() == []  # nothing is ever copied down into a producer
