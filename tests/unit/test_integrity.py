"""Chunk framing and checksums (tiercache/integrity.py): the format, and that damage is caught.

The checksum is recomputed here from the documented byte ranges with xxhash
directly, so a change of format cannot pass unnoticed; every single-byte
change in the covered bytes must turn a load into an IntegrityError, and a
failed decode must leave the caller's buffer untouched. The keyed MAC
(tiercache/mac.py) likewise: recomputed with hashlib from the documented
derivation; refused when tampered, written under another key, absent (an xxh3
frame) or unexpected (no key to check it), with the same-key load as the
negative control; the ``mac_key`` option of the server and Redis tiers.
"""

from __future__ import annotations

import hashlib
import importlib
import pickle
import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tiercache.integrity import (
    ALGO_BLAKE2B_MAC,
    ALGO_XXH3_64,
    ALIGN,
    FIXED_HEADER_BYTES,
    FORMAT_VERSION,
    FRAME_MAGIC,
    MAX_KEY_BYTES,
    ChecksumMismatch,
    FrameFormatError,
    IntegrityError,
    MacError,
    MacKey,
    aligned_frame_bytes,
    compact_header_len,
    compact_payload,
    decode_frame,
    encode_frame,
    frame_checksum,
    frame_header,
    pack_header,
    read_header,
    round_up,
    verify_frame,
)
from tiercache.mac import MAC_KEY_ENV

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


# ---------------------------------------------------------------------------- keyed MAC
SECRET = "correct horse battery staple 42"
MAC = MacKey(SECRET)


def _recomputed_mac(frame: bytes, secret: str) -> int:
    """The documented MAC of a compact frame, from the documented derivation, with hashlib."""
    key = hashlib.pbkdf2_hmac("sha256", secret.encode(), b"tiercache frame MAC key v1", 200_000, 32)
    tag = hashlib.blake2b(frame[:8] + frame[16:], key=key, digest_size=8, person=b"tiercache-frame1")
    return int.from_bytes(tag.digest(), "little")


def test_mac_frame_layout() -> None:
    frame = encode_frame(NS, KEY, PAYLOAD, mac=MAC)
    hl = compact_header_len(len(KEY))
    assert len(frame) == hl + len(PAYLOAD)  # same shape as an xxh3 frame: no size change anywhere
    magic, version, algo, flags, checksum = struct.unpack_from("<4sBBHQ", frame)
    assert (magic, version, algo, flags) == (FRAME_MAGIC, FORMAT_VERSION, ALGO_BLAKE2B_MAC, 0)
    assert checksum == _recomputed_mac(frame, SECRET)
    assert frame[16:] == encode_frame(NS, KEY, PAYLOAD)[16:]  # only algo and checksum differ


def test_mac_round_trip_with_the_same_secret() -> None:
    """Negative control of the refusals below: a reader with the writer's secret loads."""
    frame = encode_frame(NS, KEY, PAYLOAD, mac=MAC)
    out = bytearray(len(PAYLOAD))
    decode_frame(frame, NS, KEY, memoryview(out), mac=MacKey(SECRET))  # derived again: same key
    assert out == PAYLOAD
    header = frame_header(NS, KEY, memoryview(PAYLOAD), mac=MAC)
    assert verify_frame(header, PAYLOAD, NS, KEY, mac=MAC).algo == ALGO_BLAKE2B_MAC


def test_mac_refuses_every_tampered_byte() -> None:
    frame = encode_frame(NS, KEY, PAYLOAD, mac=MAC)
    hl = compact_header_len(len(KEY))
    for pos in [*range(hl), *range(hl, len(frame), 61), len(frame) - 1]:
        damaged = bytearray(frame)
        damaged[pos] ^= 0x01
        out = bytearray(b"\x5a" * len(PAYLOAD))
        with pytest.raises(IntegrityError):
            decode_frame(damaged, NS, KEY, memoryview(out), mac=MAC)
        assert out == b"\x5a" * len(PAYLOAD), f"output written despite damage at byte {pos}"
    damaged = bytearray(frame)
    damaged[-1] ^= 0x01
    with pytest.raises(MacError, match="does not verify"):
        decode_frame(damaged, NS, KEY, memoryview(bytearray(len(PAYLOAD))), mac=MAC)


