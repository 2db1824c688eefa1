"""A hand-off READ checked by its tags: the P/D consumer reads the tags, the data, the tags again.

:meth:`TaggedReader.read` runs one :class:`tiercache.pd.read_plans.ReadPlan`
against one producer. A slot's or a block's tag names the chunk while the
producer holds it for us (see :mod:`tiercache.pd.channel`); the producer
clears it before it writes the slot again. So, like a sequence lock: one READ
of the tags; the data of the chunks they name, in one READ; their tags again.
Named both times: arrived (the producer did not touch the bytes in between).
A tag of 0 before: the producer's copy into that slot still runs (via_host)
or its worker has not heard of the hold yet (direct): those chunks are tried
again a moment later, until the deadline. Another chunk's tag, or a tag that
changed during the data READ: the slot or blocks were released and reused,
the chunk is dropped (recomputed, never wrong; counted as ``stale_chunks``).
Reading the tags only after the data (as until 2026-11-27) accepted a READ
that ran while the copy was still writing the slot, when the copy ended and
its tag was set between the two READs: torn KV for chunks not verified by
page hashes (CUDA consumers, other TP sizes).

Then the page hashes (mode via_host, chunks the plan verifies): the
producer's xxh3-64 of each position read (published before its tag named the
chunk) against the hash of what our block holds now
(:mod:`tiercache.pd.page_hashes`); a chunk with any block that differs is
dropped (recomputed; counted as ``corrupt_chunks``), so nothing unchecked is
used or stored.

A read that must not wait (an inline read on the worker thread) raises
:class:`MustWait` instead of waiting for a tag: the caller hands the job to its
I/O thread.

Tags are READ into a small registered buffer, one descriptor per run of
consecutive tags; or, when the producer's whole tag array is small, into a
:class:`tiercache.pd.nixl_reads.TagMirror` made once per producer agent and
tag array (:attr:`TaggedReader.mirrors`).

Buffers: the tag buffer and the mirrors are registered with the consumer's
agent by this object; the buffer's registration is :attr:`TaggedReader.reg`
(its owner deregisters it). Threads: one read at a time, under the consumer's
``_io_lock``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from tiercache.layout import block_runs
from tiercache.pd.blocks import BlockRegions
from tiercache.pd.channel import TAG_BYTES, ChannelError
from tiercache.pd.link import PeerLink
from tiercache.pd.nixl_reads import TagMirror, read_to_completion, thread_schedstat
from tiercache.pd.page_hashes import block_hash
from tiercache.pd.read_plans import ReadPlan

logger = logging.getLogger(__name__)

_TAG_POLL_S = 0.001


class MustWait(Exception):
    """A read that may not wait met something to wait for: the I/O thread takes the job instead."""


class TaggedReader:
    """The consumer agent's tag buffer (``max_tags`` tags) and tag mirrors; runs read plans.

    ``counters`` is the reader's: ``stale_chunks``, ``corrupt_chunks`` and
    ``data_descs`` (NIXL descriptors of data READs, tags not counted) are
    counted in it.
    """

    def __init__(self, agent: Any, max_tags: int, counters: dict[str, int]) -> None:
        self.agent = agent
        self.counters = counters
        self._tags = np.zeros(max(1, max_tags), dtype=np.uint64)
        self.reg = agent.register_memory([(int(self._tags.ctypes.data), self._tags.nbytes, 0, "")], "DRAM")
        self.mirrors: dict[tuple[str, int], TagMirror] = {}  # (producer agent, tags addr) -> its tags

    def read(self, link: PeerLink, plan: ReadPlan, expected: list[int], ours: BlockRegions, deadline: float,
             wait: bool, poll_burst_s: float) -> tuple[list[int], int, float]:
        """READ the data, then its tags; again for chunks whose tags were 0; then the page hashes.

        ``expected``: per chunk, the tag naming it; ``ours``: our blocks (where the data
        lands); ``poll_burst_s``: as :func:`tiercache.pd.nixl_reads.read_to_completion`.
        Returns the chunks that arrived (and verified), and the bytes and seconds of the
        data READs alone.
        """
        local_mem = ours.mem_type
        if sum(len(t) for t in plan.tag_index) > len(self._tags):
            raise ChannelError(f"a hand-off of {sum(len(t) for t in plan.tag_index)} blocks exceeds the "
                               f"{len(self._tags)} tags")
        arrived: list[int] = []
        pending = list(range(len(expected)))
        data_bytes, data_secs = 0, 0.0
        while pending:
            # tags before the data: only chunks the producer names now are read
            before = time.perf_counter()
            ready, again = self._sort_by_tags(link, plan, expected, pending, deadline, poll_burst_s)
            if again and not wait:
                raise MustWait
            if ready:
                debug = logger.isEnabledFor(logging.DEBUG)
                sched = thread_schedstat() if debug else (0, 0)
                t0 = time.perf_counter()
                local, remote = plan.descs(ready)
                t1 = time.perf_counter()
                self._read_descs(link, local, local_mem, remote, plan.remote_mem, deadline, poll_burst_s)
                t2 = time.perf_counter()
                # ... and after it: a chunk whose tag changed meanwhile was released (its slot or
                # blocks reused): what we read may be torn, it is dropped
                kept, changed = self._sort_by_tags(link, plan, expected, ready, deadline, poll_burst_s)
                t3 = time.perf_counter()
                arrived += kept
                self.counters["stale_chunks"] += len(changed)
                self.counters["data_descs"] += len(local)
                data_bytes += int(np.asarray(local)[:, 1].sum())
                data_secs += t2 - t1
                if debug:
                    cpu, waited = (after - before for after, before in zip(thread_schedstat(), sched))
                    logger.debug("tiercache P/D: %d descriptors: tags before %.2f ms (%d of %d chunks named, "
                                 "%d not yet), built %.2f ms, data READ %.2f ms (CPU %.2f ms, waiting for the "
                                 "CPU %.2f ms), tags after %.2f ms", len(local), (t0 - before) * 1e3, len(ready),
                                 len(pending), len(again), (t1 - t0) * 1e3, (t2 - t1) * 1e3, cpu / 1e6,
                                 waited / 1e6, (t3 - t2) * 1e3)
            pending = again
            if pending:
                logger.debug("tiercache P/D: %d chunks not named by their tags yet: again in %.0f ms",
                             len(pending), _TAG_POLL_S * 1e3)
                if time.monotonic() >= deadline:
                    logger.warning("tiercache P/D: %d chunks of %s never became readable (expired?)",
                                   len(pending), link.address)
                    break
                time.sleep(_TAG_POLL_S)
        return self._verified(link, plan, sorted(arrived), ours, deadline, poll_burst_s), data_bytes, data_secs

    def _sort_by_tags(self, link: PeerLink, plan: ReadPlan, expected: list[int], chunks: list[int],
                      deadline: float, poll_burst_s: float) -> tuple[list[int], list[int]]:
        """READ the tags of ``chunks``: (those every tag of which names the chunk, those with a tag of 0:
        a copy into the slot in flight, or a hold not marked yet). Any other tag: the slot or blocks were
        released and reused (another chunk's now): dropped, counted as ``stale_chunks``."""
        tags = iter(self._read_tags(link, plan.tags_addr, plan.tag_count,
                                    [t for i in chunks for t in plan.tag_index[i]], deadline, poll_burst_s))
        named: list[int] = []
        waiting: list[int] = []
        for i in chunks:
            got = [next(tags) for _ in plan.tag_index[i]]
            if all(t == expected[i] for t in got):
                named.append(i)
            elif any(t not in (0, expected[i]) for t in got):
                self.counters["stale_chunks"] += 1
            else:
                waiting.append(i)
        return named, waiting

    def _verified(self, link: PeerLink, plan: ReadPlan, arrived: list[int], ours: BlockRegions, deadline: float,
                  poll_burst_s: float) -> list[int]:
        """The arrived chunks whose blocks match the producer's page hashes (chunks not to verify pass)."""
        checked = [i for i in arrived if plan.hash_index and plan.hash_index[i]]
        if not checked:
            return arrived
        theirs = iter(self._read_tags(link, plan.hashes_addr, plan.hash_count,
                                      [h for i in checked for h in plan.hash_index[i]], deadline, poll_burst_s))
        bad: set[int] = set()
        for i in checked:
            got = [next(theirs) for _ in plan.hash_index[i]]
            if any(h != block_hash(ours, b) for h, b in zip(got, plan.hash_blocks[i])):
                bad.add(i)
        if bad:
            self.counters["corrupt_chunks"] += len(bad)
            logger.warning("tiercache P/D: %d chunks from %s do not match their page hashes: dropped (recomputed)",
                           len(bad), link.address)
        return [i for i in arrived if i not in bad]

    def _read_tags(self, link: PeerLink, tags_addr: int, count: int, indices: list[int],
                   deadline: float, poll_burst_s: float) -> list[int]:
        if 0 < count * TAG_BYTES <= TagMirror.MAX_BYTES:  # the whole array, one handle made once per link
            key = (link.agent_name, tags_addr)
            if key not in self.mirrors:
                self.mirrors[key] = TagMirror(self.agent, link.agent_name, link.address, tags_addr, count)
            tags = self.mirrors[key].read(deadline, poll_burst_s)
            return [int(tags[i]) for i in indices]
        base = int(self._tags.ctypes.data)
        # one descriptor per run of consecutive tags: a hand-off's slots or blocks mostly are one run,
        # and each descriptor is one process_vm_readv on one host (63 single tags took 0.15 ms)
        runs = block_runs(indices)
        local = [(base + pos * TAG_BYTES, n * TAG_BYTES, 0) for pos, _, n in runs]
        remote = [(tags_addr + first * TAG_BYTES, n * TAG_BYTES, 0) for _, first, n in runs]
        self._tags[: len(indices)] = 0
        self._read_descs(link, local, "DRAM", remote, "DRAM", deadline, poll_burst_s)
        return [int(t) for t in self._tags[: len(indices)]]

    def _read_descs(self, link: PeerLink, local: Any, local_mem: str, remote: Any, remote_mem: str,
                   deadline: float, poll_burst_s: float) -> None:
        """One NIXL READ of ``remote`` into ``local``, to completion (ChannelError if it fails or passes ``deadline``)."""
        read_to_completion(self.agent, link.agent_name, link.address, local, local_mem, remote, remote_mem,
                           deadline, poll_burst_s)

    def warm(self, link: PeerLink, deadline: float) -> int:
        """READ a little of every producer region a hand-off from ``link`` reads; how many READs ran.

        Before any hand-off (the consumer's start-up warm-up): each tag array the producer
        publishes is read whole, through the mirror its hand-offs will use (made here, once),
        and the first tag's worth of its host slab, of each plane of a planes slab and of
        each region of its KV blocks (mode direct) into our tag buffer. The first hand-off then
        finds UCX's endpoint wired and the producer's regions known, instead of paying for
        both inside its READ. Nothing read here is used. ChannelError if a READ fails.
        """
        reads = 0
        if link.num_slots:
            self._read_tags(link, link.tags_addr, link.num_slots, [0], deadline, 0.002)
            reads += 1
        if link.blocks is not None and link.block_tags_addr:
            self._read_tags(link, link.block_tags_addr, link.blocks.num_blocks, [0], deadline, 0.002)
            reads += 1
        regions: list[tuple[int, int, str]] = [(link.slab_addr, 0, "DRAM")] if link.slab_addr else []
        for theirs in (link.slot_planes, link.blocks):
            if theirs is not None:
                regions += [(addr, device, theirs.mem_type) for addr, _, device, _ in theirs.spans()]
        base = int(self._tags.ctypes.data)
        for addr, device, mem in regions:  # one READ each: a READ's descriptors share one memory type
            self._read_descs(link, [(base, TAG_BYTES, 0)], "DRAM", [(addr, TAG_BYTES, device)], mem, deadline, 0.002)
            reads += 1
        return reads

    def forget(self, link: PeerLink) -> None:
        """The link is dropped: close the mirrors of its producer's tag arrays (before its agent goes)."""
        for key in [k for k in self.mirrors if k[0] == link.agent_name]:
            self.mirrors.pop(key).close()

    def close(self) -> None:
        """Close every mirror (the buffer's registration, :attr:`reg`, is its owner's to drop)."""
        for mirror in self.mirrors.values():
            mirror.close()
