"""A lower tier seen through store shards: chunks in, per-head shards on the medium.

:class:`ShardedBackend` wraps every lower-tier backend (built-in or plugin),
so no backend author has to know about TP ranks: the backend stores fixed-size
values under opaque keys, and this wrapper turns a chunk job into shard jobs
(:mod:`tiercache.shards`) and their results back into one chunk result.

* put: each chunk's write shards are cut into buffers owned here until the
  inner backend reports the job (a rank that writes no shard of a chunk, a
  replica, reports it stored at once);
* get: the chunk's read shards are read into buffers owned here; a chunk is
  OK only if every one of its shards is, and only then are the shards joined
  into the caller's view (the host staging slot). A chunk with a missing or
  failed shard is reported failed: the engine recomputes it;
* contains: a chunk is present when every shard of ``ShardSet.reads`` is;
* recover: a chunk is recovered when every shard it reads is listed;
* delete: every shard this process writes.

With rank shards (no head cut possible) or one local head whose shard is the
whole chunk, the caller's view is handed to the backend as is (no copy).

Threading: the owner's thread only, like the Backend contract.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from tiercache.backend import Backend, JobResult
from tiercache.shards import HeadSlicer, ShardSet
from tiercache.tiers.worker_lanes import BackendJob

_Op = Literal["put", "get"]


@dataclass(eq=False, slots=True)
class _Job(BackendJob):
    """One chunk job in flight (the kit's record: ``keys`` are its chunks, ``views`` the
    caller's), plus its shard keys per chunk and the buffers the inner backend holds."""

    shard_keys: list[list[bytes]] = field(default_factory=list)
    buffers: list[list[np.ndarray]] = field(default_factory=list)


class ShardedBackend(Backend):
    """Wraps ``inner`` so that it holds store shards named by head, never whole rank chunks."""

    def __init__(self, inner: Backend, shards: ShardSet, slicer: HeadSlicer | None = None) -> None:
        self.inner = inner
        self.shards = shards
        self.slicer = slicer
        self.name = inner.name
        self.shared = inner.shared
        self.verifies_integrity = inner.verifies_integrity  # frames name the shard key: a checked shard is ours
        self._jobs: dict[int, _Job] = {}
        self._done: list[JobResult] = []
        # Zero-copy when a shard is the whole chunk: a rank shard, or one head on this rank.
        self._whole = shards.local_heads is None or (slicer is not None and slicer.local_heads == 1)

    # ------------------------------------------------------------------ jobs
    def submit_put(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        self._submit("put", job_id, keys, views)

    def submit_get(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        self._submit("get", job_id, keys, views)

    def _submit(self, op: _Op, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        positions = self.shards.writes if op == "put" else self.shards.reads
        if self.shards.ignore_rank:
            positions = positions[:1]
        shard_keys = [[self.shards.key(k, s) for s in positions] for k in keys]
        buffers = [self._buffers(op, view, positions) for view in views]
        job = _Job(op, job_id, list(keys), list(views), shard_keys=shard_keys, buffers=buffers)
        flat_keys = [sk for per in shard_keys for sk in per]
        if not flat_keys:  # a replica rank: nothing of these chunks is ours to write
            self._done.append(JobResult(job_id, tuple(keys), (), 0, 0.0))
            return
        self._jobs[job_id] = job
        flat_views = [memoryview(b) for per in buffers for b in per]
        try:
            (self.inner.submit_put if op == "put" else self.inner.submit_get)(job_id, flat_keys, flat_views)
        except BaseException:
            del self._jobs[job_id]
            raise

    def _buffers(self, op: _Op, view: memoryview, positions: Sequence[int]) -> list[np.ndarray]:
        chunk = np.frombuffer(view, dtype=np.uint8)
        if self._whole or self.shards.ignore_rank:
            return [chunk] * len(positions)
        assert self.slicer is not None and self.shards.local_heads is not None
        local = dict(zip(self.shards.reads, self.shards.local_heads))
        out = []
        for shard in positions:
            buf = np.empty(self.slicer.shard_bytes, dtype=np.uint8)
            if op == "put":
                self.slicer.cut(chunk, local[shard], buf)
            out.append(buf)
        return out

    def poll(self) -> list[JobResult]:
        out, self._done = self._done, []
        for res in self.inner.poll():
            job = self._jobs.pop(res.job_id, None)
            if job is None:
                continue
            out.append(self._chunk_result(res, job))
        return out

    def _chunk_result(self, res: JobResult, job: _Job) -> JobResult:
        failed_shards = set(res.failed_keys)
        ok_shards = set(res.ok_keys)
        ok: list[bytes] = []
        failed: list[bytes] = []
        for chunk, per, buffers, view in zip(job.keys, job.shard_keys, job.buffers, job.views):
            if all(sk in ok_shards and sk not in failed_shards for sk in per):
                if job.kind == "get" and not (self._whole or self.shards.ignore_rank):
                    self._join(buffers, view)
                ok.append(chunk)
            else:
                failed.append(chunk)
        return JobResult(res.job_id, tuple(ok), tuple(failed), res.bytes, res.secs)

    def _join(self, buffers: list[np.ndarray], view: memoryview) -> None:
        assert self.slicer is not None and self.shards.local_heads is not None
        chunk = np.frombuffer(view, dtype=np.uint8)
        for buf, head in zip(buffers, self.shards.local_heads):
            self.slicer.join(buf, head, chunk)

    # ------------------------------------------------------------ directory
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        per_chunk = [self.shards.read_keys(k) for k in keys]
        flat = [sk for per in per_chunk for sk in per]
        present = iter(self.inner.contains(flat))
        answers = [[next(present) for _ in per] for per in per_chunk]
        return [all(a) for a in answers]

    def delete(self, keys: Sequence[bytes]) -> None:
        shard_keys = [sk for k in keys for sk in self.shards.write_keys(k)]
        if shard_keys:
            self.inner.delete(shard_keys)

    def recover(self) -> Iterable[bytes]:
        listed = set(self.inner.recover())
        if self.shards.ignore_rank:
            return list(listed)
        chunks = {ShardSet.chunk_of(k) for k in listed}
        return [c for c in chunks if all(sk in listed for sk in self.shards.read_keys(c))]

    def close(self) -> None:
        self._jobs.clear()
        self.inner.close()
