"""The worker's job pipeline: device <-> host (TransferEngine) chained with host <-> lower tiers (TierIO).

Jobs arriving from the scheduler, and what happens to them:

* store: engine blocks -> host slot (TransferEngine);
* load (a :class:`~tiercache.jobs.LoadJob`): host slot -> engine blocks; a
  chunk whose source is a lower tier (:class:`~tiercache.jobs.FromTier`) is
  first read into its host staging slot, and the device copy starts once every
  staged read has ended: one job, lower tier -> host -> device. A chunk whose
  staged read failed is left out of the device copy and reported failed (vLLM
  recomputes it). A chunk of a *direct* tier (:class:`~tiercache.jobs.FromReader`:
  a P/D producer, read by its :class:`BlockReader`) is read straight into its
  engine blocks, beside the staged reads; it takes no part in the device copy;
* demote: host slot -> lower tier (TierIO);
* delete: lower-tier keys evicted by the manager (TierIO's housekeeping lanes).

Every job ends as exactly one JobResult from :meth:`poll`: what vLLM may rely
on (which chunks are in their blocks). With ``track_reports``, every job also
ends as one *report* from :meth:`take_reports`, what the scheduler's manager
may rely on (which slots are free again); the two differ only for a load
that passed its deadline.

Deadlines (``deadlines`` in the config). A load whose lower-tier reads are not
all reported ``load_deadline_s`` after submission goes on without them: the
chunks still owed are failed (vLLM recomputes them), the rest is copied into
the blocks as usual, and the JobResult comes out. The backend still owns the
owed chunks' host staging slots (or bounce buffers) and may write them any
time until it reports, so the job's report waits for that: until then the
manager keeps those slots reserved (STORING, a miss for everyone) and never
hands them to another chunk. Late bytes can thus land in staging slots only,
never in engine blocks. A demotion not reported within ``store_deadline_s``
stays owned by its backend (its host copy stays pinned) but stalls its tier
(see TierIO); one the backend never received is failed at once. Device copies
are never abandoned: they are memory copies, awaited. A direct tier's reads
keep their own deadline (``pd.read_timeout_s``; the reader cancels and
awaits its READ before it reports).

Threading: worker main thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tiercache import faults
from tiercache.backend import JobResult
from tiercache.jobs import DemoteJob, FromReader, FromTier, LoadChunk, LoadJob, TransferJob
from tiercache.tiers.tier_io import TierIO
from tiercache.transfer.engine import TransferEngine


class BlockReader(Protocol):
    """A tier whose chunks are read straight into engine blocks (no host slot)."""

    def read_chunks(self, job_id: int, chunks: Sequence[LoadChunk]) -> None:
        """Start reading ``chunks`` (each a :class:`~tiercache.jobs.FromReader` of this tier) into their blocks."""
        ...

    def poll_blocks(self) -> list[JobResult]: ...


@dataclass
class _StagedLoad:
    job: LoadJob
    waiting: set[str]
    tier_keys: dict[str, tuple[bytes, ...]]  # the keys each staged tier reads
    deadline: float
    direct: set[bytes] = field(default_factory=set)  # keys read by a BlockReader
    failed: set[bytes] = field(default_factory=set)
    direct_bytes: int = 0
    abandoned: bool = False  # its blocks were given up: no device copy, every key fails
    started: float = field(default_factory=time.perf_counter)


@dataclass
class _Settled:
    """What a load's reads settled before its device copy: failed keys, direct arrivals."""

    failed: set[bytes]
    direct_ok: tuple[bytes, ...]
    direct_bytes: int


@dataclass
class _Demote:
    tier: str
    keys: tuple[bytes, ...]
    deadline: float
    overdue: bool = False


@dataclass
class _Held:
    """A load past its deadline: tiers that still own its staging slots, and its outcome so far."""

    owing: set[str] = field(default_factory=set)
    late_ok: set[bytes] = field(default_factory=set)
    result: JobResult | None = None


