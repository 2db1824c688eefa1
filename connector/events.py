"""Translate tiercache's ChunkEvents into vLLM's KV events (BlockStored / BlockRemoved).

One event per chunk key; the block hash is the engine's chained prefix hash of
the chunk's last block, and ``medium`` names the tier, so a KV-aware router
can tell host-tier hits from device hits.
"""

from __future__ import annotations

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from tiercache.events import ChunkEvent, EventKind


def to_vllm_events(events: list[ChunkEvent], chunk_tokens: int) -> list[KVCacheEvent]:
    out: list[KVCacheEvent] = []
    for event in events:
        hashes = [maybe_convert_block_hash(h) for h in event.prefix_hashes()]
        if event.kind == EventKind.STORED:
            out.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=chunk_tokens,
                    lora_id=None,
                    medium=event.tier,
                    lora_name=None,
                )
            )
        else:
            out.append(BlockRemoved(block_hashes=hashes, medium=event.tier))
    return out
