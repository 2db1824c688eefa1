"""The Redis tier: framed chunks in a Redis server or a Redis Cluster shared by many engines.

Keys and values. A chunk lives under ``b"tc:" + key``. The chunk key already
starts with the engine's 8-byte namespace digest (which covers model, KV
layout, TP rank and size, ...: DESIGN.md section 2), so engines read exactly
the chunks they can use, and ``SCAN MATCH tc:*`` finds tiercache's keys in a
shared server. The value is a compact frame of :mod:`tiercache.integrity`
(header with namespace, key, payload length and xxh3_64 checksum, then the
payload). Every load verifies the frame before one byte reaches the caller's
buffer: a damaged, truncated or foreign value is a miss, counted in
``stats()["checksum_failures"]``. With ``ttl_seconds`` every SET carries
``EX``, so chunks nobody rewrites expire.

Cluster (``cluster: true``). redis-py's ``RedisCluster`` keeps the slot map.
Keys carry no hash tag: the chunks of one sequence hash to different slots
and so spread over the masters; a job's pipeline is split per node by
redis-py's cluster pipeline (one round trip per node per batch), which also
follows MOVED and ASK while slots migrate. A hash tag would put a sequence on
one master and buy nothing, since no command here spans keys.

I/O. Puts are pipelined ``SET`` (``pipeline_batch`` keys per round trip);
gets pipelined ``GET``; deletes pipelined ``UNLINK`` (the server frees large
values off its main thread); lookups pipelined ``EXISTS``. A frame is never
assembled in memory: the connections use a serializer
(:class:`_FramePacker`) that sends a frame argument as the RESP length, the
frame header and the caller's payload view as separate pieces, so a payload
goes from the engine's buffer to the socket without a copy (redis-py's hiredis
serializer copies every value twice). Replies are parsed by hiredis.

Asynchronous lookups. The scheduler must not wait for a network round trip
(DESIGN.md section 3: a lookup answers None and is asked again next step)::

    backend.submit_contains(request_id, keys)        # returns at once
    ...                                              # a later scheduler step:
    for token, held in backend.poll_contains():      # never blocks
        ...                                          # held[i]: keys[i] is in Redis

Each submit is answered exactly once, by a thread of its own (lookups never
queue behind chunk I/O); while the server is down, lookups answer all False
without I/O. ``contains(keys)`` is the blocking form: one round trip on the
caller's thread (all False, at once, while the tier is down; right after
construction it waits for the first connection attempt).

Budget. A shared tier is not owned by one engine: Redis evicts by its own
``maxmemory-policy`` (``allkeys-lru``, or ``volatile-lru`` with a TTL, is what
a cache wants) and by TTL. ``context.capacity_bytes`` is advisory (the
manager's own accounting); this backend does not enforce it. It enforces only
that a value is a chunk: a put's view holds 1 to ``chunk_bytes`` bytes, and a
loaded frame's payload is exactly as long as the caller's buffer. A chunk the
manager believes stored may vanish at any time (eviction, TTL, a flush,
another engine's delete); its load then fails as a miss. A put and a delete
of one key that are in flight together may reach Redis in either order; both
outcomes (the chunk, or a miss) are valid states of a cache. The memory a
chunk really costs in Redis is its frame plus the server's per-key overhead
and jemalloc's size-class rounding, which :meth:`RedisBackend.footprint` does
not try to predict: a value of a power-of-two size plus anything (Redis's own
string header is enough, framed or not) lands in the next size class, so a
256 KiB, 1 MiB or 4 MiB chunk occupies 320 KiB, 1.25 MiB or 5 MiB
(``MEMORY USAGE``); size ``maxmemory`` for that.

Restarts. :meth:`RedisBackend.recover` returns nothing: a shared tier is
looked up, not owned, and Redis keeps its data across a reconnect of the
client, so there is no directory to rebuild.

Failures. A connection-level error (refused, reset, socket timeout, cluster
down, authentication) fails the rest of that job, counts in
``connection_errors`` and marks the tier *down*. While down every job and
lookup fails at once (no I/O, so a dead Redis costs the engine nothing but
misses), and one reconnect thread tries to connect again after
``reconnect_initial_s``, doubling the wait up to ``reconnect_max_s`` (plus up
to 25% jitter, so engines do not return in lockstep). A successful probe (a
fresh client and a PING of every master) brings the tier back *up* and counts
in ``reconnects``. An error reply for one command (OOM under ``noeviction``, a
read-only replica) fails that key and counts in ``server_errors``. Nothing
raises into the caller after construction; construction raises only for
invalid settings, never because Redis is unreachable.

Threads. The owner's thread calls ``submit_put``, ``submit_get``,
``submit_contains``, ``poll``, ``poll_contains``, ``delete``, ``stats``,
``contains`` and ``close``; none of them waits for I/O except ``contains``
and ``close`` (which finishes the queued jobs first).
``io_threads`` threads (:class:`Lane`) run put, get and delete jobs, gets and
deletes before puts (a get is what a request waits for); a one-thread lane
runs lookups; the reconnect thread (:class:`Link`) owns the client's life:
it creates the client, probes, and replaces it after an outage. Results reach
the owner through locked lists. Counters are bumped under a lock.

Buffers. A job holds the caller's views from submit until its JobResult is
published and drops them before; the frame headers it builds and the reply
bytes hiredis allocates are its own. The serializer hands the payload view to
the socket, never keeping it past the send.

Files: the backend here; options in ``redis_settings`` (re-exported here),
connections in ``redis_client``, the reconnect thread and lanes in ``redis_link``.
"""

