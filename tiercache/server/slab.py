"""The server's host memory: one anonymous mapping cut into fixed slots, one chunk each.

A slot holds a value of any size up to ``max_value_bytes + HEADER_ALLOWANCE``
at its start and a 16-byte *trailer* at its end (magic ``b"TCSV"``, reserved,
value length), so a slot is self-describing: lower tiers (disk, ...) store and
return whole slots, and a chunk read back after a restart still knows its
length. ``max_value_bytes`` (the server's config) is the largest *chunk*; the
client tier stores each chunk as a frame of :mod:`tiercache.integrity` (a
header of 40 bytes plus the key, then the chunk), so a value may exceed it by
``HEADER_ALLOWANCE``, the header of the longest key the protocol allows: a
server sized with ``max_value_bytes`` = the engines' chunk bytes takes their
frames. Slot stride is ``max_value_bytes + HEADER_ALLOWANCE + 16`` rounded up
to 64 bytes, or to 4 KiB when values are 256 KiB or more (page-aligned slots
let an O_DIRECT disk tier write them in place; the rounding then costs under
2 %, and usually absorbs the allowance).

The mapping is reserved, not committed: pages cost memory when first written,
so resident memory grows with what is stored, never past ``num_slots *
slot_bytes``. It is page-aligned, so NIXL registers it as one region.

Ownership: the server's :class:`~tiercache.server.store.ChunkStore` owns the
slab for the life of the process; connection tasks receive into and send from
slot views only while the manager has the slot STORING or pinned, and lower
tiers get slot views only while their job is unreported. Event loop thread
only, except the lower tiers' own I/O threads working on the views they hold.
"""

from __future__ import annotations

import mmap
import struct

import numpy as np

from tiercache.integrity import compact_header_len
from tiercache.server.protocol_messages import MAX_KEY_BYTES_CAP

#: Bytes a stored value may carry beyond ``max_value_bytes``: a frame header of the longest key.
HEADER_ALLOWANCE = compact_header_len(MAX_KEY_BYTES_CAP)
TRAILER = struct.Struct("<4sIQ")
TRAILER_BYTES = TRAILER.size  # 16
TRAILER_MAGIC = b"TCSV"
PAGE = 4096


def slot_bytes_for(max_value_bytes: int) -> int:
    """Stride of one slot holding chunks up to ``max_value_bytes`` (with a frame header)."""
    align = PAGE if max_value_bytes >= 256 * 1024 else 64
    return -(-(max_value_bytes + HEADER_ALLOWANCE + TRAILER_BYTES) // align) * align


class Slab:
    def __init__(self, num_slots: int, max_value_bytes: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"the host tier holds no slot of {slot_bytes_for(max_value_bytes)} bytes")
        self.num_slots = num_slots
        #: The largest value a slot takes: a chunk of the config's max_value_bytes and its header.
        self.max_value_bytes = max_value_bytes + HEADER_ALLOWANCE
        self.slot_bytes = slot_bytes_for(max_value_bytes)
        self._map = mmap.mmap(-1, num_slots * self.slot_bytes)
        self._array = np.frombuffer(self._map, np.uint8)  # keeps an export: the map stays mapped
        self.view = memoryview(self._map)
        self.address: int = self._array.ctypes.data
        self.nbytes = num_slots * self.slot_bytes

    def slot(self, index: int) -> memoryview:
        """The whole slot (value, padding, trailer): what lower tiers store."""
        start = index * self.slot_bytes
        return self.view[start : start + self.slot_bytes]

    def value(self, index: int, size: int) -> memoryview:
        """The first ``size`` bytes of the slot: where a value is received or sent from."""
        start = index * self.slot_bytes
        return self.view[start : start + size]

    def value_address(self, index: int) -> int:
        return self.address + index * self.slot_bytes

    def seal(self, index: int, size: int) -> None:
        """Record that the slot holds a value of ``size`` bytes (after all of them arrived)."""
        TRAILER.pack_into(self._map, (index + 1) * self.slot_bytes - TRAILER_BYTES, TRAILER_MAGIC, 0, size)

    def size_of(self, index: int) -> int | None:
        """The value length recorded in the slot's trailer; None if the trailer is not valid."""
        magic, _, size = TRAILER.unpack_from(self._map, (index + 1) * self.slot_bytes - TRAILER_BYTES)
        if magic != TRAILER_MAGIC or not 0 < size <= self.max_value_bytes:
            return None
        return int(size)
