"""The housekeeping lane: a backend's deletes, run by a thread of their own, off the forward path.

A lower tier's deletes (evictions, discarded chunks, resets) used to run on
the worker thread, between two forward passes: a stopped cache server made
each of them wait for its timeout. :class:`DeleteLane` runs them on one
thread per backend from a bounded queue; the worker thread only queues.

Ordering and exclusion (see :class:`tiercache.tiers.tier_io.TierIO`):

* every batch gets a sequence number; a demotion submitted after a delete
  waits until the lane has done that batch (``caught_up``), so the backend's
  own budget check has the room the manager counted on;
* the lane holds the tier's lock while it calls ``delete``; the worker thread
  only ever *tries* that lock (a backend sees one call at a time, as the
  Backend contract promises, and the worker thread never waits for a delete).

A full queue drops the batch (counted: fault ``delete_dropped``): the chunks
stay on the medium until the backend's own budget or TTL evicts them, or a
restart's ``recover`` finds them over budget. An exception from ``delete`` is
counted (``backend_exception``) and the lane goes on.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

from tiercache import faults
from tiercache.backend import Backend

MAX_QUEUED_KEYS = 1 << 16


class DeleteLane:
    """One backend's delete thread and its bounded queue."""

    def __init__(self, tier: str, backend: Backend, lock: threading.Lock,
                 max_keys: int = MAX_QUEUED_KEYS) -> None:
        self.tier = tier
        self.backend = backend
        self.lock = lock
        self.max_keys = max_keys
        self.queued_seq = 0  # the last batch accepted (owner thread)
        self.done_seq = 0  # the last batch done (lane thread)
        self._queue: deque[tuple[int, list[bytes]]] = deque()
        self._queued_keys = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name=f"tiercache-delete-{tier}", daemon=True)
        self._thread.start()

    def push(self, keys: Sequence[bytes]) -> bool:
        """Queue a delete of ``keys``; False (counted) when the queue is full or the lane closed."""
        with self._cond:
            if self._stopping or self._queued_keys + len(keys) > self.max_keys:
                dropped = True
            else:
                dropped = False
                self.queued_seq += 1
                self._queue.append((self.queued_seq, list(keys)))
                self._queued_keys += len(keys)
                self._cond.notify()
        if dropped:
            faults.record(faults.DELETE_DROPPED, f"{len(keys)} deletes dropped: the queue of tier "
                          f"{self.tier} is full (is its backend stalled?)", where=self.tier, count=len(keys))
        return not dropped

    def caught_up(self, seq: int) -> bool:
        """Whether every batch up to ``seq`` is done."""
        return self.done_seq >= seq

    @property
    def idle(self) -> bool:
        return self.done_seq >= self.queued_seq

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every queued batch is done (tests, shutdown); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self.done_seq >= self.queued_seq, timeout=timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Run what is queued (for up to ``timeout_s``), then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                seq, keys = self._queue.popleft()
                self._queued_keys -= len(keys)
            try:
                with self.lock:
                    self.backend.delete(keys)
            except Exception as exc:  # noqa: BLE001 - the lane outlives any backend error
                faults.record(faults.BACKEND_EXCEPTION, exc, where=f"{self.tier}.delete")
            with self._cond:
                self.done_seq = seq
                self._cond.notify_all()
