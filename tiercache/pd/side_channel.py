"""The producer's side-channel server: bounded connections, the authentication handshake, then hellos and read notices.

:class:`SideChannel` owns the listening socket and one thread that serves
every connection from a ``select`` loop (the messages:
:mod:`tiercache.pd.channel`; the proofs: :mod:`tiercache.pd.auth`). A
connection goes through three states:

* ``new``: it may send one ``hello`` carrying its nonce; it is answered with
  our nonce (nothing else: no metadata, no address, no fingerprint);
* ``challenged``: it may send one ``prove`` with its proof and fingerprint. A
  wrong proof is answered ``authentication failed`` and the connection closed;
  a right one gets our proof and the owner's answer to the fingerprint
  (``answer_hello``: the addresses to READ, or a refusal naming the differing
  fields only);
* ``authenticated``: it may send read notices (``on_read``), nothing else.

Bounds (``pd.max_connections``, ``pd.max_connections_per_peer``,
``pd.handshake_timeout_s``, ``pd.idle_timeout_s``): a newcomer over either cap
takes the place of the oldest connection not yet authenticated (of its peer
address, for the per-peer cap), one that has said nothing first, then one
waiting for its proof; when every connection it could replace is
authenticated it is closed instead (:mod:`tiercache.admission`). A newcomer's first bytes are read the
moment it is accepted (a consumer sends its hello at once), and at most
:data:`_ACCEPTS_PER_ROUND` are accepted between two rounds of reading, so a
flood of silent connections cannot push a consumer's handshake out. A connection not authenticated within the
handshake timeout, or authenticated and silent for the idle timeout, is
closed. A message may be at most :data:`MAX_UNAUTHENTICATED_BYTES` before
authentication and :data:`MAX_AUTHENTICATED_BYTES` after it, so the buffered
bytes stay below ``max_connections`` times the latter.

Threads: the serving thread alone touches the sockets and the connection
table; ``counters`` (ints) are written by it and read by anyone.
``answer_hello`` and ``on_read`` run on it: they must not block.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tiercache import faults
from tiercache.admission import Admission
from tiercache.pd import auth
from tiercache.pd.channel import (
    REPLY_TIMEOUT_S,
    ChannelError,
    decode_body,
    encode_message,
    take_body,
)

logger = logging.getLogger(__name__)

MAX_UNAUTHENTICATED_BYTES = 8 << 10  # a hello or a proof with a fingerprint: a few hundred bytes
MAX_AUTHENTICATED_BYTES = 64 << 10  # read notices: tens of bytes each
_RECV_BYTES = 16 << 10
_BACKLOG = 1024
_ACCEPTS_PER_ROUND = 32
_SWEEP_S = 0.25  # how often, at most, deadlines are checked


@dataclass(frozen=True)
class ChannelLimits:
    """The side channel's bounds (pd.max_connections, pd.max_connections_per_peer, and the timeouts)."""

    max_connections: int = 256
    max_per_peer: int = 64
    handshake_timeout_s: float = 5.0
    idle_timeout_s: float = 900.0


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: str  # the peer's IP address
    since: float  # accepted (monotonic)
    last: float  # last bytes received (monotonic)
    state: str = "new"  # new -> challenged -> authenticated
    their_nonce: bytes = b""
    our_nonce: bytes = b""
    buf: bytearray = field(default_factory=bytearray)


