"""The copy plan (tiercache/transfer/copy_plan.py) and its executors, on CPU tensors.

Property test: on randomised block tables (scattered, consecutive, partial
chunks, random slots), for several layouts (K/V apart or together, a
permuted page like vLLM's HND, kernel blocks split, every layer in one shared
buffer as vLLM 0.32 allocates it), the plan executed by ``memmove`` and by the
device gather executor (which runs on CPU tensors too) leaves exactly the bytes
the per-run path (``copy_segments``, the old CUDA path) leaves, for stores and
loads, in slab layouts ``slots`` and ``planes``. A negative control shows the
comparison catches a plan with two host pages swapped.
"""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
import torch

from tiercache.layout import KVBlockLayout, slab_planes
from tiercache.transfer.copy_plan import CopyPlan, PlanGeometry, job_blocks, plan_copy, run_plan_on_host
from tiercache.transfer.cuda_batch import GatherExecutor, _pieces, engine_windows, pick_executor
from tiercache.transfer.device import CopyJob, CopySegment, copy_segments

NUM_BLOCKS = 48
BPC = 4
SLOTS = 10


def shared_buffer_layers(layers: int, heads: int, tokens: int, head: int, hnd: bool, seed: int) -> dict[str, torch.Tensor]:
    """vLLM 0.32's way: one raw buffer for the group, each layer a (2, blocks, ...) view of its part."""
    gen = torch.Generator().manual_seed(seed)
    per_layer = 2 * NUM_BLOCKS * heads * tokens * head
    raw = torch.randn(layers * per_layer, generator=gen)
    out = {}
    for i in range(layers):
        part = raw[i * per_layer:(i + 1) * per_layer]
        if hnd:  # physical (2, blocks, heads, tokens, head), seen as (2, blocks, tokens, heads, head)
            out[f"l{i}"] = part.view(2, NUM_BLOCKS, heads, tokens, head).permute(0, 1, 3, 2, 4)
        else:
            out[f"l{i}"] = part.view(2, NUM_BLOCKS, tokens, heads, head)
    return out


def separate_layers(kv_split: bool, seed: int) -> dict[str, torch.Tensor]:
    """One allocation per layer (older vLLM, tests), unequal head counts."""
    gen = torch.Generator().manual_seed(seed)
    lead = (2, NUM_BLOCKS) if kv_split else (NUM_BLOCKS, 2)
    return {f"l{i}": torch.randn(*lead, 16, 1 + i, 8, generator=gen) for i in range(3)}


def kernel_split_layers(seed: int) -> dict[str, torch.Tensor]:
    """Kernel blocks of half the manager's block: the block dimension is 2 * num_blocks."""
    gen = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randn(2, NUM_BLOCKS * 2, 2, 16, 8, generator=gen) for i in range(2)}


LAYOUTS = {
    "shared-nhd": lambda s: shared_buffer_layers(3, 2, 16, 8, hnd=False, seed=s),
    "shared-hnd": lambda s: shared_buffer_layers(3, 2, 16, 8, hnd=True, seed=s),
    "separate-kv-apart": lambda s: separate_layers(True, s),
    "separate-kv-together": lambda s: separate_layers(False, s),
    "kernel-ratio-2": kernel_split_layers,
}


def random_segments(rng: random.Random) -> tuple[CopySegment, ...]:
    slots = rng.sample(range(SLOTS), rng.randint(1, 4))
    ids = list(range(NUM_BLOCKS))
    rng.shuffle(ids)
    segs = []
    for slot in slots:
        kind = rng.choice(["scattered", "consecutive", "partial"])
        if kind == "consecutive":
            start = rng.randrange(NUM_BLOCKS - BPC)
            blocks = tuple(range(start, start + BPC))
            first = 0
        else:
            first = rng.randrange(BPC) if kind == "partial" else 0
            count = rng.randint(1, BPC - first) if kind == "partial" else BPC
            blocks = tuple(ids.pop() for _ in range(count))
        segs.append(CopySegment(slot, first, blocks))
    return tuple(segs)


