"""The cache server's wire protocol: frame header, message bodies, bounds, typed decode errors.

Every message, in both directions, is one *frame*::

    offset  size  field
    0       4     magic        b"TCSP"
    4       1     version      PROTOCOL_VERSION (1); any other is refused
    5       1     type         a MsgType; replies are ``request type | 0x80``, errors 0xFF
    6       2     flags        0 (reserved; anything else is refused)
    8       4     request_id   chosen by the client (never 0), echoed in the reply; an ERROR
                               with request_id 0 is about the connection (refused at accept,
                               or a header too broken to read its id)
    12      4     body_len     bytes of the msgpack body that follows the header
    16      8     payload_len  raw bytes that follow the body (chunk values), 0 for most types
    24      ...   body         msgpack of the type's Struct (array-like), ``body_len`` bytes
    24+body ...   payload      ``payload_len`` bytes: the values of a PUT or a GET reply,
                               back to back, in the order of the body's keys

All integers are little endian. The body is small and bounded (keys, sizes,
statuses); the payload is the bulk data and is never decoded: a reader moves
it straight into its destination (a host slot, a caller's view).

Bounds, checked before anything is allocated or read: the magic, version,
type and flags; ``body_len <= max_body_bytes``; ``payload_len <=
max_payload_bytes``; a payload only on the types that carry one; then, on
decoding the body, its Struct (msgspec validates types and the static caps
below), and :func:`check_request` applies the receiver's configured limits
(keys per message, key length, value size, payload = sum of sizes).

Every decode problem raises a subclass of :class:`ProtocolError` with a
stable ``code`` (sent back in an ERROR frame): nothing else escapes the
decoder, whatever the bytes. :class:`FrameDecoder` is the same decoder fed
incrementally (sans I/O), for tools and the fuzz tests; the server and the
client read from sockets with :mod:`tiercache.server.wire` and call
:func:`unpack_header` / :func:`decode_body` directly.

Nothing here holds a socket or a thread; every function may be called from any thread.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta, Struct

MAGIC = b"TCSP"
PROTOCOL_VERSION = 1
HEADER = struct.Struct("<4sBBHIIQ")
HEADER_BYTES = HEADER.size  # 24
REPLY_BIT = 0x80

# Static caps (the most any receiver accepts, whatever its config says).
MAX_KEYS_CAP = 65536
MAX_KEY_BYTES_CAP = 1024
MAX_TEXT = 256
MAX_METADATA_BYTES = 1 << 24

Key = Annotated[bytes, Meta(min_length=1, max_length=MAX_KEY_BYTES_CAP)]
Keys = Annotated[list[Key], Meta(max_length=MAX_KEYS_CAP)]
Sizes = Annotated[list[Annotated[int, Meta(ge=0, le=1 << 40)]], Meta(max_length=MAX_KEYS_CAP)]
Addrs = Annotated[list[Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]], Meta(max_length=MAX_KEYS_CAP)]
Text = Annotated[str, Meta(max_length=MAX_TEXT)]


class MsgType(enum.IntEnum):
    HELLO = 1
    EXISTS = 2
    PUT = 3
    GET = 4
    DELETE = 5
    STATS = 6
    HEALTH = 7
    PUT_REMOTE = 8  # NIXL data path: the server READs the values from the client's memory
    GET_REMOTE = 9  # NIXL data path: the server WRITEs the values into the client's memory
    AGENT_META = 10  # NIXL: the client's agent metadata changed (new registrations)
    ERROR = 0xFF


class Status(enum.IntEnum):
    """Per-key outcome of a PUT or GET."""

    OK = 0
    MISS = 1  # get: not held (never stored, evicted, deleted)
    FULL = 2  # put: no room (every slot pinned or being written, or when_full: refuse)
    BUSY = 3  # put: the key is being written by another request; get: being staged too long
    BAD_SIZE = 4  # put: value empty or larger than the server's max_value_bytes; get: view too small
    FAILED = 5  # an I/O or transfer error on the server side
    PRESENT = 6  # put without overwrite: the key is held already (the bytes were not taken)
    LIMIT = 7  # get: the reply would exceed max_payload_bytes; ask again in a smaller batch


OK_PUT = frozenset({Status.OK, Status.PRESENT})


# ------------------------------------------------------------------------------ bodies
class _Body(Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    pass


class Hello(_Body):
    """First message of every connection; nothing else is served before it is accepted."""

    token: Annotated[str, Meta(max_length=1024)] = ""
    client: Text = ""
    nixl_agent: Text = ""  # empty: no NIXL on the client
    nixl_metadata: Annotated[bytes, Meta(max_length=MAX_METADATA_BYTES)] = b""


class Welcome(_Body):
    server: Text
    session: int
    max_body_bytes: int
    max_payload_bytes: int
    max_keys: int
    max_key_bytes: int
    max_value_bytes: int
    nixl: bool  # the server reads/writes the client's memory when asked (PUT_REMOTE/GET_REMOTE)


class Exists(_Body):
    keys: Keys


class ExistsReply(_Body):
    present: Annotated[list[bool], Meta(max_length=MAX_KEYS_CAP)]


class Put(_Body):
    """Values follow as the payload, ``sizes[i]`` bytes each, in key order."""

    keys: Keys
    sizes: Sizes
    overwrite: bool = True


class PutRemote(_Body):
    """Values stay in the client's registered memory at ``addrs[i]``; the server READs them."""

    keys: Keys
    sizes: Sizes
    addrs: Addrs
    overwrite: bool = True


