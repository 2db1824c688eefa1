"""The engine's paged KV cache seen as bytes per block, and a chunk slot's layout.

vLLM hands the worker one tensor per attention layer. Whatever its shape, each
holds, for every engine block, one or more contiguous byte runs ("pages"): a
tensor shaped ``(num_blocks, ...)`` has one page per block, one shaped
``(2, num_blocks, ...)`` (K and V apart) has two. :class:`KVBlockLayout` finds
the block dimension of each tensor (the first one of size ``num_blocks``, or of
a multiple of it when the attention kernel's blocks are smaller than the
manager's) and exposes every page run as a ``(num_blocks, page_bytes)`` uint8
view, a *region*. A page is copied as raw bytes in memory order, so a layout
whose dimensions inside a block are permuted (vLLM's HND) works unchanged.
A layout whose block holds no contiguous page per layer (vLLM 0.32's LHBNC
and BHLNC with more than one KV head) is refused with a :class:`LayoutError`
(tests/unit/test_vllm_layouts.py covers every layout vLLM hands over).

A chunk slot in the host tier is laid out region-major::

    [region 0: block 0 page | block 1 page | ... | block n-1 page][region 1: ...]...

so copying one region of a chunk is one contiguous destination run. That is
the chunk's byte format everywhere outside the host slab (lower tiers, the
cache server). Inside the slab a chunk sits in one of two layouts
(:func:`slab_planes`): ``slots``, slot ``i`` is the chunk's bytes as
above at ``i * slot_bytes``; or ``planes``, where the slab is one
*plane* per region, each ``num_slots * blocks_per_chunk`` pages, and chunk
slot ``i``'s region ``r`` is pages ``i * blocks_per_chunk ..`` of plane ``r``.
The second makes the slab look like a paged KV cache of its own, so chunks in
consecutive slots are one byte run per region (a P/D hand-off: a few large
NIXL descriptors, not one per chunk and region).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch


class LayoutError(ValueError):
    """The engine's KV tensors are not in a shape tiercache can address per block."""


@dataclass(frozen=True)
class KVBlockLayout:
    regions: tuple[torch.Tensor, ...]  # each (num_blocks, page_bytes), uint8, a view of engine memory
    page_bytes: tuple[int, ...]
    num_blocks: int

    @property
    def bytes_per_block(self) -> int:
        return sum(self.page_bytes)

    @property
    def device(self) -> torch.device:
        return self.regions[0].device

    def slot_bytes(self, blocks_per_chunk: int) -> int:
        return self.bytes_per_block * blocks_per_chunk

    def region_offsets(self, blocks_per_chunk: int) -> tuple[int, ...]:
        """Byte offset of each region inside a chunk slot."""
        return region_offsets(self.page_bytes, blocks_per_chunk)

    @classmethod
    def from_kv_caches(cls, kv_caches: Mapping[str, torch.Tensor], num_blocks: int,
                       layout_name: str = "") -> KVBlockLayout:
        """Build the layout from vLLM's ``{layer_name: tensor}`` (layers sharing memory count once).

        ``layout_name``: what the engine calls its KV layout (vLLM's resolved KV-cache
        layout, say ``LHBNC``), named in the :class:`LayoutError` of a layout refused here.
        """
        if not kv_caches:
            raise LayoutError("no KV cache tensors were registered")
        regions: list[torch.Tensor] = []
        try:
            for name, tensor in distinct_layers(kv_caches):
                regions.extend(_regions_of(name, tensor, num_blocks))
        except LayoutError as exc:
            if not layout_name:
                raise
            raise LayoutError(f"tiercache cannot use the KV-cache layout {layout_name}: {exc}") from None
        return cls(
            regions=tuple(regions),
            page_bytes=tuple(r.shape[1] for r in regions),
            num_blocks=num_blocks,
        )