def engine_bytes(layout: KVBlockLayout) -> list[torch.Tensor]:
    return [r.clone() for r in layout.regions]


def run_reference(layout: KVBlockLayout, slab: torch.Tensor, job: CopyJob, planes) -> None:
    copy_segments(layout, slab, BPC, job, planes=planes)


def run_memmove(layout: KVBlockLayout, slab: torch.Tensor, job: CopyJob, planes) -> None:
    run_plan_on_host(plan_copy(PlanGeometry.of(layout, slab, BPC, planes), job.direction == "store", job.segments))


def run_gather(layout: KVBlockLayout, slab: torch.Tensor, job: CopyJob, planes) -> None:
    plan = plan_copy(PlanGeometry.of(layout, slab, BPC, planes), job.direction == "store", job.segments)
    GatherExecutor(layout, slab).run(plan)


EXECUTORS = {"memmove": run_memmove, "gather": run_gather}


@pytest.mark.parametrize("slab_layout", ["slots", "planes"])
@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("executor", sorted(EXECUTORS))
def test_plan_matches_the_per_run_path_on_random_block_tables(executor: str, layout_name: str, slab_layout: str) -> None:
    run = EXECUTORS[executor]
    for trial in range(6):
        rng = random.Random(zlib.crc32(repr((executor, layout_name, slab_layout, trial)).encode()))  # not hash(): salted per process
        kvs = LAYOUTS[layout_name](trial)
        layout = KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)
        slot_bytes = layout.slot_bytes(BPC)
        ours = torch.randint(0, 256, (SLOTS, slot_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(trial))
        ref = ours.clone()
        planes_ours = slab_planes(ours, layout.page_bytes, BPC) if slab_layout == "planes" else None
        planes_ref = slab_planes(ref, layout.page_bytes, BPC) if slab_layout == "planes" else None
        segs = random_segments(rng)
        # store: the slabs must match byte for byte
        run(layout, ours, CopyJob(1, "store", segs), planes_ours)
        run_reference(layout, ref, CopyJob(1, "store", segs), planes_ref)
        assert torch.equal(ours, ref)
        # load into other blocks: the engine must match what the reference load leaves
        before = engine_bytes(layout)
        sources = {b for s in segs for b in s.block_ids}  # a target among them could receive its own bytes
        targets = rng.sample(sorted(set(range(NUM_BLOCKS)) - sources), sum(len(s.block_ids) for s in segs))
        load_segs, pos = [], 0
        for s in segs:
            load_segs.append(CopySegment(s.slot, s.first_block, tuple(targets[pos:pos + len(s.block_ids)])))
            pos += len(s.block_ids)
        run(layout, ours, CopyJob(2, "load", tuple(load_segs)), planes_ours)
        after_ours = engine_bytes(layout)
        for region, saved in zip(layout.regions, before):
            region.copy_(saved)
        run_reference(layout, ref, CopyJob(2, "load", tuple(load_segs)), planes_ref)
        for mine, theirs in zip(after_ours, layout.regions):
            assert torch.equal(mine, theirs)
        assert any(not torch.equal(a, b) for a, b in zip(after_ours, before)), "the load changed nothing"


def test_a_plan_with_two_host_pages_swapped_is_caught() -> None:
    """Negative control: the comparison above fails for a plan one swap away from right."""
    kvs = LAYOUTS["shared-nhd"](0)
    layout = KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)
    ours = torch.zeros((SLOTS, layout.slot_bytes(BPC)), dtype=torch.uint8)
    ref = ours.clone()
    segs = (CopySegment(0, 0, (3, 9, 1, 30)),)
    plan = plan_copy(PlanGeometry.of(layout, ours, BPC), True, segs)
    host = plan.host_ptrs.copy()
    host[[0, 1]] = host[[1, 0]]
    run_plan_on_host(CopyPlan(True, plan.engine_ptrs, host, plan.sizes))
    copy_segments(layout, ref, BPC, CopyJob(1, "store", segs))
    assert not torch.equal(ours, ref)


