"""P/D of a state-layer model (connector/pd/state_handoff.py), without engines.

A hand-off ends at a chunk's end state: the chunk keys before it and that
chunk's state key, flagged ``ends_with_state`` in the params; no prompt tail.
The via_host producer names what its host tier holds; the consumer takes the
state key only when it is the state key of its own chunk there (a peer's key
is never trusted); mode direct pins the state block vLLM offered (vLLM frees it
a step later) until the hand-off's own pins hold it. The real engines' check is
tests/e2e/test_pd_state_models.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tiercache.connector.kv_groups import FULL, STATE, KVGroup
from tiercache.connector.pd.state_handoff import (
    NO_BLOCK,
    OfferedStates,
    state_handoff_keys,
    state_key_blocks,
    via_host_state_keys,
)
from tiercache.pd.handoff import Handoff, HandoffError

BLOCK = 32
GROUPS = (KVGroup(STATE), KVGroup(FULL))  # LFM2's order: the conv layers' group first
NULL = 0
PROMPT = 190  # 5 whole chunks of one block and a 30-token tail; vLLM's first step ends at 160


def keys(n: int) -> list[bytes]:
    return [bytes([i]) * 8 for i in range(n)]


def state_of(key: bytes) -> bytes:
    return b"s" + key


def handed(chunks_held: int, states: set[int], prompt: int = PROMPT) -> int:
    """How many chunks a via_host hand-off spans when the host tier holds the first ``chunks_held``
    chunk keys and the state keys of chunks ``states`` (READY or STORING)."""
    ks = keys(5)
    host = SimpleNamespace(ready=set(ks[:chunks_held]) | {state_of(ks[c]) for c in states}, storing=set())
    held = via_host_state_keys(ks, prompt, BLOCK, host, state_of)  # type: ignore[arg-type]
    assert held == (state_handoff_keys(ks, len(held), state_of) if held else [])
    return len(held)


def test_a_hand_off_spans_up_to_a_state_before_the_prompts_last_token() -> None:
    assert handed(5, {1, 4}) == 5  # chunk 4's state, 160 < 190
    assert handed(5, {1, 4}, prompt=160) == 2  # 160 tokens: the hit stops before 159
    assert handed(4, {1, 4}) == 5  # chunk 4's own key is not needed
    assert handed(3, {1, 4}) == 2  # chunk 3 missing: back to chunk 1's state
    assert handed(5, set()) == 0
    assert state_handoff_keys(keys(5), 2, state_of) == [keys(5)[0], state_of(keys(5)[1])]


def test_direct_keys_name_the_attention_blocks_and_the_offered_state_in_the_last_key_only() -> None:
    tables = ([NULL, NULL, 50, NULL], [1, 2, 3, 4])  # the state table: stale or null, never trusted
    held = state_key_blocks(tables, 3, 1, (0,), {0: 77}, NULL)
    assert held == [(NO_BLOCK, 1), (NO_BLOCK, 2), (77, 3)]


def test_params_carry_ends_with_state_and_refuse_it_with_a_tail_or_without_keys() -> None:
    handoff = Handoff(engine_id="e", host="127.0.0.1", port=5000, request_id="r", keys=(b"a" * 8, b"b" * 8),
                      slots=(1, 2), fingerprint={"chunk_tokens": BLOCK, "block_size": BLOCK},
                      ends_with_state=True)
    back = Handoff.from_params(handoff.to_params())
    assert back is not None and back.full_keys == (b"a" * 8,) and back.state_key == b"b" * 8
    params = handoff.to_params()
    for bad in ({"ends_with_state": "yes"}, {"ends_with_state": True, "tail_tokens": 5}):
        with pytest.raises(HandoffError, match="ends_with_state"):
            Handoff.from_params({**params, "tiercache": {**params["tiercache"], **bad}})
    with pytest.raises(HandoffError, match="ends_with_state"):
        Handoff.from_params({**params, "remote_block_ids": [], "tiercache": {**params["tiercache"], "chunk_keys": []}})


# ------------------------------------------------------------------ through the scheduler
pytest.importorskip("vllm")


def scheduler(kv_role: str, mode: str = "via_host", pool: Any = None, tables: Any = None):  # type: ignore[no-untyped-def]
    from tiercache.config.schema import load_config
    from tiercache.connector.engine_info import ChunkGeometry, EngineGeometry
    from tiercache.connector.scheduler import TierCacheScheduler

    config = load_config(chunk_tokens=BLOCK, tiers=[{"name": "cpu", "backend": "cpu", "capacity": "4MiB"}],
                         pd={"mode": mode})
    engine = EngineGeometry(model="m", kv_dtype="torch.float32", kv_layout="NHD", block_size=BLOCK, tp_size=1,
                            world_size=1, bytes_per_block=4096, hash_algo="sha256", kv_groups=GROUPS)
    sched = TierCacheScheduler(config, ChunkGeometry.build(config, engine), kv_role=kv_role)
    ids = tables or ([NULL] * 4 + [50, NULL], [1, 2, 3, 4, 5, 6])
    sched.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda rid: ids, block_pool=pool))
    return sched


def request(rid: str, params: dict[str, Any] | None, tokens: int = PROMPT) -> SimpleNamespace:
    from vllm.v1.request import RequestStatus

    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(tokens)), num_prompt_tokens=tokens,
                           num_tokens=tokens, num_computed_tokens=0, kv_transfer_params=params,
                           block_hashes=[bytes([i]) * 32 for i in range(tokens // BLOCK)],
                           status=RequestStatus.FINISHED_LENGTH_CAPPED)


def step(sched, req: SimpleNamespace, scheduled: int, offered: list[tuple[int, int, int]]):  # type: ignore[no-untyped-def]
    meta = sched.build_connector_meta(SimpleNamespace(
        num_scheduled_tokens={req.request_id: scheduled}, finished_req_ids=set(), preempted_req_ids=None,
        kv_connector_block_state=SimpleNamespace(boundary_state_offloads={req.request_id: offered})))
    req.num_computed_tokens += scheduled
    return meta


def finish_stores(sched, meta) -> None:  # type: ignore[no-untyped-def]
    """Every worker copied the step's stores: the manager holds them, their store pins go."""
    from tiercache.connector.metadata import JobReport, TierCacheWorkerMetadata

    done = {job.job_id: JobReport(reports=1, failed_keys=set(), bytes=0, secs=0.0) for job in meta.stores}
    sched.update_connector_output(TierCacheWorkerMetadata(done=done))


