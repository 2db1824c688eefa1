"""The kit lower-tier backends run their jobs on: one job record, worker lanes, a job desk.

Backends that do their I/O on threads of their own (``tiercache.backends``'
lmdb and redis tiers run on all of them; disk and server, whose threads keep
per-key or per-connection state, use the job records; so does
:mod:`~tiercache.tiers.sharded_backend`) build on these pieces instead of
keeping copies of them:

* :class:`BackendJob`: one submitted job (a put, a get, a delete, or a
  lookup): the keys that reach the medium, the caller's views, every key as
  submitted and the positions refused at intake. :class:`PartedJob` adds the
  countdown of a job cut into parts that several threads run: the thread that
  ends the last part reports the job.
* :class:`WorkerLanes`: named daemon threads serving prioritized queues
  (queue 0 first, FIFO within a queue); a queue may be reserved for the first
  thread, which then runs its jobs one at a time, in submission order.
  ``close`` runs what is queued, then ends the threads.
* :class:`JobDesk`: the owner's side of jobs on lanes: intake (checks keys
  and views, counts and reports refusals), the results that ``poll`` drains,
  the keys whose deletes are queued, and :meth:`JobDesk.run`, which turns one
  job into exactly one :class:`~tiercache.backend.JobResult` whatever happens.
* :class:`Every`: a rate limit for a log line.

Threads and buffers. ``push``, ``intake``, ``queue_delete``, ``poll`` and
``close`` run on the backend owner's thread; ``run`` on a lane's thread. A
job holds the caller's views from intake until :meth:`JobDesk.run` has run
it, and drops them before its result is published. An exception that escapes
a job is counted as a fault (``backend_exception``); the lane lives on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tiercache import faults
from tiercache.backend import BackendContext, JobResult
from tiercache.buffers import as_key_bytes, flat_byte_view
from tiercache.counters import Counters

JobKind = Literal["put", "get", "delete", "contains"]
#: How a job's attempt ended: ok keys, failed keys, payload bytes moved.
Outcome = tuple[list[bytes], list[bytes], int]


# ------------------------------------------------------------------------- job records
@dataclass(eq=False, slots=True)
class BackendJob:
    """One job of a backend, from intake until it is reported."""

    kind: JobKind
    job_id: Any  # an int job id (-1 for a delete), or a lookup's token
    keys: list[bytes]  # the keys that reach the medium
    views: list[memoryview] = field(default_factory=list)  # the caller's, one per key in ``keys``
    submitted: list[Any] = field(default_factory=list)  # every key as submitted, refused too
    refused: list[int] = field(default_factory=list)  # positions in ``submitted`` failed at intake

    def in_order(self, failed: list[bytes]) -> list[Any]:
        """``failed`` and the keys refused at intake, in submission order."""
        if not self.refused:
            return failed
        refused, gone = set(self.refused), set(failed)  # refused keys need not even be hashable
        return [key for i, key in enumerate(self.submitted) if i in refused or key in gone]


@dataclass(eq=False, slots=True)
class PartedJob(BackendJob):
    """A job cut into parts that several threads run; whoever ends the last part reports it."""

    remaining: int = 0  # parts not ended yet (changed under the lock that guards the job)
    start: float = field(default_factory=time.perf_counter)  # its JobResult's secs count from here

    def part_ended(self) -> bool:
        """Count one part as ended (under the job's lock); True if it was the last."""
        self.remaining -= 1
        return self.remaining == 0

    def result(self, good: Sequence[bool], moved: int) -> JobResult:
        """Its JobResult: keys whose ``good`` is true ok, the others failed, both in order."""
        ok = tuple(key for key, fine in zip(self.keys, good) if fine)
        failed = tuple(key for key, fine in zip(self.keys, good) if not fine)
        return JobResult(self.job_id, ok, failed, moved, time.perf_counter() - self.start)


# ----------------------------------------------------------------------------- threads
class WorkerLanes:
    """Threads running jobs from prioritized queues: queue 0 first, FIFO within a queue.

    Every thread serves every queue but those in ``first_thread_only``, which
    thread 0 alone serves (one job at a time, in submission order). Threads
    are named ``f"{prefix}{i}"``; an exception a job lets out is recorded as a
    fault ``where=f"{where} {job.kind}"`` and the thread goes on.
    """

    def __init__(
        self, prefix: str, threads: int, queues: int, run: Callable[[BackendJob], None], *,
        where: str, first_thread_only: Collection[int] = (),
    ) -> None:
        self._run = run
        self._where = where
        self._cond = threading.Condition()
        self._queues: list[deque[BackendJob]] = [deque() for _ in range(queues)]
        reserved = frozenset(first_thread_only)
        # A job only thread 0 may take must wake thread 0: wake them all then.
        self._wake = self._cond.notify_all if reserved else self._cond.notify
        self._stopping = False
        self._threads = [
            threading.Thread(
                target=self._serve,
                args=([q for n, q in enumerate(self._queues) if i == 0 or n not in reserved],),
                name=f"{prefix}{i}", daemon=True,
            )
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def push(self, job: BackendJob, queue: int = 0) -> None:
        with self._cond:
            self._queues[queue].append(job)
            self._wake()

    def close(self) -> None:
        """Run the queued jobs, then end the threads."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()

    def _serve(self, queues: list[deque[BackendJob]]) -> None:
        while (job := self._next(queues)) is not None:
            try:
                self._run(job)
            except Exception as exc:  # noqa: BLE001 - the lane outlives any job (result lost)
                faults.record(faults.BACKEND_EXCEPTION, exc, where=f"{self._where} {job.kind}")

    def _next(self, queues: list[deque[BackendJob]]) -> BackendJob | None:
        with self._cond:
            while True:
                for queue in queues:
                    if queue:
                        return queue.popleft()
                if self._stopping:
                    return None
                self._cond.wait()


# ------------------------------------------------------------------------------ the desk
class JobDesk:
    """The owner's side of a backend's jobs on lanes: intake, results, keys being deleted.

    ``tier`` names the tier in log lines (``"lmdb tier"``); ``counters`` has
    ``put_failures``, ``get_failures`` and ``delete_failures``. A key is
    storable when it is ``bytes`` of the context's namespace, at most
    ``max_key`` long; a view is usable when it is flat, 1 to ``chunk_bytes``
    bytes, and writable for a get.
    """

    def __init__(
        self, tier: str, log: logging.Logger, counters: Counters, context: BackendContext,
        max_key: int,
    ) -> None:
        self._tier = tier
        self._log = log
        self._counters = counters
        self._namespace = context.namespace
        self._chunk_bytes = context.chunk_bytes
        self._max_key = max_key
        self._results: list[JobResult] = []
        self._results_lock = threading.Lock()
        #: key -> its queued deletes not done yet. Changed under a lock; lane threads only test
        #: membership (gets and lookups miss such keys), which for bytes keys is atomic.
        self.deleting: dict[bytes, int] = {}
        self._deleting_lock = threading.Lock()

    def storable(self, key: Any) -> bool:
        """A key of this namespace that the medium and the frame format can hold."""
        return (
            isinstance(key, bytes)
            and len(key) <= self._max_key
            and key.startswith(self._namespace)
        )

    # ------------------------------------------------------------------ owner thread
    def intake(
        self, kind: Literal["put", "get"], job_id: int, keys: Sequence[Any],
        views: Sequence[memoryview], refuse_all: bool = False,
    ) -> BackendJob | None:
        """Check a job's keys and views; None once it is already reported (nothing to run)."""
        job = BackendJob(kind, job_id, [], submitted=[as_key_bytes(k) for k in keys])
        if refuse_all or len(keys) != len(views):
            job.refused = list(range(len(job.submitted)))
        else:
            for i, (key, view) in enumerate(zip(job.submitted, views)):
                flat = flat_byte_view(view, writable=kind == "get")
                usable = flat is not None and 0 < flat.nbytes <= self._chunk_bytes
                if usable and self.storable(key):
                    job.keys.append(key)
                    job.views.append(flat)  # type: ignore[arg-type]
                else:
                    job.refused.append(i)
        if job.refused:
            self._counters.add(**{f"{kind}_failures": len(job.refused)})
        if job.keys:
            return job
        self.publish(JobResult(job_id, (), tuple(job.submitted), 0, 0.0))
        return None

    def queue_delete(self, keys: list[bytes]) -> BackendJob:
        """The delete job of ``keys``; gets and lookups miss them until it has run."""
        with self._deleting_lock:
            for key in keys:
                self.deleting[key] = self.deleting.get(key, 0) + 1
        return BackendJob("delete", -1, keys)

    def poll(self) -> list[JobResult]:
        with self._results_lock:
            results, self._results = self._results, []
        return results

    def clear(self) -> None:
        """Drop the results nobody polled (the backend is closed)."""
        with self._results_lock:
            self._results.clear()

    # ------------------------------------------------------------------ lane threads
    def run(self, job: BackendJob, attempt: Callable[[BackendJob], Outcome]) -> None:
        """Run ``attempt`` on a job and publish its result (a delete's: none); nothing escapes."""
        start = time.perf_counter()
        try:
            ok, failed, moved = attempt(job)
        except Exception:  # noqa: BLE001 - a bug or an unforeseen state: the job fails, tier lives
            self._log.exception("%s: %s job %r failed", self._tier, job.kind, job.job_id)
            ok, failed, moved = [], list(job.keys), 0
            self._counters.add(**{f"{job.kind}_failures": len(failed)})
        finally:
            job.views.clear()  # no reference to the caller's buffers outlives the job
            if job.kind == "delete":
                self._forget_deleting(job.keys)
        if job.kind != "delete":
            self.publish(JobResult(job.job_id, tuple(ok), tuple(job.in_order(failed)), moved,
                                   time.perf_counter() - start))

    def publish(self, result: JobResult) -> None:
        with self._results_lock:
            self._results.append(result)

    def _forget_deleting(self, keys: list[bytes]) -> None:
        with self._deleting_lock:
            for key in keys:
                left = self.deleting.get(key, 0) - 1
                if left > 0:
                    self.deleting[key] = left
                else:
                    self.deleting.pop(key, None)


# ------------------------------------------------------------------------------ logging
class Every:
    """True at most once per ``seconds`` (to rate-limit a log line)."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._next = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self._seconds
        return True
