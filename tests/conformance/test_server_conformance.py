"""The client tier (backends/server/backend.py) against the conformance kit, talking to a live server.

Every test gets its own server subprocess (``tiercache serve``), sized for the
kit's context: ``max_value_bytes`` is the kit's chunk size and the host tier
holds exactly the context's number of chunks, with ``when_full: refuse`` (the
kit checks that a full medium refuses puts, where a cache server would
otherwise evict). The server is a shared, volatile tier from the engine's point
of view: ``recover()`` returns nothing and namespaces are kept apart by the
keys themselves, so the kit's persistence tests do not apply. The tier frames
and verifies every chunk, so the kit's checksum test runs: ``corrupt_chunk``
reads a chunk's stored frame with a raw client, flips one payload byte and
writes it back, as another client of the server could. The client runs with
``overwrite: true`` (the kit's overwrite test expects a put to replace a
chunk). Subclasses repeat the kit with requests pipelined (one chunk per
request, three in flight), with a ``mac_key``, and over the NIXL data path
when NIXL works on this machine.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from tiercache.backends.server.backend import ServerBackend, ServerSettings

from tests.server.harness import ServerProcess
from tiercache.backend import Backend, BackendContext
from tiercache.integrity import compact_header_len
from tiercache.server import protocol as p
from tiercache.server.client import ServerClient
from tiercache.server.nixl_path import nixl_available
from tiercache.server.slab import slot_bytes_for
from tiercache.testing.conformance import BackendConformance
from tiercache.testing.payloads import SENTINEL


class TestServerConformance(BackendConformance):
    persistent = False
    server_options: ClassVar[dict[str, Any]] = {}
    # one request at a time (TestServerConformancePipelined runs the kit with several in flight)
    client_options: ClassVar[dict[str, Any]] = {"data_path": "tcp", "overwrite": True, "pipeline_depth": 1}

    @pytest.fixture(autouse=True)
    def _servers(self) -> Iterator[None]:
        self._procs: dict[pathlib.Path, ServerProcess] = {}
        yield
        for proc in self._procs.values():
            proc.kill()

    def _server_for(self, path: pathlib.Path, context: BackendContext) -> ServerProcess:
        proc = self._procs.get(path)
        if proc is None:  # one server per test path; reopening reaches the same server
            chunks = context.capacity_bytes // context.chunk_bytes
            proc = ServerProcess(
                path.parent / "server",
                max_value_bytes=context.chunk_bytes,
                when_full="refuse",
                tiers=[{"name": "cpu", "backend": "cpu", "capacity": chunks * slot_bytes_for(context.chunk_bytes)}],
                **self.server_options,
            ).start()
            self._procs[path] = proc
        return proc

    def make_backend(self, path: pathlib.Path, context: BackendContext) -> Backend:
        proc = self._server_for(path, context)
        settings = ServerSettings(address=proc.address, **self.client_options)
        return ServerBackend(settings, context)

    def corrupt_chunk(self, backend: Backend, key: bytes) -> None:
        """Flip one payload byte of ``key``'s stored frame, through a raw client of the server."""
        size = compact_header_len(len(key)) + self.chunk_bytes
        frame = bytearray(size)
        with ServerClient(self._procs[self.path].address) as raw:
            statuses, sizes = raw.get([key], [memoryview(frame)])
            assert statuses == [p.Status.OK] and sizes == [size], (statuses, sizes)
            frame[size - 1234] ^= 0xFF
            assert raw.delete([key]) == 1
            assert raw.put([key], [frame]) == [p.Status.OK]

    def test_corruption_is_counted(self) -> None:
        backend = self.open()
        chunks = self.chunks(0, 2)
        assert self.put(backend, chunks).ok
        bad = next(iter(chunks))
        self.corrupt_chunk(backend, bad)
        result, got = self.get(backend, list(chunks))
        assert result.failed_keys == (bad,)
        assert got[bad] in (bytes(self.chunk_bytes), bytes([SENTINEL]) * self.chunk_bytes)  # TCP, NIXL
        stats = backend.stats()  # type: ignore[attr-defined]
        assert stats["checksum_failures"] == 1 and stats["get_failures"] == 1

    def used_bytes(self, backend: Backend, path: pathlib.Path) -> int | None:
        with ServerClient(self._procs[path].address) as client:
            stats = client.stats()
        return sum(t.used_bytes for t in stats.tiers) // slot_bytes_for(self.chunk_bytes) * self.chunk_bytes

    def test_is_shared(self) -> None:
        backend = self.open()
        assert type(backend).shared and type(backend).footprint(self.chunk_bytes) == self.chunk_bytes
        chunks = self.chunks(0, 2)
        assert self.put(backend, chunks).ok
        assert backend.contains([*chunks, b"never-stored"]) == [True, True, False]


@pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")
class TestServerConformanceNixl(TestServerConformance):
    server_options: ClassVar[dict[str, Any]] = {"nixl": "on"}
    client_options: ClassVar[dict[str, Any]] = {
        "data_path": "nixl", "nixl_staging_bytes": 8 << 20, "overwrite": True,
    }

    def test_nixl_is_used(self) -> None:
        backend = self.open()
        assert isinstance(backend, ServerBackend)
        chunks = self.chunks(0, 3)
        assert self.put(backend, chunks).ok
        self.assert_loads(backend, chunks)
        assert backend.stats()["nixl_connections"] >= 1


class TestServerConformancePipelined(TestServerConformance):
    """The kit with every chunk its own request and up to three requests in flight per connection."""

    client_options: ClassVar[dict[str, Any]] = {
        "data_path": "tcp", "overwrite": True, "pipeline_depth": 3, "pipeline_request_bytes": 1,
    }


class TestServerConformanceMac(TestServerConformance):
    """The kit with a keyed MAC on every frame (the corruption is then a MAC failure)."""

    client_options: ClassVar[dict[str, Any]] = {
        "data_path": "tcp", "overwrite": True, "mac_key": "conformance-kit-mac-key",
    }

