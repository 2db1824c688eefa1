"""The cache-server tier's frame checks made while a TCP get's bytes arrive, not after the last.

:meth:`tiercache.server.client.ServerClient.finish` hands a get's values on as byte ranges
about 256 KiB at a time (``on_data``, :mod:`tiercache.server.client_values`); checking each
range right then reads bytes still in the CPU's cache, where checking a whole request after
its last byte read them all back from memory (Intel Xeon, loopback: 0.78 of a raw receive
after, 0.95 as they arrive). The check is the tier's usual one (:mod:`.frames`), cut in
pieces: :func:`tiercache.integrity.check_header` on a frame's first bytes, its checksum
(:class:`tiercache.integrity.FrameDigest`, xxh3 or the keyed MAC) fed range by range,
:func:`tiercache.integrity.check_checksum` on its last. Anything unusual falls back to the
whole check, never to a pass.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiercache.backends.server.frames import Framer

from tiercache.integrity import (
    FrameDigest,
    FrameHeader,
    IntegrityError,
    check_checksum,
    check_header,
)
from tiercache.server import protocol as p


class ArrivalChecks:
    """A TCP get's frames checked as their bytes arrive (``on_data`` of
    :meth:`tiercache.server.client.ServerClient.finish`), while they are still in the CPU's
    cache: a frame's header when its first bytes are in, its checksum fed piece by piece
    (:class:`tiercache.integrity.FrameDigest`, MAC or xxh3), compared when its last are.
    :attr:`passed` holds the indices of the keys that passed; any other (a damaged frame, a value
    of the wrong size) is left to :meth:`Worker._verified`, which checks it whole and logs
    why it failed. Used by one I/O thread."""

    def __init__(self, framer: Framer, keys: list[bytes], frames: Sequence[tuple[memoryview, memoryview]]) -> None:
        self.framer, self.keys, self.frames = framer, keys, frames
        self.passed: set[int] = set()
        self._open: dict[int, tuple[FrameHeader, FrameDigest]] = {}  # frames whose bytes are arriving

    def on_data(self, ranges: list[tuple[int, int, int]], statuses: list[p.Status], sizes: list[int]) -> None:
        mac, namespace = self.framer.mac, self.framer.namespace
        for i, start, end in ranges:
            head, body = self.frames[i]
            key, head_len = self.keys[i], len(head)
            if sizes[i] != head_len + len(body):
                continue  # not this frame's size: checked whole afterwards, which says why
            if start == 0:
                if end < head_len:
                    continue  # the header not whole in the first range: checked whole afterwards
                try:
                    fields = check_header(head, namespace, key, len(body), mac=mac)
                except IntegrityError:
                    continue
                self._open[i] = (fields, FrameDigest(head, len(key), mac=mac))
            if i not in self._open:
                continue
            fields, digest = self._open[i]
            digest.update(body[max(start - head_len, 0) : max(end - head_len, 0)])
            if end == sizes[i]:
                del self._open[i]
                try:
                    check_checksum(fields, digest.value(), key, mac=mac)
                except IntegrityError:
                    continue
                self.passed.add(i)
