"""Pins on vLLM's own KV blocks: a P/D producer in mode direct keeps a finished request's blocks.

vLLM's NixlConnector keeps a handed-off request's blocks by *delaying* their
free (``request_finished`` returns True) until the worker reports the request
"finished sending". vLLM then steps the engine, every millisecond or so, for
as long as any such request is held (``Scheduler.has_finished_requests``), even
with nothing to compute. tiercache instead takes its own reference on the
blocks (:meth:`BlockPins.pin`, vLLM's ``BlockPool.touch``, as a prefix-cache hit
does) and lets vLLM free the request at once: the blocks stay allocated, counted
in the KV-cache usage, and out of the free queue, while the engine may go idle.
:meth:`BlockPins.unpin` drops the reference (``BlockPool.free_blocks``) once every
worker has cleared the blocks' tags (connector/pd/scheduler_role.py).

Scheduler thread only, like everything on vLLM's block pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager


class BlockPins(Protocol):
    def pin(self, block_ids: Sequence[int]) -> None: ...

    def unpin(self, block_ids: Sequence[int]) -> None: ...


class VllmBlockPins:
    """References on the blocks of vLLM's (first KV-cache group's) block pool."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    @classmethod
    def of(cls, kv_cache_manager: KVCacheManager) -> VllmBlockPins:
        return cls(kv_cache_manager.block_pool)

    def pin(self, block_ids: Sequence[int]) -> None:
        self.pool.touch([self.pool.blocks[b] for b in block_ids])

    def unpin(self, block_ids: Sequence[int]) -> None:
        # tail blocks first: vLLM's own order for a request's blocks (evicted soonest)
        self.pool.free_blocks([self.pool.blocks[b] for b in reversed(block_ids)])

    def refs(self, block_id: int) -> int:
        """References on one block (tests and diagnostics)."""
        return int(self.pool.blocks[block_id].ref_cnt)
