"""Message types and bodies of the cache server's wire protocol (:mod:`tiercache.server.protocol`).

:class:`MsgType` is the ``type`` byte of a frame header; each request type
has a body Struct (msgpack, array-like, frozen, unknown fields refused) and a
reply body Struct, listed in :data:`REQUEST_BODIES` and :data:`REPLY_BODIES`.
:class:`Status` is the per-key outcome in PUT and GET replies. The static
caps bound every body whatever the receiver's configuration; msgspec checks
them while decoding.
"""

from __future__ import annotations

import enum
from typing import Annotated

from msgspec import Meta, Struct

# Static caps (the most any receiver accepts, whatever its config says).
MAX_KEYS_CAP = 65536
MAX_KEY_BYTES_CAP = 1024
MAX_TEXT = 256
MAX_METADATA_BYTES = 1 << 24
#: The most bytes of a value carried in a PUT_REMOTE/GET_REMOTE body per key (its frame header:
#: the client tier's compact header of the longest key, 40 + MAX_KEY_BYTES_CAP, fits).
MAX_HEAD_BYTES = 2048

Key = Annotated[bytes, Meta(min_length=1, max_length=MAX_KEY_BYTES_CAP)]
Keys = Annotated[list[Key], Meta(max_length=MAX_KEYS_CAP)]
Sizes = Annotated[list[Annotated[int, Meta(ge=0, le=1 << 40)]], Meta(max_length=MAX_KEYS_CAP)]
Addrs = Annotated[list[Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]], Meta(max_length=MAX_KEYS_CAP)]
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
Heads = Annotated[list[Annotated[bytes, Meta(max_length=MAX_HEAD_BYTES)]], Meta(max_length=MAX_KEYS_CAP)]
HeadLens = Annotated[list[Annotated[int, Meta(ge=0, le=MAX_HEAD_BYTES)]], Meta(max_length=MAX_KEYS_CAP)]


class MsgType(enum.IntEnum):
    """The ``type`` byte of a request; a reply's is ``type | REPLY_BIT``, an error's 0xFF."""

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


#: Statuses of a PUT that leave the key held.
OK_PUT: frozenset[Status] = frozenset({Status.OK, Status.PRESENT})


class _Body(Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """Base of every message body (callers name it ``protocol._Body``)."""


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
    """Values stay in the client's registered memory at ``addrs[i]``; the server READs them.

    ``heads`` (empty, or one per key): value ``i`` is ``heads[i]`` (carried here, written into
    the slot by the server) followed by ``sizes[i] - len(heads[i])`` bytes READ from
    ``addrs[i]``; ``sizes[i]`` is the whole value's length, head included
    (:mod:`tiercache.server.nixl_requests`).
    """

    keys: Keys
    sizes: Sizes
    addrs: Addrs
    overwrite: bool = True
    heads: Heads = []


class PutReply(_Body):
    status: Annotated[list[int], Meta(max_length=MAX_KEYS_CAP)]


class Get(_Body):
    """The reply's payload holds the OK values back to back (``sizes[i]`` bytes each)."""

    keys: Keys
    capacities: Sizes  # the most bytes the client takes for each key (its view's length)


class GetRemote(_Body):
    """The server WRITEs each OK value into the client's registered memory at ``addrs[i]``.

    ``head_lens`` (empty, or one per key): the reply's ``heads[i]`` carries the value's first
    ``min(head_lens[i], size)`` bytes and only the rest is written to ``addrs[i]``;
    ``capacities[i]`` bounds the whole value (head included) as in GET.
    """

    keys: Keys
    capacities: Sizes
    addrs: Addrs
    head_lens: HeadLens = []


class GetReply(_Body):
    status: Annotated[list[int], Meta(max_length=MAX_KEYS_CAP)]
    sizes: Sizes  # bytes of each value (0 unless OK)
    heads: Heads = []  # GET_REMOTE with head_lens: each value's first bytes (b"" unless OK)


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
    # Empty: the whole server (an admin token, or auth: none). Else the tenant whose view this is:
    # its own clients and counters, store-wide usage 0 (tiercache/server/tenant_stats.py).
    tenant_view: Text = ""


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
PAYLOAD_REQUESTS: frozenset[MsgType] = frozenset({MsgType.PUT})
PAYLOAD_REPLIES: frozenset[MsgType] = frozenset({MsgType.GET})
