"""Pins: who may not evict what. Every pin in every tier is taken and released here, one for one.

A pin keeps a chunk's slot from being evicted or handed out again while
something reads it: a load in flight (``OffloadingManager.prepare_load`` until
``complete_load``), a P/D hand-off (:meth:`Holds.hold_host_prefix` until the
consumer read it or it expired), a host copy queued for or being copied down
into a lower tier (the cascade, until the demotion completes or is given up).
The counts live in each :class:`TierDirectory`'s ``pins`` (eviction reads
them there); this part is the only one that changes them.

Contract: whoever holds a key releases it exactly once, with :meth:`release`
(or :meth:`release_at` when it knows the tier). A key a holder pins is pinned
in one tier only (a load reads every copy of a key from one tier), so a release
by key alone finds the right count. Releasing a key nothing holds is ignored.
Scheduler thread only; nothing here locks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tiercache.manager.directory import TierDirectory


class Holds:
    """The pin counts of every tier, host first; hold and release are paired."""

    def __init__(self, tiers: Sequence[TierDirectory]) -> None:
        self._tiers = list(tiers)
        self._host = self._tiers[0]

    def hold(self, tier: TierDirectory, keys: Iterable[bytes]) -> None:
        """One more pin on each of ``keys`` in ``tier`` (a key listed twice is pinned twice)."""
        pins = tier.pins
        get = pins.get
        for key in keys:
            pins[key] = get(key, 0) + 1

    def hold_host_prefix(self, keys: Sequence[bytes]) -> list[bytes]:
        """Pin the leading ``keys`` the host tier holds (READY or STORING) for a P/D hand-off.

        Stops at the first key the host tier lacks (a hand-off is a prefix) and
        returns the held ones. Their host slots stay put until :meth:`release`
        (the hand-off's params name them: ``TierDirectory.slots_of``).
        """
        host = self._host
        ready, storing = host.ready, host.storing
        held: list[bytes] = []
        for key in keys:
            if key not in ready and key not in storing:
                break
            held.append(key)
        self.hold(host, held)
        return held

    def release(self, keys: Sequence[bytes]) -> None:
        """Give back one pin on each key, in the first tier (host first) that pins it.

        When a key's last pin goes, the slots it kept after a discard (its
        ``doomed`` slots) are free again.
        """
        for tier in self._tiers:
            if tier.pins:
                keys = self._release_in(tier, keys)
                if not keys:
                    return

    def release_at(self, tier: TierDirectory, keys: Sequence[bytes]) -> None:
        """Give back one pin on each of ``keys`` in ``tier`` (a staged load's source tier)."""
        self._release_in(tier, keys)

    @staticmethod
    def _release_in(tier: TierDirectory, keys: Sequence[bytes]) -> list[bytes]:
        """One pin off each of ``keys`` that ``tier`` pins; return the keys it does not pin."""
        pins = tier.pins
        rest: list[bytes] = []
        for key in keys:
            count = pins.get(key)
            if count is None:
                rest.append(key)
            elif count == 1:
                del pins[key]
                held = tier.doomed.pop(key, None)
                if held is not None:
                    tier.free_slots.extend(held)
            else:
                pins[key] = count - 1
        return rest
