"""Adaptive Replacement Cache (Megiddo and Modha, FAST 2003), adapted to a tier.

T1 holds keys seen once, T2 keys seen again; B1 and B2 remember recently
evicted keys of each (ghosts, keys only). A store of a key found in B1 means
"recency was undervalued" and grows T1's target ``p``; one found in B2 shrinks
it. Candidates come from T1 while it is above its target, else from T2; for a
batch eviction, T1's size is counted down as its keys are taken, so a batch
never drains T1 below ``p`` while T2 has keys (ARC's REPLACE, once per victim).
Ghost lists together hold at most ``capacity`` keys.
Since the tier, not the policy, decides when to evict, a hit in a ghost list is
observed at ``insert`` (the key is being stored again after its eviction).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator

from tiercache.manager.policies.base import EvictionPolicy


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
        if self._t1.pop(key, 0) is None or self._t2.pop(key, 0) is None:
            self._t2[key] = None

    def candidates(self) -> Iterator[bytes]:
        # ARC's REPLACE, applied to a whole batch: take T1's oldest keys only
        # while T1 stays above its target p, then T2, then the rest of T1.
        t1, t2 = self._t1, self._t2
        excess = len(t1) - self.target_t1
        if excess <= 0:
            return itertools.chain(t2, t1)
        if not t2:
            return iter(t1)
        head = math.ceil(excess)
        return itertools.chain(
            itertools.islice(t1, head), t2, itertools.islice(t1, head, None)
        )

    def evicted(self, key: bytes) -> None:
        self.evicted_many((key,))

    def insert_many(self, keys: Iterable[bytes]) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        for key in keys:
            if key in b1 or key in b2 or key in t1 or key in t2:
                self.insert(key)  # a ghost hit or a resident key: the full rule
            else:
                t1[key] = None

    def access_many(self, keys: Iterable[bytes]) -> None:
        t1, t2 = self._t1, self._t2
        t1_pop, t2_pop = t1.pop, t2.pop
        for key in keys:
            if t1_pop(key, 0) is None or t2_pop(key, 0) is None:
                t2[key] = None

    def evicted_many(self, keys: Iterable[bytes]) -> None:
        t1_pop, t2 = self._t1.pop, self._t2
        b1, b2 = self._b1, self._b2
        for key in keys:
            if t1_pop(key, 0) is None:
                b1[key] = None
            else:
                del t2[key]
                b2[key] = None
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        # Ghost lists together never remember more keys than the tier holds.
        # Forget the oldest ghosts of the longer list first (B1 on a tie), i.e.
        # shorten the longer list down to the other, then both alternately.
        b1, b2 = self._b1, self._b2
        n1, n2, cap = len(b1), len(b2), self.capacity
        excess = n1 + n2 - cap
        if excess <= 0:
            return
        if n1 - excess >= n2:
            drop1 = excess
        elif n2 - excess >= n1:
            drop1 = 0
        else:
            drop1 = n1 - cap // 2
        for ghosts, count in ((b1, drop1), (b2, excess - drop1)):
            if count:
                for key in list(itertools.islice(ghosts, count)):
                    del ghosts[key]

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
