"""The LMDB tier's value format: framing a chunk before a put, verifying it on a get.

Every LMDB value of the tier is a compact frame of :mod:`tiercache.integrity`
(header right before the payload); :class:`Framer` builds and checks them and
:class:`Load` names what a get found. Threading: ``frame`` belongs to the
writer thread alone, ``unframe`` runs on any get thread.
"""

from __future__ import annotations

import enum
import logging

import numpy as np

from tiercache import integrity
from tiercache.backends.lmdb.env import max_frame_bytes

# The tier's one logger: its backend module's name, the name log configurations filter on.
logger = logging.getLogger(f"{__package__}.backend")


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

    def __init__(self, namespace: bytes, chunk_bytes: int) -> None:
        self.namespace = namespace
        self._stage(max_frame_bytes(chunk_bytes))

    def _stage(self, size: int) -> None:
        self._staging = memoryview(bytearray(size))
        self._staging_array = np.frombuffer(self._staging, dtype=np.uint8)

    def frame(self, key: bytes, payload: memoryview) -> memoryview:
        """The frame of ``payload`` under ``key``, in the staging buffer, valid until the next call.

        The payload is copied first and checksummed in the staging buffer: the
        hash then reads cache-warm bytes and covers exactly the bytes stored.
        """
        start = integrity.compact_header_len(len(key))
        end = start + payload.nbytes
        if end > len(self._staging):
            self._stage(end)
        np.copyto(self._staging_array[start:end], np.frombuffer(payload, dtype=np.uint8))
        frame = self._staging[:end]
        integrity.pack_header(frame, self.namespace, key, frame[start:])
        return frame

    def unframe(self, key: bytes, frame: memoryview, out: memoryview) -> Load:
        """Verify ``frame`` as ``key``'s, then copy its payload into ``out`` (else untouched)."""
        # magic, version, namespace, key, the payload length (the rest of the value)
        # and the checksum, which covers the header length
        try:
            payload = integrity.compact_payload(frame, self.namespace, key)
        except integrity.IntegrityError as exc:
            logger.warning("lmdb tier: dropping chunk %s: %s", key.hex(), exc)
            return Load.CORRUPT
        if payload.nbytes != out.nbytes:
            return Load.WRONG_SIZE
        _copy(out, payload)
        return Load.OK


def _copy(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` for flat byte views, through numpy, which releases the GIL."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
