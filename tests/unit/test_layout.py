"""Unit tests of KVBlockLayout (tiercache/layout.py): per-block pages of vLLM's KV tensors.

Each test builds the tensors the way a vLLM attention backend shapes them and
checks the regions ``from_kv_caches`` finds: how many, their page sizes, and
above all that region ``r`` row ``b`` *is* block ``b``'s memory (writing
through the region changes exactly that block of the engine tensor).
"""

from __future__ import annotations

import pytest
import torch

from tiercache.layout import KVBlockLayout, LayoutError, block_runs

NUM_BLOCKS = 10
BLOCK, HEADS, HEAD_DIM = 16, 2, 8


def elem_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def assert_region_is_block(region: torch.Tensor, block_view: torch.Tensor, block: int) -> None:
    """Filling region row ``block`` fills exactly ``block_view`` (that block of the layer)."""
    region.zero_()
    region[block].fill_(0xA5)
    as_bytes = block_view.contiguous().view(torch.uint8)
    assert bool((as_bytes == 0xA5).all())


# ------------------------------------------------------------------------- vLLM shapes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_single_page_per_block(dtype: torch.dtype) -> None:
    """(num_blocks, block_size, heads, head_dim): MLA-like, one page per block."""
    kv = torch.zeros(NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM, dtype=dtype)
    layout = KVBlockLayout.from_kv_caches({"layer.0": kv}, NUM_BLOCKS)
    page = BLOCK * HEADS * HEAD_DIM * elem_bytes(dtype)
    assert layout.page_bytes == (page,)
    assert layout.bytes_per_block == page
    assert layout.regions[0].shape == (NUM_BLOCKS, page)
    assert layout.regions[0].dtype == torch.uint8
    assert_region_is_block(layout.regions[0], kv[3], 3)
    assert int(kv.view(torch.uint8).count_nonzero()) == page  # nothing else touched


def test_kv_inside_the_block() -> None:
    """(num_blocks, 2, block_size, heads, head_dim) (FlashInfer): K and V in one page."""
    kv = torch.zeros(NUM_BLOCKS, 2, BLOCK, HEADS, HEAD_DIM)
    layout = KVBlockLayout.from_kv_caches({"layer.0": kv}, NUM_BLOCKS)
    page = 2 * BLOCK * HEADS * HEAD_DIM * 4
    assert layout.page_bytes == (page,)
    assert_region_is_block(layout.regions[0], kv[7], 7)


def test_kv_apart_gives_two_regions() -> None:
    """(2, num_blocks, ...) (FlashAttention): K and V are separate regions, K first."""
    kv = torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM)
    layout = KVBlockLayout.from_kv_caches({"layer.0": kv}, NUM_BLOCKS)
    page = BLOCK * HEADS * HEAD_DIM * 4
    assert layout.page_bytes == (page, page)
    assert layout.bytes_per_block == 2 * page
    assert_region_is_block(layout.regions[0], kv[0, 4], 4)
    assert_region_is_block(layout.regions[1], kv[1, 4], 4)


def test_permuted_page_hnd() -> None:
    """vLLM's HND stride order: logical (2, N, block, heads, dim), heads outer in memory."""
    physical = torch.zeros(2, NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM)
    kv = physical.transpose(2, 3)  # the logical shape vLLM hands over
    assert not kv[0, 0].is_contiguous()
    layout = KVBlockLayout.from_kv_caches({"layer.0": kv}, NUM_BLOCKS)
    assert layout.page_bytes == (BLOCK * HEADS * HEAD_DIM * 4,) * 2
    assert_region_is_block(layout.regions[1], physical[1, 2], 2)


@pytest.mark.parametrize("ratio", [2, 4])
def test_kernel_blocks_grouped(ratio: int) -> None:
    """dim 0 = num_blocks * ratio (kernel blocks smaller than the manager's): grouped."""
    kernel_block = BLOCK // ratio
    kv = torch.zeros(NUM_BLOCKS * ratio, kernel_block, HEADS, HEAD_DIM)
    layout = KVBlockLayout.from_kv_caches({"layer.0": kv}, NUM_BLOCKS)
    assert layout.page_bytes == (BLOCK * HEADS * HEAD_DIM * 4,)
    assert_region_is_block(layout.regions[0], kv[5 * ratio : 6 * ratio], 5)


def test_kernel_blocks_grouped_with_kv_apart() -> None:
    """(2, num_blocks * ratio, kernel_block, ...): two regions of ``ratio`` kernel blocks a page."""
    kv = torch.zeros(2, NUM_BLOCKS * 2, BLOCK // 2, HEADS, HEAD_DIM)
    layout = KVBlockLayout.from_kv_caches({"layer.0": kv}, NUM_BLOCKS)
    assert len(layout.regions) == 2
    assert_region_is_block(layout.regions[1], kv[1, 6:8], 3)


def test_block_dim_is_the_first_match() -> None:
    """A trailing dimension that happens to equal num_blocks must not be taken for it."""
    kv = torch.zeros(NUM_BLOCKS * 2, BLOCK, NUM_BLOCKS, HEAD_DIM)  # heads == num_blocks
    layout = KVBlockLayout.from_kv_caches({"layer.0": kv}, NUM_BLOCKS)
    assert layout.page_bytes == (2 * BLOCK * NUM_BLOCKS * HEAD_DIM * 4,)
    assert_region_is_block(layout.regions[0], kv[2:4], 1)


def test_one_dimensional_tensor() -> None:
    kv = torch.zeros(NUM_BLOCKS, dtype=torch.int32)
    layout = KVBlockLayout.from_kv_caches({"layer.0": kv}, NUM_BLOCKS)
    assert layout.page_bytes == (4,)


def test_layers_in_registration_order() -> None:
    kvs = {
        f"layer.{i}": torch.full((NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM), float(i)) for i in range(3)
    }
    layout = KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)
    assert len(layout.regions) == 3
    for i, region in enumerate(layout.regions):
        assert torch.equal(
            region[0].view(torch.float32), torch.full((BLOCK * HEADS * HEAD_DIM,), float(i))
        )


