"""The cache-server tier's I/O threads: one connection each, serving one shared request queue.

A :class:`Worker` owns one :class:`~tiercache.server.client.ServerClient`
(connected on demand, reconnected with exponential backoff) and one thread
that takes requests off its backend's ``requests`` queue until it finds
``None``: a :class:`Part` of a job (its keys put or got, over TCP or NIXL,
and always reported to :meth:`ServerBackend.part_done
<tiercache.backends.server.backend.ServerBackend.part_done>`) or a
synchronous :class:`Call` (its result handed to the waiting caller's future).
The thread reads a put's views and writes a get's views only while it runs
their part; the arena it stages NIXL values through is its own (index
``index`` of the backend's :class:`~tiercache.server.nixl_client.NixlClientSide`).

These threads are not :class:`~tiercache.tiers.worker_lanes.WorkerLanes`:
each keeps its own connection and backoff state, and the backend's ``close``
bounds how long it waits for them (a dead server must not hang it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
import queue
from typing import Any, Protocol, TypeVar

from tiercache import faults
from tiercache.backend import BackendContext
from tiercache.backends.server.settings import ServerSettings
from tiercache.server import protocol as p
from tiercache.server.client import ServerClient
from tiercache.server.nixl_client import NixlClientSide, view_address
from tiercache.tiers.worker_lanes import PartedJob

# The tier's one logger: its backend module's name, the name log configurations filter on.
logger = logging.getLogger(f"{__package__}.backend")
T = TypeVar("T")


@dataclass(eq=False, slots=True)
class ServerJob(PartedJob):
    """The kit's record of a job cut into parts; ``ok[i]``: key ``i`` made it."""

    ok: list[bool] = field(default_factory=list)


@dataclass(eq=False)
class Part:
    """Some keys of a job (positions ``indices``), sent in one request."""

    job: ServerJob
    indices: list[int]


@dataclass(eq=False)
class Call:
    """A synchronous request (``contains``, ``delete``): ``fn`` runs on a connection."""

    fn: Callable[[ServerClient], Any]
    future: Future[Any]


class WorkerOwner(Protocol):
    """What a worker uses of its :class:`~tiercache.backends.server.backend.ServerBackend`."""

    settings: ServerSettings
    context: BackendContext
    requests: queue.SimpleQueue[Part | Call | None]
    nixl: NixlClientSide | None

    def count(self, name: str, n: int = 1) -> None: ...

    def part_done(self, part: Part, ok: list[bool]) -> None: ...


class Worker:
    """One I/O thread and its connection."""

    def __init__(self, backend: WorkerOwner, index: int, client: ServerClient) -> None:
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
            item = self.backend.requests.get()
            if item is None:
                return
            try:
                self._serve(item)
            except Exception as exc:  # noqa: BLE001 - the I/O thread outlives anything the server sends
                faults.record(faults.BACKEND_EXCEPTION, exc, where=f"server tier {self.backend.context.tier_name}")

    def _serve(self, item: Part | Call) -> None:
        """One queued request: a synchronous call, or a part of a job (always reported)."""
        backend = self.backend
        if isinstance(item, Call):
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
        backend.part_done(part, ok)

    def _with_connection(self, fn: Callable[[ServerClient], T]) -> T:
        self._connect()
        try:
            return fn(self.client)
        except (OSError, p.ProtocolError, p.RemoteError) as exc:
            self.client.close()
            self.nixl_active = False
            self.backend.count("request_errors")
            logger.warning("server tier %s: request to %s failed: %s", self.backend.context.tier_name,
                           self.backend.settings.address, exc)
            raise

    def _connect(self) -> None:
        if self.client.connected:
            return
        backend = self.backend
        now = time.monotonic()
        if now < self.next_attempt:
            backend.count("fast_failures")
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
            backend.count("connect_failures")
            self.next_attempt = time.monotonic() + self.backoff
            if self.backoff == backend.settings.backoff_min_s:
                logger.warning("server tier %s: cannot reach %s: %s", backend.context.tier_name,
                               backend.settings.address, exc)
            self.backoff = min(self.backoff * 2, backend.settings.backoff_max_s)
            raise
        backend.count("connects")
        self.backoff = backend.settings.backoff_min_s
        self.nixl_active = nixl is not None and welcome.nixl
        if backend.settings.data_path == "nixl" and not self.nixl_active:
            self.client.close()
            raise ConnectionError("data_path is nixl but the server or this client has no NIXL")

    # ------------------------------------------------------------------ one part
    def _run_part(self, client: ServerClient, part: Part) -> list[bool]:
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
            if job.kind == "put":
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
                self.backend.count("misses")
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
