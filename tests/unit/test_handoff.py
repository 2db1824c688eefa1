"""P/D building blocks without engines: hand-off params, the fingerprint check, holds, the peer tier."""

from __future__ import annotations

import pytest

from tiercache.pd.handoff import Handoff, HandoffError, mismatches
from tiercache.manager.offloading import OffloadingManager, TierSpec

FP = {"model": "m", "kv_dtype": "torch.float32", "chunk_tokens": 32, "block_size": 16}  # 2 blocks a chunk


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
    assert m.holds.hold_host_prefix([key(1), key(2), key(3)]) == [key(1), key(2)]  # a prefix: stops at the first missing
    storing_slots = m.host.slots_of([key(1), key(2)])
    assert storing_slots == list(plan.slots)  # the slots the hand-off params will name
    m.complete_store([key(1), key(2)])
    assert m.host.slots_of([key(1), key(2)]) == storing_slots  # stable while held
    assert m.prepare_store([key(3)]) is None  # both slots held: nothing evictable
    m.holds.release([key(1), key(2)])  # released (read or expired)
    assert m.prepare_store([key(3)]) is not None


def test_peer_tier_is_read_only_and_forgotten_after_the_load() -> None:
    m = OffloadingManager([TierSpec("cpu", 4), TierSpec("peer", 8, mode="read_only", shared=True)])
    m.cascade.learn("peer", [key(1), key(2)])
    assert m.lookup([key(1), key(2)]) == 2
    plan = m.prepare_load([key(1), key(2)])
    assert plan.tiers == ("peer", "peer") and all(plan.staged)
    m.complete_load(plan.keys)
    m.cascade.forget("peer", list(plan.keys))
    assert m.state_of(key(1), "peer") is None
    m.prepare_store([key(9)])
    m.complete_store([key(9)])
    assert m.cascade.prepare_demotions() == []  # nothing is ever copied down into a producer


def test_direct_params_name_each_chunks_blocks() -> None:
    h = Handoff("eng", "127.0.0.1", 5700, "req-2", (key(1), key(2)), (4, 5, 9, 10), FP, mode="direct")
    params = h.to_params()
    assert params["tiercache"]["mode"] == "direct" and params["remote_block_ids"] == [4, 5, 9, 10]
    back = Handoff.from_params(params)
    assert back == h and back.blocks_of(2) == [(4, 5), (9, 10)]
    params["remote_block_ids"] = [4, 5, 9]  # not the same number of blocks per key
    with pytest.raises(HandoffError, match="remote_block_ids"):
        Handoff.from_params(params)
    params = h.to_params()
    params["tiercache"]["mode"] = "teleport"
    with pytest.raises(HandoffError, match="tiercache.mode"):
        Handoff.from_params(params)


@pytest.mark.parametrize("mode", ["via_host", "direct"])
def test_a_prompt_tail_travels_last_with_its_slot_or_fewer_blocks(mode: str) -> None:
    """The tail key is the last key; via_host: one slot; direct: the blocks its tokens span (5 tokens: 1 of 2)."""
    slots = (7, 3) if mode == "via_host" else (4, 5, 9)
    h = Handoff("eng", "127.0.0.1", 5700, "req-3", (key(1), key(2)), slots, FP, mode=mode, tail_tokens=5)
    params = h.to_params()
    assert params["tiercache"]["tail_tokens"] == 5
    back = Handoff.from_params(params)
    assert back == h and back.full_keys == (key(1),) and back.tail_key == key(2)
    if mode == "direct":
        assert back.blocks_of(2) == [(4, 5), (9,)]
        params["remote_block_ids"] = [4, 5, 9, 10]  # a 5-token tail spans one 16-token block, not two
        with pytest.raises(HandoffError, match="remote_block_ids"):
            Handoff.from_params(params)
    for bad in (32, -1):  # a tail is less than a chunk
        params = h.to_params()
        params["tiercache"]["tail_tokens"] = bad
        with pytest.raises(HandoffError, match="tail_tokens"):
            Handoff.from_params(params)
    no_tail = Handoff("eng", "127.0.0.1", 5700, "req-4", (key(1),), slots[:1 if mode == "via_host" else 2], FP,
                      mode=mode)
    assert no_tail.full_keys == (key(1),) and no_tail.tail_key is None


