"""tiercache's chunk events as vLLM's KV events (BlockStored / BlockRemoved), block by block.

The manager logs which chunks entered or left which tier (tiercache/events.py);
vLLM publishes what the connector's ``take_events()`` returns with its own KV
events (``--kv-events-config``: ZMQ, the engine's topic and sequence numbers),
next to the block pool's GPU events. A KV-aware router matches blocks by the
hashes vLLM computed for them, so each event here carries what vLLM's own
events carry for the same blocks:

* ``BlockStored`` per chunk: every block's hash (``request.block_hashes``,
  as the GPU events), the hash of the block before the chunk as
  ``parent_block_hash`` (None for the first chunk), the chunk's token ids, the
  engine's ``block_size``, the KV-cache group, and the tier's ``medium``;
* ``BlockRemoved`` per chunk event: the blocks of every chunk that left the tier.

``medium`` names the tier's kind as vLLM does ("CPU" for the host tier, and
"DISK", "LMDB", "REDIS", "SERVER", a plugin's name in capitals, "PEER" for a
P/D consumer's producers); a lower tier's own name goes in ``ownership``, so
two disk tiers stay apart. Events keep the manager's order: a chunk is stored
in CPU before it is copied to DISK, removed from CPU when evicted, and so on.

What each chunk is comes from its request (connector/event_blocks.py): a chunk
whose request was never seen (one found on a lower tier at start-up, a P/D
prompt tail) has no event. With KV events off nothing is recorded and the log
is only drained.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tiercache.connector.event_blocks import ChunkBlocks, ChunkBlockTable
from tiercache.connector.metadata import TierCacheConnectorMetadata
from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from tiercache.config.schema import TierCacheConfig
from tiercache.events import ChunkEvent, EventKind
from tiercache.jobs import FromTier
from tiercache.pd.peer_tier import PEER_TIER

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

# a tier's backend -> vLLM's medium; any other backend plugin: its name in capitals
BACKEND_MEDIA = {"cpu": MEDIUM_CPU, "disk": "DISK", "lmdb": "LMDB", "redis": "REDIS", "server": "SERVER"}
PEER_MEDIUM = "PEER"


def tier_media(config: TierCacheConfig) -> dict[str, str]:
    """Tier name -> the ``medium`` its events carry."""
    media = {t.name: BACKEND_MEDIA.get(t.backend, t.backend.upper()) for t in config.tiers}
    media.setdefault(PEER_TIER, PEER_MEDIUM)
    return media


def kv_events_enabled(vllm_config: VllmConfig) -> bool:
    """True when vLLM publishes KV events (``--kv-events-config`` with enable_kv_cache_events)."""
    events_config = getattr(vllm_config, "kv_events_config", None)
    return bool(events_config is not None and events_config.enable_kv_cache_events)


class KVEvents:
    """The scheduler-side facade's KV events: requests seen, chunks recorded, vLLM events out."""

    def __init__(self, enabled: bool, media: dict[str, str], host_tier: str,
                 block_size: int = 1, blocks_per_chunk: int = 1) -> None:
        self.enabled = enabled
        self.media = media
        self.host_tier = host_tier
        self.table = ChunkBlockTable(block_size, blocks_per_chunk)
        self._requests: dict[str, Any] = {}  # request id -> the live Request, while enabled

    @classmethod
    def off(cls) -> KVEvents:
        return cls(False, {}, "")

    @classmethod
    def for_engine(cls, vllm_config: VllmConfig, config: TierCacheConfig,
                   block_size: int, blocks_per_chunk: int) -> KVEvents:
        return cls(kv_events_enabled(vllm_config), tier_media(config), config.host_tier.name,
                   block_size, blocks_per_chunk)

    # ------------------------------------------------------- what chunks are
    def saw(self, request: Any) -> None:
        """A request vLLM schedules: its blocks name the chunks planned for it."""
        if self.enabled:
            self._requests[request.request_id] = request

    def finished(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def planned(self, meta: Any) -> None:
        """Record the chunks a step's stores and staged loads bring into the host tier.

        Never raises: events are a side channel and must not cost a step its stores.
        """
        if not self.enabled or not isinstance(meta, TierCacheConnectorMetadata):
            return
        try:
            for job in meta.stores:
                self._record(job.req_id, job.keys)
            for load in meta.loads:  # a chunk staged from a lower tier becomes READY in the host tier
                self._record(load.req_id, [c.key for c in load.chunks if isinstance(c.source, FromTier)])
        except Exception:
            logger.exception("tiercache: recording KV event payloads failed; those chunks have no events")

    def _record(self, req_id: str, keys: Iterable[bytes]) -> None:
        request = self._requests.get(req_id)
        if request is not None:
            self.table.record(request, keys)

    # ------------------------------------------------------------ vLLM events
    def translate(self, events: list[ChunkEvent]) -> list[KVCacheEvent]:
        """vLLM's events for the manager's ``events``, in their order (none while disabled)."""
        if not self.enabled:
            return []
        out: list[KVCacheEvent] = []
        for event in events:
            medium = self.media.get(event.tier, event.tier.upper())
            ownership = None if event.tier == self.host_tier else event.tier
            if event.kind is EventKind.STORED:
                for key in event.keys:
                    chunk = self.table.stored(key, event.tier)
                    if chunk is not None:
                        out.append(stored_event(chunk, medium, ownership))
                continue
            by_group: dict[int, list[Any]] = {}
            for key in event.keys:
                chunk = self.table.removed(key, event.tier)
                if chunk is not None:
                    by_group.setdefault(chunk.group_idx, []).extend(
                        maybe_convert_block_hash(h) for h in chunk.block_hashes)
            for group, hashes in by_group.items():
                out.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group, ownership=ownership))
        return out


def stored_event(chunk: ChunkBlocks, medium: str, ownership: str | None) -> BlockStored:
    """One chunk's ``BlockStored``, shaped as vLLM's own (several blocks in one event)."""
    return BlockStored(
        block_hashes=[maybe_convert_block_hash(h) for h in chunk.block_hashes],
        parent_block_hash=None if chunk.parent is None else maybe_convert_block_hash(chunk.parent),
        token_ids=chunk.token_ids.tolist(),
        block_size=len(chunk.token_ids) // len(chunk.block_hashes),
        lora_id=chunk.lora_id,
        medium=medium,
        lora_name=chunk.lora_name,
        group_idx=chunk.group_idx,
        ownership=ownership,
    )
