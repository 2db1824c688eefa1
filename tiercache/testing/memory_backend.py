"""MemoryBackend: a keyed in-memory backend over a host slab, for the conformance kit and tests.

Each key takes one row (slot) of a :class:`~tiercache.transfer.host_slab.HostSlab`
through its own key -> slot map; a put of a new key fails once every slot is taken
(no eviction), a put of a held key overwrites its slot in place. Volatile and
unframed: nothing survives :meth:`MemoryBackend.close`, and nothing is verified on
load. It is not a plugin (no ``(settings, context)`` constructor, no registry
name): tests build it directly, and ``contains`` answers from the map, so it also
serves as a fast stand-in for a shared tier.

Threading: every job runs to completion on the calling thread; results are queued
under a lock, so :meth:`MemoryBackend.poll` may run on another thread. The slab's
memory belongs to the caller's :class:`HostSlab`; this object only writes the rows
it maps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from tiercache.backend import Backend, JobResult
from tiercache.transfer.host_slab import HostSlab


class MemoryBackend(Backend):
    """Keyed put/get/contains/delete over the rows of ``slab``."""

    name = "memory"

    def __init__(self, slab: HostSlab) -> None:
        self.host_slab = slab
        self.slot_bytes = slab.slot_bytes
        self._slab_bytes = slab.slab.numpy()  # the same memory, for the keyed copies
        self._key_slots: dict[bytes, int] = {}
        self._free = list(range(slab.num_slots - 1, -1, -1))
        self._results: list[JobResult] = []
        self._lock = threading.Lock()

    # Copies go through numpy: it reads read-only buffers (bytes) without
    # complaint, refuses to write into them, and copies on this thread only.
    def submit_put(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        start = time.perf_counter()
        ok: list[bytes] = []
        failed: list[bytes] = []
        moved = 0
        for key, view in zip(keys, views):
            src = _bytes_of(view)
            slot = self._key_slots.get(key)
            if src is None or src.size > self.slot_bytes or (slot is None and not self._free):
                failed.append(key)
                continue
            if slot is None:
                slot = self._key_slots[key] = self._free.pop()
            self._slab_bytes[slot, : src.size] = src
            moved += src.size
            ok.append(key)
        self._push(JobResult(job_id, tuple(ok), tuple(failed), moved, time.perf_counter() - start))

    def submit_get(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        start = time.perf_counter()
        ok: list[bytes] = []
        failed: list[bytes] = []
        moved = 0
        for key, view in zip(keys, views):
            slot = self._key_slots.get(key)
            dst = _bytes_of(view)
            if slot is None or dst is None or not dst.flags.writeable or dst.size > self.slot_bytes:
                failed.append(key)
                continue
            dst[...] = self._slab_bytes[slot, : dst.size]
            moved += dst.size
            ok.append(key)
        self._push(JobResult(job_id, tuple(ok), tuple(failed), moved, time.perf_counter() - start))

    def _push(self, result: JobResult) -> None:
        with self._lock:
            self._results.append(result)

    def poll(self) -> list[JobResult]:
        with self._lock:
            results, self._results = self._results, []
        return results

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self._key_slots for k in keys]

    def delete(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            slot = self._key_slots.pop(key, None)
            if slot is not None:
                self._free.append(slot)

    def close(self) -> None:
        self._key_slots.clear()
        self._results.clear()


def _bytes_of(view: memoryview) -> np.ndarray | None:
    """The bytes of ``view`` as a flat uint8 array over the same memory; None if not contiguous."""
    try:
        return np.frombuffer(view, dtype=np.uint8)
    except (ValueError, TypeError, BufferError):
        return None
