"""The Redis tier: framed chunks in a Redis server or a Redis Cluster shared by many engines.

Keys and values. A chunk lives under ``b"tc:" + key``. The chunk key already
starts with the engine's 8-byte namespace digest (which covers model, KV
layout, KV heads, ...: tiercache.keys), so engines read exactly
the chunks they can use, and ``SCAN MATCH tc:*`` finds tiercache's keys in a
shared server. The value is a compact frame of :mod:`tiercache.integrity`
(header with namespace, key, payload length and xxh3_64 checksum, then the
payload). Every load verifies the frame before one byte reaches the caller's
buffer: a damaged, truncated or foreign value is a miss, counted in
``stats()["checksum_failures"]``. With a ``mac_key`` (option, or
``TIERCACHE_MAC_KEY``) the checksum is a keyed MAC (:mod:`tiercache.mac`) and a
load refuses every value not written with the same key, so another client
of the Redis server, without the key, cannot poison this tier's chunks.
With ``ttl_seconds`` every SET carries ``EX``, so chunks nobody rewrites expire.

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
(docs/architecture.md, Shared tiers: a lookup answers None and is asked again next step)::

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
``io_threads`` threads (a lane of :class:`~tiercache.tiers.worker_lanes.WorkerLanes`)
run put, get and delete jobs, gets and deletes before puts (a get is what a
request waits for); a one-thread lane runs lookups; the reconnect thread
(:class:`Link`) owns the client's life: it creates the client, probes, and
replaces it after an outage. Results reach the owner through locked lists.
Counters are bumped under a lock.

Buffers. A job holds the caller's views from submit until its JobResult is
published and drops them before; the frame headers it builds and the reply
bytes hiredis allocates are its own. The serializer hands the payload view to
the socket, never keeping it past the send.

Files: the backend here (its jobs, lookups and threads); options in
:mod:`.settings` (re-exported here), connections in :mod:`.client`, the
reconnect thread in :mod:`.link`, the pipelined commands in :mod:`.commands`.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Hashable, Sequence

from tiercache.backends.redis.client import connect
from tiercache.backends.redis.commands import KEY_TAG, Commands, redis_key
from tiercache.backends.redis.link import Link, LinkState
from tiercache.backends.redis.settings import RedisSettings

from tiercache import integrity
from tiercache.backend import Backend, BackendContext, JobResult
from tiercache.buffers import as_key_bytes
from tiercache.counters import Counters
from tiercache.tiers.worker_lanes import BackendJob, JobDesk, Outcome, WorkerLanes

__all__ = ["KEY_TAG", "MAX_KEY_BYTES", "LinkState", "RedisBackend", "RedisSettings", "redis_key"]

logger = logging.getLogger(__name__)

#: Longest chunk key this tier stores (namespace 8 + prefix hash + group 4; vLLM's
#: block hashes are at most 32 bytes); :meth:`RedisBackend.footprint` counts this length.
MAX_KEY_BYTES = 128

_COUNTERS = (
    "puts", "gets", "put_failures", "get_failures", "checksum_failures", "delete_failures",
    "lookups", "lookup_failures", "server_errors", "connection_errors", "connect_attempts",
    "reconnects", "auth_failures",
)
#: The I/O lane's queues: gets and deletes first (a get is what a request waits for), then puts.
_FIRST, _PUTS = 0, 1


# ----------------------------------------------------------------------------- backend
class RedisBackend(Backend):
    """Chunks in Redis or Redis Cluster; see the module docstring for keys, threads, failures."""

    name = "redis"
    settings_model = RedisSettings
    shared = True  # other engines write it too: looked up asynchronously, not owned
    verifies_integrity = True  # compact frames (xxh3 or keyed MAC), checked on every load

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
        self._desk = JobDesk("redis tier", logger, self._counters, context, MAX_KEY_BYTES)
        self._answers: list[tuple[Hashable, list[bool]]] = []
        self._answers_lock = threading.Lock()
        self._closed = False
        name = f"redis-{context.tier_name}"
        client_name = _client_name(context)
        self._link = Link(settings, self._counters, name,
                           lambda: connect(settings, client_name))
        self._commands = Commands(settings, context, self._counters, self._link,
                                  self._desk.deleting, self._desk.storable)
        self._io = WorkerLanes(f"{name}-io-", settings.io_threads, 2, self._run, where="redis lane")
        self._lookups = WorkerLanes(f"{name}-lookup-", 1, 1, self._run, where="redis lane")

    # ------------------------------------------------------------------ owner thread
    @property
    def state(self) -> LinkState:
        """Whether the tier is up (see the module docstring, Failures)."""
        return self._link.state

    def submit_put(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        job = self._desk.intake("put", job_id, keys, views, refuse_all=self._closed)
        if job is not None:
            self._io.push(job, _PUTS)

    def submit_get(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        job = self._desk.intake("get", job_id, keys, views, refuse_all=self._closed)
        if job is not None:
            self._io.push(job, _FIRST)

    def poll(self) -> list[JobResult]:
        return self._desk.poll()

    def submit_contains(self, token: Hashable, keys: Sequence[bytes]) -> None:
        """Ask which ``keys`` Redis holds; the answer comes once from :meth:`poll_contains`."""
        wanted = [as_key_bytes(k) for k in keys]
        if self._closed or not any(map(self._desk.storable, wanted)):
            self._answer(token, [False] * len(wanted))
        else:
            self._lookups.push(BackendJob("contains", token, wanted))

    def poll_contains(self) -> list[tuple[Hashable, list[bool]]]:
        """Answers to :meth:`submit_contains` since the last call: ``(token, held)``; never blocks."""
        with self._answers_lock:
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
        return self._commands.exists(client, wanted)

    def delete(self, keys: Sequence[bytes]) -> None:
        """Queue the keys' removal; gets and lookups miss them from now on."""
        keys = [k for k in map(as_key_bytes, keys) if self._desk.storable(k)]
        if self._closed or not keys:
            return
        self._io.push(self._desk.queue_delete(keys), _FIRST)

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
        self._io.close()
        self._lookups.close()
        self._link.close()
        self._desk.clear()
        with self._answers_lock:
            self._answers.clear()

    def _answer(self, token: Hashable, held: list[bool]) -> None:
        with self._answers_lock:
            self._answers.append((token, held))

    # --------------------------------------------------------------- worker threads
    def _run(self, job: BackendJob) -> None:
        """Run one job to its result or answer; nothing escapes into the thread."""
        if job.kind == "contains":
            self._answer(job.job_id, self._lookup(job.keys))
        else:
            self._desk.run(job, self._dispatch)

    def _dispatch(self, job: BackendJob) -> Outcome:
        client = self._link.client(wait_for_start=True)
        run = {"put": self._commands.put, "get": self._commands.get,
               "delete": self._commands.delete}[job.kind]
        return run(client, job)

    def _lookup(self, keys: list[bytes]) -> list[bool]:
        try:
            return self._commands.exists(self._link.client(wait_for_start=True), keys)
        except Exception:  # as in JobDesk.run: the lookup misses, the tier lives
            logger.exception("redis tier: lookup of %d keys failed", len(keys))
            return [False] * len(keys)


# ----------------------------------------------------------------------------- helpers
def _client_name(context: BackendContext) -> str:
    """The name the connections give themselves (CLIENT LIST shows it): no spaces allowed."""
    return re.sub(r"[^A-Za-z0-9_.:-]", "_", f"tiercache-{context.tier_name}-rank{context.rank}")