def test_aliased_layers_counted_once() -> None:
    """vLLM's cross-layer KV sharing registers one tensor under two layer names."""
    shared = torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM)
    other = torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM)
    layout = KVBlockLayout.from_kv_caches(
        {"layer.0": shared, "layer.1": other, "layer.2": shared}, NUM_BLOCKS
    )
    assert len(layout.regions) == 4
    assert layout.bytes_per_block == 4 * BLOCK * HEADS * HEAD_DIM * 4


# ---------------------------------------------------------------------------- refusals
def test_no_block_dimension_names_the_layer() -> None:
    kvs = {
        "model.layers.0.attn": torch.zeros(NUM_BLOCKS, 4),
        "model.layers.1.attn": torch.zeros(3, 7, 9),
    }
    with pytest.raises(LayoutError, match=r"model\.layers\.1\.attn.*num_blocks=10"):
        KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)


def test_scalar_tensor_refused() -> None:
    with pytest.raises(LayoutError, match="layer.0"):
        KVBlockLayout.from_kv_caches({"layer.0": torch.zeros(())}, NUM_BLOCKS)


def test_non_contiguous_pages_refused() -> None:
    """A block's data with holes (a sliced head_dim) is not one byte run."""
    kv = torch.zeros(NUM_BLOCKS, BLOCK, HEADS, 2 * HEAD_DIM)[..., :HEAD_DIM]
    with pytest.raises(LayoutError, match=r"layer\.7.*contiguous"):
        KVBlockLayout.from_kv_caches({"layer.7": kv}, NUM_BLOCKS)


def test_block_dim_inside_the_page_refused() -> None:
    """Blocks interleaved below tokens in memory: a block's bytes are scattered."""
    kv = torch.zeros(BLOCK, NUM_BLOCKS, HEAD_DIM).transpose(0, 1)
    with pytest.raises(LayoutError, match="contiguous"):
        KVBlockLayout.from_kv_caches({"layer.0": kv}, NUM_BLOCKS)


def test_overlapping_blocks_refused() -> None:
    kv = torch.zeros(1, BLOCK).expand(NUM_BLOCKS, BLOCK)
    with pytest.raises(LayoutError):
        KVBlockLayout.from_kv_caches({"layer.0": kv}, NUM_BLOCKS)


def test_empty_mapping_refused() -> None:
    with pytest.raises(LayoutError, match="no KV cache"):
        KVBlockLayout.from_kv_caches({}, NUM_BLOCKS)


# ------------------------------------------------------------------------ slot geometry
def test_slot_bytes_and_region_offsets() -> None:
    kvs = {
        "a": torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM),  # two pages of 1024 B
        "b": torch.zeros(NUM_BLOCKS, BLOCK, HEAD_DIM, dtype=torch.float16),  # one of 256 B
    }
    layout = KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)
    assert layout.page_bytes == (1024, 1024, 256)
    assert layout.bytes_per_block == 2304
    assert layout.slot_bytes(4) == 4 * 2304
    assert layout.region_offsets(4) == (0, 4096, 8192)
    assert layout.region_offsets(1) == (0, 1024, 2048)


def test_layout_device_is_the_tensors() -> None:
    layout = KVBlockLayout.from_kv_caches({"a": torch.zeros(NUM_BLOCKS, 8)}, NUM_BLOCKS)
    assert layout.device == torch.device("cpu")
    assert layout.num_blocks == NUM_BLOCKS


# --------------------------------------------------------------------------- block_runs
@pytest.mark.parametrize(
    ("ids", "runs"),
    [
        ([], []),
        ([7], [(0, 7, 1)]),
        ([3, 4, 5, 6], [(0, 3, 4)]),
        ([9, 2, 3, 4, 8], [(0, 9, 1), (1, 2, 3), (4, 8, 1)]),
        ([5, 4, 3], [(0, 5, 1), (1, 4, 1), (2, 3, 1)]),  # descending ids do not coalesce
        ([1, 1, 2], [(0, 1, 1), (1, 1, 2)]),
        ((0, 1, 10, 11, 12), [(0, 0, 2), (2, 10, 3)]),
    ],
)
def test_block_runs(ids: list[int], runs: list[tuple[int, int, int]]) -> None:
    assert block_runs(ids) == runs


def test_block_runs_cover_every_id_in_order() -> None:
    ids = torch.randperm(200, generator=torch.Generator().manual_seed(1))[:64].tolist()
    ids[10:20] = range(50, 60)
    rebuilt: list[int] = []
    for pos, first, length in block_runs(ids):
        assert pos == len(rebuilt)
        rebuilt.extend(range(first, first + length))
    assert rebuilt == ids
