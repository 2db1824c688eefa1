"""The P/D producer seen from a consumer: a read-only tier whose chunks are NIXL READs.

Not configured by users: the consumer's worker (connector/worker.py) creates
one when its kv_role is ``kv_consumer`` (or ``kv_both`` with a ``pd``
section) and registers it in TierIO under the tier name ``peer``. The
scheduler plans a load from this tier like any staged load (producer slot ->
consumer host slot -> device blocks); the metadata of that step names, per
key, which producer holds it and in which of its host slots (:meth:`expect`).

A get, on this backend's I/O thread, per producer: handshake once
(:class:`tiercache.pd_channel.PeerLink`; a producer with a different model,
dtype, layout or chunk size is refused, naming the difference), then NIXL
only: read the slots' tags until they name the keys (the producer's copies
are complete), one READ of all the chunks into the consumer's host slots,
the tags again (a slot re-filled meanwhile drops its chunk), and a
notification naming the producer's request so it releases the chunks.
Anything that goes wrong (dead producer, refusal, timeout, a transfer error)
fails the keys: the engine recomputes.

Buffers: the consumer's host slab and a small tag buffer are registered with
this backend's NIXL agent once, at construction; views handed to
``submit_get`` lie inside the slab and are written only by the READ of their
own job.

Threads: submit/poll/expect/close from the worker thread; everything NIXL and
socket on the one I/O thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiercache.backend import Backend, JobResult
from tiercache.handoff import NOTIF_PREFIX
from tiercache.pd_channel import TAG_BYTES, ChannelError, PeerLink, key_tag, make_agent

logger = logging.getLogger(__name__)

PEER_TIER = "peer"
_HELLO_ATTEMPT_S = 1.0
_TAG_POLL_S = 0.001
_POLL_BURST_S = 0.002
Desc = tuple[int, int, int]


@dataclass(frozen=True)
class PeerSource:
    """Which producer handed a request's chunks off: its side channel and its request id."""

    host: str
    port: int
    request_id: str


