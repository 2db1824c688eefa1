"""A copy-plan executor for host memory: every run of a plan copied by ``rep movsb``, in one call.

Why: the CPU copier moves pages of 2 KiB and less (small models, TP shards: one
page per layer, K or V, per block) between scattered engine blocks and the host
slab. glibc's ``memmove`` (and so numpy's ``take``, fancy assignment, torch's
``index_select``/``index_copy_`` and ``ctypes.memmove``) copies anything below
its ``rep_movsb_threshold`` (4-8 KiB on AVX2/AVX-512 machines) with a vector
loop of ordinary stores, and each scattered page starts with a full memory
latency (the hardware prefetchers do not guess the next page). Measured on the
2-vCPU AMD EPYC (Zen 4) VM of issue 22, one thread gathering 256 MiB of
scattered 2 KiB pages from 4 KiB-paged tensors: numpy ``take`` 3.5-4.2 GB/s,
``rep movsb`` alone 3.6-4.6, ``rep movsb`` with the next page prefetched (this
kernel) 5.7-7.0 GB/s, against one 256 MiB memcpy at 11-12 GB/s (non-temporal
stores). See docs/PERFORMANCE.md, host tier on the CPU.

What: a 166-byte x86-64 System V leaf function, ``copy_runs(dst, src, sizes, n)``
over three int64 arrays (no calls, no relocations, no stack), mapped into one
anonymous page that is written, then made read+exec (never both writable and
executable). Its source, assembled with GNU ``as`` (``.intel_syntax noprefix``;
``objcopy -O binary -j .text`` gives :data:`CODE`)::

        test rcx, rcx            ; n == 0: nothing to do
        jz 2f
        mov r8, rdi              ; r8/r9/r10: the dst, src and size arrays
        mov r9, rsi
        mov r10, rdx
        mov r11, rcx             ; r11: runs left
    1:  cmp r11, 1               ; a next run: prefetch its first 512 bytes
        jbe 3f
        mov rax, [r9+8]
        mov rdx, [r8+8]
        prefetcht0 [rax]         ; ... and [rax+64] .. [rax+448]: 8 lines to read
        prefetchw [rdx]          ; ... and [rdx+64] .. [rdx+448]: 8 lines to write
    3:  mov rdi, [r8]
        mov rsi, [r9]
        mov rcx, [r10]
        rep movsb                ; the System V ABI guarantees DF = 0 on entry
        add r8, 8
        add r9, 8
        add r10, 8
        dec r11
        jnz 1b
    2:  ret

A prefetch never faults, whatever the address. The function is called through
``ctypes.CFUNCTYPE``, which releases the GIL for the call.

When: **opt-in**, ``TIERCACHE_HOST_KERNEL=1`` in the engine's environment (off
by default: its gains were measured only on a loaded 2-vCPU AMD machine, and
shipping machine code in a Python package is a choice the project has not made
for every user; docs/PERFORMANCE.md, host tier on the CPU, has the figures).
Where: Linux on x86-64 with the ``erms`` (fast ``rep movsb``) and
``3dnowprefetch`` (``prefetchw``) CPU flags, and where the kernel lets a process
map executable memory; anywhere else, or without the opt-in, :func:`run_kernel`
is None and the copier keeps its numpy gathers (and copies each part alone).
A self-test copies three runs at start-up and compares the bytes.

Contract: the caller owns every address of the plan for the call and guarantees
them valid (bounds checked by :func:`~tiercache.transfer.device.check_segment`
before planning) and the runs' destinations disjoint from every source; the
kernel neither checks nor allocates. It is stateless: any number of threads may
call it at once. The page is mapped once per process and never unmapped.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
import sys
from collections.abc import Callable
from functools import cache

import numpy as np

from tiercache.transfer.copy_plan import CopyPlan

logger = logging.getLogger(__name__)

ENV_SWITCH = "TIERCACHE_HOST_KERNEL"  # "1": use the kernel where it works (default: off, numpy gathers)

CODE = bytes.fromhex(
    "4885c90f849c0000004989f84989f14989d24989cb4983fb01766a498b4108498b5008"
    "0f18080f1848400f1888800000000f1888c00000000f1888000100000f1888400100000f1888800100000f1888c0010000"
    "0f0d0a0f0d4a400f0d8a800000000f0d8ac00000000f0d8a000100000f0d8a400100000f0d8a800100000f0d8ac0010000"
    "498b38498b31498b0af3a44983c0084983c1084983c20849ffcb0f8570ffffffc3"
)
REQUIRED_FLAGS = frozenset({"erms", "3dnowprefetch"})  # /proc/cpuinfo: fast rep movsb, prefetchw

_Fn = Callable[[int, int, int, int], None]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _map_code() -> _Fn:
    """The code in a page of its own: written while read+write, then switched to read+exec."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    page.write(CODE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    if libc.mprotect(address, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
        raise OSError(ctypes.get_errno(), "mprotect(PROT_READ | PROT_EXEC) refused")
    _KEEP.append(page)  # mapped for the life of the process
    proto = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    return proto(address)


_KEEP: list[mmap.mmap] = []


def enabled() -> bool:
    """Whether the process opted in (``TIERCACHE_HOST_KERNEL=1``; read when a copier is built)."""
    return os.environ.get(ENV_SWITCH, "0").strip() == "1"


@cache
def _kernel() -> _Fn | None:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    if not REQUIRED_FLAGS <= _cpu_flags():
        return None
    try:
        fn = _map_code()
        # self-test: a run of each size class, compared with the expected bytes
        src = np.arange(3 * 4096, dtype=np.uint8)
        dst = np.zeros_like(src)
        runs = np.array([[4096, 0, 4096], [0, 8192, 1], [1, 8193, 2047]], np.int64)
        dsts, srcs = runs[:, 0] + dst.ctypes.data, runs[:, 1] + src.ctypes.data  # kept alive for the call
        sizes = np.ascontiguousarray(runs[:, 2])
        fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, 3)
        if not (np.array_equal(dst[4096:8192], src[:4096]) and dst[0] == src[8192]
                and np.array_equal(dst[1:2048], src[8193:10240])):
            raise RuntimeError("the copy kernel's self-test copied the wrong bytes")
        return fn
    except Exception as exc:  # noqa: BLE001 - no kernel is a slower copier, never an error
        logger.info("tiercache host copy kernel unavailable (numpy gathers instead): %s", exc)
        return None


def run_kernel(force: bool = False) -> Callable[[CopyPlan], int] | None:
    """The executor ``plan -> bytes moved`` where the process opted in (or ``force``, for tests and
    benchmarks) and the kernel works here, else None."""
    fn = _kernel() if force or enabled() else None
    if fn is None:
        return None

    def run(plan: CopyPlan) -> int:
        n = plan.count
        if n:
            dst, src, sizes = (np.ascontiguousarray(a, np.int64) for a in (plan.dst_ptrs, plan.src_ptrs, plan.sizes))
            fn(dst.ctypes.data, src.ctypes.data, sizes.ctypes.data, n)
        return int(plan.sizes.sum())

    return run
