"""The cache-server tier's I/O threads: one connection each, serving one request queue.

A :class:`Worker` owns one :class:`~tiercache.server.client.ServerClient`
(connected on demand, reconnected with exponential backoff) and one thread
that takes requests off its queue until it finds ``None``: a :class:`Part` of
a job (its keys put or got, over TCP or NIXL, and always reported to
:meth:`ServerBackend.part_done
<tiercache.backends.server.backend.ServerBackend.part_done>`) or a
synchronous :class:`Call` (its result handed to the waiting caller's future).
The data workers share the backend's ``requests`` queue (parts); one lookup
worker (``data=False``: no NIXL, never a part) serves its ``calls`` queue
alone, so a lookup never waits behind a job's megabytes.
Over TCP a part goes as requests of ``pipeline_request_bytes`` with up to
``pipeline_depth`` in flight on the connection (:meth:`Worker._pipelined`:
the next request is framed and sent while the server handles the one
before; replies come in order, each checked against its request id by the
client); over NIXL one request at a time. The thread reads a put's views
and writes a get's views only while it runs their part; every value is a
frame (:mod:`.frames`: built on put, verified on get before the key counts
as loaded; over TCP a get's frames are checked ~256 KiB at a time as their bytes
arrive, while in the cache: :class:`~.arrival_checks.ArrivalChecks`); over NIXL a chunk in registered memory
moves in place and any other through the arena that is this thread's own
(index ``index`` of the backend's
:class:`~tiercache.server.nixl_client.NixlClientSide`), the frame header
always in the message body (``nixl_staged_bytes`` counts the arena copies).

These threads are not :class:`~tiercache.tiers.worker_lanes.WorkerLanes`:
each keeps its own connection and backoff state, and the backend's ``close``
bounds how long it waits for them (a dead server must not hang it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from tiercache.backends.server.arrival_checks import ArrivalChecks
from tiercache.backends.server.frames import Framer
from tiercache.backends.server.settings import ServerSettings

from tiercache import faults
from tiercache.backend import BackendContext
from tiercache.server import protocol as p
from tiercache.server.client import Pending, ServerClient
from tiercache.server.nixl_client import NixlClientSide
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
    nixl: NixlClientSide | None
    framer: Framer

    def count(self, name: str, n: int = 1) -> None: ...

    def part_done(self, part: Part, ok: list[bool]) -> None: ...

    def note_refused(self, keys: Sequence[bytes]) -> None: ...

    def check_slot_fit(self, max_value_bytes: int) -> None: ...

    def take_refused(self, keys: Sequence[bytes]) -> bool: ...


class Worker:
    """One I/O thread and its connection, serving ``requests``.

    ``data``: a data worker (parts of jobs, NIXL when the backend has it; ``index``
    picks its NIXL arena); else a lookup worker (calls only, TCP only).
    """

    def __init__(self, backend: WorkerOwner, index: int, client: ServerClient,
                 requests: queue.SimpleQueue[Part | Call | None], data: bool = True) -> None:
        self.backend = backend
        self.index = index
        self.client = client
        self.requests = requests
        self.data = data
        self.backoff = backend.settings.backoff_min_s
        self.next_attempt = 0.0
        self.nixl_active = False
        self._meta_version = 0
        self.thread = threading.Thread(
            target=self._run, daemon=True,
            name=f"tiercache-server-{backend.context.tier_name}-{index if data else 'lookups'}"
        )

    def _run(self) -> None:
        while True:
            item = self.requests.get()
            if item is None:
                return
            try:
                self._serve(item)
            except Exception as exc:
                faults.record(faults.BACKEND_EXCEPTION, exc, where=f"server tier {self.backend.context.tier_name}")

    def _serve(self, item: Part | Call) -> None:
        """One queued request: a synchronous call, or a part of a job (always reported)."""
        backend = self.backend
        if isinstance(item, Call):
            if item.future.set_running_or_notify_cancel():
                try:
                    item.future.set_result(self._with_connection(item.fn))
                except Exception as exc:
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
            if not self.client.closed_by_server():
                return
            self.client.close()  # idle-closed or drained by the server: a fresh one, no backoff
            self.nixl_active = False
            self.backend.count("server_closed")
        backend = self.backend
        now = time.monotonic()
        if now < self.next_attempt:
            backend.count("fast_failures")
            raise ConnectionError("server unreachable; waiting before reconnecting")
        nixl = backend.nixl if self.data else None
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
        backend.check_slot_fit(welcome.max_value_bytes)
        self.backoff = backend.settings.backoff_min_s
        self.nixl_active = nixl is not None and welcome.nixl
        if self.data and backend.settings.data_path == "nixl" and not self.nixl_active:
            self.client.close()
            raise ConnectionError("data_path is nixl but the server or this client has no NIXL")

    # ------------------------------------------------------------------ one part
    def _run_part(self, client: ServerClient, part: Part) -> list[bool]:
        job = part.job
        keys = [job.keys[i] for i in part.indices]
        views = [job.views[i] for i in part.indices]
        welcome = client.welcome
        assert welcome is not None
        settings = self.backend.settings
        too_big = [len(v) > welcome.max_value_bytes or len(k) > welcome.max_key_bytes for k, v in zip(keys, views)]
        chosen = [i for i, bad in enumerate(too_big) if not bad]
        ok = [False] * len(keys)
        max_keys = max(1, min(welcome.max_keys, settings.max_batch_keys))
        pipelined = not self.nixl_active and settings.pipeline_depth > 1
        max_bytes = min(welcome.max_payload_bytes, settings.pipeline_request_bytes if pipelined else 1 << 62)
        sizes = [Framer.framed_bytes(keys[i], views[i]) for i in chosen]
        subs = _batches(chosen, sizes, max_keys, max_bytes)
        if pipelined:
            results = self._pipelined(client, job.kind == "put", keys, views, subs)
        else:
            results = ((sub, self._one_request(client, job.kind == "put", keys, views, sub)) for sub in subs)
        for sub, good in results:
            for i, g in zip(sub, good):
                ok[i] = g
        return ok

    def _one_request(self, client: ServerClient, is_put: bool, keys: list[bytes], views: list[memoryview],
                     sub: list[int]) -> list[bool]:
        sub_keys = [keys[i] for i in sub]
        sub_views = [views[i] for i in sub]
        return self._put(client, sub_keys, sub_views) if is_put else self._get(client, sub_keys, sub_views)

    def _pipelined(self, client: ServerClient, is_put: bool, keys: list[bytes], views: list[memoryview],
                   subs: list[list[int]]) -> Iterator[tuple[list[int], list[bool]]]:
        """A part's TCP requests with up to ``pipeline_depth`` in flight: the next request is framed
        (checksummed) and sent while the server stores or fetches the one before, and a get's values
        are verified while the server prepares the next. Results come in order, per request."""
        framer = self.backend.framer
        depth = self.backend.settings.pipeline_depth
        sent: deque[tuple[list[int], Pending, list[tuple[memoryview, memoryview]]]] = deque()
        for sub in subs:
            sub_keys = [keys[i] for i in sub]
            sub_views = [views[i] for i in sub]
            if is_put:
                values = framer.put_values(sub_keys, sub_views)
                sent.append((sub, client.send_put(sub_keys, values, self._overwrite(sub_keys)), []))
            else:
                frames = framer.get_values(sub_keys, sub_views)
                sent.append((sub, client.send_get(sub_keys, frames), frames))
            if len(sent) >= depth:
                yield self._received(client, keys, views, *sent.popleft())
        while sent:
            yield self._received(client, keys, views, *sent.popleft())

    def _received(self, client: ServerClient, keys: list[bytes], views: list[memoryview], sub: list[int],
                  pending: Pending, frames: list[tuple[memoryview, memoryview]]) -> tuple[list[int], list[bool]]:
        """The reply of one pipelined request: a put's statuses, or a get's values verified."""
        if pending.msg_type is p.MsgType.PUT:
            statuses, _ = client.finish(pending)
            return sub, [s in p.OK_PUT for s in statuses]
        sub_keys = [keys[i] for i in sub]
        checks = ArrivalChecks(self.backend.framer, sub_keys, frames)
        statuses, sizes = client.finish(pending, checks.on_data)
        return sub, self._verified(sub_keys, [views[i] for i in sub], frames, statuses, sizes, checks.passed)

    def _use_nixl(self, keys: list[bytes], views: list[memoryview]) -> bool:
        """NIXL for this request: the connection has it, the chunks outside registered memory fit
        the arena, and the heads fit the server's body limit."""
        nixl = self.backend.nixl
        if not self.nixl_active or nixl is None:
            return False
        welcome = self.client.welcome
        body = sum(len(k) + h + 24 for k, h in zip(keys, Framer.head_lens(keys))) + 64
        if welcome is not None and body > welcome.max_body_bytes:
            return False
        return Framer.staged_bytes(views, nixl.locate) <= nixl.arena_bytes

    def _overwrite(self, keys: list[bytes]) -> bool:
        """Whether a put of ``keys`` replaces the server's copies: the setting, or any key whose stored
        copy failed our check (else a damaged or forged chunk stays a miss until evicted)."""
        return self.backend.settings.overwrite or self.backend.take_refused(keys)

    def _put(self, client: ServerClient, keys: list[bytes], views: list[memoryview]) -> list[bool]:
        overwrite = self._overwrite(keys)
        framer = self.backend.framer
        values = framer.put_values(keys, views)
        if not self._use_nixl(keys, views):
            return [s in p.OK_PUT for s in client.put(keys, values, overwrite)]
        targets, addrs = self._place(client, views)
        for target, view in zip(targets, views):
            if target is not view:  # outside registered memory: staged in the arena
                framer.copy(target, view)
                self.backend.count("nixl_staged_bytes", len(view))
        heads = [head for head, _ in values]
        sizes = [len(head) + len(view) for head, view in values]
        return [s in p.OK_PUT for s in client.put_remote(keys, sizes, addrs, overwrite, heads)]

    def _get(self, client: ServerClient, keys: list[bytes], views: list[memoryview]) -> list[bool]:
        framer = self.backend.framer
        passed: set[int] = set()
        if not self._use_nixl(keys, views):
            frames = framer.get_values(keys, views)
            checks = ArrivalChecks(framer, keys, frames)
            statuses, sizes = client.get(keys, frames, checks.on_data)
            passed = checks.passed
        else:
            targets, addrs = self._place(client, views)
            head_lens = Framer.head_lens(keys)
            capacities = [h + len(v) for h, v in zip(head_lens, views)]
            try:
                statuses, sizes, heads = client.get_remote_heads(keys, capacities, addrs, head_lens)
            except BaseException:  # the server may have written into the views: leave nothing
                for target, view in zip(targets, views):
                    if target is view:
                        view[:] = bytes(len(view))
                raise
            frames = [(memoryview(h), t) for h, t in zip(heads, targets)]
        return self._verified(keys, views, frames, statuses, sizes, passed)

    def _verified(self, keys: list[bytes], views: list[memoryview], frames: Sequence[tuple[memoryview, memoryview]],
                  statuses: list[p.Status], sizes: list[int], passed: set[int]) -> list[bool]:
        """Each got frame checked (a chunk staged in the arena delivered to its view once good); a
        view that received bytes that failed is zeroed, and the key remembered as refused.
        ``passed``: the indices of the frames that already passed as their values arrived (:class:`~.arrival_checks.ArrivalChecks`),
        by index."""
        framer = self.backend.framer
        ok: list[bool] = []
        refused: list[bytes] = []
        for i, (key, view, (head, body), status, size) in enumerate(zip(keys, views, frames, statuses, sizes)):
            good = status is p.Status.OK and (i in passed or framer.verified(key, head, body, size))
            if good and body is not view:
                framer.copy(view, body)  # verified in the arena, then delivered
                self.backend.count("nixl_staged_bytes", len(view))
            elif not good and body is view and status in (p.Status.OK, p.Status.FAILED):
                view[:] = bytes(len(view))  # received (maybe in part), then refused: leave nothing of it
            if status is p.Status.OK and not good:
                self.backend.count("checksum_failures")
                refused.append(key)
            if status is p.Status.MISS:
                self.backend.count("misses")
            ok.append(good)
        if refused:
            self.backend.note_refused(refused)
        return ok

    def _place(self, client: ServerClient, views: list[memoryview]) -> tuple[list[memoryview], list[int]]:
        """Where each chunk moves by NIXL (its view in place, or this thread's arena) and its address,
        after the server has this agent's current metadata (a buffer registered since)."""
        nixl = self.backend.nixl
        assert nixl is not None
        version, metadata = nixl.metadata()
        if version != self._meta_version:
            client.agent_meta(metadata)
            self._meta_version = version
        return Framer.place(nixl.arena(self.index)[0], views, nixl.locate)


def _batches(indices: list[int], sizes: list[int], max_keys: int, max_bytes: int) -> list[list[int]]:
    """``indices`` cut into requests of at most ``max_keys`` keys and ``max_bytes`` value bytes."""
    out: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, size in zip(indices, sizes):
        if current and (len(current) == max_keys or total + size > max_bytes):
            out.append(current)
            current, total = [], 0
        current.append(i)
        total += size
    if current:
        out.append(current)
    return out
