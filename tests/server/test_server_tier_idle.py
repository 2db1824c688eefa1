"""The server tier survives the server's idle timeout: an idle-closed connection is replaced before the next request.

The server closes connections idle for ``idle_timeout_s`` (on by default); the
engine's tier connections sit idle between a prompt's store and the next hit.
A real server with a short idle timeout, a real :class:`ServerBackend`: after
the server closed its idle connection, the tier's next get still succeeds (it
noticed the close and reconnected first). The negative control is the
counter: the server really did close it (``server_closed``), so the success is
the reconnect's doing, not a connection that stayed open.
"""

from __future__ import annotations

import pathlib
import time

from tiercache.backends.server.backend import ServerBackend, ServerSettings

from tests.server.harness import ServerProcess
from tiercache.backend import BackendContext
from tiercache.testing.conformance import make_key, make_payload, wait_for_jobs

CHUNK = 8 * 1024
NS = b"idle-tst"


def test_an_idle_closed_connection_costs_no_failed_request(tmp_path: pathlib.Path) -> None:
    server = ServerProcess(tmp_path, idle_timeout_s=0.5, max_value_bytes=CHUNK).start()
    settings = ServerSettings(address=server.address, connections=1)
    backend = ServerBackend(settings, BackendContext(tier_name="server", namespace=NS, chunk_bytes=CHUNK,
                                                     capacity_bytes=1 << 30))
    try:
        keys = [NS + make_key(i)[len(NS):] for i in range(3)]
        values = [make_payload(k, CHUNK, 0) for k in keys]
        backend.submit_put(1, keys, [memoryview(v) for v in values])
        assert wait_for_jobs(backend, [1])[1].ok
        deadline = time.monotonic() + 30
        while "timed out" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.1)  # until the server has closed the idle connection
        assert "timed out" in server.log(), server.log()
        views = [bytearray(CHUNK) for _ in keys]
        backend.submit_get(2, keys, [memoryview(v) for v in views])
        result = wait_for_jobs(backend, [2])[2]
        assert result.ok and [bytes(v) for v in views] == values
        stats = backend.stats()
        assert stats["server_closed"] == 1 and stats["request_errors"] == 0, stats
    finally:
        backend.close()
        server.terminate()
