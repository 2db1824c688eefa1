"""Every KV layout vLLM 0.32 hands a connector on CUDA, built by vLLM's own code, through tiercache.

The views come from vLLM's ``allocate_kv_cache`` on CPU tensors
(tiercache/testing/vllm_views.py: the same calls both CUDA model runners make),
for the CUDA backends FLASH_ATTN, FLASHINFER, TRITON_ATTN and FLEX_ATTENTION,
every layout each can take (NHD/HND, layer-outer or cross-layer, and the two
vLLM can resolve that tiercache refuses), kernel-block ratios 1, 2, 4, and
float16, bfloat16 and fp8 (vLLM stores it as uint8). Each case:

* round-trips through the host tier (layouts ``slots`` and ``planes``), checked
  token by token and head by head, the host chunk's pages decoded with vLLM's
  strides (tiercache/testing/layout_checks.py);
* reaches a P/D consumer's blocks through the descriptors tiercache/pd/blocks.py
  builds (via_host planes and slots, direct), executed here as memmoves, and a
  block's descriptors cover exactly its bytes as vLLM addresses them, layer by layer;
* a consumer with another layout is refused by the attention identity in the
  namespace fingerprint (the page sizes match, so nothing else would refuse it).

Negative controls: a page walk in logical rather than memory order, one changed
byte, and a cross-layout hand-off all fail the same semantic checks.
"""

from __future__ import annotations

import ast
import ctypes
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from tiercache.keys import Namespace
from tiercache.layout import KVBlockLayout, LayoutError
from tiercache.pd.blocks import BlockRegions, paired_descs, plane_descs, slot_descs
from tiercache.pd.handoff import fingerprint
from tiercache.pd.heads import tp_mismatches
from tiercache.testing import layout_checks as lc
from tiercache.testing.job_builders import make_job
from tiercache.testing.vllm_views import (
    BACKENDS,
    LAYOUTS,
    NO_LAYER_PAGE,
    KVViews,
    ViewCase,
    all_cases,
    backend_class,
    build_views,
    raw_page,
    token_bytes,
    vllm_kernel_block_size,
    why_unreachable,
    with_layout,
)
from tiercache.transfer.engine import TransferEngine

CASES = [c for c in all_cases() if not why_unreachable(c) and c.layout not in NO_LAYER_PAGE]
REFUSED = [c for c in all_cases(dtypes=(torch.float16,), ratios=(1,)) if not why_unreachable(c)
           and c.layout in NO_LAYER_PAGE]


def _ids(cases: list[ViewCase]) -> list[str]:
    return [str(c) for c in cases]


# ------------------------------------------------------------------------ the views themselves


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.uint8], ids=str)
def test_the_table_builds_what_vllm_builds(layout: str, ratio: int, dtype: torch.dtype) -> None:
    """The GPU machine has no vLLM: its views come from the tables, equal to vLLM's for every case."""
    for backend in BACKENDS:
        case = ViewCase(backend=backend, layout=layout, ratio=ratio, block_size=64 * ratio, dtype=dtype)
        try:
            ours = build_views(case, use_vllm=False)
        except ValueError:
            with pytest.raises(ValueError, match="dense"):  # vLLM refuses the same kernel split
                build_views(case, use_vllm=True)
            assert why_unreachable(case)
            continue
        theirs = build_views(case, use_vllm=True)
        assert theirs.source == "vllm" and ours.source == "table"
        assert ours.raw.numel() == theirs.raw.numel() == theirs.kv_cache_config.kv_cache_tensors[0].size
        assert (ours.layer_offsets, ours.block_stride) == (theirs.layer_offsets, theirs.block_stride)
        for name, view in theirs.kv_caches.items():
            mine = ours.kv_caches[name]
            assert (mine.shape, mine.stride(), mine.storage_offset(), mine.dtype) == \
                (view.shape, view.stride(), view.storage_offset(), view.dtype), (case, name)
            assert view.untyped_storage().data_ptr() == theirs.raw.data_ptr()  # one buffer under every layer


