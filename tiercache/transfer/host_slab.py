"""The host-memory tier: one pre-allocated slab of fixed-size chunk slots.

The slab is allocated once, at start-up, from the tier's byte budget (pinned
when CUDA is present, so device copies can be asynchronous DMA), as a
``(num_slots, slot_bytes)`` tensor. The scheduler-side manager hands out slot
numbers; how a chunk's bytes sit in the slab is the TransferEngine's choice
(:mod:`tiercache.layout`): ``slots``, chunk slot ``i`` is row ``i``
(:meth:`HostTier.slot`), or ``planes``, one plane per KV region across
all rows (the row then holds no single chunk).

Ownership: the slab belongs to this object for the life of the worker;
backends and copiers get views and must not keep them past their job.
As a :class:`~tiercache.backend.Backend` it also serves keyed put/get (used by
the conformance kit and by standalone tools), with its own key->slot map.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from tiercache.backend import Backend, JobResult
from tiercache.transfer.huge_pages import HugePageReport, advise_huge, aligned_interior, collapse_huge, huge_bytes_in

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


class HostTier(Backend):
    name = "cpu"

    def __init__(self, num_slots: int, slot_bytes: int, pin_memory: bool | None = None,
                 prefault: bool = False, huge_pages: bool = False) -> None:
        if num_slots <= 0 or slot_bytes <= 0:
            raise ValueError(
                f"host tier needs at least one slot (num_slots={num_slots}, slot_bytes={slot_bytes})"
            )
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.pinned = pin_memory
        # Pageable: untouched pages cost nothing until first written (on Linux),
        # so the budget is reserved, not committed, until chunks arrive, unless
        # ``prefault``. Pinned: the whole slab is committed and page-locked here.
        self.slab = torch.empty((num_slots, slot_bytes), dtype=torch.uint8, pin_memory=pin_memory)
        self._slab_bytes = self.slab.numpy()  # the same memory, for the keyed copies
        self.prefaulted = prefault and not pin_memory
        self.huge_pages: HugePageReport | None = None  # what huge_pages got, if asked
        if self.prefaulted:
            start = time.perf_counter()
            addr, nbytes = int(self._slab_bytes.ctypes.data), self._slab_bytes.nbytes
            # before the first touch, so that it faults in whole 2 MiB pages
            advised = advise_huge(addr, nbytes) if huge_pages else None
            # a NIXL read (CMA) or copy into a page never touched pays a fault per page, which
            # ran ~40x slower (config: tiers.0.options.prefault)
            commit_pages(self._slab_bytes.reshape(-1))
            if advised is not None:
                huge, failure = huge_bytes_in(addr, nbytes), advised.failure
                if failure is None and huge < aligned_interior(addr, nbytes)[1]:
                    # memory the allocator had touched before (a heap, not a fresh mmap): move it
                    failure = collapse_huge(addr, nbytes).failure
                    huge = huge_bytes_in(addr, nbytes)
                self.huge_pages = HugePageReport(nbytes, huge, time.perf_counter() - start, failure)
        # Keyed Backend interface (not used by the connector's slot path).
        self._key_slots: dict[bytes, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self._results: list[JobResult] = []
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def slot(self, index: int) -> torch.Tensor:
        """Row ``index`` of the slab as a 1-D uint8 tensor view (chunk slot ``index`` in layout ``slots``)."""
        return self.slab[index]

    # ---------------------------------------------------- keyed Backend API
    # Copies go through numpy: it reads read-only buffers (bytes) without
    # complaint, refuses to write into them, and copies on this thread only.
    def submit_put(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        start = time.perf_counter()
        ok: list[bytes] = []
        failed: list[bytes] = []
        moved = 0
        for key, view in zip(keys, views):
            src = _bytes_of(view)
            slot = self._key_slots.get(key)
            if src is None or src.size > self.slot_bytes or (slot is None and not self._free):
                failed.append(key)
                continue
            if slot is None:
                slot = self._key_slots[key] = self._free.pop()
            self._slab_bytes[slot, : src.size] = src
            moved += src.size
            ok.append(key)
        self._push(JobResult(job_id, tuple(ok), tuple(failed), moved, time.perf_counter() - start))

    def submit_get(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        start = time.perf_counter()
        ok: list[bytes] = []
        failed: list[bytes] = []
        moved = 0
        for key, view in zip(keys, views):
            slot = self._key_slots.get(key)
            dst = _bytes_of(view)
            if slot is None or dst is None or not dst.flags.writeable or dst.size > self.slot_bytes:
                failed.append(key)
                continue
            dst[...] = self._slab_bytes[slot, : dst.size]
            moved += dst.size
            ok.append(key)
        self._push(JobResult(job_id, tuple(ok), tuple(failed), moved, time.perf_counter() - start))

    def _push(self, result: JobResult) -> None:
        with self._lock:
            self._results.append(result)

    def poll(self) -> list[JobResult]:
        with self._lock:
            results, self._results = self._results, []
        return results

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self._key_slots for k in keys]

    def delete(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            slot = self._key_slots.pop(key, None)
            if slot is not None:
                self._free.append(slot)

    def close(self) -> None:
        self._key_slots.clear()
        self._results.clear()


def _bytes_of(view: memoryview) -> np.ndarray | None:
    """The bytes of ``view`` as a flat uint8 array over the same memory; None if not contiguous."""
    try:
        return np.frombuffer(view, dtype=np.uint8)
    except (ValueError, TypeError, BufferError):
        return None
