"""The cache-server tier's frames: what a chunk looks like on the server, and the check on load.

Every chunk goes to the server as a compact frame of :mod:`tiercache.integrity`
(a header naming the namespace, key and length, checksummed with xxh3_64 or,
with the tier's ``mac_key``, authenticated with a keyed MAC; then the chunk),
so the server, or another of its clients, cannot hand back bytes that load as
another chunk's, or, with a key, as any chunk it did not get from a holder of
the key. The server stores the frame as an opaque value (its slots allow a
frame header on top of ``max_value_bytes``: :mod:`tiercache.server.slab`).

Data path, per value:

* TCP put: two pieces of one value, the header built here and the engine's
  view, sent as they are (no copy of the chunk);
* TCP get: the header is received into a small buffer of the request's own
  and the chunk straight into the engine's view; the key counts as loaded only
  once its frame verified, and a view that received a failed frame is zeroed
  before the job is reported (the engine never reads a view before its
  JobResult, and a failed key's view not at all);
* NIXL: the server READs or WRITEs one contiguous value, so the whole frame
  is staged in the I/O thread's arena (:meth:`Framer.stage`; one copy each
  way), and a loaded frame is verified in the arena before its chunk is
  copied to the view: no unverified byte reaches the view.

A frame that does not verify (damaged, truncated, another key's, not
authenticated by this tier's key) is a failed key, counted by the caller in
``checksum_failures``, and logged with the key and the reason, never with a
MAC value.

Threads: a :class:`Framer` is immutable and shared by the tier's I/O threads;
the buffers it returns belong to the calling thread's request. It keeps no
reference to a caller's view.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from tiercache.integrity import (
    IntegrityError,
    MacKey,
    compact_header_len,
    frame_header,
    pack_header,
    verify_frame,
)

# The tier's one logger: its backend module's name, the name log configurations filter on.
logger = logging.getLogger(f"{__package__}.backend")


class Framer:
    """Frames of one tier: its namespace digest and optional MAC key (see the module docstring)."""

    def __init__(self, namespace: bytes, mac: MacKey | None, tier_name: str) -> None:
        if len(namespace) != 8:
            raise ValueError(f"namespace digest must be 8 bytes, got {len(namespace)}")
        self.namespace = namespace
        self.mac = mac
        self.tier_name = tier_name

    @staticmethod
    def framed_bytes(key: bytes, view: memoryview) -> int:
        """Bytes of the value that carries ``view`` under ``key`` (header + chunk)."""
        return compact_header_len(len(key)) + len(view)

    # ------------------------------------------------------------------ TCP
    def put_values(
        self, keys: Sequence[bytes], views: Sequence[memoryview]
    ) -> list[tuple[bytearray, memoryview]]:
        """Each chunk as the pieces of its value: a new header, then the view itself."""
        return [(frame_header(self.namespace, k, v, mac=self.mac), v) for k, v in zip(keys, views)]

    @staticmethod
    def get_values(
        keys: Sequence[bytes], views: Sequence[memoryview]
    ) -> list[tuple[memoryview, memoryview]]:
        """Where each value is received: a fresh header buffer, then the view."""
        return [(memoryview(bytearray(compact_header_len(len(k)))), v) for k, v in zip(keys, views)]

    # ------------------------------------------------------------------ NIXL
    def stage(
        self, arena: memoryview, keys: Sequence[bytes], views: Sequence[memoryview], copy_in: bool
    ) -> list[tuple[memoryview, memoryview]]:
        """Lay each key's frame out in ``arena``, one after another; each frame's (header, chunk).

        ``copy_in`` (a put): copy each view into its place and write its header
        there, checksumming the staged bytes (what the server will read). The
        frames must fit (the caller sized the request by :meth:`framed_bytes`).
        """
        out = []
        offset = 0
        for key, view in zip(keys, views):
            start, mid = offset, offset + compact_header_len(len(key))
            offset = mid + len(view)
            head, body = arena[start:mid], arena[mid:offset]
            if copy_in:
                _copy(body, view)
                pack_header(head, self.namespace, key, body, mac=self.mac)
            out.append((head, body))
        return out

    # ------------------------------------------------------------------ loads
    def verified(self, key: bytes, head: memoryview, body: memoryview, size: int) -> bool:
        """Whether the ``size``-byte value received into ``head`` + ``body`` is ``key``'s intact
        frame (under this tier's MAC key, if it has one); logs why not."""
        expected = len(head) + len(body)
        if size != expected:
            reason = f"a value of {size} bytes where its frame has {expected}"
        else:
            try:
                verify_frame(head, body, self.namespace, key, mac=self.mac)
                return True
            except IntegrityError as exc:
                reason = str(exc)
        logger.warning("server tier %s: dropping chunk %s: %s", self.tier_name, key.hex(), reason)
        return False

    @staticmethod
    def deliver(body: memoryview, view: memoryview) -> None:
        """Copy a verified chunk staged in an arena into the caller's view."""
        _copy(view, body)


def _copy(dst: memoryview, src: memoryview) -> None:
    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
