"""The CUDA driver's batched copy (``cuMemcpyBatchAsync``, CUDA >= 12.8) called through ctypes.

What vLLM's ``swap_blocks_batch`` does on CUDA, without needing a CUDA build of
vLLM: one driver call per plan, each entry a pointer-to-pointer copy (device
KV page <-> pinned host page; with unified addressing every such pointer is
valid for the driver). The function is fetched with ``cuGetProcAddress`` at
ABI version 12.8, so its signature is the 12.8 one (with ``failIdx``) whatever
the installed driver's default. Source access order *stream*: a copy reads
its source only when the stream reaches it (the store stream waits for the
forward pass first).

:func:`driver_batch` returns None when the driver, the symbol or CUDA is
missing; the executor never raises for a missing driver after that (a call
that fails raises ``RuntimeError`` with the driver's error code: the copier
turns it into a failed job).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

import numpy as np
import torch

from tiercache.transfer.copy_plan import CopyPlan

_ABI_VERSION = 12080  # the signature below: cuMemcpyBatchAsync as CUDA 12.8 declared it
_SRC_ACCESS_ORDER_STREAM = 1


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


_BATCH_FN = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,  # dsts, srcs, sizes, count
    ctypes.POINTER(_MemcpyAttributes), ctypes.c_void_p, ctypes.c_size_t,  # attrs, attrsIdxs, numAttrs
    ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p,  # failIdx, hStream
)


def _load_driver() -> Any | None:
    for name in ("libcuda.so.1", ctypes.util.find_library("cuda")):
        if name:
            try:
                return ctypes.CDLL(name)
            except OSError:
                continue
    return None


def driver_batch() -> Any | None:
    """``cuMemcpyBatchAsync`` (12.8 ABI) as a ctypes function, or None where unavailable."""
    if not torch.cuda.is_available():
        return None
    lib = _load_driver()
    if lib is None or not hasattr(lib, "cuGetProcAddress_v2"):
        return None
    torch.cuda.init()  # the driver must be initialised before cuGetProcAddress
    fn = ctypes.c_void_p()
    status = ctypes.c_int()
    get = lib.cuGetProcAddress_v2
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                    ctypes.POINTER(ctypes.c_int)]
    rc = get(b"cuMemcpyBatchAsync", ctypes.byref(fn), _ABI_VERSION, 0, ctypes.byref(status))
    if rc != 0 or not fn.value:
        return None
    return _BATCH_FN(fn.value)


class DriverBatchExecutor:
    """One ``cuMemcpyBatchAsync`` per plan on the current stream (see the module docstring)."""

    name = "driver_batch"

    def __init__(self, fn: Any) -> None:
        self._fn = fn
        self._attrs = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, _MemLocation(0, 0), _MemLocation(0, 0), 0)
        self._attr_idx = (ctypes.c_size_t * 1)(0)

    def run(self, plan: CopyPlan) -> int:
        if not plan.count:
            return 0
        # the plan's int64 arrays as the driver's unsigned ones, without copies where they are contiguous
        dsts = np.ascontiguousarray(plan.dst_ptrs).view(np.uint64)
        srcs = np.ascontiguousarray(plan.src_ptrs).view(np.uint64)
        sizes = np.ascontiguousarray(plan.sizes).view(np.uint64)
        fail = ctypes.c_size_t(0)
        stream = torch.cuda.current_stream().cuda_stream
        rc = self._fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, plan.count,
                      ctypes.byref(self._attrs), ctypes.addressof(self._attr_idx), 1, ctypes.byref(fail),
                      ctypes.c_void_p(stream))
        if rc != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync failed: CUresult {rc} at copy {fail.value} of {plan.count}")
        return plan.nbytes
