"""The host slab: the host tier's memory, one pre-allocated slab of fixed-size chunk slots.

The slab is allocated once, at start-up, from the host tier's byte budget, as a
``(num_slots, slot_bytes)`` tensor. When CUDA is present it is pinned, so device
copies can be asynchronous DMA: an exact-size mapping registered with CUDA and
verified (:mod:`tiercache.transfer.pinning`; :attr:`HostSlab.pinned` is true only
when verified, :attr:`HostSlab.pin_failure` says why not). Otherwise it is plain
pageable memory from torch. The scheduler-side manager hands out slot
numbers; how a chunk's bytes sit in the slab is the TransferEngine's choice
(:mod:`tiercache.layout`): ``slots``, chunk slot ``i`` is row ``i``
(:meth:`HostSlab.slot`), or ``planes``, one plane per KV region across
all rows (the row then holds no single chunk).

The host tier (``backend: cpu``, always the first tier) is the core's own, not a
backend plugin: the TransferEngine owns its :class:`HostSlab` for the life of the
worker; lower-tier backends and copiers get views and must not keep them past their
job. :meth:`HostSlab.close` (TransferEngine.shutdown calls it after closing the
copier, so no copy is in flight) drops the pinning; the memory itself goes with
the last tensor viewing it. A keyed put/get over a slab, for the conformance kit and tests, is
:class:`tiercache.testing.memory_backend.MemoryBackend`.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import torch

from tiercache.transfer.huge_pages import (
    HugePageReport,
    advise_huge,
    aligned_interior,
    collapse_huge,
    huge_bytes_in,
)
from tiercache.transfer.pinning import PinnedRegion, pin_host_memory

_PAGE_BYTES = 4096  # the smallest page: touching one byte of each commits the whole slab
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14


def commit_pages(buf: np.ndarray) -> None:
    """Fault in every page of a fresh ``buf`` (1-D, contiguous) for writing, now.

    One ``madvise(MADV_POPULATE_WRITE)`` where the kernel has it (about twice as
    fast as touching: no trap per page), else :func:`touch_pages`.
    """
    addr = int(buf.ctypes.data)
    start = addr - addr % _PAGE_BYTES
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(buf.nbytes + addr - start), _MADV_POPULATE_WRITE) == 0:
            return
    except (OSError, AttributeError):
        pass  # no libc madvise here
    touch_pages(buf)


def touch_pages(buf: np.ndarray) -> None:
    """Write a zero into every page of ``buf`` (1-D, contiguous): it must hold nothing yet."""
    first = (-int(buf.ctypes.data)) % _PAGE_BYTES  # the first page boundary inside buf
    buf[:first] = 0
    buf[first::_PAGE_BYTES] = 0


class HostSlab:
    """``num_slots`` rows of ``slot_bytes`` bytes, committed now or as written (see ``prefault``).

    Plain memory with no state of its own: whoever holds a slot number (the engine's
    copier, a lower tier's job) reads and writes that row; the manager's plans keep two
    writers off one slot.
    """

    def __init__(self, num_slots: int, slot_bytes: int, pin_memory: bool | None = None,
                 prefault: bool = False, huge_pages: bool = False, device: int | None = None) -> None:
        if num_slots <= 0 or slot_bytes <= 0:
            raise ValueError(
                f"host tier needs at least one slot (num_slots={num_slots}, slot_bytes={slot_bytes})"
            )
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.pinned = False  # true only once CUDA sees every piece as page-locked
        self.pin_failure: str | None = None  # why pinning was asked and not had
        self.pinned_bytes = 0  # bytes page-locked: the slab rounded up to a page, or 0
        self.numa_node: int | None = None  # the NUMA node the pinned slab was bound to, if any
        self.huge_pages: HugePageReport | None = None  # what huge_pages got, if asked
        self._region: PinnedRegion | None = None
        if pin_memory:
            # ``device``: the GPU whose NUMA node the memory should be on (default: the current one)
            self._region = pin_host_memory(num_slots * slot_bytes, device, huge_pages, row_bytes=slot_bytes)
            self.slab = self._region.tensor[: num_slots * slot_bytes].view(num_slots, slot_bytes)
            self.pinned, self.pin_failure = self._region.pinned, self._region.failure
            self.pinned_bytes, self.numa_node = self._region.pinned_bytes, self._region.numa_node
            self.huge_pages = self._region.huge_pages
        else:
            # Pageable: untouched pages cost nothing until first written (on Linux),
            # so the budget is reserved, not committed, until chunks arrive, unless
            # ``prefault``. Pinned: the whole slab is committed and page-locked.
            self.slab = torch.empty((num_slots, slot_bytes), dtype=torch.uint8)
        # a slab that should have been pinned and is not is prefaulted as asked
        self.prefaulted = prefault and not self.pinned
        if self.prefaulted:
            self._prefault(huge_pages)

    def _prefault(self, huge_pages: bool) -> None:
        start = time.perf_counter()
        flat = self.slab.numpy().reshape(-1)  # the same memory
        addr, nbytes = int(flat.ctypes.data), flat.nbytes
        # before the first touch, so that it faults in whole 2 MiB pages
        advised = advise_huge(addr, nbytes) if huge_pages else None
        # a NIXL read (CMA) or copy into a page never touched pays a fault per page, which
        # ran ~40x slower (config: tiers.0.options.prefault)
        commit_pages(flat)
        if advised is not None:
            huge, failure = huge_bytes_in(addr, nbytes), advised.failure
            if failure is None and huge < aligned_interior(addr, nbytes)[1]:
                # memory the allocator had touched before (a heap, not a fresh mmap): move it
                failure = collapse_huge(addr, nbytes).failure
                huge = huge_bytes_in(addr, nbytes)
            self.huge_pages = HugePageReport(nbytes, huge, time.perf_counter() - start, failure)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def slot(self, index: int) -> torch.Tensor:
        """Row ``index`` of the slab as a 1-D uint8 tensor view (chunk slot ``index`` in layout ``slots``)."""
        return self.slab[index]

    def describe_pinning(self) -> str:
        """For the worker's start-up log: ``pinned N bytes`` or ``pageable: <why>``."""
        if self.pinned:
            node = "" if self.numa_node is None else f", NUMA node {self.numa_node}"
            return f"pinned {self.pinned_bytes} bytes{node}"
        return f"pageable: {self.pin_failure}" if self.pin_failure else "pageable"

    def close(self) -> None:
        """Unpin (idempotent); the memory goes with the last reference to :attr:`slab` or a view of it.

        Call only once no copy into or out of the slab can be in flight:
        TransferEngine.shutdown closes its copier (which waits for its copies)
        first. Views used afterwards still work, as pageable memory.
        """
        if self._region is not None:
            self._region.close()
            self.pinned, self.pinned_bytes = False, 0
