"""Store shards (tiercache/shards.py): which heads a rank holds, and cutting chunks by head.

The KV tensors are built as vLLM 0.32 hands them to a connector: a
``[blocks, heads, tokens, content]`` view per layer, head-major in memory on
the CPU backend (LBHNC), token-major on CUDA's default (LBNHC, a permuted
view), and with kernel blocks smaller than the manager's block. The same
global KV is laid out for TP=1 and for both ranks of TP=2; a head's shard must
be the same bytes whichever engine cut it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiercache.layout import KVBlockLayout
from tiercache.shards import (
    HeadSlicer,
    ShardError,
    global_heads,
    group_shards,
    head_shards,
    rank_shards,
)

HEADS, TOKENS, CONTENT, LAYERS, NUM_BLOCKS, BPC = 4, 8, 6, 3, 10, 2


def global_kv(seed: int = 0) -> torch.Tensor:
    """[layers, blocks, heads, tokens, content] float32 values of one model."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, NUM_BLOCKS, HEADS, TOKENS, CONTENT, generator=g)


def rank_caches(kv: torch.Tensor, heads: tuple[int, ...], layout: str, kernel_split: int = 1) -> dict[str, torch.Tensor]:
    """The per-layer tensors one rank registers, holding global heads ``heads``."""
    out = {}
    for layer in range(LAYERS):
        part = kv[layer][:, list(heads)]  # [B, H, N, C]
        if kernel_split > 1:  # kernel blocks of TOKENS / split tokens: [B * split, H, N / split, C]
            b, h, n, c = part.shape
            part = part.reshape(b, h, kernel_split, n // kernel_split, c).permute(0, 2, 1, 3, 4)
            part = part.reshape(b * kernel_split, h, n // kernel_split, c)
        if layout == "LBHNC":
            out[f"l{layer}"] = part.contiguous()
        else:  # LBNHC: memory [B, N, H, C], seen as a [B, H, N, C] view
            out[f"l{layer}"] = part.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    return out


def chunk_bytes(caches: dict[str, torch.Tensor], blocks: list[int]) -> np.ndarray:
    layout = KVBlockLayout.from_kv_caches(caches, NUM_BLOCKS)
    return np.concatenate([r[blocks].numpy().reshape(-1) for r in layout.regions])


def shards_of(caches: dict[str, torch.Tensor], local: int, blocks: list[int]) -> list[bytes]:
    slicer = HeadSlicer.from_kv_caches(caches, NUM_BLOCKS, local, BPC)
    data = chunk_bytes(caches, blocks)
    out = []
    for head in range(local):
        buf = np.empty(slicer.shard_bytes, dtype=np.uint8)
        slicer.cut(data, head, buf)
        out.append(buf.tobytes())
    return out


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("kernel_split", [1, 2])
def test_a_heads_shard_is_the_same_bytes_at_any_tp_size(layout: str, kernel_split: int) -> None:
    kv = global_kv()
    blocks = [7, 2]
    tp1 = shards_of(rank_caches(kv, (0, 1, 2, 3), layout, kernel_split), 4, blocks)
    tp2 = [s for r in range(2) for s in shards_of(rank_caches(kv, global_heads(4, 2, r), layout, kernel_split), 2, blocks)]
    tp4 = [shards_of(rank_caches(kv, global_heads(4, 4, r), layout, kernel_split), 1, blocks)[0] for r in range(4)]
    assert tp1 == tp2 == tp4
    assert len(set(tp1)) == 4  # four different heads


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_join_restores_the_chunk_from_its_shards(layout: str) -> None:
    caches = rank_caches(global_kv(1), (0, 1, 2, 3), layout)
    slicer = HeadSlicer.from_kv_caches(caches, NUM_BLOCKS, 4, BPC)
    data = chunk_bytes(caches, [3, 4])
    rebuilt = np.zeros_like(data)
    for head in range(4):
        buf = np.empty(slicer.shard_bytes, dtype=np.uint8)
        slicer.cut(data, head, buf)
        slicer.join(buf, head, rebuilt)
    assert np.array_equal(rebuilt, data)
    assert slicer.shard_bytes * 4 == data.size == slicer.chunk_bytes


def test_a_page_map_without_a_middle_head_dim_is_cut_by_index() -> None:
    head_map = np.array([0, 1, 1, 0, 1, 0], dtype=np.int16)  # no outer x heads x inner form
    slicer = HeadSlicer([head_map], 2, 1)
    data = np.arange(6, dtype=np.uint8)
    out = np.empty(3, dtype=np.uint8)
    slicer.cut(data, 1, out)
    assert out.tolist() == [1, 2, 4]


def test_unequal_heads_are_refused() -> None:
    with pytest.raises(ShardError):
        HeadSlicer([np.array([0, 0, 1], dtype=np.int16)], 2, 1)


def test_which_heads_each_rank_holds_and_writes() -> None:
    assert global_heads(8, 1, 0) == tuple(range(8))
    assert global_heads(8, 4, 3) == (6, 7)
    # more ranks than heads: each holds one replicated head; the first holder writes it
    assert [global_heads(2, 4, r) for r in range(4)] == [(0,), (0,), (1,), (1,)]
    assert [head_shards(2, 4, r).writes for r in range(4)] == [(0,), (), (1,), ()]
    with pytest.raises(ShardError):
        global_heads(6, 4, 0)


def test_shard_keys_name_the_head_not_the_rank() -> None:
    key = b"k" * 44
    tp1, rank1 = head_shards(4, 1, 0), head_shards(4, 2, 1)
    assert rank1.read_keys(key) == tp1.read_keys(key)[2:]
    assert len(set(tp1.read_keys(key))) == 4
    assert all(k.startswith(key) and len(k) == len(key) + 6 for k in tp1.read_keys(key))
    # pipeline stages hold other layers: other keys
    assert head_shards(4, 1, 0, pp_rank=1, pp_size=2).read_keys(key)[0] != tp1.read_keys(key)[0]
    # the scheduler asks for every head of every stage
    assert len(group_shards(4, pp_size=2).read_keys(key)) == 8
    # rank shards never equal head shards, and carry the TP size
    assert set(rank_shards(2, 0).read_keys(key)).isdisjoint(head_shards(4, 2, 0).read_keys(key))
    assert rank_shards(2, 0).read_keys(key) != rank_shards(4, 0).read_keys(key)
