"""The cache-server tier's frame checks fed piece by piece (backends/server/arrival_checks.py).

A TCP get hands the tier byte ranges of its values as they arrive; ``ArrivalChecks``
checks a frame's header when its first bytes are in and feeds the checksum piece
by piece. Each case: frames made by the tier's own ``Framer`` (xxh3, and the
keyed MAC), received into the tier's get buffers, fed in ranges of several
shapes (whole values, many small pieces, the header alone first). Passes: every
intact frame, whatever the cut. Negative controls, each must leave the key out
of ``passed`` (the worker then checks it whole and logs why it failed): one
payload byte flipped anywhere, a frame of another key, another namespace, a
value of the wrong size, a piece fed twice, a first range that ends inside the
header.
"""

from __future__ import annotations

import itertools
import random

import pytest
from tiercache.backends.server.arrival_checks import ArrivalChecks
from tiercache.backends.server.frames import Framer

from tiercache.mac import MacKey
from tiercache.server import protocol as p

NS = b"ns-test!"
SIZES = [1, 4096, 300_000]


def received(framer: Framer, keys: list[bytes], payloads: list[bytes]) -> tuple[list, list[int]]:
    """The frames of ``payloads`` as a get receives them: the tier's get buffers, filled."""
    sent = framer.put_values(keys, [memoryview(x) for x in payloads])
    frames = Framer.get_values(keys, [memoryview(bytearray(len(x))) for x in payloads])
    for (head, body), (s_head, s_body) in zip(frames, sent):
        head[:] = bytes(s_head)
        body[:] = bytes(s_body)
    return frames, [len(h) + len(b) for h, b in frames]


def feed(checks: ArrivalChecks, sizes: list[int], cuts: str, rng: random.Random) -> None:
    """Every value's bytes as ranges, in order: ``whole``, ``small`` (random pieces after the header, as
    the client cuts: its first range always holds a whole header), ``header-first``."""
    ranges = []
    for i, size in enumerate(sizes):
        if cuts == "whole":
            bounds = [0, size]
        elif cuts == "header-first":
            bounds = [0, min(size, 64), size]
        else:
            head = len(checks.frames[i][0])
            bounds = sorted({0, size, *(rng.randrange(head, size) for _ in range(5) if size > head)})
        ranges += [(i, a, b) for a, b in itertools.pairwise(bounds) if b > a]
    statuses = [p.Status.OK] * len(sizes)
    for at in range(0, len(ranges), 3):  # three ranges per call, as groups of values would come
        checks.on_data(ranges[at : at + 3], statuses, sizes)


@pytest.fixture(params=["xxh3", "mac"])
def framer(request: pytest.FixtureRequest) -> Framer:
    return Framer(NS, MacKey(b"a secret of the tier" * 2) if request.param == "mac" else None, "test")


def payloads_of(rng: random.Random) -> tuple[list[bytes], list[bytes]]:
    keys = [f"key-{n}".encode() for n in range(len(SIZES))]
    return keys, [rng.randbytes(n) for n in SIZES]


@pytest.mark.parametrize("cuts", ["whole", "small", "header-first"])
def test_intact_frames_pass_whatever_the_cut(framer: Framer, cuts: str) -> None:
    rng = random.Random(cuts)
    keys, payloads = payloads_of(rng)
    frames, sizes = received(framer, keys, payloads)
    checks = ArrivalChecks(framer, keys, frames)
    feed(checks, sizes, cuts, rng)
    assert checks.passed == set(range(len(keys)))
    assert all(framer.verified(k, h, b, n) for k, (h, b), n in zip(keys, frames, sizes))  # the whole check agrees


@pytest.mark.parametrize("cuts", ["whole", "small"])
def test_one_flipped_payload_byte_fails_its_frame_only(framer: Framer, cuts: str) -> None:
    rng = random.Random(7)
    keys, payloads = payloads_of(rng)
    for victim in range(len(keys)):
        frames, sizes = received(framer, keys, payloads)
        body = frames[victim][1]
        at = rng.randrange(len(body))
        body[at] ^= 0x01
        checks = ArrivalChecks(framer, keys, frames)
        feed(checks, sizes, cuts, rng)
        assert victim not in checks.passed and len(checks.passed) == len(keys) - 1


def test_another_keys_or_namespaces_frame_fails(framer: Framer) -> None:
    rng = random.Random(3)
    keys, payloads = payloads_of(rng)
    frames, sizes = received(framer, [b"other", *keys[1:]], payloads)  # key 0's value is another key's frame
    checks = ArrivalChecks(framer, keys, frames)
    feed(checks, sizes, "small", rng)
    assert 0 not in checks.passed and len(checks.passed) == len(keys) - 1
    foreign = Framer(b"other-ns", framer.mac, "test")
    frames, sizes = received(foreign, keys, payloads)
    checks = ArrivalChecks(framer, keys, frames)
    feed(checks, sizes, "whole", rng)
    assert checks.passed == set()


def test_a_value_of_the_wrong_size_or_a_piece_fed_twice_fails(framer: Framer) -> None:
    rng = random.Random(5)
    keys, payloads = payloads_of(rng)
    frames, sizes = received(framer, keys, payloads)
    short = [sizes[0], sizes[1], sizes[2] - 1]  # the last value one byte short of its frame
    checks = ArrivalChecks(framer, keys, frames)
    feed(checks, short, "whole", rng)
    assert 2 not in checks.passed and {0, 1} <= checks.passed
    checks = ArrivalChecks(framer, keys, frames)
    statuses = [p.Status.OK] * len(keys)
    half = sizes[2] // 2
    checks.on_data([(2, 0, half), (2, half - 100, sizes[2])], statuses, sizes)  # 100 bytes twice
    assert 2 not in checks.passed


def test_a_first_range_inside_the_header_is_left_to_the_whole_check(framer: Framer) -> None:
    rng = random.Random(9)
    keys, payloads = payloads_of(rng)
    frames, sizes = received(framer, keys, payloads)
    checks = ArrivalChecks(framer, keys, frames)
    statuses = [p.Status.OK] * len(keys)
    checks.on_data([(2, 0, 10), (2, 10, sizes[2])], statuses, sizes)  # 10 bytes: not a whole header
    assert 2 not in checks.passed
    assert framer.verified(keys[2], *frames[2], sizes[2])  # the frame itself is intact
