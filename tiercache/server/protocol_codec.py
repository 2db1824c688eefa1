"""Encoding and decoding of the cache server's frames (:mod:`tiercache.server.protocol`).

:func:`encode_body` / :func:`frame` build what a sender writes (the payload,
if any, follows separately); :func:`body_type` and :func:`decode_body` turn a
received body into its Struct, and :func:`check_request` applies the
receiver's configured limits to a decoded request. :class:`FrameDecoder` is
the same decoding fed incrementally (sans I/O), for tools and the fuzz tests.
Every problem is a :class:`~tiercache.server.protocol_errors.ProtocolError`
subclass; nothing else escapes the decoder, whatever the bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from tiercache.server.protocol_errors import (
    LimitExceeded,
    MalformedBody,
    ProtocolError,
    Truncated,
)
from tiercache.server.protocol_header import (
    HEADER_BYTES,
    Header,
    Limits,
    pack_header,
    unpack_header,
)
from tiercache.server.protocol_messages import (
    REPLY_BODIES,
    REQUEST_BODIES,
    ErrorReply,
    MsgType,
    Put,
    _Body,
)

_DECODERS: dict[type[_Body], msgspec.msgpack.Decoder[Any]] = {
    cls: msgspec.msgpack.Decoder(cls)
    for cls in {*REQUEST_BODIES.values(), *REPLY_BODIES.values(), ErrorReply}
}
_ENCODER: msgspec.msgpack.Encoder = msgspec.msgpack.Encoder()


B = TypeVar("B", bound=_Body)


def body_type(header: Header) -> type[_Body]:
    """The body Struct a frame with this header carries."""
    if header.type == MsgType.ERROR:
        return ErrorReply
    table = REPLY_BODIES if header.is_reply else REQUEST_BODIES
    return table[header.base_type]


def decode_body(cls: type[B], data: bytes | bytearray | memoryview) -> B:
    """Decode a msgpack body into ``cls``; :class:`MalformedBody` for anything else."""
    decoder = _DECODERS.get(cls)
    if decoder is None:
        raise MalformedBody(f"no decoder for {cls.__name__}")
    try:
        return decoder.decode(data)  # type: ignore[no-any-return]
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedBody(f"{cls.__name__}: {exc}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # belt and braces
        raise MalformedBody(f"{cls.__name__}: {type(exc).__name__}: {exc}") from None


def encode_body(body: _Body) -> bytes:
    """The msgpack bytes of a body."""
    return _ENCODER.encode(body)


def frame(msg_type: int, request_id: int, body: _Body, payload_len: int = 0) -> bytes:
    """Header + body of one frame (the payload, if any, is sent after it by the caller)."""
    data = encode_body(body)
    return pack_header(msg_type, request_id, len(data), payload_len) + data


def check_request(body: _Body, header: Header, limits: Limits) -> None:
    """The receiver's configured limits on a decoded request; :class:`LimitExceeded` if beyond."""
    keys: list[bytes] | None = getattr(body, "keys", None)
    if keys is None:
        return
    if len(keys) > limits.max_keys:
        raise LimitExceeded(f"{len(keys)} keys in one message, the limit is {limits.max_keys}")
    for key in keys:
        if len(key) > limits.max_key_bytes:
            raise LimitExceeded(f"a key of {len(key)} bytes, the limit is {limits.max_key_bytes}")
    for field in ("sizes", "capacities", "addrs"):
        values: list[int] | None = getattr(body, field, None)
        if values is not None and len(values) != len(keys):
            raise MalformedBody(f"{len(keys)} keys but {len(values)} {field}")
    if isinstance(body, Put) and sum(body.sizes) != header.payload_len:
        raise MalformedBody(
            f"sizes add up to {sum(body.sizes)} bytes, the payload has {header.payload_len}"
        )


@dataclass(frozen=True, slots=True)
class Frame:
    """One whole decoded frame, as :class:`FrameDecoder` yields it."""

    header: Header
    body: _Body
    payload: bytes


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, take whole frames out.

    After a :class:`ProtocolError` the stream is unusable (framing is lost);
    every later call raises the same error. :meth:`close` raises
    :class:`Truncated` if the stream ended inside a frame. Buffers what it is
    fed (at most one frame's bounded size plus one ``feed``).
    """

    def __init__(self, limits: Limits, replies: bool = False) -> None:
        self.limits = limits
        self.replies = replies
        self._buf = bytearray()
        self._header: Header | None = None
        self._error: ProtocolError | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> Iterator[Frame]:
        if self._error is not None:
            raise self._error
        self._buf += data
        try:
            while True:
                frame_ = self._next()
                if frame_ is None:
                    return
                yield frame_
        except ProtocolError as exc:
            self._error = exc
            raise

    def _next(self) -> Frame | None:
        if self._header is None:
            if len(self._buf) < HEADER_BYTES:
                return None
            self._header = unpack_header(self._buf, self.limits, self.replies)
        header = self._header
        end = HEADER_BYTES + header.body_len + header.payload_len
        if len(self._buf) < end:
            return None
        body_end = HEADER_BYTES + header.body_len
        body = decode_body(body_type(header), bytes(self._buf[HEADER_BYTES:body_end]))
        if not header.is_reply and header.type != MsgType.ERROR:
            check_request(body, header, self.limits)
        payload = bytes(self._buf[body_end:end])
        del self._buf[:end]
        self._header = None
        return Frame(header, body, payload)

    def close(self) -> None:
        if self._error is None and (self._buf or self._header is not None):
            self._error = Truncated(f"stream ended inside a frame ({len(self._buf)} bytes pending)")
        if self._error is not None:
            raise self._error