from __future__ import annotations

import enum
import logging
import re
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Any, Literal, TypeVar

import numpy as np

from tiercache import integrity
from tiercache.backend import Backend, BackendContext, JobResult
from tiercache.backends.redis.client import TROUBLE, Client, Framed, connect
from tiercache.backends.redis.link import LinkState, Job, Lane, Link
from tiercache.backends.redis.settings import RedisSettings
from tiercache.buffers import as_key_bytes, flat_byte_view
from tiercache.counters import Counters

logger = logging.getLogger(__name__)

#: Prefix of every Redis key this tier writes (a shared server stays inspectable).
KEY_TAG = b"tc:"
#: Longest chunk key this tier stores (namespace 8 + prefix hash + group 4; vLLM's
#: block hashes are at most 32 bytes); :meth:`RedisBackend.footprint` counts this length.
MAX_KEY_BYTES = 128
#: Keys per pipeline round trip for the small commands (EXISTS, UNLINK).
SMALL_BATCH = 1024


def redis_key(key: bytes) -> bytes:
    """The Redis key of a chunk key."""
    return KEY_TAG + key


_COUNTERS = (
    "puts", "gets", "put_failures", "get_failures", "checksum_failures", "delete_failures",
    "lookups", "lookup_failures", "server_errors", "connection_errors", "connect_attempts",
    "reconnects",
)


class _Load(enum.Enum):
    OK = "ok"
    MISSING = "missing"
    CORRUPT = "corrupt"  # failed verification: damaged, foreign, or not this key's frame
    WRONG_SIZE = "wrong_size"  # intact, but the caller's buffer has another length
    ERROR = "error"  # an error reply for this key


_Outcome = tuple[list[bytes], list[bytes], int]  # ok keys, failed keys, payload bytes moved
_I = TypeVar("_I")


