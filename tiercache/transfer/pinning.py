"""Pinned host memory for the host tier: an exact-size anonymous mapping, page-locked with ``cudaHostRegister``.

Why not ``torch.empty(..., pin_memory=True)``: torch's pinned allocator (the CUDA
caching host allocator) rounds every allocation up to the next power of two (a
40 GiB tier pins 64 GiB, per TP rank), and nothing checked that the memory came
back pinned. :func:`pin_host_memory` instead:

1. maps exactly the asked bytes rounded up to a page, anonymous and untouched
   (:func:`map_anonymous`; with ``huge_pages`` at a 2 MiB-aligned address and
   advised ``MADV_HUGEPAGE``). The mapping never moves: its address is fixed for
   its life, so a NIXL registration of it stays valid;
2. binds it to the GPU's NUMA node (``mbind(MPOL_PREFERRED)``) before anything
   touches it, when sysfs names the node (:func:`gpu_numa_node`);
3. registers it with CUDA (``cudaHostRegister``, portable: every context sees it),
   in one call or, if that fails, in pieces of about 1 GiB (page-aligned, whole
   slab rows where the row size allows); registering faults in and page-locks
   every page. A copy that spans two pieces is still correct, but the driver
   may stage it;
4. verifies it: ``is_pinned()`` at the first, middle and last byte of every piece.

Any failure leaves the memory pageable, which makes every ``non_blocking`` copy
synchronous: ONE warning says so, with the CUDA error, and the returned
:class:`PinnedRegion` reports it (``pinned``, ``failure``) for the worker's log
line and the ``tiercache_host_pinned_bytes`` metric.

Ownership: a :class:`PinnedRegion` owns its mapping and its registration.
``close()`` (idempotent; also run when the region is garbage collected)
unregisters and never unmaps: the mapping is unmapped only when the last
reference to it goes, the region's and every tensor viewing it (the tensor's
storage holds the mapping's owner), so memory a live tensor still views is
never unmapped. Unregister only once no copy can be in flight: the
TransferEngine's ``shutdown`` closes its copier (which waits for its streams)
before ``HostSlab.close``. A view used after ``close()`` still works, as
pageable memory. Threads: made and closed on the worker's main thread.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import mmap
import platform
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tiercache.transfer.huge_pages import (
    HUGE_PAGE_BYTES,
    HugePageReport,
    advise_huge,
    huge_bytes_in,
)

logger = logging.getLogger(__name__)

PAGE_BYTES = mmap.PAGESIZE
PIECE_BYTES = 1 << 30  # the piece size of a registration that failed in one call
CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context
MPOL_PREFERRED = 1
_MBIND_SYSCALL = {"x86_64": 237, "aarch64": 235}
SYSFS_PCI_DEVICES = Path("/sys/bus/pci/devices")

# the seams of the CUDA calls (tests drive the piece logic through them):
Register = Callable[[int, int, int], "str | None"]  # (addr, nbytes, flags) -> None, or the CUDA error
Unregister = Callable[[int], "str | None"]  # (addr) -> None, or the CUDA error
IsPinnedAt = Callable[[int], bool]  # does CUDA see this address as page-locked host memory?

_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_long]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.syscall.restype = ctypes.c_long
    return _libc


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _munmap(addr: int, nbytes: int) -> None:
    if nbytes > 0:
        _c().munmap(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes))


def map_anonymous(nbytes: int, align: int = PAGE_BYTES) -> torch.Tensor:
    """A fresh anonymous mapping of ``nbytes`` rounded up to a page, at an ``align``-aligned address.

    Returned as a 1-D uint8 tensor whose storage starts at the mapping (so
    ``is_pinned()`` of it and its views asks about the mapping's first byte).
    Nothing is touched: pages cost memory only once written or registered. The
    mapping is unmapped when the last tensor viewing it is freed, never before.
    """
    length = round_up(nbytes, PAGE_BYTES)
    slack = max(0, align - PAGE_BYTES)
    raw = _c().mmap(None, length + slack, mmap.PROT_READ | mmap.PROT_WRITE,
                    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if raw is None or raw == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {length} bytes for the host tier: {errno.errorcode.get(err, err)}")
    addr = round_up(raw, align)
    _munmap(raw, addr - raw)  # the unaligned head and tail: the mapping is exactly `length` bytes
    _munmap(addr + length, raw + slack - addr)
    owner = (ctypes.c_uint8 * length).from_address(addr)
    weakref.finalize(owner, _munmap, addr, length).atexit = False  # the process's exit frees it anyway
    return torch.from_numpy(np.frombuffer(owner, dtype=np.uint8))  # tensor -> array -> owner


def sysfs_bus_id(bus_id: str) -> str:
    """CUDA's PCI bus id (``00000000:3B:00.0``) as sysfs names the device (``0000:3b:00.0``)."""
    domain, rest = bus_id.strip().split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


def numa_node_of(bus_id: str, devices: Path = SYSFS_PCI_DEVICES) -> int | None:
    """The NUMA node sysfs gives the PCI device ``bus_id``; None when unknown (-1, no file, no such device)."""
    try:
        node = int((devices / sysfs_bus_id(bus_id) / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def gpu_numa_node(device: int | None = None, devices: Path = SYSFS_PCI_DEVICES) -> int | None:
    """The NUMA node of CUDA device ``device`` (default: the current one), or None if it cannot be known."""
    try:
        index = torch.cuda.current_device() if device is None else device
        props = torch.cuda.get_device_properties(index)
        bus_id = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except Exception as exc:  # noqa: BLE001 - best effort: no CUDA, an older torch, a driver error
        logger.debug("tiercache: the GPU's PCI address is unknown (%s)", exc)
        return None
    return numa_node_of(bus_id, devices)


def bind_preferred(addr: int, nbytes: int, node: int) -> str | None:
    """``mbind(MPOL_PREFERRED, node)`` on untouched memory: its pages come from ``node`` if it can. None, or why not."""
    number = _MBIND_SYSCALL.get(platform.machine())
    if number is None:
        return f"no mbind syscall number for {platform.machine()}"
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    rc = _c().syscall(ctypes.c_long(number), ctypes.c_void_p(addr), ctypes.c_ulong(nbytes),
                      ctypes.c_int(MPOL_PREFERRED), mask, ctypes.c_ulong(words * 64 + 1), ctypes.c_uint(0))
    if rc == 0:
        return None
    err = ctypes.get_errno()
    return f"mbind: {errno.errorcode.get(err, err)}"


def piece_bytes_for(row_bytes: int | None) -> int:
    """About :data:`PIECE_BYTES`, page-aligned, and a whole number of ``row_bytes`` rows where that fits."""
    unit = PAGE_BYTES if not row_bytes else math.lcm(PAGE_BYTES, row_bytes)
    return PIECE_BYTES if unit > PIECE_BYTES else PIECE_BYTES // unit * unit


def unregister_pieces(pieces: list[tuple[int, int]], unregister: Unregister) -> list[str]:
    """Unregister every ``(addr, nbytes)`` piece; the errors, if any."""
    errors = []
    for addr, _ in pieces:
        failure = unregister(addr)
        if failure is not None:
            errors.append(f"{addr:#x}: {failure}")
    return errors


def register_pieces(addr: int, nbytes: int, register: Register, unregister: Unregister,
                    piece_bytes: int = PIECE_BYTES) -> tuple[list[tuple[int, int]], str | None]:
    """Register ``[addr, addr + nbytes)``: in one call, else in ``piece_bytes`` pieces.

    Returns the registered ``(addr, nbytes)`` pieces and None, or ``[]`` and why
    not; after a failure nothing stays registered.
    """
    if piece_bytes <= 0 or piece_bytes % PAGE_BYTES:
        raise ValueError(f"a piece must be a whole number of {PAGE_BYTES}-byte pages, not {piece_bytes}")
    whole = register(addr, nbytes, CUDA_HOST_REGISTER_PORTABLE)
    if whole is None:
        return [(addr, nbytes)], None
    if nbytes <= piece_bytes:
        return [], whole
    logger.debug("tiercache: registering %d bytes in one call failed (%s); trying %d-byte pieces",
                 nbytes, whole, piece_bytes)
    done: list[tuple[int, int]] = []
    for start in range(addr, addr + nbytes, piece_bytes):
        size = min(piece_bytes, addr + nbytes - start)
        failure = register(start, size, CUDA_HOST_REGISTER_PORTABLE)
        if failure is not None:
            unregister_pieces(done, unregister)
            return [], f"{whole}; in {piece_bytes}-byte pieces: {failure} at byte {start - addr}"
        done.append((start, size))
    return done, None


def unpinned_probes(pieces: list[tuple[int, int]], is_pinned_at: IsPinnedAt) -> list[int]:
    """The addresses among each piece's first, middle and last byte that CUDA does not see as pinned."""
    probes = sorted({a + off for a, n in pieces for off in (0, n // 2, n - 1)})
    return [p for p in probes if not is_pinned_at(p)]


class PinnedRegion:
    """One pinned (or, after a failure, pageable) mapping; see the module docstring for who owns what."""

    def __init__(self, tensor: torch.Tensor, pieces: list[tuple[int, int]], failure: str | None,
                 numa_node: int | None, huge_pages: HugePageReport | None, unregister: Unregister) -> None:
        self.tensor = tensor  # 1-D uint8, exactly the mapping
        self.failure = failure
        self.numa_node = numa_node  # the node the mapping was bound to, None if not bound
        self.huge_pages = huge_pages
        self._pieces = pieces
        # unregisters once: at close(), or when the region is collected without it
        self._release = weakref.finalize(self, _release, pieces, unregister)
        self._release.atexit = False  # at exit the CUDA runtime may be gone; the driver cleans up

    @property
    def pinned(self) -> bool:
        return bool(self._pieces)

    @property
    def pinned_bytes(self) -> int:
        """Bytes page-locked now (the mapping's page-rounded size, or 0)."""
        return sum(n for _, n in self._pieces)

    def close(self) -> None:
        """Unregister (idempotent); the mapping goes with the last tensor viewing it."""
        self._release()


def _release(pieces: list[tuple[int, int]], unregister: Unregister) -> None:
    errors = unregister_pieces(pieces, unregister)
    pieces.clear()
    if errors:
        logger.warning("tiercache: cudaHostUnregister of the host tier failed: %s", "; ".join(errors))


def pin_host_memory(nbytes: int, device: int | None = None, huge_pages: bool = False,
                    row_bytes: int | None = None, register: Register | None = None,
                    unregister: Unregister | None = None, is_pinned_at: IsPinnedAt | None = None,
                    numa: bool = True, piece_bytes: int | None = None) -> PinnedRegion:
    """Map ``nbytes`` (rounded up to a page), bind, register and verify; see the module docstring.

    ``register``/``unregister``/``is_pinned_at`` default to the CUDA runtime's
    (``torch.cuda.cudart()``); if it cannot be had the region stays pageable.
    ``piece_bytes`` (default :func:`piece_bytes_for` ``row_bytes``) sizes the
    pieces of a registration that fails in one call.
    """
    tensor = map_anonymous(nbytes, HUGE_PAGE_BYTES if huge_pages else PAGE_BYTES)
    addr, length = tensor.data_ptr(), tensor.numel()
    node = gpu_numa_node(device) if numa else None
    if node is not None:
        why = bind_preferred(addr, length, node)
        if why is not None:
            logger.debug("tiercache: host tier not bound to NUMA node %d: %s", node, why)
            node = None
    advised = advise_huge(addr, length) if huge_pages else None  # before registering touches the pages
    if register is None or unregister is None or is_pinned_at is None:
        try:
            cuda_register, cuda_unregister = cudart_calls()
        except (AssertionError, RuntimeError, AttributeError) as exc:
            region = PinnedRegion(tensor, [], f"no CUDA runtime: {type(exc).__name__}: {exc}", node, None,
                                  lambda a: None)
            _warn_pageable(length, region.failure)
            return region
        register, unregister = register or cuda_register, unregister or cuda_unregister
        is_pinned_at = is_pinned_at or torch_is_pinned_at
    pieces, failure = register_pieces(addr, length, register, unregister, piece_bytes or piece_bytes_for(row_bytes))
    if pieces:
        bad = unpinned_probes(pieces, is_pinned_at)
        if bad:
            unregister_pieces(pieces, unregister)
            pieces, failure = [], f"registered, but is_pinned() is False at {len(bad)} probe(s), first {bad[0]:#x}"
    report = None
    if advised is not None:
        report = HugePageReport(length, huge_bytes_in(addr, length), advised.seconds, advised.failure)
    region = PinnedRegion(tensor, pieces, failure, node, report, unregister)
    if failure is not None:
        _warn_pageable(length, failure)
    else:
        logger.info("tiercache: host tier pinned, %d bytes in %d piece(s), NUMA node %s",
                    length, len(pieces), "unknown" if node is None else node)
    return region


def _warn_pageable(nbytes: int, failure: str | None) -> None:
    logger.warning("tiercache: the host tier (%d bytes) could not be pinned, it is PAGEABLE: every copy between "
                   "it and the GPU will be synchronous (slow). Cause: %s", nbytes, failure)


def cudart_calls() -> tuple[Register, Unregister]:
    """``cudaHostRegister``/``cudaHostUnregister`` of torch's CUDA runtime as seams; raises if there is none."""
    cudart = torch.cuda.cudart()
    return (lambda addr, nbytes, flags: _cuda_error(cudart, cudart.cudaHostRegister(addr, nbytes, flags)),
            lambda addr: _cuda_error(cudart, cudart.cudaHostUnregister(addr)))


def _cuda_error(cudart: object, code: object) -> str | None:
    """None for cudaSuccess, else the error's number and text; clears it from the runtime's last error."""
    if int(code) == 0:  # type: ignore[call-overload]
        return None
    try:
        text = cudart.cudaGetErrorString(code)  # type: ignore[attr-defined]
    except (TypeError, RuntimeError):
        text = "?"
    _clear_cuda_error()
    return f"cuda error {int(code)} ({text})"  # type: ignore[call-overload]


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error, which torch's next kernel-launch check would raise.

    torch's cudart binding has no ``cudaGetLastError``: call the loaded ``libcudart``'s.
    """
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libcudart" in line.rsplit("/", 1)[-1]), None)
        if path is not None:
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError) as exc:
        logger.debug("tiercache: could not clear the CUDA runtime's last error: %s", exc)


def torch_is_pinned_at(addr: int) -> bool:
    """Does CUDA see ``addr`` as pinned? A tensor whose storage starts at ``addr`` asks (``is_pinned``
    asks about a tensor's storage start, not its view's)."""
    probe = (ctypes.c_uint8 * 1).from_address(addr)
    return bool(torch.from_numpy(np.frombuffer(probe, dtype=np.uint8)).is_pinned())
