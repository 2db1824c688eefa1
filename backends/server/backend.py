"""The client tier: chunks kept by a tiercache cache server (``backend: server`` in YAML).

A shared tier (``shared = True``): other engines write the same server, so the
engine asks it (``contains``) instead of owning its directory, and the server's
own budget and eviction policy bound what it holds. Keys go to the server as
they are (they start with the engine's namespace digest, so engines whose
namespaces differ never read each other's chunks).

Threads and connections: ``connections`` I/O threads, each owning one
:class:`~tiercache.server.client.ServerClient` (a TCP connection, connected on
demand). A job is split into parts of at most ``max_batch_keys`` keys and
``max_batch_bytes`` bytes; the parts go on one queue and run on whichever
thread is free, so a large job uses every connection. ``contains`` and
``delete`` are answered synchronously (they wait for a thread, up to
``timeout_s``) and may be called from any thread, as the scheduler's shared
lookup does; ``submit_*``, ``poll`` and ``close`` from the owner's thread.

Data path: TCP, or NIXL when ``data_path`` allows it, nixl imports here and
the server offers it. With NIXL the server READs a put's values from, and
WRITEs a get's values into, memory registered with this client's agent: a
view inside a buffer given to :meth:`ServerBackend.register_buffer` (an
engine's host slab) is used in place; other views are copied through the
I/O thread's arena of a registered staging area (a part then holds at most
one arena of such views). The agent has no progress thread (NIXL's spins a
core): the I/O thread waiting for a NIXL reply drives it, sleeping in
``select`` between rounds.

Failures: a dead or unreachable server, a timeout, a refused request - the
part's keys fail (counted in :meth:`ServerBackend.stats`), the connection is
closed, and its thread reconnects with exponential backoff (between attempts
its parts fail at once, so a dead server costs no waiting). Nothing raises
into the engine.

Buffers: the engine owns every view. A thread reads a put's views while
sending (or the server reads them over NIXL before it replies) and writes a
get's views while receiving; a view a failed get may have written is zeroed.
The job drops its views before its JobResult is published.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import Field, SecretStr, field_validator

from tiercache import faults
from tiercache.backend import Backend, BackendContext, BackendSettings, JobResult
from tiercache.config.schema import ByteSize
from tiercache.server import protocol as p
from tiercache.server.client import ServerClient, parse_address
from tiercache.server.nixl_client import NixlClientSide, view_address

logger = logging.getLogger(__name__)
T = TypeVar("T")


class ServerSettings(BackendSettings):
    """Options of a ``backend: server`` tier."""

    address: str = Field(description="HOST:PORT of the cache server (tiercache serve).")
    token: SecretStr | None = Field(default=None, description="The server's auth_token, if it has one.")
    connections: int = Field(default=2, ge=1, le=32, description="TCP connections (one I/O thread each).")
    timeout_s: float = Field(default=10.0, gt=0, description="Seconds one request may take.")
    connect_timeout_s: float = Field(default=2.0, gt=0)
    backoff_min_s: float = Field(default=0.05, gt=0, description="First wait before reconnecting.")
    backoff_max_s: float = Field(default=5.0, gt=0, description="Longest wait between reconnects.")
    data_path: Literal["auto", "tcp", "nixl"] = Field(
        default="auto",
        description="auto: NIXL when both sides have it, else TCP; tcp: never NIXL; "
        "nixl: NIXL required (requests fail without it).",
    )
    nixl_staging_bytes: ByteSize = Field(
        default=64 << 20, description="Registered staging memory for views outside registered buffers."
    )
    overwrite: bool = Field(
        default=True,
        description="A put replaces a chunk the server holds; false: held chunks are kept "
        "(chunk keys name their bytes, so engines may skip the rewrite).",
    )
    max_batch_keys: int = Field(default=256, ge=1, le=65536, description="Keys per request.")
    max_batch_bytes: ByteSize = Field(default=32 << 20, gt=0, description="Value bytes per request.")
    client_name: str = Field(default="", max_length=128, description="Shown by tiercache inspect.")

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        parse_address(value)
        return value


@dataclass(eq=False)
class _Job:
    job_id: int
    is_put: bool
    keys: tuple[bytes, ...]
    views: list[memoryview]
    ok: list[bool]
    remaining: int = 0
    start: float = field(default_factory=time.perf_counter)


@dataclass(eq=False)
class _Part:
    job: _Job
    indices: list[int]


@dataclass(eq=False)
class _Call:
    fn: Callable[[ServerClient], Any]
    future: Future[Any]


_COUNTERS = (
    "puts", "put_failures", "gets", "get_failures", "misses", "request_errors",
    "connects", "connect_failures", "fast_failures",
)


class ServerBackend(Backend):
    name = "server"
    settings_model = ServerSettings
    shared = True

    @classmethod
    def footprint(cls, chunk_bytes: int) -> int:
        return chunk_bytes  # the server's budget is its own; here it bounds what the engine remembers

    def __init__(self, settings: ServerSettings, context: BackendContext) -> None:
        self.settings = settings
        self.context = context
        self._lock = threading.Lock()
        self._results: list[JobResult] = []
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._queue: queue.SimpleQueue[_Part | _Call | None] = queue.SimpleQueue()
        self._closed = False
        self.nixl: NixlClientSide | None = None
        if settings.data_path != "tcp":
            try:
                self.nixl = NixlClientSide(settings.nixl_staging_bytes, settings.connections)
            except Exception:
                level = logging.WARNING if settings.data_path == "nixl" else logging.DEBUG
                logger.log(level, "server tier %s: no NIXL here; TCP data path", context.tier_name,
                           exc_info=True)
        token = settings.token.get_secret_value() if settings.token is not None else None
        name = settings.client_name or f"{context.tier_name}/rank{context.rank}"
        self._workers = [
            _Worker(self, i, ServerClient(
                settings.address, token, name, settings.timeout_s, settings.connect_timeout_s,
            ))
            for i in range(settings.connections)
        ]
        for worker in self._workers:
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
            self._queue.put(None)
        for worker in self._workers:
            worker.thread.join(timeout=self.settings.timeout_s + 1)
            worker.client.close()
        if self.nixl is not None:
            self.nixl.close()
        with self._lock:
            self._results.clear()

    # ------------------------------------------------------------------ extras
    def register_buffer(self, buffer: memoryview) -> bool:
        """Register a long-lived host buffer for zero-copy NIXL transfers; False without NIXL."""
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

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    # ------------------------------------------------------------------ submission
    def _submit(self, job_id: int, is_put: bool, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        if self._closed:
            raise RuntimeError(f"server tier {self.context.tier_name} is closed")
        if len(keys) != len(views):
            raise ValueError(f"{len(keys)} keys but {len(views)} views")
        flat = [_flat_view(v, writable=not is_put) for v in views]
        job = _Job(job_id, is_put, tuple(bytes(k) for k in keys), flat, [False] * len(keys))  # type: ignore[arg-type]
        usable = [i for i, v in enumerate(flat) if v is not None and 0 < len(job.keys[i]) <= p.MAX_KEY_BYTES_CAP]
        parts = self._split(job, usable)
        job.remaining = len(parts)
        if not parts:
            self._finish(job)
            return
        for part in parts:
            self._queue.put(part)

    def _split(self, job: _Job, indices: list[int]) -> list[_Part]:
        """Parts of at most max_batch_keys keys and max_batch_bytes bytes; with NIXL, the views
        outside registered buffers (copied through an arena) also fit one arena per part."""
        max_keys = self.settings.max_batch_keys
        max_bytes = self.settings.max_batch_bytes
        nixl = self.nixl
        arena = nixl.arena_bytes if nixl is not None else 0
        parts: list[_Part] = []
        current: list[int] = []
        size = staged = 0
        for i in indices:
            n = len(job.views[i])
            s = n if nixl is not None and nixl.locate(job.views[i]) is None else 0
            if current and (len(current) == max_keys or size + n > max_bytes or (s and staged + s > arena)):
                parts.append(_Part(job, current))
                current, size, staged = [], 0, 0
            current.append(i)
            size += n
            staged += s
        if current:
            parts.append(_Part(job, current))
        return parts

    def _part_done(self, part: _Part, ok: list[bool]) -> None:
        job = part.job
        with self._lock:
            for i, good in zip(part.indices, ok):
                job.ok[i] = good
            job.remaining -= 1
            last = job.remaining == 0
        if last:
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        ok = tuple(k for k, good in zip(job.keys, job.ok) if good)
        failed = tuple(k for k, good in zip(job.keys, job.ok) if not good)
        moved = sum(len(v) for v, good in zip(job.views, job.ok) if good)
        job.views = []  # never keep a caller's view past its JobResult
        result = JobResult(job.job_id, ok, failed, moved, time.perf_counter() - job.start)
        with self._lock:
            op = "puts" if job.is_put else "gets"
            self._counters[op] += len(ok)
            self._counters[op[:-1] + "_failures"] += len(failed)
            if not self._closed:
                self._results.append(result)

    def _call(self, fn: Callable[[ServerClient], T]) -> T | None:
        """Run ``fn`` on an I/O thread's connection and wait; None if it failed or timed out."""
        if self._closed:
            return None
        future: Future[T] = Future()
        self._queue.put(_Call(fn, future))
        try:
            return future.result(timeout=self.settings.timeout_s + self.settings.connect_timeout_s)
        except Exception:
            logger.debug("server tier %s: request failed", self.context.tier_name, exc_info=True)
            return None


