"""Integrity of a hand-off: one xxh3-64 per chunk position, published by the producer, checked by the consumer.

A chunk is ``blocks_per_chunk`` *positions*; position ``p`` is one KV page per
region (a layer's K or V). Its hash is xxh3-64 over those pages, region by
region, in region order (0 is never a hash: a digest of 0 is taken as 1; 0
means "none published"). Both sides can compute it whatever their memory
layout:

* the producer (mode via_host), from slot ``s`` of its host slab: layout
  ``planes`` (:func:`tiercache.layout.slab_planes`), host block
  ``s * blocks_per_chunk + p`` of every plane; layout ``slots``, region ``r``'s
  page ``p`` at ``region_offsets[r] + p * page[r]`` inside the slot
  (:func:`slot_hashes`), once the copy into the slot finished, before the
  slot's tag names the chunk;
* the consumer, from the KV block the position landed in, after the READ and
  its tag check (:func:`block_hash`), before the chunk is used or stored.

A position's hash covers exactly what one consumer block receives, so a read
that starts mid-chunk, or the prompt's tail, is checked block by block.

Limits (docs/pd.md, Security): mode direct publishes no hashes (the blocks are
the engine's own memory, VRAM on CUDA; hashing every handed-off block on the
producer's step would cost a device-to-host copy); a consumer whose KV blocks
are in GPU memory cannot hash what it received without such a copy; a
consumer of another TP size receives parts of pages. Those chunks are checked
by their tags only, and not stored unless ``pd.store_unverified``.

Memory is read in place through ctypes views of raw addresses (host memory
only); nothing is copied and no reference is kept. Any thread may call these.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import xxhash

from tiercache.layout import region_offsets
from tiercache.pd.blocks import BlockRegions


def _view(addr: int, size: int) -> ctypes.Array[ctypes.c_char]:
    return (ctypes.c_char * size).from_address(addr)


def _digest(h: xxhash.xxh3_64) -> int:
    return h.intdigest() or 1


def hash_pages(spans: Sequence[tuple[int, int]]) -> int:
    """xxh3-64 over the host memory ``(address, bytes)`` spans, in order (never 0)."""
    h = xxhash.xxh3_64()
    for addr, size in spans:
        h.update(_view(addr, size))
    return _digest(h)


def positions_of(slot_bytes: int, pages: Sequence[int]) -> int:
    """Positions per slot (blocks per chunk); ValueError if the slot is not a whole number of them."""
    per = sum(pages)
    if per <= 0 or slot_bytes % per:
        raise ValueError(f"a {slot_bytes}-byte slot is not a whole number of {per}-byte positions")
    return slot_bytes // per


def slot_hashes(slot: int, slab_addr: int, slot_bytes: int, pages: Sequence[int],
                planes: BlockRegions | None) -> list[int]:
    """The hashes of every position of host slot ``slot`` (layout planes when ``planes`` is given, else slots)."""
    bpc = positions_of(slot_bytes, pages)
    if planes is not None:
        return [hash_pages([(a + (slot * bpc + p) * s, page)
                            for a, s, page in zip(planes.addrs, planes.strides, planes.pages)])
                for p in range(bpc)]
    base = slab_addr + slot * slot_bytes
    offsets = region_offsets(pages, bpc)
    return [hash_pages([(base + off + p * page, page) for off, page in zip(offsets, pages)]) for p in range(bpc)]


def block_hash(regions: BlockRegions, block: int) -> int:
    """The hash of what KV block ``block`` holds (host memory only: ``regions.mem_type`` DRAM)."""
    if regions.mem_type != "DRAM":
        raise ValueError("KV blocks in GPU memory cannot be hashed in place")
    return hash_pages([(a + block * s, page) for a, s, page in zip(regions.addrs, regions.strides, regions.pages)])
