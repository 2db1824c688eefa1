"""Transparent huge pages for the host memory a peer's NIXL READ touches.

On one host a NIXL READ (UCX over CMA, ``process_vm_readv``) copies on the
reader's CPU and first pins every source page, one ``struct page`` per 4 KiB.
Measured on this project's 2-vCPU VM (docs/performance/history.md, P/D session 6): a
31.5 MiB READ takes 3.3-3.5 ms from 4 KiB pages and 1.3-1.8 ms from 2 MiB
pages. NumPy asks for huge pages on its own for arrays of 4 MiB and more, so a
"raw NIXL" benchmark between two NumPy buffers reads huge pages, while vLLM's
CPU KV cache (a plain ``torch.zeros``) and a plain ``mmap`` slab get 4 KiB
pages unless asked: with the kernel's default THP mode ``madvise`` nothing
else does.

Two calls, both on the 2 MiB-aligned interior of a range (the ragged ends keep
their small pages):

* :func:`advise_huge` - ``MADV_HUGEPAGE`` on memory not yet touched (a fresh
  ``mmap`` slab): its first touch then faults in whole huge pages.
* :func:`collapse_huge` - ``MADV_HUGEPAGE`` then ``MADV_COLLAPSE`` (Linux >= 6.1)
  on memory already touched (vLLM's KV tensors at ``register_kv_caches``):
  the kernel copies each 2 MiB run into a huge page, **keeping its contents**.

Both are best effort: a kernel without the advice, THP disabled, or no free
huge page leaves the memory as it was, and the caller gets a
:class:`HugePageReport` saying how much of the range ended up huge. Linux only;
elsewhere they report 0 and do nothing. Call them from one thread per range,
before the memory is registered with NIXL or shared with another thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux >= 6.1


@dataclass(frozen=True)
class HugePageReport:
    """What one call did: bytes it asked about, bytes now on huge pages, time, and why not more."""

    requested_bytes: int
    huge_bytes: int
    seconds: float
    failure: str | None = None

    def describe(self) -> str:
        done = f"{self.huge_bytes >> 20} of {self.requested_bytes >> 20} MiB on 2 MiB pages in {self.seconds:.2f}s"
        return done if self.failure is None else f"{done} ({self.failure})"


def aligned_interior(addr: int, nbytes: int) -> tuple[int, int]:
    """The 2 MiB-aligned part of ``[addr, addr + nbytes)``: ``(start, length)``, length 0 if none."""
    start = (addr + HUGE_PAGE_BYTES - 1) & ~(HUGE_PAGE_BYTES - 1)
    end = (addr + nbytes) & ~(HUGE_PAGE_BYTES - 1)
    return start, max(0, end - start)


def advise_huge(addr: int, nbytes: int) -> HugePageReport:
    """``MADV_HUGEPAGE`` on the aligned interior of memory not touched yet; its first touch brings huge pages.

    ``huge_bytes`` is what was advised: whether huge pages come is known only after the touch.
    """
    start = time.perf_counter()
    lo, length = aligned_interior(addr, nbytes)
    failure = _madvise(lo, length, _MADV_HUGEPAGE) if length else "range holds no aligned 2 MiB page"
    return HugePageReport(nbytes, 0 if failure else length, time.perf_counter() - start, failure)


def collapse_huge(addr: int, nbytes: int) -> HugePageReport:
    """Move touched memory onto huge pages in place, contents kept (``MADV_HUGEPAGE`` + ``MADV_COLLAPSE``).

    Collapses one huge page at a time so that one that cannot be had (no free
    2 MiB page) costs only itself.
    """
    start = time.perf_counter()
    lo, length = aligned_interior(addr, nbytes)
    if not length:
        return HugePageReport(nbytes, 0, time.perf_counter() - start, "range holds no aligned 2 MiB page")
    failure = _madvise(lo, length, _MADV_HUGEPAGE)
    if failure is not None:
        return HugePageReport(nbytes, 0, time.perf_counter() - start, failure)
    huge = 0
    for page in range(lo, lo + length, HUGE_PAGE_BYTES):
        failure = _madvise(page, HUGE_PAGE_BYTES, _MADV_COLLAPSE)
        if failure is None:
            huge += HUGE_PAGE_BYTES
        elif "EINVAL" in failure:  # the kernel has no MADV_COLLAPSE: no page will do better
            break
    return HugePageReport(nbytes, huge, time.perf_counter() - start, None if huge == length else failure)


def huge_bytes_in(addr: int, nbytes: int) -> int:
    """How many bytes of ``[addr, addr + nbytes)`` this process has on huge pages now (Linux; else 0).

    From ``/proc/self/smaps``: the ``AnonHugePages`` of each mapping the range
    overlaps, counted up to the overlap (a mapping is one region of like
    memory; the slab and a KV tensor of vLLM's size are each their own).
    """
    end = addr + nbytes
    total = 0
    overlap = 0
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    overlap = max(0, min(hi, end) - max(lo, addr))
                elif overlap and head == "AnonHugePages:":
                    total += min(overlap, int(line.split()[1]) << 10)
    except OSError:
        return 0
    return total


def collapse_tensors(tensors: Iterable[torch.Tensor]) -> HugePageReport:
    """:func:`collapse_huge` on the storage of every host-memory tensor, each storage once.

    For vLLM's KV tensors (views of one or several storages). Device tensors are skipped.
    """
    start = time.perf_counter()
    seen: set[int] = set()
    requested = huge = 0
    failure: str | None = None
    for tensor in tensors:
        if tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        report = collapse_huge(storage.data_ptr(), storage.nbytes())
        requested += report.requested_bytes
        huge += report.huge_bytes
        failure = failure or report.failure
    return HugePageReport(requested, huge, time.perf_counter() - start, failure)


_libc: ctypes.CDLL | None = None


def _madvise(addr: int, nbytes: int, advice: int) -> str | None:
    """One ``madvise``; None on success, else why not (errno name)."""
    global _libc
    if not sys.platform.startswith("linux"):
        return "not Linux"
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    if _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), advice) == 0:
        return None
    err = ctypes.get_errno()
    return f"madvise({advice}): {errno.errorcode.get(err, err)}"
