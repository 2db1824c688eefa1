"""What each chunk is, block by block, from its request: the payload of its KV events.

A chunk key names a chunk by the engine's hash of its *last* block
(tiercache/keys.py); vLLM's ``BlockStored`` wants every block's hash, the
parent block's hash and the tokens. Those come from the request while it
lives (``request.block_hashes``: the hashes vLLM's own block pool computed
and publishes in its GPU events; ``request.all_token_ids``), so the facade
records them when it plans a store or a staged load for a chunk, and keeps them
while any tier holds the chunk: a chunk evicted from disk an hour after its
request finished still names its blocks in ``BlockRemoved``.

One :class:`ChunkBlocks` per chunk (a few hundred bytes: the block hashes and
the tokens as 32-bit integers), only while KV events are enabled. Scheduler
thread only.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tiercache.keys import STATE_KEY_GROUP, split_key


@dataclass(slots=True)
class ChunkBlocks:
    """One chunk's blocks as vLLM names them, and the tiers that hold it."""

    block_hashes: tuple[bytes, ...]  # the engine's hash of each block, first to last
    parent: bytes | None  # the hash of the block before the chunk; None for the first chunk
    token_ids: array  # the chunk's tokens (int32)
    group_idx: int
    lora_id: int | None = None
    lora_name: str | None = None
    tiers: set[str] = field(default_factory=set)
    pending: bool = True  # a store or staged load was planned; its STORED event has not come yet


class ChunkBlockTable:
    """Chunk key -> :class:`ChunkBlocks`, from the store/load plan until no tier holds the chunk."""

    __slots__ = ("_chunks", "block_size", "blocks_per_chunk")

    def __init__(self, block_size: int, blocks_per_chunk: int) -> None:
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self._chunks: dict[bytes, ChunkBlocks] = {}

    def __len__(self) -> int:
        return len(self._chunks)

    def get(self, key: bytes) -> ChunkBlocks | None:
        return self._chunks.get(key)

    def record(self, request: Any, keys: Iterable[bytes]) -> int:
        """Note what ``keys`` (full chunks of ``request``) are; a STORED event is expected for each.

        Keys that are no full chunk of the request (a P/D prompt tail) are left out, and so are
        state keys (connector/state_chunks.py): their chunk key's events name the same blocks.
        Returns how many keys were recorded.
        """
        keys = list(keys)
        if not keys:
            return 0
        hashes = request.block_hashes
        bpc = self.blocks_per_chunk
        ends = {hashes[end - 1]: end for end in range(bpc, len(hashes) + 1, bpc)}  # chunk's last hash -> end
        recorded = 0
        for key in keys:
            known = self._chunks.get(key)
            if known is not None:
                known.pending = True
                recorded += 1
                continue
            _, last_hash, group = split_key(key)
            end = ends.get(last_hash)
            if end is None or group == STATE_KEY_GROUP:  # a state key: the same blocks as its chunk key's
                continue
            start = end - bpc
            tokens = request.all_token_ids[start * self.block_size : end * self.block_size]
            if len(tokens) < bpc * self.block_size:
                continue
            lora = getattr(request, "lora_request", None)
            self._chunks[key] = ChunkBlocks(
                block_hashes=tuple(hashes[start:end]),
                parent=hashes[start - 1] if start > 0 else None,
                token_ids=array("i", tokens),
                group_idx=group,
                lora_id=lora.adapter_id if lora is not None else None,
                lora_name=lora.name if lora is not None else None,
            )
            recorded += 1
        return recorded

    def stored(self, key: bytes, tier: str) -> ChunkBlocks | None:
        """``key`` entered ``tier``: its blocks, or None when they were never recorded."""
        chunk = self._chunks.get(key)
        if chunk is not None:
            chunk.tiers.add(tier)
            chunk.pending = False
        return chunk

    def removed(self, key: bytes, tier: str) -> ChunkBlocks | None:
        """``key`` left ``tier``: its blocks if it was announced there (forgotten once no tier holds
        it and nothing is pending), else None."""
        chunk = self._chunks.get(key)
        if chunk is None or tier not in chunk.tiers:
            return None  # never announced there (a chunk found on a lower tier at start-up)
        chunk.tiers.discard(tier)
        if not chunk.tiers and not chunk.pending:
            del self._chunks[key]
        return chunk