class SideChannel:
    """The producer's side channel: authentication, then ``answer_hello`` and ``on_read`` (see the module)."""

    def __init__(self, host: str, port: int, key: bytes, limits: ChannelLimits,
                 answer_hello: Callable[[Any], dict[str, Any]], on_read: Callable[[dict[str, Any]], None]) -> None:
        self.address = f"{host}:{port}"
        self.limits = limits
        self._key = key
        self._answer_hello = answer_hello
        self._on_read = on_read
        self.counters = {"accepted": 0, "authenticated": 0, "auth_failed": 0, "evicted": 0, "rejected": 0,
                         "timed_out": 0, "bad_messages": 0}
        self._conns: dict[socket.socket, _Conn] = {}
        self._admission: Admission[_Conn] = Admission(limits.max_connections, limits.max_per_peer, _handshake_rank)
        self._listener = socket.create_server((host, port), backlog=_BACKLOG)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()  # close() wakes the thread
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="tiercache-pd-side-channel", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def connections(self) -> int:
        return len(self._conns)

    @property
    def buffered_bytes(self) -> int:
        return sum(len(c.buf) for c in list(self._conns.values()))

    # ------------------------------------------------------------ the thread
    def _serve(self) -> None:
        next_sweep = time.monotonic() + _SWEEP_S
        while not self._closed:
            try:
                events = self._selector.select(timeout=_SWEEP_S)
            except (OSError, ValueError):
                return  # closed under us
            for sel_key, _ in events:
                if sel_key.fileobj is self._wake_r:
                    return
                if sel_key.fileobj is self._listener:
                    self._accept()
                else:
                    conn = self._conns.get(sel_key.fileobj)  # type: ignore[arg-type]
                    if conn is not None:
                        self._receive(conn)
            now = time.monotonic()
            if now >= next_sweep:
                self._sweep(now)
                next_sweep = now + _SWEEP_S

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_ROUND):
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                logger.warning("tiercache P/D: accept on %s failed", self.address, exc_info=True)
                return
            peer = str(addr[0])
            victims = self._admission.make_room(peer)  # the oldest unauthenticated make way
            if victims is None:
                self.counters["rejected"] += 1
                sock.close()
                continue
            for victim in victims:
                self.counters["evicted"] += 1
                self._drop(victim)
            now = time.monotonic()
            sock.setblocking(False)
            conn = self._conns[sock] = _Conn(sock, peer, now, now)
            self._admission.add(conn, peer)
            self._selector.register(sock, selectors.EVENT_READ, None)
            self.counters["accepted"] += 1
            self._receive(conn)  # its hello, if it came with the connection (else the selector says when)

    def _sweep(self, now: float) -> None:
        """Close connections past their handshake or idle deadline."""
        for conn in list(self._conns.values()):
            if conn.state == "authenticated":
                late = now - conn.last > self.limits.idle_timeout_s
            else:
                late = now - conn.since > self.limits.handshake_timeout_s
            if late:
                self.counters["timed_out"] += 1
                self._drop(conn)

    def _receive(self, conn: _Conn) -> None:
        try:
            part = conn.sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            part = b""
        if not part:
            self._drop(conn)
            return
        conn.last = time.monotonic()
        conn.buf += part
        limit = MAX_AUTHENTICATED_BYTES if conn.state == "authenticated" else MAX_UNAUTHENTICATED_BYTES
        try:
            while conn.sock in self._conns and (body := take_body(conn.buf, limit)) is not None:
                self._handle(conn, decode_body(body))
            if len(conn.buf) > limit:
                raise ChannelError(f"more than {limit} bytes pending")
        except (ChannelError, OSError) as exc:
            self.counters["bad_messages"] += 1
            logger.info("tiercache P/D: side channel %s: dropping a connection from %s: %s",
                        self.address, conn.peer, exc)
            self._drop(conn)
        except Exception as exc:
            self.counters["bad_messages"] += 1
            faults.record(faults.READER_EXCEPTION, exc, where=f"pd side channel {self.address}")
            self._drop(conn)

    def _handle(self, conn: _Conn, message: dict[str, Any]) -> None:
        op = message.get("op")
        if conn.state == "authenticated":
            if op != "read":
                raise ChannelError(f"unexpected {op!r} after the handshake")
            self._on_read(message)
        elif conn.state == "new":
            nonce = message.get("nonce")
            if op != "hello" or not auth.valid_nonce(nonce):
                self._send(conn, {"ok": False, "error": "authenticate first (hello with a nonce)"})
                raise ChannelError(f"{op!r} before authentication")
            conn.their_nonce, conn.our_nonce, conn.state = nonce, auth.new_nonce(), "challenged"
            self._send(conn, {"ok": True, "nonce": conn.our_nonce})
        else:  # challenged: the peer's proof, and its fingerprint
            expected = auth.consumer_proof(self._key, conn.their_nonce, conn.our_nonce)
            if op != "prove" or not auth.proof_matches(expected, message.get("proof")):
                self.counters["auth_failed"] += 1
                logger.warning("tiercache P/D: side channel %s: %s failed to authenticate (no pd.secret, or "
                               "another one)", self.address, conn.peer)
                self._send(conn, {"ok": False, "error": "authentication failed"})
                self._drop(conn)
                return
            conn.state = "authenticated"
            self.counters["authenticated"] += 1
            answer = self._answer_hello(message.get("fingerprint"))
            answer["proof"] = auth.producer_proof(self._key, conn.their_nonce, conn.our_nonce)
            self._send(conn, answer)
            if not answer.get("ok"):
                self._drop(conn)

    def _send(self, conn: _Conn, message: dict[str, Any]) -> None:
        """One answer (a few KiB at most: it fits the socket buffer at once, or gives up after REPLY_TIMEOUT_S)."""
        conn.sock.settimeout(REPLY_TIMEOUT_S)
        try:
            conn.sock.sendall(encode_message(message))
        finally:
            if conn.sock.fileno() >= 0:
                conn.sock.setblocking(False)

    def _drop(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        self._admission.discard(conn)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def close(self) -> None:
        self._closed = True
        self._wake_w.send(b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for conn in list(self._conns.values()):
            self._drop(conn)
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()


def _handshake_rank(conn: _Conn) -> int | None:
    """Admission's rank of a connection: silent ones make way first, then those mid-handshake."""
    return {"new": 0, "challenged": 1}.get(conn.state)
