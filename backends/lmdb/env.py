"""The LMDB tier's environment layer: map sizing, database names, the per-process environment.

:func:`max_frame_bytes` and :func:`default_map_size` size a chunk's frame and
the map that holds the budget's frames; :func:`environment_options` gives the
``lmdb.open`` arguments of a tier's settings and :func:`database_name` the
sub-database of a namespace and rank. :class:`SharedEnvironment` keeps one
``lmdb.Environment`` per path per process (LMDB forbids opening one twice) and
:class:`_MapGate` keeps remapping away from open transactions. The tier itself
(:class:`~tiercache.backends.lmdb.backend.LMDBBackend`) lives in :mod:`.backend`.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import lmdb

from tiercache import integrity

if TYPE_CHECKING:
    from tiercache.backends.lmdb.settings import LMDBSettings

# The tier's one logger: its backend module's name, the name log configurations filter on.
logger = logging.getLogger(f"{__package__}.backend")

#: Longest chunk key this tier stores (namespace 8 + prefix hash + group 4; vLLM's
#: block hashes are at most 32 bytes). The budget counts every frame at this key length.
MAX_KEY_BYTES = 128
#: Bytes LMDB puts in front of a value that spills into overflow pages (a page header).
LMDB_PAGE_HEADER_BYTES = 16
#: Map headroom over the pages the budget's chunks occupy: a fraction, and a floor.
MAP_HEADROOM_FRACTION = 0.25
MAP_HEADROOM_MIN_BYTES = 64 << 20
#: Named databases one process may open in one environment (one per namespace and rank).
_MAX_DBS = 64


# ------------------------------------------------------------------------------ sizing
def max_frame_bytes(chunk_bytes: int) -> int:
    """The largest compact frame of a ``chunk_bytes`` payload (key of MAX_KEY_BYTES)."""
    return integrity.compact_header_len(MAX_KEY_BYTES) + chunk_bytes


def default_map_size(capacity_chunks: int, frame_bytes: int, page_size: int = mmap.PAGESIZE) -> int:
    """Map size for ``capacity_chunks`` frames of up to ``frame_bytes`` each.

    A value larger than a page lives in its own run of overflow pages behind a
    16-byte page header, so each chunk occupies ``ceil((frame + 16) / page)``
    whole pages (LMDB's page is the OS page). On top of that: 25% (at least
    64 MiB) for the B-tree's branch and leaf pages, LMDB's free-page list, and
    copy-on-write (a write transaction takes new pages while pages freed by
    deletes are still visible to older read transactions, in this or another
    process). The map is address space, not disk: the file grows as pages are used.
    """
    pages_per_chunk = -(-(frame_bytes + LMDB_PAGE_HEADER_BYTES) // page_size)
    data = capacity_chunks * pages_per_chunk * page_size
    headroom = max(int(data * MAP_HEADROOM_FRACTION), MAP_HEADROOM_MIN_BYTES)
    return -(-(data + headroom) // page_size) * page_size


def environment_options(settings: LMDBSettings, map_size: int) -> dict[str, Any]:
    """Keyword arguments of ``lmdb.open`` for these settings (the benchmark's raw runs use them)."""
    return {
        "map_size": map_size,
        "subdir": settings.subdir,
        "readonly": settings.readonly,
        "sync": settings.sync,
        "metasync": settings.sync,
        "max_readers": settings.max_readers,
        "max_dbs": _MAX_DBS,
        "max_spare_txns": 1,
        "lock": True,
    }


def database_name(namespace: bytes, rank: int = 0) -> bytes:
    """The named sub-database of one namespace and TP rank (tied to the frame format)."""
    return b"tiercache/frames-v%d/%s/rank%d" % (
        integrity.FORMAT_VERSION, namespace.hex().encode(), rank,
    )


# ------------------------------------------------------------------------ environment
class _MapGate:
    """Shared while a transaction is open in this process; exclusive to remap the environment.

    LMDB's ``set_mapsize`` ends every transaction of the process and moves the
    map, so it must not run while any thread reads from the map.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = 0
        self._remapping = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._remapping)
            self._open += 1
        try:
            yield
        finally:
            with self._cond:
                self._open -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._remapping)
            self._remapping = True
            self._cond.wait_for(lambda: self._open == 0)
        try:
            yield
        finally:
            with self._cond:
                self._remapping = False
                self._cond.notify_all()


class SharedEnvironment:
    """One ``lmdb.Environment`` per environment per process, shared by that process's backends."""

    _open: dict[str, SharedEnvironment] = {}
    _lock = threading.Lock()

    def __init__(self, env: lmdb.Environment, where: str) -> None:
        self.env = env
        self.gate = _MapGate()
        self.readonly = bool(env.flags()["readonly"])
        self._where = where
        self._users = 1

    @classmethod
    def acquire(cls, settings: LMDBSettings, map_size: int) -> SharedEnvironment:
        """Open the environment at ``settings.path``, or join this process's open one."""
        if settings.subdir and not settings.readonly:
            settings.path.mkdir(parents=True, exist_ok=True)
        where = os.path.realpath(settings.path)
        with cls._lock:
            shared = cls._open.get(where)
            if shared is None:
                env = lmdb.open(str(settings.path), **environment_options(settings, map_size))
                env.reader_check()  # free the reader slots of processes that died
                shared = cls._open[where] = cls(env, where)
                return shared
            if shared.readonly and not settings.readonly:
                raise ValueError(f"lmdb environment {where} is open read-only in this process")
            shared._users += 1
        shared.grow_map(map_size)
        return shared

    def release(self) -> None:
        """Drop one user; the last one closes the environment."""
        with self._lock:  # closed under the lock: a new open of the same files waits for it
            self._users -= 1
            if self._users == 0:
                del self._open[self._where]
                self.env.close()

    def grow_map(self, map_size: int) -> None:
        """Make the map at least ``map_size`` bytes (a later backend may need more)."""
        if map_size > self.env.info()["map_size"]:
            with self.gate.exclusive():
                self.env.set_mapsize(map_size)

    def adopt_grown_map(self) -> None:
        """Another process grew the map past ours: remap to the size it recorded."""
        with self.gate.exclusive():
            self.env.set_mapsize(0)
        logger.info("lmdb tier: adopted map size %d", self.env.info()["map_size"])
