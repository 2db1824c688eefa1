"""A ring of pinned host memory for small uploads (the gather executor's row indices).

Why: ``tensor.pin_memory()`` per job asks torch's caching host allocator for a
fresh block, and a block freed right after its upload is still in use until the
copy stream reaches it; with jobs submitted back to back the allocator calls
``cudaHostAlloc`` again and again (hundreds of microseconds each, measured as
the gather executor's host time). An upload from pageable memory is worse: it
first waits for the whole stream. The ring is pinned once; each upload takes
the next ``n`` entries, and an entry range is written again only after the
event recorded behind its upload was reached (:meth:`PinnedRing.upload` waits
for it on the host, which happens only when the ring wraps onto an upload
still queued: size the ring for a few jobs in flight).

Threading: the worker's main thread (the copier's ``submit``) only.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch


class PinnedRing:
    """``capacity`` int64 entries of pinned memory, handed out in order, reused behind events."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.device = device
        self._host = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        self._view = self._host.numpy()
        self._head = 0
        self._pending: deque[tuple[int, int, torch.cuda.Event]] = deque()  # (start, end, upload done)

    def upload(self, values: np.ndarray) -> torch.Tensor:
        """``values`` (1-D int64) on the device, copied on the current stream without a host wait."""
        n = int(values.size)
        if n > self.capacity:  # larger than the ring: a one-off pinned copy
            return torch.from_numpy(values).pin_memory().to(self.device, non_blocking=True)
        if self._head + n > self.capacity:
            self._head = 0
        start, end = self._head, self._head + n
        self._wait_for(start, end)
        self._view[start:end] = values
        out = self._host[start:end].to(self.device, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._pending.append((start, end, done))
        self._head = end
        return out

    def _wait_for(self, start: int, end: int) -> None:
        """Drop finished uploads; wait for any still-queued upload of entries in ``[start, end)``."""
        keep: deque[tuple[int, int, torch.cuda.Event]] = deque()
        for item in self._pending:
            lo, hi, event = item
            if event.query():
                continue
            if lo < end and start < hi:
                event.synchronize()
                continue
            keep.append(item)
        self._pending = keep
