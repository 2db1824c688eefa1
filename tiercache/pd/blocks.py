"""The engine's KV blocks as NIXL sees them: where a P/D consumer's READs land.

A consumer READs hand-offs straight into its own KV blocks: from the
producer's KV blocks (mode ``direct``: no host copy on either side,
:func:`paired_descs`) or from the producer's host slots (mode ``via_host``:
:func:`plane_descs` for a planes slab, the default, else
:func:`slot_descs`). Both workers describe their paged KV cache the same way, as :class:`BlockRegions`: one entry per region
of :class:`tiercache.layout.KVBlockLayout` (a layer's K or V pages, say), each
``num_blocks`` pages of ``page`` bytes, ``stride`` bytes apart, starting at
``addr``. A block's data is then, per region ``r``, the byte run
``addrs[r] + block * strides[r]`` of ``pages[r]`` bytes.

A transfer's descriptors come from :func:`paired_descs`: per region, one
descriptor per run of blocks that are consecutive on both sides (vLLM hands
out consecutive blocks to a fresh prompt more often than not), so a 2048-token
hand-off of a 16-region model is a few dozen descriptors, not a thousand
pages (measured here: 1.1 GB/s per page, several times that per run).

Pure data and numpy; NIXL agents are driven by :mod:`tiercache.pd.producer`
and :mod:`tiercache.pd.peer_tier`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiercache.layout import KVBlockLayout, block_runs, paired_runs, plane_blocks, region_offsets


@dataclass(frozen=True)
class BlockRegions:
    addrs: tuple[int, ...]
    strides: tuple[int, ...]
    pages: tuple[int, ...]
    num_blocks: int
    mem_type: str  # "DRAM" (CPU engine) or "VRAM" (CUDA engine)
    device_id: int

    @classmethod
    def from_layout(cls, layout: KVBlockLayout) -> BlockRegions:
        device = layout.device
        on_gpu = device.type == "cuda"
        return cls(
            addrs=tuple(int(r.data_ptr()) for r in layout.regions),
            strides=tuple(int(r.stride(0)) for r in layout.regions),  # uint8 views: bytes
            pages=tuple(layout.page_bytes),
            num_blocks=layout.num_blocks,
            mem_type="VRAM" if on_gpu else "DRAM",
            device_id=int(device.index or 0) if on_gpu else 0,
        )

    @classmethod
    def from_planes(cls, planes: Sequence[Any]) -> BlockRegions:
        """A planes host slab's planes (:func:`tiercache.layout.slab_planes`) as blocks: host
        block ``slot * blocks_per_chunk + position`` (host memory, so DRAM even beside a GPU)."""
        return cls(
            addrs=tuple(int(p.data_ptr()) for p in planes),
            strides=tuple(int(p.stride(0)) for p in planes),
            pages=tuple(int(p.shape[1]) for p in planes),
            num_blocks=int(planes[0].shape[0]),
            mem_type="DRAM",
            device_id=0,
        )

    def spans(self) -> list[tuple[int, int, int, str]]:
        """The memory to register with NIXL: every region's extent, overlaps merged."""
        extents = sorted((a, a + (self.num_blocks - 1) * s + p) for a, s, p in zip(self.addrs, self.strides, self.pages))
        merged: list[list[int]] = []
        for lo, hi in extents:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        return [(lo, hi - lo, self.device_id, "") for lo, hi in merged]

    def check_blocks(self, blocks: Sequence[int]) -> None:
        """ValueError unless every id names one of our blocks."""
        if blocks and (min(blocks) < 0 or max(blocks) >= self.num_blocks):
            raise ValueError(f"block id outside 0..{self.num_blocks - 1}")

    def mismatch(self, other: BlockRegions) -> str | None:
        """Why ``other``'s blocks cannot be copied page for page into ours (None: they can)."""
        if len(self.pages) != len(other.pages):
            return f"KV regions: ours {len(self.pages)}, peer {len(other.pages)}"
        if self.pages != other.pages:
            return f"KV page bytes per region: ours {list(self.pages)[:4]}..., peer {list(other.pages)[:4]}..."
        return None

    def to_wire(self) -> dict[str, Any]:
        return {"addrs": list(self.addrs), "strides": list(self.strides), "pages": list(self.pages),
                "num_blocks": self.num_blocks, "mem_type": self.mem_type, "device_id": self.device_id}

    @classmethod
    def from_wire(cls, d: Any) -> BlockRegions:
        """Parse a peer's description; raises ValueError naming what is wrong."""
        if not isinstance(d, dict):
            raise ValueError("KV block description is not a map")
        try:
            regions = cls(
                addrs=tuple(int(x) for x in d["addrs"]),
                strides=tuple(int(x) for x in d["strides"]),
                pages=tuple(int(x) for x in d["pages"]),
                num_blocks=int(d["num_blocks"]),
                mem_type=str(d["mem_type"]),
                device_id=int(d["device_id"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed KV block description: {exc!r}") from exc
        n = len(regions.addrs)
        if not (n and len(regions.strides) == n and len(regions.pages) == n and regions.num_blocks > 0):
            raise ValueError("KV block description: regions, strides and pages differ in length")
        if regions.mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"KV block description: unknown memory type {regions.mem_type!r}")
        return regions


def paired_descs(ours: BlockRegions, theirs: BlockRegions, our_blocks: Sequence[int],
                 their_blocks: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) ``(N, 3)`` descriptor arrays copying ``their_blocks[i]`` into ``our_blocks[i]``.

    Both sides must have the same pages per region (:meth:`BlockRegions.mismatch`)
    and valid block ids (:meth:`BlockRegions.check_blocks`). Blocks consecutive
    on both sides form one descriptor per region where pages are contiguous
    (stride == page).
    """
    runs = paired_runs(our_blocks, their_blocks)
    local: list[tuple[int, int, int]] = []
    remote: list[tuple[int, int, int]] = []
    for r, page in enumerate(ours.pages):
        oa, os_, ta, ts = ours.addrs[r], ours.strides[r], theirs.addrs[r], theirs.strides[r]
        if os_ == page and ts == page:
            for i0, length in runs:
                local.append((oa + our_blocks[i0] * os_, length * page, ours.device_id))
                remote.append((ta + their_blocks[i0] * ts, length * page, theirs.device_id))
        else:
            for ob, tb in zip(our_blocks, their_blocks):
                local.append((oa + ob * os_, page, ours.device_id))
                remote.append((ta + tb * ts, page, theirs.device_id))
    return np.asarray(local, dtype=np.int64).reshape(-1, 3), np.asarray(remote, dtype=np.int64).reshape(-1, 3)


def plane_descs(ours: BlockRegions, planes: BlockRegions, num_slots: int, slots: Sequence[int],
                firsts: Sequence[int], our_blocks: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`slot_descs` for a producer whose slab is planes (it sent its ``planes``).

    Chunk ``i`` is host blocks ``slots[i] * bpc + firsts[i] ..`` of the planes, so the
    whole hand-off pairs host blocks with ours, and every run consecutive on both
    sides (consecutive slots, consecutive blocks) is one descriptor per region.
    ValueError if a chunk overflows its slot or the planes do not match our pages.
    """
    why = ours.mismatch(planes)
    if why:
        raise ValueError(f"host slab planes do not match our blocks: {why}")
    if num_slots <= 0 or planes.num_blocks % num_slots:
        raise ValueError(f"{planes.num_blocks} host blocks do not divide into {num_slots} slots")
    bpc = planes.num_blocks // num_slots
    theirs: list[int] = []
    flat: list[int] = []
    for slot, first, blocks in zip(slots, firsts, our_blocks):
        _check_positions(first, len(blocks), bpc)
        theirs.extend(plane_blocks(slot, first, len(blocks), bpc))
        flat.extend(blocks)
    return paired_descs(ours, planes, flat, theirs)


def slot_descs(ours: BlockRegions, slab_addr: int, slot_bytes: int, slots: Sequence[int],
               firsts: Sequence[int], our_blocks: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) descriptors copying chunks out of a producer's host slots into our blocks.

    A host slot holds one chunk region by region (:meth:`KVBlockLayout.region_offsets`:
    region ``r``'s ``blocks_per_chunk`` pages, then region ``r+1``'s): chunk ``i`` is
    slot ``slots[i]``, its positions ``firsts[i]..`` land in ``our_blocks[i]``. Runs of
    consecutive block ids give one descriptor per region (the slot side is contiguous
    there); the producer has the same layout (fingerprint: model, dtype, chunk size),
    so ``slot_bytes`` must be a whole number of our blocks (ValueError otherwise).
    """
    per_block = sum(ours.pages)
    if per_block == 0 or slot_bytes % per_block:
        raise ValueError(f"a {slot_bytes}-byte host slot is not a whole number of our {per_block}-byte blocks")
    bpc = slot_bytes // per_block
    offsets = region_offsets(ours.pages, bpc)
    local: list[tuple[int, int, int]] = []
    remote: list[tuple[int, int, int]] = []
    for slot, first, blocks in zip(slots, firsts, our_blocks):
        _check_positions(first, len(blocks), bpc)
        base = slab_addr + slot * slot_bytes
        runs = block_runs(blocks)
        for r, page in enumerate(ours.pages):
            addr, stride = ours.addrs[r], ours.strides[r]
            for pos, first_id, length in runs:
                src = base + offsets[r] + (first + pos) * page
                if stride == page:
                    local.append((addr + first_id * stride, length * page, ours.device_id))
                    remote.append((src, length * page, 0))
                else:
                    for k in range(length):
                        local.append((addr + (first_id + k) * stride, page, ours.device_id))
                        remote.append((src + k * page, page, 0))
    return np.asarray(local, dtype=np.int64).reshape(-1, 3), np.asarray(remote, dtype=np.int64).reshape(-1, 3)


def _check_positions(first: int, count: int, blocks_per_chunk: int) -> None:
    """ValueError unless positions ``first .. first + count - 1`` lie inside one chunk."""
    if first < 0 or first + count > blocks_per_chunk:
        raise ValueError(f"positions {first}..{first + count - 1} overflow a {blocks_per_chunk}-block chunk")
