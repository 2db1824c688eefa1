"""The P/D producers seen from a consumer: a read-only tier whose chunks are NIXL READs into blocks.

Not configured by users: the consumer's worker (connector/worker.py) creates
one when its kv_role is ``kv_consumer`` (or ``kv_both`` with a ``pd``
section). It is the ``WorkerPipeline``'s *block reader* for tier ``peer``, a
direct tier of the consumer's manager: the load plan gives no host slot, and
:meth:`NixlPeerTier.submit_blocks` READs each chunk straight into the
consumer's KV blocks (registered by :meth:`NixlPeerTier.expose_blocks`),
results from :meth:`NixlPeerTier.poll_blocks`. The source depends on the
producer's mode: its host slot (``via_host``, :func:`tiercache.pd.blocks.plane_descs`
or, for a slab in layout ``slots``, :func:`~tiercache.pd.blocks.slot_descs`) or its own KV blocks (``direct``, :func:`tiercache.pd.blocks.paired_descs`).

The metadata of the step names, per key, which producer holds it and where
(:meth:`expect`). A producer of another TP size (``PeerSource.tp_size``) is read
head by head (tiercache.pd.heads): this rank's KV heads from the producer
rank(s) holding them, each a sub-run of their head-major pages
(:func:`~tiercache.pd.read_plans.head_plan`); a chunk arrived when every
producer rank's part did.

A read, per producer: handshake once (:class:`tiercache.pd.channel.PeerLink`;
a producer with a different model, dtype, layout or chunk size is refused,
naming the difference), then NIXL only: one READ of the data, one READ of the
tags guarding it (a slot's or a block's tag names the chunk while the producer
holds it for us; the producer's whole tag array, when small, by a handle made
once: ``nixl_read.TagMirror``). A tag that names the chunk: arrived. A tag of 0: the
producer's copy into that slot still runs (via_host) or its worker has not
heard of the hold yet (direct): read the chunk again a moment later. Another
chunk's tag: the slot or blocks were reused, the chunk is dropped
(recomputed, never wrong). Then a one-way message on the side channel naming
the producer's request, so it releases the chunks. Anything that goes wrong
(dead producer, refusal, timeout, a transfer error) fails the keys: the
engine recomputes.

Buffers: the consumer's KV blocks, a small tag buffer and one tag mirror per
producer tag array are registered with this object's NIXL agent once; blocks named by ``submit_blocks`` are the
load's own, written only by the READ of their own job.

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiercache import faults
from tiercache.backend import JobResult
from tiercache.pd.read_plans import (
    PEER_DEVICE_TO_DEVICE as PEER_DEVICE_TO_DEVICE,  # re-exported: the metric paths
    PEER_HOST_TO_DEVICE as PEER_HOST_TO_DEVICE,
    IncompatibleBlocks,
    ReadPlan,
    block_plan,
    head_plan,
    slot_plan,
)
from tiercache.pd.nixl_reads import TagMirror, read_to_completion, thread_schedstat
from tiercache.transfer.device import CopySegment
from tiercache.layout import block_runs
from tiercache.pd.blocks import BlockRegions
from tiercache.pd.channel import TAG_BYTES, ChannelError, PeerLink, key_tag, make_agent
from tiercache.pd.heads import HeadRun, PageHeads, head_runs, readers_of
from tiercache.shards import ShardError

logger = logging.getLogger(__name__)

PEER_TIER = "peer"
# transfer-metric paths: PEER_HOST_TO_DEVICE / PEER_DEVICE_TO_DEVICE (tiercache/pd/read_plans.py), the
# whole hand-off by source; and of the data READs alone, either source: the READ's handle made, posted, completed and
# released (no descriptor building, no tag READ); comparable with raw NIXL and NIXL's own telemetry
PEER_DATA_READ = "peer_data_read"
_HELLO_ATTEMPT_S = 1.0
_TAG_POLL_S = 0.001
_POLL_BURST_S = 0.002


@dataclass(frozen=True)
class PeerSource:
    """Which producer handed a request's chunks off: its side channel and its request id."""

    host: str
    port: int
    request_id: str
    tp_size: int = 0  # the producer's TP size (0: ours); another: our heads' sub-runs (tiercache.pd.heads)


