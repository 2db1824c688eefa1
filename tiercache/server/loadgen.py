"""Load generation against a cache server: N concurrent clients putting and getting, verified.

Used by ``tiercache bench server`` and by tests/server/test_server_load.py.
Each client is a thread with its own connection (a separate TCP session to
the server; socket I/O releases the GIL). For a bounded time every client
loops: put a batch of new keys, or get a batch of keys among the last
``keyspace`` keys any client put (keep it below what the server holds for
mostly hits). Every value is a slice of one shared random pool chosen by a hash
of its key, so a put sends it in place and a get is checked byte for byte
(a value that comes back different, from another key or torn, is *corrupt*;
a key evicted since is a *miss*, which is allowed). Each request's latency
is recorded; the report has p50/p99 per operation and the throughput.

Threads: the client threads write only their own :class:`_ClientTally`; the
shared recent-key ring is guarded by a lock. ``progress`` is called from the
caller's thread while the clients run.
"""

from __future__ import annotations

import os
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import xxhash

from tiercache.server.client import ServerClient, parse_address
from tiercache.server.protocol import OK_PUT, ProtocolError, RemoteError, Status

POOL_BYTES = 16 << 20


@dataclass
class _ClientTally:
    put_lat: list[float] = field(default_factory=list)
    get_lat: list[float] = field(default_factory=list)
    put_keys: int = 0
    put_ok: int = 0
    get_keys: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    errors: int = 0
    bytes_put: int = 0
    bytes_got: int = 0


@dataclass
class LoadReport:
    clients: int
    seconds: float
    chunk_bytes: int
    batch: int
    requests: int
    put_keys: int
    put_ok: int
    get_keys: int
    hits: int
    misses: int
    corrupt: int
    errors: int
    put_gbps: float
    get_gbps: float
    requests_per_s: float
    put_p50_ms: float
    put_p99_ms: float
    get_p50_ms: float
    get_p99_ms: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _pct(samples: list[float], q: float) -> float:
    if not samples:
        return 0.0
    if len(samples) == 1:
        return samples[0] * 1e3
    return statistics.quantiles(samples, n=1000, method="inclusive")[int(q * 1000) - 1] * 1e3


