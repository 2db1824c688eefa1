"""The worker's job pipeline: device <-> host (TransferEngine) chained with host <-> lower tiers (TierIO).

Jobs arriving from the scheduler, and what happens to them:

* store: engine blocks -> host slot (TransferEngine);
* load: host slot -> engine blocks; when some chunks live in a lower tier
  (``stage_tiers[i]`` names it), those are first read into their host staging
  slots, and the device copy starts once every staged read has ended: one job,
  lower tier -> host -> device. A chunk whose staged read failed is left out of
  the device copy and reported failed (vLLM recomputes it). A chunk of a
  *direct* tier (one with a :class:`BlockReader`: a P/D producer in mode
  direct) is read by that reader straight into its engine blocks, beside the
  staged reads; it takes no part in the device copy;
* demote: host slot -> lower tier (TierIO);
* delete: lower-tier keys evicted by the manager.

Every job ends as exactly one JobResult from :meth:`poll`. Threading: worker
main thread only.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tiercache.backend import JobResult
from tiercache.device import CopySegment
from tiercache.tier_io import TierIO
from tiercache.transfer import TransferEngine, TransferJobSpec


@dataclass(frozen=True, slots=True)
class DemoteJobSpec:
    """Copy host slots ``host_slots[i]`` into lower tier ``tier`` under ``keys[i]``."""

    job_id: int
    tier: str
    keys: tuple[bytes, ...]
    host_slots: tuple[int, ...]


class BlockReader(Protocol):
    """A tier whose chunks are read straight into engine blocks (no host slot)."""

    def submit_blocks(self, job_id: int, keys: Sequence[bytes], segments: Sequence[CopySegment]) -> None: ...

    def poll_blocks(self) -> list[JobResult]: ...


@dataclass
class _StagedLoad:
    spec: TransferJobSpec
    waiting: set[str]
    direct: set[bytes] = field(default_factory=set)  # keys read by a BlockReader
    failed: set[bytes] = field(default_factory=set)
    direct_bytes: int = 0
    started: float = field(default_factory=time.perf_counter)


@dataclass
class _Settled:
    """What a load's reads settled before its device copy: failed keys, direct arrivals."""

    failed: set[bytes]
    direct_ok: tuple[bytes, ...]
    direct_bytes: int


class WorkerPipeline:
    def __init__(self, engine: TransferEngine, tier_io: TierIO | None = None,
                 block_readers: Mapping[str, BlockReader] | None = None) -> None:
        self.engine = engine
        self.tier_io = tier_io
        self.block_readers = dict(block_readers or {})
        self._staging: dict[int, _StagedLoad] = {}
        self._settled: dict[int, _Settled] = {}
        self._demotes: set[int] = set()
        self._ready: list[JobResult] = []

    # ------------------------------------------------------------ submission
    def submit(self, spec: TransferJobSpec, stage_tiers: Sequence[str | None] = ()) -> None:
        if spec.direction != "load" or not any(stage_tiers):
            self.engine.submit(spec)
            return
        by_tier: dict[str, tuple[list[bytes], list[int]]] = {}
        direct: dict[str, tuple[list[bytes], list[CopySegment]]] = {}
        for key, seg, tier in zip(spec.keys, spec.segments, stage_tiers):
            if tier in self.block_readers:
                keys, segs = direct.setdefault(tier, ([], []))
                keys.append(key)
                segs.append(seg)
            elif tier:
                keys, slots = by_tier.setdefault(tier, ([], []))
                keys.append(key)
                slots.append(seg.slot)
        if by_tier and self.tier_io is None:
            self._ready.append(JobResult(spec.job_id, (), spec.keys, 0, 0.0))
            return
        direct_keys = {k for keys, _ in direct.values() for k in keys}
        self._staging[spec.job_id] = _StagedLoad(spec, set(by_tier) | set(direct), direct_keys)
        for tier, (keys, slots) in by_tier.items():
            assert self.tier_io is not None
            self.tier_io.get(spec.job_id, tier, keys, slots)
        for tier, (keys, segs) in direct.items():
            try:
                self.block_readers[tier].submit_blocks(spec.job_id, keys, segs)
            except Exception:  # noqa: BLE001 - a reader that cannot start fails its keys
                self._staged_read_done(tier, JobResult(spec.job_id, (), tuple(keys), 0, 0.0), self._ready)

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
        for tier, reader in self.block_readers.items():
            for res in reader.poll_blocks():
                if res.job_id in self._staging:
                    self._staged_read_done(tier, res, out)
        out.extend(self._merge(self.engine.poll()))
        return out

    def _merge(self, results: list[JobResult]) -> list[JobResult]:
        """Add what the reads settled (failed chunks, direct arrivals) to the job's device-copy result."""
        merged: list[JobResult] = []
        for res in results:
            settled = self._settled.pop(res.job_id, None)
            if settled is not None:
                res = JobResult(res.job_id, res.ok_keys + settled.direct_ok,
                                res.failed_keys + tuple(settled.failed), res.bytes + settled.direct_bytes, res.secs)
            merged.append(res)
        return merged

    def _staged_read_done(self, tier: str, res: JobResult, out: list[JobResult]) -> None:
        staged = self._staging[res.job_id]
        staged.waiting.discard(tier)
        staged.failed.update(res.failed_keys)
        if tier in self.block_readers:
            staged.direct_bytes += res.bytes
        if staged.waiting:
            return
        del self._staging[res.job_id]
        spec = staged.spec
        direct_ok = tuple(k for k in spec.keys if k in staged.direct and k not in staged.failed)
        keep = [i for i, key in enumerate(spec.keys) if key not in staged.failed and key not in staged.direct]
        if not keep:
            failed = tuple(k for k in spec.keys if k in staged.failed)
            out.append(JobResult(spec.job_id, direct_ok, failed, staged.direct_bytes,
                                 time.perf_counter() - staged.started))
            return
        if staged.failed or direct_ok:
            self._settled[spec.job_id] = _Settled(staged.failed, direct_ok, staged.direct_bytes)
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
