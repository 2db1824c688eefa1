"""Tests of the pinned host tier on a GPU (tiercache/transfer/pinning.py, HostSlab): run only where CUDA is.

A slab of an odd size is pinned exactly (its page-rounded size, not the next
power of two, and nothing from torch's caching host allocator), CUDA sees it as
page-locked at its start, middle and end, a ``non_blocking`` device-to-host
copy into it returns while the stream is still busy (the negative control: into
pageable memory the same call blocks), a failed registration does not poison
torch's next CUDA call, and ``close()`` unregisters. ``torch.cuda._sleep`` keeps
a stream busy; events, not host timers, say what ran.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from tiercache.transfer import pinning
from tiercache.transfer.host_slab import HostSlab
from tiercache.transfer.pinning import (
    PAGE_BYTES,
    cudart_calls,
    gpu_numa_node,
    round_up,
    torch_is_pinned_at,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MIB = 1 << 20
SLOT = 12 * 1024 + 100  # not a whole number of pages
SLOTS = (1536 * MIB) // SLOT + 1  # about 1.5 GiB: torch's pinned allocator would take 2 GiB
COPY_BYTES = 256 * MIB
SLEEP_CYCLES = 2_000_000_000  # ~1 s of a busy stream on an H100


def host_allocations() -> int | None:
    stats = getattr(torch.cuda, "host_memory_stats", None)
    return None if stats is None else int(stats().get("allocations.current", 0))


TORCH_HOST_ALLOCATIONS: list[int | None] = []  # torch's pinned allocations before and after the slab


@pytest.fixture(scope="module")
def host() -> Iterator[HostSlab]:
    torch.cuda.init()
    TORCH_HOST_ALLOCATIONS.append(host_allocations())
    slab = HostSlab(SLOTS, SLOT)  # pin_memory: CUDA is here
    TORCH_HOST_ALLOCATIONS.append(host_allocations())
    yield slab
    slab.close()


def test_an_odd_sized_slab_is_pinned_exactly(host: HostSlab) -> None:
    total = SLOTS * SLOT
    assert host.pinned and host.pin_failure is None, host.pin_failure
    assert host.pinned_bytes == round_up(total, PAGE_BYTES) < 1 << (total - 1).bit_length()
    assert host.describe_pinning().startswith(f"pinned {host.pinned_bytes} bytes")
    before, after = TORCH_HOST_ALLOCATIONS
    if before is not None:
        assert after == before  # nothing from torch's caching host allocator
    assert host.numa_node in (None, gpu_numa_node())


def test_cuda_sees_the_start_middle_and_end_as_pinned(host: HostSlab) -> None:
    addr, total = host.slab.data_ptr(), SLOTS * SLOT
    for offset in (0, total // 2, total - 1, host.pinned_bytes - 1):
        assert torch_is_pinned_at(addr + offset), offset
    for row in (0, SLOTS // 2, SLOTS - 1):  # torch's own answer for views (it asks about their storage)
        assert host.slot(row).is_pinned()
    assert not torch_is_pinned_at(torch.empty(PAGE_BYTES, dtype=torch.uint8).data_ptr())  # control


def copy_returns_while_the_stream_is_busy(dst: torch.Tensor) -> bool:
    """A non_blocking device-to-host copy into ``dst`` behind ~1 s of GPU sleep: did the call return first?"""
    src = torch.randint(0, 256, (dst.numel(),), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    slept = torch.cuda.Event()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        slept.record(stream)
        dst.copy_(src, non_blocking=True)
    returned_first = not slept.query()  # the GPU still sleeps: the host did not wait for the copy
    stream.synchronize()
    assert torch.equal(dst, src.cpu())  # and the bytes arrived
    return returned_first


def test_a_copy_into_the_pinned_slab_is_asynchronous(host: HostSlab) -> None:
    assert copy_returns_while_the_stream_is_busy(host.slab.view(-1)[PAGE_BYTES: PAGE_BYTES + COPY_BYTES])


def test_a_copy_into_pageable_memory_blocks() -> None:
    # the negative control: the same copy into memory nobody pinned waits for the stream
    pageable = torch.empty(COPY_BYTES, dtype=torch.uint8)
    assert not pageable.is_pinned()
    assert not copy_returns_while_the_stream_is_busy(pageable)


def test_a_failed_registration_leaves_torch_working(host: HostSlab) -> None:
    register, _ = cudart_calls()
    failure = register(host.slab.data_ptr(), PAGE_BYTES, pinning.CUDA_HOST_REGISTER_PORTABLE)
    assert failure is not None  # already registered
    # torch checks cudaGetLastError after its kernel launches: the failure must not surface there
    assert int(torch.arange(10, device="cuda").sum()) == 45


def test_a_failed_registration_left_in_the_runtime_breaks_torch() -> None:
    # the negative control of the test above, in a process of its own: without _cuda_error's
    # cudaGetLastError, torch's next kernel launch raises the registration's error
    code = (
        "import torch\n"
        "c = torch.cuda.cudart(); x = torch.empty(1 << 20, dtype=torch.uint8)\n"
        "assert int(c.cudaHostRegister(x.data_ptr(), 1 << 20, 0)) == 0\n"
        "assert int(c.cudaHostRegister(x.data_ptr(), 1 << 20, 0)) != 0\n"
        "try:\n"
        "    print('fine', int(torch.arange(10, device='cuda').sum()))\n"
        "except Exception as exc:\n"
        "    print('raised', type(exc).__name__)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.startswith("raised"), run.stdout + run.stderr[-2000:]


def test_close_unregisters(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tiercache")
    slab = HostSlab(3, 5000)
    addr = slab.slab.data_ptr()
    assert slab.pinned and slab.pinned_bytes == 4 * PAGE_BYTES and torch_is_pinned_at(addr)
    view = slab.slot(1)
    slab.close()
    slab.close()  # idempotent
    assert not [r for r in caplog.records if r.name.startswith("tiercache")]  # unregistered (failures warn)
    assert not slab.pinned and slab.pinned_bytes == 0
    assert not torch_is_pinned_at(addr) and not view.is_pinned()
    view.fill_(3)  # still mapped: a view outlives the registration, as pageable memory
    assert int(view.sum()) == 3 * 5000
    _, unregister = cudart_calls()
    assert unregister(addr) is not None  # nothing left to unregister