@dataclass(frozen=True)
class PeerChunk:
    """One handed-off chunk: its producer and the producer's host slot holding it."""

    source: PeerSource
    slot: int


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class NixlPeerTier(Backend):
    name = "nixl_peer"

    def __init__(self, slab_addr: int, slab_bytes: int, chunk_bytes: int,
                 fingerprint: dict[str, Any], rank: int, read_timeout_s: float) -> None:
        self.chunk_bytes = chunk_bytes
        self.fingerprint = fingerprint
        self.rank = rank
        self.read_timeout_s = read_timeout_s
        self.agent = make_agent("consumer")
        # one tag per chunk of the largest possible job (a job stages into host slots)
        self._tags = np.zeros(max(1, slab_bytes // chunk_bytes), dtype=np.uint64)
        self._reg = self.agent.register_memory(
            [(slab_addr, slab_bytes, 0, ""), (int(self._tags.ctypes.data), self._tags.nbytes, 0, "")], "DRAM")
        self._chunks: dict[bytes, PeerChunk] = {}
        self._links: dict[tuple[str, int], PeerLink] = {}
        self._refused: dict[tuple[str, int], str] = {}
        self._jobs: queue.Queue[tuple[int, list[bytes], list[memoryview], dict[bytes, PeerChunk]] | None] = queue.Queue()
        self._done: list[JobResult] = []
        self._lock = threading.Lock()
        self.counters = {"read_chunks": 0, "read_bytes": 0, "failed_chunks": 0, "refused_peers": 0,
                         "hello_retries": 0, "stale_chunks": 0}
        self._thread = threading.Thread(target=self._run, name="tiercache-pd-reader", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ worker thread
    def expect(self, chunks: dict[bytes, PeerChunk]) -> None:
        """Which producer slot holds each key the next loads read from this tier."""
        self._chunks.update(chunks)

    def submit_get(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        chunks = {k: self._chunks.pop(k) for k in keys if k in self._chunks}
        self._jobs.put((job_id, list(keys), list(views), chunks))

    def submit_put(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        with self._lock:  # a producer is read-only
            self._done.append(JobResult(job_id, (), tuple(keys), 0, 0.0))

    def poll(self) -> list[JobResult]:
        with self._lock:
            out, self._done = self._done, []
        return out

    def delete(self, keys: Sequence[bytes]) -> None:
        return None  # the producer releases its own chunks (notification or timeout)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=self.read_timeout_s + 5)
        try:
            self.agent.deregister_memory(self._reg)
        except Exception:  # noqa: BLE001
            logger.debug("tiercache P/D: deregistering the consumer slab failed", exc_info=True)

    # ---------------------------------------------------------------- I/O thread
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job_id, keys, views, chunks = job
            start = time.perf_counter()
            ok: list[bytes] = []
            by_peer: dict[PeerSource, list[int]] = {}
            for i, key in enumerate(keys):
                chunk = chunks.get(key)
                if chunk is not None:
                    by_peer.setdefault(chunk.source, []).append(i)
            for src, idx in by_peer.items():
                for lo in range(0, len(idx), len(self._tags)):
                    part = idx[lo:lo + len(self._tags)]
                    ok.extend(self._read(src, [keys[i] for i in part], [views[i] for i in part],
                                         [chunks[keys[i]].slot for i in part]))
            ok_set = set(ok)
            failed = tuple(k for k in keys if k not in ok_set)
            moved = len(ok) * self.chunk_bytes
            self.counters["read_chunks"] += len(ok)
            self.counters["read_bytes"] += moved
            self.counters["failed_chunks"] += len(failed)
            with self._lock:
                self._done.append(JobResult(job_id, tuple(ok), failed, moved, time.perf_counter() - start))

    def _link(self, src: PeerSource) -> PeerLink:
        addr = (src.host, src.port + self.rank)
        if addr in self._refused:
            raise ChannelError(self._refused[addr])
        link = self._links.get(addr)
        if link is None:
            link = self._connect(addr)
            self._links[addr] = link
        return link

    def _connect(self, addr: tuple[str, int]) -> PeerLink:
        """Handshake with a producer, retrying short attempts until ``read_timeout_s``.

        A producer answers between its engine steps, so a handshake that lands
        in a long forward pass waits for it; a dead producer is retried until
        the deadline (it may be restarting).
        """
        deadline = time.monotonic() + self.read_timeout_s
        while True:
            attempt_s = min(_HELLO_ATTEMPT_S, max(0.05, deadline - time.monotonic()))
            try:
                return PeerLink(addr[0], addr[1], self.fingerprint, self.agent, attempt_s)
            except ChannelError as exc:
                if "refused us" in str(exc) or "incompatible" in str(exc):
                    self._refused[addr] = str(exc)
                    self.counters["refused_peers"] += 1
                    logger.error("tiercache P/D: %s", exc)
                    raise
                if time.monotonic() >= deadline:
                    raise
            self.counters["hello_retries"] += 1
            time.sleep(0.05)

    def _read(self, src: PeerSource, keys: list[bytes], views: list[memoryview], slots: list[int]) -> list[bytes]:
        """NIXL READ of ``keys`` from one producer's ``slots`` into ``views``; the keys that arrived."""
        start = time.monotonic()
        try:
            link = self._link(src)
            if any(not 0 <= s < link.num_slots for s in slots):
                raise ChannelError(f"producer {link.address}: hand-off names a slot outside its {link.num_slots}")
            expected = [key_tag(k) for k in keys]
            ready = self._await_tags(link, slots, expected, start + self.read_timeout_s)
            if not any(ready):
                logger.warning("tiercache P/D: %s holds none of %d chunks (released or expired?)",
                               link.address, len(keys))
                self._notify(link, src)
                return []
            idx = [i for i, r in enumerate(ready) if r]
            t_tags = time.monotonic()
            local = [(_address(views[i]), self.chunk_bytes, 0) for i in idx]
            remote = [(link.slab_addr + slots[i] * link.slot_bytes, self.chunk_bytes, 0) for i in idx]
            if not self._transfer(link, local, remote, start + self.read_timeout_s):
                raise ChannelError(f"producer {link.address}: READ failed or timed out")
            t_data = time.monotonic()
            still = self._read_tags(link, [slots[i] for i in idx], start + self.read_timeout_s)
            arrived = [keys[i] for i, tag in zip(idx, still) if tag == expected[i]]
            self.counters["stale_chunks"] += len(idx) - len(arrived)
            self._notify(link, src)
            logger.debug("tiercache P/D: %d chunks from %s: handshake+tags %.1f ms, READ %.1f ms, "
                         "tags+notify %.1f ms", len(arrived), link.address, (t_tags - start) * 1e3,
                         (t_data - t_tags) * 1e3, (time.monotonic() - t_data) * 1e3)
            return arrived
        except (ChannelError, OSError) as exc:
            logger.warning("tiercache P/D: %d chunks from %s:%d not read after %.2fs: %s: %s", len(keys),
                           src.host, src.port, time.monotonic() - start, type(exc).__name__, exc)
            self._drop_link(src)
            return []

    def _await_tags(self, link: PeerLink, slots: list[int], expected: list[int], deadline: float) -> list[bool]:
        """Per slot: does its tag name the expected key (waiting for copies in flight)."""
        while True:
            tags = self._read_tags(link, slots, deadline)
            ready = [t == e for t, e in zip(tags, expected)]
            if all(ready) or time.monotonic() >= deadline:
                return ready
            time.sleep(_TAG_POLL_S)

    def _read_tags(self, link: PeerLink, slots: list[int], deadline: float) -> list[int]:
        base = int(self._tags.ctypes.data)
        local = [(base + i * TAG_BYTES, TAG_BYTES, 0) for i in range(len(slots))]
        remote = [(link.tags_addr + s * TAG_BYTES, TAG_BYTES, 0) for s in slots]
        self._tags[: len(slots)] = 0
        if not self._transfer(link, local, remote, deadline):
            raise ChannelError(f"producer {link.address}: reading slot tags failed or timed out")
        return [int(t) for t in self._tags[: len(slots)]]

    def _notify(self, link: PeerLink, src: PeerSource) -> None:
        """Tell the producer this request's chunks were read (it releases them)."""
        try:
            self.agent.send_notif(link.agent_name, NOTIF_PREFIX + src.request_id.encode())
        except Exception:  # noqa: BLE001 - the hold then expires on the producer
            logger.warning("tiercache P/D: notifying %s failed", link.address, exc_info=True)

    def _transfer(self, link: PeerLink, local: list[Desc], remote: list[Desc], deadline: float) -> bool:
        agent, handle = self.agent, None
        try:
            handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"),
                                           agent.get_xfer_descs(remote, "DRAM"), link.agent_name)
            state = agent.transfer(handle)
            yield_at = time.monotonic() + _POLL_BURST_S
            while state not in ("DONE", "ERR"):
                now = time.monotonic()
                if now > deadline:
                    logger.warning("tiercache P/D: READ from %s timed out", link.address)
                    return False  # the handle is released below
                if now >= yield_at:
                    # Poll in bursts: a thread that yields the GIL after every call gets it
                    # back only every switch interval (5 ms) beside vLLM's spinning worker.
                    time.sleep(0)
                    yield_at = time.monotonic() + _POLL_BURST_S
                state = agent.check_xfer_state(handle)
            return state == "DONE"
        except Exception:  # noqa: BLE001 - a transfer error fails the keys, never the engine
            logger.warning("tiercache P/D: READ from %s failed", link.address, exc_info=True)
            return False
        finally:
            if handle is not None:
                try:
                    agent.release_xfer_handle(handle)
                except Exception:  # noqa: BLE001
                    logger.debug("tiercache P/D: releasing a transfer handle failed", exc_info=True)

    def _drop_link(self, src: PeerSource) -> None:
        addr = (src.host, src.port + self.rank)
        link = self._links.pop(addr, None)
        if link is not None:
            try:
                self.agent.remove_remote_agent(link.agent_name)
            except Exception:  # noqa: BLE001
                logger.debug("tiercache P/D: removing agent %s failed", link.agent_name, exc_info=True)
