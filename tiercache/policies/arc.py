"""Adaptive Replacement Cache (Megiddo and Modha, FAST 2003), adapted to a tier.

T1 holds keys seen once, T2 keys seen again; B1 and B2 remember recently
evicted keys of each (ghosts, keys only). A store of a key found in B1 means
"recency was undervalued" and grows T1's target ``p``; one found in B2 shrinks
it. Candidates come from T1 while it is above its target, else from T2.
Since the tier, not the policy, decides when to evict, a hit in a ghost list is
observed at ``insert`` (the key is being stored again after its eviction).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from tiercache.policies.base import EvictionPolicy


class ARCPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._t1: dict[bytes, None] = {}
        self._t2: dict[bytes, None] = {}
        self._b1: dict[bytes, None] = {}
        self._b2: dict[bytes, None] = {}
        self.target_t1 = 0.0  # ARC's p

    def insert(self, key: bytes) -> None:
        if key in self._t1 or key in self._t2:
            self.access(key)
            return
        if key in self._b1:
            delta = max(len(self._b2) / max(len(self._b1), 1), 1.0)
            self.target_t1 = min(float(self.capacity), self.target_t1 + delta)
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            delta = max(len(self._b1) / max(len(self._b2), 1), 1.0)
            self.target_t1 = max(0.0, self.target_t1 - delta)
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None

    def access(self, key: bytes) -> None:
        if self._t1.pop(key, 0) is None:
            self._t2[key] = None
        elif self._t2.pop(key, 0) is None:
            self._t2[key] = None

    def candidates(self) -> Iterator[bytes]:
        if self._t1 and len(self._t1) > self.target_t1:
            return itertools.chain(self._t1, self._t2)
        return itertools.chain(self._t2, self._t1)

    def evicted(self, key: bytes) -> None:
        if self._t1.pop(key, 0) is None:
            self._b1[key] = None
        else:
            del self._t2[key]
            self._b2[key] = None
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        # Ghost lists together never remember more keys than the tier holds.
        cap = self.capacity
        while len(self._b1) + len(self._b2) > cap:
            victim_list = self._b1 if len(self._b1) >= len(self._b2) else self._b2
            del victim_list[next(iter(victim_list))]

    def remove(self, key: bytes) -> None:
        if self._t1.pop(key, 0) is not None:
            self._t2.pop(key, None)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: bytes) -> bool:
        return key in self._t1 or key in self._t2

    def clear(self) -> None:
        self._t1.clear()
        self._t2.clear()
        self._b1.clear()
        self._b2.clear()
        self.target_t1 = 0.0
