"""The P/D side channel: a producer worker's TCP service, and a consumer's link to it.

Control only; the KV bytes move by NIXL (UCX) READs that the consumer issues
into its own registered host slab, straight from the producer's registered
host slab. Messages are msgpack maps framed by a 4-byte big-endian length,
bounded by ``MAX_MESSAGE_BYTES``; anything else closes the connection.

    consumer -> producer                       producer -> consumer
    {"op": "hello", "fingerprint": {...}}      {"ok": true, "agent": name, "metadata": bytes,
                                                "fingerprint": {...}, "slab_addr": int,
                                                "slot_bytes": int, "num_slots": int}
                                               or {"ok": false, "error": "..."}
    {"op": "resolve", "keys": [bytes],         {"ok": true, "slots": [slot or -1 per key]}
     "wait_s": float}                          (waits until every key's copy into the host
                                                tier has finished, or wait_s passed)

The producer refuses a consumer whose fingerprint differs (naming the
fields), and so does the consumer (it checks the producer's answer too).

:class:`HandoffServer` (producer worker): owns a NIXL agent with the host slab
registered once, a listening socket (one thread per connection) and a thread
that collects NIXL notifications ("this request's chunks were read"). The
worker tells it which key each host slot holds (:meth:`slot_filling` when a
copy into a slot starts, :meth:`slot_filled` when it is done), so ``resolve``
answers only with slots whose bytes are complete.

:class:`PeerLink` (consumer worker): one connection to one producer rank, its
agent loaded into the consumer's agent.

Threads: HandoffServer's state is guarded by its condition variable; the NIXL
agent calls are serialised by ``agent_lock`` (the agent is not thread-safe).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from tiercache.handoff import NOTIF_PREFIX, mismatches

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 << 20
_LEN = struct.Struct(">I")
_ACCEPT_POLL_S = 0.005
_NOTIF_POLL_S = 0.002


class ChannelError(ConnectionError):
    """The side channel failed: unreachable peer, malformed message, refused hello."""


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    body = msgspec.msgpack.encode(message)
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ChannelError("side channel closed by the peer")
        buf += part
    return bytes(buf)


def recv_message(sock: socket.socket) -> dict[str, Any]:
    (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if size > MAX_MESSAGE_BYTES:
        raise ChannelError(f"side-channel message of {size} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        message = msgspec.msgpack.decode(_recv_exact(sock, size))
    except msgspec.DecodeError as exc:
        raise ChannelError(f"malformed side-channel message: {exc}") from exc
    if not isinstance(message, dict):
        raise ChannelError("side-channel message is not a map")
    return message


def make_agent(role: str, progress_thread: bool = False) -> Any:
    """A NIXL agent with the UCX backend.

    ``progress_thread``: NIXL's own (C++) thread progresses UCX; it busy-polls a
    core. Off by default: the producer progresses UCX from its notification
    thread instead (a consumer's READ completes only while the producer's UCX
    worker is progressed; measured: with neither, every READ timed out). With
    the progress thread on, the side channel's accept thread starved outright
    on this 2-core VM (4 of 4 probe runs), see docs/pd.md.
    """
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(f"tiercache-{role}-{os.getpid()}-{os.urandom(3).hex()}",
                      nixl_agent_config(backends=["UCX"], enable_prog_thread=progress_thread))


class HandoffServer:
    """Producer worker: serves hellos and resolves, collects read notifications."""

    def __init__(self, slab_addr: int, slot_bytes: int, num_slots: int,
                 fingerprint: dict[str, Any], host: str, port: int) -> None:
        self.slab_addr, self.slot_bytes, self.num_slots = slab_addr, slot_bytes, num_slots
        self.fingerprint = fingerprint
        self.agent = make_agent("producer")
        self.agent_lock = threading.Lock()
        self._reg = self.agent.register_memory([(slab_addr, slot_bytes * num_slots, 0, "")], "DRAM")
        self.agent_name = self.agent.name
        self.metadata: bytes = self.agent.get_agent_metadata()
        self._cond = threading.Condition()
        self._slot_of: dict[bytes, int] = {}  # key -> slot whose bytes are complete
        self._key_in: dict[int, bytes] = {}  # slot -> the key it holds
        self._read: set[str] = set()  # producer request ids whose hand-off was read
        self._closed = False
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.setblocking(False)
        self.address = f"{host}:{port}"
        self._threads = [
            threading.Thread(target=self._accept_loop, name="tiercache-pd-accept", daemon=True),
            threading.Thread(target=self._notif_loop, name="tiercache-pd-notifs", daemon=True),
        ]
        for t in self._threads:
            t.start()
        logger.info("tiercache P/D producer: side channel on %s, NIXL agent %s", self.address, self.agent_name)

    # -------------------------------------------------------- worker thread
    def slot_filling(self, slots: Sequence[int]) -> None:
        """Copies into ``slots`` start: whatever they held is no longer readable."""
        with self._cond:
            for slot in slots:
                old = self._key_in.pop(slot, None)
                if old is not None and self._slot_of.get(old) == slot:
                    del self._slot_of[old]

    def slot_filled(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """The copies of ``keys`` into ``slots`` finished: they may be read."""
        with self._cond:
            for key, slot in zip(keys, slots):
                self._slot_of[key] = slot
                self._key_in[slot] = key
            self._cond.notify_all()

    def take_read_requests(self) -> set[str]:
        """Producer request ids whose hand-off a consumer finished reading (drained)."""
        with self._cond:
            out, self._read = self._read, set()
        return out

    # ------------------------------------------------------ service threads
    def _accept_loop(self) -> None:
        while not self._closed:
            # Non-blocking accept, tried every few milliseconds: waiting in poll()/accept()
            # for the wake-up missed connections for seconds on this VM's network stack
            # (the kernel had them queued while poll() kept reporting nothing).
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                time.sleep(_ACCEPT_POLL_S)
                continue
            except OSError:
                return
            conn.setblocking(True)
            threading.Thread(target=self._serve, args=(conn,), name="tiercache-pd-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(300)
            try:
                while not self._closed:
                    send_message(conn, self._answer(recv_message(conn)))
            except (ChannelError, OSError):
                return  # the consumer left or spoke nonsense: only this connection ends

    def _answer(self, message: dict[str, Any]) -> dict[str, Any]:
        op = message.get("op")
        if op == "hello":
            theirs = message.get("fingerprint")
            diff = mismatches(self.fingerprint, theirs if isinstance(theirs, dict) else {})
            if diff:
                return {"ok": False, "error": "incompatible peer: " + "; ".join(diff)}
            return {"ok": True, "agent": self.agent_name, "metadata": self.metadata,
                    "fingerprint": self.fingerprint, "slab_addr": self.slab_addr,
                    "slot_bytes": self.slot_bytes, "num_slots": self.num_slots}
        if op == "resolve":
            keys = message.get("keys")
            if not isinstance(keys, list) or not all(isinstance(k, bytes) for k in keys):
                return {"ok": False, "error": "resolve: keys must be a list of bytes"}
            wait_s = min(float(message.get("wait_s", 0) or 0), 60.0)
            return {"ok": True, "slots": self._resolve(keys, wait_s)}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _resolve(self, keys: list[bytes], wait_s: float) -> list[int]:
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                slots = [self._slot_of.get(k, -1) for k in keys]
                left = deadline - time.monotonic()
                if -1 not in slots or left <= 0 or self._closed:
                    return slots
                self._cond.wait(min(left, 0.05))

    def _notif_loop(self) -> None:
        """Collect read notifications; each call also progresses the producer's UCX worker."""
        while not self._closed:
            self._collect_notifs()
            time.sleep(_NOTIF_POLL_S)

    def _collect_notifs(self) -> None:
        try:
            with self.agent_lock:
                notifs = self.agent.get_new_notifs()
        except Exception:  # noqa: BLE001 - a NIXL hiccup must not end the producer
            logger.warning("tiercache P/D: reading NIXL notifications failed", exc_info=True)
            return
        done = [m[len(NOTIF_PREFIX):].decode(errors="replace")
                for msgs in notifs.values() for m in msgs if m.startswith(NOTIF_PREFIX)]
        if done:
            with self._cond:
                self._read.update(done)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
        for t in self._threads:
            t.join(timeout=2)
        with self.agent_lock:
            try:
                self.agent.deregister_memory(self._reg)
            except Exception:  # noqa: BLE001
                logger.debug("tiercache P/D: deregistering the slab failed", exc_info=True)


