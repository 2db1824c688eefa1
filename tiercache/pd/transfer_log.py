"""What the P/D consumer's reads report to the transfer metrics: (path, bytes, seconds) per READ.

Paths: ``peer_host_to_device`` / ``peer_device_to_device``
(:data:`tiercache.pd.read_plans.PEER_HOST_TO_DEVICE` /
:data:`~tiercache.pd.read_plans.PEER_DEVICE_TO_DEVICE`), a whole hand-off by
source, its seconds from building its descriptors to its tags checked (the
READs and any re-reads; not the handshake, the notice or the queueing); and
:data:`PEER_DATA_READ`, either source, the data READs alone (handle made,
posted, completed, released), the part that compares with raw NIXL and with
what vLLM's NixlConnector reports as ``nixl_xfer_time_seconds`` (NIXL's own
telemetry, from post to completion).

Threads: :meth:`TransferLog.record` from whichever thread read (the reader's
I/O thread, or the worker thread inline), :meth:`TransferLog.take` from the
worker thread; a lock keeps them apart.
"""

from __future__ import annotations

import threading

PEER_DATA_READ = "peer_data_read"

Transfer = tuple[str, int, float]  # (path, bytes, seconds)


class TransferLog:
    """The transfers finished since the last :meth:`take`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._transfers: list[Transfer] = []

    def record(self, *transfers: Transfer) -> None:
        with self._lock:
            self._transfers.extend(transfers)

    def take(self) -> list[Transfer]:
        """Every transfer recorded since the last call, oldest first."""
        with self._lock:
            out, self._transfers = self._transfers, []
        return out
