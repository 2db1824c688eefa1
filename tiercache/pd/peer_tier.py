"""The P/D producers seen from a consumer: a read-only tier whose chunks are NIXL READs into blocks.

Not configured by users: the consumer's worker (connector/worker.py) creates
one when its kv_role is ``kv_consumer`` (or ``kv_both`` with a ``pd``
section). It is the ``WorkerPipeline``'s *block reader* for tier ``peer``, a
direct tier of the consumer's manager: the load plan gives no host slot, and
:meth:`NixlPeerTier.submit_blocks` READs each chunk straight into the
consumer's KV blocks (registered by :meth:`NixlPeerTier.expose_blocks`),
results from :meth:`NixlPeerTier.poll_blocks`. The source depends on the
producer's mode: its host slot (``via_host``: :func:`tiercache.pd.read_plans.slot_plan`)
or its own KV blocks (``direct``: :func:`tiercache.pd.read_plans.block_plan`).

The metadata of the step names, per key, which producer holds it and where
(:meth:`NixlPeerTier.expect`). A producer of another TP size
(``PeerSource.tp_size``) is read head by head (:mod:`tiercache.pd.heads`):
this rank's KV heads from the producer rank(s) holding them
(:func:`tiercache.pd.read_plans.head_plan`); a chunk arrived when every
producer rank's part did.

A read, per producer: handshake once (:class:`tiercache.pd.link.PeerLinks`;
a producer with a different model, dtype, layout or chunk size is refused,
naming the difference), then NIXL only: the data READ and the READ of the tags
guarding it, again while a tag says "not yet" (:class:`tiercache.pd.tagged_reads.TaggedReader`;
a chunk whose slot or blocks were reused is dropped: recomputed, never wrong).
Then a one-way message on the side channel naming the producer's request, so
it releases the chunks. Anything that goes wrong (dead producer, refusal,
timeout, a transfer error) fails the keys: the engine recomputes.

Buffers: the consumer's KV blocks, a small tag buffer and one tag mirror per
producer tag array are registered with this object's NIXL agent once; blocks
named by ``submit_blocks`` are the load's own, written only by their job's READ.

Threads: submit/poll/expect/close from the worker thread; the warm-up's thread
(:mod:`tiercache.pd.warm_up`) shakes hands before the first hand-off, under
``_io_lock``. A read runs on the I/O thread, except that with UCX error handling ``none`` (one-sided reads that
cannot hang on the producer) a read from a producer already shaken hands with
is tried inline, on the worker thread: in an engine pinned to one core the
I/O thread shares that core with vLLM's spinning worker loop, and the inline
READ is several times faster. If it would have to wait (a tag not set yet, a
handshake, the I/O thread busy) the job goes to the I/O thread as before.
``_io_lock`` serialises all NIXL and link use.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tiercache import faults
from tiercache.backend import JobResult
from tiercache.jobs import CopySegment, FromReader, LoadChunk
from tiercache.pd.blocks import BlockRegions
from tiercache.pd.channel import ChannelError, key_tag, make_agent
from tiercache.pd.heads import HeadRun, PageHeads, head_runs, readers_of
from tiercache.pd.link import PeerLink, PeerLinks
from tiercache.pd.peer_chunks import PeerChunk as PeerChunk  # re-exported
from tiercache.pd.peer_chunks import PeerSource as PeerSource
from tiercache.pd.read_plans import PEER_DEVICE_TO_DEVICE as PEER_DEVICE_TO_DEVICE  # re-exported
from tiercache.pd.read_plans import PEER_HOST_TO_DEVICE as PEER_HOST_TO_DEVICE  # re-exported
from tiercache.pd.read_plans import IncompatibleBlocks, block_plan, head_plan, slot_plan
from tiercache.pd.tagged_reads import MustWait, TaggedReader
from tiercache.pd.transfer_log import PEER_DATA_READ as PEER_DATA_READ  # re-exported: a metric path
from tiercache.pd.transfer_log import Transfer, TransferLog
from tiercache.pd.trust import ProducerTrust
from tiercache.pd.warm_up import WarmUp
from tiercache.shards import ShardError

logger = logging.getLogger(__name__)

PEER_TIER = "peer"
_POLL_BURST_S = 0.002


@dataclass
class _Job:
    job_id: int
    keys: list[bytes]
    chunks: dict[bytes, PeerChunk]
    segments: list[CopySegment]  # the consumer's blocks of each key


class NixlPeerTier:
    name = "nixl_peer"

    def __init__(self, chunk_bytes: int, fingerprint: dict[str, Any], rank: int, read_timeout_s: float,
                 error_handling: str = "none", max_blocks: int = 1, *, key: bytes = b"",
                 trust: ProducerTrust | None = None) -> None:
        """``key``: the side channel's shared secret (empty: none); ``trust``: whom we read from
        (default: producers proven by ``key``, or loopback ones without it)."""
        self.chunk_bytes = chunk_bytes
        self.trust = trust or ProducerTrust((), has_secret=bool(key))
        self.fingerprint = fingerprint
        self.rank = rank
        self.read_timeout_s = read_timeout_s
        self.inline = error_handling == "none"
        self._io_lock = threading.Lock()
        self.agent = make_agent("consumer", error_handling)
        self.counters = {"read_chunks": 0, "read_bytes": 0, "failed_chunks": 0, "refused_peers": 0,
                         "hello_retries": 0, "stale_chunks": 0, "inline_jobs": 0, "auth_failures": 0,
                         "untrusted_peers": 0, "corrupt_chunks": 0, "warmed_peers": 0,
                         "data_descs": 0}  # NIXL descriptors of data READs (tags not counted)
        # one tag per block of the largest possible job (a slot's tag per chunk: fewer)
        self._reads = TaggedReader(self.agent, max_blocks, self.counters)
        self._mirrors = self._reads.mirrors  # (producer agent, tags addr) -> its tags
        self._regs = [self._reads.reg]
        self._links = PeerLinks(self.agent, fingerprint, read_timeout_s, self.counters, self._reads.forget, key)
        self.blocks: BlockRegions | None = None
        # our pages by KV head (set by the worker): producers of another TP size are read head by head
        self.page_heads: PageHeads | None = None
        self._chunks: dict[bytes, PeerChunk] = {}
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._done: list[JobResult] = []
        self._log = TransferLog()
        self._lock = threading.Lock()  # guards _done: finished by either thread, polled by the worker
        self._warm_up: WarmUp | None = None
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

    def read_chunks(self, job_id: int, chunks: Sequence[LoadChunk]) -> None:
        """The pipeline's call (BlockReader): each chunk's producer memory is its source's ``where``."""
        self.expect({c.key: c.source.where for c in chunks if isinstance(c.source, FromReader) and c.source.where})
        # one read entry per run of blocks: a hybrid model's chunk has one per KV-cache group (and per
        # run of allocated blocks); the entries of a key share its slot and tag
        entries = [(c.key, seg) for c in chunks for seg in c.segments()]
        self.submit_blocks(job_id, [k for k, _ in entries], [seg for _, seg in entries])

    def submit_blocks(self, job_id: int, keys: Sequence[bytes], segments: Sequence[CopySegment]) -> None:
        """READ ``keys`` from their producers into ``segments``' blocks; the result from :meth:`poll_blocks`."""
        job = _Job(job_id, list(keys), {k: self._chunks[k] for k in keys if k in self._chunks}, list(segments))
        for key in set(keys):
            self._chunks.pop(key, None)
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
            except MustWait:
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

    def take_transfers(self) -> list[Transfer]:
        """The NIXL transfers finished since the last call: (path, bytes, seconds) each.

        The paths, and what each one's seconds cover: :mod:`tiercache.pd.transfer_log`.
        """
        return self._log.take()

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until a first read need not start the metadata vetter; whether it need not.

        Never needed for correctness (a read that runs out of time is a miss); tests and
        tools that time their first read call it after construction.
        """
        return self._links.wait_ready(timeout_s)

    def warm_up(self, producers: Sequence[tuple[str, int]], for_s: float) -> None:
        """Shake hands with this rank's rank of each producer in ``producers`` (host, rank 0's port; those
        we trust) and READ a little of its memory in the background, before any hand-off names it
        (:mod:`tiercache.pd.warm_up`)."""
        ranks = [(host, port + self.rank) for host, port in producers if self.trust.why_not(host, port) is None]
        if ranks and for_s > 0:
            self._warm_up = WarmUp(self._links, self._reads, self._io_lock, self.counters, self.read_timeout_s)
            self._warm_up.start(ranks, for_s)

    def close(self) -> None:
        if self._warm_up is not None:
            self._warm_up.close()
        self._jobs.put(None)
        self._thread.join(timeout=self.read_timeout_s + 5)
        self._reads.close()
        self._links.close()
        for reg in self._regs:
            try:
                self.agent.deregister_memory(reg)
            except Exception:
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
                except Exception as exc:
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
        """Read every chunk of ``job`` (``wait`` False: raise MustWait rather than wait)."""
        start = time.perf_counter()
        by_peer: dict[PeerSource, list[int]] = {}
        for i, key in enumerate(job.keys):
            chunk = job.chunks.get(key)
            if chunk is not None:
                by_peer.setdefault(chunk.source, []).append(i)
        arrived_entries: set[int] = set()
        moved = 0
        for src, idx in by_peer.items():
            arrived = self._read(src, [job.keys[i] for i in idx], [job.segments[i] for i in idx],
                                 [job.chunks[job.keys[i]] for i in idx], wait)
            arrived_entries.update(idx[i] for i in arrived)
            moved += sum(len(job.segments[idx[i]].block_ids) for i in arrived)
        # a key read as several entries (a hybrid model's groups) arrived only if all of them did
        failed_keys = {k for i, k in enumerate(job.keys) if i not in arrived_entries}
        keys = list(dict.fromkeys(job.keys))
        per_block = sum(self.blocks.pages) if self.blocks is not None else 0
        return JobResult(job.job_id, tuple(k for k in keys if k not in failed_keys),
                         tuple(k for k in keys if k in failed_keys), moved * per_block, time.perf_counter() - start)

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
        return self._links.get((src.host, src.port + (self.rank if producer_rank is None else producer_rank)))

    # ---------------------------------------------------------------- reading
    def _read(self, src: PeerSource, keys: list[bytes], segments: list[CopySegment], chunks: list[PeerChunk],
              wait: bool) -> list[int]:
        """READ one producer's chunks into their blocks; the indices of those that arrived."""
        start = time.monotonic()
        deadline = start + self.read_timeout_s
        try:
            untrusted = self.trust.why_not(src.host, src.port)
            if untrusted:  # nothing connects to it, nothing is read
                self.counters["untrusted_peers"] += 1
                raise ChannelError(untrusted)
            if self._hetero(src):
                return self._read_heads(src, keys, segments, chunks, wait, start, deadline)
            link = self._link(src)
            blocks = self._our_blocks(segments)
            if all(c.slot >= 0 for c in chunks):
                plan = slot_plan(blocks, link, segments, chunks, self.chunk_bytes)
            elif all(c.slot < 0 for c in chunks):
                try:
                    plan = block_plan(blocks, link, segments, chunks)
                except IncompatibleBlocks as exc:
                    self._links.refuse((src.host, src.port + self.rank),
                                       f"producer {link.address} is incompatible: {exc}")
                    raise
            else:
                raise ChannelError(f"producer {link.address}: a hand-off mixes host slots and KV blocks")
            t0 = time.monotonic()
            expected = [c.tag or key_tag(k) for k, c in zip(keys, chunks)]
            arrived, data_bytes, data_secs = self._reads.read(link, plan, expected, blocks, deadline,
                                                              wait, self._poll_burst())
            t1 = time.monotonic()
            moved = sum(len(segments[i].block_ids) for i in arrived) * sum(blocks.pages)
            if moved:
                self._log.record((plan.path, moved, t1 - t0), (PEER_DATA_READ, data_bytes, data_secs))
            self._notify(link, src)
            logger.debug("tiercache P/D: %d/%d chunks (%d blocks, %s) from %s: handshake %.1f ms, "
                         "READs and tags %.1f ms", len(arrived), len(keys), sum(len(g.block_ids) for g in segments),
                         plan.path,
                         link.address, (t0 - start) * 1e3, (t1 - t0) * 1e3)
            return arrived
        except (ChannelError, OSError) as exc:
            self._failed(src, len(keys), start, exc)
            return []
        except MustWait:
            raise
        except Exception as exc:
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
        blocks = self._our_blocks(segments)
        expected = [c.tag or key_tag(k) for k, c in zip(keys, chunks)]
        arrived: set[int] | None = None
        links: list[tuple[PeerLink, int]] = []
        t0 = time.monotonic()
        for prank in sorted({r.producer_rank for r in runs}):
            link = self._link(src, prank)
            try:
                plan = head_plan(blocks, ours, link, [r for r in runs if r.producer_rank == prank],
                                 segments, chunks, self.chunk_bytes)
            except IncompatibleBlocks as exc:
                self._links.refuse((src.host, src.port + prank), f"producer {link.address} is incompatible: {exc}")
                raise
            got, data_bytes, data_secs = self._reads.read(link, plan, expected, blocks, deadline,
                                                          wait, self._poll_burst())
            arrived = set(got) if arrived is None else arrived & set(got)
            links.append((link, prank))
            if data_bytes:
                self._log.record((PEER_DATA_READ, data_bytes, data_secs))
        t1 = time.monotonic()
        done = sorted(arrived or ())
        moved = sum(len(segments[i].block_ids) for i in done) * sum(blocks.pages)
        if moved:
            path = PEER_DEVICE_TO_DEVICE if all(c.slot < 0 for c in chunks) else PEER_HOST_TO_DEVICE
            self._log.record((path, moved, t1 - t0))
        for link, prank in links:
            self._notify(link, src, readers_of(ours.total, ours.tp_size, src.tp_size, prank))
        logger.debug("tiercache P/D: %d/%d chunks from %d producer ranks of TP size %d (ours %d): %.1f ms",
                     len(done), len(keys), len(links), src.tp_size, ours.tp_size, (t1 - t0) * 1e3)
        return done

    # ------------------------------------------------------------------ common
    def _our_blocks(self, segments: list[CopySegment]) -> BlockRegions:
        """Our registered KV blocks, once ``segments``' blocks are checked to lie in them (else ChannelError)."""
        if self.blocks is None:
            raise ChannelError("this consumer's KV blocks are not registered")
        try:
            self.blocks.check_blocks([b for seg in segments for b in seg.block_ids])
        except ValueError as exc:
            raise ChannelError(f"our blocks: {exc}") from exc
        return self.blocks

    def _notify(self, link: PeerLink, src: PeerSource, readers: int = 1) -> None:
        """Tell the producer this request's chunks were read (it releases them once ``readers`` of our ranks did).

        Over the side channel, not as a NIXL notification (why: :mod:`tiercache.pd.channel`).
        """
        try:
            link.notify_read(src.request_id, src.release_token, self.rank, readers)
        except ChannelError:  # the hold then expires on the producer
            logger.warning("tiercache P/D: notifying %s failed", link.address, exc_info=True)

    def _poll_burst(self) -> float:
        # The I/O thread polls in bursts and yields the GIL between them (a thread that yields
        # after every call gets it back only every switch interval, 5 ms, beside vLLM's spinning
        # worker). An inline read is the worker thread's own work: it never yields mid-READ.
        return _POLL_BURST_S if threading.current_thread() is self._thread else float("inf")

    def _failed(self, src: PeerSource, n: int, start: float, exc: Exception) -> None:
        logger.warning("tiercache P/D: %d chunks from %r:%d not read after %.2fs: %s: %s", n, src.host[:80], src.port,
                       time.monotonic() - start, type(exc).__name__, exc)
        for prank in self._producer_ranks(src):  # the next read shakes hands again
            self._links.drop((src.host, src.port + prank))
