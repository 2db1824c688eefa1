"""Stored/removed events for KV-aware routers.

The manager's parts add an event to one shared :class:`EventLog` whenever chunks
become ready in a tier or leave it; the connector drains it (``manager.events.take()``)
and translates the events into the engine's own event types (vLLM's BlockStored /
BlockRemoved, block by block: connector/events.py adds what each chunk's blocks are,
recorded from its request). The keys hold the engine's prefix hashes; the connector
publishes the engine's own block hashes, so a router matches them to vLLM's events.
Scheduler thread only (like the manager): nothing here locks.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
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


class EventLog:
    """The events of one manager, oldest first, kept until drained with :meth:`take`."""

    __slots__ = ("_events",)

    def __init__(self) -> None:
        self._events: list[ChunkEvent] = []

    def add(self, kind: EventKind, tier: str, keys: Sequence[bytes]) -> None:
        """Record that ``keys`` entered (STORED) or left (REMOVED) ``tier``; no keys, no event."""
        if keys:
            self._events.append(ChunkEvent(kind, tier, tuple(keys)))

    def take(self) -> list[ChunkEvent]:
        """Every event recorded since the last take, oldest first."""
        events, self._events = self._events, []
        return events
