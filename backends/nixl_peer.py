"""The P/D producer seen from a consumer: a read-only tier whose chunks are NIXL READs.

Not configured by users: the consumer's worker (connector/worker.py) creates
one when its kv_role is ``kv_consumer`` (or ``kv_both`` with a ``pd``
section) and registers it in TierIO under the tier name ``peer``. The
scheduler plans a load from this tier like any staged load (producer slot ->
consumer host slot -> device blocks); the metadata of that step names, per
key, which producer holds it (:meth:`expect`).

A get, on this backend's I/O thread, per producer: connect and handshake once
(:class:`tiercache.pd_channel.PeerLink`; a producer with a different model,
dtype, layout or chunk size is refused, naming the difference), ask where the
keys are (waiting up to ``read_timeout_s`` for the producer's copies to
finish), then one NIXL READ of all of them from the producer's host slab into
the consumer's host slots, with a notification naming the producer's request
so it can release the chunks. Anything that goes wrong (dead producer,
refusal, timeout, a transfer error) fails the keys: the engine recomputes.

Buffers: the consumer's host slab is registered with this backend's NIXL
agent once, at construction; views handed to ``submit_get`` lie inside it and
are written only by the READ of their own job.

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
from tiercache.pd_channel import ChannelError, PeerLink, make_agent

logger = logging.getLogger(__name__)

PEER_TIER = "peer"
_HELLO_ATTEMPT_S = 1.0


@dataclass(frozen=True)
class PeerSource:
    """Where one handed-off chunk lives: the producer's side channel and its request."""

    host: str
    port: int
    request_id: str


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
        self._reg = self.agent.register_memory([(slab_addr, slab_bytes, 0, "")], "DRAM")
        self._sources: dict[bytes, PeerSource] = {}
        self._links: dict[tuple[str, int], PeerLink] = {}
        self._refused: dict[tuple[str, int], str] = {}
        self._jobs: queue.Queue[tuple[int, list[bytes], list[memoryview], dict[bytes, PeerSource]] | None] = queue.Queue()
        self._done: list[JobResult] = []
        self._lock = threading.Lock()
        self.counters = {"read_chunks": 0, "read_bytes": 0, "failed_chunks": 0, "refused_peers": 0,
                         "hello_retries": 0}
        self._thread = threading.Thread(target=self._run, name="tiercache-pd-reader", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ worker thread
    def expect(self, sources: dict[bytes, PeerSource]) -> None:
        """Which producer holds each key the next loads read from this tier."""
        self._sources.update(sources)

    def submit_get(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        sources = {k: self._sources.pop(k) for k in keys if k in self._sources}
        self._jobs.put((job_id, list(keys), list(views), sources))

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
        for link in self._links.values():
            link.close()
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
            job_id, keys, views, sources = job
            start = time.perf_counter()
            ok: list[bytes] = []
            by_peer: dict[PeerSource, list[int]] = {}
            for i, key in enumerate(keys):
                src = sources.get(key)
                if src is not None:
                    by_peer.setdefault(src, []).append(i)
            for src, idx in by_peer.items():
                ok.extend(self._read(src, [keys[i] for i in idx], [views[i] for i in idx]))
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

        Short attempts: on this VM a loopback connection to a producer inside a
        vLLM worker process now and then stays unanswered (accepted by the kernel,
        never seen by the producer's accept loop); a fresh connection gets through.
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
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise ChannelError(f"producer {addr[0]}:{addr[1]}: {exc}") from exc
            self.counters["hello_retries"] += 1
            time.sleep(0.05)

    def _read(self, src: PeerSource, keys: list[bytes], views: list[memoryview]) -> list[bytes]:
        """NIXL READ of ``keys`` from one producer into ``views``; the keys that arrived."""
        start = time.monotonic()
        try:
            link = self._link(src)
            slots = link.resolve(keys, self.read_timeout_s)
        except (ChannelError, OSError) as exc:
            logger.warning("tiercache P/D: %d chunks from %s:%d not read after %.2fs: %s: %s", len(keys),
                           src.host, src.port, time.monotonic() - start, type(exc).__name__, exc)
            self._drop_link(src)
            return []
        pairs = [(k, v, s) for k, v, s in zip(keys, views, slots) if s >= 0]
        if len(pairs) < len(keys):
            logger.warning("tiercache P/D: %s holds %d of %d chunks (released or expired?)",
                           link.address, len(pairs), len(keys))
        if not pairs:
            return []
        local = [(_address(v), self.chunk_bytes, 0) for _, v, _ in pairs]
        remote = [(link.slab_addr + s * link.slot_bytes, self.chunk_bytes, 0) for _, _, s in pairs]
        if self._transfer(link, local, remote, NOTIF_PREFIX + src.request_id.encode()):
            return [k for k, _, _ in pairs]
        self._drop_link(src)
        return []

    def _transfer(self, link: PeerLink, local: list[tuple[int, int, int]],
                  remote: list[tuple[int, int, int]], notif: bytes) -> bool:
        agent, handle = self.agent, None
        try:
            handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"),
                                           agent.get_xfer_descs(remote, "DRAM"), link.agent_name, notif)
            state = agent.transfer(handle)
            deadline = time.monotonic() + self.read_timeout_s
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    logger.warning("tiercache P/D: READ from %s timed out", link.address)
                    return False  # the handle is released below
                time.sleep(0)  # let the worker thread run between progress calls
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
            link.close()
            try:
                self.agent.remove_remote_agent(link.agent_name)
            except Exception:  # noqa: BLE001
                logger.debug("tiercache P/D: removing agent %s failed", link.agent_name, exc_info=True)