class LoadGenerator:
    def __init__(
        self,
        address: str,
        token: str | None = None,
        clients: int = 16,
        chunk_bytes: int = 64 << 10,
        batch: int = 8,
        get_ratio: float = 0.5,
        timeout_s: float = 30.0,
        keyspace: int = 1024,
    ) -> None:
        parse_address(address)  # a bad address is a ValueError here, not in 16 threads
        self.address = address
        self.token = token
        self.clients = clients
        self.chunk_bytes = chunk_bytes
        self.batch = batch
        self.get_ratio = get_ratio
        self.timeout_s = timeout_s
        self.keyspace = max(1, keyspace)  # gets sample the last ``keyspace`` keys put (by anyone)
        self.pool = memoryview(os.urandom(max(POOL_BYTES, 2 * chunk_bytes)))
        self.run_id = os.urandom(4)
        self._recent: list[bytes] = []
        self._recent_at = 0
        self._lock = threading.Lock()
        self.tallies = [_ClientTally() for _ in range(clients)]

    def value_of(self, key: bytes) -> memoryview:
        span = len(self.pool) - self.chunk_bytes
        start = (xxhash.xxh3_64_intdigest(key) % span) & ~7
        return self.pool[start : start + self.chunk_bytes]

    def _remember(self, keys: list[bytes]) -> None:
        with self._lock:
            for key in keys:
                if len(self._recent) < self.keyspace:
                    self._recent.append(key)
                else:
                    self._recent[self._recent_at] = key
                    self._recent_at = (self._recent_at + 1) % self.keyspace

    def _sample(self, rng: random.Random, n: int) -> list[bytes]:
        with self._lock:
            if not self._recent:
                return []
            return [self._recent[rng.randrange(len(self._recent))] for _ in range(n)]

    def run(self, seconds: float, progress: Callable[[int], None] | None = None) -> LoadReport:
        """Run every client for ``seconds``; ``progress(total_requests)`` about 5 times a second."""
        deadline = time.monotonic() + seconds
        threads = [
            threading.Thread(target=self._client, args=(i, deadline), name=f"load-{i}", daemon=True)
            for i in range(self.clients)
        ]
        started = time.perf_counter()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(0.2)
            if progress is not None:
                progress(sum(len(t.put_lat) + len(t.get_lat) for t in self.tallies))
        for t in threads:
            t.join()
        return self._report(time.perf_counter() - started)

    def _client(self, index: int, deadline: float) -> None:
        tally = self.tallies[index]
        rng = random.Random(index)
        client = ServerClient(self.address, self.token, f"load-{index}", self.timeout_s)
        counter = 0
        views = [memoryview(bytearray(self.chunk_bytes)) for _ in range(self.batch)]
        prefix = b"load" + self.run_id + index.to_bytes(2, "big")
        while time.monotonic() < deadline:
            try:
                if not client.connected:
                    client.connect()
                if rng.random() >= self.get_ratio or not self._recent:
                    keys = [prefix + (counter + i).to_bytes(8, "big") for i in range(self.batch)]
                    counter += self.batch
                    t0 = time.perf_counter()
                    statuses = client.put(keys, [self.value_of(k) for k in keys])
                    tally.put_lat.append(time.perf_counter() - t0)
                    ok = [k for k, s in zip(keys, statuses) if s in OK_PUT]
                    tally.put_keys += len(keys)
                    tally.put_ok += len(ok)
                    tally.bytes_put += len(ok) * self.chunk_bytes
                    self._remember(ok)
                else:
                    keys = self._sample(rng, self.batch)
                    t0 = time.perf_counter()
                    statuses, sizes = client.get(keys, views[: len(keys)])
                    tally.get_lat.append(time.perf_counter() - t0)
                    tally.get_keys += len(keys)
                    for key, view, status, size in zip(keys, views, statuses, sizes):
                        if status is Status.OK:
                            if size != self.chunk_bytes or view[:size].tobytes() != self.value_of(key).tobytes():
                                tally.corrupt += 1
                            else:
                                tally.hits += 1
                                tally.bytes_got += size
                        else:
                            tally.misses += 1
            except (OSError, ProtocolError, RemoteError):
                tally.errors += 1
                client.close()
                time.sleep(0.01)
        client.close()

    def _report(self, elapsed: float) -> LoadReport:
        t = self.tallies
        put_lat = [x for c in t for x in c.put_lat]
        get_lat = [x for c in t for x in c.get_lat]
        total = sum(c.bytes_put for c in t), sum(c.bytes_got for c in t)
        return LoadReport(
            clients=self.clients, seconds=round(elapsed, 3), chunk_bytes=self.chunk_bytes, batch=self.batch,
            requests=len(put_lat) + len(get_lat), put_keys=sum(c.put_keys for c in t),
            put_ok=sum(c.put_ok for c in t), get_keys=sum(c.get_keys for c in t),
            hits=sum(c.hits for c in t), misses=sum(c.misses for c in t),
            corrupt=sum(c.corrupt for c in t), errors=sum(c.errors for c in t),
            put_gbps=round(total[0] / elapsed / 1e9, 4), get_gbps=round(total[1] / elapsed / 1e9, 4),
            requests_per_s=round((len(put_lat) + len(get_lat)) / elapsed, 1),
            put_p50_ms=round(_pct(put_lat, 0.5), 3), put_p99_ms=round(_pct(put_lat, 0.99), 3),
            get_p50_ms=round(_pct(get_lat, 0.5), 3), get_p99_ms=round(_pct(get_lat, 0.99), 3),
        )
