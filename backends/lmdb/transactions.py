"""The LMDB tier's transactions on one namespace's sub-database: put, get, delete, short reads.

Each method of :class:`Transactions` runs one LMDB transaction inside the
map gate (:class:`~tiercache.backends.lmdb.env.SharedEnvironment`'s, so a
remap waits for it) and returns what it found; LMDB's errors go to the
caller, :class:`~tiercache.backends.lmdb.backend.LMDBBackend`, which counts,
logs and retries. Threads: ``put``, ``delete`` and ``with_room`` run on the
writer thread alone (the framer's staging buffer is the writer's), ``get``
on any I/O thread, ``contains``, ``keys`` and ``held`` on the owner's thread.
``db`` is the sub-database's handle, opened by the backend.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lmdb

from tiercache.backends.lmdb.env import SharedEnvironment
from tiercache.backends.lmdb.frames import Framer, Load
from tiercache.buffers import as_key_bytes
from tiercache.tiers.worker_lanes import BackendJob, Outcome

#: A record in the main database that a transaction rewrites to move LMDB's txn id on.
_TICK_KEY = b"tiercache/tick"


class Transactions:
    """The transactions the tier runs; ``deleting``: keys whose deletes are queued (misses)."""

    def __init__(
        self, shared: SharedEnvironment, framer: Framer, capacity_chunks: int,
        deleting: Mapping[bytes, int],
    ) -> None:
        self._env = shared.env
        self._gate = shared.gate
        self._framer = framer
        self._capacity_chunks = capacity_chunks
        self._deleting = deleting

    # ------------------------------------------------------------------ writer thread
    def with_room(
        self, body: Callable[[Any, BackendJob], Outcome], db: Any, job: BackendJob,
    ) -> Outcome:
        """Run a write transaction; if the map is full, make room once and run it again.

        LMDB reuses the pages a transaction freed only from the transaction after
        the next one on, and never while a reader (even one whose process died)
        still sees them. So a put right after the delete that made room for it
        finds the map full; an aborted transaction advances nothing. Making room:
        clear dead readers' slots and commit a tiny transaction, after which the
        pages freed before it are free to take.
        """
        try:
            return body(db, job)
        except lmdb.MapFullError:
            self._env.reader_check()
            with self._gate.shared(), self._env.begin(write=True) as txn:
                txn.put(_TICK_KEY, time.time_ns().to_bytes(8, "little"))
            return body(db, job)

    def put(self, db: Any, job: BackendJob) -> Outcome:
        """One write transaction: frame and put every chunk that fits the budget.

        Returns the keys stored, those over the budget, and the payload bytes stored.
        """
        ok: list[bytes] = []
        over: list[bytes] = []
        moved = 0
        with self._gate.shared(), self._env.begin(db=db, write=True) as txn:
            held = txn.stat(db)["entries"]
            cursor = txn.cursor()
            for key, view in zip(job.keys, job.views):
                present = cursor.set_key(key)
                if not present and held >= self._capacity_chunks:
                    over.append(key)
                    continue
                txn.put(key, self._framer.frame(key, view))
                held += not present
                ok.append(key)
                moved += view.nbytes
        return ok, over, moved

    def delete(self, db: Any, job: BackendJob) -> Outcome:
        with self._gate.shared(), self._env.begin(db=db, write=True) as txn:
            for key in job.keys:
                txn.delete(key)
        return [], [], 0

    # ------------------------------------------------------------------ get threads
    def get(self, db: Any, job: BackendJob) -> tuple[list[bytes], list[bytes], int, int]:
        """One read transaction: copy each frame's payload out of the map, verifying it as it goes.

        A view of a failed key holds nothing usable (zeroed, or untouched), as the
        backend contract allows.

        Returns the keys loaded, those missing or failed, payload bytes, and how
        many frames failed verification.
        """
        ok: list[bytes] = []
        failed: list[bytes] = []
        moved = corrupt = 0
        with self._gate.shared(), self._env.begin(db=db, buffers=True) as txn:
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

    # ------------------------------------------------------------------ owner thread
    def contains(
        self, db: Any, keys: Sequence[bytes], storable: Callable[[Any], bool],
    ) -> list[bool]:
        with self._gate.shared(), self._env.begin(db=db, buffers=True) as txn:
            cursor = txn.cursor()
            return [
                storable(key) and key not in self._deleting and cursor.set_key(key)
                for key in map(as_key_bytes, keys)
            ]

    def keys(self, db: Any, namespace: bytes) -> list[bytes]:
        """The keys of ``namespace`` in the sub-database (names only: no value is read)."""
        with self._gate.shared(), self._env.begin(db=db) as txn:
            keys = txn.cursor().iternext(keys=True, values=False)
            return [key for key in keys if key.startswith(namespace)]

    def held(self, db: Any) -> int:
        """Chunks in the sub-database now."""
        with self._gate.shared(), self._env.begin(db=db) as txn:
            return int(txn.stat(db)["entries"])
