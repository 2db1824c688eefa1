"""The server tier over NIXL: chunks in registered memory move zero copy, frame headers in the bodies.

A real NIXL-enabled server, a real :class:`ServerBackend` (``data_path: nixl``)
with the engine's buffer registered (``register_buffer``), and a raw
:class:`ServerClient` with its own NIXL agent as the intruder.

* zero copy: a put and a get of views inside the registered buffer stage no
  byte through the I/O thread's arena (``nixl_staged_bytes`` stays 0), the
  chunks round-trip, and the server holds each as a whole frame (header from
  the PUT_REMOTE body, chunk READ after it). Negative control: the same job
  with unregistered views stages every byte both ways (the counter is what
  it claims to be).
* a forged header over NIXL: the intruder PUT_REMOTEs a value whose header
  (in the body) does not match the chunk (READ from its memory): the tier's
  get over NIXL refuses it, zeroes the view it was written into, counts a
  checksum failure and replaces the key on its next store. Negative control:
  the intruder's correctly framed (xxh3, no MAC key) value loads.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from tiercache.backends.server.backend import ServerBackend, ServerSettings

from tests.server.harness import ServerProcess
from tiercache.backend import BackendContext
from tiercache.integrity import compact_header_len, frame_header
from tiercache.server import protocol as p
from tiercache.server.client import ServerClient
from tiercache.server.nixl_path import nixl_available
from tiercache.testing.conformance import make_key, make_payload, wait_for_jobs

pytestmark = pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")

CHUNK = 64 * 1024
NS = b"nixl-zc!"
N = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("nixl-tier"), nixl="on", max_value_bytes=CHUNK,
                         tiers=[{"name": "cpu", "backend": "cpu", "capacity": "8MiB"}]).start()
    yield proc
    proc.kill()
    assert "internal" not in proc.log(), proc.log()


@pytest.fixture()
def tier(server: ServerProcess) -> Iterator[ServerBackend]:
    settings = ServerSettings(address=server.address, connections=1, data_path="nixl", overwrite=False,
                              nixl_staging_bytes=4 << 20)
    backend = ServerBackend(settings, BackendContext(tier_name="server", namespace=NS, chunk_bytes=CHUNK,
                                                     capacity_bytes=1 << 30))
    yield backend
    backend.close()


def _keys(first: int) -> list[bytes]:
    return [NS + make_key(i)[len(NS):] for i in range(first, first + N)]


def _round_trip(backend: ServerBackend, keys: list[bytes], src: memoryview, dst: memoryview, job: int) -> None:
    values = [make_payload(k, CHUNK, 0) for k in keys]
    for i, v in enumerate(values):
        src[i * CHUNK : (i + 1) * CHUNK] = v
    backend.submit_put(job, keys, [src[i * CHUNK : (i + 1) * CHUNK] for i in range(N)])
    assert wait_for_jobs(backend, [job])[job].ok
    backend.submit_get(job + 1, keys, [dst[i * CHUNK : (i + 1) * CHUNK] for i in range(N)])
    result = wait_for_jobs(backend, [job + 1])[job + 1]
    assert result.ok and result.failed_keys == ()
    assert [bytes(dst[i * CHUNK : (i + 1) * CHUNK]) for i in range(N)] == values


def test_registered_views_move_zero_copy(server: ServerProcess, tier: ServerBackend) -> None:
    slab = np.zeros(2 * N * CHUNK, np.uint8)  # the engine's host slab: registered once
    view = memoryview(slab).cast("B")
    assert tier.register_buffer(view)
    keys = _keys(0)
    _round_trip(tier, keys, view[: N * CHUNK], view[N * CHUNK :], job=1)
    stats = tier.stats()
    assert stats["nixl_connections"] == 1 and stats["nixl_staged_bytes"] == 0, stats
    with ServerClient(server.address, client_name="reader") as raw:  # the server holds whole frames
        frames = [memoryview(bytearray(compact_header_len(len(k)) + CHUNK)) for k in keys]
        assert raw.get(keys, frames)[0] == [p.Status.OK] * N
    for k, f in zip(keys, frames):
        assert bytes(f) == bytes(frame_header(NS, k, make_payload(k, CHUNK, 0))) + make_payload(k, CHUNK, 0)


def test_negative_control_unregistered_views_are_staged(tier: ServerBackend) -> None:
    src, dst = bytearray(N * CHUNK), bytearray(N * CHUNK)
    _round_trip(tier, _keys(100), memoryview(src), memoryview(dst), job=1)
    stats = tier.stats()
    assert stats["nixl_connections"] == 1 and stats["nixl_staged_bytes"] == 2 * N * CHUNK, stats


def _intruder_put_remote(server: ServerProcess, key: bytes, head: bytes, chunk: bytes) -> None:
    """A client with its own NIXL agent stores ``head`` (in the body) + ``chunk`` (READ by NIXL)."""
    from tiercache.server.nixl_client import NixlClientSide, view_address

    side = NixlClientSide(1 << 20, 1)
    try:
        _, metadata = side.metadata()
        arena = side.arena(0)[0]
        arena[: len(chunk)] = chunk
        with ServerClient(server.address, client_name="intruder", nixl_metadata=metadata,
                          nixl_agent=side.agent_name, nixl_progress=side.progress) as raw:
            assert raw.welcome is not None and raw.welcome.nixl
            statuses = raw.put_remote([key], [len(head) + len(chunk)], [view_address(arena)], True, [head])
            assert statuses == [p.Status.OK]
    finally:
        side.close()


@pytest.mark.parametrize("forged", [True, False], ids=["forged-header", "control-valid-xxh3-frame"])
def test_a_header_forged_over_nixl_is_refused(server: ServerProcess, tier: ServerBackend, forged: bool) -> None:
    slab = np.zeros(2 * N * CHUNK, np.uint8)
    view = memoryview(slab).cast("B")
    tier.register_buffer(view)
    keys = _keys(200 + 10 * forged)
    _round_trip(tier, keys, view[: N * CHUNK], view[N * CHUNK :], job=1)
    target = keys[2]
    evil = make_payload(target, CHUNK, version=66)
    head = bytearray(frame_header(NS, target, evil))
    if forged:
        head = bytearray(frame_header(NS, target, make_payload(target, CHUNK, 0)))  # the good chunk's header
    _intruder_put_remote(server, target, bytes(head), evil)
    out = view[N * CHUNK :]
    out[:] = b"\x5a" * len(out)
    tier.submit_get(3, keys, [out[i * CHUNK : (i + 1) * CHUNK] for i in range(N)])
    result = wait_for_jobs(tier, [3])[3]
    got = [bytes(out[i * CHUNK : (i + 1) * CHUNK]) for i in range(N)]
    stats = tier.stats()
    assert stats["nixl_staged_bytes"] == 0, stats
    for i, k in enumerate(keys):
        if k != target:
            assert got[i] == make_payload(k, CHUNK, 0)
    if not forged:  # the check is what refuses: a valid frame of the intruder's bytes loads
        assert result.failed_keys == () and got[2] == evil and stats["checksum_failures"] == 0
        return
    assert result.failed_keys == (target,)
    assert got[2] == bytes(CHUNK)  # written by the server, refused, zeroed
    assert stats["checksum_failures"] == 1
    tier.submit_put(4, [target], [view[2 * CHUNK : 3 * CHUNK]])  # overwrite false: replaced anyway
    assert wait_for_jobs(tier, [4])[4].ok and tier.stats()["replaced"] == 1
