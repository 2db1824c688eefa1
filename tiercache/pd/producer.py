"""The producer worker's end of the P/D side channel: registered slab and tags, handshakes, read notices.

:class:`ProducerEndpoint` registers the producer's host slab (and, mode
direct, its KV blocks) with a NIXL agent, with one tag per slot (or block)
beside it (the tags' meaning: :mod:`tiercache.pd.channel`), and answers the
side channel: a consumer's hello gets the addresses it READs from, a
consumer's read notice tells the worker to release that hand-off.

A side-channel thread answers handshakes and records read notices at once
(blocked in ``select`` otherwise), and the worker calls
:meth:`ProducerEndpoint.service` every engine step to collect the request ids
read since (and progress UCX). With UCX error handling ``none`` (the default,
see :func:`tiercache.pd.channel.make_agent`) a consumer's READ needs nothing
from the producer's CPU (one-sided CMA / shared memory on one host), so an
idle producer may stop stepping: what it hears is handled at its next step.
With ``peer`` (tcp on one host) a READ moves only while the producer's UCX
worker is progressed: NIXL's own progress thread spins a whole core even when
idle, so instead, with ``busy_progress`` a small thread progresses UCX every
``PROGRESS_INTERVAL_S`` while hand-offs are held (:meth:`set_holding`) and
sleeps otherwise. Measured on the 2-core VM with ``peer``: a 15.5 MiB READ
took 90-200 ms with progress once per step, 2 ms with continuous progress;
with ``none``, 1-2 ms and no producer involvement at all.

Threads: every public method on the worker thread only (it alone writes the
tag arrays); the side-channel thread owns the sockets and reads only fields
fixed before it serves (``blocks``, the tag arrays' addresses); the progress
thread only progresses UCX. The NIXL agent's calls from more than one thread
are serialised by ``_agent_lock``, the read request ids by ``_read_lock``.
Buffers: the slab and the KV blocks belong to the worker; this object
registers them and deregisters them at :meth:`close`.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from tiercache import faults
from tiercache.pd.blocks import BlockRegions
from tiercache.pd.channel import (
    REPLY_TIMEOUT_S,
    ChannelError,
    decode_body,
    encode_message,
    key_tag,
    make_agent,
    take_body,
)
from tiercache.pd.heads import PageHeads, tp_mismatches

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 256
MAX_PARTIAL_READS = 4096  # hand-offs heard from some, not yet all, consumer ranks of another TP size
_RECV_BYTES = 64 * 1024
PROGRESS_INTERVAL_S = 0.0002  # busy progress: pause between bursts while hand-offs are held
PROGRESS_BURST_S = 0.002  # busy progress: one burst of back-to-back UCX progress calls


class ProducerEndpoint:
    """Producer worker: NIXL-registered slab and slot tags, handshakes, read notifications."""

    def __init__(self, slab_addr: int, slot_bytes: int, num_slots: int,
                 fingerprint: dict[str, Any], host: str, port: int,
                 error_handling: str = "none", busy_progress: bool = False,
                 blocks: BlockRegions | None = None, slot_planes: BlockRegions | None = None,
                 page_heads: PageHeads | None = None) -> None:
        self.slab_addr, self.slot_bytes, self.num_slots = slab_addr, slot_bytes, num_slots
        # our pages by KV head: consumers of another TP size read their heads' sub-runs (tiercache.pd.heads)
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
            while (body := take_body(buf)) is not None:
                answer = self._answer(decode_body(body))
                if answer is None:
                    continue  # a one-way message
                conn.settimeout(REPLY_TIMEOUT_S)  # a few KiB: fits the socket buffer at once
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