class _Worker:
    """One I/O thread and its connection."""

    def __init__(self, backend: ServerBackend, index: int, client: ServerClient) -> None:
        self.backend = backend
        self.index = index
        self.client = client
        self.backoff = backend.settings.backoff_min_s
        self.next_attempt = 0.0
        self.nixl_active = False
        self._meta_version = 0
        self.thread = threading.Thread(
            target=self._run, name=f"tiercache-server-{backend.context.tier_name}-{index}", daemon=True
        )

    def _run(self) -> None:
        while True:
            item = self.backend._queue.get()
            if item is None:
                return
            try:
                self._serve(item)
            except Exception as exc:  # noqa: BLE001 - the I/O thread outlives anything the server sends
                faults.record(faults.BACKEND_EXCEPTION, exc, where=f"server tier {self.backend.context.tier_name}")

    def _serve(self, item: _Part | _Call) -> None:
        """One queued request: a synchronous call, or a part of a job (always reported)."""
        backend = self.backend
        if isinstance(item, _Call):
            if item.future.set_running_or_notify_cancel():
                try:
                    item.future.set_result(self._with_connection(item.fn))
                except Exception as exc:  # noqa: BLE001 - handed to the waiting caller
                    item.future.set_exception(exc)
            return
        part = item
        try:
            ok = self._with_connection(lambda c, part=part: self._run_part(c, part))
        except (OSError, p.ProtocolError, p.RemoteError):
            ok = [False] * len(part.indices)  # counted and logged by _with_connection
        except Exception:
            logger.exception("server tier %s: a request failed", backend.context.tier_name)
            ok = [False] * len(part.indices)
        backend._part_done(part, ok)

    def _with_connection(self, fn: Callable[[ServerClient], T]) -> T:
        self._connect()
        try:
            return fn(self.client)
        except (OSError, p.ProtocolError, p.RemoteError) as exc:
            self.client.close()
            self.nixl_active = False
            self.backend._count("request_errors")
            logger.warning("server tier %s: request to %s failed: %s", self.backend.context.tier_name,
                           self.backend.settings.address, exc)
            raise

    def _connect(self) -> None:
        if self.client.connected:
            return
        backend = self.backend
        now = time.monotonic()
        if now < self.next_attempt:
            backend._count("fast_failures")
            raise ConnectionError("server unreachable; waiting before reconnecting")
        nixl = backend.nixl
        if nixl is not None:
            version, metadata = nixl.metadata()
            self.client.nixl_agent, self.client.nixl_metadata = nixl.agent_name, metadata
            self.client.nixl_progress = nixl.progress
            self._meta_version = version
        try:
            welcome = self.client.connect()
        except (OSError, p.ProtocolError, p.RemoteError) as exc:
            backend._count("connect_failures")
            self.next_attempt = time.monotonic() + self.backoff
            if self.backoff == backend.settings.backoff_min_s:
                logger.warning("server tier %s: cannot reach %s: %s", backend.context.tier_name,
                               backend.settings.address, exc)
            self.backoff = min(self.backoff * 2, backend.settings.backoff_max_s)
            raise
        backend._count("connects")
        self.backoff = backend.settings.backoff_min_s
        self.nixl_active = nixl is not None and welcome.nixl
        if backend.settings.data_path == "nixl" and not self.nixl_active:
            self.client.close()
            raise ConnectionError("data_path is nixl but the server or this client has no NIXL")

    # ------------------------------------------------------------------ one part
    def _run_part(self, client: ServerClient, part: _Part) -> list[bool]:
        job = part.job
        keys = [job.keys[i] for i in part.indices]
        views = [job.views[i] for i in part.indices]
        welcome = client.welcome
        assert welcome is not None
        too_big = [len(v) > welcome.max_value_bytes or len(k) > welcome.max_key_bytes for k, v in zip(keys, views)]
        chosen = [i for i, bad in enumerate(too_big) if not bad]
        ok = [False] * len(keys)
        step = max(1, min(welcome.max_keys, self.backend.settings.max_batch_keys))
        for start in range(0, len(chosen), step):
            sub = chosen[start : start + step]
            sub_keys = [keys[i] for i in sub]
            sub_views = [views[i] for i in sub]
            if job.is_put:
                good = self._put(client, sub_keys, sub_views)
            else:
                good = self._get(client, sub_keys, sub_views)
            for i, g in zip(sub, good):
                ok[i] = g
        return ok

    def _use_nixl(self, views: list[memoryview]) -> bool:
        """NIXL for this request: the connection has it and the staged views fit the arena."""
        nixl = self.backend.nixl
        if not self.nixl_active or nixl is None:
            return False
        staged = sum(len(v) for v in views if nixl.locate(v) is None)
        return staged <= nixl.arena_bytes

    def _put(self, client: ServerClient, keys: list[bytes], views: list[memoryview]) -> list[bool]:
        overwrite = self.backend.settings.overwrite
        if not self._use_nixl(views):
            return [s in p.OK_PUT for s in client.put(keys, views, overwrite)]
        addrs = self._nixl_addresses(client, views, copy_in=True)
        statuses = client.put_remote(keys, [len(v) for v in views], addrs, overwrite)
        return [s in p.OK_PUT for s in statuses]

    def _get(self, client: ServerClient, keys: list[bytes], views: list[memoryview]) -> list[bool]:
        if not self._use_nixl(views):
            statuses, sizes = client.get(keys, views)
        else:
            addrs = self._nixl_addresses(client, views, copy_in=False)
            statuses, sizes = client.get_remote(keys, [len(v) for v in views], addrs)
            self._copy_out(views, addrs, statuses, sizes)
        ok = []
        for view, status, size in zip(views, statuses, sizes):
            good = status is p.Status.OK and size == len(view)
            if status is p.Status.OK and not good:
                view[:size] = bytes(size)  # a value of another size: not this chunk, leave nothing
            if status is p.Status.MISS:
                self.backend._count("misses")
            ok.append(good)
        return ok

    def _nixl_addresses(self, client: ServerClient, views: list[memoryview], copy_in: bool) -> list[int]:
        """Where the server finds (put) or puts (get) each value: in place, or in this thread's arena."""
        nixl = self.backend.nixl
        assert nixl is not None
        version, metadata = nixl.metadata()
        if version != self._meta_version:
            client.agent_meta(metadata)
            self._meta_version = version
        arena, arena_addr = nixl.arena(self.index)
        offset = 0
        addrs = []
        for view in views:
            addr = nixl.locate(view)
            if addr is None:
                addr = arena_addr + offset
                if copy_in:
                    arena[offset : offset + len(view)] = view
                offset += len(view)
            addrs.append(addr)
        return addrs

    def _copy_out(self, views: list[memoryview], addrs: list[int], statuses: list[p.Status], sizes: list[int]) -> None:
        nixl = self.backend.nixl
        assert nixl is not None
        arena, arena_addr = nixl.arena(self.index)
        for view, addr, status, size in zip(views, addrs, statuses, sizes):
            if status is p.Status.OK and arena_addr <= addr < arena_addr + len(arena) and view_address(view) != addr:
                start = addr - arena_addr
                view[:size] = arena[start : start + size]


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
