"""Misbehaving backends, for the conformance kit and the fault tests: tiercache must recompute in each.

Named in a config by import path (tiercache/tiers/registry.py takes ``module:Class``)::

    tiers:
      - {name: cpu, backend: cpu, capacity: 64MiB}
      - {name: stuck, backend: "tiercache.testing.faulty_backends:NeverReportsBackend", capacity: 1GiB}

* :class:`NeverReportsBackend` (``NEVER_REPORTS``): keeps chunks in memory;
  puts are reported at once, gets never (``stall: get``, the default), or no
  job ever is (``stall: all``). It keeps a get's views like a backend whose
  I/O is stuck; :meth:`NeverReportsBackend.finish_stuck` plays the late
  arrival (writes the chunks, reports the jobs) for tests that check where
  late bytes land.
* :class:`RaisingBackend` (``RAISES``): every call after construction raises
  (``recover`` too unless ``recover_ok``: an engine cannot start on a tier
  whose recovery fails, by design).
* :class:`WrongBytesBackend` (``WRONG_BYTES``): stores chunks unframed and
  hands back other bytes with an "ok" (every byte XOR 0x5A); only the core's
  own check (tiercache/tiers/chunk_digests.py) can catch it.

Threading: the owner's thread only (no I/O threads: nothing here waits).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from tiercache.backend import Backend, BackendContext, BackendSettings, JobResult

_HERE = "tiercache.testing.faulty_backends"
NEVER_REPORTS = f"{_HERE}:NeverReportsBackend"
RAISES = f"{_HERE}:RaisingBackend"
WRONG_BYTES = f"{_HERE}:WrongBytesBackend"


class FaultySettings(BackendSettings):
    stall: Literal["get", "all"] = Field(default="get", description="NeverReports: which jobs never end.")
    recover_ok: bool = Field(default=True, description="Raising: recover() returns nothing instead of raising.")


class _MemoryBackend(Backend):
    """Chunks in a dict, copied in and out on the caller's thread (no framing)."""

    settings_model = FaultySettings

    def __init__(self, settings: FaultySettings, context: BackendContext) -> None:
        self.settings = settings
        self.context = context
        self.chunks: dict[bytes, bytes] = {}
        self._results: list[JobResult] = []

    def _limit(self) -> int:
        return max(0, self.context.capacity_bytes // max(1, self.footprint(self.context.chunk_bytes)))

    def _put_now(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        ok, failed = [], []
        for key, view in zip(keys, views):
            if key in self.chunks or len(self.chunks) < self._limit():
                self.chunks[bytes(key)] = bytes(view)
                ok.append(key)
            else:
                failed.append(key)
        self._results.append(JobResult(job_id, tuple(ok), tuple(failed), len(ok) * self.context.chunk_bytes, 0.0))

    def _get_now(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview], wrong: bool = False) -> None:
        ok, failed = [], []
        for key, view in zip(keys, views):
            data = self.chunks.get(bytes(key))
            if data is None or len(data) != view.nbytes:
                failed.append(key)
                continue
            out = np.frombuffer(view.cast("B") if view.format != "B" else view, dtype=np.uint8)
            out[:] = np.frombuffer(data, dtype=np.uint8) ^ (0x5A if wrong else 0)
            ok.append(key)
        self._results.append(JobResult(job_id, tuple(ok), tuple(failed), len(ok) * self.context.chunk_bytes, 0.0))

    def submit_put(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        self._put_now(job_id, keys, views)

    def submit_get(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        self._get_now(job_id, keys, views)

    def poll(self) -> list[JobResult]:
        out, self._results = self._results, []
        return out

    def delete(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.chunks.pop(bytes(key), None)

    def close(self) -> None:
        self.chunks.clear()
        self._results.clear()


class NeverReportsBackend(_MemoryBackend):
    """Gets (``stall: get``) or all jobs (``stall: all``) are never reported; see the module docstring."""

    name = "never_reports"

    def __init__(self, settings: FaultySettings, context: BackendContext) -> None:
        super().__init__(settings, context)
        self.stuck: list[tuple[str, int, list[bytes], list[memoryview]]] = []  # jobs holding views

    def submit_put(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        if self.settings.stall == "all":
            self.stuck.append(("put", job_id, list(keys), list(views)))
        else:
            self._put_now(job_id, keys, views)

    def submit_get(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        self.stuck.append(("get", job_id, list(keys), list(views)))

    def finish_stuck(self) -> int:
        """Tests: the stuck jobs end now (late), writing their views first; how many ended."""
        stuck, self.stuck = self.stuck, []
        for op, job_id, keys, views in stuck:
            (self._put_now if op == "put" else self._get_now)(job_id, keys, views)
        return len(stuck)

    def close(self) -> None:
        self.stuck.clear()  # a closed backend writes nothing any more
        super().close()


class RaisingBackend(_MemoryBackend):
    """Every call raises (construction does not; ``recover`` only without ``recover_ok``)."""

    name = "raises"

    @staticmethod
    def _boom(what: str) -> RuntimeError:
        return RuntimeError(f"RaisingBackend.{what}: raised by design (tiercache.testing.faulty_backends)")

    def submit_put(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        raise self._boom("submit_put")

    def submit_get(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        raise self._boom("submit_get")

    def poll(self) -> list[JobResult]:
        raise self._boom("poll")

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        raise self._boom("contains")

    def delete(self, keys: Sequence[bytes]) -> None:
        raise self._boom("delete")

    def recover(self) -> tuple[bytes, ...]:
        if self.settings.recover_ok:
            return ()
        raise self._boom("recover")

    def close(self) -> None:
        raise self._boom("close")


class WrongBytesBackend(_MemoryBackend):
    """Stores chunks unframed; every get is reported ok with other bytes (XOR 0x5A)."""

    name = "wrong_bytes"

    def submit_get(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        self._get_now(job_id, keys, views, wrong=True)