# ------------------------------------------------------------- producer, mode direct
def direct_producer(error_handling: str = "none", tp_size: int = 1):  # type: ignore[no-untyped-def]
    """A mode-direct producer's scheduler half on a real vLLM block pool of 32 blocks."""
    pytest.importorskip("vllm")
    from vllm.v1.core.block_pool import BlockPool

    from tiercache.config.schema import PDConfig
    from tiercache.connector.block_pins import VllmBlockPins
    from tiercache.connector.pd.scheduler_role import PDScheduler
    from tiercache.keys import KeySpace, Namespace

    ns = Namespace("m", "torch.float32", "NHD", 32, 64, 1, 4096, "sha256")
    settings = PDConfig(mode="direct", handoff_timeout_s=5, nixl_error_handling=error_handling)  # type: ignore[arg-type]
    pd = PDScheduler(settings, "kv_producer", KeySpace(ns, 2), OffloadingManager([TierSpec("cpu", 4)]),
                     chunk_tokens=64, engine_id="e", tp_size=tp_size, blocks_per_chunk=2)
    pd.bind_pins(VllmBlockPins(BlockPool(32, enable_caching=True, hash_block_size=32)))
    return pd


def allocate(pd, n: int = 5) -> list[int]:  # type: ignore[no-untyped-def]
    """vLLM gives a request ``n`` blocks."""
    return [b.block_id for b in pd.pins.pool.get_new_blocks(n)]


def vllm_frees(pd, block_ids: list[int]) -> None:  # type: ignore[no-untyped-def]
    """What vLLM does with a finished request's blocks when request_finished did not delay it."""
    pd.pins.unpin(block_ids)


def prompt_request(rid: str, capped: bool = True):  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    status = RequestStatus.FINISHED_LENGTH_CAPPED if capped else RequestStatus.FINISHED_STOPPED
    return SimpleNamespace(request_id=rid, kv_transfer_params={"do_remote_decode": True}, num_prompt_tokens=140,
                           block_hashes=[bytes([i]) * 32 for i in range(4)], status=status)


def handed_off(pd, rid: str) -> int:  # type: ignore[no-untyped-def]
    """A request prefilled, marked at its prefill step, finished and freed by vLLM: a hand-off of its
    four full blocks (pinned). The pool's free blocks from before the request got its five."""
    pool = pd.pins.pool
    req = prompt_request(rid)
    blocks = allocate(pd)
    free_before = pool.get_num_free_blocks()
    pd.mark_prefill(req, (blocks,))
    pd.take_direct()
    pd.request_finished(req, (blocks,))  # type: ignore[arg-type]
    vllm_frees(pd, blocks)
    return free_before


def test_direct_producer_marks_at_the_prefill_step_and_pins_the_blocks() -> None:
    pd = direct_producer()
    pool = pd.pins.pool
    req = prompt_request("r1")
    blocks = allocate(pd)
    free_before = pool.get_num_free_blocks()
    pd.mark_prefill(req, (blocks,))  # the step completing the 140-token prompt
    marks, unmarks, released = pd.take_direct()
    assert list(marks) == ["r1"] and marks["r1"].blocks == (tuple(blocks[:2]), tuple(blocks[2:4]))
    assert not unmarks and not released
    assert not pd.has_pending()  # delivered: an idle producer may stop stepping
    delay, params = pd.request_finished(req, (blocks,))  # type: ignore[arg-type]
    # vLLM frees the request at once (no delayed free: the engine need not keep stepping) ...
    assert delay is False and params is not None and params["remote_block_ids"] == blocks[:4]
    vllm_frees(pd, blocks)
    # ... and the hand-off's four blocks stay allocated (our pin), the fifth is free again
    assert pool.get_num_free_blocks() == free_before + 1
    assert [pd.pins.refs(b) for b in blocks] == [1, 1, 1, 1, 0]
    assert pd.take_direct() == ({}, [], [])  # marked already: nothing more for the worker
    assert pd.held_chunks == 2 and pd.pinned_blocks == 4
    pd.expire(now=1e12)  # nobody read it
    assert pd.take_direct() == ({}, [], ["r1"]) and pd.counters["handoffs_expired"] == 1
    assert pd.pinned_blocks == 4  # until the worker says the tags are cleared
    pd.blocks_released({"r1": {0}})
    assert pd.pinned_blocks == 0 and pool.get_num_free_blocks() == free_before + 5
    pd.blocks_released({"r1": {0}})  # a repeated report changes nothing
    assert pool.get_num_free_blocks() == free_before + 5


def test_direct_producer_unpins_only_when_every_tp_rank_cleared_its_tags() -> None:
    pd = direct_producer(tp_size=2)
    pool = pd.pins.pool
    free_before = handed_off(pd, "r5")
    pd.handoffs_read({"r5": {0}})  # rank 0's consumer read it; rank 0 cleared its tags
    pd.blocks_released({"r5": {0}})
    assert pd.counters["handoffs_read"] == 0 and pd.held_chunks == 2 and pd.pinned_blocks == 4
    pd.expire(now=1e12)  # rank 1 never heard (its consumer failed): expired, told to clear them anyway
    assert pd.take_direct() == ({}, [], ["r5"]) and pd.counters["handoffs_expired"] == 1
    assert pd.held_chunks == 0
    pd.expire(now=1e12)
    assert pd.take_direct() == ({}, [], [])  # told once
    pd.blocks_released({"r5": {0, 1}})  # the aggregated report of the step after
    assert pd.pinned_blocks == 0 and pool.get_num_free_blocks() == free_before + 5