# ----------------------------------------------------------------------------- backend
class RedisBackend(Backend):
    """Chunks in Redis or Redis Cluster; see the module docstring for keys, threads, failures."""

    name = "redis"
    settings_model = RedisSettings
    shared = True  # other engines write it too: looked up asynchronously, not owned
    verifies_integrity = True  # compact frames, checked on every load

    @classmethod
    def footprint(cls, chunk_bytes: int) -> int:
        """Bytes of one chunk's largest frame (advisory: Redis adds its own overhead)."""
        return integrity.compact_header_len(MAX_KEY_BYTES) + chunk_bytes

    def __init__(self, settings: RedisSettings, context: BackendContext) -> None:
        """Start the threads and the first connection attempt; never waits for Redis."""
        if len(context.namespace) != 8:
            raise ValueError(f"namespace digest must be 8 bytes, got {len(context.namespace)}")
        self.settings = settings
        self.context = context
        self._counters = Counters(_COUNTERS)
        self._results: list[JobResult] = []
        self._answers: list[tuple[Hashable, list[bool]]] = []
        self._results_lock = threading.Lock()
        # key -> its queued deletes not yet done; gets and lookups miss such keys.
        self._deleting: dict[bytes, int] = {}
        self._deleting_lock = threading.Lock()
        self._closed = False
        name = f"redis-{context.tier_name}"
        client_name = _client_name(context)
        self._link = Link(settings, self._counters, name,
                           lambda: connect(settings, client_name))
        self._io = Lane(f"{name}-io", settings.io_threads, 2, self._run)
        self._lookups = Lane(f"{name}-lookup", 1, 1, self._run)

    # ------------------------------------------------------------------ owner thread
    @property
    def state(self) -> LinkState:
        """Whether the tier is up (see the module docstring, Failures)."""
        return self._link.state

    def submit_put(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        job = self._intake("put", job_id, keys, views)
        if job is not None:
            self._io.push(job, queue=1)

    def submit_get(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        job = self._intake("get", job_id, keys, views)
        if job is not None:
            self._io.push(job, queue=0)

    def poll(self) -> list[JobResult]:
        with self._results_lock:
            results, self._results = self._results, []
        return results

    def submit_contains(self, token: Hashable, keys: Sequence[bytes]) -> None:
        """Ask which ``keys`` Redis holds; the answer comes once from :meth:`poll_contains`."""
        wanted = [as_key_bytes(k) for k in keys]
        if self._closed or not any(map(self._storable, wanted)):
            self._answer(token, [False] * len(wanted))
        else:
            self._lookups.push(Job("contains", token, wanted))

    def poll_contains(self) -> list[tuple[Hashable, list[bool]]]:
        """Answers to :meth:`submit_contains` since the last call: ``(token, held)``; never blocks."""
        with self._results_lock:
            answers, self._answers = self._answers, []
        return answers

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys Redis holds now: one round trip on this thread (all False while down).

        Right after construction it first waits for the first connection attempt.
        """
        wanted = [as_key_bytes(k) for k in keys]
        client = None if self._closed else self._link.client(wait_for_start=True)
        if client is None:
            return [False] * len(wanted)
        return self._exists(client, wanted)

    def delete(self, keys: Sequence[bytes]) -> None:
        """Queue the keys' removal; gets and lookups miss them from now on."""
        keys = [k for k in map(as_key_bytes, keys) if self._storable(k)]
        if self._closed or not keys:
            return
        with self._deleting_lock:
            for key in keys:
                self._deleting[key] = self._deleting.get(key, 0) + 1
        self._io.push(Job("delete", -1, keys), queue=0)

    def recover(self) -> tuple[bytes, ...]:
        """Nothing: a shared tier is looked up, not owned (see the module docstring)."""
        return ()

    def stats(self) -> dict[str, int | str]:
        """Event counts since open (see ``_COUNTERS``), ``state`` (starting/up/down) and ``up``."""
        out: dict[str, int | str] = dict(self._counters.snapshot())
        out["state"] = self._link.state.value
        out["up"] = int(self._link.state is LinkState.UP)
        return out

    def close(self) -> None:
        """Finish the queued jobs, then stop the threads and close the client. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._io.stop()
        self._lookups.stop()
        self._link.close()
        with self._results_lock:
            self._results.clear()
            self._answers.clear()

    # ------------------------------------------------------------------- job intake
    def _intake(
        self, kind: Literal["put", "get"], job_id: int, keys: Sequence[bytes],
        views: Sequence[memoryview],
    ) -> Job | None:
        """Check a job's keys and buffers on the owner thread; None once it is already reported."""
        job = Job(kind, job_id, [], submitted=[as_key_bytes(k) for k in keys])
        if self._closed or len(keys) != len(views):
            job.refused = list(range(len(job.submitted)))
        else:
            for i, (key, view) in enumerate(zip(job.submitted, views)):
                flat = flat_byte_view(view, writable=kind == "get")
                usable = flat is not None and 0 < flat.nbytes <= self.context.chunk_bytes
                if usable and self._storable(key):
                    job.keys.append(key)
                    job.views.append(flat)  # type: ignore[arg-type]
                else:
                    job.refused.append(i)
        if job.refused:
            self._counters.add(**{f"{kind}_failures": len(job.refused)})
        if job.keys:
            return job
        self._push(JobResult(job_id, (), tuple(job.submitted), 0, 0.0))
        return None

    def _storable(self, key: Any) -> bool:
        """A key of this namespace that the frame format and the budget allow."""
        return (
            isinstance(key, bytes)
            and len(key) <= MAX_KEY_BYTES
            and key.startswith(self.context.namespace)
        )

    def _push(self, result: JobResult) -> None:
        with self._results_lock:
            self._results.append(result)

    def _answer(self, token: Hashable, held: list[bool]) -> None:
        with self._results_lock:
            self._answers.append((token, held))

    # --------------------------------------------------------------- worker threads
    def _run(self, job: Job) -> None:
        """Run one job to its result or answer; nothing escapes into the thread."""
        if job.kind == "contains":
            self._answer(job.job_id, self._lookup(job.keys))
            return
        start = time.perf_counter()
        try:
            ok, failed, moved = self._dispatch(job)
        except Exception:  # a bug or an unforeseen client state: the job fails, the tier lives
            logger.exception("redis tier: %s job %r failed", job.kind, job.job_id)
            ok, failed, moved = [], list(job.keys), 0
            if job.kind != "delete":
                self._counters.add(**{f"{job.kind}_failures": len(failed)})
        finally:
            job.views.clear()  # no reference to the caller's buffers outlives the job
            if job.kind == "delete":
                self._forget_deleting(job.keys)
        if job.kind != "delete":
            failed = _in_order(job, failed)
            self._push(JobResult(job.job_id, tuple(ok), tuple(failed), moved,
                                 time.perf_counter() - start))

    def _dispatch(self, job: Job) -> _Outcome:
        client = self._link.client(wait_for_start=True)
        if job.kind == "put":
            return self._put(client, job)
        if job.kind == "get":
            return self._get(client, job)
        self._delete(client, job)
        return [], [], 0

    def _lookup(self, keys: list[bytes]) -> list[bool]:
        try:
            return self._exists(self._link.client(wait_for_start=True), keys)
        except Exception:  # as in _run: the lookup misses, the tier lives
            logger.exception("redis tier: lookup of %d keys failed", len(keys))
            return [False] * len(keys)

    def _put(self, client: Client | None, job: Job) -> _Outcome:
        ok: list[bytes] = []
        moved = errors = 0
        ex = ("EX", self.settings.ttl_seconds) if self.settings.ttl_seconds else ()

        def command(pair: tuple[bytes, memoryview]) -> tuple[Any, ...]:
            key, view = pair
            header = integrity.frame_header(self.context.namespace, key, view)
            return ("SET", redis_key(key), Framed(header, view), *ex)

        pairs = list(zip(job.keys, job.views))
        for batch, replies in self._pipelines(client, pairs, self.settings.pipeline_batch, command):
            for (key, view), reply in zip(batch, replies):
                if isinstance(reply, BaseException):
                    errors += self._reply_error(client, reply)
                else:
                    ok.append(key)
                    moved += view.nbytes
        failed = _missing(job.keys, ok)
        self._counters.add(puts=len(ok), put_failures=len(failed), server_errors=errors)
        return ok, failed, moved

    def _get(self, client: Client | None, job: Job) -> _Outcome:
        ok: list[bytes] = []
        moved = corrupt = errors = 0
        pairs = [(k, v) for k, v in zip(job.keys, job.views) if k not in self._deleting]
        batches = self._pipelines(client, pairs, self.settings.pipeline_batch,
                                  lambda pair: ("GET", redis_key(pair[0])))
        for batch, replies in batches:
            for i, (key, view) in enumerate(batch):
                outcome = self._unframe(client, key, replies[i], view)
                replies[i] = None  # let a large reply go as soon as it is used
                if outcome is _Load.OK:
                    ok.append(key)
                    moved += view.nbytes
                corrupt += outcome is _Load.CORRUPT
                errors += outcome is _Load.ERROR
        failed = _missing(job.keys, ok)
        self._counters.add(gets=len(ok), get_failures=len(failed), checksum_failures=corrupt,
                           server_errors=errors)
        return ok, failed, moved

    def _unframe(self, client: Client | None, key: bytes, reply: Any, out: memoryview) -> _Load:
        """Verify ``reply`` as ``key``'s frame, then copy its payload into ``out`` (else untouched)."""
        if reply is None:
            return _Load.MISSING
        if isinstance(reply, BaseException):
            return _Load.ERROR if self._reply_error(client, reply) else _Load.MISSING
        frame = memoryview(reply)
        header_len = integrity.compact_header_len(len(key))
        try:
            if frame.nbytes < header_len:
                raise integrity.FrameFormatError(f"a value of {frame.nbytes} bytes is no frame")
            payload = frame[header_len:]
            integrity.verify_frame(frame[:header_len], payload, self.context.namespace, key)
        except integrity.IntegrityError as exc:
            logger.warning("redis tier: dropping chunk %s: %s", key.hex(), exc)
            return _Load.CORRUPT
        if payload.nbytes != out.nbytes:
            return _Load.WRONG_SIZE
        np.copyto(np.frombuffer(out, dtype=np.uint8), np.frombuffer(payload, dtype=np.uint8))
        return _Load.OK

    def _exists(self, client: Client | None, keys: list[bytes]) -> list[bool]:
        """Pipelined EXISTS of each key; False for keys being deleted, and on trouble."""
        held = [False] * len(keys)
        asked = [i for i, k in enumerate(keys) if self._storable(k) and k not in self._deleting]
        answered = 0
        batches = self._pipelines(client, asked, SMALL_BATCH,
                                  lambda i: ("EXISTS", redis_key(keys[i])))
        for batch, replies in batches:
            for i, reply in zip(batch, replies):
                held[i] = reply == 1
            answered += len(batch)
        self._counters.add(lookups=len(keys), lookup_failures=len(asked) - answered)
        return held

    def _delete(self, client: Client | None, job: Job) -> None:
        done = 0
        batches = self._pipelines(client, job.keys, SMALL_BATCH,
                                  lambda key: ("UNLINK", redis_key(key)))
        for _, replies in batches:
            done += sum(not isinstance(r, BaseException) for r in replies)
        if done < len(job.keys):  # those chunks stay until TTL or eviction: only stale hits
            self._counters.add(delete_failures=len(job.keys) - done)

    def _pipelines(
        self, client: Client | None, items: list[_I], size: int,
        command: Callable[[_I], tuple[Any, ...]],
    ) -> Iterator[tuple[list[_I], list[Any]]]:
        """``(batch, replies)`` per pipeline of ``size`` items, while ``client`` is the live one.

        A connection-level error reports trouble and ends the iteration; an
        error reply of one command is an exception object in its reply's place.
        """
        for batch in _batches(items, size):
            if client is None or self._link.client() is not client:
                return
            pipe = client.pipeline(transaction=False)
            try:
                for item in batch:
                    pipe.execute_command(*command(item))
                replies = pipe.execute(raise_on_error=False)
            except TROUBLE as exc:
                self._link.trouble(client, exc)
                return
            yield batch, replies

    def _reply_error(self, client: Client | None, error: BaseException) -> int:
        """Classify an error in one command's place: 1 if the server refused it, 0 if trouble."""
        if isinstance(error, TROUBLE):
            if client is not None:
                self._link.trouble(client, error)
            return 0
        logger.warning("redis tier: error reply: %s", error)
        return 1

    def _forget_deleting(self, keys: list[bytes]) -> None:
        with self._deleting_lock:
            for key in keys:
                left = self._deleting.get(key, 0) - 1
                if left > 0:
                    self._deleting[key] = left
                else:
                    self._deleting.pop(key, None)


# ----------------------------------------------------------------------------- helpers
def _client_name(context: BackendContext) -> str:
    """The name the connections give themselves (CLIENT LIST shows it): no spaces allowed."""
    return re.sub(r"[^A-Za-z0-9_.:-]", "_", f"tiercache-{context.tier_name}-rank{context.rank}")


def _batches(items: list[Any], size: int) -> Iterable[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _missing(keys: list[bytes], ok: list[bytes]) -> list[bytes]:
    """``keys`` that are not in ``ok``, in order (a key may appear more than once)."""
    if len(ok) == len(keys):
        return []
    done = set(ok)
    return [k for k in keys if k not in done]


def _in_order(job: Job, failed: list[bytes]) -> list[bytes]:
    """The job's failed keys, those refused at intake included, in submission order."""
    if not job.refused:
        return failed
    refused, gone = set(job.refused), set(failed)  # refused keys need not even be hashable
    return [key for i, key in enumerate(job.submitted) if i in refused or key in gone]