def test_vllm_picks_the_ratios_the_cases_use() -> None:
    """prepare_kernel_block_sizes: FlashInfer splits layer-outer blocks into 64-token kernel blocks,
    never cross-layer ones; the others take any multiple of 16 (FLASH_ATTN splits on FA4 GPUs only)."""
    for backend in BACKENDS:
        for layout in ("LBNHC", "LBHNC", "BLNHC", "BLHNC"):
            for ratio in (1, 2, 4):
                case = ViewCase(backend=backend, layout=layout, block_size=64 * ratio)
                splits = backend == "FLASHINFER" and not case.block_outermost
                assert vllm_kernel_block_size(case) == (64 if splits else 64 * ratio), case


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_backend_traits_match_vllm(backend: str) -> None:
    cls, why = backend_class(backend)
    if why:
        pytest.skip(f"{backend}: {why}; its traits are checked against its source instead")
    from vllm.v1.attention.backend import MultipleOf

    traits = BACKENDS[backend]
    sizes = cls.get_supported_kernel_block_sizes()
    assert sizes == ([MultipleOf(16)] if not traits.kernel_block_sizes else list(traits.kernel_block_sizes))
    declared = cls.supported_kv_cache_layouts()
    assert ({lay.name for lay in declared} if declared else set(LAYOUTS)) == set(traits.layouts)
    kv_dtypes = {torch.uint8 if d.startswith("fp8") else torch.float16 for d in cls.supported_kv_cache_dtypes
                 if d.startswith("fp8") or d in ("auto", "float16", "bfloat16")}
    assert (torch.uint8 in kv_dtypes) == (torch.uint8 in traits.kv_dtypes)


def test_flashinfer_traits_match_its_source() -> None:
    """flashinfer.py does not import without FlashInfer: read its kernel sizes and SM100 layouts from the source."""
    import vllm

    source = Path(vllm.__file__).parent / "v1/attention/backends/flashinfer.py"
    cls = next(n for n in ast.walk(ast.parse(source.read_text())) if isinstance(n, ast.ClassDef)
               and n.name == "FlashInferBackend")
    methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
    returns = [r.value for r in ast.walk(methods["get_supported_kernel_block_sizes"]) if isinstance(r, ast.Return)]
    small, large = sorted((ast.literal_eval(r) for r in returns), key=len)
    assert small == list(BACKENDS["FLASHINFER"].kernel_block_sizes)  # without trtllm's large pages
    assert large[:len(small)] == small  # with them (Blackwell GQA): larger sizes, fewer splits
    layouts = [r.value for r in ast.walk(methods["supported_kv_cache_layouts"]) if isinstance(r, ast.Return)]
    sm100 = next(v for v in layouts if isinstance(v, ast.Tuple))  # else super(): any layout with a FlashInfer name
    assert [e.attr for e in sm100.elts] == ["LBHNC", "BLHNC"]  # type: ignore[attr-defined]
    assert set(BACKENDS["FLASHINFER"].layouts) == {"LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC"}


# ------------------------------------------------------------------------ host tier


@pytest.mark.parametrize("slot_layout", ["slots", "planes"])
@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_round_trip_through_the_host_tier(case: ViewCase, slot_layout: str) -> None:
    views = build_views(case)
    assert views.source == "vllm"
    lc.round_trip(views, slot_layout, seed=zlib.crc32(str(case).encode()))  # type: ignore[arg-type]


# ------------------------------------------------------------------------ P/D


def run_descs(local: np.ndarray, remote: np.ndarray) -> None:
    """A NIXL READ, here: copy each remote run into its local run."""
    assert local.shape == remote.shape and np.array_equal(local[:, 1], remote[:, 1])
    for (dst, n, _), (src, _, _) in zip(local.tolist(), remote.tolist()):
        ctypes.memmove(dst, src, n)


