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

Deletes run on a housekeeping lane per backend (:mod:`tiercache.tiers.housekeeping`),
never on the worker thread. The lane holds the tier's lock while it deletes;
this thread only *tries* the lock, so a job submitted meanwhile waits here
(``deferred``) and is handed over by a later :meth:`poll`, and a demotion waits
for the deletes queued before it (the backend's budget needs their room).

Deadlines are the pipeline's (:mod:`tiercache.transfer.pipeline`); when a job passes
one, :meth:`abandon` either drops it (the backend never saw it) or marks it
*overdue* (the backend owns its views until it reports). While a tier owes
overdue jobs, or its lane is stuck in a delete that made a job miss its
deadline, the tier is *stalled*: new jobs fail at once (fault
``tier_stalled``) instead of each waiting for its deadline.

Integrity: a tier whose backend does not verify what it returns (one without
``Backend.verifies_integrity``: a plugin, the cache server) is checked here
against the digests of what this worker wrote (:mod:`tiercache.tiers.chunk_digests`).

Threading: worker main thread only (backends and lanes run threads of their
own). A backend that raises is counted and its job reported failed; it never
raises into vLLM.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tiercache import faults
from tiercache.backend import Backend, JobResult
from tiercache.tiers.chunk_digests import ChunkDigests
from tiercache.tiers.housekeeping import DeleteLane
from tiercache.layout import gather_slot, scatter_slot


@dataclass
class _Bounce:
    """A planes job's buffers, alive until its backend reports it."""

    op: str
    keys: list[bytes]
    slots: list[int]
    buffers: list[np.ndarray]


@dataclass
class _Deferred:
    """A job not handed to its backend yet: the lane holds the lock, or deletes go first."""

    op: str
    job_id: int
    keys: list[bytes]
    views: list[memoryview]
    after_delete: int  # the lane batch a put waits for


@dataclass
class _Handed:
    """A job the backend holds: its op, and what the integrity check needs when it reports."""

    op: str
    keys: list[bytes]
    views: list[memoryview] | None = None  # a checked get's destinations
    digests: dict[bytes, int] | None = None  # a checked put's chunks


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
        self._locks = {name: threading.Lock() for name in backends}
        self.lanes = {name: DeleteLane(name, b, self._locks[name]) for name, b in backends.items()}
        self._deferred: dict[str, list[_Deferred]] = {name: [] for name in backends}
        self._handed: dict[str, dict[int, _Handed]] = {name: {} for name in backends}  # with the backend now
        # a ShardedBackend carries its inner backend's verifies_integrity
        self._digests = {name: ChunkDigests() for name, b in backends.items() if not b.verifies_integrity}
        self._overdue: dict[str, set[int]] = {name: set() for name in backends}  # ... and past a deadline
        self._stuck_lane: dict[str, int] = {}  # tier -> lane batch that made a job miss its deadline

    # ------------------------------------------------------------ submission
    def get(self, job_id: int, tier: str, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Read ``keys`` from ``tier`` into host slots ``slots``."""
        self._submit("get", job_id, tier, keys, slots)

    def put(self, job_id: int, tier: str, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Write host slots ``slots`` into ``tier`` under ``keys``."""
        self._submit("put", job_id, tier, keys, slots)

    def delete(self, tier: str, keys: Sequence[bytes]) -> None:
        """Queue a delete on the tier's housekeeping lane (returns at once)."""
        lane = self.lanes.get(tier)
        if lane is not None and keys:
            lane.push(keys)
            if tier in self._digests:
                self._digests[tier].forget(keys)

    def stalled(self, tier: str) -> bool:
        """Whether ``tier`` owes jobs past their deadline (or its lane is stuck): jobs fail at once."""
        if self._overdue.get(tier):
            return True
        stuck = self._stuck_lane.get(tier)
        if stuck is None:
            return False
        if self.lanes[tier].done_seq > stuck or self.lanes[tier].idle:
            del self._stuck_lane[tier]  # the lane moved on
            return False
        return True

    def abandon(self, tier: str, job_id: int) -> bool:
        """A job passed its deadline. True: it never reached the backend and is dropped (no result
        will come); False: the backend owns it, its result comes from :meth:`poll` later (overdue)."""
        deferred = self._deferred.get(tier, [])
        for i, job in enumerate(deferred):
            if job.job_id == job_id:
                del deferred[i]
                self._bounces.pop((tier, job_id), None)
                if not self.lanes[tier].idle:
                    self._stuck_lane[tier] = self.lanes[tier].done_seq
                return True
        for i, (name, res) in enumerate(self._failed_now):
            if name == tier and res.job_id == job_id:
                del self._failed_now[i]
                return True
        if job_id in self._handed.get(tier, ()):
            self._overdue[tier].add(job_id)
            return False
        return True

    def _submit(self, op: str, job_id: int, tier: str, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        backend = self.backends.get(tier)
        if backend is None:
            faults.record(faults.BACKEND_EXCEPTION, f"no backend for tier {tier!r}", where=tier)
            self._fail(tier, job_id, keys)
            return
        if self.stalled(tier):
            faults.record(faults.TIER_STALLED, f"tier {tier} still owes jobs past their deadline: "
                          f"{op} jobs fail at once", where=tier)
            self._fail(tier, job_id, keys)
            return
        try:
            views = self._views(op, tier, job_id, keys, slots)
        except Exception as exc:  # noqa: BLE001
            faults.record(faults.BACKEND_EXCEPTION, exc, where=f"{tier}.{op}")
            self._bounces.pop((tier, job_id), None)
            self._fail(tier, job_id, keys)
            return
        self._deferred[tier].append(_Deferred(op, job_id, list(keys), views, self.lanes[tier].queued_seq))
        self._hand_over(tier)

    def _hand_over(self, tier: str) -> None:
        """Give the backend the deferred jobs it may take now (never waits for the lane)."""
        waiting = self._deferred[tier]
        if not waiting or not self._locks[tier].acquire(blocking=False):
            return
        try:
            lane = self.lanes[tier]
            keep: list[_Deferred] = []
            for job in waiting:
                if job.op == "put" and not lane.caught_up(job.after_delete):
                    keep.append(job)
                else:
                    self._start(tier, job)
            self._deferred[tier] = keep
        finally:
            self._locks[tier].release()

    def _start(self, tier: str, job: _Deferred) -> None:
        backend = self.backends[tier]
        submit = backend.submit_get if job.op == "get" else backend.submit_put
        handed = _Handed(job.op, job.keys)
        try:
            checks = self._digests.get(tier)
            if checks is not None and job.op == "put":
                handed.digests = checks.of(job.keys, job.views)  # the slot is pinned until the report
            elif checks is not None:
                handed.views = job.views
            submit(job.job_id, job.keys, job.views)
        except Exception as exc:  # noqa: BLE001 - a backend that raises fails its job, never vLLM
            faults.record(faults.BACKEND_EXCEPTION, exc, where=f"{tier}.submit_{job.op}")
            self._bounces.pop((tier, job.job_id), None)
            self._fail(tier, job.job_id, job.keys)
            return
        self._handed[tier][job.job_id] = handed

    def _fail(self, tier: str, job_id: int, keys: Sequence[bytes]) -> None:
        self._failed_now.append((tier, JobResult(job_id, (), tuple(keys), 0, 0.0)))

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

    # ------------------------------------------------------------ completion
    def _settle(self, tier: str, result: JobResult) -> None:
        """Drop a finished job's bounce buffers; a get's arrived chunks go into their slots first."""
        bounce = self._bounces.pop((tier, result.job_id), None)
        if bounce is None or bounce.op != "get" or self._planes is None:
            return
        ok = set(result.ok_keys)
        for key, slot, buf in zip(bounce.keys, bounce.slots, bounce.buffers):
            if key in ok:
                scatter_slot(self._planes, slot, self._blocks_per_chunk, buf)

    def poll(self) -> list[tuple[str, JobResult]]:
        """(tier, result) of every backend job finished since the last call (overdue ones included)."""
        out, self._failed_now = self._failed_now, []
        for name, backend in self.backends.items():
            self._hand_over(name)
            lock = self._locks[name]
            if not lock.acquire(blocking=False):
                continue  # the lane is deleting: results wait for the next poll
            try:
                results = backend.poll()
            except Exception as exc:  # noqa: BLE001
                faults.record(faults.BACKEND_EXCEPTION, exc, where=f"{name}.poll")
                continue
            finally:
                lock.release()
            for res in results:
                handed = self._handed[name].pop(res.job_id, None)
                self._overdue[name].discard(res.job_id)
                if handed is not None and handed.op == "get" and res.failed_keys:  # else only vLLM's "recovered"
                    faults.record(faults.TIER_READ_FAILED, f"{len(res.failed_keys)} chunks not read from tier "
                                  f"{name} (gone since the lookup, e.g. evicted; refused by its checks; or the "
                                  "request failed): recomputed", where=name, count=len(res.failed_keys))
                if handed is not None and name in self._digests:
                    res = self._check(name, handed, res)
                self._settle(name, res)
                out.append((name, res))
        return out

    def _check(self, tier: str, handed: _Handed, res: JobResult) -> JobResult:
        """Record a put's digests; fail a get's chunks whose bytes are not what was written."""
        checks = self._digests[tier]
        if handed.digests is not None:
            checks.stored(handed.digests, res.ok_keys)
            return res
        if handed.views is None or not res.ok_keys:
            return res
        wrong = set(checks.wrong(handed.keys, handed.views, res.ok_keys))
        if not wrong:
            return res
        faults.record(faults.INTEGRITY, f"{len(wrong)} chunks from tier {tier} differ from what was "
                      "written: recomputed", where=tier, count=len(wrong))
        ok = tuple(k for k in res.ok_keys if k not in wrong)
        failed = tuple(k for k in handed.keys if k in wrong or k in res.failed_keys)
        return JobResult(res.job_id, ok, failed, res.bytes * len(ok) // max(1, len(res.ok_keys)), res.secs)

    def wait_deletes(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued delete ran (tests, shutdown); False if some lane did not finish."""
        return all(lane.wait_idle(timeout_s) for lane in self.lanes.values())

    def close(self) -> None:
        """Stop the lanes (bounded wait), then close the backends; a stuck one is left to its threads."""
        for lane in self.lanes.values():
            lane.close(timeout_s=5.0)
        for name, backend in self.backends.items():
            got = self._locks[name].acquire(timeout=5.0)
            try:
                backend.close()
            except Exception as exc:  # noqa: BLE001
                faults.record(faults.BACKEND_EXCEPTION, exc, where=f"{name}.close")
            finally:
                if got:
                    self._locks[name].release()
