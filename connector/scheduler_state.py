"""What the scheduler half keeps between steps: per request, and per job until every worker reported it.

Owned by :class:`tiercache.connector.scheduler.TierCacheScheduler`; touched on
vLLM's scheduler thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tiercache.connector.partial_chunks import PartialChunk
    from vllm.v1.request import Request


@dataclass
class RequestState:
    """A request the connector has looked up or stores for."""

    request: Request
    next_store_chunk: int = 0  # chunks below this were offered to the manager already
    lookup_local_tokens: int | None = None  # vLLM's own hit, from get_num_new_matched_tokens
    lookup_hit_tokens: int = 0
    lookup_tokens: int = 0  # asked of tiercache at the last lookup (beyond vLLM's own hit), until allocated
    shared_asked: bool = False  # the shared tiers answered for this request already
    held_since: float | None = None  # first lookup held (busy chunk, staging room: connector/lookup_hold.py)
    holds: int = 0  # lookups held so far (connector/lookup_hold.py)
    tail_stored: bool = False  # P/D producer, via_host: the prompt's tail was offered to the host tier
    partial: PartialChunk | None = None  # the partial chunk ending the last lookup's hit (partial_chunks.py)
    partial_stored: PartialChunk | None = None  # the request's latest partial chunk (stored or loaded)

    def reoffer(self, chunk_keys: list[bytes], failed: set[bytes]) -> None:
        """Chunks whose load failed (of ``chunk_keys``, the request's): offer them for storing again."""
        failed_at = [i for i, key in enumerate(chunk_keys) if key in failed]
        if failed_at:
            self.next_store_chunk = min(self.next_store_chunk, failed_at[0])


@dataclass
class JobRecord:
    """A job of any kind (load, store, demote) until all ``reports_left`` workers reported it."""

    direction: str  # load | store | demote
    owner: str  # the request (load, store), or the lower tier a demotion writes
    keys: tuple[bytes, ...]
    reports_left: int
    failed: set[bytes] = field(default_factory=set)
