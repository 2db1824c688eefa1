"""Transparent huge pages for P/D memory (tiercache/transfer/huge_pages.py), on this machine's real kernel.

Checks: the 2 MiB-aligned interior is what gets advised; ``MADV_COLLAPSE``
moves touched memory (a KV tensor) onto huge pages without changing a byte,
and ``/proc/self/smaps`` agrees with what the call reports; a slab advised
before its first touch comes up huge; failures (an unmapped range, a range
without an aligned 2 MiB page) are reported, never raised; tensors sharing a
storage are collapsed once; a P/D worker does this to its KV tensors and slab
at ``register_kv_caches`` unless ``pd.huge_pages`` is off.
Tests that need huge pages skip where the kernel offers none (THP ``never``).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
import torch
from tiercache.transfer.host_slab import HostSlab

from tiercache.transfer.huge_pages import (
    HUGE_PAGE_BYTES,
    advise_huge,
    aligned_interior,
    collapse_huge,
    collapse_tensors,
    huge_bytes_in,
)

MIB = 1 << 20
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="this kernel offers no transparent huge pages"
)


def test_aligned_interior() -> None:
    h = HUGE_PAGE_BYTES
    assert aligned_interior(0, 3 * h) == (0, 3 * h)
    assert aligned_interior(1, 3 * h) == (h, 2 * h)  # the ragged ends keep small pages
    assert aligned_interior(h - 4096, 2 * h + 4096) == (h, 2 * h)
    assert aligned_interior(4096, h) == (h, 0)
    assert aligned_interior(h, h - 1) == (h, 0)


def test_a_range_without_an_aligned_huge_page_is_reported_not_raised() -> None:
    buf = np.zeros(MIB, dtype=np.uint8)
    for report in (collapse_huge(int(buf.ctypes.data), buf.nbytes), advise_huge(int(buf.ctypes.data), buf.nbytes)):
        assert report.huge_bytes == 0 and report.failure == "range holds no aligned 2 MiB page"


def test_an_unmapped_range_is_reported_not_raised() -> None:
    area = mmap.mmap(-1, 8 * MIB)
    addr = int(np.frombuffer(area, dtype=np.uint8).ctypes.data)
    area.close()  # now unmapped: madvise says ENOMEM
    report = collapse_huge(addr, 8 * MIB)
    assert report.huge_bytes == 0 and report.failure is not None and "ENOMEM" in report.failure
    assert "0 of 8 MiB" in report.describe() and "ENOMEM" in report.describe()


@needs_thp
def test_collapse_keeps_every_byte_and_smaps_agrees() -> None:
    kv = torch.randn(3, 4 * MIB // 4)  # 12 MiB of touched small pages, like vLLM's zeroed KV cache
    before = kv.clone()
    addr, nbytes = kv.data_ptr(), kv.nbytes
    assert huge_bytes_in(addr, nbytes) == 0
    report = collapse_huge(addr, nbytes)
    _, interior = aligned_interior(addr, nbytes)
    assert report.failure is None, report.describe()
    assert report.huge_bytes == interior >= 10 * MIB
    assert huge_bytes_in(addr, nbytes) == interior
    assert torch.equal(kv, before)


@needs_thp
def test_collapse_tensors_does_each_storage_once_and_skips_other_devices() -> None:
    kv = torch.zeros(2, 8 * MIB // 4)
    kv[1, 5] = 7.0
    views = [kv[0], kv[1], kv.view(-1)]  # one storage, three views
    report = collapse_tensors([*views, torch.empty(4 * MIB, device="meta")])
    assert report.requested_bytes == kv.nbytes and report.huge_bytes >= 14 * MIB
    assert huge_bytes_in(kv.data_ptr(), kv.nbytes) == report.huge_bytes
    assert float(kv.sum()) == 7.0


@needs_thp
def test_a_slab_advised_before_its_first_touch_comes_up_huge() -> None:
    area = mmap.mmap(-1, 16 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # as malloc's (mmap's default is shared)
    buf = np.frombuffer(area, dtype=np.uint8)
    report = advise_huge(int(buf.ctypes.data), buf.nbytes)
    assert report.failure is None and report.huge_bytes >= 14 * MIB
    buf[:: 4096] = 1  # first touch
    assert huge_bytes_in(int(buf.ctypes.data), buf.nbytes) >= 14 * MIB
    del buf
    area.close()


@needs_thp
def test_host_tier_huge_pages_only_when_asked() -> None:
    huge = HostSlab(16, MIB, pin_memory=False, prefault=True, huge_pages=True)
    assert huge.huge_pages is not None and huge.huge_pages.huge_bytes >= 14 * MIB
    assert huge_bytes_in(huge.slab.data_ptr(), huge.slab.nbytes) == huge.huge_pages.huge_bytes
    small = HostSlab(16, MIB, pin_memory=False, prefault=True)
    assert small.huge_pages is None
    lazy = HostSlab(16, MIB, pin_memory=False, huge_pages=True)  # huge pages come with prefaulting only
    assert lazy.huge_pages is None


# ------------------------------------------------------------------ the worker
BLOCKS, BLOCK, HEADS, HEAD_DIM = 64, 32, 4, 64  # two layers of (K/V, blocks, ...) float32: 4 MiB each


@needs_thp
@pytest.mark.parametrize("huge", [True, False])
def test_a_pd_worker_moves_its_kv_tensors_and_slab_to_huge_pages(huge: bool) -> None:
    pytest.importorskip("vllm")
    pytest.importorskip("nixl._api")
    from tiercache.connector.engine_info import ChunkGeometry, EngineGeometry
    from tiercache.connector.worker import TierCacheWorker

    from tiercache.config.schema import load_config

    config = load_config(chunk_tokens=BLOCK, tiers=[{"name": "cpu", "backend": "cpu", "capacity": "8MiB"}],
                         pd={"huge_pages": huge})
    per_block = 2 * 2 * BLOCK * HEADS * HEAD_DIM * 4
    engine = EngineGeometry(model="m", kv_dtype="torch.float32", kv_layout="NHD", block_size=BLOCK, tp_size=1,
                            world_size=1, bytes_per_block=per_block, hash_algo="sha256")
    worker = TierCacheWorker(config, ChunkGeometry.build(config, engine), BLOCKS, kv_role="kv_consumer")
    kv = {f"layer.{i}": torch.randn(2, BLOCKS, BLOCK, HEADS, HEAD_DIM) for i in range(2)}
    before = {name: t.clone() for name, t in kv.items()}
    kv_huge_before = sum(huge_bytes_in(t.data_ptr(), t.nbytes) for t in kv.values())  # freed memory reused may be huge already
    try:
        worker.register_kv_caches(kv)
        kv_huge = sum(huge_bytes_in(t.data_ptr(), t.nbytes) for t in kv.values())
        assert worker.engine is not None
        host = worker.engine.engine.host
        if huge:
            assert host.huge_pages is not None and host.huge_pages.huge_bytes >= 4 * MIB
            assert huge_bytes_in(host.slab.data_ptr(), host.slab.nbytes) == host.huge_pages.huge_bytes
            assert kv_huge >= 4 * MIB
        else:
            assert host.huge_pages is None and kv_huge == kv_huge_before
        assert all(torch.equal(kv[name], before[name]) for name in kv)
    finally:
        worker.shutdown()

