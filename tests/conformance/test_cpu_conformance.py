"""MemoryBackend (tiercache/testing/memory_backend.py: keyed put/get over a host slab) against the conformance kit.

It is volatile and holds unframed bytes (a test backend, not a lower tier),
so the kit's recovery, namespace and checksum tests do not
apply to it and skip.
"""

from __future__ import annotations

import pathlib

from tiercache.backend import BackendContext
from tiercache.testing.conformance import BackendConformance
from tiercache.testing.memory_backend import MemoryBackend
from tiercache.transfer.host_slab import HostSlab


class TestMemoryBackendConformance(BackendConformance):
    persistent = False

    def make_backend(self, path: pathlib.Path, context: BackendContext) -> MemoryBackend:
        slots = context.capacity_bytes // context.chunk_bytes
        return MemoryBackend(HostSlab(slots, context.chunk_bytes, pin_memory=False))
