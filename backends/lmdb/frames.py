"""The LMDB tier's value format: framing a chunk before a put, verifying it on a get.

Every LMDB value of the tier is a compact frame of :mod:`tiercache.integrity`
(header right before the payload); :class:`Framer` builds and checks them and
:class:`Load` names what a get found. Threading: ``frame`` belongs to the
writer thread alone, ``unframe`` runs on any get thread.

One read of every byte from memory: the payload is checksummed
(:class:`tiercache.integrity.FrameDigest`, streaming) as it is copied, on a put
into the staging frame, on a get into the caller's buffer, so that one of the
two reads of every byte hits the CPU's cache (:func:`_copy_hashing`). A get
therefore writes the buffer *before* it knows the checksum: the buffer is the
backend's until the job is reported, and its bytes mean nothing unless the key
is reported ok (the contract of :meth:`tiercache.backend.Backend.submit_get`).
On a mismatch the bytes written are zeroed and the key fails
(``Load.CORRUPT``); a frame whose header is wrong (another key, namespace,
length, format) fails before anything is copied, and a buffer of the wrong
length is never written (``Load.WRONG_SIZE`` once the frame verified in place).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from tiercache import integrity
from tiercache.backends.lmdb.env import max_frame_bytes

# The tier's one logger: its backend module's name, the name log configurations filter on.
logger = logging.getLogger(f"{__package__}.backend")

#: Payloads are checksummed and copied this many bytes at a time (see :func:`_copy_hashing`).
#: Measured (docs/PERFORMANCE.md, LMDB tier): with 256 KiB pieces gets of 1-4 MiB chunks ran
#: at 0.63-0.74 of raw lmdb, against 0.81-0.98 hashing whole values; pieces under 1 MiB lose
#: the speed of one large copy.
PIECE_BYTES = 1 << 20


class Load(enum.Enum):
    OK = "ok"
    MISSING = "missing"
    CORRUPT = "corrupt"  # failed verification: damaged, or not the frame asked for
    WRONG_SIZE = "wrong_size"  # intact, but the caller's buffer has another length


class Framer:
    """The one place this module frames and verifies chunks (:mod:`tiercache.integrity`).

    Frames are compact: the header right before the payload, the whole LMDB
    value. ``frame`` reuses one staging buffer, so only one thread (the writer)
    may call it; ``unframe`` keeps no state and runs on every get thread.
    """

    def __init__(self, namespace: bytes, chunk_bytes: int, piece_bytes: int = PIECE_BYTES) -> None:
        if piece_bytes <= 0:
            raise ValueError(f"piece_bytes must be positive, got {piece_bytes}")
        self.namespace = namespace
        self.piece_bytes = piece_bytes
        self._stage(max_frame_bytes(chunk_bytes))

    def _stage(self, size: int) -> None:
        self._staging = memoryview(bytearray(size))
        self._staging_array = np.frombuffer(self._staging, dtype=np.uint8)

    def frame(self, key: bytes, payload: memoryview) -> memoryview:
        """The frame of ``payload`` under ``key``, in the staging buffer, valid until the next call.

        The header goes first; the payload is then copied in pieces, each
        checksummed in the staging buffer right after it landed: the hash reads
        cache-warm bytes and covers exactly the bytes stored.
        """
        start = integrity.compact_header_len(len(key))
        end = start + payload.nbytes
        if end > len(self._staging):
            self._stage(end)
        frame = self._staging[:end]
        digest = integrity.open_header(frame, self.namespace, key, payload.nbytes)
        _copy_hashing(self._staging_array[start:end], _array(payload), digest.update,
                      self.piece_bytes)
        digest.seal(frame)
        return frame

    def unframe(self, key: bytes, frame: memoryview, out: memoryview) -> Load:
        """Copy ``frame``'s payload into ``out`` while verifying it as ``key``'s.

        OK: ``out`` holds the verified payload. CORRUPT: the header was wrong
        (``out`` untouched) or the checksum (``out`` zeroed). WRONG_SIZE: the
        frame verified but ``out`` has another length (``out`` untouched).
        """
        header_len = integrity.compact_header_len(len(key))
        if frame.nbytes - header_len != out.nbytes:
            return self._wrong_size(key, frame)
        header = frame[:header_len]
        try:
            # magic, version, algorithm, namespace, key, payload length: before any byte moves
            head = integrity.check_header(header, self.namespace, key, out.nbytes)
        except integrity.IntegrityError as exc:
            return _corrupt(key, exc)
        digest = integrity.FrameDigest(header, len(key))  # covers the header's fields too
        dst = _array(out)
        _copy_hashing(dst, _array(frame)[header_len:], digest.update, self.piece_bytes)
        try:
            integrity.check_checksum(head, digest.value(), key)
        except integrity.IntegrityError as exc:
            dst.fill(0)  # never leave unverified bytes behind (the conformance kit checks it)
            return _corrupt(key, exc)
        return Load.OK

    def _wrong_size(self, key: bytes, frame: memoryview) -> Load:
        """A buffer of another length than the value's payload: verify the frame in place
        (a damaged or foreign value is CORRUPT, as ever), never write the buffer."""
        try:
            integrity.compact_payload(frame, self.namespace, key)
        except integrity.IntegrityError as exc:
            return _corrupt(key, exc)
        return Load.WRONG_SIZE


def _corrupt(key: bytes, exc: integrity.IntegrityError) -> Load:
    logger.warning("lmdb tier: dropping chunk %s: %s", key.hex(), exc)
    return Load.CORRUPT


def _array(view: memoryview) -> np.ndarray:
    """A flat uint8 array over a contiguous buffer (no copy)."""
    return np.frombuffer(view, dtype=np.uint8)


def _copy_hashing(dst: np.ndarray, src: np.ndarray, update: Callable[[Any], Any], piece: int) -> None:
    """``dst[:] = src``, feeding the bytes to ``update`` (in order) as they are copied.

    Up to half a piece: one copy, then the hash of the bytes that landed in ``dst``
    (still in the cache). Larger: piece by piece, each hashed as it is read from
    ``src`` (which brings it into the cache) and then copied from there. Either way
    ``src`` is read from memory once. numpy's copy and xxh3's update release the GIL.
    """
    if src.size <= piece // 2:
        np.copyto(dst, src)
        update(dst)
        return
    for at in range(0, src.size, piece):
        part = src[at : at + piece]
        update(part)
        np.copyto(dst[at : at + piece], part)
