"""File I/O of the disk tier (:mod:`tiercache.backends.disk.backend`): frames, I/O mode, syncs.

What is here holds no tier state (no index, budget or counters):

- :func:`choose_io_mode`, run once at start-up: O_DIRECT (no page cache; every
  buffer, offset and length a multiple of 4 KiB) where the filesystem accepts
  it, plain buffered I/O where it refuses (``direct_io: auto``); ``on`` makes a
  refusal a start-up error, ``off`` never tries.
- :class:`FrameIO` writes and reads one chunk's aligned frame of
  :mod:`tiercache.integrity` (a 4 KiB header block, then the payload padded to
  4 KiB). With O_DIRECT, a view that is page-aligned and a multiple of 4 KiB
  long (a pinned slab's slots are) is written and read in place; any other
  view goes through the calling thread's aligned bounce buffer.
- Small file-system helpers: full vectored writes and reads, ``syncfs``,
  directory fsync, rename into a fan-out directory, quiet unlink.

Threads: any thread may call anything here. :class:`FrameIO` keeps one header
block and one bounce buffer per thread (anonymous mmaps) and keeps no
reference to a caller's view after a call returns.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tiercache.config.schema import ConfigError
from tiercache.integrity import (
    ALIGN,
    FrameFormatError,
    IntegrityError,
    aligned_frame_bytes,
    pack_header,
    verify_frame,
)

# The tier's one logger: its backend module's name, the name log configurations filter on.
logger = logging.getLogger(f"{__package__}.backend")

DIRECT = getattr(os, "O_DIRECT", 0)
NOSPACE = (errno.ENOSPC, errno.EDQUOT)


# ---------------------------------------------------------------------------- start-up
def make_tree(directory: Path, subdirs: list[str], tier: str) -> None:
    """Create the namespace/rank tree and its subdirectories; ConfigError naming the path."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for subdir in subdirs:
            os.makedirs(subdir, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"disk tier {tier}: cannot create {exc.filename or directory}: {exc.strerror or exc}"
        ) from exc


def choose_io_mode(directory: str, want: str, tier: str) -> bool:
    """Probe O_DIRECT with one aligned write and read in ``directory``; True to use it."""
    buffered_error = _probe(directory, direct=False)
    if buffered_error is not None and buffered_error.errno not in NOSPACE:
        raise ConfigError(
            f"disk tier {tier}: cannot write in {directory}: "
            f"{buffered_error.strerror or buffered_error}"
        )
    if want == "off":
        return False
    direct_error = _probe(directory, direct=True) if DIRECT else OSError("no O_DIRECT here")
    if direct_error is None or direct_error.errno in NOSPACE:
        return True
    if want == "on":
        raise ConfigError(
            f"disk tier {tier}: direct_io is on but {directory} refuses O_DIRECT: "
            f"{direct_error.strerror or direct_error}"
        )
    logger.info(
        "disk tier %s: %s refuses O_DIRECT (%s); using buffered I/O",
        tier,
        directory,
        direct_error.strerror or direct_error,
    )
    return False


def _probe(directory: str, direct: bool) -> OSError | None:
    """Write and read back one aligned block in a scratch file; the error, or None."""
    path = f"{directory}/.probe-{os.getpid()}-{threading.get_ident()}"
    block = mmap.mmap(-1, ALIGN)
    flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC | (DIRECT if direct else 0)
    try:
        fd = os.open(path, flags, 0o644)
        try:
            os.pwrite(fd, block, 0)
            os.preadv(fd, [block], 0)
        finally:
            os.close(fd)
    except OSError as exc:
        return exc
    finally:
        unlink(path)
        block.close()
    return None


# ---------------------------------------------------------------------------- frames
class _IOBuffers(threading.local):
    """Per-thread aligned memory: one header block and one payload bounce buffer."""

    header_map: mmap.mmap | None = None
    bounce_map: mmap.mmap | None = None
    header: memoryview
    bounce: memoryview
    bounce_np: np.ndarray


