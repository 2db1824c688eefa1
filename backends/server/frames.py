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
* NIXL: the header travels in the PUT_REMOTE body (the server writes it at
  the start of the slot) and comes back in the GET_REMOTE reply body
  (:meth:`Framer.head_lens` asks for it); only the chunk moves by NIXL,
  straight from or into the engine's view when it lies in memory registered
  with the agent (``ServerBackend.register_buffer``: zero copy), else through
  the I/O thread's arena (:meth:`Framer.place`; one copy each way). A chunk
  the server wrote into a view counts as loaded only once header + chunk
  verified; a view that received a failed frame is zeroed before the job is
  reported. A staged chunk is verified in the arena before it is copied to the
  view.

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
from collections.abc import Callable, Sequence

import numpy as np

from tiercache.frame_batch import xxh3_headers, xxh3_intact
from tiercache.integrity import (
    IntegrityError,
    MacKey,
    compact_header_len,
    frame_header,
    verify_frame,
)
from tiercache.server.nixl_client import view_address

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
        if self.mac is None:
            return list(zip(xxh3_headers(self.namespace, keys, views), views))
        return [(frame_header(self.namespace, k, v, mac=self.mac), v) for k, v in zip(keys, views)]

    @staticmethod
    def get_values(
        keys: Sequence[bytes], views: Sequence[memoryview]
    ) -> list[tuple[memoryview, memoryview]]:
        """Where each value is received: a fresh header buffer, then the view."""
        return [(memoryview(bytearray(compact_header_len(len(k)))), v) for k, v in zip(keys, views)]

    # ------------------------------------------------------------------ NIXL
    @staticmethod
    def head_lens(keys: Sequence[bytes]) -> list[int]:
        """Bytes of each key's frame header (what a NIXL get asks back in the reply body)."""
        return [compact_header_len(len(k)) for k in keys]

    @staticmethod
    def place(
        arena: memoryview, views: Sequence[memoryview], locate: Callable[[memoryview], int | None],
    ) -> tuple[list[memoryview], list[int]]:
        """Where each chunk moves by NIXL, and its address: the view itself when ``locate`` finds it
        in registered memory (zero copy), else the next free bytes of ``arena`` (the caller copies).

        The unlocated chunks must fit the arena (the caller sized the request: :meth:`staged_bytes`).
        """
        targets, addrs = [], []
        offset = 0
        for view in views:
            addr = locate(view)
            if addr is None:
                target = arena[offset : offset + len(view)]
                offset += len(view)
                addr = view_address(target)
            else:
                target = view
            targets.append(target)
            addrs.append(addr)
        return targets, addrs

    @staticmethod
    def staged_bytes(views: Sequence[memoryview], locate: Callable[[memoryview], int | None]) -> int:
        """Bytes of ``views`` that :meth:`place` would put in the arena (outside registered memory)."""
        return sum(len(v) for v in views if locate(v) is None)

    # ------------------------------------------------------------------ loads
    def verified(self, key: bytes, head: memoryview, body: memoryview, size: int) -> bool:
        """Whether the ``size``-byte value received into ``head`` + ``body`` is ``key``'s intact
        frame (under this tier's MAC key, if it has one); logs why not."""
        expected = len(head) + len(body)
        if size == expected and self.mac is None and xxh3_intact(head, body, self.namespace, key):
            return True  # the batch form; anything else goes the long way, which says why
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
    def copy(dst: memoryview, src: memoryview) -> None:
        """Copy a chunk into the arena (a put) or a verified staged chunk into the caller's view."""
        _copy(dst, src)


def _copy(dst: memoryview, src: memoryview) -> None:
    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
