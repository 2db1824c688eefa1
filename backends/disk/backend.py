"""The disk tier: one file per chunk under a namespaced directory tree.

The code is split in modules: this one (:class:`DiskBackend`: start-up,
the Backend calls, job submission), :mod:`tiercache.backends.disk.settings`
(the options, re-exported here), :mod:`tiercache.backends.disk.index` (the
index, the free pool, the byte budget, the job record),
:mod:`tiercache.backends.disk.tasks` (what the pool threads run: one task
per key, a job's completion and fsync), :mod:`tiercache.backends.disk.layout`
(the tree's layout and file names, and the warm-restart scan) and
:mod:`tiercache.backends.disk.file_io` (frame reads and writes, the I/O-mode
probe, syncs and other file-system helpers).

Layout, in short: ``<root>/<namespace hex>/rank<r>/<fan-out>/<key hex>.chunk``
for chunks and ``.../rank<r>/free/<name>.free`` for files kept for reuse. Each
chunk file holds one *aligned frame* of :mod:`tiercache.integrity`: a 4 KiB
header block (magic, version, namespace digest, key, payload length, xxh3_64
checksum), then the payload padded to 4 KiB, so every file has the same size.

I/O mode, chosen once at start-up and logged: O_DIRECT where the filesystem
accepts it, plain buffered I/O where it refuses (``direct_io: auto``); ``on``
makes a refusal a start-up error, ``off`` never tries (see
:func:`~tiercache.backends.disk.file_io.choose_io_mode`).

Atomic writes: a frame is written under a name no reader looks at (a fresh
``<key hex>.chunk.<tag>.tmp`` in the chunk's directory, or a file of the free
pool) and then renamed over the chunk's name, so a reader (this process or the
next) sees the old chunk, no chunk, or the whole new one. ``fsync``: ``none``
(after a power cut the newest chunks may be missing or fail their checksum,
never served wrong), ``batch`` (before a put job is reported, one ``syncfs`` of
the tier's filesystem makes its files and renames durable, shared by the jobs
that finish meanwhile; where syncfs is missing, each file is fdatasynced and
each directory fsynced once; syncfs also writes back other processes' dirty
pages on that filesystem), ``always`` (each file is fdatasynced before its
rename, and its directory fsynced after). A rename that became durable before
its data cannot serve wrong bytes: the frame's key and checksum are verified.

Reuse (``reuse_files``, on by default): a deleted chunk's file is renamed into
``free/`` and the next store overwrites it in place, so a store in a full
cache creates no file and allocates no block (on ext4 that roughly doubles
small-chunk store throughput, and deleting becomes a rename instead of an
unlink that may wait for a discard). Free files stay inside the byte budget.
With ``reuse_files: false`` a delete unlinks the file and the space goes back
to the filesystem at once.

Budget: every file the tier owns costs its frame size (payload rounded up to 4
KiB, plus 4 KiB of header): chunks, free files, and files being written. A put
takes a free file or reserves a new frame; if neither is possible it fails
that key (so rewriting a stored key in a full tier fails: for a moment both
versions exist). ``bytes_used`` in :meth:`DiskBackend.stats` never exceeds
``context.capacity_bytes``.

Warm restart: constructing the backend scans the tree (names and sizes only,
see :func:`~tiercache.backends.disk.layout.scan_tree`) and rebuilds the index;
:meth:`DiskBackend.recover` returns the keys found, oldest first. A chunk that
fails verification on load (checksum, header, size) or has vanished is a
failed key plus a counter, and is dropped from the index at the next poll.

Threads and buffers: ``submit_put``, ``submit_get``, ``poll``, ``delete``,
``recover``, ``stats`` and ``close`` run on the owner's thread; the I/O (open,
write, read, checksum, rename, fsync) runs on ``io_threads`` pool threads, one
task per key. A pool thread reads from (put) or writes into (get) the caller's
view only while its job is unreported; the job drops its references to the
views before its JobResult is published. Each pool thread owns an aligned
header block and bounce buffer (anonymous mmaps, in
:class:`~tiercache.backends.disk.file_io.FrameIO`). The index, the free pool, the
byte count and the counters are guarded by one lock.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tiercache.backend import Backend, BackendContext, JobResult
from tiercache.backends.disk.file_io import (
    DIRECT,
    FrameIO,
    choose_io_mode,
    find_syncfs,
    is_flat,
    make_tree,
)
from tiercache.backends.disk.index import COUNTERS, Job, Outcome
from tiercache.backends.disk.layout import (
    CHUNK_SUFFIX,  # noqa: F401 (still importable from here)
    FANOUT,
    FREE_DIR,
    FREE_SUFFIX,  # noqa: F401 (still importable from here)
    MAX_KEY_BYTES,
    chunk_path,
)
from tiercache.backends.disk.settings import DiskSettings, check_context
from tiercache.backends.disk.tasks import DiskTasks

logger = logging.getLogger(__name__)


class DiskBackend(DiskTasks, Backend):
    """Chunks as files: aligned, checksummed frames; O_DIRECT or buffered; poll-based."""

    name = "disk"
    settings_model = DiskSettings
    verifies_integrity = True  # aligned frames, checked on every load

    def __init__(self, settings: DiskSettings, context: BackendContext) -> None:
        check_context(context)
        self.settings = settings
        self.context = context
        self.chunk_bytes = context.chunk_bytes
        self.capacity_bytes = context.capacity_bytes
        self.directory = Path(settings.root) / context.namespace.hex() / f"rank{context.rank}"
        self._dir = str(self.directory)
        self._fan_dirs = [f"{self._dir}/{i:02x}" for i in range(FANOUT)]
        self._free_dir = f"{self._dir}/{FREE_DIR}"
        make_tree(self.directory, [self._free_dir], context.tier_name)  # fan-outs: on first use
        self.direct = choose_io_mode(self._dir, settings.direct_io, context.tier_name)
        extra = DIRECT if self.direct else 0
        self._open_new = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | extra
        self._open_reuse = os.O_WRONLY | os.O_CLOEXEC | extra
        self._frames = FrameIO(context.chunk_bytes, context.namespace, self.direct)
        self.frame_bytes = self._frames.frame_bytes
        self._tag = f"{os.getpid()}-{os.urandom(3).hex()}"  # names no earlier run can have used
        self._seq = itertools.count()
        self._gen = itertools.count(1)
        self._lock = threading.Lock()
        self._syncfs = _SYNCFS  # read at open from this module (tests patch it)
        self._sync_lock = threading.Lock()  # fsync=batch: one syncfs at a time
        self._sync_ticket = 0  # put jobs that asked for a sync (under _lock)
        self._synced_upto = 0  # tickets a finished sync covered (under _sync_lock)
        self._index: dict[bytes, int] = {}  # key -> generation of its committed file
        self._pending: dict[bytes, bool] = {}  # key being written -> doomed (deleted meanwhile)
        self._readers: dict[bytes, int] = {}  # key -> gets in flight
        self._free: list[str] = []  # files kept for reuse
        self._quarantine: list[tuple[bytes, int]] = []
        self._results: list[JobResult] = []
        self._bytes_used = 0
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._closed = False
        started = time.perf_counter()
        self._scan()
        self.scan_secs = time.perf_counter() - started
        self._pool = ThreadPoolExecutor(
            max_workers=settings.io_threads,
            thread_name_prefix=f"tiercache-disk-{context.tier_name}",
        )
        logger.info(
            "disk tier %s: %s I/O in %s (fsync=%s, %d threads); %d chunks and %d free files "
            "found in %.3fs",
            context.tier_name,
            self.io_mode,
            self._dir,
            settings.fsync,
            settings.io_threads,
            len(self._index),
            len(self._free),
            self.scan_secs,
        )

    # ------------------------------------------------------------------ inspection
    @property
    def io_mode(self) -> str:
        """``"direct"`` (O_DIRECT) or ``"buffered"``, as chosen at start-up."""
        return "direct" if self.direct else "buffered"

    def path_of(self, key: bytes) -> str:
        """The file that holds ``key`` (whether or not it exists)."""
        return chunk_path(self._fan_dirs, key)

    def stats(self) -> dict[str, int]:
        """Counters since start-up, and ``bytes_used`` / ``chunks`` / ``free_files`` now."""
        with self._lock:
            out = dict(self._counters)
            out["bytes_used"] = self._bytes_used
            out["chunks"] = len(self._index)
            out["free_files"] = len(self._free)
        return out

    # ------------------------------------------------------------------ Backend API
    def submit_put(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        job = self._new_job(job_id, True, keys, views)
        with self._lock:
            for i, key in enumerate(job.keys):
                if job.outcome[i] is Outcome.OK:
                    self._admit_put(job, i, key)
        self._launch(job)

    def submit_get(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        job = self._new_job(job_id, False, keys, views)
        with self._lock:
            for i, key in enumerate(job.keys):
                gen = self._index.get(key)
                if job.outcome[i] is not Outcome.OK:
                    continue
                if gen is None:
                    job.outcome[i] = Outcome.FAILED
                    self._counters["misses"] += 1
                    continue
                job.gens[i] = gen
                job.admitted[i] = True
                self._readers[key] = self._readers.get(key, 0) + 1
        self._launch(job)

    def poll(self) -> list[JobResult]:
        with self._lock:
            results, self._results = self._results, []
            dropped, self._quarantine = self._quarantine, []
            for key, gen in dropped:
                self._drop_if_current(key, gen)
        return results

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._index for k in keys]

    def delete(self, keys: Sequence[bytes]) -> None:
        """Forget ``keys``; their space is free for new chunks when this returns.

        With ``reuse_files`` each file is renamed into the free pool; without,
        it is unlinked (on the caller's thread, outside the lock the I/O
        threads need).
        """
        victims: list[tuple[str, bool]] = []
        with self._lock:
            for key in keys:
                if key in self._pending:
                    self._pending[key] = True  # its writer disposes of the new file when it ends
                if self._index.pop(key, None) is not None:
                    victims.append((self.path_of(key), self._may_keep(key)))
        moved = [self._move_away(path, keep) for path, keep in victims]
        with self._lock:
            for free in moved:
                self._account_moved(free)

    def recover(self) -> Iterable[bytes]:
        """Keys on disk when the tier was opened (oldest first), then any stored since."""
        with self._lock:
            return list(self._index)

    def close(self) -> None:
        """Wait for in-flight I/O, then release the threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            self._results.clear()

    # ------------------------------------------------------------------ submission
    def _new_job(
        self, job_id: int, is_put: bool, keys: Sequence[bytes], views: Sequence[memoryview]
    ) -> Job:
        if self._closed:
            raise RuntimeError(f"disk tier {self.context.tier_name} is closed")
        if len(keys) != len(views):
            raise ValueError(f"{len(keys)} keys but {len(views)} views")
        keys = [bytes(k) for k in keys]
        flat = [self._usable_view(k, v, writable=not is_put) for k, v in zip(keys, views)]
        n = len(keys)
        return Job(
            "put" if is_put else "get",
            job_id,
            keys,
            flat,  # type: ignore[arg-type] # None where the key failed at once (never read)
            outcome=[Outcome.OK if v is not None else Outcome.FAILED for v in flat],
            admitted=[False] * n,
            sources=[None] * n,
            gens=[0] * n,
        )

    def _usable_view(self, key: bytes, view: memoryview, writable: bool) -> memoryview | None:
        """``view`` as flat bytes if it can hold a chunk of this tier (else None: the key fails)."""
        try:
            whole = memoryview(view)
            flat = whole if is_flat(whole) else whole.cast("B")
        except (TypeError, ValueError):
            return None
        if not 0 < len(key) <= MAX_KEY_BYTES or len(flat) != self.chunk_bytes:
            return None
        if writable and flat.readonly:
            return None
        return flat

    def _launch(self, job: Job) -> None:
        todo = [i for i, o in enumerate(job.outcome) if o is Outcome.OK]
        job.remaining = len(todo)  # before any task exists: no other thread sees the job yet
        if not todo:
            self._finish(job)
            return
        task = self._put_task if job.kind == "put" else self._get_task
        for i in todo:
            self._pool.submit(task, job, i)


_SYNCFS = find_syncfs()  # read by each backend as it opens (tests patch it)
