"""The disk tier's pool-thread work: one task per key, a job's completion, its fsync.

:class:`DiskTasks` is the part of :class:`~tiercache.backends.disk.backend.DiskBackend`
that runs on the ``io_threads`` pool: ``_put_task`` writes a key's frame
(into a free file it took, or a fresh temporary file) and renames it over
the chunk's name, ``_get_task`` reads and verifies one into the caller's
view. The thread that ends a job's last key finishes the job: with
``fsync: batch`` it makes the job's files durable first (one ``syncfs`` shared
by the jobs that end meanwhile, or per-directory fsyncs where syncfs is
missing), then it commits the keys to the index and publishes the JobResult,
having dropped the job's views. Like :class:`~tiercache.backends.disk.index.DiskIndex`
it holds no state of its own: ``DiskBackend.__init__`` sets every attribute
annotated below; the index, results and counters change only under ``_lock``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from tiercache.backends.disk.file_io import FrameIO, fsync_dir, rename_into, syncfs, unlink
from tiercache.backends.disk.index import DiskIndex, Job, Outcome
from tiercache.backends.disk.layout import TMP_SUFFIX
from tiercache.integrity import ChecksumMismatch, IntegrityError

if TYPE_CHECKING:
    from tiercache.backend import JobResult

# The tier's one logger: its backend module's name, the name log configurations filter on.
logger = logging.getLogger(f"{__package__}.backend")


class DiskTasks(DiskIndex):
    """Mixin of :class:`~tiercache.backends.disk.backend.DiskBackend`: what its pool threads run."""

    chunk_bytes: int
    _dir: str
    _frames: FrameIO
    _open_new: int
    _open_reuse: int
    _syncfs: Callable[[int], int] | None  # libc's syncfs, None where it is missing
    _sync_lock: threading.Lock
    _sync_ticket: int
    _synced_upto: int
    _results: list[JobResult]

    # ------------------------------------------------------------------ one key
    def _put_task(self, job: Job, i: int) -> None:
        key, view = job.keys[i], job.views[i]
        path = self.path_of(key)
        staged: str | None = None
        outcome = Outcome.FAILED
        try:
            fd, staged = self._open_for_write(job, i, path)
            try:
                self._write_frame(fd, key, view)
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
        if self.settings.fsync == "always" or (self.settings.fsync == "batch" and not self._syncfs):
            os.fdatasync(fd)

    def _get_task(self, job: Job, i: int) -> None:
        key, view = job.keys[i], job.views[i]
        path = self.path_of(key)
        outcome = Outcome.FAILED
        try:
            self._frames.read(path, key, view)
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
            last = job.part_ended()
        if last:
            self._finish(job)

    def _finish(self, job: Job) -> None:
        """Runs once per job, on the thread that ended its last key (or the submitter)."""
        put = job.kind == "put"
        if put and self.settings.fsync == "batch":
            self._sync_job(job)
        with self._lock:
            if put:
                self._commit_puts(job)
            else:
                self._release_readers(job)
            good = [o is Outcome.OK for o in job.outcome]
            job.views.clear()  # never keep a caller's view past its JobResult
            result = job.result(good, sum(good) * self.chunk_bytes)
            self._counters[f"{job.kind}s"] += len(result.ok_keys)
            self._counters[f"{job.kind}_failures"] += len(result.failed_keys)
            self._results.append(result)

    def _sync_job(self, job: Job) -> None:
        """fsync=batch: make a put job's files and renames durable before it is reported.

        On Linux one ``syncfs`` of the tier's filesystem does it, shared by every
        job whose renames were done when it started (group commit: concurrent
        jobs wait for one sync instead of issuing their own). Elsewhere, the
        files were fdatasynced before their renames and each directory the
        job renamed into is fsynced once.
        """
        if self._syncfs:
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
                syncfs(self._dir, self._syncfs)
            except OSError as exc:
                self._count_os_error(exc, "fsync", self._dir)
                for i, outcome in enumerate(job.outcome):
                    if outcome is Outcome.OK:
                        job.outcome[i] = Outcome.FAILED_RENAMED
                return
            self._synced_upto = covers
