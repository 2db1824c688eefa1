"""The server tier says so when the server's slots do not fit the engine's values.

The cache server keeps every value in a fixed slot of its ``max_value_bytes``.
An engine whose values (a chunk's store shard: one KV head's part) are a
quarter of that fills a quarter of each slot, and the server holds a quarter
of the chunks its capacity suggests: it evicts early and lookups turn into
failed loads (found by bench/serve.py, where every load from a server sized by
whole chunks failed). Values larger than ``max_value_bytes`` fail every store.
A real server and a real :class:`ServerBackend`: one WARNING at the first
connect, naming the sizes, in either case; none where they fit (the control).
"""

from __future__ import annotations

import logging
import pathlib

import pytest

from tiercache.backends.server.backend import ServerBackend, ServerSettings

from tests.server.harness import ServerProcess
from tiercache.backend import BackendContext
from tiercache.testing.conformance import make_key, make_payload, wait_for_jobs

VALUE = 64 * 1024
NS = b"slot-fit"
LOGGER = "tiercache.backends.server.backend"


def store_one(tmp_path: pathlib.Path, max_value_bytes: int) -> bool:
    """Start a server, store one value through the tier; whether the store succeeded."""
    server = ServerProcess(tmp_path, max_value_bytes=max_value_bytes).start()
    backend = ServerBackend(ServerSettings(address=server.address, connections=1),
                            BackendContext(tier_name="server", namespace=NS, chunk_bytes=VALUE,
                                           capacity_bytes=1 << 30))
    try:
        key = NS + make_key(0)[len(NS):]
        backend.submit_put(1, [key], [memoryview(make_payload(key, VALUE, 0))])
        return wait_for_jobs(backend, [1])[1].ok
    finally:
        backend.close()
        server.terminate()


@pytest.mark.parametrize(("max_value", "says", "stored"), [
    (4 * VALUE, "holds about 4x fewer chunks", True),
    (VALUE // 2, "every store and load of this tier will fail", False),
    (VALUE, None, True),  # the control: sized to the values, nothing to say
], ids=["slots-too-big", "slots-too-small", "fits"])
def test_one_warning_names_the_misfit(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture,
                                      max_value: int, says: str | None, stored: bool) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store_one(tmp_path, max_value) is stored
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER and "max_value_bytes" in r.getMessage()]
    if says is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and says in warnings[0], warnings
