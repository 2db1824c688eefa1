"""Store shards: a chunk as lower tiers hold it, split by the KV heads each part covers.

A host-tier chunk is one TP rank's slice of the KV: its KV heads, every layer
of its pipeline stage. Lower tiers never see that chunk whole. They see its
*store shards*: one shard per global KV head (and per pipeline stage), named
by the head, not by the rank that wrote it::

    shard key = chunk key | kind b"h" | pp stage (1 byte) | head index (2) | head count (2)

So a TP=2 engine's rank 1 writes heads 2-3 of a 4-head model under the same
keys a TP=1 engine writes them, and either engine reads the other's shards
(vLLM's Mooncake store connector shares across TP sizes the same way). A rank
reads and writes the shards of its own heads only, and a chunk is present
only when every shard a reader needs is; a shard that was lost is a failed
load, never another rank's bytes.

When the TP size exceeds the head count, ranks hold replicated heads: the
first rank holding a head writes its shard, every holder reads it. MLA's
latent cache is one head replicated on every rank.

A layout whose pages cannot be cut by head (no head dimension tiercache can
find) falls back to *rank shards*: kind b"r", the rank and the TP size in
place of head index and count. Those share only between engines of equal TP
size, and never collide with head shards.

The byte format of a head shard: for each region of the chunk's byte format
(:mod:`tiercache.layout`), for each block of the chunk, the bytes of that
head in the page's memory order. It does not depend on the TP size, since a
page of ``H`` heads is ``outer x H x inner`` bytes with the same ``outer`` and
``inner`` for any ``H``. :class:`HeadSlicer` finds each region's byte-to-head
map from the registered KV tensors and cuts and joins shards with it.

Who may touch what: :class:`ShardSet` is plain data, built once per process;
a :class:`HeadSlicer` is read-only after construction (any thread).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tiercache.layout import region_head_maps

HEAD_SHARD = b"h"
RANK_SHARD = b"r"
_SUFFIX = struct.Struct(">cBHH")
SHARD_SUFFIX_BYTES = _SUFFIX.size

#: Test hook: every rank reads and writes the plain chunk key (the bug this module prevents).
#: Only negative-control tests set it.
IGNORE_RANK_ENV = "TIERCACHE_TEST_SHARDS_IGNORE_RANK"


class ShardError(ValueError):
    """The engine's parallel layout cannot be split into store shards."""


@dataclass(frozen=True)
class ShardSet:
    """Which store shards one process reads and writes, and how they are named.

    ``reads``: the shards a chunk needs before this process counts it present
    (a worker: its own heads; the scheduler: every head of every stage).
    ``writes``: the shards this process stores (a replica rank of a head that a
    lower rank already writes stores nothing).
    ``local_heads``: for each shard this process holds, its index among the
    heads of this rank's pages (None for the scheduler, which moves no bytes).
    """

    kind: bytes
    pp_rank: int
    count: int  # head shards: the global head count; rank shards: the TP size
    reads: tuple[int, ...]
    writes: tuple[int, ...]
    local_heads: tuple[int, ...] | None
    ignore_rank: bool = False
    pp_size: int = 1
    whole_group: bool = False  # the scheduler: ``reads`` of every pipeline stage

    @property
    def shard_count(self) -> int:
        """Shards of one chunk this process writes (sizes a lower tier's per-chunk footprint)."""
        return 1 if self.ignore_rank else len(self.writes)

    def key(self, chunk_key: bytes, shard: int, pp_rank: int | None = None) -> bytes:
        if self.ignore_rank:
            return chunk_key
        stage = self.pp_rank if pp_rank is None else pp_rank
        return chunk_key + _SUFFIX.pack(self.kind, stage, shard, self.count)

    def read_keys(self, chunk_key: bytes) -> list[bytes]:
        if self.ignore_rank:
            return [chunk_key]
        if self.whole_group:
            return [self.key(chunk_key, s, p) for p in range(self.pp_size) for s in self.reads]
        return [self.key(chunk_key, s) for s in self.reads]

    def write_keys(self, chunk_key: bytes) -> list[bytes]:
        if self.ignore_rank:
            return [chunk_key] if self.writes else []
        return [self.key(chunk_key, s) for s in self.writes]

    @staticmethod
    def chunk_of(shard_key: bytes) -> bytes:
        return shard_key[:-SHARD_SUFFIX_BYTES]