def test_mac_refuses_a_frame_of_another_key() -> None:
    forged = encode_frame(NS, KEY, PAYLOAD, mac=MacKey("another tenant's secret key"))
    with pytest.raises(MacError, match="does not verify") as info:
        decode_frame(forged, NS, KEY, memoryview(bytearray(len(PAYLOAD))), mac=MAC)
    stored = struct.unpack_from("<Q", forged, 8)[0]
    right = _recomputed_mac(forged, SECRET)
    for tag in (stored, right):  # no tag in the message: it would tell a forger the right one
        assert f"{tag:016x}" not in str(info.value) and str(tag) not in str(info.value)


def test_mac_refuses_an_xxh3_frame_and_a_keyless_reader_refuses_a_mac_frame() -> None:
    plain = encode_frame(NS, KEY, PAYLOAD)  # anyone can write this: xxh3 needs no key
    with pytest.raises(MacError, match="no MAC"):
        decode_frame(plain, NS, KEY, memoryview(bytearray(len(PAYLOAD))), mac=MAC)
    keyed = encode_frame(NS, KEY, PAYLOAD, mac=MAC)
    with pytest.raises(MacError, match="no key"):
        decode_frame(keyed, NS, KEY, memoryview(bytearray(len(PAYLOAD))))
    # a MAC frame relabelled as xxh3 (with a valid xxh3 checksum) is an xxh3 frame: refused too
    relabelled = bytearray(keyed)
    relabelled[5] = ALGO_XXH3_64
    hl = compact_header_len(len(KEY))
    struct.pack_into("<Q", relabelled, 8, frame_checksum(relabelled[:hl], len(KEY), PAYLOAD))
    decode_frame(relabelled, NS, KEY, memoryview(bytearray(len(PAYLOAD))))  # valid as xxh3 ...
    with pytest.raises(MacError):
        decode_frame(relabelled, NS, KEY, memoryview(bytearray(len(PAYLOAD))), mac=MAC)  # ... not as MAC


def test_mac_binds_namespace_and_key() -> None:
    frame = encode_frame(NS, KEY, PAYLOAD, mac=MAC)
    with pytest.raises(FrameFormatError, match="key"):
        compact_payload(memoryview(frame), NS, KEY[:-1] + b"\x09", mac=MAC)
    other = KEY[:-1] + b"\x09"  # the same bytes relabelled as another key's frame
    moved = bytearray(frame)
    moved[40 : 40 + len(KEY)] = other
    with pytest.raises(MacError):
        compact_payload(memoryview(moved), NS, other, mac=MAC)


def test_mac_key_is_bounded_and_never_shown() -> None:
    for bad in ("", "x" * 15, "x" * 1025):
        with pytest.raises(ValueError, match="16 to 1024 bytes") as info:
            MacKey(bad)
        assert bad not in str(info.value) or not bad
    assert SECRET not in repr(MAC) and "hidden" in repr(MAC)
    with pytest.raises(TypeError):
        pickle.dumps(MAC)
    assert MacKey.from_secret(None) is None


@pytest.mark.parametrize("settings_path", [
    "tiercache.backends.server.settings:ServerSettings",
    "tiercache.backends.redis.settings:RedisSettings",
])
def test_mac_key_option(settings_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module, name = settings_path.split(":")
    model = getattr(importlib.import_module(module), name)
    base = {"address": "127.0.0.1:7470"} if name == "ServerSettings" else {}
    monkeypatch.delenv(MAC_KEY_ENV, raising=False)
    assert model(**base).mac_key is None
    assert model(**base, mac_key=SECRET).mac_key.get_secret_value() == SECRET
    monkeypatch.setenv(MAC_KEY_ENV, SECRET)
    assert model(**base).mac_key.get_secret_value() == SECRET
    for bad in ("", "short-secret"):  # an empty env var is an error, not "no MAC"
        monkeypatch.setenv(MAC_KEY_ENV, bad)
        with pytest.raises(ValidationError) as info:
            model(**base)
        assert "mac_key" in str(info.value) and (not bad or bad not in str(info.value))
    monkeypatch.delenv(MAC_KEY_ENV)
    with pytest.raises(ValidationError) as info:
        model(**base, mac_key="hunter2-hunter2")  # 15 bytes
    assert "hunter2" not in str(info.value)
