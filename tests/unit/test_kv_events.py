"""KV events in vLLM's format, from a real scheduler half and real vLLM requests (no engine).

Requests are vLLM's own ``Request`` with vLLM's sha256 block hasher, so the
hashes in the events are the ones vLLM computes; the scheduler half plans
stores and demotions as in an engine, and the test completes them as the
workers would. The engine-level check (vLLM's publisher, a ZMQ subscriber)
is tests/e2e/test_kv_events.py.
"""

from __future__ import annotations

import pathlib
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from tiercache.connector.engine_info import ChunkGeometry, EngineGeometry  # noqa: E402
from tiercache.connector.events import KVEvents, tier_media  # noqa: E402
from tiercache.connector.scheduler import TierCacheScheduler  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request  # noqa: E402

from tiercache.config.schema import load_config  # noqa: E402
from tiercache.events import ChunkEvent, EventKind  # noqa: E402

BLOCK, CHUNK = 32, 64  # two blocks per chunk
BLOCK_BYTES = 4096
HOST_CHUNKS = 4


def make(tmp: pathlib.Path) -> tuple[TierCacheScheduler, KVEvents]:
    host = HOST_CHUNKS * (CHUNK // BLOCK) * BLOCK_BYTES
    config = load_config(chunk_tokens=CHUNK, tiers=[
        {"name": "cpu", "backend": "cpu", "capacity": host},
        {"name": "ssd", "backend": "disk", "capacity": "1MiB", "mode": "write_through", "options": {"root": str(tmp)}},
    ])
    engine = EngineGeometry(model="m", kv_dtype="torch.float32", kv_layout="NHD", block_size=BLOCK, tp_size=1,
                            world_size=1, bytes_per_block=BLOCK_BYTES, hash_algo="sha256")
    sched = TierCacheScheduler(config, ChunkGeometry.build(config, engine))
    sched.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda rid: (list(range(1, 65)),)))  # type: ignore[arg-type]
    return sched, KVEvents(True, tier_media(config), "cpu", BLOCK, CHUNK // BLOCK)


def request(rid: str, tokens: list[int]) -> Request:
    init_none_hash(sha256)
    return Request(rid, tokens, SamplingParams(max_tokens=1), None, block_hasher=get_request_block_hasher(BLOCK, sha256))


def hashes(req: Request, start: int, end: int) -> list[Any]:
    """vLLM's hashes of blocks ``start .. end - 1`` as its events carry them (64-bit ints by default)."""
    return [maybe_convert_block_hash(h) for h in req.block_hashes[start:end]]


def prefill(sched: TierCacheScheduler, events: KVEvents, req: Request) -> None:
    """What the facade and vLLM do for a new request's prefill, and the workers' store reports."""
    events.saw(req)
    sched.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([],)), 0)  # type: ignore[arg-type]
    meta = step(sched, events, {req.request_id: req.num_tokens})
    for job in meta.stores:
        sched.manager.complete_store(list(job.keys))
    events.finished(req.request_id)  # the request may end before its events are taken


def step(sched: TierCacheScheduler, events: KVEvents, scheduled: dict[str, int]) -> Any:
    out = SimpleNamespace(num_scheduled_tokens=scheduled, finished_req_ids=set(), preempted_req_ids=None)
    meta = sched.build_connector_meta(out)  # type: ignore[arg-type]
    events.planned(meta)
    return meta


def demote(sched: TierCacheScheduler, events: KVEvents) -> None:
    meta = step(sched, events, {})
    for job in meta.demotes:
        sched.manager.cascade.complete_demotion(job.tier, job.keys)


def test_stored_events_name_every_block_with_its_parent_tokens_and_medium(tmp_path: pathlib.Path) -> None:
    sched, events = make(tmp_path)
    prompt = list(range(1000, 1000 + 3 * CHUNK + 10))  # three whole chunks and a partial one
    req = request("a", prompt)
    prefill(sched, events, req)
    demote(sched, events)
    out = events.translate(sched.take_events())
    assert [type(e) for e in out] == [BlockStored] * 6
    assert [e.medium for e in out] == ["CPU"] * 3 + ["DISK"] * 3
    assert [e.ownership for e in out] == [None] * 3 + ["ssd"] * 3  # a lower tier's own name
    for i, event in enumerate(out[:3]):
        assert event.block_hashes == hashes(req, 2 * i, 2 * i + 2)  # vLLM's own hashes, per block
        assert event.parent_block_hash == (hashes(req, 2 * i - 1, 2 * i)[0] if i else None)
        assert event.token_ids == prompt[i * CHUNK : (i + 1) * CHUNK]
        assert event.block_size == BLOCK and event.group_idx == 0
        assert out[i + 3].block_hashes == event.block_hashes and out[i + 3].token_ids == event.token_ids


