"""The compiled copy-plan executor for host memory: every run of a plan copied in one C call.

Why: the CPU copier moves pages of 2 KiB and less (small models, TP shards: one
page per layer, K or V, per block) between scattered engine blocks and the host
slab. Each scattered page starts with a full memory latency: the hardware
prefetchers do not guess where the next page starts. The executor copies run
after run with ``memcpy`` while prefetching the next run (its first 4 KiB, read
side and write side). Measured on the 2-vCPU Intel Xeon VM of issue 22, one
thread gathering 256 MiB of randomly scattered 2 KiB pages: numpy ``take``
0.31-0.40 of one 256 MiB memcpy, ``memcpy`` per page 0.38-0.39, with the next
page prefetched 0.54-0.58; two threads 0.49 / 0.62 / 0.86 (docs/PERFORMANCE.md,
host tier on the CPU, has the copier's figures).

What: ``copy_runs(dst, src, sizes, n)`` over three int64 arrays, in
``tiercache/transfer/native/copy_runs.c``, built by ``pip install`` as the
extension module ``tiercache.transfer._copy_runs`` (setup.py). The build is
optional: without a C compiler it is skipped and :func:`run_kernel` is None.
The function is called through ``ctypes.CFUNCTYPE``, which releases the GIL for
the call. It replaces, since 2026-12-06, a 166-byte ``rep movsb`` kernel mapped
from bytes in this module (opt-in): the compiled one is faster on the Intel VM
from 2 MiB jobs up, ships as C source, and is on by default.

Stores: ``copy_runs`` writes through the cache (both sides prefetched);
``copy_runs_stream`` writes with non-temporal (streaming) stores (no read of the
destination's lines before they are written; the source two runs ahead
prefetched). On the AMD EPYC VM (session 27, five runs of each, alternated) the
streaming one moved 4 MiB jobs of scattered 2 KiB pages from a median 0.45 /
0.47 of one memcpy to 0.71 / 1.04 (store / load; docs/PERFORMANCE.md); on the
Intel Xeon VM the cached one reached 0.94 / 0.99 and the streaming one is not
measured yet. So ``TIERCACHE_HOST_STREAM_STORES`` is ``auto`` by default:
streaming on AMD CPUs (``/proc/cpuinfo`` says ``AuthenticAMD``), cached
elsewhere; ``1`` / ``0`` force either.

When: by default, wherever the module was built and its self-test (three runs
copied at import, the bytes compared) passes; ``TIERCACHE_HOST_KERNEL=0`` in
the engine's environment turns it off (the copier then keeps its numpy gathers
for every part). The copier sends it every part of a slab of slots through
``copy_segments`` (below); a planes slab's parts as numpy plans.

Segments (since session 29): :func:`segment_runner` gives the copier the
module's ``copy_segments`` (since session 30; ``copy_segment`` before it, one
segment a call), which makes each segment's plan in C (the addresses of
``copy_plan``'s :class:`~tiercache.transfer.copy_plan.PlanGeometry`, pages
contiguous on both sides merged) and runs it with the same two functions. A
numpy plan costs 10-25 us a job and the numpy gathers ~10 us of Python a part,
against ~20 us for a 256 KiB chunk's copy: on the AMD VM, one thread, scattered
2 KiB pages, a 256 KiB chunk's store took 30 us this way against 65-69 (gathers
or plan + executor), a load 18 against 40-54. ``copy_segments`` checks every
index of every segment itself (IndexError, nothing copied) and releases the GIL
once for all of their copies: a copy thread's whole batch of parts is one call.
For a slab of slots only (a planes slab keeps the plan).

Contract: the caller owns every address of the plan for the call and guarantees
them valid (bounds checked by :func:`~tiercache.transfer.device.check_segment`
before planning) and the runs' destinations disjoint from every source; the
executor neither checks nor allocates. ``copy_segments`` checks its indices
against the geometry's counts; the geometry's addresses (engine KV tensors,
slab) are the copier's, valid while it lives. Both are stateless: any number of
threads may call them at once.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Sequence
from functools import cache

import numpy as np

from tiercache.jobs import CopySegment
from tiercache.transfer.copy_plan import CopyPlan, PlanGeometry

logger = logging.getLogger(__name__)

ENV_SWITCH = "TIERCACHE_HOST_KERNEL"  # "0": numpy gathers only (default: the compiled executor, where built)
STREAM_SWITCH = "TIERCACHE_HOST_STREAM_STORES"  # auto (default: streaming on AMD) | 1 | 0

_Fn = Callable[[int, int, int, int], None]


def enabled() -> bool:
    """Whether the process left the executor on (``TIERCACHE_HOST_KERNEL`` unset or not ``0``;
    read when a copier is built)."""
    return os.environ.get(ENV_SWITCH, "1").strip() != "0"


def streaming() -> bool:
    """Whether the executor writes with streaming stores: ``TIERCACHE_HOST_STREAM_STORES`` ``1`` / ``0``,
    else (``auto``, the default) on AMD CPUs only, where they were measured faster. Off x86-64 both
    functions are the cached ``copy_runs``."""
    setting = os.environ.get(STREAM_SWITCH, "auto").strip().lower()
    if setting in ("0", "1"):
        return setting == "1"
    return _cpu_vendor() == "AuthenticAMD"


@cache
def _cpu_vendor() -> str:
    """``vendor_id`` of /proc/cpuinfo's first processor; "" where there is none (not Linux, not x86)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def stores_used(stream: bool | None = None) -> str:
    """``"streaming"`` or ``"cached"``: the stores :func:`run_kernel` writes with (``stream`` None: as
    :func:`streaming` says), after the fallback of a build older than ``copy_runs_stream`` (cached)."""
    wanted = streaming() if stream is None else stream
    return "streaming" if wanted and _stream_address() is not None else "cached"