class FrameIO:
    """Writes and reads the aligned frame of one chunk, O_DIRECT or buffered.

    Called on the tier's pool threads; each thread uses its own header block
    and bounce buffer. A caller's view is read from (write) or written into
    (read) only during the call.
    """

    def __init__(self, chunk_bytes: int, namespace: bytes, direct: bool) -> None:
        self.chunk_bytes = chunk_bytes
        self.namespace = namespace
        self.direct = direct
        self.frame_bytes = aligned_frame_bytes(chunk_bytes)
        self._padded = self.frame_bytes - ALIGN
        self._open_read = os.O_RDONLY | os.O_CLOEXEC | (DIRECT if direct else 0)
        self._tail = memoryview(bytes(self._padded - chunk_bytes))
        self._tls = _IOBuffers()

    def write(self, fd: int, key: bytes, view: memoryview) -> None:
        """Write the aligned frame of ``key`` (header block, payload, padding) at offset 0."""
        bufs = self._buffers()
        payload = view
        if self.direct and not _aligned(view):
            payload = bufs.bounce[: self._padded]
            np.copyto(bufs.bounce_np[: self.chunk_bytes], np.frombuffer(view, np.uint8))
            bufs.bounce_np[self.chunk_bytes : self._padded] = 0
        pack_header(bufs.header, self.namespace, key, payload[: self.chunk_bytes], ALIGN)
        pieces = [bufs.header, payload]
        if payload is view and self._tail:
            pieces.append(self._tail)
        _pwritev_all(fd, pieces)

    def read(self, path: str, key: bytes, view: memoryview) -> None:
        """Read and verify the frame of ``key`` into ``view`` (zeroed if read into and failed)."""
        bufs = self._buffers()
        in_place = not self.direct or _aligned(view)
        if in_place:
            payload = view
            pieces = [bufs.header, view]
            if self._tail:
                pieces.append(bufs.bounce[: len(self._tail)])  # padding: read, ignored
        else:
            payload = bufs.bounce[: self.chunk_bytes]
            pieces = [bufs.header, bufs.bounce[: self._padded]]
        fd = os.open(path, self._open_read)
        try:
            size = os.fstat(fd).st_size
            if size != self.frame_bytes:
                raise _truncated(size, self.frame_bytes)
            got = _preadv_all(fd, pieces)
            if got != self.frame_bytes:
                raise _truncated(got, self.frame_bytes)
            verify_frame(bufs.header, payload, self.namespace, key)
        except BaseException:
            if in_place:
                _zero(view)  # no damaged or partial bytes are left for the engine
            raise
        finally:
            os.close(fd)
        if not in_place:
            np.copyto(np.frombuffer(view, np.uint8), bufs.bounce_np[: self.chunk_bytes])

    def _buffers(self) -> _IOBuffers:
        bufs = self._tls
        if bufs.header_map is None:
            bufs.header_map = mmap.mmap(-1, ALIGN)
            bufs.bounce_map = mmap.mmap(-1, self._padded)
            bufs.header = memoryview(bufs.header_map)
            bufs.bounce = memoryview(bufs.bounce_map)
            bufs.bounce_np = np.frombuffer(bufs.bounce_map, np.uint8)
        return bufs


# ---------------------------------------------------------------------------- helpers
def is_flat(view: memoryview) -> bool:
    return view.format == "B" and view.ndim == 1 and view.c_contiguous


def _aligned(view: memoryview) -> bool:
    """Whether O_DIRECT can use ``view`` in place: page-aligned address and length."""
    if len(view) % ALIGN:
        return False
    return np.frombuffer(view, np.uint8).ctypes.data % ALIGN == 0


def _zero(view: memoryview) -> None:
    np.frombuffer(view, np.uint8).fill(0)


def _pwritev_all(fd: int, pieces: list[memoryview]) -> None:
    offset = 0
    while pieces:
        n = os.pwritev(fd, pieces, offset)
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        offset += n
        pieces = _advance(pieces, n)


def _preadv_all(fd: int, pieces: list[memoryview]) -> int:
    """Fill ``pieces`` from offset 0; bytes read (short only at end of file)."""
    offset = 0
    while pieces:
        n = os.preadv(fd, pieces, offset)
        if n == 0:
            break
        offset += n
        pieces = _advance(pieces, n)
    return offset


def _advance(pieces: list[memoryview], n: int) -> list[memoryview]:
    """The buffers left after the first ``n`` bytes of ``pieces`` were transferred."""
    rest = list(pieces)
    while rest and n >= len(rest[0]):
        n -= len(rest[0])
        rest.pop(0)
    if rest and n:
        rest[0] = rest[0][n:]
    return rest


def _truncated(size: int, expected: int) -> IntegrityError:
    return FrameFormatError(f"{size} bytes, a frame is {expected} (truncated)")


def find_syncfs() -> Callable[[int], int] | None:
    """libc's syncfs(2) (Linux), or None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syncfs  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def syncfs(directory: str, syncfs_fn: Callable[[int], int] | None) -> None:
    """Write back and flush everything on the filesystem holding ``directory``.

    ``syncfs_fn`` is what :func:`find_syncfs` found (the caller checked it is not None).
    """
    assert syncfs_fn is not None
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if syncfs_fn(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), directory)
    finally:
        os.close(fd)


def rename_into(staged: str, path: str) -> None:
    """Rename ``staged`` to ``path``, making ``path``'s directory on first use."""
    try:
        os.replace(staged, path)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.replace(staged, path)


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("cannot remove %s: %s", path, exc)
