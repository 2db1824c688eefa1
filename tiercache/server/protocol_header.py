"""The frame header of the cache server's wire protocol (:mod:`tiercache.server.protocol`).

A fixed 24-byte header (layout in :mod:`tiercache.server.protocol`) starts
every frame. :func:`pack_header` writes one; :func:`unpack_header` parses one
and checks it against the receiver's :class:`Limits` before anything is
allocated or read, raising a :class:`~tiercache.server.protocol_errors.ProtocolError`
subclass for anything this side does not accept.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from tiercache.server.protocol_errors import (
    BadFlags,
    BadMagic,
    MessageTooLarge,
    Truncated,
    UnexpectedPayload,
    UnknownMessageType,
    UnsupportedVersion,
)
from tiercache.server.protocol_messages import (
    PAYLOAD_REPLIES,
    PAYLOAD_REQUESTS,
    REPLY_BODIES,
    REQUEST_BODIES,
    MsgType,
)

MAGIC: bytes = b"TCSP"
PROTOCOL_VERSION: int = 1
HEADER: struct.Struct = struct.Struct("<4sBBHIIQ")
HEADER_BYTES: int = HEADER.size  # 24
REPLY_BIT: int = 0x80


@dataclass(frozen=True, slots=True)
class Header:
    """A parsed frame header (magic, version and flags are checked, not kept)."""

    type: int
    request_id: int
    body_len: int
    payload_len: int

    @property
    def is_reply(self) -> bool:
        return bool(self.type & REPLY_BIT)

    @property
    def base_type(self) -> MsgType:
        return MsgType(self.type if self.type == MsgType.ERROR else self.type & ~REPLY_BIT)


@dataclass(frozen=True, slots=True)
class Limits:
    """What a receiver accepts; the server's come from its config, a client's from Welcome."""

    max_body_bytes: int = 1 << 20
    max_payload_bytes: int = 64 << 20
    max_keys: int = 4096
    max_key_bytes: int = 256
    max_value_bytes: int = 64 << 20


def pack_header(msg_type: int, request_id: int, body_len: int, payload_len: int = 0) -> bytes:
    """The 24 header bytes of a frame (magic, this side's version, flags 0)."""
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, msg_type, 0, request_id, body_len, payload_len)


def unpack_header(data: bytes | bytearray | memoryview, limits: Limits, replies: bool) -> Header:
    """Parse and bound-check a frame header (``replies``: the reader expects replies).

    Raises a :class:`ProtocolError` subclass for anything but a frame this side accepts.
    """
    if len(data) < HEADER_BYTES:
        raise Truncated(f"header needs {HEADER_BYTES} bytes, got {len(data)}")
    magic, version, msg_type, flags, request_id, body_len, payload_len = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BadMagic(f"bad magic {bytes(magic)!r}")
    if version != PROTOCOL_VERSION:
        raise UnsupportedVersion(f"protocol version {version}, this side speaks {PROTOCOL_VERSION}")
    if flags:
        raise BadFlags(f"flags {flags:#x} are reserved")
    base = msg_type if msg_type == MsgType.ERROR else msg_type & ~REPLY_BIT
    is_reply = bool(msg_type & REPLY_BIT)
    table = REPLY_BODIES if replies else REQUEST_BODIES
    if (
        (msg_type == MsgType.ERROR and not replies)
        or (msg_type != MsgType.ERROR and (is_reply != replies or base not in table))
    ):
        raise UnknownMessageType(f"message type {msg_type:#x}")
    if body_len > limits.max_body_bytes:
        raise MessageTooLarge(f"body of {body_len} bytes, the limit is {limits.max_body_bytes}")
    if payload_len > limits.max_payload_bytes:
        raise MessageTooLarge(
            f"payload of {payload_len} bytes, the limit is {limits.max_payload_bytes}"
        )
    carries = PAYLOAD_REPLIES if replies else PAYLOAD_REQUESTS
    if payload_len and base not in carries:
        raise UnexpectedPayload(f"message type {msg_type:#x} carries no payload")
    return Header(msg_type, request_id, body_len, payload_len)


def reply_type(msg_type: MsgType) -> int:
    """The header ``type`` of the reply to a ``msg_type`` request."""
    return int(msg_type) | REPLY_BIT

