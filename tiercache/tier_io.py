"""Host slots <-> lower-tier backends, on the worker side.

Owns the lower tiers' :class:`~tiercache.backend.Backend` objects (disk, LMDB,
plugins) and hands them memoryviews of host-tier slots: reads for staged
loads (lower tier -> host slot), writes for demotions (host slot -> lower
tier), deletes for evictions. The views point into the host slab, owned by the
TransferEngine; a backend drops them when it reports the job.

A planes slab (:func:`tiercache.layout.slab_planes`, a P/D producer's)
holds no chunk as one byte run, so backends get bounce buffers instead: a
put gathers each slot into one (kept here until the backend reports the
job), a get reads into them and scatters the chunks that arrived into their
slots in :meth:`TierIO.poll`, before anyone sees the result. Either way a
lower tier sees the chunk in the same byte format.

Threading: worker main thread only (backends run their own I/O threads).
A backend that raises is logged and its job reported failed; it never raises
into vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tiercache.backend import Backend, JobResult
from tiercache.layout import gather_slot, scatter_slot

logger = logging.getLogger(__name__)


@dataclass
class _Bounce:
    """A planes job's buffers, alive until its backend reports it."""

    op: str
    keys: list[bytes]
    slots: list[int]
    buffers: list[np.ndarray]


class TierIO:
    def __init__(self, backends: dict[str, Backend], slab: torch.Tensor,
                 planes: Sequence[torch.Tensor] | None = None, blocks_per_chunk: int = 1) -> None:
        self.backends = backends
        # A numpy view shares the slab's memory; memoryviews of its rows are what backends get.
        self._rows: np.ndarray = slab.numpy()
        self._planes = tuple(planes) if planes is not None else None
        self._blocks_per_chunk = blocks_per_chunk
        self._bounces: dict[tuple[str, int], _Bounce] = {}  # (tier, job id) -> buffers in use
        self._failed_now: list[tuple[str, JobResult]] = []

    def _views(self, op: str, tier: str, job_id: int, keys: Sequence[bytes],
               slots: Sequence[int]) -> list[memoryview]:
        rows = self._rows
        if self._planes is None:
            return [memoryview(rows[s]) for s in slots]
        buffers = [np.empty(rows.shape[1], dtype=np.uint8) for _ in slots]
        if op == "put":
            for slot, buf in zip(slots, buffers):
                gather_slot(self._planes, slot, self._blocks_per_chunk, buf)
        self._bounces[(tier, job_id)] = _Bounce(op, list(keys), list(slots), buffers)
        return [memoryview(buf) for buf in buffers]

    def _settle(self, tier: str, result: JobResult) -> None:
        """Drop a finished job's bounce buffers; a get's arrived chunks go into their slots first."""
        bounce = self._bounces.pop((tier, result.job_id), None)
        if bounce is None or bounce.op != "get" or self._planes is None:
            return
        ok = set(result.ok_keys)
        for key, slot, buf in zip(bounce.keys, bounce.slots, bounce.buffers):
            if key in ok:
                scatter_slot(self._planes, slot, self._blocks_per_chunk, buf)

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
            submit(job_id, list(keys), self._views(op, tier, job_id, keys, slots))
        except Exception:
            logger.exception("tiercache: %s job %d on tier %s failed to start", op, job_id, tier)
            self._bounces.pop((tier, job_id), None)
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
                results = backend.poll()
            except Exception:
                logger.exception("tiercache: polling tier %s failed", name)
                continue
            for res in results:
                self._settle(name, res)
                out.append((name, res))
        return out

    def close(self) -> None:
        for name, backend in self.backends.items():
            try:
                backend.close()
            except Exception:
                logger.exception("tiercache: closing tier %s failed", name)
