"""The client tier: chunks kept by a tiercache cache server (``backend: server`` in YAML).

A shared tier (``shared = True``): other engines write the same server, so the
engine asks it (``contains``) instead of owning its directory, and the server's
own budget and eviction policy bound what it holds. Keys go to the server as
they are (they start with the engine's namespace digest, so engines whose
namespaces differ never read each other's chunks).

Threads and connections: ``connections`` data I/O threads, each owning one
:class:`~tiercache.server.client.ServerClient` (a TCP connection, connected on
demand). A job is split into parts of at most ``max_batch_keys`` keys and
``max_batch_bytes`` bytes; the parts go on one queue and run on whichever
thread is free, so a large job uses every connection; over TCP a thread
keeps up to ``pipeline_depth`` requests of a part in flight on its connection
(:mod:`.worker`). ``contains`` and ``delete`` are answered synchronously by
one more thread with a connection of its own (connected on its first call),
so a lookup never queues behind a job's parts (under write-through load one
that did missed ``deadlines.lookup_wait_s`` and cost its request a forward
pass: docs/PERFORMANCE.md, Serving); they wait up to ``timeout_s`` and may be
called from any thread, as the scheduler's shared lookup does; ``submit_*``,
``poll`` and ``close`` from the owner's thread.

Integrity (``verifies_integrity``): every chunk is stored as a frame of
:mod:`tiercache.integrity` (namespace, key, length, xxh3_64; or, with
``mac_key``, a keyed MAC) and verified on every load (:mod:`.frames`): a chunk
another client overwrote, damaged or forged is a failed key counted in
``stats()["checksum_failures"]``, never bytes for the engine. With a
``mac_key`` (option, or ``TIERCACHE_MAC_KEY``) only frames written with the same
key load, so a client without it cannot poison this tier's chunks. A key
refused on load is remembered (at most ``MAX_REFUSED_KEYS``): the engine's
next store of it overwrites the bad copy whatever ``overwrite`` says
(counted in ``replaced``), so a forged chunk costs one recompute, not a miss
until eviction.

Data path: TCP, or NIXL when ``data_path`` allows it, nixl imports here and
the server offers it. Over TCP a frame's header and the engine's view travel
as two pieces of one value, both ways (no copy). With NIXL the server READs a
put's values from, and WRITEs a get's values into, memory registered with
this client's agent; each frame's header travels in the PUT_REMOTE body
and comes back in the GET_REMOTE reply body, and only the chunk moves by
NIXL: straight from or into the engine's view when it lies in a buffer
registered with :meth:`ServerBackend.register_buffer` (zero copy), else
through the I/O thread's arena of a registered staging area (one copy each
way, counted in ``stats()["nixl_staged_bytes"]``; a part then holds at most
one arena of such chunks). The agent has no progress thread (NIXL's spins a core): the I/O
thread waiting for a NIXL reply drives it, sleeping in ``select`` between
rounds.

Failures: a dead or unreachable server, a timeout, a refused request - the
part's keys fail (counted in :meth:`ServerBackend.stats`), the connection is
closed, and its thread reconnects with exponential backoff (between attempts
its parts fail at once, so a dead server costs no waiting). A connection the
server ended while it was idle (its ``idle_timeout_s``, a drain) is noticed
before the next request and replaced at once (``server_closed``), so the
idle timeout costs no failed request. Nothing raises into the engine.

Buffers: the engine owns every view. A thread reads a put's views while
sending (or the server reads them over NIXL before it replies) and writes a
get's views while receiving; a view a failed get may have written is zeroed.
The job drops its views before its JobResult is published.

Files: the backend here (submission, synchronous calls, results); options in
:mod:`.settings` (re-exported here), the I/O threads and the queue's records
(jobs, parts, calls) in :mod:`.worker`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

from tiercache.backends.server.frames import Framer
from tiercache.backends.server.settings import ServerSettings
from tiercache.backends.server.worker import Call, Part, ServerJob, Worker

from tiercache.backend import Backend, BackendContext, JobResult
from tiercache.integrity import MacKey
from tiercache.server import protocol as p
from tiercache.server.client import ServerClient
from tiercache.server.nixl_client import NixlClientSide

__all__ = ["ServerBackend", "ServerSettings"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


MAX_REFUSED_KEYS = 65536  # refused chunks remembered for replacement (oldest forgotten first)

_COUNTERS = (
    "puts", "put_failures", "gets", "get_failures", "misses", "checksum_failures",
    "request_errors", "connects", "connect_failures", "fast_failures", "server_closed", "replaced",
    "nixl_staged_bytes",  # chunk bytes copied through an arena (views outside registered memory)
)


class ServerBackend(Backend):
    name = "server"
    settings_model = ServerSettings
    shared = True
    verifies_integrity = True  # compact frames, checked on every load (.frames)

    @classmethod
    def footprint(cls, chunk_bytes: int) -> int:
        return chunk_bytes  # the server's budget is its own; here it bounds what the engine remembers

    def __init__(self, settings: ServerSettings, context: BackendContext) -> None:
        self.settings = settings
        self.context = context
        self.framer = Framer(context.namespace, MacKey.from_secret(settings.mac_key), context.tier_name)
        self._lock = threading.Lock()
        self._results: list[JobResult] = []
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._refused: OrderedDict[bytes, None] = OrderedDict()  # under _lock: see note_refused
        self._slots_checked = False  # under _lock: see check_slot_fit
        #: What the data threads take: parts of jobs, None to stop.
        self.requests: queue.SimpleQueue[Part | Call | None] = queue.SimpleQueue()
        #: What the lookup thread takes: synchronous calls (contains, delete), None to stop.
        self.calls: queue.SimpleQueue[Part | Call | None] = queue.SimpleQueue()
        self._closed = False
        self.nixl: NixlClientSide | None = None
        if settings.data_path != "tcp":
            try:
                # frame headers travel in the message bodies: the arenas hold chunks only
                self.nixl = NixlClientSide(settings.nixl_staging_bytes, settings.connections)
            except Exception:
                level = logging.WARNING if settings.data_path == "nixl" else logging.DEBUG
                logger.log(level, "server tier %s: no NIXL here; TCP data path", context.tier_name,
                           exc_info=True)
        token = settings.token.get_secret_value() if settings.token is not None else None
        name = settings.client_name or f"{context.tier_name}/rank{context.rank}"
        tls = settings.tls_context()
        server_name = settings.tls.server_name if settings.tls is not None else None

        def client() -> ServerClient:
            return ServerClient(settings.address, token, name, settings.timeout_s, settings.connect_timeout_s,
                                tls=tls, server_name=server_name)

        self._workers = [Worker(self, i, client(), self.requests) for i in range(settings.connections)]
        self._lookups = Worker(self, settings.connections, client(), self.calls, data=False)
        for worker in (*self._workers, self._lookups):
            worker.thread.start()

    # ------------------------------------------------------------------ Backend API
    def submit_put(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        self._submit(job_id, True, keys, views)

    def submit_get(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        self._submit(job_id, False, keys, views)

    def poll(self) -> list[JobResult]:
        with self._lock:
            results, self._results = self._results, []
        return results

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys the server holds; all False if it cannot be asked (never raises)."""
        keys = [bytes(k) for k in keys]
        if not keys:
            return []
        out: list[bool] = []
        step = self.settings.max_batch_keys
        for i in range(0, len(keys), step):
            part = keys[i : i + step]
            present = self._call(lambda c, part=part: c.exists(part))
            out.extend(present if present is not None else [False] * len(part))
        return out

    def delete(self, keys: Sequence[bytes]) -> None:
        """Delete on the server; returns when the server has (or could not be asked)."""
        keys = [bytes(k) for k in keys]
        step = self.settings.max_batch_keys
        for i in range(0, len(keys), step):
            part = keys[i : i + step]
            self._call(lambda c, part=part: c.delete(part))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._workers:
            self.requests.put(None)
        self.calls.put(None)
        for worker in (*self._workers, self._lookups):
            worker.thread.join(timeout=self.settings.timeout_s + 1)
            worker.client.close()
        if self.nixl is not None:
            self.nixl.close()
        with self._lock:
            self._results.clear()

    # ------------------------------------------------------------------ extras
    def register_buffer(self, buffer: memoryview) -> bool:
        """Register a long-lived host buffer with the NIXL agent; False without NIXL.

        Chunks inside it then move by NIXL in place, zero copy (see the module docstring).
        The buffer must outlive this backend.
        """
        if self.nixl is None:
            return False
        self.nixl.register(buffer)
        return True

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._counters)
        out["connected"] = sum(1 for w in self._workers if w.client.connected)
        out["nixl_connections"] = sum(1 for w in self._workers if w.nixl_active)
        return out

    def check_slot_fit(self, max_value_bytes: int) -> None:
        """Warn once (any thread, at a connect) when the server's slots dwarf this engine's values.

        The server keeps every value in a fixed slot of its ``max_value_bytes``
        (tiercache/server/slab.py): values of half that or less leave most of each
        slot empty, so the server holds that many times fewer chunks than its
        capacity suggests, evicts early, and lookups turn into failed loads.
        """
        with self._lock:
            if self._slots_checked:
                return
            self._slots_checked = True
        value = self.context.chunk_bytes
        if value > max_value_bytes:
            logger.warning("server tier %s: this engine's values are %d B, more than %s takes (max_value_bytes "
                           "%d B): every store and load of this tier will fail", self.context.tier_name, value,
                           self.settings.address, max_value_bytes)
        elif 0 < value and 2 * value <= max_value_bytes:
            logger.warning(
                "server tier %s: this engine's values are %d B (a chunk, or a chunk's store shard) but %s "
                "keeps every value in a slot of its max_value_bytes (%d B): it holds about %dx fewer "
                "chunks than its capacity suggests; give the server a max_value_bytes of about %d B",
                self.context.tier_name, value, self.settings.address, max_value_bytes,
                max_value_bytes // value, value)

    def note_refused(self, keys: Sequence[bytes]) -> None:
        """These keys' stored copies failed verification: our next store of them overwrites (any thread)."""
        with self._lock:
            for key in keys:
                self._refused[key] = None
            while len(self._refused) > MAX_REFUSED_KEYS:
                self._refused.popitem(last=False)

    def take_refused(self, keys: Sequence[bytes]) -> bool:
        """Whether any of ``keys`` was refused on load (forgotten now: this store replaces it)."""
        with self._lock:
            hits = [key for key in keys if key in self._refused]
            for key in hits:
                del self._refused[key]
            if hits:
                self._counters["replaced"] += len(hits)
        return bool(hits)

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to a counter of :meth:`stats` (any thread)."""
        with self._lock:
            self._counters[name] += n

    # ------------------------------------------------------------------ submission
    def _submit(self, job_id: int, is_put: bool, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        if self._closed:
            raise RuntimeError(f"server tier {self.context.tier_name} is closed")
        if len(keys) != len(views):
            raise ValueError(f"{len(keys)} keys but {len(views)} views")
        flat = [_flat_view(v, writable=not is_put) for v in views]
        job = ServerJob("put" if is_put else "get", job_id, [bytes(k) for k in keys],
                        flat, ok=[False] * len(keys))  # type: ignore[arg-type]
        usable = [i for i, v in enumerate(flat) if v is not None and 0 < len(job.keys[i]) <= p.MAX_KEY_BYTES_CAP]
        parts = self._split(job, usable)
        job.remaining = len(parts)
        if not parts:
            self._finish(job)
            return
        for part in parts:
            self.requests.put(part)

    def _split(self, job: ServerJob, indices: list[int]) -> list[Part]:
        """Parts of at most max_batch_keys keys and max_batch_bytes bytes; with NIXL, the chunks
        outside registered memory (staged through an arena) also fit one arena per part."""
        max_keys = self.settings.max_batch_keys
        max_bytes = self.settings.max_batch_bytes
        nixl = self.nixl
        arena = nixl.arena_bytes if nixl is not None else 0
        parts: list[Part] = []
        current: list[int] = []
        size = staged = 0
        for i in indices:
            n = len(job.views[i])
            s = n if nixl is not None and nixl.locate(job.views[i]) is None else 0
            if current and (len(current) == max_keys or size + n > max_bytes or (s and staged + s > arena)):
                parts.append(Part(job, current))
                current, size, staged = [], 0, 0
            current.append(i)
            size += n
            staged += s
        if current:
            parts.append(Part(job, current))
        return parts

    def part_done(self, part: Part, ok: list[bool]) -> None:
        """An I/O thread ended ``part``: ``ok[n]`` for its ``n``-th key; the last part reports."""
        job = part.job
        with self._lock:
            for i, good in zip(part.indices, ok):
                job.ok[i] = good
            last = job.part_ended()
        if last:
            self._finish(job)

    def _finish(self, job: ServerJob) -> None:
        moved = sum(len(v) for v, good in zip(job.views, job.ok) if good)
        job.views.clear()  # never keep a caller's view past its JobResult
        result = job.result(job.ok, moved)
        with self._lock:
            self._counters[f"{job.kind}s"] += len(result.ok_keys)
            self._counters[f"{job.kind}_failures"] += len(result.failed_keys)
            if not self._closed:
                self._results.append(result)

    def _call(self, fn: Callable[[ServerClient], T]) -> T | None:
        """Run ``fn`` on an I/O thread's connection and wait; None if it failed or timed out."""
        if self._closed:
            return None
        future: Future[T] = Future()
        self.calls.put(Call(fn, future))
        try:
            return future.result(timeout=self.settings.timeout_s + self.settings.connect_timeout_s)
        except Exception:
            logger.debug("server tier %s: request failed", self.context.tier_name, exc_info=True)
            return None


def _flat_view(view: memoryview, writable: bool) -> memoryview | None:
    """``view`` as flat bytes (None if it cannot be used: not contiguous, read-only for a get)."""
    try:
        v = memoryview(view)
        if v.ndim != 1 or v.format != "B":
            v = v.cast("B")
    except (TypeError, ValueError):
        return None
    if not len(v) or (writable and v.readonly):
        return None
    return v
