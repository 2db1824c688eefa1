"""The server tier answers a lookup on a connection of its own: never behind a job's parts.

The scheduler's shared lookup (``contains``) waits at most
``deadlines.lookup_wait_s`` (5 ms) for its first answer; past that the request
is sent back to vLLM for a whole forward pass. Until 2026-12-06 a lookup went
on the same queue as the data threads' parts, so under write-through load an
EXISTS of a few bytes waited for megabytes of PUTs ahead of it.

A real server, a real :class:`ServerBackend` with one data connection: while a
put job of 384 MiB is still running, ``contains`` answers (a key stored before
it present, an unknown key absent) and the put job has not reported yet. The
negative control is that last check: with the lookup on the data queue it
returns only after the put's parts, when the job has reported (checked).
"""

from __future__ import annotations

import pathlib
import time

from tiercache.backends.server.backend import ServerBackend, ServerSettings

from tests.server.harness import ServerProcess
from tiercache.backend import BackendContext
from tiercache.testing.conformance import make_key, wait_for_jobs

CHUNK = 4 << 20
BIG_JOB_KEYS = 96  # 384 MiB: a few hundred ms over loopback, against ~1 ms for a lookup
NS = b"lookups!"


def test_a_lookup_is_answered_while_a_large_put_is_in_flight(tmp_path: pathlib.Path) -> None:
    server = ServerProcess(tmp_path, max_value_bytes=CHUNK + 4096,
                           tiers=[{"name": "cpu", "backend": "cpu", "capacity": "512MiB"}]).start()
    backend = ServerBackend(ServerSettings(address=server.address, connections=1),
                            BackendContext(tier_name="server", namespace=NS, chunk_bytes=CHUNK,
                                           capacity_bytes=1 << 30))
    try:
        keys = [NS + make_key(i)[len(NS):] for i in range(BIG_JOB_KEYS + 2)]
        stored, unknown, big = keys[0], keys[1], keys[2:]
        payload = memoryview(bytearray(b"\x5a" * CHUNK))
        backend.submit_put(1, [stored], [payload])
        assert wait_for_jobs(backend, [1])[1].ok
        assert backend.contains([stored, unknown]) == [True, False]  # the lookup connection is up

        backend.submit_put(2, big, [payload] * len(big))  # one buffer, many keys: 384 MiB on the wire
        start = time.monotonic()
        answer = backend.contains([stored, unknown])
        lookup_s = time.monotonic() - start
        reported = [r.job_id for r in backend.poll()]
        assert answer == [True, False]
        assert reported == [], f"the lookup ({lookup_s * 1e3:.1f} ms) waited for the put job"

        result = wait_for_jobs(backend, [2])[2]
        put_s = time.monotonic() - start
        assert result.ok, result
        assert lookup_s < put_s
        assert backend.contains([big[-1]]) == [True]
    finally:
        backend.close()
        server.terminate()
