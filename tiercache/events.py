"""Stored/removed events for KV-aware routers.

The manager appends an event whenever chunks become ready in a tier or leave
it; the connector drains them (``take_events``) and translates them into the
engine's own event types (vLLM's BlockStored / BlockRemoved). Events carry the
engine's prefix hashes, not our namespaced keys, so a router can match them to
the engine's own block hashes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tiercache.keys import split_key


class EventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class ChunkEvent:
    """Chunks that entered (STORED) or left (REMOVED) one tier."""

    kind: EventKind
    tier: str
    keys: tuple[bytes, ...]

    def prefix_hashes(self) -> list[bytes]:
        """The engine prefix hashes inside the keys (what a router matches on)."""
        return [split_key(k)[1] for k in self.keys]
