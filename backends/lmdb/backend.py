"""The LMDB tier: framed chunks in one LMDB environment on a local disk, shared by a node's engines.

Layout. One environment (``path``: a directory holding ``data.mdb`` and
``lock.mdb``) may serve several engines. Each namespace and TP rank gets a
named sub-database, ``tiercache/frames-v<format>/<namespace hex>/rank<r>``
(ranks hold different bytes under the same key). Inside it the key is the
chunk key itself, which starts with the 8-byte namespace digest (a key of
another namespace is refused), and the value is a compact frame from
:mod:`tiercache.integrity`: a header (format version, namespace, key,
length, xxh3_64 checksum) and the payload. Every load checks the header
before one byte reaches the caller's buffer, then verifies the checksum while
it copies the payload into the buffer (:mod:`tiercache.backends.lmdb.frames`:
every byte read from memory once). So a get's buffer is the backend's until
its job is polled, and its bytes mean nothing unless the key is reported ok
(:meth:`tiercache.backend.Backend.submit_get`); a frame that fails is a miss,
its buffer zeroed, and counts in ``stats()["checksum_failures"]``.

Processes. LMDB's own multi-process model: every process maps the same
files; one write transaction at a time across all of them (LMDB's writer
mutex in ``lock.mdb``); readers never block and never see an uncommitted
write. A process opened with ``readonly: true`` serves gets, ``contains`` and
``recover``; its puts fail. LMDB forbids opening one environment twice in a
process, so backends of one process on the same ``path`` (the scheduler's
recovery pass and a worker, or two ranks) share one ``lmdb.Environment``
(:class:`SharedEnvironment`); the first to open it sets its options. As
with any LMDB handle, open a backend in the process that uses it (not across
``fork``).

Budget. The tier never holds more than ``context.capacity_bytes`` of frames:
at most :attr:`LMDBBackend.capacity_chunks` chunks, each counted at
:meth:`LMDBBackend.footprint` (the largest frame a chunk can have, with a key
of :data:`MAX_KEY_BYTES`), which is also how the manager sizes the tier. The
count is read from the sub-database inside each write transaction, so it is
exact even when several processes write one namespace. A put beyond it fails
(counted); ``delete`` frees room. The map is sized from the budget of every
rank with headroom for LMDB's pages (:func:`default_map_size`); if it fills
anyway (pages freed by deletes stay pinned while a reader in some process
still looks at an old snapshot), that transaction's puts fail, ``map_full``
counts them, and the backend keeps serving.

Threads. ``submit_put``, ``submit_get``, ``delete``, ``poll``, ``contains``,
``recover``, ``stats`` and ``close`` are called from the owner's thread and,
but for ``close`` (which finishes the queued jobs), never wait for I/O
(``contains``/``recover``/``stats`` run a short read transaction, which LMDB
never blocks). Jobs run on the backend's own threads
(``io_threads``, lanes of :class:`~tiercache.tiers.worker_lanes.WorkerLanes`):
every one of them runs gets (one read transaction per job); the first also
runs the writes (one write transaction per put job; deletes), in submission
order, whenever no get is waiting. Each thread begins and ends its own
transactions. Chunk copies and checksums release the GIL. Finished jobs reach
the owner through the locked list of a
:class:`~tiercache.tiers.worker_lanes.JobDesk`, which ``poll`` drains.
Remapping the environment (adopting a map that another process grew) waits
until no transaction of this process is open (:class:`_MapGate`).

Files. This module holds the backend: its jobs, their errors and counters.
The options are in :mod:`tiercache.backends.lmdb.settings` (re-exported here),
the environment layer (sizing, sub-database names, :class:`SharedEnvironment`,
:class:`_MapGate`) in :mod:`tiercache.backends.lmdb.env`, the frame format
(:class:`Framer`) in :mod:`tiercache.backends.lmdb.frames`, and the
transactions in :mod:`tiercache.backends.lmdb.transactions`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import lmdb

from tiercache.backend import Backend, BackendContext, JobResult
from tiercache.backends.lmdb.env import (
    LMDB_PAGE_HEADER_BYTES,
    MAP_HEADROOM_FRACTION,
    MAP_HEADROOM_MIN_BYTES,
    MAX_KEY_BYTES,
    SharedEnvironment,
    database_name,
    default_map_size,
    environment_options,
    max_frame_bytes,
)
from tiercache.backends.lmdb.frames import Framer
from tiercache.backends.lmdb.settings import LMDBSettings
from tiercache.backends.lmdb.transactions import Transactions
from tiercache.buffers import as_key_bytes
from tiercache.counters import Counters
from tiercache.tiers.worker_lanes import BackendJob, Every, JobDesk, Outcome, WorkerLanes

logger = logging.getLogger(__name__)

# The sizing names are defined in lmdb_env and re-exported here, where tests and bench import them.
__all__ = [
    "LMDB_PAGE_HEADER_BYTES",
    "MAP_HEADROOM_FRACTION",
    "MAP_HEADROOM_MIN_BYTES",
    "MAX_KEY_BYTES",
    "LMDBBackend",
    "LMDBSettings",
    "database_name",
    "default_map_size",
    "environment_options",
    "max_frame_bytes",
]

_COUNTERS = ("puts", "gets", "put_failures", "get_failures", "checksum_failures", "map_full",
             "delete_failures")
#: The lanes' queues: gets (every thread), writes (the first thread alone, in order).
_READS, _WRITES = 0, 1

_T = TypeVar("_T")


# ----------------------------------------------------------------------------- backend
class LMDBBackend(Backend):
    """Chunks in an LMDB environment; see the module docstring for layout, budget and threads."""

    name = "lmdb"
    settings_model = LMDBSettings
    verifies_integrity = True  # compact frames, checked on every load

    @classmethod
    def footprint(cls, chunk_bytes: int) -> int:
        """Budget bytes of one chunk: its largest frame (the manager sizes the tier with it)."""
        return max_frame_bytes(chunk_bytes)

    def __init__(self, settings: LMDBSettings, context: BackendContext) -> None:
        self.frame_bytes = self.footprint(context.chunk_bytes)
        self.capacity_chunks = context.capacity_bytes // self.frame_bytes
        if self.capacity_chunks <= 0:
            raise ValueError(
                f"lmdb tier {context.tier_name}: capacity {context.capacity_bytes} bytes holds no "
                f"chunk frame of {self.frame_bytes} bytes"
            )
        self.settings = settings
        self.context = context
        self.map_size = settings.map_size or default_map_size(
            self.capacity_chunks * max(1, context.world_size), self.frame_bytes
        )
        self._counters = Counters(_COUNTERS)
        self._db_lock = threading.Lock()
        self._map_full_log = Every(60.0)
        self._closed = False
        self._shared = SharedEnvironment.acquire(settings, self.map_size)
        self._env = self._shared.env
        try:
            self._db = self._open_db(create=not settings.readonly)
        except BaseException:
            self._shared.release()
            raise
        max_key = min(MAX_KEY_BYTES, self._env.max_key_size())
        self._desk = JobDesk("lmdb tier", logger, self._counters, context, max_key)
        self._deleting = self._desk.deleting  # key -> its queued deletes not yet committed
        self._txns = Transactions(self._shared, Framer(context.namespace, context.chunk_bytes),
                                  self.capacity_chunks, self._deleting)
        self._lanes = WorkerLanes(f"lmdb-{context.tier_name}-io", settings.io_threads, 2, self._run,
                                  where="lmdb worker", first_thread_only={_WRITES})

    # ------------------------------------------------------------------ owner thread
    def submit_put(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        refuse = self._closed or self.settings.readonly
        job = self._desk.intake("put", job_id, keys, views, refuse_all=refuse)
        if job is not None:
            self._lanes.push(job, _WRITES)

    def submit_get(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        job = self._desk.intake("get", job_id, keys, views, refuse_all=self._closed)
        if job is not None:
            self._lanes.push(job, _READS)

    def poll(self) -> list[JobResult]:
        return self._desk.poll()

    def delete(self, keys: Sequence[bytes]) -> None:
        """Queue the keys' removal (one write transaction); gets and ``contains`` miss them now."""
        keys = [k for k in map(as_key_bytes, keys) if isinstance(k, bytes) and k]
        if self._closed or self.settings.readonly or not keys:
            return
        self._lanes.push(self._desk.queue_delete(keys), _WRITES)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys the environment holds now (written by any process); all False on an error."""
        return self._owner_read(self._txns.contains, keys, self._desk.storable,
                                default=[False] * len(keys))

    def recover(self) -> list[bytes]:
        """This namespace's keys, from the B-tree alone: no chunk body is read.

        An LMDB error here is raised: it happens at start-up, where it should be seen.
        """
        if self._closed or self._current_db() is None:
            return []
        try:
            return self._txns.keys(self._db, self.context.namespace)
        except lmdb.MapResizedError:
            self._shared.adopt_grown_map()
            return self._txns.keys(self._db, self.context.namespace)

    def stats(self) -> dict[str, int]:
        """Key counts since open (``puts``, ``gets``, ``*_failures``, ``checksum_failures``,
        ``map_full``) and ``bytes_used``: chunks held now times :attr:`frame_bytes`."""
        out = self._counters.snapshot()
        out["bytes_used"] = self._owner_read(self._txns.held, default=0) * self.frame_bytes
        return out

    def close(self) -> None:
        """Finish the queued jobs, then let go of the environment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._lanes.close()
        self._shared.release()
        self._desk.clear()

    # ------------------------------------------------------------------ I/O threads
    def _run(self, job: BackendJob) -> None:
        """Run one job to its JobResult; nothing escapes into the thread."""
        self._desk.run(job, self._attempt)

    def _attempt(self, job: BackendJob) -> Outcome:
        """Run the job; if another process grew the map past ours, adopt it and run once more."""
        run = {"put": self._put, "get": self._get, "delete": self._delete}[job.kind]
        try:
            return run(job)
        except lmdb.MapResizedError:
            self._shared.adopt_grown_map()
            return run(job)

    def _put(self, job: BackendJob) -> Outcome:
        try:
            ok, over, moved = self._txns.with_room(self._txns.put, self._db, job)
        except lmdb.MapFullError:
            self._counters.add(map_full=len(job.keys), put_failures=len(job.keys))
            if self._map_full_log.due():  # an exhausted map fails every put job: say it rarely
                logger.warning("lmdb tier: map full (%d bytes): %d puts dropped so far",
                               self._env.info()["map_size"], self._counters.snapshot()["map_full"])
        except lmdb.MapResizedError:
            raise
        except lmdb.Error as exc:
            logger.warning("lmdb tier: put job %d failed: %s", job.job_id, exc)
            self._counters.add(put_failures=len(job.keys))
        else:
            self._counters.add(puts=len(ok), put_failures=len(over))
            return ok, over, moved
        return [], list(job.keys), 0

    def _get(self, job: BackendJob) -> Outcome:
        if self._current_db() is None:  # read-only, and no writer created the namespace yet
            self._counters.add(get_failures=len(job.keys))
            return [], list(job.keys), 0
        try:
            ok, failed, moved, corrupt = self._txns.get(self._db, job)
        except lmdb.MapResizedError:
            raise
        except lmdb.Error as exc:
            logger.warning("lmdb tier: get job %d failed: %s", job.job_id, exc)
            self._counters.add(get_failures=len(job.keys))
            return [], list(job.keys), 0
        self._counters.add(gets=len(ok), get_failures=len(failed), checksum_failures=corrupt)
        return ok, failed, moved

    def _delete(self, job: BackendJob) -> Outcome:
        try:
            self._txns.with_room(self._txns.delete, self._db, job)
        except lmdb.MapResizedError:
            raise
        except lmdb.Error as exc:  # the chunks stay; a restart's recover() lists them again
            logger.warning("lmdb tier: deleting %d chunks failed: %s", len(job.keys), exc)
            self._counters.add(delete_failures=len(job.keys))
        return [], [], 0

    # ------------------------------------------------------------------ environment
    def _open_db(self, create: bool) -> Any:
        """This namespace's and rank's sub-database; None if read-only and not created yet."""
        name = database_name(self.context.namespace, self.context.rank)
        try:
            with self._shared.gate.shared():
                return self._env.open_db(name, create=create)
        except lmdb.NotFoundError:
            return None

    def _current_db(self) -> Any:
        """The handle, opened late when a read-only process started before any writer."""
        if self._db is None:
            with self._db_lock:
                if self._db is None:
                    self._db = self._open_db(create=False)
        return self._db

    def _owner_read(self, txn_body: Callable[..., _T], *args: Any, default: _T) -> _T:
        """A short read on the owner's thread: never raises, ``default`` when there is nothing."""
        try:
            if self._closed or self._current_db() is None:
                return default
            try:
                return txn_body(self._db, *args)
            except lmdb.MapResizedError:
                self._shared.adopt_grown_map()
                return txn_body(self._db, *args)
        except lmdb.Error as exc:
            logger.warning("lmdb tier: %s failed: %s", txn_body.__name__, exc)
            return default
