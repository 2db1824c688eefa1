"""Read plans for the P/D consumer: which producer memory lands in which of our blocks, and its tags.

One :class:`ReadPlan` per hand-off READ (:class:`tiercache.pd.peer_tier.NixlPeerTier`
runs it): descriptors for any subset of the hand-off's chunks (a retry reads
only those whose tags were not ready) and the producer tags guarding each chunk.

* :func:`slot_plan`, mode via_host: each chunk from the producer's host slot
  (one tag per slot); a slab in layout planes reads a run of slots as one
  descriptor per region (:func:`tiercache.pd.blocks.plane_descs`), layout slots
  one per region per chunk (:func:`tiercache.pd.blocks.slot_descs`).
* :func:`block_plan`, mode direct: each chunk from the producer's KV blocks
  (one tag per block), runs of consecutive blocks on both sides as one
  descriptor per region (:func:`tiercache.pd.blocks.paired_descs`).
* :func:`head_plan`, a producer of another TP size (either mode): this rank's
  KV heads' sub-runs of one producer rank's head-major pages
  (:mod:`tiercache.pd.heads`), one descriptor per region, page and run of heads.

A via_host plan also names, for each chunk to verify (``verify``), the
producer's page hashes of the positions read and our blocks they landed in
(:mod:`tiercache.pd.page_hashes`); a chunk to verify that cannot be (the
producer publishes no hashes, our blocks are in GPU memory, mode direct,
another TP size) is a ``ChannelError``: its keys fail, never unchecked.

Anything the producer names that we cannot read is a ``ChannelError`` (the
keys fail and are recomputed); a producer whose KV pages differ from ours is an
:class:`IncompatibleBlocks` (the caller refuses the peer). Pure: no NIXL calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from tiercache.layout import region_offsets
from tiercache.pd.blocks import BlockRegions, paired_descs, plane_descs, slot_descs
from tiercache.pd.channel import ChannelError
from tiercache.pd.handoff import NO_BLOCK
from tiercache.pd.heads import HeadRun, PageHeads, check_pages, head_descs
from tiercache.pd.link import PeerLink
from tiercache.transfer.device import CopySegment

# transfer-metric paths of a whole hand-off (tiercache_transfer_*{path=...}), by source: the
# producer's host slots (via_host) or its KV blocks (direct); both land in our blocks
PEER_HOST_TO_DEVICE = "peer_host_to_device"
PEER_DEVICE_TO_DEVICE = "peer_device_to_device"


class HeldChunk(Protocol):
    """Where a producer holds one handed-off chunk, as a plan reads it.

    :class:`tiercache.pd.peer_tier.PeerChunk` is one (a protocol here: plans import no reader).
    """

    @property
    def slot(self) -> int: ...  # its host slot (via_host), or -1 (direct)

    @property
    def blocks(self) -> tuple[int, ...]: ...  # mode direct: its KV blocks

    @property
    def verify(self) -> bool: ...  # its blocks must match the producer's page hashes


class IncompatibleBlocks(ChannelError):
    """The producer's KV blocks are not ours to read into (other pages): refuse the peer."""


@dataclass(frozen=True)
class ReadPlan:
    """How to read one producer's chunks: descriptors for any subset, and their tags."""

    descs: Callable[[list[int]], tuple[np.ndarray, np.ndarray]]  # chunk indices -> (local, remote)
    remote_mem: str
    tags_addr: int
    tag_count: int  # tags in the producer's array (slots or blocks)
    tag_index: list[list[int]]  # per chunk: the producer tags guarding it (slot or blocks)
    path: str  # transfer-metric path
    hashes_addr: int = 0  # the producer's page hashes (0: nothing to verify)
    hash_count: int = 0  # hashes in the producer's array
    hash_index: list[list[int]] = field(default_factory=list)  # per chunk: its positions' hashes ([]: unchecked)
    hash_blocks: list[list[int]] = field(default_factory=list)  # per chunk: our blocks, in the same order


def _unverifiable(link: PeerLink, chunks: Sequence[HeldChunk], what: str) -> None:
    """ChannelError if a chunk must be verified: ``what`` publishes no page hashes."""
    if any(c.verify for c in chunks):
        raise ChannelError(f"producer {link.address}: {what} has no page hashes; a chunk to verify fails")


def _slots(link: PeerLink, chunks: Sequence[HeldChunk]) -> list[int]:
    """The producer host slots a via_host hand-off names, each checked against its slab."""
    slots = [c.slot for c in chunks]
    if any(not 0 <= s < link.num_slots for s in slots):
        raise ChannelError(f"producer {link.address}: hand-off names a slot outside its {link.num_slots}")
    return slots