def test_evictions_remove_the_same_blocks_and_events_keep_the_managers_order(tmp_path: pathlib.Path) -> None:
    sched, events = make(tmp_path)
    first = request("a", list(range(1000, 1000 + 3 * CHUNK)))
    prefill(sched, events, first)
    demote(sched, events)
    events.translate(sched.take_events())
    second = request("b", list(range(5000, 5000 + 3 * CHUNK)))  # 3 more chunks: 2 of a's leave the host tier
    prefill(sched, events, second)
    out = events.translate(sched.take_events())
    assert [type(e).__name__ for e in out] == ["BlockRemoved", "BlockStored", "BlockStored", "BlockStored"]
    removed = out[0]
    assert isinstance(removed, BlockRemoved) and removed.medium == "CPU"
    # a's two last chunks, each chunk's blocks in order (the policy evicts a prefix from its tail)
    assert removed.block_hashes == hashes(first, 4, 6) + hashes(first, 2, 4)
    assert [e.block_hashes for e in out[1:]] == [hashes(second, i, i + 2) for i in (0, 2, 4)]
    # still on disk: a later eviction there names them, then nothing is left to name
    sched.manager.discard(sched.keys.chunk_keys(first.block_hashes))
    out = events.translate(sched.take_events())
    assert [(type(e).__name__, e.medium) for e in out] == [("BlockRemoved", "CPU"), ("BlockRemoved", "DISK")]
    assert out[0].block_hashes == hashes(first, 0, 2) and out[1].block_hashes == hashes(first, 0, 6)
    assert all(events.table.get(k) is None for k in sched.keys.chunk_keys(first.block_hashes))


def test_a_chunk_never_recorded_or_never_announced_has_no_event(tmp_path: pathlib.Path) -> None:
    sched, events = make(tmp_path)
    req = request("a", list(range(1000, 1000 + CHUNK)))
    (key,) = sched.keys.chunk_keys(req.block_hashes)
    assert events.translate([ChunkEvent(EventKind.STORED, "cpu", (key,))]) == []  # request never seen
    events.saw(req)
    events.table.record(req, [key])
    assert events.translate([ChunkEvent(EventKind.REMOVED, "ssd", (key,))]) == []  # never stored there
    (stored,) = events.translate([ChunkEvent(EventKind.STORED, "cpu", (key,))])
    assert stored.token_ids == req.all_token_ids[:CHUNK]


def test_a_state_key_has_no_event_of_its_own(tmp_path: pathlib.Path) -> None:
    """A state-layer model's state key (connector/state_chunks.py) holds its chunk key's blocks: their
    events are the chunk key's; a KV-cache group index "STAT" must never reach vLLM's events."""
    sched, events = make(tmp_path)
    req = request("a", list(range(2000, 2000 + CHUNK)))
    (key,) = sched.keys.chunk_keys(req.block_hashes)
    events.saw(req)
    assert events.table.record(req, [sched.keys.state_key(key)]) == 0
    assert events.translate([ChunkEvent(EventKind.STORED, "cpu", (sched.keys.state_key(key),))]) == []
    assert events.table.record(req, [key]) == 1


def test_with_events_off_nothing_is_recorded_and_the_log_is_drained(tmp_path: pathlib.Path) -> None:
    sched, on = make(tmp_path)
    off = KVEvents(False, on.media, "cpu", BLOCK, CHUNK // BLOCK)
    prefill(sched, off, request("a", list(range(1000, 1000 + 2 * CHUNK))))
    assert off.translate(sched.take_events()) == [] and len(off.table) == 0 and sched.take_events() == []


def test_media_follow_the_backends() -> None:
    config = load_config(tiers=[{"name": "host", "backend": "cpu", "capacity": "1MiB"},
                                {"name": "r", "backend": "redis", "capacity": "1MiB", "options": {"url": "redis://x"}}])
    assert tier_media(config) == {"host": "CPU", "r": "REDIS", "peer": "PEER"}
