"""The P/D side channel and slot tags: a producer worker's endpoint, a consumer's link to it.

Control only; the KV bytes move by NIXL (UCX) READs that the consumer issues
from the producer's registered host slab (mode via_host) or KV blocks (mode
direct) into its own registered memory. The side channel carries, per
consumer and producer rank, one handshake, then one short one-way message
per hand-off read; the hand-off params name the producer's host slots or
blocks (``remote_block_ids``).

Messages are msgpack maps framed by a 4-byte big-endian length, bounded by
``MAX_MESSAGE_BYTES``; anything else closes that connection only::

    consumer -> producer                       producer -> consumer
    {"op": "hello", "fingerprint": {...}}      {"ok": true, "agent": name, "metadata": bytes,
                                                "fingerprint": {...}, "slab_addr": int,
                                                "slot_bytes": int, "num_slots": int,
                                                "tags_addr": int,
                                                planes slab: "slot_planes": {...},
                                                mode direct: "blocks": {...},
                                                "block_tags_addr": int}
                                               or {"ok": false, "error": "..."}
    {"op": "read", "request_id": str}          (none: the producer releases that hand-off)
    another TP size, several consumer ranks read this producer rank:
    {"op": "read", "request_id": str,          (none: released once ``readers`` distinct
     "rank": int, "readers": int}               consumer ranks have said so)

A consumer of another TP size (tiercache.pd.heads) is accepted when only
``tp_size``/``bytes_per_chunk`` differ and the ratio allows it; the producer's
answer then carries ``"page_heads"`` (its global heads and one head's bytes per
page region), from which the consumer READs its heads' sub-runs.

The read message goes over the side channel rather than as a NIXL
notification: with UCX error handling ``none``, NIXL notifications from a
consumer were seen to never reach a ``vllm serve`` producer here (they did
reach an offline-engine producer); the side channel has no such doubt.

The producer refuses a consumer whose fingerprint differs (naming the
fields), and so does the consumer (it checks the producer's answer too).

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
hand-off (see :meth:`ProducerEndpoint.hold_blocks`).

:class:`ProducerEndpoint` (producer worker): a side-channel thread answers
handshakes and records read notices at once (blocked in ``select``
otherwise), and the worker calls :meth:`ProducerEndpoint.service` every
engine step to collect the request ids read since (and progress UCX). With
UCX error handling ``none`` (the default, see :func:`make_agent`) a consumer's READ needs nothing from the producer's CPU
(one-sided CMA / shared memory on one host), so an idle producer may stop
stepping: what it hears is handled at its next step. With ``peer`` (tcp on
one host) a READ moves only while the producer's UCX worker is progressed:
NIXL's own progress thread spins a whole core even when idle, so instead,
with ``busy_progress`` a small thread progresses UCX every
``PROGRESS_INTERVAL_S`` while hand-offs are held (:meth:`set_holding`) and
sleeps otherwise.
Measured on the 2-core VM with ``peer``: a 15.5 MiB READ took 90-200 ms with
progress once per step, 2 ms with continuous progress; with ``none``, 1-2 ms
and no producer involvement at all.

:class:`PeerLink` (consumer): one handshake with one producer rank, its
agent loaded into the consumer's agent.

Threads: every public ProducerEndpoint method on the worker thread only;
the side-channel thread owns the sockets and reads only fields fixed before
it serves (``blocks``, the tag arrays' addresses); the progress thread only
progresses UCX. The NIXL agent's calls from more than one thread are
serialised by ``_agent_lock``, the read request ids by ``_read_lock``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from tiercache import faults
from tiercache.pd.blocks import BlockRegions
from tiercache.pd.heads import PageHeads, tp_mismatches

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 << 20
MAX_CONNECTIONS = 256
MAX_PARTIAL_READS = 4096  # hand-offs heard from some, not yet all, consumer ranks of another TP size
TAG_BYTES = 8
_LEN = struct.Struct(">I")
_RECV_BYTES = 64 * 1024
_REPLY_TIMEOUT_S = 2.0
PROGRESS_INTERVAL_S = 0.0002  # busy progress: pause between bursts while hand-offs are held
PROGRESS_BURST_S = 0.002  # busy progress: one burst of back-to-back UCX progress calls


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
    try:
        message = msgspec.msgpack.decode(body)
    except msgspec.DecodeError as exc:
        raise ChannelError(f"malformed side-channel message: {exc}") from exc
    if not isinstance(message, dict):
        raise ChannelError("side-channel message is not a map")
    return message


def recv_message(sock: socket.socket) -> dict[str, Any]:
    (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if size > MAX_MESSAGE_BYTES:
        raise ChannelError(f"side-channel message of {size} bytes exceeds {MAX_MESSAGE_BYTES}")
    return decode_body(_recv_exact(sock, size))


def make_agent(role: str, error_handling: str = "none") -> Any:
    """A NIXL agent with the UCX backend and no NIXL progress thread.

    ``error_handling`` is UCX's error-handling mode (``pd.nixl_error_handling``).
    With ``none`` UCX may pick one-sided transports (CMA/shared memory on one
    host, RDMA): a READ completes without the producer's CPU. With ``peer``
    (NIXL's default) UCX on one host falls back to tcp, where a READ moves only
    while the producer progresses its UCX worker.

    NIXL's progress thread busy-polls a core (its Python API sets no delay); on
    a 2-core machine beside two engines that starves everything else. The
    producer's UCX worker is progressed by :meth:`ProducerEndpoint.service`
    each step (and by its own progress thread when configured), the
    consumer's by its reader thread while it waits.
    """
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"tiercache-{role}-{os.getpid()}-{os.urandom(3).hex()}",
                       nixl_agent_config(backends=[], enable_prog_thread=False))
    agent.create_backend("UCX", {"ucx_error_handling_mode": error_handling})
    return agent


class ProducerEndpoint:
    """Producer worker: NIXL-registered slab and slot tags, handshakes, read notifications."""

    def __init__(self, slab_addr: int, slot_bytes: int, num_slots: int,
                 fingerprint: dict[str, Any], host: str, port: int,
                 error_handling: str = "none", busy_progress: bool = False,
                 blocks: BlockRegions | None = None, slot_planes: BlockRegions | None = None,
                 page_heads: PageHeads | None = None) -> None:
        self.slab_addr, self.slot_bytes, self.num_slots = slab_addr, slot_bytes, num_slots
        # our pages by KV head: consumers of another TP size read their heads' sub-runs (pd_heads)
        self.page_heads = page_heads
        self.slot_planes = slot_planes  # a planes slab's planes (inside the slab), else None
        self.fingerprint = fingerprint
        self.tags = np.zeros(num_slots, dtype=np.uint64)  # written by this worker thread only
        self.agent = make_agent("producer", error_handling)
        self._reg = self.agent.register_memory(
            [(slab_addr, slot_bytes * num_slots, 0, ""), (int(self.tags.ctypes.data), self.tags.nbytes, 0, "")],
            "DRAM")
        self.agent_name: str = self.agent.name
        self._listener = socket.create_server((host, port))
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()  # close() wakes the side-channel thread
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._inbox: dict[socket.socket, bytearray] = {}
        self.address = f"{host}:{port}"
        self.counters = {"hellos": 0, "refused": 0, "bad_messages": 0}
        self._agent_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._read: set[str] = set()
        # another TP size: a request read by several consumer ranks, the ranks heard so far
        self._partial: dict[str, set[int]] = {}
        self._holding = threading.Event()
        self._closed = False
        # mode direct: the engine's KV blocks, one tag per block, blocks held per request
        self.blocks: BlockRegions | None = None
        self.block_tags = np.zeros(0, dtype=np.uint64)  # written by this worker thread only
        self._block_reg: Any = None
        self._block_tags_reg: Any = None
        self._held_blocks: dict[str, list[int]] = {}
        if blocks is not None:
            self._expose_blocks(blocks)  # before the side channel answers anyone
        self._progress: threading.Thread | None = None
        if busy_progress:
            self._progress = threading.Thread(target=self._progress_loop, name="tiercache-pd-progress", daemon=True)
            self._progress.start()
        self._serving = threading.Thread(target=self._serve_loop, name="tiercache-pd-side-channel", daemon=True)
        self._serving.start()
        logger.info("tiercache P/D producer: side channel on %s, NIXL agent %s", self.address, self.agent_name)

    # -------------------------------------------------------------- slot tags
    def slot_filling(self, slots: Sequence[int]) -> None:
        """Copies into ``slots`` start: whatever they held is no longer readable."""
        for slot in slots:
            self.tags[slot] = 0

    def slot_filled(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """The copies of ``keys`` into ``slots`` finished: they may be read."""
        for key, slot in zip(keys, slots):
            self.tags[slot] = key_tag(key)

    # ----------------------------------------------------- mode direct: blocks
    def _expose_blocks(self, blocks: BlockRegions) -> None:
        """Mode direct: register the engine's KV blocks (and one tag per block) for consumers' READs."""
        self.blocks = blocks
        self.block_tags = np.zeros(blocks.num_blocks, dtype=np.uint64)
        self._block_reg = self.agent.register_memory(blocks.spans(), blocks.mem_type)
        self._block_tags_reg = self.agent.register_memory(
            [(int(self.block_tags.ctypes.data), self.block_tags.nbytes, 0, "")], "DRAM")

    def hold_blocks(self, request_id: str, keys: Sequence[bytes], blocks_per_key: Sequence[Sequence[int]]) -> None:
        """A request's blocks are handed off (vLLM keeps them until :meth:`release_blocks`)."""
        self.release_blocks(request_id)  # marked again (other blocks): the old marks go
        held: list[int] = []
        for key, blocks in zip(keys, blocks_per_key):
            tag = key_tag(key)
            for block in blocks:
                self.block_tags[block] = tag
                held.append(block)
        self._held_blocks[request_id] = held

    def release_blocks(self, request_id: str) -> bool:
        """The hand-off ended (read or expired): its blocks are no longer readable.

        True when the request held blocks here (the worker then reports them
        cleared, and the scheduler unpins them: connector/block_pins.py).
        """
        held = self._held_blocks.pop(request_id, None)
        if held is None:
            return False
        self.block_tags[held] = 0
        return True

    # ------------------------------------------------------------- each step
    def set_holding(self, holding: bool) -> None:
        """Hand-offs are held (consumers may READ now): keep the producer's UCX progressed."""
        if holding:
            self._holding.set()
        else:
            self._holding.clear()

    def service(self) -> set[str]:
        """Progress UCX; the producer request ids consumers reported read since last time."""
        self._progress_ucx()
        with self._read_lock:
            out, self._read = self._read, set()
        return out

    def _serve_loop(self) -> None:
        """The side-channel thread: handshakes are answered at once, engine steps or not."""
        while not self._closed:
            try:
                events = self._selector.select(timeout=1.0)
            except (OSError, ValueError):
                return  # closed under us
            for sel_key, _ in events:
                if sel_key.fileobj is self._wake_r:
                    return
                if sel_key.fileobj is self._listener:
                    self._accept()
                else:
                    self._receive(sel_key.fileobj)  # type: ignore[arg-type]

    def _progress_loop(self) -> None:
        """tcp transports: move consumers' READs between engine steps while hand-offs are held."""
        while not self._closed:
            if not self._holding.wait(timeout=0.5):
                continue
            # Progress in bursts: a thread that gives up the GIL after every call gets it
            # back only every switch interval (5 ms) beside the worker's spinning loop.
            burst_end = time.monotonic() + PROGRESS_BURST_S
            while time.monotonic() < burst_end:
                self._progress_ucx()
            time.sleep(PROGRESS_INTERVAL_S)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                logger.warning("tiercache P/D: accept on %s failed", self.address, exc_info=True)
                return
            if len(self._inbox) >= MAX_CONNECTIONS:
                conn.close()
                continue
            conn.setblocking(False)
            self._inbox[conn] = bytearray()
            self._selector.register(conn, selectors.EVENT_READ, None)

    def _receive(self, conn: socket.socket) -> None:
        buf = self._inbox[conn]
        try:
            part = conn.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            part = b""
        if not part:
            self._drop(conn)
            return
        buf += part
        try:
            while len(buf) >= _LEN.size:
                (size,) = _LEN.unpack_from(buf)
                if size > MAX_MESSAGE_BYTES:
                    raise ChannelError(f"message of {size} bytes exceeds {MAX_MESSAGE_BYTES}")
                if len(buf) < _LEN.size + size:
                    return
                body = bytes(buf[_LEN.size:_LEN.size + size])
                del buf[:_LEN.size + size]
                answer = self._answer(decode_body(body))
                if answer is None:
                    continue  # a one-way message
                conn.settimeout(_REPLY_TIMEOUT_S)  # a few KiB: fits the socket buffer at once
                conn.sendall(encode_message(answer))
                conn.setblocking(False)
        except (ChannelError, OSError) as exc:
            self.counters["bad_messages"] += 1
            logger.warning("tiercache P/D: side channel %s: dropping a connection: %s", self.address, exc)
            self._drop(conn)
        except Exception as exc:  # noqa: BLE001 - a peer's garbage must not end the side channel
            self.counters["bad_messages"] += 1
            faults.record(faults.READER_EXCEPTION, exc, where=f"pd side channel {self.address}")
            self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        self._inbox.pop(conn, None)
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _answer(self, message: dict[str, Any]) -> dict[str, Any] | None:
        op = message.get("op")
        if op == "read":
            rid = message.get("request_id")
            if not isinstance(rid, str):
                raise ChannelError("read message without a request id")
            readers, rank = message.get("readers", 1), message.get("rank", 0)
            if not (isinstance(readers, int) and isinstance(rank, int) and 1 <= readers <= 4096):
                raise ChannelError("read message with a bad reader count or rank")
            with self._read_lock:
                if readers == 1:
                    self._read.add(rid)
                else:  # consumer of another TP size: every consumer rank that reads us must have read
                    heard = self._partial.setdefault(rid, set())
                    heard.add(rank)
                    if len(heard) >= readers:
                        del self._partial[rid]
                        self._read.add(rid)
                    while len(self._partial) > MAX_PARTIAL_READS:  # a rank that never read: its hold expires
                        del self._partial[next(iter(self._partial))]
            return None  # one-way: the consumer does not wait
        if op != "hello":
            return {"ok": False, "error": f"unknown op {op!r}"}
        theirs = message.get("fingerprint")
        diff = tp_mismatches(self.fingerprint, theirs if isinstance(theirs, dict) else {}, we_produce=True)
        if diff:
            self.counters["refused"] += 1
            return {"ok": False, "error": "incompatible peer: " + "; ".join(diff)}
        self.counters["hellos"] += 1
        with self._agent_lock:
            metadata = self.agent.get_agent_metadata()
        answer = {"ok": True, "agent": self.agent_name, "metadata": metadata,
                  "fingerprint": self.fingerprint, "slab_addr": self.slab_addr,
                  "slot_bytes": self.slot_bytes, "num_slots": self.num_slots,
                  "tags_addr": int(self.tags.ctypes.data)}
        if self.slot_planes is not None:
            answer["slot_planes"] = self.slot_planes.to_wire()
        if self.page_heads is not None:
            answer["page_heads"] = self.page_heads.to_wire()
        if self.blocks is not None:
            answer["blocks"] = self.blocks.to_wire()
            answer["block_tags_addr"] = int(self.block_tags.ctypes.data)
        return answer

    def _progress_ucx(self) -> None:
        """One round of this agent's UCX worker (read notices come over the side channel instead)."""
        try:
            with self._agent_lock:
                self.agent.get_new_notifs()  # the Python API's way to progress the UCX worker
        except Exception:  # noqa: BLE001 - a NIXL hiccup must not end the producer
            logger.warning("tiercache P/D: progressing UCX failed", exc_info=True)

    def close(self) -> None:
        self._closed = True
        self._holding.set()
        if self._progress is not None:
            self._progress.join(timeout=2)
        self._wake_w.send(b"x")
        self._serving.join(timeout=5)
        for conn in list(self._inbox):
            self._drop(conn)
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
        for reg in (self._reg, self._block_reg, self._block_tags_reg):
            if reg is None:
                continue
            try:
                self.agent.deregister_memory(reg)
            except Exception:  # noqa: BLE001
                logger.debug("tiercache P/D: deregistering memory failed", exc_info=True)


class PeerLink:
    """Consumer: the handshake with one producer rank (its agent added to ours)."""

    def __init__(self, host: str, port: int, fingerprint: dict[str, Any], agent: Any, timeout_s: float) -> None:
        self.address = f"{host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise ChannelError(f"producer {self.address} unreachable: {exc}") from exc
        self._sock = sock  # kept open: read notices go over it
        try:
            metadata = self._hello(fingerprint)
        except ChannelError:
            sock.close()
            raise
        name = agent.add_remote_agent(metadata)
        self.agent_name = name.decode() if isinstance(name, bytes) else str(name)

    def _hello(self, fingerprint: dict[str, Any]) -> bytes:
        """The handshake: check the producer's answer, keep its addresses; its agent metadata."""
        try:
            send_message(self._sock, {"op": "hello", "fingerprint": fingerprint})
            reply = recv_message(self._sock)
        except (OSError, ChannelError) as exc:
            raise ChannelError(f"producer {self.address}: hello: {exc}") from exc
        if not reply.get("ok"):
            raise ChannelError(f"producer {self.address} refused us: {reply.get('error')}")
        diff = tp_mismatches(fingerprint, reply.get("fingerprint") or {})
        if diff:
            raise ChannelError(f"producer {self.address} is incompatible: " + "; ".join(diff))
        try:
            self.slab_addr = int(reply["slab_addr"])
            self.slot_bytes = int(reply["slot_bytes"])
            self.num_slots = int(reply["num_slots"])
            self.tags_addr = int(reply["tags_addr"])
            # a planes slab: where each region's plane of host blocks lies (absent: slots)
            self.slot_planes = BlockRegions.from_wire(reply["slot_planes"]) if "slot_planes" in reply else None
            # mode direct: the producer's KV blocks and their tags (absent when it exposes none)
            self.blocks = BlockRegions.from_wire(reply["blocks"]) if "blocks" in reply else None
            self.block_tags_addr = int(reply.get("block_tags_addr", 0))
            # its pages by KV head (a consumer of another TP size reads head sub-runs; absent: unknown)
            self.page_heads = PageHeads.from_wire(reply["page_heads"]) if "page_heads" in reply else None
            return bytes(reply["metadata"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ChannelError(f"producer {self.address}: malformed hello answer: {exc!r}") from exc

    def notify_read(self, request_id: str, rank: int = 0, readers: int = 1) -> None:
        """Tell the producer its hand-off ``request_id`` was read (one-way; it releases the chunks).

        ``readers`` > 1 (a consumer of another TP size): that many consumer ranks read this
        producer rank; it counts the hand-off read once each (``rank``) has said so.
        """
        message: dict[str, Any] = {"op": "read", "request_id": request_id}
        if readers > 1:
            message.update(rank=rank, readers=readers)
        try:
            self._sock.settimeout(_REPLY_TIMEOUT_S)
            send_message(self._sock, message)
        except OSError as exc:
            raise ChannelError(f"producer {self.address}: read notification: {exc}") from exc

    def close(self) -> None:
        self._sock.close()