class PutReply(_Body):
    status: Annotated[list[int], Meta(max_length=MAX_KEYS_CAP)]


class Get(_Body):
    """The reply's payload holds the OK values back to back (``sizes[i]`` bytes each)."""

    keys: Keys
    capacities: Sizes  # the most bytes the client takes for each key (its view's length)


class GetRemote(_Body):
    """The server WRITEs each OK value into the client's registered memory at ``addrs[i]``."""

    keys: Keys
    capacities: Sizes
    addrs: Addrs


class GetReply(_Body):
    status: Annotated[list[int], Meta(max_length=MAX_KEYS_CAP)]
    sizes: Sizes  # bytes of each value (0 unless OK)


class Delete(_Body):
    keys: Keys


class DeleteReply(_Body):
    deleted: int


class Stats(_Body):
    pass


class TierStats(_Body):
    name: str
    backend: str
    capacity_bytes: int
    used_bytes: int
    chunks: int
    hit_chunks: int
    stored_chunks: int
    evictions: int


class ClientStats(_Body):
    session: int
    client: str
    peer: str
    data_path: str
    connected_s: float
    requests: int
    put_keys: int
    get_keys: int
    hits: int
    misses: int
    bytes_in: int
    bytes_out: int
    errors: int


class StatsReply(_Body):
    server: str
    version: str
    uptime_s: float
    draining: bool
    max_value_bytes: int
    capacity_bytes: int
    used_bytes: int
    get_keys: int
    hits: int
    misses: int
    put_keys: int
    stored: int
    refused_messages: int
    tiers: list[TierStats]
    clients: list[ClientStats]


class Health(_Body):
    pass


class HealthReply(_Body):
    status: str  # "ok" or "draining"
    uptime_s: float
    connections: int


class AgentMeta(_Body):
    metadata: Annotated[bytes, Meta(max_length=MAX_METADATA_BYTES)]


class Ack(_Body):
    pass


class ErrorReply(_Body):
    code: Text
    message: Annotated[str, Meta(max_length=4096)]


REQUEST_BODIES: dict[MsgType, type[_Body]] = {
    MsgType.HELLO: Hello,
    MsgType.EXISTS: Exists,
    MsgType.PUT: Put,
    MsgType.GET: Get,
    MsgType.DELETE: Delete,
    MsgType.STATS: Stats,
    MsgType.HEALTH: Health,
    MsgType.PUT_REMOTE: PutRemote,
    MsgType.GET_REMOTE: GetRemote,
    MsgType.AGENT_META: AgentMeta,
}
REPLY_BODIES: dict[MsgType, type[_Body]] = {
    MsgType.HELLO: Welcome,
    MsgType.EXISTS: ExistsReply,
    MsgType.PUT: PutReply,
    MsgType.GET: GetReply,
    MsgType.DELETE: DeleteReply,
    MsgType.STATS: StatsReply,
    MsgType.HEALTH: HealthReply,
    MsgType.PUT_REMOTE: PutReply,
    MsgType.GET_REMOTE: GetReply,
    MsgType.AGENT_META: Ack,
}
#: Request types followed by a payload (the values of a PUT). Replies: only GET's.
PAYLOAD_REQUESTS = frozenset({MsgType.PUT})
PAYLOAD_REPLIES = frozenset({MsgType.GET})

_DECODERS: dict[type[_Body], msgspec.msgpack.Decoder[Any]] = {
    cls: msgspec.msgpack.Decoder(cls)
    for cls in {*REQUEST_BODIES.values(), *REPLY_BODIES.values(), ErrorReply}
}
_ENCODER = msgspec.msgpack.Encoder()


# ------------------------------------------------------------------------------ errors
class ProtocolError(Exception):
    """A frame or body this side refuses. ``code`` is sent back in an ERROR frame."""

    code = "protocol_error"


class BadMagic(ProtocolError):
    code = "bad_magic"


class UnsupportedVersion(ProtocolError):
    code = "unsupported_version"


class UnknownMessageType(ProtocolError):
    code = "unknown_type"


class BadFlags(ProtocolError):
    code = "bad_flags"


class MessageTooLarge(ProtocolError):
    code = "too_large"


class UnexpectedPayload(ProtocolError):
    code = "unexpected_payload"


class MalformedBody(ProtocolError):
    code = "malformed_body"


class LimitExceeded(ProtocolError):
    """A well-formed body beyond this receiver's configured limits."""

    code = "limit_exceeded"


class Truncated(ProtocolError):
    """The stream ended inside a frame."""

    code = "truncated"


class Unauthorized(ProtocolError):
    code = "unauthorized"


class HelloRequired(ProtocolError):
    code = "hello_required"


class RemoteError(Exception):
    """The other side answered with an ERROR frame."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# ------------------------------------------------------------------------------ header
@dataclass(frozen=True, slots=True)
class Header:
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


# ------------------------------------------------------------------------------ bodies
B = TypeVar("B", bound=_Body)


def body_type(header: Header) -> type[_Body]:
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
    return _ENCODER.encode(body)


def frame(msg_type: int, request_id: int, body: _Body, payload_len: int = 0) -> bytes:
    """Header + body of one frame (the payload, if any, is sent after it by the caller)."""
    data = encode_body(body)
    return pack_header(msg_type, request_id, len(data), payload_len) + data


def reply_type(msg_type: MsgType) -> int:
    return int(msg_type) | REPLY_BIT


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


# ------------------------------------------------------------------------------ sans-I/O
@dataclass(frozen=True, slots=True)
class Frame:
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
