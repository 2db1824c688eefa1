"""The disk tier's bookkeeping: index, writes in flight, readers, free pool, budget, counters.

:class:`DiskIndex` is the part of :class:`~tiercache.backends.disk.backend.DiskBackend`
that decides, under the backend's one lock (``_lock``), what the tier holds:

- ``_index``: key -> generation of its committed chunk file (a get that fails
  to load drops its key only if the generation is still the one it saw);
- ``_pending``: keys being written (one write of a key at a time), flagged when
  deleted meanwhile; ``_readers``: gets in flight per key (a file being read is
  never put in the free pool);
- ``_free``: files kept for reuse; ``_bytes_used``: chunks, free files and
  files being written, one frame each, never over ``capacity_bytes``;
- ``_counters``: the names in :data:`COUNTERS`.

It also rebuilds that state at start-up from
:func:`~tiercache.backends.disk.layout.scan_tree`. It holds no state of its
own: :meth:`DiskBackend.__init__ <tiercache.backends.disk.backend.DiskBackend>` sets
every attribute annotated below. Methods marked "lock held" run with
``_lock`` held by the caller; the others take it or need no lock.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from tiercache.backends.disk.file_io import NOSPACE, unlink
from tiercache.backends.disk.layout import FREE_SUFFIX, scan_tree
from tiercache.tiers.worker_lanes import PartedJob

if TYPE_CHECKING:
    from tiercache.backend import BackendContext
    from tiercache.backends.disk.settings import DiskSettings

# The tier's one logger: its backend module's name, the name log configurations filter on.
logger = logging.getLogger(f"{__package__}.backend")

COUNTERS = (
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


class Outcome(Enum):
    OK = 0
    FAILED = 1  # the chunk's name was not touched
    FAILED_RENAMED = 2  # our file was renamed over the chunk's name, then something failed


@dataclass(eq=False, slots=True)
class Job(PartedJob):
    """A submitted job until it is reported (one part per key); its views are dropped when it is.

    The kit's record, plus what the index decides per key at submission.
    """

    outcome: list[Outcome] = field(default_factory=list)
    # put: holds the key's write slot and one budget unit; get: a reader
    admitted: list[bool] = field(default_factory=list)
    sources: list[str | None] = field(default_factory=list)  # put: free file to overwrite, or None
    gens: list[int] = field(default_factory=list)  # get: index generation seen at submission


class DiskIndex:
    """Mixin of :class:`~tiercache.backends.disk.backend.DiskBackend`: the state under ``_lock``."""

    settings: DiskSettings
    context: BackendContext
    capacity_bytes: int
    frame_bytes: int
    _fan_dirs: list[str]
    _free_dir: str
    _tag: str
    _seq: itertools.count[int]
    _gen: itertools.count[int]
    _lock: threading.Lock
    _index: dict[bytes, int]
    _pending: dict[bytes, bool]
    _readers: dict[bytes, int]
    _free: list[str]
    _quarantine: list[tuple[bytes, int]]
    _bytes_used: int
    _counters: dict[str, int]

    if TYPE_CHECKING:

        def path_of(self, key: bytes) -> str: ...  # DiskBackend's

    # ------------------------------------------------------------------ admission and commit
    def _admit_put(self, job: Job, i: int, key: bytes) -> None:
        """Give one key of a put its write slot and a budget unit, or fail it (lock held)."""
        if key in self._pending:
            job.outcome[i] = Outcome.FAILED  # one write of a key at a time; the first wins
            return
        if self._free:
            job.sources[i] = self._free.pop()
        elif self._bytes_used + self.frame_bytes <= self.capacity_bytes:
            self._bytes_used += self.frame_bytes
        else:
            job.outcome[i] = Outcome.FAILED
            self._counters["over_budget"] += 1
            return
        job.admitted[i] = True
        self._pending[key] = False

    def _commit_puts(self, job: Job) -> None:
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
            if outcome is Outcome.FAILED:  # the chunk's name was not touched
                if job.sources[i] is not None:
                    self._free.append(job.sources[i])  # type: ignore[arg-type]
                else:
                    self._bytes_used -= self.frame_bytes
                continue
            if key in self._index:  # our rename replaced the previous version's file
                del self._index[key]
                self._bytes_used -= self.frame_bytes
            if outcome is Outcome.OK and not doomed:
                self._index[key] = next(self._gen)
                continue
            job.outcome[i] = Outcome.FAILED
            self._account_moved(self._move_away(self.path_of(key), self._may_keep(key)))

    def _release_readers(self, job: Job) -> None:
        for i, key in enumerate(job.keys):
            if job.admitted[i]:
                left = self._readers[key] - 1
                if left:
                    self._readers[key] = left
                else:
                    del self._readers[key]

    # ------------------------------------------------------------------ free pool and quarantine
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
        unlink(path)
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
        found = scan_tree(self._fan_dirs, self._free_dir, self.frame_bytes, self.capacity_bytes)
        self._free.extend(found.free)
        self._counters["tmp_removed"] += found.tmp_removed
        self._counters["dropped_on_recover"] += found.dropped
        for key in found.chunks:
            self._index[key] = next(self._gen)
        self._counters["recovered"] = len(self._index)
        self._bytes_used = (len(self._index) + len(self._free)) * self.frame_bytes

    # ------------------------------------------------------------------ counters
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _count_os_error(self, exc: OSError, op: str, path: str) -> None:
        if exc.errno in NOSPACE:
            self._count("enospc")
            logger.warning(
                "disk tier %s: no space for %s (%s dropped)", self.context.tier_name, path, op
            )
        else:
            self._count("io_errors")
            logger.warning("disk tier %s: %s of %s: %s", self.context.tier_name, op, path, exc)