class WorkerPipeline:
    def __init__(self, engine: TransferEngine, tier_io: TierIO | None = None,
                 block_readers: Mapping[str, BlockReader] | None = None,
                 load_deadline_s: float = 5.0, store_deadline_s: float = 30.0) -> None:
        self.engine = engine
        self.tier_io = tier_io
        self.block_readers = dict(block_readers or {})
        self.load_deadline_s = load_deadline_s
        self.store_deadline_s = store_deadline_s
        self.track_reports = False
        self._staging: dict[int, _StagedLoad] = {}
        self._settled: dict[int, _Settled] = {}
        self._demotes: dict[int, _Demote] = {}
        self._held: dict[int, _Held] = {}
        self._ready: list[JobResult] = []
        self._reports: list[JobResult] = []

    # ------------------------------------------------------------ submission
    def submit(self, job: TransferJob) -> None:
        """Start a job; raises only before anything was started (the caller fails the job then)."""
        if not isinstance(job, LoadJob) or all(not isinstance(c.source, (FromTier, FromReader)) for c in job.chunks):
            self.engine.submit(job)
            return
        staged: dict[str, list[LoadChunk]] = {}
        direct: dict[str, list[LoadChunk]] = {}
        for chunk in job.chunks:
            if isinstance(chunk.source, FromReader):
                direct.setdefault(chunk.source.tier, []).append(chunk)
            elif isinstance(chunk.source, FromTier):
                staged.setdefault(chunk.source.tier, []).append(chunk)
        if (staged and self.tier_io is None) or any(t not in self.block_readers for t in direct):
            self._ready.append(JobResult(job.job_id, (), job.keys, 0, 0.0))
            return
        direct_keys = {c.key for chunks in direct.values() for c in chunks}
        tier_keys = {tier: tuple(c.key for c in chunks) for tier, chunks in staged.items()}
        self._staging[job.job_id] = _StagedLoad(job, set(staged) | set(direct), tier_keys,
                                                time.perf_counter() + self.load_deadline_s, direct_keys)
        # From here on the job is registered: every part ends in _staged_read_done, whatever happens.
        for tier, chunks in staged.items():
            assert self.tier_io is not None  # never raises: failures come from poll
            self.tier_io.get(job.job_id, tier, [c.key for c in chunks], [c.source.slot for c in chunks])
        for tier, chunks in direct.items():
            try:
                self.block_readers[tier].read_chunks(job.job_id, chunks)
            except Exception as exc:  # noqa: BLE001 - a reader that cannot start fails its keys
                faults.record(faults.READER_EXCEPTION, exc, where=f"{tier}.submit")
                self._staged_read_done(tier, JobResult(job.job_id, (), tuple(c.key for c in chunks), 0, 0.0),
                                       self._ready)

    def submit_demote(self, spec: DemoteJob) -> None:
        if self.tier_io is None:
            self._ready.append(JobResult(spec.job_id, (), spec.keys, 0, 0.0))
            return
        self._demotes[spec.job_id] = _Demote(spec.tier, spec.keys, time.perf_counter() + self.store_deadline_s)
        self.tier_io.put(spec.job_id, spec.tier, spec.keys, spec.host_slots)

    def delete(self, deletes: dict[str, list[bytes]]) -> None:
        """Queue deletes on the tiers' housekeeping lanes (never waits for a backend)."""
        if self.tier_io is not None:
            for tier, keys in deletes.items():
                self.tier_io.delete(tier, keys)

    def abandon(self, job_ids: Iterable[int]) -> None:
        """Give up the blocks of loads still reading (their caller reported them failed already):
        no device copy will write them; each job still ends in one result and one report."""
        for job_id in job_ids:
            staged = self._staging.get(job_id)
            if staged is not None:
                staged.abandoned = True

    # ------------------------------------------------------------ completion
    @property
    def busy(self) -> bool:
        """Whether reads or demotions are outstanding that have not passed their deadline yet
        (those past it may never end: nobody waits for them)."""
        return bool(self._staging or any(not d.overdue for d in self._demotes.values()))

    def take_reports(self) -> list[JobResult]:
        """Reports for the scheduler's manager since the last call (``track_reports`` only)."""
        out, self._reports = self._reports, []
        return out

    def poll(self) -> list[JobResult]:
        out, self._ready = self._ready, []
        if self.tier_io is not None:
            for tier, res in self.tier_io.poll():
                self._tier_result(tier, res, out)
        for tier, reader in self.block_readers.items():
            try:
                results = reader.poll_blocks()
            except Exception as exc:  # noqa: BLE001
                faults.record(faults.READER_EXCEPTION, exc, where=f"{tier}.poll")
                continue
            for res in results:
                if res.job_id in self._staging:
                    self._staged_read_done(tier, res, out)
        self._expire(out)
        out.extend(self._merge(self.engine.poll()))
        self._report(out)
        return out

    def _tier_result(self, tier: str, res: JobResult, out: list[JobResult]) -> None:
        held = self._held.get(res.job_id)
        if held is not None and tier in held.owing:  # a late read: its backend is done with the slots
            held.owing.discard(tier)
            held.late_ok.update(res.ok_keys)
            self._release(res.job_id)
        elif res.job_id in self._demotes:
            del self._demotes[res.job_id]
            out.append(res)
        elif res.job_id in self._staging:
            self._staged_read_done(tier, res, out)

    def _expire(self, out: list[JobResult]) -> None:
        """Fail what passed its deadline (see the module docstring)."""
        now = time.perf_counter()
        for job_id, staged in list(self._staging.items()):
            if now < staged.deadline:
                continue
            for tier in [t for t in staged.waiting if t in staged.tier_keys]:
                keys = staged.tier_keys[tier]
                assert self.tier_io is not None
                if not self.tier_io.abandon(tier, job_id):  # the backend owns the slots until it reports
                    self._held.setdefault(job_id, _Held()).owing.add(tier)
                faults.record(faults.LOAD_DEADLINE, f"{len(keys)} chunks not read from tier {tier} in "
                              f"{self.load_deadline_s:g}s: recomputed", where=tier)
                self._staged_read_done(tier, JobResult(job_id, (), keys, 0, 0.0), out)
        for job_id, demote in list(self._demotes.items()):
            if demote.overdue or now < demote.deadline:
                continue
            assert self.tier_io is not None
            faults.record(faults.STORE_DEADLINE, f"{len(demote.keys)} chunks not written to tier {demote.tier} "
                          f"in {self.store_deadline_s:g}s: the tier is stalled", where=demote.tier)
            if self.tier_io.abandon(demote.tier, job_id):  # never handed to the backend: failed now
                del self._demotes[job_id]
                out.append(JobResult(job_id, (), demote.keys, 0, 0.0))
            else:
                demote.overdue = True

    def _report(self, results: list[JobResult]) -> None:
        """Results become reports at once, except a held load's: it waits for its late reads."""
        for res in results:
            held = self._held.get(res.job_id)
            if held is None:
                if self.track_reports:
                    self._reports.append(res)
            else:
                held.result = res
                self._release(res.job_id)

    def _release(self, job_id: int) -> None:
        held = self._held[job_id]
        if held.owing or held.result is None:
            return
        del self._held[job_id]
        res = held.result
        # Chunks whose late read arrived are in their staging slots: the manager may keep them.
        late = tuple(k for k in res.failed_keys if k in held.late_ok)
        if late and self.tier_io is not None:
            res = JobResult(res.job_id, res.ok_keys + late, tuple(k for k in res.failed_keys if k not in held.late_ok),
                            res.bytes, res.secs)
        if self.track_reports:
            self._reports.append(res)

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
        job = staged.job
        keys = job.keys
        if staged.abandoned:
            staged.failed.update(keys)
        direct_ok = tuple(k for k in keys if k in staged.direct and k not in staged.failed)
        keep = {k for k in keys if k not in staged.failed and k not in staged.direct}
        if not keep:
            failed = tuple(k for k in keys if k in staged.failed)
            out.append(JobResult(job.job_id, direct_ok, failed, staged.direct_bytes,
                                 time.perf_counter() - staged.started))
            return
        if staged.failed or direct_ok:
            self._settled[job.job_id] = _Settled(staged.failed, direct_ok, staged.direct_bytes)
        self.engine.submit(job.only(keep))  # every chunk left sits in its host slot now

    def wait_for(self, job_ids: Iterable[int], timeout_s: float | None = None) -> list[JobResult]:
        """Poll until every job in ``job_ids`` has a result (others that finish are returned too).

        Lower-tier reads end by the load deadline; device copies are awaited. ``timeout_s``
        (default: the load deadline plus a minute) is a last resort for a hung copy or direct
        reader: past it this returns without those jobs, never raises (the caller gives them up).
        """
        pending = set(job_ids)
        return self._poll_until(pending, lambda: not pending, timeout_s, "wait_for")

    def wait_before_compute(self, job_ids: Iterable[int], timeout_s: float | None = None
                            ) -> tuple[list[JobResult], set[int]]:
        """Sync loads: return once the engine's next kernels will see these jobs' blocks filled.

        Where the copier orders copies on the device (CUDA), the host waits only for the
        lower-tier and direct reads (within their deadlines, as :meth:`wait_for`); jobs whose
        device copy is still running are ordered before the compute stream and returned as
        the second value (their results come from a later :meth:`poll`). Elsewhere (CPU)
        this is :meth:`wait_for`: every job's result, nothing left running.
        """
        pending = set(job_ids)
        if not self.engine.orders_on_device:
            return self.wait_for(pending, timeout_s), set()
        out = self._poll_until(pending, lambda: not pending & self._staging.keys(), timeout_s, "wait_before_compute")
        on_device = pending - self._staging.keys()
        self.engine.order_before_compute(on_device)
        return out, on_device

    def _poll_until(self, pending: set[int], enough: Callable[[], bool], timeout_s: float | None,
                    where: str) -> list[JobResult]:
        """Poll until ``enough()``: the results (their ids leave ``pending``, which ``enough`` may read).

        Past ``timeout_s`` (default: the load deadline plus a minute) it records a
        LOAD_DEADLINE fault and returns what it has. When nothing is staging (only
        device copies left) it blocks on the copies instead of polling.
        """
        out: list[JobResult] = []
        limit = self.load_deadline_s + 60.0 if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        while True:
            batch = self.poll()
            out.extend(batch)
            pending.difference_update(r.job_id for r in batch)
            if enough():
                return out
            if time.monotonic() > deadline:
                faults.record(faults.LOAD_DEADLINE, f"jobs {sorted(pending)} not done in {limit:g}s: given up",
                              where=where)
                return out
            if self._staging:
                time.sleep(0.0002)
                continue
            batch = self.await_copies()  # only device copies left: block
            out.extend(batch)
            pending.difference_update(r.job_id for r in batch)

    def wait_all(self, timeout_s: float = 60.0) -> list[JobResult]:
        """Poll until nothing is outstanding within its deadline, or ``timeout_s`` (shutdown, tests)."""
        out = self.poll()
        deadline = time.monotonic() + timeout_s
        while self.busy and time.monotonic() < deadline:
            time.sleep(0.001)
            out.extend(self.poll())
        out.extend(self.await_copies())
        return out

    def await_copies(self) -> list[JobResult]:
        """Wait for every device copy in flight (memory copies: they end); their results."""
        batch = self._merge(self.engine.wait_all())
        self._report(batch)
        return batch

    def shutdown(self) -> None:
        self.wait_all()
        self.engine.shutdown()
        if self.tier_io is not None:
            self.tier_io.close()
