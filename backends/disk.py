"""The disk tier: one file per chunk under a namespaced directory tree.

Layout (one tree per engine namespace and TP rank; engines whose namespaces
differ never share a file)::

    <root>/<namespace hex>/rank<r>/<fan-out>/<key hex>.chunk   chunks
    <root>/<namespace hex>/rank<r>/free/<name>.free             files kept for reuse

``<fan-out>`` is two hex digits of a hash of the key (up to 256 directories,
each made on first use, so no directory grows past a few thousand entries).
Each chunk file holds one *aligned frame* of :mod:`tiercache.integrity`: a 4
KiB header block (magic, version, namespace digest, key, payload length,
xxh3_64 checksum), then the payload padded to 4 KiB. Every file therefore has
the same size, which is what lets a restart check a file without reading it.

I/O mode, chosen once at start-up and logged: O_DIRECT (no page cache; every
buffer, offset and length a multiple of 4 KiB) where the filesystem accepts it,
plain buffered I/O where it refuses (``direct_io: auto``); ``on`` makes a
refusal a start-up error, ``off`` never tries. With O_DIRECT, a view that is
page-aligned and a multiple of 4 KiB long (a pinned slab's slots are) is
written and read in place; any other view goes through the I/O thread's aligned
bounce buffer.

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

Warm restart: constructing the backend scans the tree with ``scandir`` (names
and sizes only, no chunk body is read), removes leftover ``.tmp`` files and
files of the wrong size (truncated), keeps the free files, trims free files and
then the oldest chunks if the tree is over budget, and rebuilds the index;
:meth:`DiskBackend.recover` returns the keys found, oldest first. A chunk that
fails verification on load (checksum, header, size) or has vanished is a
failed key plus a counter, and is dropped from the index at the next poll.

Threads and buffers: ``submit_put``, ``submit_get``, ``poll``, ``delete``,
``recover``, ``stats`` and ``close`` run on the owner's thread; the I/O (open,
write, read, checksum, rename, fsync) runs on ``io_threads`` pool threads, one
task per key. A pool thread reads from (put) or writes into (get) the caller's
view only while its job is unreported; the job drops its references to the
views before its JobResult is published. Each pool thread owns an aligned
header block and bounce buffer (anonymous mmaps). The index, the free pool,
the byte count and the counters are guarded by one lock.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Literal

import numpy as np
import xxhash
from pydantic import Field

from tiercache.backend import Backend, BackendContext, BackendSettings, JobResult
from tiercache.config import ConfigError
from tiercache.integrity import (
    ALIGN,
    ChecksumMismatch,
    FrameFormatError,
    IntegrityError,
    aligned_frame_bytes,
    pack_header,
    verify_frame,
)

logger = logging.getLogger(__name__)

CHUNK_SUFFIX = ".chunk"
TMP_SUFFIX = ".tmp"
FREE_SUFFIX = ".free"
FREE_DIR = "free"
FANOUT = 256
MAX_KEY_BYTES = 100  # key hex + suffixes must fit a 255-byte file name
_DIRECT = getattr(os, "O_DIRECT", 0)
_NOSPACE = (errno.ENOSPC, errno.EDQUOT)


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


class _Outcome(Enum):
    OK = 0
    FAILED = 1  # the chunk's name was not touched
    FAILED_RENAMED = 2  # our file was renamed over the chunk's name, then something failed


@dataclass(eq=False, slots=True)
class _Job:
    """A submitted job until it is reported; its views are dropped when it is."""

    job_id: int
    is_put: bool
    keys: tuple[bytes, ...]
    views: list[memoryview | None]
    outcome: list[_Outcome]
    admitted: list[bool]  # put: holds the key's write slot and one budget unit; get: a reader
    sources: list[str | None]  # put: the free file to overwrite (None: create a new file)
    gens: list[int]  # get: index generation seen at submission
    remaining: int = 0
    start: float = field(default_factory=time.perf_counter)


class _IOBuffers(threading.local):
    """Per-thread aligned memory: one header block and one payload bounce buffer."""

    header_map: mmap.mmap | None = None
    bounce_map: mmap.mmap | None = None
    header: memoryview
    bounce: memoryview
    bounce_np: np.ndarray


class DiskBackend(Backend):
    """Chunks as files: aligned, checksummed frames; O_DIRECT or buffered; poll-based."""

    name = "disk"
    settings_model = DiskSettings

    def __init__(self, settings: DiskSettings, context: BackendContext) -> None:
        _check_context(context)
        self.settings = settings
        self.context = context
        self.chunk_bytes = context.chunk_bytes
        self.capacity_bytes = context.capacity_bytes
        self.frame_bytes = aligned_frame_bytes(context.chunk_bytes)
        self._padded = self.frame_bytes - ALIGN
        self.directory = Path(settings.root) / context.namespace.hex() / f"rank{context.rank}"
        self._dir = str(self.directory)
        self._fan_dirs = [f"{self._dir}/{i:02x}" for i in range(FANOUT)]
        self._free_dir = f"{self._dir}/{FREE_DIR}"
        _make_tree(self.directory, [self._free_dir], context.tier_name)  # fan-outs: on first use
        self.direct = _choose_io_mode(self._dir, settings.direct_io, context.tier_name)
        extra = _DIRECT if self.direct else 0
        self._open_new = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | extra
        self._open_reuse = os.O_WRONLY | os.O_CLOEXEC | extra
        self._open_read = os.O_RDONLY | os.O_CLOEXEC | extra
        self._tail = memoryview(bytes(self._padded - self.chunk_bytes))
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
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._tls = _IOBuffers()
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
        return f"{self._fan_dirs[_fan(key)]}/{key.hex()}{CHUNK_SUFFIX}"

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
                if job.outcome[i] is _Outcome.OK:
                    self._admit_put(job, i, key)
        self._launch(job)

    def submit_get(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        job = self._new_job(job_id, False, keys, views)
        with self._lock:
            for i, key in enumerate(job.keys):
                gen = self._index.get(key)
                if job.outcome[i] is not _Outcome.OK:
                    continue
                if gen is None:
                    job.outcome[i] = _Outcome.FAILED
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
    ) -> _Job:
        if self._closed:
            raise RuntimeError(f"disk tier {self.context.tier_name} is closed")
        if len(keys) != len(views):
            raise ValueError(f"{len(keys)} keys but {len(views)} views")
        keys = tuple(bytes(k) for k in keys)
        flat = [self._usable_view(k, v, writable=not is_put) for k, v in zip(keys, views)]
        n = len(keys)
        return _Job(
            job_id,
            is_put,
            keys,
            flat,
            outcome=[_Outcome.OK if v is not None else _Outcome.FAILED for v in flat],
            admitted=[False] * n,
            sources=[None] * n,
            gens=[0] * n,
        )

    def _usable_view(self, key: bytes, view: memoryview, writable: bool) -> memoryview | None:
        """``view`` as flat bytes if it can hold a chunk of this tier (else None: the key fails)."""
        try:
            whole = memoryview(view)
            flat = whole if _is_flat(whole) else whole.cast("B")
        except (TypeError, ValueError):
            return None
        if not 0 < len(key) <= MAX_KEY_BYTES or len(flat) != self.chunk_bytes:
            return None
        if writable and flat.readonly:
            return None
        return flat

    def _admit_put(self, job: _Job, i: int, key: bytes) -> None:
        """Give one key of a put its write slot and a budget unit, or fail it (lock held)."""
        if key in self._pending:
            job.outcome[i] = _Outcome.FAILED  # one write of a key at a time; the first wins
            return
        if self._free:
            job.sources[i] = self._free.pop()
        elif self._bytes_used + self.frame_bytes <= self.capacity_bytes:
            self._bytes_used += self.frame_bytes
        else:
            job.outcome[i] = _Outcome.FAILED
            self._counters["over_budget"] += 1
            return
        job.admitted[i] = True
        self._pending[key] = False

    def _launch(self, job: _Job) -> None:
        todo = [i for i, o in enumerate(job.outcome) if o is _Outcome.OK]
        job.remaining = len(todo)  # before any task exists: no other thread sees the job yet
        if not todo:
            self._finish(job)
            return
        task = self._put_task if job.is_put else self._get_task
        for i in todo:
            self._pool.submit(task, job, i)

    # ------------------------------------------------------------------ pool threads
    def _put_task(self, job: _Job, i: int) -> None:
        key, view = job.keys[i], job.views[i]
        path = self.path_of(key)
        staged: str | None = None
        outcome = _Outcome.FAILED
        try:
            fd, staged = self._open_for_write(job, i, path)
            try:
                self._write_frame(fd, key, view)  # type: ignore[arg-type]
            finally:
                os.close(fd)
            _rename_into(staged, path)
            outcome = _Outcome.FAILED_RENAMED
            if self.settings.fsync == "always":
                _fsync_dir(os.path.dirname(path))
            outcome = _Outcome.OK
        except OSError as exc:
            self._count_os_error(exc, "put", path)
        except Exception:  # a bug must still end the job, never hang it
            logger.exception("disk tier %s: put of %s failed", self.context.tier_name, path)
        if outcome is _Outcome.FAILED and staged is not None and staged != job.sources[i]:
            _unlink(staged)  # our half-written temporary file
        self._key_done(job, i, outcome)

    def _open_for_write(self, job: _Job, i: int, path: str) -> tuple[int, str]:
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
        """Write the aligned frame of ``key`` (header block, payload, padding) at offset 0."""
        bufs = self._buffers()
        payload = view
        if self.direct and not _aligned(view):
            payload = bufs.bounce[: self._padded]
            np.copyto(bufs.bounce_np[: self.chunk_bytes], np.frombuffer(view, np.uint8))
            bufs.bounce_np[self.chunk_bytes : self._padded] = 0
        pack_header(bufs.header, self.context.namespace, key, payload[: self.chunk_bytes], ALIGN)
        pieces = [bufs.header, payload]
        if payload is view and self._tail:
            pieces.append(self._tail)
        _pwritev_all(fd, pieces)
        if self.settings.fsync == "always" or (self.settings.fsync == "batch" and not _SYNCFS):
            os.fdatasync(fd)

    def _get_task(self, job: _Job, i: int) -> None:
        key, view = job.keys[i], job.views[i]
        path = self.path_of(key)
        outcome = _Outcome.FAILED
        try:
            self._read_frame(path, key, view)  # type: ignore[arg-type]
            outcome = _Outcome.OK
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

    def _read_frame(self, path: str, key: bytes, view: memoryview) -> None:
        """Read and verify the frame of ``key`` into ``view`` (zeroed if read into and failed)."""
        bufs = self._buffers()
        in_place = not self.direct or _aligned(view)
        if in_place:
            payload = view
            pieces = [bufs.header, view]
            if self._tail:
                pieces.append(bufs.bounce[: len(self._tail)])  # padding: read, ignored
        else:
            payload = bufs.bounce[: self.chunk_bytes]
            pieces = [bufs.header, bufs.bounce[: self._padded]]
        fd = os.open(path, self._open_read)
        try:
            size = os.fstat(fd).st_size
            if size != self.frame_bytes:
                raise _truncated(size, self.frame_bytes)
            got = _preadv_all(fd, pieces)
            if got != self.frame_bytes:
                raise _truncated(got, self.frame_bytes)
            verify_frame(bufs.header, payload, self.context.namespace, key)
        except BaseException:
            if in_place:
                _zero(view)  # no damaged or partial bytes are left for the engine
            raise
        finally:
            os.close(fd)
        if not in_place:
            np.copyto(np.frombuffer(view, np.uint8), bufs.bounce_np[: self.chunk_bytes])

    def _buffers(self) -> _IOBuffers:
        bufs = self._tls
        if bufs.header_map is None:
            bufs.header_map = mmap.mmap(-1, ALIGN)
            bufs.bounce_map = mmap.mmap(-1, self._padded)
            bufs.header = memoryview(bufs.header_map)
            bufs.bounce = memoryview(bufs.bounce_map)
            bufs.bounce_np = np.frombuffer(bufs.bounce_map, np.uint8)
        return bufs

    # ------------------------------------------------------------------ completion
    def _key_done(self, job: _Job, i: int, outcome: _Outcome) -> None:
        with self._lock:
            job.outcome[i] = outcome
            job.remaining -= 1
            last = job.remaining == 0
        if last:
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        """Runs once per job, on the thread that ended its last key (or the submitter)."""
        if job.is_put and self.settings.fsync == "batch":
            self._sync_job(job)
        with self._lock:
            if job.is_put:
                self._commit_puts(job)
            else:
                self._release_readers(job)
            ok = tuple(k for k, o in zip(job.keys, job.outcome) if o is _Outcome.OK)
            failed = tuple(k for k, o in zip(job.keys, job.outcome) if o is not _Outcome.OK)
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

    def _sync_job(self, job: _Job) -> None:
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
            if job.outcome[i] is _Outcome.OK:
                dirs.setdefault(os.path.dirname(self.path_of(key)), []).append(i)
        for directory, members in dirs.items():
            try:
                _fsync_dir(directory)
            except OSError as exc:
                self._count_os_error(exc, "fsync", directory)
                for i in members:
                    job.outcome[i] = _Outcome.FAILED_RENAMED

    def _group_sync(self, job: _Job) -> None:
        with self._lock:
            self._sync_ticket += 1
            ticket = self._sync_ticket  # every rename this job made happened before this
        with self._sync_lock:
            if self._synced_upto >= ticket:
                return  # a sync that started after our renames has finished
            with self._lock:
                covers = self._sync_ticket
            try:
                _syncfs(self._dir)
            except OSError as exc:
                self._count_os_error(exc, "fsync", self._dir)
                for i, outcome in enumerate(job.outcome):
                    if outcome is _Outcome.OK:
                        job.outcome[i] = _Outcome.FAILED_RENAMED
                return
            self._synced_upto = covers

    def _commit_puts(self, job: _Job) -> None:
        """Index a finished put's keys, or undo them (lock held).

        Every admitted key holds one budget unit (a free file it took, or a
        reserved frame); this hands the unit to the index, back to the free
        pool, or back to the budget.
        """
        for i, key in enumerate(job.keys):
            if not job.admitted[i]:
                continue  # refused at submission: nothing reserved, nothing written
            doomed = self._pending.pop(key)
            outcome = job.outcome[i]
            if outcome is _Outcome.FAILED:  # the chunk's name was not touched
                if job.sources[i] is not None:
                    self._free.append(job.sources[i])  # type: ignore[arg-type]
                else:
                    self._bytes_used -= self.frame_bytes
                continue
            if key in self._index:  # our rename replaced the previous version's file
                del self._index[key]
                self._bytes_used -= self.frame_bytes
            if outcome is _Outcome.OK and not doomed:
                self._index[key] = next(self._gen)
                continue
            job.outcome[i] = _Outcome.FAILED
            self._account_moved(self._move_away(self.path_of(key), self._may_keep(key)))

    def _release_readers(self, job: _Job) -> None:
        for i, key in enumerate(job.keys):
            if job.admitted[i]:
                left = self._readers[key] - 1
                if left:
                    self._readers[key] = left
                else:
                    del self._readers[key]

    def _may_keep(self, key: bytes) -> bool:
        """Whether ``key``'s file may join the free pool (lock held): no get may be reading it."""
        return self.settings.reuse_files and key not in self._readers

    def _move_away(self, path: str, keep: bool) -> str | None:
        """Rename the file at ``path`` into the free pool (``keep``) or unlink it.

        Returns the free file's path if it was kept; None if it was unlinked or
        there was nothing at ``path`` (a racing delete or commit moved it first).
        """
        if keep:
            free = f"{self._free_dir}/{self._tag}-{next(self._seq)}{FREE_SUFFIX}"
            try:
                os.replace(path, free)
                return free
            except FileNotFoundError:
                return None
            except OSError as exc:
                logger.warning(
                    "disk tier %s: cannot keep %s: %s", self.context.tier_name, path, exc
                )
        _unlink(path)
        return None

    def _account_moved(self, free: str | None) -> None:
        """Book a file that :meth:`_move_away` handled: pooled, or off the budget (lock held)."""
        if free is not None:
            self._free.append(free)
        else:
            self._bytes_used -= self.frame_bytes

    def _quarantine_key(self, key: bytes, gen: int) -> None:
        """Have the owner's next poll drop ``key`` (its file failed to load)."""
        with self._lock:
            self._quarantine.append((key, gen))

    def _drop_if_current(self, key: bytes, gen: int) -> None:
        """Remove a chunk that failed to load, unless it was rewritten since (lock held)."""
        if key in self._pending or self._index.get(key) != gen:
            return
        del self._index[key]
        self._counters["quarantined"] += 1
        path = self.path_of(key)
        try:
            os.unlink(path)  # damaged: never reused
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("disk tier %s: cannot remove %s: %s", self.context.tier_name, path, exc)
        self._bytes_used -= self.frame_bytes

    # ------------------------------------------------------------------ start-up scan
    def _scan(self) -> None:
        """Rebuild the index and free pool from names and sizes (no chunk body is read)."""
        found: list[tuple[float, bytes]] = []
        for fan, directory in enumerate(self._fan_dirs):
            try:
                with os.scandir(directory) as entries:
                    for entry in entries:
                        item = self._scan_entry(entry, fan)
                        if item is not None:
                            found.append(item)
            except FileNotFoundError:
                continue  # created on first use
        with os.scandir(self._free_dir) as entries:
            for entry in entries:
                if _regular_size(entry) == self.frame_bytes and entry.name.endswith(FREE_SUFFIX):
                    self._free.append(entry.path)
                else:
                    _unlink(entry.path)
        found.sort()
        limit = self.capacity_bytes // self.frame_bytes
        while self._free and len(self._free) + len(found) > limit:  # over budget: free files go
            _unlink(self._free.pop())
        excess = max(0, len(found) - limit)
        for _, key in found[:excess]:  # then the oldest chunks
            _unlink(self.path_of(key))
        self._counters["dropped_on_recover"] += excess
        for _, key in found[excess:]:
            self._index[key] = next(self._gen)
        self._counters["recovered"] = len(self._index)
        self._bytes_used = (len(self._index) + len(self._free)) * self.frame_bytes

    def _scan_entry(self, entry: os.DirEntry[str], fan: int) -> tuple[float, bytes] | None:
        name = entry.name
        if name.endswith(TMP_SUFFIX):
            _unlink(entry.path)  # a write that never finished (killed mid-put)
            self._counters["tmp_removed"] += 1
            return None
        if not name.endswith(CHUNK_SUFFIX):
            return None
        try:
            key = bytes.fromhex(name[: -len(CHUNK_SUFFIX)])
            st = entry.stat(follow_symlinks=False)
        except (ValueError, OSError):
            return None
        if _fan(key) != fan or _regular_size(entry) != self.frame_bytes:
            _unlink(entry.path)  # truncated, misplaced or not ours
            self._counters["dropped_on_recover"] += 1
            return None
        return (st.st_mtime, key)

    # ------------------------------------------------------------------ counters
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _count_os_error(self, exc: OSError, op: str, path: str) -> None:
        if exc.errno in _NOSPACE:
            self._count("enospc")
            logger.warning(
                "disk tier %s: no space for %s (%s dropped)", self.context.tier_name, path, op
            )
        else:
            self._count("io_errors")
            logger.warning("disk tier %s: %s of %s: %s", self.context.tier_name, op, path, exc)


