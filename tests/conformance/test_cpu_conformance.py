"""The host-memory tier (tiercache/transfer/host_slab.py) against the conformance kit, through its keyed API.

The host tier is volatile and holds unframed bytes (it is the staging tier,
not a lower tier), so the kit's recovery, namespace and checksum tests do not
apply to it and skip.
"""

from __future__ import annotations

import pathlib

from tiercache.transfer.host_slab import HostTier

from tiercache.backend import BackendContext
from tiercache.testing.conformance import BackendConformance


class TestHostTierConformance(BackendConformance):
    persistent = False

    def make_backend(self, path: pathlib.Path, context: BackendContext) -> HostTier:
        slots = context.capacity_bytes // context.chunk_bytes
        return HostTier(slots, context.chunk_bytes, pin_memory=False)
