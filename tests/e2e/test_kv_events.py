"""tiercache's KV events through vLLM's own publisher, read by a ZMQ subscriber as a router reads them.

One engine (tiny random-weight Llama, 32-token blocks, 64-token chunks) with
``kv_events_config`` (ZMQ publisher on loopback) and tiercache: a host tier of
4 chunks in front of a write-through disk tier. The subscriber
(tiercache.testing.kv_events_subscriber) decodes the batches with its own
msgspec types, as vLLM's example subscriber does.

Rounds (the first once the subscriber and the publisher are connected):
eight 2-chunk prompts one at a time (16 chunks through a 4-chunk host tier:
evictions; a store that finds every slot pinned by copies to disk still in
flight is refused, so which prompts reach the host tier depends on timing),
then the first prompt again after ``reset_prefix_cache()`` (a disk hit,
promoted back into the host tier), then one more prompt (its steps publish
what the round before left pending).

Checked on the stream: every batch decodes, no sequence number is missed;
each chunk's ``BlockStored`` names its 2 blocks with the hashes vLLM's own GPU
events gave the same blocks, the chunk before as parent, the prompt's token
ids and ``block_size`` 32; CPU before DISK for every chunk; removals only of
blocks the medium holds; the promotion after the eviction; and a router's
index built from tiercache's events alone finds the first prompt on DISK by
its token ids, and stops at the first changed block (the negative control).
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from tiercache.testing.engine_runner import EngineRun, random_prompts
from tiercache.testing.kv_events_subscriber import (
    BlockRemoved,
    BlockStored,
    EventSubscriber,
    PrefixIndex,
)

from .conftest import engine_spec, free_port

BLOCK, CHUNK = 32, 64
HOST_CHUNKS = 4
PROMPTS = random_prompts(8, 2 * CHUNK + 22, seed=31)  # 2 whole chunks each: 16 through 4 host slots
LAST = random_prompts(1, CHUNK + 10, seed=32)


def rounds() -> list[dict[str, Any]]:
    return [
        {"prompts": PROMPTS, "max_tokens": 2, "sequential": True, "barrier": "subscribed"},
        {"prompts": PROMPTS[:1], "max_tokens": 2, "reset_prefix_cache_before": True},
        {"prompts": LAST, "max_tokens": 2},
    ]


@pytest.fixture(scope="module")
def stream(tiny_model: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[EventSubscriber, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("kv-events")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    disk = {"name": "disk", "backend": "disk", "capacity": "256MiB", "mode": "write_through",
            "options": {"root": str(tmp / "disk-tier")}}
    spec = engine_spec(tiny_model, CHUNK, [disk], rounds(), kv_extra={"host_capacity": HOST_CHUNKS * CHUNK * 4096},
                       kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                         "endpoint": endpoint, "topic": "kv-events"})
    sub = EventSubscriber(endpoint, "kv-events", bind=True)  # vLLM's PUB connects to a loopback address
    run = EngineRun(spec, tmp / "engine")
    try:
        run.wait_for("subscribed", timeout_s=400)  # vLLM's publisher is up by now
        sub.wait_connected()
        run.release("subscribed")
        result = run.result(timeout_s=500)
    finally:
        run.kill()
        sub.stop()
    return sub, result


def ours(sub: EventSubscriber) -> list[BlockStored | BlockRemoved]:
    """tiercache's events (every medium but vLLM's own GPU), in publishing order."""
    return [e for e in sub.events() if isinstance(e, (BlockStored, BlockRemoved)) and e.medium != "GPU"]


def chunk_stores(events: list[Any], medium: str, tokens: list[int]) -> list[tuple[int, BlockStored]]:
    """(position, event) of every ``medium`` BlockStored whose token ids are ``tokens``."""
    return [(i, e) for i, e in enumerate(events)
            if isinstance(e, BlockStored) and e.medium == medium and e.token_ids == tokens]


def test_every_batch_decodes_in_sequence(stream: tuple[EventSubscriber, dict[str, Any]]) -> None:
    sub, _ = stream
    assert not sub.errors
    assert sub.sequence_numbers() == list(range(len(sub.batches))) and sub.batches
    assert {e.medium for e in ours(sub)} == {"CPU", "DISK"}


def test_each_chunk_is_stored_block_by_block_with_its_parent_and_tokens(
        stream: tuple[EventSubscriber, dict[str, Any]]) -> None:
    sub, _ = stream
    events = ours(sub)
    chunks = {tuple(p[c * CHUNK : (c + 1) * CHUNK]): (i, c) for i, p in enumerate(PROMPTS + LAST) for c in range(2)}
    announced: dict[tuple[int, int], BlockStored] = {}
    for event in events:
        if isinstance(event, BlockStored):
            assert tuple(event.token_ids) in chunks, "token ids that are no chunk of any prompt"
            assert len(event.block_hashes) == CHUNK // BLOCK and event.block_size == BLOCK and event.group_idx == 0
            announced.setdefault(chunks[tuple(event.token_ids)], event)
    assert (0, 0) in announced and (0, 1) in announced  # the first prompt found the host tier empty
    assert len(announced) >= len(PROMPTS)
    for (i, c), event in announced.items():
        if c == 0:
            assert event.parent_block_hash is None
        elif (i, 0) in announced:
            assert event.parent_block_hash == announced[(i, 0)].block_hashes[-1]


def test_block_hashes_are_the_ones_vllm_announced_for_the_same_blocks(
        stream: tuple[EventSubscriber, dict[str, Any]]) -> None:
    sub, _ = stream
    engine_index = PrefixIndex()  # what a router learnt from vLLM's own (GPU) events
    engine_index.apply(e for e in sub.events() if isinstance(e, BlockStored) and e.medium == "GPU")
    assert engine_index.by_tokens, "vLLM published no GPU BlockStored"
    stored = [e for e in ours(sub) if isinstance(e, BlockStored)]
    assert stored
    for event in stored:
        parent = event.parent_block_hash
        for i, h in enumerate(event.block_hashes):
            tokens = tuple(event.token_ids[i * BLOCK : (i + 1) * BLOCK])
            assert engine_index.by_tokens.get((parent, tokens)) == h
            parent = h


def test_stores_removals_and_moves_come_in_order(stream: tuple[EventSubscriber, dict[str, Any]]) -> None:
    sub, _ = stream
    events = ours(sub)
    held: dict[str, set[Any]] = {"CPU": set(), "DISK": set()}
    removed_from_cpu = 0
    for event in events:
        blocks = set(event.block_hashes)
        if isinstance(event, BlockStored):
            if event.medium == "DISK":  # a lower-tier copy comes from the host tier's
                assert blocks <= held["CPU"] and event.ownership == "disk"
            held[event.medium] |= blocks
        else:
            assert blocks <= held[event.medium], "a removal of blocks the medium was never said to hold"
            held[event.medium] -= blocks
            removed_from_cpu += len(blocks) * (event.medium == "CPU")
    assert removed_from_cpu >= 2 * (CHUNK // BLOCK)  # evictions (how many: see the module docstring)
    first_chunk = PROMPTS[0][:CHUNK]
    (cpu_at, cpu), (disk_at, _) = chunk_stores(events, "CPU", first_chunk)[0], chunk_stores(events, "DISK", first_chunk)[0]
    assert cpu_at < disk_at
    gone_at = next(i for i, e in enumerate(events) if isinstance(e, BlockRemoved) and e.medium == "CPU"
                   and set(cpu.block_hashes) <= set(e.block_hashes))
    promoted = [i for i, _ in chunk_stores(events, "CPU", first_chunk) if i > gone_at]
    assert promoted, "the disk hit of round 2 was not announced back in CPU"


def test_a_router_finds_the_prompt_on_disk_by_its_tokens_and_not_a_changed_one(
        stream: tuple[EventSubscriber, dict[str, Any]]) -> None:
    sub, result = stream
    assert result["rounds"][1]["requests"][0]["num_cached_tokens"] >= 2 * CHUNK - 1  # it was a hit
    router = PrefixIndex()
    router.apply(ours(sub))
    prompt = PROMPTS[0]
    assert router.match(prompt, BLOCK, "DISK") == 4
    changed = list(prompt)
    changed[2 * BLOCK + 5] += 1  # the third block's tokens differ: its hash chain does not exist
    assert router.match(changed, BLOCK, "DISK") == 2
    assert router.match([prompt[0] + 1, *prompt[1:]], BLOCK, "DISK") == 0
