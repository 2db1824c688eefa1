"""The P/D producer seen from a consumer: a read-only tier whose chunks are NIXL READs.

Not configured by users: the consumer's worker (connector/worker.py) creates
one when its kv_role is ``kv_consumer`` (or ``kv_both`` with a ``pd``
section). It serves two tiers of the consumer's manager:

* ``peer`` (producers in mode ``via_host``): registered in TierIO; the
  scheduler plans a staged load (producer host slot -> consumer host slot ->
  device blocks) and :meth:`NixlPeerTier.submit_get` READs the producer's
  slots into the consumer's staging slots;
* ``peer_direct`` (producers in mode ``direct``): a direct tier; the load
  plan gives no host slot and :meth:`NixlPeerTier.submit_blocks` READs the
  producer's KV blocks straight into the consumer's KV blocks (registered by
  :meth:`NixlPeerTier.expose_blocks`), results from :meth:`poll_blocks`.

The metadata of the step names, per key, which producer holds it and where
(:meth:`expect`).

A read, on this backend's I/O thread, per producer: handshake once
(:class:`tiercache.pd_channel.PeerLink`; a producer with a different model,
dtype, layout or chunk size is refused, naming the difference), then NIXL
only: one READ of the data, one READ of the tags guarding it (a slot's or a
block's tag names the chunk while the producer holds it for us). A tag that
names the chunk: arrived. A tag of 0: the producer's copy into that slot is
still running (via_host: read the chunk again) or its worker has not heard of
the hold yet (direct: the blocks are held since the request finished, so the
data read is good; wait for the tag). Another chunk's tag: the slot or
blocks were reused, the chunk is dropped (recomputed, never wrong). Then a
notification naming the producer's request, so it releases the chunks.
Anything that goes wrong (dead producer, refusal, timeout, a transfer error)
fails the keys: the engine recomputes.

Buffers: the consumer's host slab, its KV blocks and a small tag buffer are
registered with this backend's NIXL agent once; views handed to
``submit_get`` lie inside the slab and blocks named by ``submit_blocks`` are
the load's own, written only by the READ of their own job.

Threads: submit/poll/expect/close from the worker thread. A read runs on the
I/O thread, except that with UCX error handling ``none`` (one-sided reads that
cannot hang on the producer) a read from a producer already shaken hands with
is tried inline, on the worker thread: in an engine pinned to one core the
I/O thread shares that core with vLLM's spinning worker loop, and the inline
READ is several times faster (docs/PERFORMANCE.md). If it would have to wait
(a tag not set yet, a handshake, the I/O thread busy) the job goes to the I/O
thread as before. ``_io_lock`` serialises all NIXL and link use.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiercache.backend import Backend, JobResult
from tiercache.device import CopySegment
from tiercache.pd_blocks import BlockRegions, paired_descs
from tiercache.pd_channel import TAG_BYTES, ChannelError, PeerLink, key_tag, make_agent

logger = logging.getLogger(__name__)

PEER_TIER = "peer"
PEER_DIRECT_TIER = "peer_direct"
# transfer-metric paths of the NIXL READs alone (tiercache_transfer_*{path=...}): into the
# consumer's host slots (via_host) or straight into its KV blocks (direct)
PEER_TO_HOST = "peer_to_host"
PEER_TO_DEVICE = "peer_to_device"
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
    """One handed-off chunk: its producer and where the producer holds it.

    Mode via_host: ``slot`` is the producer's host slot. Mode direct: ``slot``
    is -1 and ``blocks`` are the producer's KV blocks of the chunk.
    """

    source: PeerSource
    slot: int
    blocks: tuple[int, ...] = ()


@dataclass
class _Job:
    job_id: int
    keys: list[bytes]
    chunks: dict[bytes, PeerChunk]
    views: list[memoryview] | None = None  # via_host: the consumer's staging slots
    segments: list[CopySegment] | None = None  # direct: the consumer's blocks


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class _MustWait(Exception):
    """An inline read met something to wait for: the I/O thread takes the job instead."""


class NixlPeerTier(Backend):
    name = "nixl_peer"

    def __init__(self, slab_addr: int, slab_bytes: int, chunk_bytes: int,
                 fingerprint: dict[str, Any], rank: int, read_timeout_s: float,
                 error_handling: str = "none", max_blocks: int = 0) -> None:
        self.chunk_bytes = chunk_bytes
        self.fingerprint = fingerprint
        self.rank = rank
        self.read_timeout_s = read_timeout_s
        self.inline = error_handling == "none"
        self._io_lock = threading.Lock()
        self.agent = make_agent("consumer", error_handling)
        # one tag per chunk (via_host) or block (direct) of the largest possible job
        self._tags = np.zeros(max(1, slab_bytes // chunk_bytes, max_blocks), dtype=np.uint64)
        self._regs = [self.agent.register_memory(
            [(slab_addr, slab_bytes, 0, ""), (int(self._tags.ctypes.data), self._tags.nbytes, 0, "")], "DRAM")]
        self.blocks: BlockRegions | None = None
        self._chunks: dict[bytes, PeerChunk] = {}
        self._links: dict[tuple[str, int], PeerLink] = {}
        self._refused: dict[tuple[str, int], str] = {}
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._done: list[JobResult] = []
        self._done_blocks: list[JobResult] = []
        self._transfers: list[tuple[str, int, float]] = []  # (path, bytes, seconds) per READ
        self._lock = threading.Lock()
        self.counters = {"read_chunks": 0, "read_bytes": 0, "failed_chunks": 0, "refused_peers": 0,
                         "hello_retries": 0, "stale_chunks": 0, "inline_jobs": 0}
        self._thread = threading.Thread(target=self._run, name="tiercache-pd-reader", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ worker thread
    def expose_blocks(self, blocks: BlockRegions) -> None:
        """Register the consumer's KV blocks: mode-direct READs land in them."""
        self.blocks = blocks
        self._regs.append(self.agent.register_memory(blocks.spans(), blocks.mem_type))

    def expect(self, chunks: dict[bytes, PeerChunk]) -> None:
        """Where the producers hold each key the next loads read from this tier."""
        self._chunks.update(chunks)

    def _take(self, keys: Sequence[bytes]) -> dict[bytes, PeerChunk]:
        return {k: self._chunks.pop(k) for k in keys if k in self._chunks}

    def submit_get(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        self._submit(_Job(job_id, list(keys), self._take(keys), views=list(views)))

    def submit_blocks(self, job_id: int, keys: Sequence[bytes], segments: Sequence[CopySegment]) -> None:
        """Mode direct: READ ``keys`` from their producers' blocks into ``segments``' blocks."""
        self._submit(_Job(job_id, list(keys), self._take(keys), segments=list(segments)))

    def _submit(self, job: _Job) -> None:
        if not (self.inline and self._run_inline(job)):
            self._jobs.put(job)

    def _run_inline(self, job: _Job) -> bool:
        """Try the job on this (the worker) thread without waiting for anything; False: queue it."""
        if not self._io_lock.acquire(blocking=False):
            return False  # the I/O thread is reading
        try:
            sources = {c.source for c in job.chunks.values()}
            if any((src.host, src.port + self.rank) not in self._links for src in sources):
                return False  # a handshake first: that may wait on the producer
            try:
                self._finish(job, self._run_job(job, wait=False))
            except _MustWait:
                return False
            self.counters["inline_jobs"] += 1
            return True
        finally:
            self._io_lock.release()

    def submit_put(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        with self._lock:  # a producer is read-only
            self._done.append(JobResult(job_id, (), tuple(keys), 0, 0.0))

    def poll(self) -> list[JobResult]:
        with self._lock:
            out, self._done = self._done, []
        return out

    def poll_blocks(self) -> list[JobResult]:
        """Finished :meth:`submit_blocks` jobs."""
        with self._lock:
            out, self._done_blocks = self._done_blocks, []
        return out

    def take_transfers(self) -> list[tuple[str, int, float]]:
        """The NIXL transfers finished since the last call: (path, bytes, seconds) each.

        Seconds run from posting a hand-off's data READ to its tags checked (the
        READs and any re-reads; not the handshake, the notice or the queueing):
        what vLLM's NixlConnector reports as ``nixl_xfer_time_seconds``.
        """
        with self._lock:
            out, self._transfers = self._transfers, []
        return out

    def _record_transfer(self, path: str, num_bytes: int, secs: float) -> None:
        if num_bytes:
            with self._lock:
                self._transfers.append((path, num_bytes, secs))

    def delete(self, keys: Sequence[bytes]) -> None:
        return None  # the producer releases its own chunks (notification or timeout)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=self.read_timeout_s + 5)
        for link in self._links.values():
            link.close()
        for reg in self._regs:
            try:
                self.agent.deregister_memory(reg)
            except Exception:  # noqa: BLE001
                logger.debug("tiercache P/D: deregistering consumer memory failed", exc_info=True)

    # ---------------------------------------------------------------- I/O thread
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._io_lock:
                self._finish(job, self._run_job(job, wait=True))

    def _finish(self, job: _Job, result: JobResult) -> None:
        self.counters["read_chunks"] += len(result.ok_keys)
        self.counters["read_bytes"] += result.bytes
        self.counters["failed_chunks"] += len(result.failed_keys)
        with self._lock:
            (self._done if job.segments is None else self._done_blocks).append(result)

    def _run_job(self, job: _Job, wait: bool) -> JobResult:
        """Read every chunk of ``job`` (``wait`` False: raise _MustWait rather than wait)."""
        start = time.perf_counter()
        ok: list[bytes] = []
        by_peer: dict[PeerSource, list[int]] = {}
        for i, key in enumerate(job.keys):
            chunk = job.chunks.get(key)
            if chunk is not None:
                by_peer.setdefault(chunk.source, []).append(i)
        for src, idx in by_peer.items():
            if job.segments is not None:
                ok.extend(self._read_blocks(src, [job.keys[i] for i in idx], [job.segments[i] for i in idx],
                                            [job.chunks[job.keys[i]] for i in idx], wait))
                continue
            assert job.views is not None
            for lo in range(0, len(idx), len(self._tags)):
                part = idx[lo:lo + len(self._tags)]
                ok.extend(self._read_slots(src, [job.keys[i] for i in part], [job.views[i] for i in part],
                                           [job.chunks[job.keys[i]].slot for i in part], wait))
        ok_set = set(ok)
        failed = tuple(k for k in job.keys if k not in ok_set)
        return JobResult(job.job_id, tuple(ok), failed, self._moved_bytes(job, ok_set),
                         time.perf_counter() - start)

    def _moved_bytes(self, job: _Job, ok: set[bytes]) -> int:
        if job.segments is None:
            return len(ok) * self.chunk_bytes
        per_block = sum(self.blocks.pages) if self.blocks is not None else 0
        return sum(len(seg.block_ids) for key, seg in zip(job.keys, job.segments) if key in ok) * per_block

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
                    self._refuse(addr, str(exc))
                    raise
                if time.monotonic() >= deadline:
                    raise
            self.counters["hello_retries"] += 1
            time.sleep(0.05)

    def _refuse(self, addr: tuple[str, int], why: str) -> None:
        self._refused[addr] = why
        self.counters["refused_peers"] += 1
        logger.error("tiercache P/D: %s", why)

    # ------------------------------------------------------------ via_host reads
    def _read_slots(self, src: PeerSource, keys: list[bytes], views: list[memoryview],
                    slots: list[int], wait: bool = True) -> list[bytes]:
        """READ ``keys`` from one producer's host ``slots`` into ``views``; the keys that arrived."""
        start = time.monotonic()
        deadline = start + self.read_timeout_s
        try:
            link = self._link(src)
            if any(not 0 <= s < link.num_slots for s in slots):
                raise ChannelError(f"producer {link.address}: hand-off names a slot outside its {link.num_slots}")
            expected = [key_tag(k) for k in keys]
            arrived: list[bytes] = []
            pending = list(range(len(keys)))
            rounds = 0
            t0 = time.monotonic()
            while pending:
                rounds += 1
                local = [(_address(views[i]), self.chunk_bytes, 0) for i in pending]
                remote = [(link.slab_addr + slots[i] * link.slot_bytes, self.chunk_bytes, 0) for i in pending]
                self._xfer(link, lambda: self.agent.initialize_xfer(
                    "READ", self.agent.get_xfer_descs(local, "DRAM"),
                    self.agent.get_xfer_descs(remote, "DRAM"), link.agent_name), deadline)
                tags = self._read_tags(link, link.tags_addr, [slots[i] for i in pending], deadline)
                waiting = []
                for i, tag in zip(pending, tags):
                    if tag == expected[i]:
                        arrived.append(keys[i])
                    elif tag == 0:
                        waiting.append(i)  # the producer's copy into the slot still runs: again
                    else:
                        self.counters["stale_chunks"] += 1  # the slot holds another chunk now
                pending = waiting
                if pending:
                    if not wait:
                        raise _MustWait
                    if time.monotonic() >= deadline:
                        logger.warning("tiercache P/D: %d slots of %s never became readable",
                                       len(pending), link.address)
                        break
                    time.sleep(_TAG_POLL_S)
            self._record_transfer(PEER_TO_HOST, len(arrived) * self.chunk_bytes, time.monotonic() - t0)
            self._notify(link, src)
            logger.debug("tiercache P/D: %d/%d chunks from %s in %.1f ms (%d rounds)", len(arrived), len(keys),
                         link.address, (time.monotonic() - start) * 1e3, rounds)
            return arrived
        except (ChannelError, OSError) as exc:
            self._failed(src, len(keys), start, exc)
            return []

    # -------------------------------------------------------------- direct reads
    def _read_blocks(self, src: PeerSource, keys: list[bytes], segments: list[CopySegment],
                     chunks: list[PeerChunk], wait: bool = True) -> list[bytes]:
        """READ ``keys`` from one producer's KV blocks straight into ours; the keys that arrived."""
        start = time.monotonic()
        deadline = start + self.read_timeout_s
        try:
            link = self._link(src)
            theirs = link.blocks
            if theirs is None:
                raise ChannelError(f"producer {link.address} exposes no KV blocks (its pd.mode is not direct)")
            if self.blocks is None:
                raise ChannelError("this consumer's KV blocks are not registered")
            why = self.blocks.mismatch(theirs)
            if why:
                self._refuse((src.host, src.port + self.rank), f"producer {link.address} is incompatible: {why}")
                raise ChannelError(why)
            ours_b: list[int] = []
            theirs_b: list[int] = []
            tag_of_block: list[int] = []
            owner: list[int] = []
            for i, (key, seg, chunk) in enumerate(zip(keys, segments, chunks)):
                src_blocks = chunk.blocks[seg.first_block:seg.first_block + len(seg.block_ids)]
                if len(src_blocks) != len(seg.block_ids):
                    raise ChannelError(f"producer {link.address}: hand-off names too few blocks for a chunk")
                ours_b.extend(seg.block_ids)
                theirs_b.extend(src_blocks)
                tag_of_block.extend([key_tag(key)] * len(src_blocks))
                owner.extend([i] * len(src_blocks))
            if len(theirs_b) > len(self._tags):
                raise ChannelError(f"a hand-off of {len(theirs_b)} blocks exceeds the {len(self._tags)} tags")
            try:
                self.blocks.check_blocks(ours_b)
                theirs.check_blocks(theirs_b)
            except ValueError as exc:
                raise ChannelError(f"producer {link.address}: {exc}") from exc
            local, remote = paired_descs(self.blocks, theirs, ours_b, theirs_b)
            ours_mem = self.blocks.mem_type
            t0 = time.monotonic()
            self._xfer(link, lambda: self.agent.initialize_xfer(
                "READ", self.agent.get_xfer_descs(local, ours_mem), self.agent.get_xfer_descs(remote, theirs.mem_type),
                link.agent_name), deadline)
            t1 = time.monotonic()
            bad = self._await_block_tags(link, theirs_b, tag_of_block, owner, deadline, wait)
            t2 = time.monotonic()
            arrived = [k for i, k in enumerate(keys) if i not in bad]
            moved = sum(len(seg.block_ids) for i, seg in enumerate(segments) if i not in bad)
            self._record_transfer(PEER_TO_DEVICE, moved * sum(self.blocks.pages), t2 - t0)
            self._notify(link, src)
            logger.debug("tiercache P/D: %d/%d chunks (%d blocks) from %s: handshake %.1f ms, READ %.1f ms, "
                         "tags %.1f ms", len(arrived), len(keys), len(theirs_b), link.address, (t0 - start) * 1e3,
                         (t1 - t0) * 1e3, (t2 - t1) * 1e3)
            return arrived
        except (ChannelError, OSError) as exc:
            self._failed(src, len(keys), start, exc)
            return []

    def _await_block_tags(self, link: PeerLink, blocks: list[int], expected: list[int], owner: list[int],
                          deadline: float, wait: bool = True) -> set[int]:
        """After the data READ: the chunks (indices) whose blocks no longer hold them."""
        bad: set[int] = set()
        while True:
            tags = self._read_tags(link, link.block_tags_addr, blocks, deadline)
            waiting = False
            for tag, want, i in zip(tags, expected, owner):
                if tag == 0:
                    waiting = True  # the producer's worker has not heard of the hold yet
                elif tag != want:
                    bad.add(i)  # released and reused: another chunk's blocks now
            if not waiting:
                self.counters["stale_chunks"] += len(bad)
                return bad
            if not wait:
                raise _MustWait
            if time.monotonic() >= deadline:
                raise ChannelError(f"producer {link.address}: the hand-off's blocks were never marked held "
                                   "(expired?)")
            time.sleep(_TAG_POLL_S)

    # ------------------------------------------------------------------ common
    def _read_tags(self, link: PeerLink, tags_addr: int, indices: list[int], deadline: float) -> list[int]:
        base = int(self._tags.ctypes.data)
        local = [(base + i * TAG_BYTES, TAG_BYTES, 0) for i in range(len(indices))]
        remote = [(tags_addr + s * TAG_BYTES, TAG_BYTES, 0) for s in indices]
        self._tags[: len(indices)] = 0
        self._xfer(link, lambda: self.agent.initialize_xfer(
            "READ", self.agent.get_xfer_descs(local, "DRAM"), self.agent.get_xfer_descs(remote, "DRAM"),
            link.agent_name), deadline)
        return [int(t) for t in self._tags[: len(indices)]]

    def _notify(self, link: PeerLink, src: PeerSource) -> None:
        """Tell the producer this request's chunks were read (it releases them).

        Over the side channel, not a NIXL notification: with UCX error handling
        ``none``, NIXL notifications from a consumer were seen to never reach a
        ``vllm serve`` producer (they did reach an offline-engine one; docs/pd.md).
        """
        try:
            link.notify_read(src.request_id)
        except ChannelError:  # the hold then expires on the producer
            logger.warning("tiercache P/D: notifying %s failed", link.address, exc_info=True)

    def _xfer(self, link: PeerLink, make_handle: Callable[[], Any], deadline: float) -> None:
        """Run one NIXL transfer to completion; ChannelError if it fails or passes ``deadline``."""
        agent, handle = self.agent, None
        try:
            handle = make_handle()
            state = agent.transfer(handle)
            yield_at = time.monotonic() + _POLL_BURST_S
            while state not in ("DONE", "ERR"):
                now = time.monotonic()
                if now > deadline:
                    raise ChannelError(f"producer {link.address}: READ timed out")
                if now >= yield_at:
                    # Poll in bursts: a thread that yields the GIL after every call gets it
                    # back only every switch interval (5 ms) beside vLLM's spinning worker.
                    time.sleep(0)
                    yield_at = time.monotonic() + _POLL_BURST_S
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise ChannelError(f"producer {link.address}: READ failed")
        except ChannelError:
            raise
        except Exception as exc:  # noqa: BLE001 - a transfer error fails the keys, never the engine
            raise ChannelError(f"producer {link.address}: READ failed: {type(exc).__name__}: {exc}") from exc
        finally:
            if handle is not None:
                try:
                    agent.release_xfer_handle(handle)
                except Exception:  # noqa: BLE001
                    logger.debug("tiercache P/D: releasing a transfer handle failed", exc_info=True)

    def _failed(self, src: PeerSource, n: int, start: float, exc: Exception) -> None:
        logger.warning("tiercache P/D: %d chunks from %s:%d not read after %.2fs: %s: %s", n, src.host, src.port,
                       time.monotonic() - start, type(exc).__name__, exc)
        self._drop_link(src)

    def _drop_link(self, src: PeerSource) -> None:
        addr = (src.host, src.port + self.rank)
        link = self._links.pop(addr, None)
        if link is not None:
            link.close()
            try:
                self.agent.remove_remote_agent(link.agent_name)
            except Exception:  # noqa: BLE001
                logger.debug("tiercache P/D: removing agent %s failed", link.agent_name, exc_info=True)
