"""The producer worker's end of the P/D side channel: registered slab and tags, handshakes, read notices.

:class:`ProducerEndpoint` registers the producer's host slab (and, mode
direct, its KV blocks) with a NIXL agent, with one tag per slot (or block)
beside it (the tags' meaning: :mod:`tiercache.pd.channel`), and answers the
side channel (:class:`tiercache.pd.side_channel.SideChannel`: bounded
connections, mutual authentication with ``pd.secret`` first): an
authenticated consumer's hello gets the addresses it READs from, and its read
notice, carrying the hand-off's release token (:func:`tiercache.pd.auth.release_token`
under the release key the scheduler sends each step, :meth:`set_release_key`),
tells the worker to release that hand-off; a notice with another token is
counted (``forged_notices``) and ignored. Mode via_host also publishes, beside
each slot's tag, one xxh3-64 per chunk position (:mod:`tiercache.pd.page_hashes`),
computed when the copy into the slot finished, before the tag names the chunk.

The side-channel thread answers handshakes and records read notices at once
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
tag and hash arrays, and the release key: one reference, replaced whole); the
side-channel thread owns the sockets and reads only fields fixed before it
serves (``blocks``, the arrays' addresses) and the release key; the progress
thread only progresses UCX. The NIXL agent's calls from more than one thread
are serialised by ``_agent_lock``, the read request ids by ``_read_lock``.
Buffers: the slab and the KV blocks belong to the worker; this object
registers them and deregisters them at :meth:`close`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from tiercache.config.pd import is_loopback
from tiercache.config.schema import ConfigError
from tiercache.pd import auth
from tiercache.pd.blocks import BlockRegions
from tiercache.pd.channel import ChannelError, key_tag, make_agent
from tiercache.pd.heads import PageHeads, tp_mismatches
from tiercache.pd.page_hashes import positions_of, slot_hashes
from tiercache.pd.side_channel import ChannelLimits, SideChannel

logger = logging.getLogger(__name__)

MAX_PARTIAL_READS = 4096  # hand-offs heard from some, not yet all, consumer ranks of another TP size
PROGRESS_INTERVAL_S = 0.0002  # busy progress: pause between bursts while hand-offs are held
PROGRESS_BURST_S = 0.002  # busy progress: one burst of back-to-back UCX progress calls


class ProducerEndpoint:
    """Producer worker: NIXL-registered slab and slot tags, handshakes, read notifications."""

    def __init__(self, slab_addr: int, slot_bytes: int, num_slots: int,
                 fingerprint: dict[str, Any], host: str, port: int,
                 error_handling: str = "none", busy_progress: bool = False,
                 blocks: BlockRegions | None = None, slot_planes: BlockRegions | None = None,
                 page_heads: PageHeads | None = None, *, key: bytes = b"",
                 limits: ChannelLimits = ChannelLimits(), pages: Sequence[int] | None = None) -> None:
        """``key``: the shared secret (empty: none, and ``host`` must be loopback, else ConfigError);
        ``pages``: per KV region, one page's bytes (slot positions are hashed; planes give their own)."""
        if not key and not is_loopback(host):
            raise ConfigError(f"pd.secret: required when pd.host ({host}) is not a loopback address")
        self.slab_addr, self.slot_bytes, self.num_slots = slab_addr, slot_bytes, num_slots
        # our pages by KV head: consumers of another TP size read their heads' sub-runs (tiercache.pd.heads)
        self.page_heads = page_heads
        self.slot_planes = slot_planes  # a planes slab's planes (inside the slab), else None
        self.fingerprint = fingerprint
        self.tags = np.zeros(num_slots, dtype=np.uint64)  # written by this worker thread only
        # one hash per slot position (tiercache.pd.page_hashes), when the pages are known
        self._pages = tuple(slot_planes.pages) if slot_planes is not None else tuple(pages or ())
        self.hash_positions = positions_of(slot_bytes, self._pages) if self._pages else 0
        self.hashes = np.zeros(max(1, num_slots * self.hash_positions), dtype=np.uint64)
        self.agent = make_agent("producer", error_handling)
        self._reg = self.agent.register_memory(
            [(slab_addr, slot_bytes * num_slots, 0, ""), (int(self.tags.ctypes.data), self.tags.nbytes, 0, ""),
             (int(self.hashes.ctypes.data), self.hashes.nbytes, 0, "")],
            "DRAM")
        self.agent_name: str = self.agent.name
        self.address = f"{host}:{port}"
        self.counters = {"hellos": 0, "refused": 0, "forged_notices": 0}  # the side channel's: self.channel.counters
        self._release_key: bytes | None = None  # set by the worker from the step metadata
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
        self.channel = SideChannel(host, port, key, limits, self._answer_hello, self._on_read)
        self.channel.start()
        logger.info("tiercache P/D producer: side channel on %s, NIXL agent %s", self.address, self.agent_name)

    # -------------------------------------------------------------- slot tags
    def slot_filling(self, slots: Sequence[int]) -> None:
        """Copies into ``slots`` start: whatever they held is no longer readable."""
        for slot in slots:
            self.tags[slot] = 0

    def slot_filled(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """The copies of ``keys`` into ``slots`` finished: their hashes, then their tags (they may be read)."""
        n = self.hash_positions
        for key, slot in zip(keys, slots):
            if n:
                self.hashes[slot * n:(slot + 1) * n] = slot_hashes(slot, self.slab_addr, self.slot_bytes,
                                                                   self._pages, self.slot_planes)
            self.tags[slot] = key_tag(key)

    def set_release_key(self, release_key: bytes) -> None:
        """The scheduler's release key (tiercache.pd.auth): read notices must carry its token for the request."""
        if release_key:
            self._release_key = release_key

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
                if block < 0:  # NO_BLOCK: a hybrid model's position the producer holds nothing for
                    continue
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

    def _on_read(self, message: dict[str, Any]) -> None:
        """Side-channel thread: an authenticated consumer's read notice; released if its token is right."""
        rid, token = message.get("request_id"), message.get("token")
        if not isinstance(rid, str) or len(rid) > 1024:
            raise ChannelError("read message without a request id")
        readers, rank = message.get("readers", 1), message.get("rank", 0)
        if not (isinstance(readers, int) and isinstance(rank, int) and 1 <= readers <= 4096):
            raise ChannelError("read message with a bad reader count or rank")
        if not auth.token_matches(self._release_key, rid, token):
            self.counters["forged_notices"] += 1
            if self.counters["forged_notices"] in (1, 10, 100) or self.counters["forged_notices"] % 1000 == 0:
                logger.warning("tiercache P/D: %s: %d read notices without their hand-off's release token "
                               "ignored (hand-offs stay held until read or expired)", self.address,
                               self.counters["forged_notices"])
            return
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

    def _answer_hello(self, theirs: Any) -> dict[str, Any]:
        """Side-channel thread, an authenticated consumer's fingerprint: the addresses to READ, or a refusal.

        A refusal names the differing fields, not their values (this log line has both).
        """
        diff = tp_mismatches(self.fingerprint, theirs if isinstance(theirs, dict) else {}, we_produce=True)
        if diff:
            self.counters["refused"] += 1
            logger.warning("tiercache P/D: %s: refusing an incompatible consumer: %s", self.address, "; ".join(diff))
            fields = sorted({line.split(":", 1)[0] for line in diff})
            return {"ok": False, "error": "incompatible peer: differing fields: " + ", ".join(fields)}
        self.counters["hellos"] += 1
        with self._agent_lock:
            metadata = self.agent.get_agent_metadata()
        answer = {"ok": True, "agent": self.agent_name, "metadata": metadata,
                  "fingerprint": self.fingerprint, "slab_addr": self.slab_addr,
                  "slot_bytes": self.slot_bytes, "num_slots": self.num_slots,
                  "tags_addr": int(self.tags.ctypes.data)}
        if self.hash_positions:
            answer.update(hashes_addr=int(self.hashes.ctypes.data), hash_positions=self.hash_positions)
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
        except Exception:
            logger.warning("tiercache P/D: progressing UCX failed", exc_info=True)

    def close(self) -> None:
        self._closed = True
        self._holding.set()
        if self._progress is not None:
            self._progress.join(timeout=2)
        self.channel.close()
        for reg in (self._reg, self._block_reg, self._block_tags_reg):
            if reg is None:
                continue
            try:
                self.agent.deregister_memory(reg)
            except Exception:
                logger.debug("tiercache P/D: deregistering memory failed", exc_info=True)
