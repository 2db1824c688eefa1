"""A GET's values handed on piece by piece as they arrive (``on_data`` of ``ServerClient.finish``).

Against a live ``tiercache serve``: each call names byte ranges of values that
are already in the views while every later byte is still untouched (so the
client tier checks them while they are in the CPU's cache, not all after the
last); the ranges cover every OK value exactly once, in order, about
``VALUE_GROUP_BYTES`` at a time, a missing key never named, a value larger
than that in several calls; a callback that raises fails the request like any
error: the connection is closed and every view written is zeroed. The client
tier's checks over those ranges (``ArrivalChecks``: header, then the checksum fed
piece by piece) are tested in tests/unit/test_server_streamed_checks.py and run
the conformance kit in tests/conformance/test_server_conformance.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.server.harness import ServerProcess
from tiercache.server import protocol as p
from tiercache.server.client import ServerClient
from tiercache.server.client_values import VALUE_GROUP_BYTES
from tiercache.testing.conformance import make_key, make_payload

CHUNK = 64 * 1024
PER_GROUP = VALUE_GROUP_BYTES // CHUNK
KEYS = 3 * PER_GROUP
ABSENT = PER_GROUP + 1  # a key the server does not hold, inside the second group
BIG = 2 * VALUE_GROUP_BYTES + 1000  # a value received over three calls


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("groups") / "srv", max_value_bytes=BIG,
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


def received_in_order(views: list[memoryview], expected: list[bytes]) -> tuple[list[list[tuple[int, int, int]]], Any]:
    """A callback that checks, at each call, that exactly the bytes named so far arrived; and its calls."""
    calls: list[list[tuple[int, int, int]]] = []
    done = [0] * len(views)  # bytes of each value named so far

    def on_data(ranges: list[tuple[int, int, int]], statuses: list[p.Status], sizes: list[int]) -> None:
        calls.append(list(ranges))
        for i, start, end in ranges:
            assert statuses[i] is p.Status.OK and start == done[i] and end <= sizes[i]
            done[i] = end
        for i, view in enumerate(views):
            assert bytes(view[: done[i]]) == expected[i][: done[i]]  # arrived
            assert not any(view[done[i]:])  # nothing beyond yet

    return calls, on_data


def test_each_group_is_handed_on_as_soon_as_it_arrived(server: ServerProcess, stored: dict[bytes, bytes]) -> None:
    keys = list(stored)
    views = [memoryview(bytearray(CHUNK)) for _ in keys]
    calls, on_data = received_in_order(views, list(stored.values()))
    with ServerClient(server.address) as client:
        statuses, sizes = client.get(keys, views, on_data)
    whole = [[(i, 0, CHUNK) for i in range(lo, hi) if i != ABSENT]
             for lo, hi in ((0, PER_GROUP), (PER_GROUP, 2 * PER_GROUP + 1), (2 * PER_GROUP + 1, KEYS))]
    assert calls == whole
    assert statuses.count(p.Status.MISS) == 1 and sizes[ABSENT] == 0
    assert [bytes(v) for i, v in enumerate(views) if i != ABSENT] == [v for v in stored.values() if v]


def test_a_large_value_is_handed_on_piece_by_piece(server: ServerProcess, stored: dict[bytes, bytes]) -> None:
    big_key, small_key = make_key(2000), next(iter(stored))
    big = make_payload(big_key, BIG, 0)
    head = memoryview(bytearray(40))  # a value in two pieces, as the client tier's frames are
    views = [memoryview(bytearray(CHUNK)), memoryview(bytearray(BIG - 40))]
    with ServerClient(server.address) as client:
        assert client.put([big_key], [big], overwrite=True) == [p.Status.OK]
        flat = [memoryview(bytearray(CHUNK)), memoryview(bytearray(BIG))]  # what the checks compare
        calls, on_data = received_in_order(flat, [stored[small_key], big])

        def both(ranges: list[tuple[int, int, int]], statuses: list[p.Status], sizes: list[int]) -> None:
            flat[0][:] = views[0]
            flat[1][:] = bytes(head) + bytes(views[1])
            on_data(ranges, statuses, sizes)

        client.get([small_key, big_key], [views[0], (head, views[1])], both)
    g = VALUE_GROUP_BYTES
    assert calls == [[(0, 0, CHUNK), (1, 0, g)], [(1, g, 2 * g)], [(1, 2 * g, BIG)]]
    assert bytes(head) + bytes(views[1]) == big


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

    def refuse(ranges: list[tuple[int, int, int]], statuses: list[p.Status], sizes: list[int]) -> None:
        assert bytes(views[0]) == stored[keys[0]]  # the first group did arrive
        raise ValueError("a check refused the group")

    with ServerClient(server.address) as client:
        with pytest.raises(ValueError, match="refused the group"):
            client.get(keys, views, refuse)
        assert not client.connected
    assert all(not any(v) for v in views)