def stored_producer(case: ViewCase, slot_layout: str, plan: lc.Plan) -> tuple[KVViews, TransferEngine, dict]:
    """A producer's views and engine after storing ``plan``, and its blocks' tokens."""
    views = build_views(case)
    views.fill_random(7)
    layout = KVBlockLayout.from_kv_caches(views.kv_caches, case.num_blocks, layout_name=case.layout)
    engine = TransferEngine(layout, lc.BLOCKS_PER_CHUNK, lc.NUM_SLOTS, slot_layout=slot_layout)  # type: ignore[arg-type]
    try:
        engine.submit(make_job(1, "req", "store", [b"k%d" % s.slot for s in plan.stores], plan.stores))
        assert [r.ok for r in engine.wait_all()] == [True]
    except BaseException:
        engine.shutdown()
        raise
    return views, engine, {name: token_bytes(views, name) for name in views.kv_caches}


def consumer_descs(mode: str, ours: BlockRegions, engine: TransferEngine,
                   plan: lc.Plan) -> tuple[np.ndarray, np.ndarray]:
    """``mode``'s (local, remote) descriptors for ``plan``'s loads: via_host planes or slots, or direct."""
    slots = [s.slot for s in plan.loads]
    firsts = [s.first_block for s in plan.loads]
    blocks = [s.block_ids for s in plan.loads]
    if mode == "planes":
        assert engine.planes is not None
        return plane_descs(ours, BlockRegions.from_planes(engine.planes), lc.NUM_SLOTS, slots, firsts, blocks)
    if mode == "slots":
        return slot_descs(ours, engine.host.slab.data_ptr(), engine.host.slot_bytes, slots, firsts, blocks)
    theirs = BlockRegions.from_layout(engine.layout)
    pairs = plan.pairs()
    return paired_descs(ours, theirs, [d for _, d in pairs], [s for s, _ in pairs])


def hand_off(producer_case: ViewCase, consumer_case: ViewCase, mode: str) -> tuple[KVViews, dict, lc.Plan]:
    """Store on a producer, read into a fresh consumer through ``mode``'s descriptors."""
    plan = lc.random_plan(producer_case.num_blocks, seed=3)
    _producer, engine, tokens = stored_producer(producer_case, "slots" if mode == "slots" else "planes", plan)
    try:
        consumer = build_views(consumer_case)
        layout = KVBlockLayout.from_kv_caches(consumer.kv_caches, consumer_case.num_blocks)
        ours = BlockRegions.from_layout(layout)
        assert ours.mismatch(BlockRegions.from_layout(engine.layout)) is None
        run_descs(*consumer_descs(mode, ours, engine, plan))  # direct reads _producer's blocks
    finally:
        engine.shutdown()
    return consumer, tokens, plan


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_pd_descriptors_land_every_token_where_it_belongs(case: ViewCase) -> None:
    for mode in ("planes", "slots", "direct"):
        consumer, tokens, plan = hand_off(case, case, mode)
        lc.check_loaded(consumer, tokens, plan)


@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == torch.bfloat16], ids=str)
def test_a_blocks_descriptors_cover_exactly_its_bytes_in_page_order(case: ViewCase) -> None:
    """Mode direct: block ``b``'s local runs are, layer by layer, vLLM's page of ``b`` (KVCacheTensor
    addressing); via_host: the remote runs a block reads hold the producer's pages in that order."""
    plan = lc.random_plan(case.num_blocks, seed=5)
    producer, engine, _ = stored_producer(case, "planes", plan)
    try:
        ours = BlockRegions.from_layout(engine.layout)
        raw = producer.raw.data_ptr()
        (src, dst), *_ = plan.pairs()
        local, remote = paired_descs(ours, ours, [dst], [src])
        want = [(raw + producer.page_span(layer, dst)[0], case.page_bytes) for layer in range(case.num_layers)]
        assert [(a, n) for a, n, _ in local.tolist()] == want
        seg = plan.loads[0]
        _, remote = plane_descs(ours, BlockRegions.from_planes(engine.planes), lc.NUM_SLOTS, [seg.slot],
                                [seg.first_block], [seg.block_ids[:1]])
        source = plan.stores[0].block_ids[seg.first_block]
        read = [ctypes.string_at(a, n) for a, n, _ in remote.tolist()]
        assert read == [raw_page(producer, layer, source).numpy().tobytes() for layer in range(case.num_layers)]
    finally:
        engine.shutdown()