def test_direct_producer_with_two_tp_ranks_reads_and_unpins_once_both_read() -> None:
    pd = direct_producer(tp_size=2)
    pool = pd.pins.pool
    free_before = handed_off(pd, "r7")
    pd.handoffs_read({"r7": {1}})
    pd.blocks_released({"r7": {1}})
    assert pd.counters["handoffs_read"] == 0 and pd.held_chunks == 2 and pd.pinned_blocks == 4
    pd.handoffs_read({"r7": {0, 1}})  # a repeated rank counts once
    pd.blocks_released({"r7": {0}})
    assert pd.counters["handoffs_read"] == 1 and pd.held_chunks == 0 and pd.pinned_blocks == 0
    assert pool.get_num_free_blocks() == free_before + 5
    pd.expire(now=1e12)
    assert pd.take_direct() == ({}, [], []) and pd.counters["handoffs_expired"] == 0


def test_via_host_hold_with_two_tp_ranks_ends_when_both_ranks_read() -> None:
    """Each consumer rank READs its own shard of the slots: none may be reused before both have."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    from tiercache.config.schema import PDConfig
    from tiercache.connector.pd.scheduler_role import PDScheduler
    from tiercache.keys import KeySpace, Namespace

    ns = Namespace("m", "torch.float32", "NHD", 32, 32, 2, 4096, "sha256")
    keys = KeySpace(ns, 1)
    manager = OffloadingManager([TierSpec("cpu", 4)])
    pd = PDScheduler(PDConfig(handoff_timeout_s=5), "kv_producer", keys, manager, chunk_tokens=32,
                     engine_id="e", tp_size=2)
    hashes = [bytes([i]) * 32 for i in range(4)]
    stored = keys.chunk_keys(hashes)
    assert manager.prepare_store(stored) is not None
    manager.complete_store(stored)
    req = SimpleNamespace(request_id="h1", kv_transfer_params={"do_remote_decode": True}, num_prompt_tokens=140,
                          block_hashes=hashes, status=RequestStatus.FINISHED_LENGTH_CAPPED)
    _, params = pd.request_finished(req)  # type: ignore[arg-type]
    assert params is not None and params["tp_size"] == 2 and pd.held_chunks == 4
    assert manager.prepare_store(keys.chunk_keys([b"x" * 32])) is None  # all four slots held
    pd.handoffs_read({"h1": {0}})
    assert pd.held_chunks == 4 and pd.counters["handoffs_read"] == 0  # rank 1 may still be reading
    pd.handoffs_read({"h1": {1}})
    assert pd.held_chunks == 0 and pd.counters["handoffs_read"] == 1
    assert manager.prepare_store(keys.chunk_keys([b"x" * 32])) is not None  # evictable again


def test_direct_producer_without_vllms_block_pool_is_a_clear_error() -> None:
    pd = direct_producer()
    pd.pins = None
    with pytest.raises(RuntimeError, match="bind_kv_cache_manager"):
        pd.request_finished(prompt_request("r6"), (list(range(1, 6)),))  # type: ignore[arg-type]


def test_direct_producer_clears_marks_when_no_hand_off_follows() -> None:
    pd = direct_producer()
    stopped = prompt_request("r2", capped=False)
    pd.mark_prefill(stopped, ([1, 2, 3, 4],))
    pd.take_direct()
    assert pd.request_finished(stopped, ([1, 2, 3, 4],))[0] is False  # type: ignore[arg-type]
    assert pd.take_direct() == ({}, ["r2"], [])  # stopped on its own: vLLM frees, tags cleared
    preempted = prompt_request("r3")
    pd.mark_prefill(preempted, ([5, 6, 7, 8],))
    pd.take_direct()
    pd.preempted("r3")
    assert pd.take_direct() == ({}, ["r3"], [])
    assert pd.has_pending() is False


def test_direct_producer_marks_late_when_the_prefill_step_was_missed() -> None:
    pd = direct_producer("peer")
    req = prompt_request("r4")
    blocks = allocate(pd, 4)
    delay, _ = pd.request_finished(req, (blocks,))  # type: ignore[arg-type]
    assert delay is False and pd.has_pending()  # a step must deliver the marks
    marks, _, _ = pd.take_direct()
    assert marks["r4"].blocks == (tuple(blocks[:2]), tuple(blocks[2:]))
    assert pd.has_pending()  # tcp (peer): keeps stepping while anything is held
    pd.handoffs_read({"r4": {0}})
    pd.blocks_released({"r4": {0}})  # the worker cleared the tags itself on the read
    assert not pd.has_pending() and pd.counters["handoffs_read"] == 1
    assert pd.take_direct() == ({}, [], []) and pd.pinned_blocks == 0
