"""Where the disk tier's files live, and the warm-restart scan that finds them.

Layout (one tree per engine namespace and TP rank; engines whose namespaces
differ never share a file)::

    <root>/<namespace hex>/rank<r>/<fan-out>/<key hex>.chunk   chunks
    <root>/<namespace hex>/rank<r>/free/<name>.free             files kept for reuse

``<fan-out>`` is two hex digits of a hash of the key (up to 256 directories,
each made on first use, so no directory grows past a few thousand entries).
Each chunk file holds one aligned frame (:class:`~tiercache.backends.disk.file_io.FrameIO`),
so every file has the same size, which is what lets a restart check a file
without reading it. A write in progress uses ``<key hex>.chunk.<tag>.tmp`` in
the chunk's directory (or a file of the free pool).

Warm restart: :func:`scan_tree` scans the tree with ``scandir`` (names and
sizes only, no chunk body is read), removes leftover ``.tmp`` files and files
of the wrong size (truncated), keeps the free files, trims free files and
then the oldest chunks if the tree is over budget, and returns what is left,
oldest chunk first; :class:`~tiercache.backends.disk.backend.DiskBackend` rebuilds its
index from it. It runs once, on the constructing thread, before any I/O thread
exists.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from tiercache.backends.disk.file_io import unlink

CHUNK_SUFFIX = ".chunk"
TMP_SUFFIX = ".tmp"
FREE_SUFFIX = ".free"
FREE_DIR = "free"
FANOUT = 256
MAX_KEY_BYTES = 100  # key hex + suffixes must fit a 255-byte file name


def fan(key: bytes) -> int:
    return xxhash.xxh3_64_intdigest(key) & (FANOUT - 1)


def chunk_path(fan_dirs: Sequence[str], key: bytes) -> str:
    """The file that holds ``key`` (whether or not it exists), given the fan-out directories."""
    return f"{fan_dirs[fan(key)]}/{key.hex()}{CHUNK_SUFFIX}"


@dataclass(slots=True)
class ScanResult:
    """What :func:`scan_tree` kept, and what it removed (for the tier's counters)."""

    chunks: list[bytes]  # keys of the chunks kept, oldest first
    free: list[str]  # paths of the free files kept
    tmp_removed: int = 0  # leftover .tmp files removed
    dropped: int = 0  # chunk files removed: truncated, misplaced, not ours, or over budget


def scan_tree(
    fan_dirs: Sequence[str], free_dir: str, frame_bytes: int, capacity_bytes: int
) -> ScanResult:
    """Find the chunks and free files of a tree from names and sizes (no chunk body is read)."""
    result = ScanResult([], [])
    found: list[tuple[float, bytes]] = []
    for fan_no, directory in enumerate(fan_dirs):
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    item = _scan_entry(entry, fan_no, frame_bytes, result)
                    if item is not None:
                        found.append(item)
        except FileNotFoundError:
            continue  # created on first use
    with os.scandir(free_dir) as entries:
        for entry in entries:
            if _regular_size(entry) == frame_bytes and entry.name.endswith(FREE_SUFFIX):
                result.free.append(entry.path)
            else:
                unlink(entry.path)
    found.sort()
    limit = capacity_bytes // frame_bytes
    while result.free and len(result.free) + len(found) > limit:  # over budget: free files go
        unlink(result.free.pop())
    excess = max(0, len(found) - limit)
    for _, key in found[:excess]:  # then the oldest chunks
        unlink(chunk_path(fan_dirs, key))
    result.dropped += excess
    result.chunks = [key for _, key in found[excess:]]
    return result


def _scan_entry(
    entry: os.DirEntry[str], fan_no: int, frame_bytes: int, result: ScanResult
) -> tuple[float, bytes] | None:
    name = entry.name
    if name.endswith(TMP_SUFFIX):
        unlink(entry.path)  # a write that never finished (killed mid-put)
        result.tmp_removed += 1
        return None
    if not name.endswith(CHUNK_SUFFIX):
        return None
    try:
        key = bytes.fromhex(name[: -len(CHUNK_SUFFIX)])
        st = entry.stat(follow_symlinks=False)
    except (ValueError, OSError):
        return None
    if fan(key) != fan_no or _regular_size(entry) != frame_bytes:
        unlink(entry.path)  # truncated, misplaced or not ours
        result.dropped += 1
        return None
    return (st.st_mtime, key)


def _regular_size(entry: os.DirEntry[str]) -> int:
    """Size of a regular file (not following links); -1 for anything else."""
    try:
        if entry.is_file(follow_symlinks=False):
            return entry.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return -1