def _stream_address() -> int | None:
    """The built module's ``copy_runs_stream``; None where it is not built or older than it."""
    try:
        from tiercache.transfer import _copy_runs
    except ImportError:
        return None
    return getattr(_copy_runs, "COPY_RUNS_STREAM", None)


def built() -> bool:
    """Whether ``pip install`` compiled the module (a C compiler was found)."""
    try:
        from tiercache.transfer import _copy_runs  # noqa: F401
    except ImportError:
        return False
    return True


@cache
def _kernel(stream: bool) -> _Fn | None:
    try:
        from tiercache.transfer import _copy_runs
    except ImportError as exc:
        logger.info("tiercache copy executor not built (numpy gathers instead): %s", exc)
        return None
    proto = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    address = _stream_address() if stream else _copy_runs.COPY_RUNS
    if address is None:  # a module built before copy_runs_stream existed: rebuild (pip install -e .)
        logger.warning("tiercache copy executor has no streaming stores (an older build): cached stores instead")
        address = _copy_runs.COPY_RUNS
    fn = proto(address)
    try:
        # self-test: a run of each size class (a streamed 4 KiB, a byte, an odd size copied with memcpy),
        # compared with the expected bytes
        src = np.arange(3 * 4096, dtype=np.uint8)
        buf = np.zeros(3 * 4096 + 64, np.uint8)
        dst = buf[(-buf.ctypes.data) % 64:][: 3 * 4096]  # 64-byte aligned: the 4 KiB run is streamed
        runs = np.array([[4096, 0, 4096], [0, 8192, 1], [1, 8193, 2047]], np.int64)
        dsts, srcs = runs[:, 0] + dst.ctypes.data, runs[:, 1] + src.ctypes.data  # kept alive for the call
        sizes = np.ascontiguousarray(runs[:, 2])
        fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, 3)
        if not (np.array_equal(dst[4096:8192], src[:4096]) and dst[0] == src[8192]
                and np.array_equal(dst[1:2048], src[8193:10240])):
            raise RuntimeError("the copy executor's self-test copied the wrong bytes")
    except Exception as exc:  # noqa: BLE001 - no executor is a slower copier, never an error
        logger.warning("tiercache copy executor failed its self-test (numpy gathers instead): %s", exc)
        return None
    return fn


def run_kernel(force: bool = False, stream: bool | None = None) -> Callable[[CopyPlan], int] | None:
    """The executor ``plan -> bytes moved`` where it was built and works here, unless the process
    turned it off (``force``: even then, for tests and benchmarks); else None. ``stream``: streaming
    stores or not (None: as ``TIERCACHE_HOST_STREAM_STORES`` says)."""
    fn = _kernel(streaming() if stream is None else stream) if force or enabled() else None
    if fn is None:
        return None

    def run(plan: CopyPlan) -> int:
        n = plan.count
        if n:
            dst, src, sizes = (np.ascontiguousarray(a, np.int64) for a in (plan.dst_ptrs, plan.src_ptrs, plan.sizes))
            fn(dst.ctypes.data, src.ctypes.data, sizes.ctypes.data, n)
        return int(plan.sizes.sum())

    return run


SegmentRunner = Callable[[Sequence[CopySegment], bool], int]  # (segments, store) -> bytes moved


def segment_geometry(geometry: PlanGeometry, num_blocks: int, num_slots: int) -> bytes:
    """``geometry`` (a slab of slots) as ``copy_segments`` reads it: int64 R, num_blocks, num_slots,
    blocks_per_chunk, slot_step, then per region engine base, block stride, page, host base, host block step."""
    g = geometry
    return np.concatenate([
        np.asarray([g.region_base.size, num_blocks, num_slots, g.blocks_per_chunk, g.slot_step], np.int64),
        g.region_base, g.region_stride, g.page, g.host_base, g.block_step]).astype(np.int64).tobytes()


def segment_runner(geometry: PlanGeometry, num_blocks: int, num_slots: int, force: bool = False,
                   stream: bool | None = None) -> SegmentRunner | None:
    """``copy_segments`` bound to ``geometry`` (a slab of slots; None for planes), where :func:`run_kernel`
    would give the executor (built, self-test passed, not turned off unless ``force``); else None."""
    stream = streaming() if stream is None else stream
    if geometry.planes or run_kernel(force=force, stream=stream) is None:
        return None
    from tiercache.transfer import _copy_runs

    copy_segments = getattr(_copy_runs, "copy_segments", None)
    if copy_segments is None:  # a module built before copy_segments existed: rebuild (pip install -e .)
        logger.warning("tiercache copy executor has no copy_segments (an older build): numpy plans and gathers")
        return None
    packed = segment_geometry(geometry, num_blocks, num_slots)
    streamed = stores_used(stream) == "streaming"

    def run(segments: Sequence[CopySegment], store: bool) -> int:
        return copy_segments(packed, store, streamed, [(s.slot, s.first_block, s.block_ids) for s in segments])

    return run

