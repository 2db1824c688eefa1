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

This module is the protocol's public face: it re-exports every name of the
modules that implement it, so callers import from here only:

* :mod:`~tiercache.server.protocol_header` - magic, version, the header
  layout, :class:`Header`, :class:`Limits`, :func:`pack_header`,
  :func:`unpack_header`, :func:`reply_type`;
* :mod:`~tiercache.server.protocol_messages` - :class:`MsgType`,
  :class:`Status`, the static caps, the body Structs and their tables;
* :mod:`~tiercache.server.protocol_codec` - :func:`encode_body`,
  :func:`frame`, :func:`decode_body`, :func:`check_request`,
  :class:`FrameDecoder`;
* :mod:`~tiercache.server.protocol_errors` - :class:`ProtocolError` and its
  subclasses, :class:`RemoteError`.
"""

from __future__ import annotations

from tiercache.server.protocol_codec import (
    B,
    Frame,
    FrameDecoder,
    body_type,
    check_request,
    decode_body,
    encode_body,
    frame,
)
from tiercache.server.protocol_errors import (
    BadFlags,
    BadMagic,
    HelloRequired,
    LimitExceeded,
    MalformedBody,
    MessageTooLarge,
    ProtocolError,
    RemoteError,
    Truncated,
    Unauthorized,
    UnexpectedPayload,
    UnknownMessageType,
    UnsupportedVersion,
)
from tiercache.server.protocol_header import (
    HEADER,
    HEADER_BYTES,
    MAGIC,
    PROTOCOL_VERSION,
    REPLY_BIT,
    Header,
    Limits,
    pack_header,
    reply_type,
    unpack_header,
)
from tiercache.server.protocol_messages import (
    MAX_HEAD_BYTES,
    MAX_KEY_BYTES_CAP,
    MAX_KEYS_CAP,
    MAX_METADATA_BYTES,
    MAX_TEXT,
    OK_PUT,
    PAYLOAD_REPLIES,
    PAYLOAD_REQUESTS,
    REPLY_BODIES,
    REQUEST_BODIES,
    Ack,
    Addrs,
    AgentMeta,
    ClientStats,
    Delete,
    DeleteReply,
    ErrorReply,
    Exists,
    ExistsReply,
    Get,
    GetRemote,
    GetReply,
    HeadLens,
    Heads,
    Health,
    HealthReply,
    Hello,
    Key,
    Keys,
    MsgType,
    Put,
    PutRemote,
    PutReply,
    Sizes,
    Stats,
    StatsReply,
    Status,
    Text,
    TierStats,
    Welcome,
    _Body,
)

__all__ = [
    "HEADER",
    "HEADER_BYTES",
    "MAGIC",
    "MAX_HEAD_BYTES",
    "MAX_KEYS_CAP",
    "MAX_KEY_BYTES_CAP",
    "MAX_METADATA_BYTES",
    "MAX_TEXT",
    "OK_PUT",
    "PAYLOAD_REPLIES",
    "PAYLOAD_REQUESTS",
    "PROTOCOL_VERSION",
    "REPLY_BIT",
    "REPLY_BODIES",
    "REQUEST_BODIES",
    "Ack",
    "Addrs",
    "AgentMeta",
    "B",
    "BadFlags",
    "BadMagic",
    "ClientStats",
    "Delete",
    "DeleteReply",
    "ErrorReply",
    "Exists",
    "ExistsReply",
    "Frame",
    "FrameDecoder",
    "Get",
    "GetRemote",
    "GetReply",
    "HeadLens",
    "Header",
    "Heads",
    "Health",
    "HealthReply",
    "Hello",
    "HelloRequired",
    "Key",
    "Keys",
    "LimitExceeded",
    "Limits",
    "MalformedBody",
    "MessageTooLarge",
    "MsgType",
    "ProtocolError",
    "Put",
    "PutRemote",
    "PutReply",
    "RemoteError",
    "Sizes",
    "Stats",
    "StatsReply",
    "Status",
    "Text",
    "TierStats",
    "Truncated",
    "Unauthorized",
    "UnexpectedPayload",
    "UnknownMessageType",
    "UnsupportedVersion",
    "Welcome",
    "_Body",
    "body_type",
    "check_request",
    "decode_body",
    "encode_body",
    "frame",
    "pack_header",
    "reply_type",
    "unpack_header",
]
