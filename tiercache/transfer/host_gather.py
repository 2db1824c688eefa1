"""The numpy gather/scatter engine behind the CPU copier (see tiercache/transfer/device.py).

Engine memory is viewed as flat numpy arrays of fixed-size items so that one
``take`` (store) or fancy assignment (load) moves a whole segment, every layer
at once, on the calling thread with the GIL released.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np
import torch

from tiercache.layout import KVBlockLayout
from tiercache.transfer.device import CopyJob, check_segment

# Below this item size a numpy take/put moves too few bytes per item to pay off.
MIN_ITEM_BYTES = 64
# Items are cut down to this size, if need be, so that all regions share one window.
SHARED_ITEM_BYTES = 1024
# numpy's fancy assignment releases the GIL only for more items than this
# (NPY_BEGIN_THREADS_THRESHOLDED); ``take`` always releases it.
GIL_FREE_ITEMS = 500
# Loads cut items down to this size at most to get there; smaller ones cost more
# per byte than holding the GIL through a small chunk's copy.
MIN_LOAD_ITEM_BYTES = 256


@dataclass(frozen=True)
class _RegionGroup:
    """Consecutive regions with the same page, block stride and window: one numpy call."""

    window: np.ndarray  # items of engine memory that hold every page of these regions
    first_items: np.ndarray  # (regions, 1) int64: item index of each region's block 0 in the window
    stride_items: int  # items from one block to the next
    page_items: int  # items per page
    slot_offset: int  # items from the start of a slot to this group's first region
    count: int  # regions in the group
    load_split: int  # loads address 1/load_split items, so a chunk's load releases the GIL
    load_window: np.ndarray  # the window in those smaller items


class HostSegmentCopier:
    """Copies a segment between host-resident engine blocks and a slot with a few numpy calls.

    Engine memory is seen as flat numpy arrays (*windows*, each from its lowest
    region address to the end of its highest) of fixed-size items of
    ``item_bytes``, the greatest common divisor of every page size and block
    stride; so is the slab. A segment's pages are then a list of item indices:
    a store is one ``take`` (gather into the slot), a load one fancy-index
    assignment (scatter into the engine), per group of alike regions. Regions
    whose addresses differ by a multiple of the item size share one window, so
    with the large, page-aligned tensors of a real engine one call covers all
    layers (small tensors from the heap sit at drifting offsets: more calls).

    A window never owns memory and may span gaps between allocations, so it is
    only ever touched by ``take`` (reads the indexed items) and fancy
    assignment (writes them); never by ``np.put``, which copies its whole
    destination (gaps included: a crash) when that overlaps the values. :func:`check_segment` bounds
    every index first, windows never span the slab, and the layout keeps the
    engine tensors alive for the life of the copier.
    """

    def __init__(
        self,
        layout: KVBlockLayout,
        slab: torch.Tensor,
        blocks_per_chunk: int,
        item_bytes: int,
        groups: tuple[_RegionGroup, ...],
    ) -> None:
        self.layout = layout
        self.blocks_per_chunk = blocks_per_chunk
        self.item_bytes = item_bytes
        self.groups = groups
        self._num_slots = slab.shape[0]
        slab_bytes = slab.numpy()
        # The slab in items of each size the groups use: 1 (stores), load_split (loads).
        self._slots = {
            scale: slab_bytes.view(np.dtype((np.void, item_bytes // scale)))
            for scale in {1, *(g.load_split for g in groups)}
        }
        longest = max(g.page_items * g.load_split for g in groups)
        self._item_range = np.arange(longest, dtype=np.int64)

    @classmethod
    def build(
        cls, layout: KVBlockLayout, slab: torch.Tensor, blocks_per_chunk: int
    ) -> HostSegmentCopier | None:
        """The copier for this layout and slab, or None when they do not fit the scheme."""
        if not _host_bytes(slab) or slab.dim() != 2 or not slab.is_contiguous():
            return None
        if not all(_host_bytes(r) and r.dim() == 2 and r.stride(1) == 1 for r in layout.regions):
            return None
        item = _item_bytes(layout)
        if item < MIN_ITEM_BYTES or slab.shape[1] % item:
            return None
        groups = _region_groups(layout, blocks_per_chunk, item, slab.data_ptr())
        return cls(layout, slab, blocks_per_chunk, item, groups)

    def copy(self, job: CopyJob) -> int:
        """Run every copy of ``job`` on the calling thread; return bytes moved."""
        store = job.direction == "store"
        moved = 0
        for seg in job.segments:
            check_segment(self.layout, self._num_slots, self.blocks_per_chunk, seg)
            if not seg.block_ids:
                continue
            ids = np.asarray(seg.block_ids, dtype=np.int64)
            for group in self.groups:
                moved += self._copy_group(group, seg.slot, seg.first_block, ids, store)
        return moved

    def _copy_group(
        self, group: _RegionGroup, slot_index: int, first: int, ids: np.ndarray, store: bool
    ) -> int:
        scale = 1 if store else group.load_split
        window = group.window if store else group.load_window
        slot = self._slots[scale][slot_index]
        k, n, bpc = group.page_items * scale, ids.size, self.blocks_per_chunk
        # (regions, n): the first item of each page in the window
        pages = group.first_items * scale + ids * (group.stride_items * scale)
        if k > 1:
            pages = (pages[:, :, None] + self._item_range[:k]).reshape(group.count, n * k)
        offset = group.slot_offset * scale
        span = slot[offset : offset + group.count * bpc * k]
        item_bytes = self.item_bytes // scale
        if store and n == bpc:
            # "clip" never clips here (check_segment bounded the ids) but, unlike
            # "raise", writes straight into ``out`` instead of through a temporary.
            window.take(pages.reshape(-1), out=span, mode="clip")
            return span.size * item_bytes
        part = span.reshape(group.count, bpc * k)[:, first * k : (first + n) * k]
        if store:
            part[...] = window.take(pages, mode="clip")
        else:
            window[pages.reshape(-1)] = part.reshape(-1)
        return part.size * item_bytes


def _host_bytes(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype == torch.uint8


def _item_bytes(layout: KVBlockLayout) -> int:
    """The item size: divides every page and block stride, and region offsets if it can.

    Large tensors sit at page-aligned addresses, so cutting 32 KiB pages into
    4 KiB items puts every layer in one window (one numpy call per segment);
    small tensors from the heap sit at 64-byte offsets, too fine a grid: they
    keep whole-page items and a window per offset class instead.
    """
    item = 0
    for region, page in zip(layout.regions, layout.page_bytes):
        item = math.gcd(item, page, region.stride(0) if layout.num_blocks > 1 else 0)
    low = min(r.data_ptr() for r in layout.regions)
    shared = item
    for region in layout.regions:
        shared = math.gcd(shared, region.data_ptr() - low)
    return shared if shared >= min(item, SHARED_ITEM_BYTES) else item


def _region_groups(
    layout: KVBlockLayout, blocks_per_chunk: int, item: int, slab_address: int
) -> tuple[_RegionGroup, ...]:
    """Runs of consecutive regions sharing page size, block stride and window."""
    regions, pages = layout.regions, layout.page_bytes

    def window_key(i: int) -> tuple[int, bool]:
        # Same item grid; and on the same side of the slab, which no window may span.
        return regions[i].data_ptr() % item, regions[i].data_ptr() < slab_address

    windows = _windows(layout, item, window_key)
    offsets = layout.region_offsets(blocks_per_chunk)

    def key(i: int) -> tuple[int, int, tuple[int, bool]]:
        return pages[i], regions[i].stride(0), window_key(i)

    groups: list[_RegionGroup] = []
    start = 0
    while start < len(regions):
        end = start + 1
        while end < len(regions) and key(end) == key(start):
            end += 1
        low, window = windows[window_key(start)]
        firsts = np.array([[(r.data_ptr() - low) // item] for r in regions[start:end]], np.int64)
        split = _load_split(item, (end - start) * blocks_per_chunk * pages[start] // item)
        groups.append(
            _RegionGroup(
                window=window,
                first_items=firsts,
                stride_items=regions[start].stride(0) // item,
                page_items=pages[start] // item,
                slot_offset=offsets[start] // item,
                count=end - start,
                load_split=split,
                load_window=window.view(np.dtype((np.void, item // split))),
            )
        )
        start = end
    return tuple(groups)


def _load_split(item: int, chunk_items: int) -> int:
    """Parts to cut items into so that a whole chunk's load is over GIL_FREE_ITEMS (or 1)."""
    split = 1
    while chunk_items * split <= GIL_FREE_ITEMS:
        split *= 2
    if item % split or item // split < MIN_LOAD_ITEM_BYTES:
        return 1
    return split


def _windows(
    layout: KVBlockLayout, item: int, window_key: Callable[[int], Hashable]
) -> dict[Hashable, tuple[int, np.ndarray]]:
    """One item array per window key: key -> (base address, window over its regions)."""
    spans: dict[Hashable, tuple[int, int]] = {}
    for i, (region, page) in enumerate(zip(layout.regions, layout.page_bytes)):
        low = region.data_ptr()
        high = low + (layout.num_blocks - 1) * region.stride(0) + page
        old_low, old_high = spans.get(window_key(i), (low, high))
        spans[window_key(i)] = (min(old_low, low), max(old_high, high))
    dtype = np.dtype((np.void, item))
    return {
        key: (low, np.frombuffer((ctypes.c_char * (high - low)).from_address(low), dtype=dtype))
        for key, (low, high) in spans.items()
    }


