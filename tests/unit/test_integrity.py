"""Chunk framing and checksums (tiercache/integrity.py): the format, and that damage is caught.

The checksum is recomputed here from the documented byte ranges with xxhash
directly, so a change of format cannot pass unnoticed; every single-byte
change in the covered bytes must turn a load into an IntegrityError, and a
failed decode must leave the caller's buffer untouched.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.integrity import (
    ALIGN,
    FIXED_HEADER_BYTES,
    FORMAT_VERSION,
    FRAME_MAGIC,
    MAX_KEY_BYTES,
    ChecksumMismatch,
    FrameFormatError,
    IntegrityError,
    aligned_frame_bytes,
    compact_header_len,
    decode_frame,
    encode_frame,
    frame_header,
    pack_header,
    read_header,
    round_up,
    verify_frame,
)

NS = b"namespc1"
KEY = NS + bytes(range(32)) + b"\x00\x00\x00\x01"
PAYLOAD = bytes((i * 7 + 3) % 256 for i in range(5000))


def test_compact_frame_layout() -> None:
    frame = encode_frame(NS, KEY, PAYLOAD)
    hl = compact_header_len(len(KEY))
    assert hl == FIXED_HEADER_BYTES + len(KEY) == 40 + 44
    assert len(frame) == hl + len(PAYLOAD)
    magic, version, algo, flags, checksum, ns, plen, klen, hlen = struct.unpack_from(
        "<4sBBHQ8sQHH4x", frame
    )
    assert (magic, version, algo, flags) == (FRAME_MAGIC, FORMAT_VERSION, 1, 0)
    assert (ns, plen, klen, hlen) == (NS, len(PAYLOAD), len(KEY), hl)
    assert frame[40:hl] == KEY and frame[hl:] == PAYLOAD
    expected = xxhash.xxh3_64(frame[:8] + frame[16:hl] + PAYLOAD).intdigest()
    assert checksum == expected


def test_aligned_header_block() -> None:
    block = bytearray(b"\xff" * ALIGN)  # padding must be zeroed, whatever was there
    checksum = pack_header(block, NS, KEY, PAYLOAD, header_len=ALIGN)
    head = verify_frame(block, PAYLOAD, NS, KEY)
    assert head.header_len == ALIGN and head.checksum == checksum and head.key == KEY
    assert block[40 + len(KEY) :] == bytes(ALIGN - 40 - len(KEY))
    assert aligned_frame_bytes(len(PAYLOAD)) == ALIGN + round_up(len(PAYLOAD)) == ALIGN + 8192
    assert aligned_frame_bytes(1 << 20) == ALIGN + (1 << 20)


def test_decode_round_trip_and_views() -> None:
    frame = encode_frame(NS, KEY, memoryview(PAYLOAD))
    out = bytearray(len(PAYLOAD))
    decode_frame(frame, NS, KEY, memoryview(out))
    assert out == PAYLOAD
    # a typed (non-byte) view of the payload and of the output work the same
    halfs = np.frombuffer(PAYLOAD, dtype=np.float16)
    frame2 = encode_frame(NS, KEY, memoryview(halfs))
    assert frame2 == frame
    out2 = np.zeros_like(halfs)
    decode_frame(memoryview(frame2), NS, KEY, memoryview(out2))
    assert out2.tobytes() == PAYLOAD


def test_every_covered_byte_is_protected() -> None:
    frame = bytearray(encode_frame(NS, KEY, PAYLOAD))
    hl = compact_header_len(len(KEY))
    positions = [*range(hl), *range(hl, len(frame), 97), len(frame) - 1]
    for pos in positions:
        damaged = bytearray(frame)
        damaged[pos] ^= 0x01
        out = bytearray(b"\x5a" * len(PAYLOAD))
        with pytest.raises(IntegrityError):
            decode_frame(damaged, NS, KEY, memoryview(out))
        assert out == b"\x5a" * len(PAYLOAD), f"output written despite damage at byte {pos}"


def test_payload_damage_is_a_checksum_mismatch() -> None:
    frame = bytearray(encode_frame(NS, KEY, PAYLOAD))
    frame[-10] ^= 0x80
    with pytest.raises(ChecksumMismatch, match="checksum mismatch"):
        decode_frame(frame, NS, KEY, memoryview(bytearray(len(PAYLOAD))))


def test_checksum_field_damage_is_caught() -> None:
    frame = bytearray(encode_frame(NS, KEY, PAYLOAD))
    frame[8] ^= 0x01
    with pytest.raises(ChecksumMismatch):
        decode_frame(frame, NS, KEY, memoryview(bytearray(len(PAYLOAD))))


@pytest.mark.parametrize(
    ("namespace", "key", "size", "match"),
    [
        (b"othernsp", KEY, len(PAYLOAD), "namespace"),
        (NS, KEY[:-1] + b"\x02", len(PAYLOAD), "key"),
        (NS, KEY, len(PAYLOAD) + 1, "payload of|output of"),
    ],
)
def test_wrong_frame_is_refused(namespace: bytes, key: bytes, size: int, match: str) -> None:
    frame = encode_frame(NS, KEY, PAYLOAD)
    out = bytearray(size)
    with pytest.raises(FrameFormatError, match=match):
        decode_frame(frame, namespace, key, memoryview(out))
    assert out == bytes(size)


def test_verify_checks_the_payload_length() -> None:
    header = frame_header(NS, KEY, PAYLOAD)
    with pytest.raises(FrameFormatError, match="payload of"):
        verify_frame(header, PAYLOAD[:-1], NS, KEY)


@pytest.mark.parametrize(
    ("offset", "value", "match"),
    [(0, b"XXXX", "magic"), (4, b"\x09", "version"), (5, b"\x07", "algorithm")],
)
def test_foreign_headers_are_refused(offset: int, value: bytes, match: str) -> None:
    frame = bytearray(encode_frame(NS, KEY, PAYLOAD))
    frame[offset : offset + len(value)] = value
    with pytest.raises(FrameFormatError, match=match):
        read_header(frame)


def test_truncated_frames_are_refused() -> None:
    frame = encode_frame(NS, KEY, PAYLOAD)
    for size in (0, 10, FIXED_HEADER_BYTES, FIXED_HEADER_BYTES + 5, len(frame) - 1):
        with pytest.raises(FrameFormatError):
            decode_frame(frame[:size], NS, KEY, memoryview(bytearray(len(PAYLOAD))))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="8 bytes"):
        encode_frame(b"short", KEY, PAYLOAD)
    with pytest.raises(ValueError, match="keys are"):
        encode_frame(NS, b"", PAYLOAD)
    with pytest.raises(ValueError, match="keys are"):
        encode_frame(NS, b"k" * (MAX_KEY_BYTES + 1), PAYLOAD)
    with pytest.raises(ValueError, match="header_len"):
        frame_header(NS, KEY, PAYLOAD, header_len=10)
    assert len(frame_header(NS, b"k" * MAX_KEY_BYTES, PAYLOAD, header_len=ALIGN)) == ALIGN


def test_integrity_errors_are_value_errors() -> None:
    assert issubclass(ChecksumMismatch, IntegrityError)
    assert issubclass(FrameFormatError, IntegrityError)
    assert issubclass(IntegrityError, ValueError)


@settings(max_examples=200, deadline=None)
@given(
    key=st.binary(min_size=1, max_size=120),
    payload=st.binary(max_size=3000),
    aligned=st.booleans(),
    flip=st.integers(min_value=0),
)
def test_round_trip_and_damage_property(
    key: bytes, payload: bytes, aligned: bool, flip: int
) -> None:
    header = frame_header(NS, key, payload, header_len=ALIGN if aligned else None)
    verify_frame(header, payload, NS, key)
    frame = bytes(header) + payload
    out = bytearray(len(payload))
    decode_frame(frame, NS, key, memoryview(out))
    assert out == payload
    covered = [*range(FIXED_HEADER_BYTES + len(key)), *range(len(header), len(frame))]
    pos = covered[flip % len(covered)]
    damaged = bytearray(frame)
    damaged[pos] ^= 1 << (flip % 8)
    with pytest.raises(IntegrityError):
        decode_frame(damaged, NS, key, memoryview(bytearray(len(payload))))
