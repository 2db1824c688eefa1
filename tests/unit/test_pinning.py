"""Unit tests of the host tier's pinned memory (tiercache/transfer/pinning.py, HostSlab's pinned path).

What runs without a GPU: the exact-size mapping (and its 2 MiB-aligned variant),
views sharing it, the rule that memory a live view still uses is never
unmapped, NUMA node discovery from sysfs, ``mbind``, the failure path (no CUDA
runtime here: ``torch.cuda.cudart()`` raises), and the piece-wise registration
and verification logic, driven through the register/unregister/is_pinned
seams with callables that record calls. The worker's one-shot report of
pinned bytes is followed to the scheduler's ``tiercache_host_pinned_bytes``.
The registration itself runs in tests/gpu/test_pinning.py.
"""

from __future__ import annotations

import ctypes
import gc
import logging
from pathlib import Path

import pytest
import torch

from tiercache.transfer import pinning
from tiercache.transfer.host_slab import HostSlab
from tiercache.transfer.pinning import (
    PAGE_BYTES,
    bind_preferred,
    map_anonymous,
    numa_node_of,
    piece_bytes_for,
    pin_host_memory,
    register_pieces,
    sysfs_bus_id,
    unpinned_probes,
)

MIB = 1 << 20


def vm_size() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmSize")


def mapped(addr: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


class FakeCuda:
    """Records register/unregister calls; fails a registration larger than ``max_bytes``."""

    def __init__(self, max_bytes: int | None = None, fail_at: int | None = None) -> None:
        self.max_bytes, self.fail_at = max_bytes, fail_at
        self.calls: list[tuple[str, int, int]] = []
        self.registered: dict[int, int] = {}
        self.probes: list[int] = []

    def register(self, addr: int, nbytes: int, flags: int) -> str | None:
        self.calls.append(("register", addr, nbytes))
        assert flags == pinning.CUDA_HOST_REGISTER_PORTABLE
        if (self.max_bytes is not None and nbytes > self.max_bytes) or addr == self.fail_at:
            return "cuda error 2 (out of memory)"
        self.registered[addr] = nbytes
        return None

    def unregister(self, addr: int) -> str | None:
        self.calls.append(("unregister", addr, 0))
        return None if self.registered.pop(addr, None) is not None else "cuda error 713 (not registered)"

    def is_pinned_at(self, addr: int) -> bool:
        self.probes.append(addr)
        return any(a <= addr < a + n for a, n in self.registered.items())


def test_the_mapping_is_exactly_the_asked_bytes_rounded_up_to_a_page() -> None:
    asked = 3 * MIB + 5  # torch's pinned allocator would take 4 MiB
    before = vm_size()
    t = map_anonymous(asked)
    grew = vm_size() - before
    assert t.dtype == torch.uint8 and t.numel() == 3 * MIB + PAGE_BYTES
    assert t.data_ptr() % PAGE_BYTES == 0
    assert t.numel() <= grew < t.numel() + 2 * MIB  # (a Python arena may come along)


def test_an_aligned_mapping_gives_back_its_slack() -> None:
    align = 64 * MIB
    before = vm_size()
    t = map_anonymous(5 * PAGE_BYTES, align)
    grew = vm_size() - before
    assert t.data_ptr() % align == 0 and t.numel() == 5 * PAGE_BYTES
    # the 64 MiB over-reservation that found the aligned address is unmapped again
    assert t.numel() <= grew < t.numel() + 2 * MIB


def test_views_share_the_mapping() -> None:
    t = map_anonymous(2 * PAGE_BYTES + 1)
    t[PAGE_BYTES + 7] = 42
    raw = (ctypes.c_uint8 * t.numel()).from_address(t.data_ptr())
    assert raw[PAGE_BYTES + 7] == 42
    raw[3] = 9
    assert int(t[3]) == 9 and int(t[2:4].numpy()[1]) == 9


def test_memory_a_live_view_uses_is_not_unmapped() -> None:
    cuda = FakeCuda()
    region = pin_host_memory(PAGE_BYTES * 4, register=cuda.register, unregister=cuda.unregister,
                             is_pinned_at=cuda.is_pinned_at, numa=False)
    addr = region.tensor.data_ptr()
    view = region.tensor[PAGE_BYTES:]
    view.fill_(7)
    region.close()
    del region
    gc.collect()
    assert mapped(addr) and int(view.sum()) == 7 * 3 * PAGE_BYTES  # still there, still readable
    del view
    gc.collect()
    assert not mapped(addr)  # negative control: with the last view, it goes


def test_sysfs_names_and_numa_nodes(tmp_path: Path) -> None:
    assert sysfs_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert sysfs_bus_id("0000:c1:00.0\n") == "0000:c1:00.0"
    for bus, text in (("0000:3b:00.0", "1\n"), ("0000:5e:00.0", "-1\n"), ("0000:86:00.0", "x")):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "numa_node").write_text(text)
    assert numa_node_of("00000000:3B:00.0", tmp_path) == 1
    assert numa_node_of("0000:5E:00.0", tmp_path) is None  # -1: the platform does not say
    assert numa_node_of("0000:86:00.0", tmp_path) is None  # unreadable
    assert numa_node_of("0000:99:00.0", tmp_path) is None  # no such device
    if not torch.cuda.is_available():
        assert pinning.gpu_numa_node() is None