def test_consecutive_blocks_in_consecutive_slots_merge() -> None:
    """A request's blocks adjacent in the engine: one run per region (slots), one per region across slots (planes)."""
    kvs = LAYOUTS["separate-kv-apart"](0)
    layout = KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)
    slab = torch.zeros((SLOTS, layout.slot_bytes(BPC)), dtype=torch.uint8)
    segs = (CopySegment(2, 0, (8, 9, 10, 11)), CopySegment(3, 0, (12, 13, 14, 15)))
    regions = len(layout.regions)
    assert plan_copy(PlanGeometry.of(layout, slab, BPC), True, segs).count == 2 * regions
    planes = slab_planes(slab, layout.page_bytes, BPC)
    plan = plan_copy(PlanGeometry.of(layout, slab, BPC, planes), True, segs)
    assert plan.count == regions
    assert plan.nbytes == 8 * layout.bytes_per_block
    # host side sorted and, per full slot (layout slots), one contiguous range
    slot_plan = plan_copy(PlanGeometry.of(layout, slab, BPC), True, segs)
    assert np.all(np.diff(slot_plan.host_ptrs) > 0)
    starts, lengths = slot_plan.host_runs()
    assert lengths.tolist() == [2 * layout.slot_bytes(BPC)]  # slots 2 and 3 are adjacent


def test_job_blocks_positions() -> None:
    ids, slots, pos = job_blocks((CopySegment(4, 1, (7, 8)), CopySegment(0, 0, (1,)), CopySegment(2, 2, (5, 6))))
    assert ids.tolist() == [7, 8, 1, 5, 6]
    assert slots.tolist() == [4, 4, 0, 2, 2]
    assert pos.tolist() == [1, 2, 0, 2, 3]


def test_pieces_cut_between_runs() -> None:
    sizes = np.asarray([100, 300, 50, 50, 500, 10], np.int64)
    plan = CopyPlan(True, np.arange(6, dtype=np.int64) * 1000, np.arange(6, dtype=np.int64) * 1000, sizes)
    pieces = _pieces(plan, 400)
    assert sum(p.nbytes for p in pieces) == plan.nbytes
    assert [p.sizes.tolist() for p in pieces] == [[100, 300], [50, 50], [500], [10]]
    assert _pieces(plan, 10_000) == (plan,)


def test_one_shared_buffer_is_one_window() -> None:
    layout = KVBlockLayout.from_kv_caches(LAYOUTS["shared-hnd"](0), NUM_BLOCKS)
    assert len(engine_windows(layout)) == 1
    layout = KVBlockLayout.from_kv_caches(LAYOUTS["separate-kv-apart"](0), NUM_BLOCKS)
    assert len(engine_windows(layout)) == 3


def test_auto_sends_large_runs_to_the_batched_dma() -> None:
    from tiercache.transfer.cuda_batch import DMA_RUN_BYTES, AutoExecutor

    class Named:
        def __init__(self, name: str) -> None:
            self.name = name

    auto = AutoExecutor(Named("driver_batch"), Named("gather"))
    one = np.ones(4, np.int64)
    assert auto.pick(CopyPlan(True, one, one, one * DMA_RUN_BYTES)).name == "driver_batch"
    assert auto.pick(CopyPlan(True, one, one, one * (DMA_RUN_BYTES // 2))).name == "gather"
    assert auto.pick(CopyPlan(True, one[:0], one[:0], one[:0])).name == "gather"


def test_auto_on_cpu_picks_the_gather_executor() -> None:
    layout = KVBlockLayout.from_kv_caches(LAYOUTS["shared-nhd"](0), NUM_BLOCKS)
    slab = torch.zeros((SLOTS, layout.slot_bytes(BPC)), dtype=torch.uint8)
    assert pick_executor("auto", layout, slab).name == "gather"
    assert pick_executor("per_run", layout, slab) is None
    with pytest.raises(ValueError, match="vllm_batch"):
        pick_executor("vllm_batch", layout, slab)