def produce(sched, req: SimpleNamespace) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The producer prefills ``req`` in vLLM's two steps (to its last block boundary, then the rest)."""
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([], [])), 0)
    for meta in (step(sched, req, 160, [(0, 50, 160)]), step(sched, req, PROMPT - 160, [])):
        finish_stores(sched, meta)
    _, params = sched.request_finished(req, sched._kv_cache_manager.get_block_ids(req.request_id))
    assert params is not None
    return params


def test_via_host_producer_hands_off_the_chunks_and_the_state_key_no_tail() -> None:
    sched = scheduler("kv_producer")
    req = request("p", {"do_remote_decode": True})
    handoff = Handoff.from_params(produce(sched, req))
    chunk_keys = sched.keys.chunk_keys(req.block_hashes)
    assert handoff is not None and handoff.ends_with_state and handoff.tail_tokens == 0
    assert handoff.keys == (*chunk_keys[:4], sched.keys.state_key(chunk_keys[4]))
    assert handoff.slots == tuple(sched.manager.host.slots_of(list(handoff.keys)))
    assert sched.pd.held_chunks == 5


def consume(params: dict[str, Any]) -> tuple[Any, tuple[int | None, bool], Any]:
    sched = scheduler("kv_consumer", tables=([NULL] * 4 + [60, NULL], [11, 12, 13, 14, 15, 16]))
    req = request("c", params)
    hit = sched.get_num_new_matched_tokens(req, 0)
    if hit[0]:
        sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: sched._kv_cache_manager
                                                            .get_block_ids("c")), hit[0])
    return sched, hit, step(sched, req, PROMPT - (hit[0] or 0), [])


def test_consumer_resumes_from_the_handed_off_state() -> None:
    params = produce(scheduler("kv_producer"), request("p", {"do_remote_decode": True}))
    _, hit, meta = consume(params)
    assert hit == (160, True)
    (load,) = meta.loads
    assert load.keys == Handoff.from_params(params).keys  # type: ignore[union-attr]
    assert set(load.reader_sources()) == set(load.keys)  # every chunk from the producer
    assert 60 in load.block_ids()  # the state lands in the block vLLM allocated at the hit's end


def test_control_a_state_key_that_is_not_this_prompts_is_refused() -> None:
    params = produce(scheduler("kv_producer"), request("p", {"do_remote_decode": True}))
    ours = params["tiercache"]
    wrong = [*ours["chunk_keys"][:-1], ours["chunk_keys"][-2][:-8] + b"STAT".hex()]  # chunk 3's state key
    sched, hit, meta = consume({**params, "tiercache": {**ours, "chunk_keys": wrong}})
    assert hit == (0, False) and not meta.loads and sched.pd.counters["handoffs_refused"] == 1


def test_direct_producer_pins_the_offered_state_until_its_hand_off_holds_it() -> None:
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(64, enable_caching=True, hash_block_size=BLOCK)
    attention = [b.block_id for b in pool.get_new_blocks(6)]
    (state,) = [b.block_id for b in pool.get_new_blocks(1)]
    sched = scheduler("kv_producer", mode="direct", pool=pool, tables=([NULL] * 6, attention))
    req = request("d", {"do_remote_decode": True})
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([], [])), 0)
    finish_stores(sched, step(sched, req, 160, [(0, state, 160)]))
    pool.free_blocks([pool.blocks[state]])  # vLLM moves on and frees the state block: our pin keeps it
    assert sched.pd.pins.refs(state) == 1
    meta = step(sched, req, PROMPT - 160, [])  # completes the prompt: the worker marks its blocks after it
    finish_stores(sched, meta)
    assert meta.pd.direct_holds["d"].blocks[-1] == (state, attention[4])
    _, params = sched.request_finished(req, ([NULL] * 6, attention))
    handoff = Handoff.from_params(params or {})
    assert handoff is not None and handoff.ends_with_state
    assert handoff.blocks_of(2) == [(NO_BLOCK, b) for b in attention[:4]] + [(state, attention[4])]
    assert sched.pd.pins.refs(state) == 1  # the hold's pin replaced the offer's
    sched.pd.blocks_released({"d": {0}})
    assert sched.pd.pins.refs(state) == 0


def test_offered_states_keep_only_the_latest_usable_one_pinned() -> None:
    pinned: list[int] = []
    pins = SimpleNamespace(pin=pinned.extend, unpin=lambda ids: [pinned.remove(b) for b in ids])
    offered = OfferedStates(pins, BLOCK)  # type: ignore[arg-type]
    prompt = {"r": PROMPT, "other": None}.get
    offered.offered({"r": {1: {0: 7}}, "other": {1: {0: 9}}}, prompt)  # "other" is not handed off
    offered.offered({"r": {4: {0: 8}, 5: {0: 10}}}, prompt)  # 192 tokens: past the prompt's last token
    assert pinned == [8] and offered.get("r") is not None and offered.get("r").chunk == 4  # type: ignore[union-attr]
    offered.drop("r")
    assert pinned == [] and len(offered) == 0