class PeerLink:
    """Consumer worker: one connection to one producer rank (handshake done)."""

    def __init__(self, host: str, port: int, fingerprint: dict[str, Any], agent: Any, timeout_s: float) -> None:
        self.address = f"{host}:{port}"
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise ChannelError(f"producer {self.address} unreachable: {exc}") from exc
        self.sock.settimeout(timeout_s)
        self.timeout_s = timeout_s
        try:
            send_message(self.sock, {"op": "hello", "fingerprint": fingerprint})
            reply = recv_message(self.sock)
            if not reply.get("ok"):
                raise ChannelError(f"producer {self.address} refused us: {reply.get('error')}")
            diff = mismatches(fingerprint, reply.get("fingerprint") or {})
            if diff:
                raise ChannelError(f"producer {self.address} is incompatible: " + "; ".join(diff))
            self.slab_addr = int(reply["slab_addr"])
            self.slot_bytes = int(reply["slot_bytes"])
            self.num_slots = int(reply["num_slots"])
            name = agent.add_remote_agent(reply["metadata"])
            self.agent_name = name.decode() if isinstance(name, bytes) else str(name)
        except OSError as exc:
            self.sock.close()
            raise ChannelError(f"producer {self.address}: hello: {exc}") from exc
        except Exception:
            self.sock.close()
            raise

    def resolve(self, keys: Sequence[bytes], wait_s: float) -> list[int]:
        """Slots of ``keys`` on the producer (-1: not there, or not complete within wait_s)."""
        try:
            self.sock.settimeout(wait_s + self.timeout_s + 5)
            send_message(self.sock, {"op": "resolve", "keys": list(keys), "wait_s": wait_s})
            reply = recv_message(self.sock)
        except OSError as exc:
            raise ChannelError(f"producer {self.address}: {exc}") from exc
        if not reply.get("ok"):
            raise ChannelError(f"producer {self.address}: {reply.get('error')}")
        slots = [int(s) for s in reply["slots"]]
        if len(slots) != len(keys) or any(s >= self.num_slots for s in slots):
            raise ChannelError(f"producer {self.address}: malformed resolve answer")
        return slots

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
