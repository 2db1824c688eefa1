"""The batch forms of xxh3 frames (tiercache/frame_batch.py) against the rules of integrity.py.

``xxh3_headers`` must write byte for byte what ``frame_header`` writes, and
``xxh3_intact`` must accept exactly the frames ``verify_frame`` accepts: every
single-byte change of a frame (header or payload), a wrong key, namespace or
length, a MAC frame and a truncated header get the same verdict from both.
"""

from __future__ import annotations

import os
import random

import pytest

from tiercache.frame_batch import xxh3_headers, xxh3_intact
from tiercache.integrity import (
    ALIGN,
    IntegrityError,
    MacKey,
    frame_header,
    verify_frame,
)

NS = b"ns-12345"


def accepted(header: bytes | bytearray, payload: bytes, key: bytes, ns: bytes = NS) -> bool:
    try:
        verify_frame(header, payload, ns, key)
    except IntegrityError:
        return False
    return True


@pytest.mark.parametrize("key_len", [1, 20, 255, ALIGN - 40])
@pytest.mark.parametrize("size", [0, 1, 2048, 65536])
def test_headers_equal_frame_header_byte_for_byte(key_len: int, size: int) -> None:
    keys = [os.urandom(key_len) for _ in range(3)]
    payloads = [memoryview(os.urandom(size)) for _ in range(3)]
    assert xxh3_headers(NS, keys, payloads) == [frame_header(NS, k, p) for k, p in zip(keys, payloads)]


def test_bad_arguments_are_refused_as_frame_header_refuses_them() -> None:
    with pytest.raises(ValueError):
        xxh3_headers(b"short", [b"k"], [b"x"])
    with pytest.raises(ValueError):
        xxh3_headers(NS, [b""], [b"x"])
    with pytest.raises(ValueError):
        xxh3_headers(NS, [bytes(ALIGN)], [b"x"])
    with pytest.raises(ValueError):
        xxh3_headers(NS, [b"k", b"j"], [b"x"])  # one payload short


def test_every_single_byte_change_gets_verify_frames_verdict() -> None:
    rng = random.Random(5)
    key, payload = b"chunk-key-0001", os.urandom(300)
    header = bytes(xxh3_headers(NS, [key], [payload])[0])
    assert xxh3_intact(header, payload, NS, key) and accepted(header, payload, key)
    frame = header + payload
    changed = 0
    for at in range(len(frame)):
        for _ in range(2):
            mutated = bytearray(frame)
            mutated[at] ^= rng.randrange(1, 256)
            h, p = bytes(mutated[: len(header)]), bytes(mutated[len(header):])
            verdict = xxh3_intact(h, p, NS, key)
            assert verdict == accepted(h, p, key), f"byte {at}: batch says {verdict}"
            changed += not verdict
    assert changed == 2 * len(frame)  # the control: every change is caught by both


def test_other_frames_get_verify_frames_verdict() -> None:
    key, payload = b"chunk-key-0002", os.urandom(64)
    header = bytes(frame_header(NS, key, payload))
    padded = bytes(frame_header(NS, key, payload, header_len=ALIGN))  # aligned: still a valid frame
    mac_header = bytes(frame_header(NS, key, payload, mac=MacKey(b"secret" * 6)))
    cases = [
        (header, payload, key, NS),
        (padded, payload, key, NS),
        (header, payload, b"chunk-key-0003", NS),  # another key's frame
        (header, payload, key, b"ns-other"),  # another namespace
        (header, payload[:-1], key, NS),  # truncated payload
        (header, payload + b"\0", key, NS),  # longer payload
        (header[:39], payload, key, NS),  # truncated header
        (header[: 40 + len(key) - 1], payload, key, NS),
        (mac_header, payload, key, NS),  # a MAC frame for a tier without a key
        (b"", payload, key, NS),
    ]
    verdicts = [xxh3_intact(h, p, ns, k) for h, p, k, ns in cases]
    assert verdicts == [accepted(h, p, k, ns) for h, p, k, ns in cases]
    assert verdicts == [True, True] + [False] * (len(cases) - 2)


def test_memoryview_headers_and_payloads_work_in_place() -> None:
    key = b"k" * 20
    buf = bytearray(os.urandom(1000))
    header = xxh3_headers(NS, [key], [memoryview(buf)[100:900]])[0]
    assert xxh3_intact(memoryview(bytearray(header)), memoryview(buf)[100:900], NS, key)
    buf[500] ^= 1
    assert not xxh3_intact(memoryview(header), memoryview(buf)[100:900], NS, key)
