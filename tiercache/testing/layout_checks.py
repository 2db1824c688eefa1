"""Round trips of vLLM-shaped KV views through tiercache's host tier, checked token by token.

:func:`round_trip` stores randomly scattered engine blocks (several chunks, the
last one partial) into host slots through a real
:class:`~tiercache.transfer.engine.TransferEngine`, checks every stored page
*semantically* (:func:`check_host_chunks`: the chunk's page of block ``b``,
decoded with vLLM's own strides, holds block ``b``'s token ``t`` head ``h``),
zeroes the whole KV buffer, loads the chunks back into *other* blocks (one
chunk from mid-chunk on) and checks those blocks token by token, and that
nothing else was written (:func:`check_loaded`). Only the engine's public API is
used (``submit``, ``wait_all``, ``shutdown``; ``host.slab`` and ``planes`` to
read the host tier), so the CUDA copier is checked through the same calls.

Used by tests/unit/test_vllm_layouts.py (CPU) and tests/gpu/test_layouts_cuda.py (CUDA).
The caller owns the views; the engine made here is shut down before returning.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from tiercache.config.schema import FaultConfig
from tiercache.jobs import CopySegment
from tiercache.layout import KVBlockLayout, SlotLayout, gather_slot
from tiercache.testing.job_builders import make_job
from tiercache.testing.vllm_views import KVViews, decode_page, token_bytes
from tiercache.transfer.engine import TransferEngine

BLOCKS_PER_CHUNK = 4
NUM_SLOTS = 8


@dataclass(frozen=True)
class Plan:
    """Store ``stores[i]`` (slot, 0, source blocks), then load ``loads[i]`` (slot, first, other blocks)."""

    stores: tuple[CopySegment, ...]
    loads: tuple[CopySegment, ...]

    def pairs(self) -> list[tuple[int, int]]:
        """(source block, destination block) of every loaded position."""
        return [(src.block_ids[load.first_block + i], dst)
                for src, load in zip(self.stores, self.loads) for i, dst in enumerate(load.block_ids)]


def random_plan(num_blocks: int, seed: int, chunks: int = 4, bpc: int = BLOCKS_PER_CHUNK) -> Plan:
    """``chunks`` chunks of scattered blocks (the last one partial) into scattered slots; loads into
    other blocks, the second chunk from position 1 on."""
    rng = np.random.default_rng(seed)
    sizes = [bpc] * (chunks - 1) + [bpc - 1]
    if sum(sizes) > num_blocks:
        raise ValueError(f"{num_blocks} blocks cannot hold {sum(sizes)}")
    src = [int(b) for b in rng.permutation(num_blocks)[:sum(sizes)]]
    dst = [int(b) for b in rng.permutation(num_blocks)]
    while any(d == s for d, s in zip(dst, src)):  # every block lands somewhere else
        dst = [int(b) for b in rng.permutation(num_blocks)]
    slots = [int(s) for s in rng.permutation(NUM_SLOTS)[:chunks]]
    stores, loads, at = [], [], 0
    for i, (slot, n) in enumerate(zip(slots, sizes)):
        first = 1 if i == 1 else 0
        stores.append(CopySegment(slot, 0, tuple(src[at:at + n])))
        loads.append(CopySegment(slot, first, tuple(dst[at + first:at + n])))
        at += n
    return Plan(tuple(stores), tuple(loads))


def host_chunk(engine: TransferEngine, slot: int) -> torch.Tensor:
    """Chunk slot ``slot`` of the host tier in the chunk's byte format (1-D uint8, a CPU copy)."""
    if engine.planes is None:
        return engine.host.slab[slot].clone()
    out = np.empty(engine.host.slot_bytes, dtype=np.uint8)
    gather_slot(engine.planes, slot, engine.blocks_per_chunk, out)
    return torch.from_numpy(out)


def _first_diff(got: torch.Tensor, want: torch.Tensor) -> str:
    """``head h token t`` of the first (head, token) whose bytes differ, "" if none."""
    bad = (got != want).any(dim=-1).nonzero()
    return f"head {int(bad[0, 0])} token {int(bad[0, 1])}" if len(bad) else ""


def check_host_chunks(views: KVViews, layout: KVBlockLayout, chunk_of: Callable[[int], torch.Tensor],
                      stores: tuple[CopySegment, ...], originals: Mapping[str, torch.Tensor]) -> None:
    """Every stored page, decoded with vLLM's strides, holds its block's tokens (AssertionError naming the first miss)."""
    offsets = layout.region_offsets(BLOCKS_PER_CHUNK)
    names = list(views.kv_caches)
    assert len(names) == len(layout.regions), (names, len(layout.regions))
    for seg in stores:
        chunk = chunk_of(seg.slot)
        for r, name in enumerate(names):
            page = layout.page_bytes[r]
            for pos, block in enumerate(seg.block_ids):
                start = offsets[r] + (seg.first_block + pos) * page
                got = decode_page(chunk[start:start + page], views, name)
                where = _first_diff(got, originals[name][block])
                assert not where, f"host slot {seg.slot} position {pos}, {name} block {block}: {where} differs"


def check_loaded(views: KVViews, originals: Mapping[str, torch.Tensor], plan: Plan) -> None:
    """Each destination block holds its source block's tokens; every other block is still zero."""
    pairs = plan.pairs()
    untouched = sorted(set(range(views.num_blocks)) - {d for _, d in pairs})
    for name, before in originals.items():
        now = token_bytes(views, name).cpu()
        for src, dst in pairs:
            where = _first_diff(now[dst], before[src])
            assert not where, f"{name}: block {dst} (loaded from block {src}'s chunk): {where} differs"
        assert int(now[untouched].count_nonzero()) == 0, f"{name}: a load wrote outside its blocks"


def round_trip(views: KVViews, slot_layout: SlotLayout, seed: int = 0, faults: FaultConfig | None = None) -> Plan:
    """Store, check the host tier, zero the engine, load into other blocks, check (see the module docstring).

    ``faults``: the engine's fault injection (``corrupt_loads``: the negative control).
    """
    case = views.case
    layout = KVBlockLayout.from_kv_caches(views.kv_caches, case.num_blocks, layout_name=case.layout)
    assert layout.bytes_per_block == case.num_layers * case.page_bytes, (layout.page_bytes, case)
    engine = TransferEngine(layout, BLOCKS_PER_CHUNK, NUM_SLOTS, slot_layout=slot_layout, faults=faults)
    try:
        plan = random_plan(case.num_blocks, seed)
        views.fill_random(seed)
        originals = {name: token_bytes(views, name).cpu() for name in views.kv_caches}
        keys = [b"chunk-%d" % s.slot for s in plan.stores]
        engine.submit(make_job(1, "req", "store", keys, plan.stores))
        assert [r.ok for r in engine.wait_all()] == [True]
        check_host_chunks(views, layout, lambda slot: host_chunk(engine, slot), plan.stores, originals)
        views.raw.zero_()
        engine.submit(make_job(2, "req", "load", keys, plan.loads))
        assert [r.ok for r in engine.wait_all()] == [True]  # done: no synchronize of our own
        check_loaded(views, originals, plan)
        return plan
    finally:
        engine.shutdown()
