"""The LMDB tier's I/O threads: the job record, the thread pool and its queues, a log rate limit.

:class:`Workers` runs every job of an
:class:`~tiercache.backends.lmdb.backend.LMDBBackend` on its own threads: all of them
run gets, the first also runs puts and deletes in submission order. A
:class:`Job` holds the caller's buffers only until it has run.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from tiercache import faults


@dataclass(slots=True)
class Job:
    kind: Literal["put", "get", "delete"]
    job_id: int
    keys: list[bytes]
    views: list[memoryview] = field(default_factory=list)
    refused: list[bytes] = field(default_factory=list)  # failed before reaching a thread
    submitted: list[bytes] = field(default_factory=list)  # every key, as submitted


class Workers:
    """The I/O threads and their two queues.

    Every thread runs gets; thread 0 alone runs writes (puts and deletes), in
    submission order, whenever no get is waiting: a get is what a request
    waits for, a store can wait. LMDB allows one writer at a time anyway, and
    readers run beside it.
    """

    def __init__(self, count: int, run: Callable[[Job], None], name: str) -> None:
        self._run = run
        self._cond = threading.Condition()
        self._reads: deque[Job] = deque()
        self._writes: deque[Job] = deque()
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._serve, args=(i == 0,), name=f"{name}-io{i}", daemon=True)
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def write(self, job: Job) -> None:
        self._enqueue(self._writes, job)

    def read(self, job: Job) -> None:
        self._enqueue(self._reads, job)

    def stop(self) -> None:
        """Finish the queued jobs, then end the threads."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()

    def _enqueue(self, jobs: deque[Job], job: Job) -> None:
        with self._cond:
            jobs.append(job)
            self._cond.notify_all()

    def _serve(self, writer: bool) -> None:
        while (job := self._next(writer)) is not None:
            try:
                self._run(job)
            except Exception as exc:  # noqa: BLE001 - the thread outlives any job
                faults.record(faults.BACKEND_EXCEPTION, exc, where=f"lmdb worker {job.kind}")

    def _next(self, writer: bool) -> Job | None:
        with self._cond:
            while True:
                if self._reads:
                    return self._reads.popleft()
                if writer and self._writes:
                    return self._writes.popleft()
                if self._stopping:
                    return None
                self._cond.wait()


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
