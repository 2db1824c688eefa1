"""vLLM 0.32's CUDA KV layouts on real CUDA tensors, through the host tier and the P/D descriptors.

The GPU machine has no vLLM: the views come from the tables of
tiercache/testing/vllm_views.py (``use_vllm=False``), which
tests/unit/test_vllm_layouts.py proves equal to vLLM's own views for every case.
Each case that vLLM can hand a connector on CUDA (backend x layout x kernel-block
ratio, bfloat16 and fp8's uint8) round-trips through a TransferEngine on the
device's KV (slab layouts ``slots`` and ``planes``), checked token by token
(tiercache/testing/layout_checks.py), and a consumer's blocks filled through
the P/D descriptors (via_host planes, direct) hold the producer's tokens.

Every test runs on ``cpu`` too (the same body, CPU KV), so its logic is checked
on any machine; the ``cuda`` runs skip without CUDA. Nothing here imports vLLM.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import pytest
import torch

from tiercache.config.schema import FaultConfig
from tiercache.layout import KVBlockLayout, LayoutError
from tiercache.pd.blocks import BlockRegions, paired_descs, plane_descs
from tiercache.testing import layout_checks as lc
from tiercache.testing.job_builders import make_job
from tiercache.testing.vllm_views import (
    NO_LAYER_PAGE,
    KVViews,
    ViewCase,
    all_cases,
    build_views,
    token_bytes,
    why_unreachable,
)
from tiercache.transfer.engine import TransferEngine

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")]),
]
CASES = [c for c in all_cases(dtypes=(torch.bfloat16, torch.uint8))
         if not why_unreachable(c) and c.layout not in NO_LAYER_PAGE]


def views_on(case: ViewCase, device: str) -> KVViews:
    views = build_views(case, device=device, use_vllm=False)
    assert views.source == "table" and views.raw.device.type == device
    return views


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slot_layout", ["slots", "planes"])
@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_round_trip_through_the_host_tier(case: ViewCase, slot_layout: str, device: str) -> None:
    views = views_on(case, device)
    lc.round_trip(views, slot_layout, seed=len(str(case)))  # type: ignore[arg-type]


@pytest.mark.parametrize("device", DEVICES)
def test_negative_control_corrupted_loads_fail_the_check(device: str) -> None:
    """The engine's ``corrupt_loads`` (loaded blocks zeroed) must fail the same round trip."""
    views = views_on(ViewCase(backend="FLASHINFER", layout="LBHNC", ratio=2, block_size=128), device)
    with pytest.raises(AssertionError, match="differs"):
        lc.round_trip(views, "planes", faults=FaultConfig(corrupt_loads=True))


def _copier(device: str) -> Callable[[int, int, int], object]:
    """How a NIXL READ is simulated here: memmove on the host, cudaMemcpy (UVA, any direction) on CUDA."""
    if device == "cpu":
        return lambda dst, src, n: ctypes.memmove(dst, src, n)
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - not installed, or no CUDA runtime it can load
        pytest.skip(f"the CUDA P/D check copies with cupy's cudaMemcpy: cupy does not import ({exc!r})")
    return lambda dst, src, n: cupy.cuda.runtime.memcpy(dst, src, n, 4)  # cudaMemcpyDefault


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == torch.bfloat16], ids=str)
def test_pd_descriptors_land_every_token_where_it_belongs(case: ViewCase, device: str) -> None:
    copy = _copier(device)
    plan = lc.random_plan(case.num_blocks, seed=4)
    producer = views_on(case, device)
    producer.fill_random(9)
    tokens = {name: token_bytes(producer, name).cpu() for name in producer.kv_caches}
    layout = KVBlockLayout.from_kv_caches(producer.kv_caches, case.num_blocks, layout_name=case.layout)
    engine = TransferEngine(layout, lc.BLOCKS_PER_CHUNK, lc.NUM_SLOTS, slot_layout="planes")
    try:
        engine.submit(make_job(1, "req", "store", [b"k%d" % s.slot for s in plan.stores], plan.stores))
        assert [r.ok for r in engine.wait_all()] == [True]
        assert engine.planes is not None
        for mode in ("planes", "direct"):
            consumer = views_on(case, device)
            ours = BlockRegions.from_layout(KVBlockLayout.from_kv_caches(consumer.kv_caches, case.num_blocks))
            assert ours.mem_type == ("VRAM" if device == "cuda" else "DRAM")
            if mode == "planes":
                local, remote = plane_descs(ours, BlockRegions.from_planes(engine.planes), lc.NUM_SLOTS,
                                            [s.slot for s in plan.loads], [s.first_block for s in plan.loads],
                                            [s.block_ids for s in plan.loads])
            else:
                pairs = plan.pairs()
                local, remote = paired_descs(ours, BlockRegions.from_layout(layout),
                                             [d for _, d in pairs], [s for s, _ in pairs])
            assert np.array_equal(local[:, 1], remote[:, 1])
            for (dst, n, _), (src, _, _) in zip(local.tolist(), remote.tolist()):
                copy(dst, src, n)
            lc.check_loaded(consumer, tokens, plan)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", NO_LAYER_PAGE)
def test_layouts_without_layer_pages_are_refused(layout: str, device: str) -> None:
    views = views_on(ViewCase(backend="TRITON_ATTN", layout=layout), device)
    with pytest.raises(LayoutError, match=f"KV-cache layout {layout}: layer model.layers.0"):
        KVBlockLayout.from_kv_caches(views.kv_caches, views.num_blocks, layout_name=layout)
