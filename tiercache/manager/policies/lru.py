"""Least-recently-used eviction: one insertion-ordered dict, oldest first."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tiercache.manager.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # Plain dicts keep insertion order; re-inserting moves a key to the end.
        self._order: dict[bytes, None] = {}

    def insert(self, key: bytes) -> None:
        order = self._order
        order.pop(key, None)
        order[key] = None

    def access(self, key: bytes) -> None:
        order = self._order
        if order.pop(key, 0) is None:
            order[key] = None

    def candidates(self) -> Iterator[bytes]:
        return iter(self._order)

    def evicted(self, key: bytes) -> None:
        del self._order[key]

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def insert_many(self, keys: Iterable[bytes]) -> None:
        order = self._order
        pop = order.pop
        for key in keys:
            pop(key, None)
            order[key] = None

    def access_many(self, keys: Iterable[bytes]) -> None:
        order = self._order
        pop = order.pop
        for key in keys:
            if pop(key, 0) is None:
                order[key] = None

    def evicted_many(self, keys: Iterable[bytes]) -> None:
        order = self._order
        for key in keys:
            del order[key]

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: bytes) -> bool:
        return key in self._order

    def clear(self) -> None:
        self._order.clear()
