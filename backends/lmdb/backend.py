"""The LMDB tier: framed chunks in one LMDB environment on a local disk, shared by a node's engines.

Layout. One environment (``path``: a directory holding ``data.mdb`` and
``lock.mdb``) may serve several engines. Each namespace and TP rank gets a
named sub-database, ``tiercache/frames-v<format>/<namespace hex>/rank<r>``
(ranks hold different bytes under the same key). Inside it the key is the
chunk key itself, which starts with the 8-byte namespace digest (a key of
another namespace is refused), and the value is a compact frame from
:mod:`tiercache.integrity`: a header (format version, namespace, key,
length, xxh3_64 checksum) and the payload. Every load verifies the frame
before one byte reaches the caller's buffer; a frame that fails is a miss
and counts in ``stats()["checksum_failures"]``.

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
(``io_threads``, :class:`Workers`): every one of them runs gets (one read
transaction per job); the first also runs the writes (one write transaction
per put job; deletes), in submission order, whenever no get is waiting. Each
thread begins and ends its own transactions. Chunk copies and checksums
release the GIL. Finished jobs reach the owner through a locked list that
``poll`` drains. Remapping the environment (adopting a map that another
process grew) waits until no transaction of this process is open
(:class:`_MapGate`).

Files. This module holds the settings and the backend. The environment layer
(sizing, sub-database names, :class:`SharedEnvironment`, :class:`_MapGate`) is
in :mod:`tiercache.backends.lmdb.env`, the frame format (:class:`Framer`) in
:mod:`tiercache.backends.lmdb.frames`, and the I/O threads (:class:`Workers`)
in :mod:`tiercache.backends.lmdb.workers`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import lmdb
from pydantic import Field

from tiercache.backend import Backend, BackendContext, BackendSettings, JobResult
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
from tiercache.backends.lmdb.frames import Framer, Load
from tiercache.backends.lmdb.workers import Every, Job, Workers
from tiercache.buffers import as_key_bytes, flat_byte_view
from tiercache.counters import Counters
from tiercache.config.schema import ByteSize

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

#: A record in the main database that a transaction rewrites to move LMDB's txn id on.
_TICK_KEY = b"tiercache/tick"


class LMDBSettings(BackendSettings):
    """Options of an ``lmdb`` tier (``tiers[i].options`` in YAML)."""

    path: Path = Field(description="Directory of the LMDB environment (created if missing).")
    map_size: ByteSize | None = Field(
        default=None,
        description=(
            "LMDB map size in bytes. Default: the capacity of every rank of the engine plus "
            "headroom for LMDB's pages (default_map_size). Set it when other engines share "
            "the environment."
        ),
    )
    max_readers: int = Field(
        default=126, ge=1,
        description="Reader slots; set by the first process that opens the environment.",
    )
    sync: bool = Field(
        default=False,
        description=(
            "fsync on every commit. False: an OS crash may lose the latest puts (they become "
            "misses); LMDB stays consistent, and every load is checksummed anyway."
        ),
    )
    io_threads: int = Field(
        default=1, ge=1, le=64,
        description="I/O threads. All run gets; the first also runs puts and deletes, in order.",
    )
    subdir: bool = Field(
        default=True, description="True: path is a directory; False: path is the data file itself."
    )
    readonly: bool = Field(
        default=False, description="Open read-only (another process writes); puts fail."
    )


_COUNTERS = ("puts", "gets", "put_failures", "get_failures", "checksum_failures", "map_full",
             "delete_failures")


_Outcome = tuple[list[bytes], list[bytes], int]  # ok keys, failed keys, payload bytes moved
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
        self._framer = Framer(context.namespace, context.chunk_bytes)
        self._counters = Counters(_COUNTERS)
        self._results: list[JobResult] = []
        self._results_lock = threading.Lock()
        # key -> its queued deletes not yet committed. Changed under the lock; get threads
        # only test membership, which for bytes keys is atomic under the GIL.
        self._deleting: dict[bytes, int] = {}
        self._deleting_lock = threading.Lock()
        self._db_lock = threading.Lock()
        self._map_full_log = Every(60.0)
        self._closed = False
        self._shared = SharedEnvironment.acquire(settings, self.map_size)
        self._env = self._shared.env
        self._gate = self._shared.gate
        try:
            self._db = self._open_db(create=not settings.readonly)
        except BaseException:
            self._shared.release()
            raise
        self._max_key = min(MAX_KEY_BYTES, self._env.max_key_size())
        self._workers = Workers(settings.io_threads, self._run, f"lmdb-{context.tier_name}")

    # ------------------------------------------------------------------ owner thread
    def submit_put(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        job = self._intake("put", job_id, keys, views)
        if job is not None:
            self._workers.write(job)

    def submit_get(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        job = self._intake("get", job_id, keys, views)
        if job is not None:
            self._workers.read(job)

    def poll(self) -> list[JobResult]:
        with self._results_lock:
            results, self._results = self._results, []
        return results

    def delete(self, keys: Sequence[bytes]) -> None:
        """Queue the keys' removal (one write transaction); gets and ``contains`` miss them now."""
        keys = [k for k in map(as_key_bytes, keys) if isinstance(k, bytes) and k]
        if self._closed or self.settings.readonly or not keys:
            return
        with self._deleting_lock:
            for key in keys:
                self._deleting[key] = self._deleting.get(key, 0) + 1
        self._workers.write(Job("delete", -1, keys))

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys the environment holds now (written by any process); all False on an error."""
        return self._owner_read(self._contains_txn, keys, default=[False] * len(keys))

    def recover(self) -> list[bytes]:
        """This namespace's keys, from the B-tree alone: no chunk body is read.

        An LMDB error here is raised: it happens at start-up, where it should be seen.
        """
        if self._closed or self._current_db() is None:
            return []
        try:
            return self._recover_txn()
        except lmdb.MapResizedError:
            self._shared.adopt_grown_map()
            return self._recover_txn()

    def stats(self) -> dict[str, int]:
        """Key counts since open (``puts``, ``gets``, ``*_failures``, ``checksum_failures``,
        ``map_full``) and ``bytes_used``: chunks held now times :attr:`frame_bytes`."""
        out = self._counters.snapshot()
        out["bytes_used"] = self._owner_read(self._held_chunks_txn, default=0) * self.frame_bytes
        return out

    def close(self) -> None:
        """Finish the queued jobs, then let go of the environment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._workers.stop()
        self._shared.release()
        with self._results_lock:
            self._results.clear()

    # ------------------------------------------------------------------- job intake
    def _intake(
        self, kind: Literal["put", "get"], job_id: int, keys: Sequence[bytes],
        views: Sequence[memoryview],
    ) -> Job | None:
        """Check a job's keys and buffers on the owner thread; None once it is already reported."""
        job = Job(kind, job_id, [], submitted=[as_key_bytes(k) for k in keys])
        if self._closed or len(keys) != len(views) or (kind == "put" and self.settings.readonly):
            job.refused = list(job.submitted)
        else:
            for key, view in zip(job.submitted, views):
                flat = flat_byte_view(view, writable=kind == "get")
                if flat is None or not self._acceptable(key, flat):
                    job.refused.append(key)
                else:
                    job.keys.append(key)
                    job.views.append(flat)
        if job.refused:
            self._counters.add(**{f"{kind}_failures": len(job.refused)})
        if job.keys:
            return job
        self._push(JobResult(job_id, (), tuple(job.refused), 0, 0.0))
        return None

    def _acceptable(self, key: bytes, view: memoryview) -> bool:
        return self._storable(key) and 0 < view.nbytes <= self.context.chunk_bytes

    def _storable(self, key: Any) -> bool:
        """A key of this namespace that LMDB and the frame format can hold."""
        return (
            isinstance(key, bytes)
            and key.startswith(self.context.namespace)
            and len(key) <= self._max_key
        )

    def _push(self, result: JobResult) -> None:
        with self._results_lock:
            self._results.append(result)

    # ------------------------------------------------------------------ I/O threads
    def _run(self, job: Job) -> None:
        """Run one job to its JobResult; nothing escapes into the thread."""
        start = time.perf_counter()
        try:
            ok, failed, moved = self._attempt(job)
        except Exception:  # a bug or an unforeseen LMDB state: the job fails, the tier lives
            logger.exception("lmdb tier: %s job %d failed", job.kind, job.job_id)
            ok, failed, moved = [], list(job.keys), 0
            self._counters.add(**{f"{job.kind}_failures": len(failed)})
        finally:
            if job.kind == "delete":
                self._forget_deleting(job.keys)
        if job.kind != "delete":
            failed = _in_order(job, failed)
            self._push(JobResult(job.job_id, tuple(ok), tuple(failed), moved,
                                 time.perf_counter() - start))
        job.views.clear()  # no reference to the caller's buffers outlives the job

    def _attempt(self, job: Job) -> _Outcome:
        """Run the job; if another process grew the map past ours, adopt it and run once more."""
        run = {"put": self._put, "get": self._get, "delete": self._delete}[job.kind]
        try:
            return run(job)
        except lmdb.MapResizedError:
            self._shared.adopt_grown_map()
            return run(job)

    def _put(self, job: Job) -> _Outcome:
        try:
            return self._with_room(self._put_txn, job)
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
        return [], list(job.keys), 0

    def _with_room(self, txn_body: Callable[[Job], _Outcome], job: Job) -> _Outcome:
        """Run a write transaction; if the map is full, make room once and run it again.

        LMDB reuses the pages a transaction freed only from the transaction after
        the next one on, and never while a reader (even one whose process died)
        still sees them. So a put right after the delete that made room for it
        finds the map full; an aborted transaction advances nothing. Making room:
        clear dead readers' slots and commit a tiny transaction, after which the
        pages freed before it are free to take.
        """
        try:
            return txn_body(job)
        except lmdb.MapFullError:
            self._env.reader_check()
            with self._gate.shared(), self._env.begin(write=True) as txn:
                txn.put(_TICK_KEY, time.time_ns().to_bytes(8, "little"))
            return txn_body(job)

    def _put_txn(self, job: Job) -> _Outcome:
        """One write transaction: frame and put every chunk that fits the budget."""
        ok: list[bytes] = []
        over: list[bytes] = []
        moved = 0
        with self._gate.shared(), self._env.begin(db=self._db, write=True) as txn:
            held = txn.stat(self._db)["entries"]
            cursor = txn.cursor()
            for key, view in zip(job.keys, job.views):
                present = cursor.set_key(key)
                if not present and held >= self.capacity_chunks:
                    over.append(key)
                    continue
                txn.put(key, self._framer.frame(key, view))
                held += not present
                ok.append(key)
                moved += view.nbytes
        self._counters.add(puts=len(ok), put_failures=len(over))
        return ok, over, moved

    def _get(self, job: Job) -> _Outcome:
        if self._current_db() is None:  # read-only, and no writer created the namespace yet
            self._counters.add(get_failures=len(job.keys))
            return [], list(job.keys), 0
        try:
            ok, failed, moved, corrupt = self._get_txn(job)
        except lmdb.MapResizedError:
            raise
        except lmdb.Error as exc:
            logger.warning("lmdb tier: get job %d failed: %s", job.job_id, exc)
            self._counters.add(get_failures=len(job.keys))
            return [], list(job.keys), 0
        self._counters.add(gets=len(ok), get_failures=len(failed), checksum_failures=corrupt)
        return ok, failed, moved

    def _get_txn(self, job: Job) -> tuple[list[bytes], list[bytes], int, int]:
        """One read transaction: verify each frame in the map, then copy its payload out."""
        ok: list[bytes] = []
        failed: list[bytes] = []
        moved = corrupt = 0
        with self._gate.shared(), self._env.begin(db=self._db, buffers=True) as txn:
            for key, view in zip(job.keys, job.views):
                frame = None if key in self._deleting else txn.get(key)
                if frame is None:
                    outcome = Load.MISSING
                else:
                    outcome = self._framer.unframe(key, frame, view)
                if outcome is Load.OK:
                    ok.append(key)
                    moved += view.nbytes
                else:
                    failed.append(key)
                    corrupt += outcome is Load.CORRUPT
        return ok, failed, moved, corrupt

    def _delete(self, job: Job) -> _Outcome:
        try:
            self._with_room(self._delete_txn, job)
        except lmdb.MapResizedError:
            raise
        except lmdb.Error as exc:  # the chunks stay; a restart's recover() lists them again
            logger.warning("lmdb tier: deleting %d chunks failed: %s", len(job.keys), exc)
            self._counters.add(delete_failures=len(job.keys))
        return [], [], 0

    def _delete_txn(self, job: Job) -> _Outcome:
        with self._gate.shared(), self._env.begin(db=self._db, write=True) as txn:
            for key in job.keys:
                txn.delete(key)
        return [], [], 0

    def _forget_deleting(self, keys: list[bytes]) -> None:
        with self._deleting_lock:
            for key in keys:
                left = self._deleting.get(key, 0) - 1
                if left > 0:
                    self._deleting[key] = left
                else:
                    self._deleting.pop(key, None)

    # ------------------------------------------------------------------ environment
    def _open_db(self, create: bool) -> Any:
        """This namespace's and rank's sub-database; None if read-only and not created yet."""
        name = database_name(self.context.namespace, self.context.rank)
        try:
            with self._gate.shared():
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

    # ------------------------------------------------------- owner-thread reads
    def _owner_read(self, txn_body: Callable[..., _T], *args: Any, default: _T) -> _T:
        """A short read on the owner's thread: never raises, ``default`` when there is nothing."""
        try:
            if self._closed or self._current_db() is None:
                return default
            try:
                return txn_body(*args)
            except lmdb.MapResizedError:
                self._shared.adopt_grown_map()
                return txn_body(*args)
        except lmdb.Error as exc:
            logger.warning("lmdb tier: %s failed: %s", txn_body.__name__.strip("_"), exc)
            return default

    def _contains_txn(self, keys: Sequence[bytes]) -> list[bool]:
        with self._gate.shared(), self._env.begin(db=self._db, buffers=True) as txn:
            cursor = txn.cursor()
            return [
                self._storable(key) and key not in self._deleting and cursor.set_key(key)
                for key in map(as_key_bytes, keys)
            ]

    def _recover_txn(self) -> list[bytes]:
        namespace = self.context.namespace
        with self._gate.shared(), self._env.begin(db=self._db) as txn:
            keys = txn.cursor().iternext(keys=True, values=False)
            return [key for key in keys if key.startswith(namespace)]

    def _held_chunks_txn(self) -> int:
        with self._gate.shared(), self._env.begin(db=self._db) as txn:
            return int(txn.stat(self._db)["entries"])


def _in_order(job: Job, failed: list[bytes]) -> list[bytes]:
    """The job's failed keys, those refused at intake included, in submission order."""
    if not job.refused:
        return failed
    gone = set(failed).union(job.refused)
    return [key for key in job.submitted if key in gone]