def attention_namespace(views: KVViews, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The P/D fingerprint of an engine registering ``views`` (connector/model_identity.py's identity)."""
    import tiercache.connector.model_identity as mi

    case = views.case
    monkeypatch.setattr(mi, "_backend_names", lambda cfg: case.backend)
    cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=case.block_size, cache_dtype="auto",
                                                       kv_cache_layout=case.layout))
    fields = mi.attention_identity_fields(cfg, views.kv_cache_config, views.kv_caches)  # type: ignore[arg-type]
    ns = Namespace(model="m", kv_dtype=str(case.dtype), kv_layout=case.layout, block_size=case.block_size,
                   chunk_tokens=case.block_size * lc.BLOCKS_PER_CHUNK, tp_size=1,
                   bytes_per_chunk=case.num_layers * case.page_bytes * lc.BLOCKS_PER_CHUNK, hash_algo="sha256",
                   attention_identity=mi.identity_digest(fields))
    return fingerprint(ns)


OTHER_LAYOUTS = [  # (producer, consumer): the same pages per region, other bytes per token and head
    (ViewCase(layout="LBHNC", ratio=2, block_size=128), with_layout(ViewCase(block_size=128), "LBHNC", 1)),
    (ViewCase(layout="LBNHC"), ViewCase(layout="LBHNC")),
    (ViewCase(backend="FLASHINFER", layout="LBHNC", ratio=4, block_size=256),
     ViewCase(backend="FLASHINFER", layout="LBHNC", ratio=2, block_size=256)),
]


@pytest.mark.parametrize("producer_case,consumer_case", OTHER_LAYOUTS, ids=lambda c: str(c))
def test_a_consumer_of_another_layout_is_refused_by_its_attention_identity(
        producer_case: ViewCase, consumer_case: ViewCase, monkeypatch: pytest.MonkeyPatch) -> None:
    theirs = attention_namespace(build_views(producer_case), monkeypatch)
    ours = attention_namespace(build_views(consumer_case), monkeypatch)
    assert any(line.startswith("attention_identity:") for line in tp_mismatches(ours, theirs))
    assert not tp_mismatches(ours, attention_namespace(build_views(consumer_case), monkeypatch))
    # why it must be: the blocks alone match (equal pages), but the tokens would land wrong
    consumer, tokens, plan = hand_off(producer_case, consumer_case, "planes")
    with pytest.raises(AssertionError, match="differs"):
        lc.check_loaded(consumer, tokens, plan)


# ------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("case", REFUSED, ids=_ids(REFUSED))
def test_a_layout_without_layer_pages_is_refused_naming_it(case: ViewCase) -> None:
    views = build_views(case)
    name, view = next(iter(views.kv_caches.items()))
    with pytest.raises(LayoutError) as err:
        KVBlockLayout.from_kv_caches(views.kv_caches, case.num_blocks, layout_name=case.layout)
    text = str(err.value)
    for part in (case.layout, name, f"shape {tuple(view.shape)}", f"stride {tuple(view.stride())}", "LBNHC"):
        assert part in text, (part, text)


