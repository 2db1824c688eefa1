"""The P/D side channel's vocabulary: message framing, the read notice's rationale, slot tags.

Control only; the KV bytes move by NIXL (UCX) READs that the consumer issues
from the producer's registered host slab (mode via_host) or KV blocks (mode
direct) into its own registered memory. The side channel carries, per
consumer and producer rank, one handshake, then one short one-way message
per hand-off read; the hand-off params name the producer's host slots or
blocks (``remote_block_ids``). The producer's end is
:class:`tiercache.pd.producer.ProducerEndpoint`, the consumer's
:class:`tiercache.pd.link.PeerLink`.

Messages are msgpack maps framed by a 4-byte big-endian length, bounded by
``MAX_MESSAGE_BYTES`` (the producer accepts far less: 8 KiB before
authentication, 64 KiB after, :mod:`tiercache.pd.side_channel`); anything
else closes that connection only. First a mutual authentication with the
shared ``pd.secret`` (the proofs: :mod:`tiercache.pd.auth`), then the
fingerprint check and the addresses, then read notices::

    consumer -> producer                       producer -> consumer
    {"op": "hello", "nonce": 32 bytes}         {"ok": true, "nonce": 32 bytes}
                                               (nothing else before the proof)
    {"op": "prove", "proof": HMAC,             wrong proof: {"ok": false, "error": "authentication
     "fingerprint": {...}}                     failed"}, closed. Right proof: {"ok": true,
                                                "proof": HMAC, "agent": name, "metadata": bytes,
                                                "fingerprint": {...}, "slab_addr": int,
                                                "slot_bytes": int, "num_slots": int,
                                                "tags_addr": int, "hashes_addr": int,
                                                "hash_positions": int,
                                                planes slab: "slot_planes": {...},
                                                mode direct: "blocks": {...},
                                                "block_tags_addr": int}
                                               or {"ok": false, "proof": HMAC, "error":
                                                "incompatible peer: differing fields: a, b"}
    {"op": "read", "request_id": str,          (none: the producer releases that hand-off if
     "token": str}                              the token is the hand-off's release token)
    another TP size, several consumer ranks read this producer rank:
    {"op": "read", "request_id": str,          (none: released once ``readers`` distinct
     "token": str, "rank": int, "readers": int} consumer ranks have said so)

The consumer believes nothing in the producer's answer before it checked the
producer's proof. A refusal names the differing fingerprint fields, never
their values (the fingerprint holds the tenant salt's digest); the consumer's
log adds its own values. The release token comes with the hand-off params
(``tiercache.release_token``): only the consumer the hand-off was given to
can release it, and only on an authenticated connection.

A consumer of another TP size (:mod:`tiercache.pd.heads`) is accepted when
only ``tp_size``/``bytes_per_chunk`` differ and the ratio allows it; the
producer's answer then carries ``"page_heads"`` (its global heads and one
head's bytes per page region), from which the consumer READs its heads'
sub-runs. Each side refuses a peer whose fingerprint differs otherwise (naming
the fields): the producer the hello, the consumer the producer's answer.

The read message goes over the side channel rather than as a NIXL
notification: with UCX error handling ``none``, NIXL notifications from a
consumer were seen to never reach a ``vllm serve`` producer here (they did
reach an offline-engine producer); the side channel has no such doubt.

**Slot tags** guard against reading a slot that no longer holds the handed-off
chunk (a copy still in flight, or a hand-off that expired and whose slot was
reused). Beside its slab the producer registers one 64-bit tag per slot: 0
while a copy into the slot runs, :func:`key_tag` of the chunk once the copy is
complete. The consumer reads the chunks, then the tags: a tag naming the
chunk proves the slot held it throughout the read (it was complete before the
params were issued); a tag of 0 (a copy in flight) means read again; another
chunk's tag means the slot was reused: dropped and recomputed. Same key means
same bytes, so a slot re-filled with the same chunk reads correctly either
way. Mode direct: one tag per KV block, set while the block is held for a
hand-off (:meth:`tiercache.pd.producer.ProducerEndpoint.hold_blocks`).

:func:`make_agent` makes either side's NIXL agent. Everything here is pure
functions and constants: no state, no threads.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
from typing import Any

import msgspec

MAX_MESSAGE_BYTES = 16 << 20
TAG_BYTES = 8
REPLY_TIMEOUT_S = 2.0  # a send that does not fit the socket buffer at once gives up after this
_LEN = struct.Struct(">I")


class ChannelError(ConnectionError):
    """The side channel failed: unreachable peer, malformed message, refused hello."""


def key_tag(key: bytes) -> int:
    """The slot tag of a chunk key: 8 bytes of BLAKE2b of the whole key (never 0: 0 means "being written").

    The whole key: its first bytes are the namespace digest, the same for every
    chunk of an engine (until session 9 the tag was those bytes, so a slot or
    block reused for another chunk of the same engine passed the check).
    """
    return int.from_bytes(hashlib.blake2b(key, digest_size=TAG_BYTES).digest(), "little") or 1


def encode_message(message: dict[str, Any]) -> bytes:
    """One framed message: its length, then its msgpack body."""
    body = msgspec.msgpack.encode(message)
    return _LEN.pack(len(body)) + body


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(encode_message(message))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ChannelError("side channel closed by the peer")
        buf += part
    return bytes(buf)


def decode_body(body: bytes) -> dict[str, Any]:
    """A message body as a map (ChannelError if it is not msgpack, or not a map)."""
    try:
        message = msgspec.msgpack.decode(body)
    except msgspec.DecodeError as exc:
        raise ChannelError(f"malformed side-channel message: {exc}") from exc
    if not isinstance(message, dict):
        raise ChannelError("side-channel message is not a map")
    return message


def recv_message(sock: socket.socket) -> dict[str, Any]:
    """The next message from a blocking socket."""
    (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if size > MAX_MESSAGE_BYTES:
        raise ChannelError(f"side-channel message of {size} bytes exceeds {MAX_MESSAGE_BYTES}")
    return decode_body(_recv_exact(sock, size))


def take_body(buf: bytearray, limit: int = MAX_MESSAGE_BYTES) -> bytes | None:
    """The first whole message body in ``buf`` (removed from it), or None while it is incomplete.

    For a non-blocking reader that collects bytes as they come; ChannelError if
    the length exceeds ``limit``.
    """
    if len(buf) < _LEN.size:
        return None
    (size,) = _LEN.unpack_from(buf)
    if size > limit:
        raise ChannelError(f"message of {size} bytes exceeds {limit}")
    if len(buf) < _LEN.size + size:
        return None
    body = bytes(buf[_LEN.size:_LEN.size + size])
    del buf[:_LEN.size + size]
    return body


def make_agent(role: str, error_handling: str = "none") -> Any:
    """A NIXL agent with the UCX backend and no NIXL progress thread.

    ``error_handling`` is UCX's error-handling mode (``pd.nixl_error_handling``).
    With ``none`` UCX may pick one-sided transports (CMA/shared memory on one
    host, RDMA): a READ completes without the producer's CPU. With ``peer``
    (NIXL's default) UCX on one host falls back to tcp, where a READ moves only
    while the producer progresses its UCX worker.

    NIXL's progress thread busy-polls a core (its Python API sets no delay); on
    a 2-core machine beside two engines that starves everything else. The
    producer's UCX worker is progressed by
    :meth:`tiercache.pd.producer.ProducerEndpoint.service` each step (and by its
    own progress thread when configured), the consumer's by its reader thread
    while it waits.
    """
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"tiercache-{role}-{os.getpid()}-{os.urandom(3).hex()}",
                       nixl_agent_config(backends=[], enable_prog_thread=False))
    agent.create_backend("UCX", {"ucx_error_handling_mode": error_handling})
    return agent
