"""A GET's values handed on group by group as they arrive (``on_values`` of ``ServerClient.finish``).

Against a live ``tiercache serve``: the callback sees keys ``lo`` to ``hi - 1``
with their values already in the views and every later view still untouched
(so the client tier checks each group while its bytes are in the CPU's
cache, not all of them after the last); the ranges cover every key once, in
order, about ``VALUE_GROUP_BYTES`` at a time, a missing key among them; a
callback that raises fails the request like any error: the connection is
closed and every view written is zeroed. The client tier's use of it (the
checks of its frames) runs the conformance kit in
tests/conformance/test_server_conformance.py, corrupted values included.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server.harness import ServerProcess
from tiercache.server import protocol as p
from tiercache.server.client import VALUE_GROUP_BYTES, ServerClient
from tiercache.testing.conformance import make_key, make_payload

CHUNK = 64 * 1024
PER_GROUP = VALUE_GROUP_BYTES // CHUNK
KEYS = 3 * PER_GROUP
ABSENT = PER_GROUP + 1  # a key the server does not hold, inside the second group


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("groups") / "srv", max_value_bytes=CHUNK,
                         tiers=[{"name": "cpu", "backend": "cpu", "capacity": "16MiB"}]).start()
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def stored(server: ServerProcess) -> dict[bytes, bytes]:
    keys = [make_key(1000 + i) for i in range(KEYS)]
    values = {k: make_payload(k, CHUNK, 0) for i, k in enumerate(keys) if i != ABSENT}
    with ServerClient(server.address) as client:
        assert client.put(list(values), list(values.values()), overwrite=True) == [p.Status.OK] * len(values)
    return {k: values.get(k, b"") for k in keys}


def test_each_group_is_handed_on_as_soon_as_it_arrived(server: ServerProcess, stored: dict[bytes, bytes]) -> None:
    keys = list(stored)
    views = [memoryview(bytearray(CHUNK)) for _ in keys]
    seen: list[tuple[int, int]] = []

    def on_values(lo: int, hi: int, statuses: list[p.Status], sizes: list[int]) -> None:
        seen.append((lo, hi))
        for i in range(lo, hi):
            assert bytes(views[i]) == (stored[keys[i]] or bytes(CHUNK))  # arrived (or a miss: untouched)
            assert statuses[i] is (p.Status.MISS if i == ABSENT else p.Status.OK)
        assert all(not any(v) for v in views[hi:])  # nothing later written yet

    with ServerClient(server.address) as client:
        statuses, sizes = client.get(keys, views, on_values)
    assert seen == [(0, PER_GROUP), (PER_GROUP, 2 * PER_GROUP + 1), (2 * PER_GROUP + 1, KEYS)]
    assert statuses.count(p.Status.MISS) == 1 and sizes[ABSENT] == 0
    assert [bytes(v) for i, v in enumerate(views) if i != ABSENT] == [v for v in stored.values() if v]


def test_without_a_callback_the_values_arrive_all_at_once(server: ServerProcess, stored: dict[bytes, bytes]) -> None:
    keys = list(stored)
    views = [memoryview(bytearray(CHUNK)) for _ in keys]
    with ServerClient(server.address) as client:
        pending = client.send_get(keys, views)
        statuses, _ = client.finish(pending)
    assert statuses[ABSENT] is p.Status.MISS
    assert [bytes(v) for i, v in enumerate(views) if i != ABSENT] == [v for v in stored.values() if v]


def test_a_callback_that_raises_fails_the_request_and_zeroes_what_arrived(
    server: ServerProcess, stored: dict[bytes, bytes]
) -> None:
    keys = list(stored)
    views = [memoryview(bytearray(CHUNK)) for _ in keys]

    def refuse(lo: int, hi: int, statuses: list[p.Status], sizes: list[int]) -> None:
        assert bytes(views[0]) == stored[keys[0]]  # the first group did arrive
        raise ValueError("a check refused the group")

    with ServerClient(server.address) as client:
        with pytest.raises(ValueError, match="refused the group"):
            client.get(keys, views, refuse)
        assert not client.connected
    assert all(not any(v) for v in views)