def test_mbind_prefers_the_node_for_untouched_memory() -> None:
    if not Path("/proc/self/numa_maps").exists():
        pytest.skip("no /proc/self/numa_maps")
    bound, free = map_anonymous(4 * PAGE_BYTES, 2 * MIB), map_anonymous(4 * PAGE_BYTES, 2 * MIB)
    why = bind_preferred(bound.data_ptr(), bound.numel(), 0)
    if why is not None and "EPERM" in why:
        pytest.skip(f"mbind not allowed here ({why})")
    assert why is None

    def policy(t: torch.Tensor) -> str:
        with open("/proc/self/numa_maps") as maps:
            return next(line.split()[1] for line in maps if int(line.split()[0], 16) == t.data_ptr())

    assert policy(bound).startswith("prefer") and policy(bound).endswith(":0")
    assert policy(free) == "default"  # negative control: not bound, not preferred


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA (tests/gpu pins for real)")
def test_without_a_cuda_runtime_the_slab_is_pageable_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tiercache")
    host = HostSlab(3, 5000, pin_memory=True)  # torch.cuda.cudart() raises in this build
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "PAGEABLE" in warnings[0].getMessage()
    assert not host.pinned and host.pinned_bytes == 0 and host.numa_node is None
    assert host.pin_failure is not None and "no CUDA runtime" in host.pin_failure
    assert host.describe_pinning().startswith("pageable: no CUDA runtime")
    assert host.slab.shape == (3, 5000) and host.slab.data_ptr() % PAGE_BYTES == 0
    host.slot(2).fill_(5)
    assert int(host.slab[2].sum()) == 5 * 5000 and int(host.slab[1].sum()) == 0
    host.close()
    host.close()  # idempotent


def test_the_pageable_slab_is_as_before() -> None:
    host = HostSlab(3, 5000, pin_memory=False)
    assert not host.pinned and host.pin_failure is None and host.pinned_bytes == 0
    assert host.describe_pinning() == "pageable"
    host.close()
    host.close()


