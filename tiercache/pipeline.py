"""The worker's job pipeline: device <-> host (TransferEngine) chained with host <-> lower tiers (TierIO).

Jobs arriving from the scheduler, and what happens to them:

* store: engine blocks -> host slot (TransferEngine);
* load: host slot -> engine blocks; when some chunks live in a lower tier
  (``stage_tiers[i]`` names it), those are first read into their host staging
  slots, and the device copy starts once every staged read has ended: one job,
  lower tier -> host -> device. A chunk whose staged read failed is left out of
  the device copy and reported failed (vLLM recomputes it);
* demote: host slot -> lower tier (TierIO);
* delete: lower-tier keys evicted by the manager.

Every job ends as exactly one JobResult from :meth:`poll`. Threading: worker
main thread only.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tiercache.backend import JobResult
from tiercache.tier_io import TierIO
from tiercache.transfer import TransferEngine, TransferJobSpec


@dataclass(frozen=True, slots=True)
class DemoteJobSpec:
    """Copy host slots ``host_slots[i]`` into lower tier ``tier`` under ``keys[i]``."""

    job_id: int
    tier: str
    keys: tuple[bytes, ...]
    host_slots: tuple[int, ...]


@dataclass
class _StagedLoad:
    spec: TransferJobSpec
    waiting: set[str]
    failed: set[bytes] = field(default_factory=set)
    bytes: int = 0
    started: float = field(default_factory=time.perf_counter)


class WorkerPipeline:
    def __init__(self, engine: TransferEngine, tier_io: TierIO | None = None) -> None:
        self.engine = engine
        self.tier_io = tier_io
        self._staging: dict[int, _StagedLoad] = {}
        self._stage_failed: dict[int, set[bytes]] = {}
        self._demotes: set[int] = set()
        self._ready: list[JobResult] = []

    # ------------------------------------------------------------ submission
    def submit(self, spec: TransferJobSpec, stage_tiers: Sequence[str | None] = ()) -> None:
        if spec.direction != "load" or not any(stage_tiers):
            self.engine.submit(spec)
            return
        if self.tier_io is None:
            self._ready.append(JobResult(spec.job_id, (), spec.keys, 0, 0.0))
            return
        by_tier: dict[str, tuple[list[bytes], list[int]]] = {}
        for key, seg, tier in zip(spec.keys, spec.segments, stage_tiers):
            if tier:
                keys, slots = by_tier.setdefault(tier, ([], []))
                keys.append(key)
                slots.append(seg.slot)
        self._staging[spec.job_id] = _StagedLoad(spec, set(by_tier))
        for tier, (keys, slots) in by_tier.items():
            self.tier_io.get(spec.job_id, tier, keys, slots)

    def submit_demote(self, spec: DemoteJobSpec) -> None:
        if self.tier_io is None:
            self._ready.append(JobResult(spec.job_id, (), spec.keys, 0, 0.0))
            return
        self._demotes.add(spec.job_id)
        self.tier_io.put(spec.job_id, spec.tier, spec.keys, spec.host_slots)

    def delete(self, deletes: dict[str, list[bytes]]) -> None:
        if self.tier_io is not None:
            for tier, keys in deletes.items():
                self.tier_io.delete(tier, keys)

    def fence_stores(self) -> None:
        self.engine.fence_stores()

    # ------------------------------------------------------------ completion
    def poll(self) -> list[JobResult]:
        out, self._ready = self._ready, []
        if self.tier_io is not None:
            for tier, res in self.tier_io.poll():
                if res.job_id in self._demotes:
                    self._demotes.discard(res.job_id)
                    out.append(res)
                elif res.job_id in self._staging:
                    self._staged_read_done(tier, res, out)
        out.extend(self._merge(self.engine.poll()))
        return out

    def _merge(self, results: list[JobResult]) -> list[JobResult]:
        """Add the chunks whose staged read failed to their job's device-copy result."""
        merged: list[JobResult] = []
        for res in results:
            failed = self._stage_failed.pop(res.job_id, None)
            if failed:
                res = JobResult(res.job_id, res.ok_keys, res.failed_keys + tuple(failed), res.bytes, res.secs)
            merged.append(res)
        return merged

    def _staged_read_done(self, tier: str, res: JobResult, out: list[JobResult]) -> None:
        staged = self._staging[res.job_id]
        staged.waiting.discard(tier)
        staged.failed.update(res.failed_keys)
        staged.bytes += res.bytes
        if staged.waiting:
            return
        del self._staging[res.job_id]
        spec = staged.spec
        keep = [i for i, key in enumerate(spec.keys) if key not in staged.failed]
        if not keep:
            out.append(JobResult(spec.job_id, (), spec.keys, 0, time.perf_counter() - staged.started))
            return
        if staged.failed:
            self._stage_failed[spec.job_id] = staged.failed
        self.engine.submit(
            TransferJobSpec(
                spec.job_id,
                spec.req_id,
                "load",
                tuple(spec.keys[i] for i in keep),
                tuple(spec.segments[i] for i in keep),
            )
        )

    def wait_for(self, job_ids: Iterable[int], timeout_s: float = 60.0) -> list[JobResult]:
        """Poll until every job in ``job_ids`` has a result (others that finish are returned too)."""
        pending = set(job_ids)
        out: list[JobResult] = []
        deadline = time.monotonic() + timeout_s
        while pending:
            batch = self.poll()
            out.extend(batch)
            pending.difference_update(r.job_id for r in batch)
            if pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tiercache: jobs {sorted(pending)} did not finish in {timeout_s}s")
                if not self._staging:
                    batch = self._merge(self.engine.wait_all())  # only device copies left: block
                    out.extend(batch)
                    pending.difference_update(r.job_id for r in batch)
                else:
                    time.sleep(0.0002)
        return out

    def wait_all(self) -> list[JobResult]:
        out = self.poll()
        deadline = time.monotonic() + 60
        while (self._staging or self._demotes) and time.monotonic() < deadline:
            time.sleep(0.001)
            out.extend(self.poll())
        out.extend(self._merge(self.engine.wait_all()))
        return out

    def shutdown(self) -> None:
        self.wait_all()
        self.engine.shutdown()
        if self.tier_io is not None:
            self.tier_io.close()
