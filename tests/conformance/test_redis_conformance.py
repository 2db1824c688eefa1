"""The Redis tier (backends/redis/backend.py) against the conformance kit, on a real redis-server.

The server is started once per session (tests/integration/redis_servers.py)
and flushed before every test, so each test sees an empty medium; "reopening"
the backend is a new client of the same server. Corruption is real: a
payload byte of the stored frame is flipped with a plain client (SETRANGE),
behind the tier's back.

Where a shared tier differs from the kit's media, and what is tested instead:

* ``persistent = False``: ``recover()`` returns nothing, because a shared tier
  is looked up, not owned (docs/architecture.md, Shared tiers). The chunks themselves do
  outlive the client, which :meth:`test_chunks_outlive_the_client` checks, and
  :meth:`test_namespaces_are_apart_on_a_shared_server` replaces the kit's
  namespace test (which skips for non-persistent media).
* The byte budget is advisory: Redis evicts by its own maxmemory policy and
  TTL, so the kit's two budget tests are replaced by the shared-tier rules: a
  put beyond ``capacity_bytes`` is stored, a value larger than a chunk is
  refused (that key only), and a failed put leaves no chunk behind.
"""

from __future__ import annotations

import pathlib
from typing import Any, ClassVar

import pytest
from tiercache.backends.redis.backend import RedisBackend, RedisSettings, redis_key

from tests.integration.redis_servers import (  # noqa: F401 (redis_server is a fixture)
    RedisServer,
    redis_server,
)
from tiercache.backend import Backend, BackendContext
from tiercache.integrity import compact_header_len
from tiercache.testing.conformance import (
    OTHER_NAMESPACE,
    SENTINEL,
    BackendConformance,
    make_key,
)


class TestRedisConformance(BackendConformance):
    persistent = False
    bytes_per_chunk = RedisBackend.footprint(BackendConformance.chunk_bytes)
    options: ClassVar[dict[str, Any]] = {}

    @pytest.fixture(autouse=True)
    def _empty_server(self, redis_server: RedisServer) -> None:  # noqa: F811
        self.server = redis_server
        with redis_server.client() as raw:
            raw.flushall()

    def make_backend(self, path: pathlib.Path, context: BackendContext) -> Backend:
        return RedisBackend(RedisSettings(url=self.server.url, **self.options), context)

    def corrupt_chunk(self, backend: Backend, key: bytes) -> None:
        at = compact_header_len(len(key)) + 1234
        with self.server.client() as raw:
            byte = raw.getrange(redis_key(key), at, at)
            raw.setrange(redis_key(key), at, bytes([byte[0] ^ 0xFF]))

    # ---------------------------------------------- the kit's budget tests, as a shared tier
    def test_budget_refuses_then_delete_frees(self) -> None:
        """Advisory budget: more than ``capacity_bytes`` is stored; oversized values are not."""
        context = self.context()
        backend = self.open(context)
        chunks = self.chunks(0, context.capacity_bytes // self.chunk_bytes + 3)
        assert self.put(backend, chunks).ok, "a shared tier leaves eviction to Redis"
        self.assert_loads(backend, chunks)
        key = make_key(1000)
        job = self.job_id()
        backend.submit_put(job, [key], [memoryview(bytes(self.chunk_bytes + 1))])
        assert self.wait(backend, [job])[job].failed_keys == (key,)
        first, second = list(chunks)[:2]
        backend.delete([first])
        result, _ = self.get(backend, [first, second])
        assert result.failed_keys == (first,)

    def test_failed_put_leaves_no_chunk(self) -> None:
        backend = self.open()
        chunks = self.chunks(0, 3)
        keys = list(chunks)
        views = [memoryview(bytearray(chunks[k])) for k in keys]
        views[1] = memoryview(bytes(self.chunk_bytes + 4096))  # not a chunk: refused
        job = self.job_id()
        backend.submit_put(job, keys, views)
        result = self.wait(backend, [job])[job]
        assert result.ok_keys == (keys[0], keys[2]) and result.failed_keys == (keys[1],)
        loaded, got = self.get(backend, keys)
        assert loaded.failed_keys == (keys[1],)
        assert got[keys[1]] == bytes([SENTINEL]) * self.chunk_bytes

    # ---------------------------------------------------------- shared-tier semantics
    def test_chunks_outlive_the_client(self) -> None:
        backend = self.open()
        chunks = self.chunks(0, 3)
        assert self.put(backend, chunks).ok
        backend = self.reopen(backend)
        assert list(backend.recover()) == []  # nothing to rebuild: looked up, not owned
        assert backend.contains(list(chunks)) == [True] * 3
        self.assert_loads(backend, chunks)

    def test_namespaces_are_apart_on_a_shared_server(self) -> None:
        backend = self.open()
        chunks = self.chunks(0, 2)
        assert self.put(backend, chunks).ok
        other = self.open(self.context(namespace=OTHER_NAMESPACE))
        result, got = self.get(other, list(chunks))
        assert result.failed_keys == tuple(chunks)
        assert all(v == bytes([SENTINEL]) * self.chunk_bytes for v in got.values())
        theirs = {make_key(i, OTHER_NAMESPACE): v for i, v in enumerate(chunks.values())}
        assert self.put(other, theirs).ok  # same prefix hashes, another namespace
        self.assert_loads(backend, chunks)
        self.assert_loads(other, theirs)

    def test_checksum_failure_is_counted(self) -> None:
        backend = self.open()
        chunks = self.chunks(0, 2)
        assert self.put(backend, chunks).ok
        bad = next(iter(chunks))
        self.corrupt_chunk(backend, bad)
        result, _ = self.get(backend, list(chunks))
        assert result.failed_keys == (bad,)
        stats = backend.stats()  # type: ignore[attr-defined]
        assert stats["checksum_failures"] == 1 and stats["get_failures"] == 1


class TestRedisConformanceOneThread(TestRedisConformance):
    options: ClassVar[dict[str, Any]] = {"io_threads": 1, "pipeline_batch": 1}


class TestRedisConformanceWithTTL(TestRedisConformance):
    options: ClassVar[dict[str, Any]] = {"ttl_seconds": 600, "io_threads": 4, "pipeline_batch": 3}