@dataclass(frozen=True)
class PeerChunk:
    """One handed-off chunk: its producer and where the producer holds it.

    Mode via_host: ``slot`` is the producer's host slot. Mode direct: ``slot``
    is -1 and ``blocks`` are the producer's KV blocks of the chunk. ``tag``: the
    key's :func:`key_tag`, computed by the scheduler that learned the hand-off
    (off the worker's READ path); 0: computed at the read.
    """

    source: PeerSource
    slot: int
    blocks: tuple[int, ...] = ()
    tag: int = 0


@dataclass
class _Job:
    job_id: int
    keys: list[bytes]
    chunks: dict[bytes, PeerChunk]
    segments: list[CopySegment]  # the consumer's blocks of each key


class _MustWait(Exception):
    """An inline read met something to wait for: the I/O thread takes the job instead."""


class NixlPeerTier:
    name = "nixl_peer"

    def __init__(self, chunk_bytes: int, fingerprint: dict[str, Any], rank: int, read_timeout_s: float,
                 error_handling: str = "none", max_blocks: int = 1) -> None:
        self.chunk_bytes = chunk_bytes
        self.fingerprint = fingerprint
        self.rank = rank
        self.read_timeout_s = read_timeout_s
        self.inline = error_handling == "none"
        self._io_lock = threading.Lock()
        self.agent = make_agent("consumer", error_handling)
        # one tag per block of the largest possible job (a slot's tag per chunk: fewer)
        self._tags = np.zeros(max(1, max_blocks), dtype=np.uint64)
        self._regs = [self.agent.register_memory([(int(self._tags.ctypes.data), self._tags.nbytes, 0, "")], "DRAM")]
        self.blocks: BlockRegions | None = None
        # our pages by KV head (set by the worker): producers of another TP size are read head by head
        self.page_heads: PageHeads | None = None
        self._chunks: dict[bytes, PeerChunk] = {}
        self._links: dict[tuple[str, int], PeerLink] = {}
        self._refused: dict[tuple[str, int], str] = {}
        self._mirrors: dict[tuple[str, int], TagMirror] = {}  # (producer agent, tags addr) -> its tags
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._done: list[JobResult] = []
        self._transfers: list[tuple[str, int, float]] = []  # (path, bytes, seconds) per READ
        self._lock = threading.Lock()
        self.counters = {"read_chunks": 0, "read_bytes": 0, "failed_chunks": 0, "refused_peers": 0,
                         "hello_retries": 0, "stale_chunks": 0, "inline_jobs": 0,
                         "data_descs": 0}  # NIXL descriptors of data READs (tags not counted)
        self._thread = threading.Thread(target=self._run, name="tiercache-pd-reader", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ worker thread
    def expose_blocks(self, blocks: BlockRegions) -> None:
        """Register the consumer's KV blocks: every READ lands in them."""
        self.blocks = blocks
        self._regs.append(self.agent.register_memory(blocks.spans(), blocks.mem_type))

    def expect(self, chunks: dict[bytes, PeerChunk]) -> None:
        """Where the producers hold each key the next loads read from this tier."""
        self._chunks.update(chunks)

    def submit_blocks(self, job_id: int, keys: Sequence[bytes], segments: Sequence[CopySegment]) -> None:
        """READ ``keys`` from their producers into ``segments``' blocks; the result from :meth:`poll_blocks`."""
        job = _Job(job_id, list(keys), {k: self._chunks.pop(k) for k in keys if k in self._chunks}, list(segments))
        if not (self.inline and self._run_inline(job)):
            self._jobs.put(job)

    def _run_inline(self, job: _Job) -> bool:
        """Try the job on this (the worker) thread without waiting for anything; False: queue it."""
        if not self._io_lock.acquire(blocking=False):
            return False  # the I/O thread is reading
        try:
            sources = {c.source for c in job.chunks.values()}
            if any((src.host, src.port + p) not in self._links for src in sources for p in self._producer_ranks(src)):
                return False  # a handshake first: that may wait on the producer
            try:
                self._finish(self._run_job(job, wait=False))
            except _MustWait:
                return False
            self.counters["inline_jobs"] += 1
            return True
        finally:
            self._io_lock.release()

    def poll_blocks(self) -> list[JobResult]:
        """Finished :meth:`submit_blocks` jobs."""
        with self._lock:
            out, self._done = self._done, []
        return out

    def take_transfers(self) -> list[tuple[str, int, float]]:
        """The NIXL transfers finished since the last call: (path, bytes, seconds) each.

        Seconds run from building a hand-off's descriptors to its tags checked (the
        READs and any re-reads; not the handshake, the notice or the queueing),
        path ``peer_host_to_device`` or ``peer_device_to_device`` by source. Each
        comes with a ``peer_data_read`` entry: the data READs alone (handle made,
        posted, completed, released), the part that compares with raw NIXL and with
        what vLLM's NixlConnector reports as ``nixl_xfer_time_seconds`` (NIXL's own
        telemetry, from post to completion).
        """
        with self._lock:
            out, self._transfers = self._transfers, []
        return out

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=self.read_timeout_s + 5)
        for mirror in self._mirrors.values():
            mirror.close()
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
                try:
                    result = self._run_job(job, wait=True)
                except Exception as exc:  # noqa: BLE001 - the reader outlives anything a peer sends
                    faults.record(faults.READER_EXCEPTION, exc, where="pd reader")
                    result = JobResult(job.job_id, (), tuple(job.keys), 0, 0.0)
                self._finish(result)

    def _finish(self, result: JobResult) -> None:
        self.counters["read_chunks"] += len(result.ok_keys)
        self.counters["read_bytes"] += result.bytes
        self.counters["failed_chunks"] += len(result.failed_keys)
        with self._lock:
            self._done.append(result)

    def _run_job(self, job: _Job, wait: bool) -> JobResult:
        """Read every chunk of ``job`` (``wait`` False: raise _MustWait rather than wait)."""
        start = time.perf_counter()
        by_peer: dict[PeerSource, list[int]] = {}
        for i, key in enumerate(job.keys):
            chunk = job.chunks.get(key)
            if chunk is not None:
                by_peer.setdefault(chunk.source, []).append(i)
        ok: list[bytes] = []
        moved = 0
        for src, idx in by_peer.items():
            arrived = self._read(src, [job.keys[i] for i in idx], [job.segments[i] for i in idx],
                                 [job.chunks[job.keys[i]] for i in idx], wait)
            ok.extend(job.keys[idx[i]] for i in arrived)
            moved += sum(len(job.segments[idx[i]].block_ids) for i in arrived)
        ok_set = set(ok)
        failed = tuple(k for k in job.keys if k not in ok_set)
        per_block = sum(self.blocks.pages) if self.blocks is not None else 0
        return JobResult(job.job_id, tuple(ok), failed, moved * per_block, time.perf_counter() - start)

    def _hetero(self, src: PeerSource) -> bool:
        return bool(src.tp_size) and (self.page_heads is None or src.tp_size != self.page_heads.tp_size)

    def _runs(self, src: PeerSource) -> list[HeadRun]:
        """Another TP size: where our heads come from (ChannelError if the pair is refused)."""
        if self.page_heads is None:
            raise ChannelError(f"producer TP size {src.tp_size}: this consumer does not know its KV heads")
        ours = self.page_heads
        try:
            return head_runs(ours.total, ours.tp_size, ours.rank, src.tp_size)
        except ShardError as exc:
            raise ChannelError(f"producer TP size {src.tp_size}, ours {ours.tp_size}: {exc}") from exc

    def _producer_ranks(self, src: PeerSource) -> list[int]:
        """The producer ranks this rank reads ``src``'s hand-offs from (the same rank, if the TP sizes are equal)."""
        if not self._hetero(src):
            return [self.rank]
        try:
            return sorted({run.producer_rank for run in self._runs(src)})
        except ChannelError:
            return [self.rank]

    def _link(self, src: PeerSource, producer_rank: int | None = None) -> PeerLink:
        addr = (src.host, src.port + (self.rank if producer_rank is None else producer_rank))
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

    # ---------------------------------------------------------------- reading
    def _read(self, src: PeerSource, keys: list[bytes], segments: list[CopySegment], chunks: list[PeerChunk],
              wait: bool) -> list[int]:
        """READ one producer's chunks into their blocks; the indices of those that arrived."""
        start = time.monotonic()
        deadline = start + self.read_timeout_s
        try:
            if self._hetero(src):
                return self._read_heads(src, keys, segments, chunks, wait, start, deadline)
            link = self._link(src)
            if self.blocks is None:
                raise ChannelError("this consumer's KV blocks are not registered")
            ours = [b for seg in segments for b in seg.block_ids]
            try:
                self.blocks.check_blocks(ours)
            except ValueError as exc:
                raise ChannelError(f"our blocks: {exc}") from exc
            if all(c.slot >= 0 for c in chunks):
                plan = slot_plan(self.blocks, link, segments, chunks, self.chunk_bytes)
            elif all(c.slot < 0 for c in chunks):
                try:
                    plan = block_plan(self.blocks, link, segments, chunks)
                except IncompatibleBlocks as exc:
                    self._refuse((src.host, src.port + self.rank), f"producer {link.address} is incompatible: {exc}")
                    raise
            else:
                raise ChannelError(f"producer {link.address}: a hand-off mixes host slots and KV blocks")
            t0 = time.monotonic()
            arrived, data_bytes, data_secs = self._read_until_tagged(link, plan, [c.tag or key_tag(k) for k, c in zip(keys, chunks)],
                                                                     deadline, wait)
            t1 = time.monotonic()
            moved = sum(len(segments[i].block_ids) for i in arrived) * sum(self.blocks.pages)
            if moved:
                with self._lock:
                    self._transfers.append((plan.path, moved, t1 - t0))
                    self._transfers.append((PEER_DATA_READ, data_bytes, data_secs))
            self._notify(link, src)
            logger.debug("tiercache P/D: %d/%d chunks (%d blocks, %s) from %s: handshake %.1f ms, "
                         "READs and tags %.1f ms", len(arrived), len(keys), len(ours), plan.path,
                         link.address, (t0 - start) * 1e3, (t1 - t0) * 1e3)
            return arrived
        except (ChannelError, OSError) as exc:
            self._failed(src, len(keys), start, exc)
            return []
        except _MustWait:
            raise
        except Exception as exc:  # noqa: BLE001 - garbage from a peer (metadata, a plan): its keys fail
            faults.record(faults.READER_EXCEPTION, exc, where=f"pd reader {src.host}:{src.port}")
            self._failed(src, len(keys), start, exc)
            return []

    def _read_heads(self, src: PeerSource, keys: list[bytes], segments: list[CopySegment],
                    chunks: list[PeerChunk], wait: bool, start: float, deadline: float) -> list[int]:
        """A producer of another TP size: our heads' sub-runs from each producer rank holding them.

        A chunk arrived when every producer rank's part did (its tag checked on that rank);
        each producer rank read is told so, with how many of our ranks read it.
        """
        runs = self._runs(src)  # ChannelError: this pair is refused
        ours = self.page_heads
        assert ours is not None
        if self.blocks is None:
            raise ChannelError("this consumer's KV blocks are not registered")
        try:
            self.blocks.check_blocks([b for seg in segments for b in seg.block_ids])
        except ValueError as exc:
            raise ChannelError(f"our blocks: {exc}") from exc
        expected = [c.tag or key_tag(k) for k, c in zip(keys, chunks)]
        arrived: set[int] | None = None
        links: list[tuple[PeerLink, int]] = []
        t0 = time.monotonic()
        for prank in sorted({r.producer_rank for r in runs}):
            link = self._link(src, prank)
            try:
                plan = head_plan(self.blocks, ours, link, [r for r in runs if r.producer_rank == prank],
                                 segments, chunks, self.chunk_bytes)
            except IncompatibleBlocks as exc:
                self._refuse((src.host, src.port + prank), f"producer {link.address} is incompatible: {exc}")
                raise
            got, data_bytes, data_secs = self._read_until_tagged(link, plan, expected, deadline, wait)
            arrived = set(got) if arrived is None else arrived & set(got)
            links.append((link, prank))
            if data_bytes:
                with self._lock:
                    self._transfers.append((PEER_DATA_READ, data_bytes, data_secs))
        t1 = time.monotonic()
        done = sorted(arrived or ())
        moved = sum(len(segments[i].block_ids) for i in done) * sum(self.blocks.pages)
        if moved:
            with self._lock:
                path = PEER_DEVICE_TO_DEVICE if all(c.slot < 0 for c in chunks) else PEER_HOST_TO_DEVICE
                self._transfers.append((path, moved, t1 - t0))
        for link, prank in links:
            readers = readers_of(ours.total, ours.tp_size, src.tp_size, prank)
            try:
                link.notify_read(src.request_id, self.rank, readers)
            except ChannelError:  # the hold then expires on the producer
                logger.warning("tiercache P/D: notifying %s failed", link.address, exc_info=True)
        logger.debug("tiercache P/D: %d/%d chunks from %d producer ranks of TP size %d (ours %d): %.1f ms",
                     len(done), len(keys), len(links), src.tp_size, ours.tp_size, (t1 - t0) * 1e3)
        return done

    def _read_until_tagged(self, link: PeerLink, plan: ReadPlan, expected: list[int], deadline: float,
                           wait: bool) -> tuple[list[int], int, float]:
        """READ the data, then its tags; again for chunks whose tags were 0.

        Returns the chunks that arrived, and the bytes and seconds of the data READs alone.
        """
        assert self.blocks is not None
        if sum(len(t) for t in plan.tag_index) > len(self._tags):
            raise ChannelError(f"a hand-off of {sum(len(t) for t in plan.tag_index)} blocks exceeds the "
                               f"{len(self._tags)} tags")
        arrived: list[int] = []
        pending = list(range(len(expected)))
        ours_mem = self.blocks.mem_type
        data_bytes, data_secs = 0, 0.0
        while pending:
            debug = logger.isEnabledFor(logging.DEBUG)
            sched = thread_schedstat() if debug else (0, 0)
            t0 = time.perf_counter()
            local, remote = plan.descs(pending)
            t1 = time.perf_counter()
            self._read_descs(link, local, ours_mem, remote, plan.remote_mem, deadline)
            t2 = time.perf_counter()
            tags = iter(self._read_tags(link, plan.tags_addr, plan.tag_count,
                                        [t for i in pending for t in plan.tag_index[i]],
                                        deadline))
            t3 = time.perf_counter()
            self.counters["data_descs"] += len(local)
            data_bytes += int(np.asarray(local)[:, 1].sum())
            data_secs += t2 - t1
            if debug:
                cpu, waited = (after - before for after, before in zip(thread_schedstat(), sched))
                logger.debug("tiercache P/D: %d descriptors: built %.2f ms, data READ %.2f ms (CPU %.2f ms, "
                             "waiting for the CPU %.2f ms), tags %.2f ms", len(local), (t1 - t0) * 1e3,
                             (t2 - t1) * 1e3, cpu / 1e6, waited / 1e6, (t3 - t2) * 1e3)
            again: list[int] = []
            for i in pending:
                got = [next(tags) for _ in plan.tag_index[i]]
                if all(t == expected[i] for t in got):
                    arrived.append(i)
                elif any(t not in (0, expected[i]) for t in got):
                    self.counters["stale_chunks"] += 1  # released and reused: another chunk's now
                else:
                    again.append(i)  # a copy into the slot in flight, or a hold not marked yet
            pending = again
            if pending:
                if not wait:
                    raise _MustWait
                if time.monotonic() >= deadline:
                    logger.warning("tiercache P/D: %d chunks of %s never became readable (expired?)",
                                   len(pending), link.address)
                    break
                time.sleep(_TAG_POLL_S)
        return sorted(arrived), data_bytes, data_secs

    # ------------------------------------------------------------------ common
    def _read_tags(self, link: PeerLink, tags_addr: int, count: int, indices: list[int],
                   deadline: float) -> list[int]:
        if 0 < count * TAG_BYTES <= TagMirror.MAX_BYTES:  # the whole array, one handle made once per link
            key = (link.agent_name, tags_addr)
            if key not in self._mirrors:
                self._mirrors[key] = TagMirror(self.agent, link.agent_name, link.address, tags_addr, count)
            tags = self._mirrors[key].read(deadline, self._poll_burst())
            return [int(tags[i]) for i in indices]
        base = int(self._tags.ctypes.data)
        # one descriptor per run of consecutive tags: a hand-off's slots or blocks mostly are one run,
        # and each descriptor is one process_vm_readv on one host (63 single tags took 0.15 ms)
        runs = block_runs(indices)
        local = [(base + pos * TAG_BYTES, n * TAG_BYTES, 0) for pos, _, n in runs]
        remote = [(tags_addr + first * TAG_BYTES, n * TAG_BYTES, 0) for _, first, n in runs]
        self._tags[: len(indices)] = 0
        self._read_descs(link, local, "DRAM", remote, "DRAM", deadline)
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

    def _read_descs(self, link: PeerLink, local: Any, local_mem: str, remote: Any, remote_mem: str,
                    deadline: float) -> None:
        """One NIXL READ of ``remote`` into ``local``, to completion (ChannelError if it fails or passes ``deadline``)."""
        read_to_completion(self.agent, link.agent_name, link.address, local, local_mem, remote, remote_mem,
                           deadline, self._poll_burst())

    def _poll_burst(self) -> float:
        # The I/O thread polls in bursts and yields the GIL between them (a thread that yields
        # after every call gets it back only every switch interval, 5 ms, beside vLLM's spinning
        # worker). An inline read is the worker thread's own work: it never yields mid-READ.
        return _POLL_BURST_S if threading.current_thread() is self._thread else float("inf")

    def _failed(self, src: PeerSource, n: int, start: float, exc: Exception) -> None:
        logger.warning("tiercache P/D: %d chunks from %s:%d not read after %.2fs: %s: %s", n, src.host, src.port,
                       time.monotonic() - start, type(exc).__name__, exc)
        self._drop_link(src)

    def _drop_link(self, src: PeerSource) -> None:
        for prank in self._producer_ranks(src):
            self._drop_one((src.host, src.port + prank))

    def _drop_one(self, addr: tuple[str, int]) -> None:
        link = self._links.pop(addr, None)
        if link is not None:
            for key in [k for k in self._mirrors if k[0] == link.agent_name]:
                self._mirrors.pop(key).close()
            link.close()
            try:
                self.agent.remove_remote_agent(link.agent_name)
            except Exception:  # noqa: BLE001
                logger.debug("tiercache P/D: removing agent %s failed", link.agent_name, exc_info=True)
