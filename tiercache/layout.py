"""The engine's paged KV cache seen as bytes per block, and a chunk slot's layout.

vLLM hands the worker one tensor per attention layer. Whatever its shape, each
holds, for every engine block, one or more contiguous byte runs ("pages"): a
tensor shaped ``(num_blocks, ...)`` has one page per block, one shaped
``(2, num_blocks, ...)`` (K and V apart) has two. :class:`KVBlockLayout` finds
the block dimension of each tensor and exposes every page run as a
``(num_blocks, page_bytes)`` uint8 view, a *region*.

A chunk slot in the host tier is laid out region-major::

    [region 0: block 0 page | block 1 page | ... | block n-1 page][region 1: ...]...

so copying one region of a chunk is one contiguous destination run.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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
        return tuple(itertools.accumulate((p * blocks_per_chunk for p in self.page_bytes), initial=0))[:-1]

    @classmethod
    def from_kv_caches(cls, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> "KVBlockLayout":
        """Build the layout from vLLM's ``{layer_name: tensor}`` (layers sharing memory count once)."""
        if not kv_caches:
            raise LayoutError("no KV cache tensors were registered")
        regions: list[torch.Tensor] = []
        seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
        for name, tensor in kv_caches.items():
            ident = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
            if ident in seen:
                continue
            seen.add(ident)
            regions.extend(_regions_of(name, tensor, num_blocks))
        return cls(
            regions=tuple(regions),
            page_bytes=tuple(r.shape[1] for r in regions),
            num_blocks=num_blocks,
        )


def _regions_of(name: str, tensor: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    if tensor.dim() >= 1 and tensor.shape[0] != num_blocks and tensor.shape[0] % num_blocks == 0 and (
        num_blocks not in tuple(tensor.shape)
    ):
        # Kernel blocks smaller than the manager block: group them (a pure view).
        tensor = tensor.unflatten(0, (num_blocks, -1))
    try:
        block_dim = list(tensor.shape).index(num_blocks)
    except ValueError:
        raise LayoutError(
            f"layer {name}: no dimension of size num_blocks={num_blocks} in shape {tuple(tensor.shape)}"
        ) from None
    out: list[torch.Tensor] = []
    for index in itertools.product(*(range(n) for n in tensor.shape[:block_dim])):
        sub = tensor[index] if index else tensor
        if sub.dim() == 1:
            sub = sub.unsqueeze(1)
        if not sub[0].is_contiguous():
            raise LayoutError(
                f"layer {name}: one block's data is not contiguous (shape {tuple(tensor.shape)}, "
                f"stride {tuple(tensor.stride())}); tiercache needs per-block contiguous pages"
            )
        flat = sub.flatten(1)
        out.append(flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat)
    return out


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