def distinct_layers(kv_caches: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of each layer, layers that share one tensor (same memory, shape and
    strides) once: the order every per-region walk of the KV cache follows."""
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, tensor in kv_caches.items():
        ident = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
        if ident not in seen:
            seen.add(ident)
            yield name, tensor


def _page_order(name: str, tensor: torch.Tensor, num_blocks: int) -> tuple[list[int], int]:
    """How a layer tensor (kernel blocks already grouped) is walked: the permutation (dims
    before the block's, the block's, then the page's in memory order) and how many leading
    dims split it into regions."""
    block_dim = _find_block_dim(name, tuple(tensor.shape), num_blocks)
    # Dimensions before the block's (K and V apart, say) split the layer into
    # regions; the ones after it form the page, taken in memory order so that a
    # permuted page (vLLM's HND) is still one dense byte run.
    outer = list(range(block_dim))
    inner = sorted(range(block_dim + 1, tensor.dim()), key=tensor.stride, reverse=True)
    return [*outer, block_dim, *inner], len(outer)


def _grouped(tensor: torch.Tensor, num_blocks: int, block_dim: int) -> torch.Tensor:
    return tensor if tensor.shape[block_dim] == num_blocks else tensor.unflatten(block_dim, (num_blocks, -1))


def _regions_of(name: str, tensor: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """Every page run of one layer's tensor, each as a ``(num_blocks, page_bytes)`` uint8 view."""
    block_dim = _find_block_dim(name, tuple(tensor.shape), num_blocks)
    tensor = _grouped(tensor, num_blocks, block_dim)
    order, n_outer = _page_order(name, tensor, num_blocks)
    ordered = tensor.permute(*order)
    out: list[torch.Tensor] = []
    for index in itertools.product(*(range(ordered.shape[i]) for i in range(n_outer))):
        sub = ordered[index] if index else ordered
        sub = sub.reshape(num_blocks, 1) if sub.dim() == 1 else sub
        _check_pages(name, tensor, sub)
        flat = sub.flatten(1)
        out.append(flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat)
    return out


def region_head_maps(kv_caches: Mapping[str, torch.Tensor], num_blocks: int, local_heads: int) -> list[np.ndarray]:
    """For each region (in :meth:`KVBlockLayout.from_kv_caches`'s order), the local KV head
    of every byte of one page: walks a head-index tensor exactly as :func:`_regions_of`
    walks the layer (tiercache.shards cuts store shards with it)."""
    maps: list[np.ndarray] = []
    for name, tensor in distinct_layers(kv_caches):
        block_dim = _find_block_dim(name, tuple(tensor.shape), num_blocks)
        head_dim = head_dim_of(tuple(tensor.shape), block_dim, local_heads)
        shape = [1] * tensor.dim()
        if head_dim is not None:
            shape[head_dim] = local_heads
        heads = torch.arange(shape[head_dim] if head_dim is not None else 1, dtype=torch.int16)
        heads = heads.view(shape).expand(tensor.shape)
        grouped = _grouped(tensor, num_blocks, block_dim)
        order, n_outer = _page_order(name, grouped, num_blocks)
        ordered = _grouped(heads, num_blocks, block_dim).permute(*order)
        for index in itertools.product(*(range(ordered.shape[i]) for i in range(n_outer))):
            sub = ordered[index] if index else ordered
            page = sub[0].reshape(-1).numpy()
            maps.append(np.repeat(page, tensor.element_size()))
    return maps


def block_dim_of(shape: Sequence[int], num_blocks: int) -> int | None:
    """The first dimension of size ``num_blocks`` or a multiple of it (kernel blocks); None if none."""
    for dim, size in enumerate(shape):
        if size == num_blocks or (size > num_blocks > 0 and size % num_blocks == 0):
            return dim
    return None


def head_dim_of(shape: Sequence[int], block_dim: int, local_heads: int) -> int | None:
    """The head dimension of a layer tensor: vLLM 0.32's ``[blocks, heads, tokens, content]``
    view has it right after the block dimension; otherwise the one dimension of that size."""
    if local_heads == 1:
        return None  # every byte is the one head's
    if len(shape) == 4 and block_dim == 0 and shape[1] == local_heads:
        return 1
    matches = [d for d, n in enumerate(shape) if d != block_dim and n == local_heads]
    if len(matches) == 1:
        return matches[0]
    raise LayoutError(f"cannot tell the KV-head dimension ({local_heads} heads) in shape {tuple(shape)}")


def _find_block_dim(name: str, shape: tuple[int, ...], num_blocks: int) -> int:
    """:func:`block_dim_of`, or a LayoutError naming the layer."""
    dim = block_dim_of(shape, num_blocks)
    if dim is not None:
        return dim
    raise LayoutError(
        f"layer {name}: no dimension of size num_blocks={num_blocks} (or a multiple of it) "
        f"in shape {shape}"
    )


def _check_pages(name: str, tensor: torch.Tensor, sub: torch.Tensor) -> None:
    """Each block's page must be one dense byte run, not overlapping another block's."""
    page = sub[0].numel()
    dense = sub[0].is_contiguous()
    apart = sub.shape[0] == 1 or abs(sub.stride(0)) >= page
    if not (dense and apart):
        raise LayoutError(
            f"layer {name}: one block's data is not a contiguous byte range ({tensor.dtype}, shape "
            f"{tuple(tensor.shape)}, stride {tuple(tensor.stride())}); tiercache needs "
            f"per-block contiguous pages (vLLM's LHBNC and BHLNC cut a layer's block by KV head: "
            f"set VLLM_KV_CACHE_LAYOUT to one of LBNHC, LBHNC, BLNHC, BLHNC your attention backend takes)"
        )


def region_offsets(page_bytes: Sequence[int], blocks_per_chunk: int) -> tuple[int, ...]:
    """Byte offset of each region inside a chunk slot: region ``r``'s pages follow region ``r-1``'s."""
    return tuple(itertools.accumulate((p * blocks_per_chunk for p in page_bytes), initial=0))[:-1]


SlotLayout = Literal["slots", "planes"]


def slab_planes(slab: torch.Tensor, page_bytes: Sequence[int], blocks_per_chunk: int) -> tuple[torch.Tensor, ...]:
    """A planes slab's planes: per region a ``(num_slots * blocks_per_chunk, page)`` uint8 view.

    ``slab`` is the host tier's ``(num_slots, slot_bytes)`` uint8 tensor;
    plane ``r`` starts at ``num_slots * region_offsets[r]``, and host block
    ``slot * blocks_per_chunk + position`` of it is that chunk position's page.
    """
    num_slots, slot_bytes = slab.shape
    if sum(page_bytes) * blocks_per_chunk != slot_bytes:
        raise ValueError(f"{slot_bytes}-byte slots do not hold {blocks_per_chunk} blocks of {sum(page_bytes)} bytes")
    flat = slab.view(-1)
    host_blocks = num_slots * blocks_per_chunk
    return tuple(
        flat[num_slots * start : num_slots * start + host_blocks * page].view(host_blocks, page)
        for start, page in zip(region_offsets(page_bytes, blocks_per_chunk), page_bytes)
    )


def plane_blocks(slot: int, first: int, count: int, blocks_per_chunk: int) -> range:
    """The host blocks of a planes slab holding positions ``first .. first + count - 1`` of chunk slot ``slot``."""
    start = slot * blocks_per_chunk + first
    return range(start, start + count)


def _slot_pages(planes: Sequence[torch.Tensor], slot: int, blocks_per_chunk: int) -> Iterator[tuple[int, np.ndarray]]:
    """Each region's pages of chunk slot ``slot`` (a flat uint8 view) and their offset in the chunk's byte format."""
    blocks = plane_blocks(slot, 0, blocks_per_chunk, blocks_per_chunk)
    start = 0
    for plane in planes:
        pages = plane.numpy()[blocks.start:blocks.stop].reshape(-1)
        yield start, pages
        start += pages.size


def gather_slot(planes: Sequence[torch.Tensor], slot: int, blocks_per_chunk: int, out: np.ndarray) -> None:
    """Copy chunk slot ``slot`` of a planes slab into ``out`` (1-D uint8) in the chunk's byte format."""
    for start, pages in _slot_pages(planes, slot, blocks_per_chunk):
        out[start:start + pages.size] = pages


def scatter_slot(planes: Sequence[torch.Tensor], slot: int, blocks_per_chunk: int, data: np.ndarray) -> None:
    """Copy a chunk in its byte format (1-D uint8 ``data``) into slot ``slot`` of a planes slab."""
    for start, pages in _slot_pages(planes, slot, blocks_per_chunk):
        pages[...] = data[start:start + pages.size]


def paired_runs(ours: Sequence[int], theirs: Sequence[int]) -> list[tuple[int, int]]:
    """Runs ``(position, length)`` over which both id lists count up by one at a time."""
    assert len(ours) == len(theirs)
    runs: list[tuple[int, int]] = []
    i, n = 0, len(ours)
    while i < n:
        j = i + 1
        while j < n and ours[j] == ours[j - 1] + 1 and theirs[j] == theirs[j - 1] + 1:
            j += 1
        runs.append((i, j - i))
        i = j
    return runs


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Coalesce block ids into runs ``(position, first_block_id, length)`` of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    if not block_ids:
        return runs
    start_pos = 0
    start_id = prev = block_ids[0]
    for pos in range(1, len(block_ids)):
        bid = block_ids[pos]
        if bid != prev + 1:
            runs.append((start_pos, start_id, pos - start_pos))
            start_pos, start_id = pos, bid
        prev = bid
    runs.append((start_pos, start_id, len(block_ids) - start_pos))
    return runs
