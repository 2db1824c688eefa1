"""Thread-safe event counters for backends: bumped by I/O threads, read by the owner."""

from __future__ import annotations

import threading
from collections.abc import Iterable


class Counters:
    """A fixed set of named integer counters behind one lock."""

    def __init__(self, names: Iterable[str]) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(names, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)