def _source_blocks(link: PeerLink, theirs: BlockRegions, segments: Sequence[CopySegment],
                   chunks: Sequence[HeldChunk]) -> list[list[int]]:
    """Mode direct: per chunk, the producer's KV blocks our segment's positions come from (checked)."""
    sources: list[list[int]] = []
    for seg, chunk in zip(segments, chunks):
        src_blocks = list(chunk.blocks[seg.first_block:seg.first_block + len(seg.block_ids)])
        if len(src_blocks) != len(seg.block_ids):
            raise ChannelError(f"producer {link.address}: hand-off names too few blocks for a chunk")
        if NO_BLOCK in src_blocks:  # a hybrid model: a window block the producer had freed
            raise ChannelError(f"producer {link.address}: the hand-off holds no block for a position "
                               f"{seg.first_block}..{seg.first_block + len(seg.block_ids) - 1} we need")
        sources.append(src_blocks)
    try:
        theirs.check_blocks([b for blocks in sources for b in blocks])
    except ValueError as exc:
        raise ChannelError(f"producer {link.address}: {exc}") from exc
    return sources


def slot_plan(ours: BlockRegions, link: PeerLink, segments: Sequence[CopySegment],
              chunks: Sequence[HeldChunk], chunk_bytes: int) -> ReadPlan:
    """Mode via_host: each chunk from the producer's host slot, one tag per slot."""
    slots = _slots(link, chunks)
    if link.slot_bytes != chunk_bytes:
        raise ChannelError(f"producer {link.address}: {link.slot_bytes}-byte slots, ours {chunk_bytes}")
    planes = link.slot_planes

    def descs(idx: list[int]) -> tuple[np.ndarray, np.ndarray]:
        chosen = [slots[i] for i in idx]
        firsts = [segments[i].first_block for i in idx]
        blocks = [segments[i].block_ids for i in idx]
        try:
            if planes is not None:  # layout planes: a run of slots is one descriptor per region
                return plane_descs(ours, planes, link.num_slots, chosen, firsts, blocks)
            return slot_descs(ours, link.slab_addr, link.slot_bytes, chosen, firsts, blocks)
        except ValueError as exc:
            raise ChannelError(f"producer {link.address}: {exc}") from exc

    hash_index: list[list[int]] = []
    hash_blocks: list[list[int]] = []
    if any(c.verify for c in chunks):
        n = link.hash_positions
        if not link.hashes_addr or n * sum(ours.pages) != chunk_bytes:
            raise ChannelError(f"producer {link.address} publishes no page hashes: its chunks cannot be verified")
        if ours.mem_type != "DRAM":
            raise ChannelError("our KV blocks are in GPU memory: a hand-off cannot be verified in place")
        for c, seg, slot in zip(chunks, segments, slots):
            positions = range(seg.first_block, seg.first_block + len(seg.block_ids))
            hash_index.append([slot * n + p for p in positions] if c.verify else [])
            hash_blocks.append(list(seg.block_ids) if c.verify else [])
    return ReadPlan(descs, "DRAM", link.tags_addr, link.num_slots, [[s] for s in slots], PEER_HOST_TO_DEVICE,
                    link.hashes_addr, link.num_slots * link.hash_positions, hash_index, hash_blocks)


def block_plan(ours: BlockRegions, link: PeerLink, segments: Sequence[CopySegment],
               chunks: Sequence[HeldChunk]) -> ReadPlan:
    """Mode direct: each chunk from the producer's KV blocks, one tag per block."""
    theirs = link.blocks
    if theirs is None:
        raise ChannelError(f"producer {link.address} exposes no KV blocks (its pd.mode is not direct)")
    _unverifiable(link, chunks, "mode direct")
    why = ours.mismatch(theirs)
    if why:
        raise IncompatibleBlocks(why)
    sources = _source_blocks(link, theirs, segments, chunks)

    def descs(idx: list[int]) -> tuple[np.ndarray, np.ndarray]:
        return paired_descs(ours, theirs, [b for i in idx for b in segments[i].block_ids],
                            [b for i in idx for b in sources[i]])

    return ReadPlan(descs, theirs.mem_type, link.block_tags_addr, theirs.num_blocks, sources, PEER_DEVICE_TO_DEVICE)