_COUNTERS = (
    "puts",
    "put_failures",
    "gets",
    "get_failures",
    "misses",
    "checksum_failures",
    "malformed_frames",
    "quarantined",
    "over_budget",
    "enospc",
    "io_errors",
    "recovered",
    "dropped_on_recover",
    "tmp_removed",
)


# ---------------------------------------------------------------------------- start-up
def _check_context(context: BackendContext) -> None:
    if len(context.namespace) != 8:
        raise ConfigError(f"disk tier {context.tier_name}: namespace digest must be 8 bytes")
    if context.chunk_bytes <= 0 or context.capacity_bytes < 0:
        raise ConfigError(
            f"disk tier {context.tier_name}: chunk_bytes {context.chunk_bytes} and capacity "
            f"{context.capacity_bytes} must be positive"
        )


def _make_tree(directory: Path, subdirs: list[str], tier: str) -> None:
    """Create the namespace/rank tree and its subdirectories; ConfigError naming the path."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for subdir in subdirs:
            os.makedirs(subdir, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"disk tier {tier}: cannot create {exc.filename or directory}: {exc.strerror or exc}"
        ) from exc


def _choose_io_mode(directory: str, want: str, tier: str) -> bool:
    """Probe O_DIRECT with one aligned write and read in ``directory``; True to use it."""
    buffered_error = _probe(directory, direct=False)
    if buffered_error is not None and buffered_error.errno not in _NOSPACE:
        raise ConfigError(
            f"disk tier {tier}: cannot write in {directory}: "
            f"{buffered_error.strerror or buffered_error}"
        )
    if want == "off":
        return False
    direct_error = _probe(directory, direct=True) if _DIRECT else OSError("no O_DIRECT here")
    if direct_error is None or direct_error.errno in _NOSPACE:
        return True
    if want == "on":
        raise ConfigError(
            f"disk tier {tier}: direct_io is on but {directory} refuses O_DIRECT: "
            f"{direct_error.strerror or direct_error}"
        )
    logger.info(
        "disk tier %s: %s refuses O_DIRECT (%s); using buffered I/O",
        tier,
        directory,
        direct_error.strerror or direct_error,
    )
    return False


def _probe(directory: str, direct: bool) -> OSError | None:
    """Write and read back one aligned block in a scratch file; the error, or None."""
    path = f"{directory}/.probe-{os.getpid()}-{threading.get_ident()}"
    block = mmap.mmap(-1, ALIGN)
    flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC | (_DIRECT if direct else 0)
    try:
        fd = os.open(path, flags, 0o644)
        try:
            os.pwrite(fd, block, 0)
            os.preadv(fd, [block], 0)
        finally:
            os.close(fd)
    except OSError as exc:
        return exc
    finally:
        _unlink(path)
        block.close()
    return None


# ---------------------------------------------------------------------------- helpers
def _fan(key: bytes) -> int:
    return xxhash.xxh3_64_intdigest(key) & (FANOUT - 1)


def _regular_size(entry: os.DirEntry[str]) -> int:
    """Size of a regular file (not following links); -1 for anything else."""
    try:
        if entry.is_file(follow_symlinks=False):
            return entry.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return -1


def _is_flat(view: memoryview) -> bool:
    return view.format == "B" and view.ndim == 1 and view.c_contiguous


def _aligned(view: memoryview) -> bool:
    """Whether O_DIRECT can use ``view`` in place: page-aligned address and length."""
    if len(view) % ALIGN:
        return False
    return np.frombuffer(view, np.uint8).ctypes.data % ALIGN == 0


def _zero(view: memoryview) -> None:
    np.frombuffer(view, np.uint8).fill(0)


def _pwritev_all(fd: int, pieces: list[memoryview]) -> None:
    offset = 0
    while pieces:
        n = os.pwritev(fd, pieces, offset)
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        offset += n
        pieces = _advance(pieces, n)


def _preadv_all(fd: int, pieces: list[memoryview]) -> int:
    """Fill ``pieces`` from offset 0; bytes read (short only at end of file)."""
    offset = 0
    while pieces:
        n = os.preadv(fd, pieces, offset)
        if n == 0:
            break
        offset += n
        pieces = _advance(pieces, n)
    return offset


def _advance(pieces: list[memoryview], n: int) -> list[memoryview]:
    """The buffers left after the first ``n`` bytes of ``pieces`` were transferred."""
    rest = list(pieces)
    while rest and n >= len(rest[0]):
        n -= len(rest[0])
        rest.pop(0)
    if rest and n:
        rest[0] = rest[0][n:]
    return rest


def _truncated(size: int, expected: int) -> IntegrityError:
    return FrameFormatError(f"{size} bytes, a frame is {expected} (truncated)")


def _find_syncfs() -> Callable[[int], int] | None:
    """libc's syncfs(2) (Linux), or None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syncfs  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_SYNCFS = _find_syncfs()


def _syncfs(directory: str) -> None:
    """Write back and flush everything on the filesystem holding ``directory``."""
    assert _SYNCFS is not None
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _SYNCFS(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), directory)
    finally:
        os.close(fd)


def _rename_into(staged: str, path: str) -> None:
    """Rename ``staged`` to ``path``, making ``path``'s directory on first use."""
    try:
        os.replace(staged, path)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.replace(staged, path)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("cannot remove %s: %s", path, exc)