def test_the_refusal_stops_the_worker_at_start_up_naming_the_layout() -> None:
    """connector/worker.py passes vLLM's resolved layout name; register_kv_caches is not guarded
    (connector/guard.py), so the error reaches vLLM's start-up."""
    from tiercache.connector.engine_info import ChunkGeometry, EngineGeometry
    from tiercache.connector.worker import TierCacheWorker

    from tiercache.config.schema import load_config

    case = ViewCase(backend="TRITON_ATTN", layout="LHBNC")
    config = load_config(chunk_tokens=2 * case.block_size,
                         tiers=[{"name": "cpu", "backend": "cpu", "capacity": "4MiB"}])
    engine = EngineGeometry(model="m", kv_dtype=str(case.dtype), kv_layout=case.layout, block_size=case.block_size,
                            tp_size=1, world_size=1, bytes_per_block=case.num_layers * case.page_bytes,
                            hash_algo="sha256")
    worker = TierCacheWorker(config, ChunkGeometry.build(config, engine), case.num_blocks)
    with pytest.raises(LayoutError, match=r"KV-cache layout LHBNC: layer model\.layers\.0\.self_attn\.attn"):
        worker.register_kv_caches(build_views(case).kv_caches)


@pytest.mark.parametrize("layout", NO_LAYER_PAGE)
def test_with_one_kv_head_those_layouts_have_pages_and_round_trip(layout: str) -> None:
    """One KV head per rank (TP = heads): the heads no longer split a layer's page."""
    lc.round_trip(build_views(ViewCase(backend="TRITON_ATTN", layout=layout, kv_heads=1)), "planes")


# ------------------------------------------------------------------------ negative controls


def logical_chunk(views: KVViews, layout: KVBlockLayout, seg: Any) -> torch.Tensor:
    """A slot as a walk in logical order would fill it: each page as ``[H, block_size, C]`` token order."""
    out = torch.zeros(layout.slot_bytes(lc.BLOCKS_PER_CHUNK), dtype=torch.uint8)
    offsets = layout.region_offsets(lc.BLOCKS_PER_CHUNK)
    for r, name in enumerate(views.kv_caches):
        tokens = token_bytes(views, name)
        page = layout.page_bytes[r]
        for pos, block in enumerate(seg.block_ids):
            out[offsets[r] + pos * page:offsets[r] + (pos + 1) * page] = tokens[block].reshape(-1)
    return out


@pytest.mark.parametrize("case,caught", [
    (ViewCase(layout="LBHNC", ratio=2, block_size=128), True),  # HND split: the page's bytes are reordered
    (ViewCase(layout="LBNHC"), True),  # NHD: tokens outside heads in memory
    (ViewCase(layout="LBHNC"), False),  # HND unsplit: logical order is memory order, the walk is right
], ids=str)
def test_negative_control_a_logical_page_walk_fails_the_semantic_check(case: ViewCase, caught: bool) -> None:
    views = build_views(case)
    views.fill_random(1)
    layout = KVBlockLayout.from_kv_caches(views.kv_caches, case.num_blocks)
    plan = lc.random_plan(case.num_blocks, seed=2)
    originals = {name: token_bytes(views, name) for name in views.kv_caches}
    chunks = {seg.slot: logical_chunk(views, layout, seg) for seg in plan.stores}
    if not caught:
        lc.check_host_chunks(views, layout, chunks.__getitem__, plan.stores, originals)
        return
    with pytest.raises(AssertionError, match="differs"):
        lc.check_host_chunks(views, layout, chunks.__getitem__, plan.stores, originals)


def test_negative_control_one_changed_byte_is_named() -> None:
    case = ViewCase(backend="FLASHINFER", layout="LBHNC", ratio=4, block_size=256)
    views = build_views(case)
    plan = lc.round_trip(views, "slots")
    now = {name: token_bytes(views, name) for name in views.kv_caches}
    before = {name: torch.zeros_like(t) for name, t in now.items()}
    for src, dst in plan.pairs():
        for name in now:
            before[name][src] = now[name][dst]
    lc.check_loaded(views, before, plan)  # as loaded: passes
    _, dst = plan.pairs()[0]
    name = next(iter(views.kv_caches))
    views.kv_caches[name].view(torch.uint8)[dst * case.ratio + 3, 1, 5, 0] ^= 1  # kernel block 3: tokens 192..
    with pytest.raises(AssertionError, match=f"block {dst} .*head 1 token {3 * 64 + 5} differs"):
        lc.check_loaded(views, before, plan)
