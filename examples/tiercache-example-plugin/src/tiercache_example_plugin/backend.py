"""``example_memory``: a tiercache backend that keeps chunks in a Python dict.

It is deliberately small, to show a backend author the whole contract:

* constructed as ``ExampleMemoryBackend(settings, context)``, where
  ``settings`` is an :class:`ExampleMemorySettings` built from the tier's YAML
  ``options`` and ``context`` says the namespace, chunk size and byte budget;
* ``submit_put`` / ``submit_get`` copy between the caller's views and the
  medium and record one JobResult per job; ``poll`` hands the results over.
  This medium is memory, so the copy is done at once on the caller's thread;
  a backend with real I/O does it on threads of its own and ``poll`` only
  collects what finished;
* every value is stored as a :mod:`tiercache.integrity` frame and verified on
  load: a damaged frame is a failed key (a miss, recomputed by the engine),
  never bytes in the caller's view;
* the byte budget (``context.capacity_bytes``) counts what the medium really
  holds (frames, header included) and a put that does not fit fails.

Buffers: views are read (put) or written (get) only inside ``submit_*`` and
never kept. Threads: every method runs on the owner's thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pydantic import Field

from tiercache.backend import Backend, BackendContext, BackendSettings, JobResult
from tiercache.integrity import IntegrityError, decode_frame, encode_frame


class ExampleMemorySettings(BackendSettings):
    """Options of an ``example_memory`` tier."""

    max_chunks: int | None = Field(
        default=None, ge=1, description="Hold at most this many chunks (on top of the byte budget)."
    )


class ExampleMemoryBackend(Backend):
    name = "example_memory"
    settings_model = ExampleMemorySettings

    def __init__(self, settings: ExampleMemorySettings, context: BackendContext) -> None:
        self.settings = settings
        self.context = context
        self.frames: dict[bytes, bytes] = {}  # key -> framed chunk (public for tests and tools)
        self.used_bytes = 0
        self.checksum_failures = 0
        self._results: list[JobResult] = []

    def submit_put(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        start = time.perf_counter()
        ok, failed = [], []
        for key, view in zip(keys, views):
            frame = encode_frame(self.context.namespace, key, view)  # a copy: the view is not kept
            if self._fits(key, len(frame)):
                self.used_bytes += len(frame) - len(self.frames.get(key, b""))
                self.frames[key] = frame
                ok.append(key)
            else:
                failed.append(key)
        self._report(job_id, ok, failed, start)

    def submit_get(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        start = time.perf_counter()
        ok, failed = [], []
        for key, view in zip(keys, views):
            frame = self.frames.get(key)
            try:
                if frame is None:
                    raise KeyError(key)
                decode_frame(frame, self.context.namespace, key, view)  # verifies, then copies
                ok.append(key)
            except IntegrityError:
                self.checksum_failures += 1
                self.delete([key])
                failed.append(key)
            except (KeyError, ValueError, TypeError):
                failed.append(key)
        self._report(job_id, ok, failed, start)

    def poll(self) -> list[JobResult]:
        results, self._results = self._results, []
        return results

    def delete(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            frame = self.frames.pop(key, None)
            if frame is not None:
                self.used_bytes -= len(frame)

    def close(self) -> None:
        self.frames.clear()
        self.used_bytes = 0

    def _fits(self, key: bytes, size: int) -> bool:
        old = len(self.frames.get(key, b""))
        if self.used_bytes - old + size > self.context.capacity_bytes:
            return False
        limit = self.settings.max_chunks
        return limit is None or key in self.frames or len(self.frames) < limit

    def _report(self, job_id: int, ok: list[bytes], failed: list[bytes], start: float) -> None:
        moved = len(ok) * self.context.chunk_bytes
        self._results.append(
            JobResult(job_id, tuple(ok), tuple(failed), moved, time.perf_counter() - start)
        )
