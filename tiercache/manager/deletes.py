"""The keys each owned lower tier's backend must delete, queued until drained once per step.

A chunk that leaves an owned lower tier's directory (evicted to make room,
discarded as unusable, dropped by a reset) must leave its backend too. The
manager's parts only record that here; the connector (or the cache server)
drains :meth:`DeleteQueue.take` once per step and hands the keys to the tier's
I/O. Only owned lower tiers have a queue: the host tier has no backend, and a
shared tier's copies belong to every engine (they are forgotten, never deleted).
Scheduler thread only; nothing here locks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tiercache.manager.directory import TierDirectory


class DeleteQueue:
    """Per owned lower tier: the keys its backend must delete, oldest first."""

    def __init__(self, tiers: Iterable[TierDirectory]) -> None:
        """``tiers``: the lower tiers (the shared ones get no queue)."""
        self._keys: dict[str, list[bytes]] = {t.name: [] for t in tiers if not t.spec.shared}

    def add(self, tier: str, keys: Sequence[bytes]) -> None:
        """Queue ``keys`` for deletion from ``tier``; ignored for a tier with no queue."""
        queue = self._keys.get(tier)
        if queue is not None:
            queue.extend(keys)

    def take(self) -> dict[str, list[bytes]]:
        """Per tier with keys to delete: those keys (drained)."""
        out = {name: keys for name, keys in self._keys.items() if keys}
        for name in out:
            self._keys[name] = []
        return out
