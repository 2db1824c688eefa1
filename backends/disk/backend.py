"""The disk tier: one file per chunk under a namespaced directory tree.

The code is split in three modules: this one (:class:`DiskBackend`: the
index, the free pool, the byte budget, jobs and their threads),
:mod:`tiercache.backends.disk.layout` (the tree's layout and file names, and
the warm-restart scan) and :mod:`tiercache.backends.disk.file_io` (frame reads and
writes, the I/O-mode probe, syncs and other file-system helpers).

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
from typing import Literal

from pydantic import Field

from tiercache.backend import Backend, BackendContext, BackendSettings, JobResult
from tiercache.backends.disk.index import COUNTERS, DiskIndex, Job, Outcome
from tiercache.backends.disk.file_io import (
    DIRECT,
    FrameIO,
    choose_io_mode,
    find_syncfs,
    fsync_dir,
    is_flat,
    make_tree,
    rename_into,
    syncfs,
    unlink,
)
from tiercache.backends.disk.layout import (
    CHUNK_SUFFIX,  # noqa: F401 (still importable from here)
    FANOUT,
    FREE_DIR,
    FREE_SUFFIX,  # noqa: F401 (still importable from here)
    MAX_KEY_BYTES,
    TMP_SUFFIX,
    chunk_path,
)
from tiercache.config.schema import ConfigError
from tiercache.integrity import ChecksumMismatch, IntegrityError

logger = logging.getLogger(__name__)


class DiskSettings(BackendSettings):
    """Options of a disk tier (``options:`` of a ``backend: disk`` tier in YAML)."""

    root: Path = Field(description="Directory holding the tier; namespaced sub-trees go under it.")
    io_threads: int = Field(
        default=4, ge=1, le=64, description="Worker threads doing the file I/O."
    )
    fsync: Literal["none", "batch", "always"] = Field(
        default="batch",
        description="none: never; batch: a job's files and directories before it is reported; "
        "always: every file and its directory as it is written.",
    )
    direct_io: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="O_DIRECT I/O: auto = where the filesystem allows it (else buffered), "
        "on = required (start-up error otherwise), off = buffered I/O.",
    )
    reuse_files: bool = Field(
        default=True,
        description="Keep deleted chunks' files (inside the budget) and overwrite them in place "
        "for new chunks; false: unlink them, returning the space to the filesystem at once.",
    )


class DiskBackend(DiskIndex, Backend):
    """Chunks as files: aligned, checksummed frames; O_DIRECT or buffered; poll-based."""

    name = "disk"
    settings_model = DiskSettings
    verifies_integrity = True  # aligned frames, checked on every load

    def __init__(self, settings: DiskSettings, context: BackendContext) -> None:
        _check_context(context)
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
        keys = tuple(bytes(k) for k in keys)
        flat = [self._usable_view(k, v, writable=not is_put) for k, v in zip(keys, views)]
        n = len(keys)
        return Job(
            job_id,
            is_put,
            keys,
            flat,
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
        task = self._put_task if job.is_put else self._get_task
        for i in todo:
            self._pool.submit(task, job, i)

    # ------------------------------------------------------------------ pool threads
    def _put_task(self, job: Job, i: int) -> None:
        key, view = job.keys[i], job.views[i]
        path = self.path_of(key)
        staged: str | None = None
        outcome = Outcome.FAILED
        try:
            fd, staged = self._open_for_write(job, i, path)
            try:
                self._write_frame(fd, key, view)  # type: ignore[arg-type]
            finally:
                os.close(fd)
            rename_into(staged, path)
            outcome = Outcome.FAILED_RENAMED
            if self.settings.fsync == "always":
                fsync_dir(os.path.dirname(path))
            outcome = Outcome.OK
        except OSError as exc:
            self._count_os_error(exc, "put", path)
        except Exception:  # a bug must still end the job, never hang it
            logger.exception("disk tier %s: put of %s failed", self.context.tier_name, path)
        if outcome is Outcome.FAILED and staged is not None and staged != job.sources[i]:
            unlink(staged)  # our half-written temporary file
        self._key_done(job, i, outcome)

    def _open_for_write(self, job: Job, i: int, path: str) -> tuple[int, str]:
        """Open the free file the key took, or else a new temporary file next to ``path``."""
        source = job.sources[i]
        if source is not None:
            try:
                return os.open(source, self._open_reuse), source
            except FileNotFoundError:
                job.sources[i] = None  # removed behind our back: its unit is a new file's now
        tmp = f"{path}.{self._tag}-{next(self._seq)}{TMP_SUFFIX}"
        try:
            return os.open(tmp, self._open_new, 0o644), tmp
        except FileNotFoundError:  # the first chunk in its fan-out directory
            os.makedirs(os.path.dirname(path), exist_ok=True)
            return os.open(tmp, self._open_new, 0o644), tmp

    def _write_frame(self, fd: int, key: bytes, view: memoryview) -> None:
        """Write the aligned frame of ``key`` at offset 0; fdatasync it if ``fsync`` asks."""
        self._frames.write(fd, key, view)
        if self.settings.fsync == "always" or (self.settings.fsync == "batch" and not _SYNCFS):
            os.fdatasync(fd)

    def _get_task(self, job: Job, i: int) -> None:
        key, view = job.keys[i], job.views[i]
        path = self.path_of(key)
        outcome = Outcome.FAILED
        try:
            self._frames.read(path, key, view)  # type: ignore[arg-type]
            outcome = Outcome.OK
        except FileNotFoundError:  # removed behind our back: forget it too
            self._count("misses")
            self._quarantine_key(key, job.gens[i])
        except IntegrityError as exc:
            self._count(
                "checksum_failures" if isinstance(exc, ChecksumMismatch) else "malformed_frames"
            )
            logger.warning("disk tier %s: %s: %s", self.context.tier_name, path, exc)
            self._quarantine_key(key, job.gens[i])
        except OSError as exc:
            self._count_os_error(exc, "get", path)
        except Exception:
            logger.exception("disk tier %s: get of %s failed", self.context.tier_name, path)
        self._key_done(job, i, outcome)

    # ------------------------------------------------------------------ completion
    def _key_done(self, job: Job, i: int, outcome: Outcome) -> None:
        with self._lock:
            job.outcome[i] = outcome
            job.remaining -= 1
            last = job.remaining == 0
        if last:
            self._finish(job)

    def _finish(self, job: Job) -> None:
        """Runs once per job, on the thread that ended its last key (or the submitter)."""
        if job.is_put and self.settings.fsync == "batch":
            self._sync_job(job)
        with self._lock:
            if job.is_put:
                self._commit_puts(job)
            else:
                self._release_readers(job)
            ok = tuple(k for k, o in zip(job.keys, job.outcome) if o is Outcome.OK)
            failed = tuple(k for k, o in zip(job.keys, job.outcome) if o is not Outcome.OK)
            op = "puts" if job.is_put else "gets"
            self._counters[op] += len(ok)
            self._counters[op[:-1] + "_failures"] += len(failed)
            job.views.clear()  # never keep a caller's view past its JobResult
            self._results.append(
                JobResult(
                    job.job_id,
                    ok,
                    failed,
                    len(ok) * self.chunk_bytes,
                    time.perf_counter() - job.start,
                )
            )

    def _sync_job(self, job: Job) -> None:
        """fsync=batch: make a put job's files and renames durable before it is reported.

        On Linux one ``syncfs`` of the tier's filesystem does it, shared by every
        job whose renames were done when it started (group commit: concurrent
        jobs wait for one sync instead of issuing their own). Elsewhere, the
        files were fdatasynced before their renames and each directory the
        job renamed into is fsynced once.
        """
        if _SYNCFS:
            self._group_sync(job)
            return
        dirs: dict[str, list[int]] = {}
        for i, key in enumerate(job.keys):
            if job.outcome[i] is Outcome.OK:
                dirs.setdefault(os.path.dirname(self.path_of(key)), []).append(i)
        for directory, members in dirs.items():
            try:
                fsync_dir(directory)
            except OSError as exc:
                self._count_os_error(exc, "fsync", directory)
                for i in members:
                    job.outcome[i] = Outcome.FAILED_RENAMED

    def _group_sync(self, job: Job) -> None:
        with self._lock:
            self._sync_ticket += 1
            ticket = self._sync_ticket  # every rename this job made happened before this
        with self._sync_lock:
            if self._synced_upto >= ticket:
                return  # a sync that started after our renames has finished
            with self._lock:
                covers = self._sync_ticket
            try:
                syncfs(self._dir, _SYNCFS)
            except OSError as exc:
                self._count_os_error(exc, "fsync", self._dir)
                for i, outcome in enumerate(job.outcome):
                    if outcome is Outcome.OK:
                        job.outcome[i] = Outcome.FAILED_RENAMED
                return
            self._synced_upto = covers


# ---------------------------------------------------------------------------- start-up
def _check_context(context: BackendContext) -> None:
    if len(context.namespace) != 8:
        raise ConfigError(f"disk tier {context.tier_name}: namespace digest must be 8 bytes")
    if context.chunk_bytes <= 0 or context.capacity_bytes < 0:
        raise ConfigError(
            f"disk tier {context.tier_name}: chunk_bytes {context.chunk_bytes} and capacity "
            f"{context.capacity_bytes} must be positive"
        )


_SYNCFS = find_syncfs()  # read through this module at call time (tests patch it)