def test_one_call_registers_the_whole_mapping_and_close_unregisters_once() -> None:
    cuda = FakeCuda()
    region = pin_host_memory(3 * 5000, register=cuda.register, unregister=cuda.unregister,
                             is_pinned_at=cuda.is_pinned_at, numa=False)
    addr, size = region.tensor.data_ptr(), 4 * PAGE_BYTES
    assert region.pinned and region.failure is None and region.pinned_bytes == size
    assert cuda.calls == [("register", addr, size)]
    assert sorted(cuda.probes) == [addr, addr + size // 2, addr + size - 1]
    region.close()
    region.close()
    assert cuda.calls[1:] == [("unregister", addr, 0)] and not region.pinned and region.pinned_bytes == 0


def test_a_failed_big_registration_is_retried_in_page_aligned_pieces() -> None:
    cuda = FakeCuda(max_bytes=4 * PAGE_BYTES)
    base, size = 1 << 40, 10 * PAGE_BYTES + PAGE_BYTES  # 11 pages in pieces of 4
    pieces, failure = register_pieces(base, size, cuda.register, cuda.unregister, 4 * PAGE_BYTES)
    assert failure is None
    assert pieces == [(base, 4 * PAGE_BYTES), (base + 4 * PAGE_BYTES, 4 * PAGE_BYTES),
                      (base + 8 * PAGE_BYTES, 3 * PAGE_BYTES)]
    assert cuda.calls[0] == ("register", base, size)  # the whole first
    assert [c[1:] for c in cuda.calls[1:]] == pieces
    assert all(a % PAGE_BYTES == 0 for a, _ in pieces) and sum(n for _, n in pieces) == size
    # negative control: one call that succeeds takes no pieces
    whole, _ = register_pieces(base, size, FakeCuda().register, cuda.unregister, 4 * PAGE_BYTES)
    assert whole == [(base, size)]
    with pytest.raises(ValueError):
        register_pieces(base, size, cuda.register, cuda.unregister, PAGE_BYTES + 1)


def test_a_failing_piece_unregisters_the_pieces_before_it() -> None:
    base = 1 << 40
    cuda = FakeCuda(max_bytes=4 * PAGE_BYTES, fail_at=base + 8 * PAGE_BYTES)
    pieces, failure = register_pieces(base, 12 * PAGE_BYTES, cuda.register, cuda.unregister, 4 * PAGE_BYTES)
    assert pieces == [] and failure is not None and f"at byte {8 * PAGE_BYTES}" in failure
    assert "out of memory" in failure and not cuda.registered
    assert [c for c in cuda.calls if c[0] == "unregister"] == [("unregister", base, 0),
                                                               ("unregister", base + 4 * PAGE_BYTES, 0)]


def test_pin_host_memory_in_pieces_probes_every_piece() -> None:
    cuda = FakeCuda(max_bytes=2 * PAGE_BYTES)
    region = pin_host_memory(5 * PAGE_BYTES - 3, register=cuda.register, unregister=cuda.unregister,
                             is_pinned_at=cuda.is_pinned_at, numa=False, piece_bytes=2 * PAGE_BYTES)
    addr = region.tensor.data_ptr()
    assert region.pinned and region.pinned_bytes == 5 * PAGE_BYTES and len(cuda.registered) == 3
    starts = {addr, addr + 2 * PAGE_BYTES, addr + 4 * PAGE_BYTES}
    assert starts <= set(cuda.probes) and addr + 5 * PAGE_BYTES - 1 in cuda.probes
    region.close()
    assert not cuda.registered


def test_a_registration_cuda_does_not_see_is_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tiercache")
    cuda = FakeCuda()
    region = pin_host_memory(3 * PAGE_BYTES, register=cuda.register, unregister=cuda.unregister,
                             is_pinned_at=lambda a: False, numa=False)
    assert not region.pinned and region.failure is not None and "is_pinned() is False" in region.failure
    assert not cuda.registered  # what was registered is dropped again
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_unpinned_probes_finds_a_hole() -> None:
    cuda = FakeCuda()
    cuda.registered = {0: 100}  # the second piece is not registered
    assert unpinned_probes([(0, 100), (100, 50)], cuda.is_pinned_at) == [100, 125, 149]


def test_pieces_hold_whole_rows_where_they_can() -> None:
    for row in (PAGE_BYTES, 3 * PAGE_BYTES, 1000, 3 * 65536):
        piece = piece_bytes_for(row)
        assert piece % PAGE_BYTES == 0 and piece % row == 0 and pinning.PIECE_BYTES // 2 < piece <= pinning.PIECE_BYTES
    assert piece_bytes_for(None) == pinning.PIECE_BYTES
    assert piece_bytes_for(pinning.PIECE_BYTES + PAGE_BYTES) == pinning.PIECE_BYTES  # rows bigger than a piece


def test_the_workers_pinned_bytes_reach_the_metric_once() -> None:
    pytest.importorskip("vllm")
    from tiercache.connector.engine_info import ChunkGeometry, EngineGeometry
    from tiercache.connector.metadata import TierCacheWorkerMetadata
    from tiercache.connector.scheduler import TierCacheScheduler
    from tiercache.connector.worker import TierCacheWorker

    from tiercache.config.schema import load_config

    block, blocks, heads, head_dim = 32, 32, 2, 8
    config = load_config(chunk_tokens=2 * block, tiers=[{"name": "cpu", "backend": "cpu", "capacity": "1MiB"}])
    engine = EngineGeometry(model="m", kv_dtype="torch.float32", kv_layout="NHD", block_size=block, tp_size=1,
                            world_size=1, bytes_per_block=2 * (2 * block * heads * head_dim * 4), hash_algo="sha256")
    geo = ChunkGeometry.build(config, engine)
    worker = TierCacheWorker(config, geo, blocks)
    worker.register_kv_caches({f"layer.{i}": torch.zeros(2, blocks, block, heads, head_dim) for i in range(2)})
    try:
        first = worker.build_worker_meta()
        assert first is not None and first.host_pinned_bytes == 0  # pageable here
        assert worker.build_worker_meta() is None  # one-shot
    finally:
        worker.shutdown()
    other = TierCacheWorkerMetadata(host_pinned_bytes=1 << 30)
    merged = first.aggregate(TierCacheWorkerMetadata()).aggregate(other)  # a rank with nothing to say
    assert isinstance(merged, TierCacheWorkerMetadata) and merged.host_pinned_bytes == 1 << 30
    sched = TierCacheScheduler(config, geo)
    sched.update_connector_output(merged)
    sched.update_connector_output(TierCacheWorkerMetadata())  # later steps: no change
    value = sched.metrics.sample("tiercache_host_pinned_bytes")
    assert value == float(1 << 30)
