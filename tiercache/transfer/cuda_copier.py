"""CudaStreamCopier: block copies on dedicated CUDA streams, ordered by events.

See tiercache/transfer/device.py for the ordering contract it implements.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import torch

from tiercache.transfer.device import BlockCopier, CopyDone, CopyJob, copy_segments
from tiercache.layout import KVBlockLayout


class CudaStreamCopier(BlockCopier):
    """Copies on dedicated CUDA streams, ordered against the compute stream by events."""

    def __init__(self, layout: KVBlockLayout, slab: torch.Tensor, blocks_per_chunk: int,
                 planes: Sequence[torch.Tensor] | None = None) -> None:
        super().__init__(layout, slab, blocks_per_chunk, planes)
        device = layout.device
        self._store_stream = torch.cuda.Stream(device=device)
        self._load_stream = torch.cuda.Stream(device=device)
        self._inflight: deque[tuple[CopyJob, torch.cuda.Event, float, int, str]] = deque()
        self._last_store_done: torch.cuda.Event | None = None

    def submit(self, job: CopyJob) -> None:
        compute = torch.cuda.current_stream(self.layout.device)
        ready = torch.cuda.Event()
        ready.record(compute)
        stream = self._store_stream if job.direction == "store" else self._load_stream
        done = torch.cuda.Event()
        error = ""
        moved = 0
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            try:
                moved = copy_segments(
                    self.layout, self.slab, self.blocks_per_chunk, job, non_blocking=True, planes=self.planes
                )
            except Exception as exc:  # noqa: BLE001 - a failed copy is a failed job
                error = repr(exc)
            done.record(stream)
        if job.direction == "store":
            self._last_store_done = done
        self._inflight.append((job, done, time.perf_counter(), moved, error))

    def poll(self) -> list[CopyDone]:
        out: list[CopyDone] = []
        keep: deque[tuple[CopyJob, torch.cuda.Event, float, int, str]] = deque()
        for item in self._inflight:
            job, done, started, moved, error = item
            if done.query():
                out.append(CopyDone(job.job_id, not error, moved, time.perf_counter() - started, error))
            else:
                keep.append(item)
        self._inflight = keep
        return out

    def fence_stores(self) -> None:
        if self._last_store_done is not None:
            torch.cuda.current_stream(self.layout.device).wait_event(self._last_store_done)

    def wait_all(self) -> list[CopyDone]:
        self._store_stream.synchronize()
        self._load_stream.synchronize()
        return self.poll()

    def close(self) -> None:
        self.wait_all()


