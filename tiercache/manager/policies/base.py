"""The eviction-policy contract shared by every policy in this package.

A policy orders the *evictable candidates* of one tier; it never decides
whether a key may be evicted (pins are the manager's business) and it never
touches bytes. The manager calls it from one thread only (the scheduler's).

Life of a key in a policy::

    insert(key)      key became ready in the tier
    access(key)      key was hit or touched
    candidates()     keys in eviction order, best victim first (a snapshot-safe iterator:
                     the manager does not mutate the policy while iterating)
    evicted(key)     the manager evicted key (ARC remembers it as a ghost)
    remove(key)      key left the tier for another reason (deleted, reset)

``insert_many``/``access_many``/``evicted_many`` are the same calls for a batch,
in order; the manager uses them (one call per plan, not per key), policies
override them when a batch can be done cheaper than its keys one by one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator


class EvictionPolicy(ABC):
    """Orders the resident keys of one tier for eviction."""

    name: str = ""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: bytes) -> None: ...

    @abstractmethod
    def access(self, key: bytes) -> None: ...

    @abstractmethod
    def candidates(self) -> Iterator[bytes]: ...

    @abstractmethod
    def evicted(self, key: bytes) -> None: ...

    @abstractmethod
    def remove(self, key: bytes) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: bytes) -> bool: ...

    @abstractmethod
    def clear(self) -> None: ...

    def insert_many(self, keys: Iterable[bytes]) -> None:
        """``insert`` each key, in order."""
        for key in keys:
            self.insert(key)

    def access_many(self, keys: Iterable[bytes]) -> None:
        """``access`` each key, in order."""
        for key in keys:
            self.access(key)

    def evicted_many(self, keys: Iterable[bytes]) -> None:
        """``evicted`` each key, in order."""
        for key in keys:
            self.evicted(key)