def head_plan(ours: BlockRegions, our_heads: PageHeads, link: PeerLink, runs: Sequence[HeadRun],
              segments: Sequence[CopySegment], chunks: Sequence[HeldChunk], chunk_bytes: int) -> ReadPlan:
    """Another TP size (tiercache.pd.heads): our heads' sub-runs of one producer rank's pages.

    ``runs``: the heads this producer rank gives us (:func:`tiercache.pd.heads.head_runs`).
    Its pages come from its host slots (via_host; planes or slots layout) or its KV blocks
    (direct), one descriptor per region, page and run of heads. Its pages must be
    head-major with our bytes per head (:func:`tiercache.pd.heads.check_pages`; else
    :class:`IncompatibleBlocks`: the peer is refused).
    """
    _unverifiable(link, chunks, "a head-split read (another TP size)")
    theirs_heads = link.page_heads
    if theirs_heads is None:
        raise IncompatibleBlocks(f"producer {link.address} does not describe its KV heads (another TP size)")
    why = check_pages(our_heads, theirs_heads)
    if why:
        raise IncompatibleBlocks(why)
    if len(ours.pages) != len(our_heads.inner):
        raise IncompatibleBlocks(f"KV regions: ours {len(ours.pages)}, head layout {len(our_heads.inner)}")
    their_pages = [inner * len(theirs_heads.heads) for inner in our_heads.inner]
    per_block = sum(ours.pages)
    if per_block == 0 or chunk_bytes % per_block:
        raise ChannelError(f"a {chunk_bytes}-byte chunk is not a whole number of our {per_block}-byte blocks")
    bpc = chunk_bytes // per_block
    direct = all(c.slot < 0 for c in chunks)
    if not direct and not all(c.slot >= 0 for c in chunks):
        raise ChannelError(f"producer {link.address}: a hand-off mixes host slots and KV blocks")
    # the producer's page addresses of each chunk's positions, region by region
    starts: list[list[list[int]]] = []  # per chunk: per region: page addresses
    if direct:
        theirs = link.blocks
        if theirs is None:
            raise ChannelError(f"producer {link.address} exposes no KV blocks (its pd.mode is not direct)")
        if list(theirs.pages) != their_pages:
            raise IncompatibleBlocks(f"KV page bytes per region: producer {list(theirs.pages)[:4]}..., "
                                     f"expected {their_pages[:4]}... for its {len(theirs_heads.heads)} heads")
        tag_index = _source_blocks(link, theirs, segments, chunks)
        starts.extend([[a + b * s for b in src] for a, s in zip(theirs.addrs, theirs.strides)] for src in tag_index)
        tags_addr, tag_count, mem, path = link.block_tags_addr, theirs.num_blocks, theirs.mem_type, PEER_DEVICE_TO_DEVICE
    else:
        slots = _slots(link, chunks)
        if link.slot_bytes != sum(their_pages) * bpc:
            raise ChannelError(f"producer {link.address}: {link.slot_bytes}-byte slots, expected "
                               f"{sum(their_pages) * bpc} for its {len(theirs_heads.heads)} heads")
        planes = link.slot_planes
        if planes is not None and list(planes.pages) != their_pages:
            raise IncompatibleBlocks(f"host slab planes: pages {list(planes.pages)[:4]}..., expected {their_pages[:4]}...")
        offsets = region_offsets(their_pages, bpc)
        for seg, slot in zip(segments, slots):
            if seg.first_block < 0 or seg.first_block + len(seg.block_ids) > bpc:
                raise ChannelError(f"producer {link.address}: positions overflow a {bpc}-block chunk")
            pos = range(seg.first_block, seg.first_block + len(seg.block_ids))
            if planes is not None:
                starts.append([[a + (slot * bpc + p) * s for p in pos] for a, s in zip(planes.addrs, planes.strides)])
            else:
                base = link.slab_addr + slot * link.slot_bytes
                starts.append([[base + off + p * page for p in pos] for off, page in zip(offsets, their_pages)])
        tag_index = [[s] for s in slots]
        tags_addr, tag_count, mem, path = link.tags_addr, link.num_slots, "DRAM", PEER_HOST_TO_DEVICE
    device = (ours.device_id, link.blocks.device_id if direct and link.blocks is not None else 0)

    def descs(idx: list[int]) -> tuple[np.ndarray, np.ndarray]:
        our_addr = [[ours.addrs[r] + b * ours.strides[r] for i in idx for b in segments[i].block_ids]
                    for r in range(len(ours.pages))]
        their_addr = [[a for i in idx for a in starts[i][r]] for r in range(len(ours.pages))]
        return head_descs(runs, our_heads.inner, our_addr, their_addr, device)

    return ReadPlan(descs, mem, tags_addr, tag_count, tag_index, path)
