"""Host slots <-> lower-tier backends, on the worker side.

Owns the lower tiers' :class:`~tiercache.backend.Backend` objects (disk, LMDB,
plugins) and hands them memoryviews of host-tier slots: reads for staged
loads (lower tier -> host slot), writes for demotions (host slot -> lower
tier), deletes for evictions. The views point into the host slab, owned by the
TransferEngine; a backend drops them when it reports the job.

Threading: worker main thread only (backends run their own I/O threads).
A backend that raises is logged and its job reported failed; it never raises
into vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from tiercache.backend import Backend, JobResult

logger = logging.getLogger(__name__)


class TierIO:
    def __init__(self, backends: dict[str, Backend], slab: torch.Tensor) -> None:
        self.backends = backends
        # A numpy view shares the slab's memory; memoryviews of its rows are what backends get.
        self._rows: np.ndarray = slab.numpy()
        self._failed_now: list[tuple[str, JobResult]] = []

    def _views(self, slots: Sequence[int]) -> list[memoryview]:
        rows = self._rows
        return [memoryview(rows[s]) for s in slots]

    def get(self, job_id: int, tier: str, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Read ``keys`` from ``tier`` into host slots ``slots``."""
        self._submit("get", job_id, tier, keys, slots)

    def put(self, job_id: int, tier: str, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Write host slots ``slots`` into ``tier`` under ``keys``."""
        self._submit("put", job_id, tier, keys, slots)

    def _submit(self, op: str, job_id: int, tier: str, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        backend = self.backends.get(tier)
        try:
            if backend is None:
                raise KeyError(f"no backend for tier {tier!r}")
            submit = backend.submit_get if op == "get" else backend.submit_put
            submit(job_id, list(keys), self._views(slots))
        except Exception:
            logger.exception("tiercache: %s job %d on tier %s failed to start", op, job_id, tier)
            self._failed_now.append((tier, JobResult(job_id, (), tuple(keys), 0, 0.0)))

    def delete(self, tier: str, keys: Sequence[bytes]) -> None:
        backend = self.backends.get(tier)
        if backend is None or not keys:
            return
        try:
            backend.delete(list(keys))
        except Exception:
            logger.exception("tiercache: deleting %d chunks from tier %s failed", len(keys), tier)

    def poll(self) -> list[tuple[str, JobResult]]:
        """(tier, result) of every backend job finished since the last call."""
        out, self._failed_now = self._failed_now, []
        for name, backend in self.backends.items():
            try:
                out.extend((name, res) for res in backend.poll())
            except Exception:
                logger.exception("tiercache: polling tier %s failed", name)
        return out

    def close(self) -> None:
        for name, backend in self.backends.items():
            try:
                backend.close()
            except Exception:
                logger.exception("tiercache: closing tier %s failed", name)