def global_heads(total_heads: int, tp_size: int, tp_rank: int) -> tuple[int, ...]:
    """The global KV heads rank ``tp_rank`` of ``tp_size`` holds, in the order of its pages."""
    if tp_size <= total_heads:
        if total_heads % tp_size:
            raise ShardError(f"{total_heads} KV heads do not split over {tp_size} TP ranks")
        per = total_heads // tp_size
        return tuple(range(tp_rank * per, (tp_rank + 1) * per))
    if tp_size % total_heads:
        raise ShardError(f"{tp_size} TP ranks do not replicate {total_heads} KV heads evenly")
    return (tp_rank * total_heads // tp_size,)


def head_shards(total_heads: int, tp_size: int, tp_rank: int, pp_rank: int = 0, pp_size: int = 1) -> ShardSet:
    """A worker's head shards: it reads its heads and writes those no lower rank also holds."""
    mine = global_heads(total_heads, tp_size, tp_rank)
    replicas = max(1, tp_size // total_heads)
    writes = mine if tp_rank % replicas == 0 else ()
    return ShardSet(HEAD_SHARD, pp_rank, total_heads, mine, writes, tuple(range(len(mine))),
                    ignore_rank=_ignore_rank(), pp_size=pp_size)


def rank_shards(tp_size: int, tp_rank: int, pp_rank: int = 0, pp_size: int = 1) -> ShardSet:
    """A worker whose pages cannot be cut by head: one shard named by its rank."""
    return ShardSet(RANK_SHARD, pp_rank, tp_size, (tp_rank,), (tp_rank,), None,
                    ignore_rank=_ignore_rank(), pp_size=pp_size)


def group_shards(total_heads: int, pp_size: int = 1) -> ShardSet:
    """The scheduler's view: a chunk is present when every head of every stage is."""
    return ShardSet(HEAD_SHARD, 0, total_heads, tuple(range(total_heads)), (), None,
                    ignore_rank=_ignore_rank(), pp_size=pp_size, whole_group=True)


def _ignore_rank() -> bool:
    return os.environ.get(IGNORE_RANK_ENV, "") == "1"


# ---------------------------------------------------------------- byte maps


class HeadSlicer:
    """Cuts a chunk (the region-major byte format) into per-head shards and joins them back.

    ``head_maps[r]`` gives, for each byte of one page of region ``r``, the
    local head it belongs to. When a region's pages are ``outer x H x inner``
    bytes (every vLLM 0.32 attention layout), cutting is a strided numpy copy;
    any other map is cut with an index array.
    """

    def __init__(self, head_maps: Sequence[np.ndarray], local_heads: int, blocks_per_chunk: int) -> None:
        self.local_heads = local_heads
        self.blocks_per_chunk = blocks_per_chunk
        self.page_bytes = tuple(int(m.size) for m in head_maps)
        self._regions = [_RegionCut.build(m, local_heads) for m in head_maps]
        per_head = [sum(r.bytes_of(h) for r in self._regions) * blocks_per_chunk for h in range(local_heads)]
        if len(set(per_head)) != 1:
            raise ShardError(f"heads hold unequal byte counts per chunk: {per_head}")
        self.shard_bytes = per_head[0]
        self.chunk_bytes = sum(self.page_bytes) * blocks_per_chunk

    @classmethod
    def from_kv_caches(cls, kv_caches: Mapping[str, torch.Tensor], num_blocks: int, local_heads: int,
                       blocks_per_chunk: int) -> HeadSlicer:
        """Byte maps of every region, in :meth:`KVBlockLayout.from_kv_caches`'s region order."""
        return cls(region_head_maps(kv_caches, num_blocks, local_heads), local_heads, blocks_per_chunk)

    def _region_views(self, chunk: np.ndarray) -> list[np.ndarray]:
        out, start = [], 0
        for page in self.page_bytes:
            size = page * self.blocks_per_chunk
            out.append(chunk[start:start + size].reshape(self.blocks_per_chunk, page))
            start += size
        return out

    def _pieces(self, chunk: np.ndarray, head: int, shard: np.ndarray) -> Iterator[tuple[_RegionCut, np.ndarray, np.ndarray]]:
        """Per region: its cut, the chunk's pages of it, and the shard's part for them."""
        start = 0
        for pages, cut in zip(self._region_views(chunk), self._regions):
            size = cut.bytes_of(head) * self.blocks_per_chunk
            yield cut, pages, shard[start:start + size].reshape(self.blocks_per_chunk, -1)
            start += size

    def cut(self, chunk: np.ndarray, head: int, out: np.ndarray) -> None:
        """Write local head ``head``'s shard of ``chunk`` (1-D uint8) into ``out``."""
        for cut, pages, part in self._pieces(chunk, head, out):
            cut.take(pages, head, part)

    def join(self, shard: np.ndarray, head: int, chunk: np.ndarray) -> None:
        """Write local head ``head``'s shard ``shard`` into its bytes of ``chunk``."""
        for cut, pages, part in self._pieces(chunk, head, shard):
            cut.put(pages, head, part)


@dataclass(frozen=True)
class _RegionCut:
    """One region's page: ``outer x heads x inner`` bytes, or an index array per head."""

    shape: tuple[int, int, int] | None
    indexes: tuple[np.ndarray, ...]

    @classmethod
    def build(cls, head_map: np.ndarray, heads: int) -> _RegionCut:
        present = np.unique(head_map)
        if present.size == 1:  # a region of one head (heads outside the page, or one head)
            only = int(present[0])
            idx = tuple(np.arange(head_map.size) if h == only else np.empty(0, np.int64) for h in range(heads))
            return cls(None, idx)
        shape = outer_heads_inner(head_map, heads)
        if shape is not None:
            return cls(shape, ())
        return cls(None, tuple(np.flatnonzero(head_map == h) for h in range(heads)))

    def bytes_of(self, head: int) -> int:
        if self.shape is not None:
            return self.shape[0] * self.shape[2]
        return int(self.indexes[head].size)

    def take(self, pages: np.ndarray, head: int, out: np.ndarray) -> None:
        if self.shape is not None:
            outer, heads, inner = self.shape
            out.reshape(-1, outer, inner)[...] = pages.reshape(-1, outer, heads, inner)[:, :, head, :]
        else:
            out[...] = pages[:, self.indexes[head]]

    def put(self, pages: np.ndarray, head: int, data: np.ndarray) -> None:
        if self.shape is not None:
            outer, heads, inner = self.shape
            pages.reshape(-1, outer, heads, inner)[:, :, head, :] = data.reshape(-1, outer, inner)
        else:
            pages[:, self.indexes[head]] = data


def outer_heads_inner(head_map: np.ndarray, heads: int) -> tuple[int, int, int] | None:
    """``(outer, heads, inner)`` if the page is that many bytes with the head in the middle."""
    size = head_map.size
    if size % heads:
        return None
    changes = np.flatnonzero(np.diff(head_map)) + 1
    inner = int(changes[0]) if changes.size else size
    if inner == 0 or size % (heads * inner):
        return None
    outer = size // (heads * inner)
    expected = np.broadcast_to(np.arange(heads).reshape(1, heads, 1), (outer, heads, inner))
    if not np.array_equal(head_map.reshape(outer, heads, inner), expected):
        return None
    return (outer, heads, inner)
