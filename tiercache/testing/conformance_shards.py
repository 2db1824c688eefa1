"""Conformance checks of a backend seen through store shards, and of ``contains``.

The base of :class:`tiercache.testing.conformance.BackendConformance`, so every
backend's suite runs them against the real medium; they drive the backend
through :class:`~tiercache.testing.conformance_harness.BackendHarness`. The engine never hands a
backend whole rank chunks: it wraps it in a
:class:`~tiercache.tiers.sharded_backend.ShardedBackend`, and these checks hold the
pair to the rule of tiercache/shards.py: two processes that differ only in TP
rank never see each other's bytes, and engines of different TP sizes share
the shards of the same KV heads.

The model here has two KV heads; one head's shard of one chunk is
``chunk_bytes`` long (the kit's context), so a TP=2 rank's chunk is one shard
and a TP=1 engine's chunk is two, head-major (pages ``[heads, ...]``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from tiercache.backend import Backend, JobResult
from tiercache.shards import HeadSlicer, head_shards
from tiercache.testing.conformance_harness import BackendHarness
from tiercache.testing.payloads import make_key, make_payload
from tiercache.tiers.sharded_backend import ShardedBackend

HEADS = 2


class StoreShardChecks(BackendHarness):
    """``test_*`` methods the kit runs for every backend (see the module docstring)."""

    def _engine(self, backend: Backend, tp_size: int, rank: int) -> ShardedBackend:
        shards = head_shards(HEADS, tp_size, rank)
        local = len(shards.reads)
        head_map = np.repeat(np.arange(local, dtype=np.int16), self.chunk_bytes)
        return ShardedBackend(backend, shards, HeadSlicer([head_map], local, 1))

    def _put_chunk(self, engine: ShardedBackend, key: bytes, data: bytes) -> JobResult:
        job = self.job_id()
        engine.submit_put(job, [key], [memoryview(bytearray(data))])
        return self.wait(engine, [job])[job]

    def _get_chunk(self, engine: ShardedBackend, key: bytes, size: int) -> tuple[JobResult, bytes]:
        job = self.job_id()
        buf = bytearray(b"\xa5") * size
        engine.submit_get(job, [key], [memoryview(buf)])
        return self.wait(engine, [job])[job], bytes(buf)

    def _payloads(self, key: bytes, heads: Sequence[int]) -> bytes:
        return b"".join(make_payload(key, self.chunk_bytes, version=h) for h in heads)

    def test_ranks_are_apart(self) -> None:
        backend = self.open()
        rank0, rank1 = self._engine(backend, 2, 0), self._engine(backend, 2, 1)
        key = make_key(40)
        assert self._put_chunk(rank0, key, self._payloads(key, [0])).ok
        result, got = self._get_chunk(rank1, key, self.chunk_bytes)
        assert result.failed_keys == (key,), "rank 1 loaded a chunk only rank 0 stored"
        assert got == b"\xa5" * self.chunk_bytes, "a failed load wrote into its view"
        if backend.shared:
            assert rank1.contains([key]) == [False]
            assert rank0.contains([key]) == [True]

    def test_tp_sizes_share_heads(self) -> None:
        backend = self.open()
        tp1 = self._engine(backend, 1, 0)
        rank0, rank1 = self._engine(backend, 2, 0), self._engine(backend, 2, 1)
        a, b = make_key(41), make_key(42)
        # TP=2 writes both heads of a; a TP=1 engine reads the whole chunk.
        assert self._put_chunk(rank0, a, self._payloads(a, [0])).ok
        assert self._put_chunk(rank1, a, self._payloads(a, [1])).ok
        result, got = self._get_chunk(tp1, a, HEADS * self.chunk_bytes)
        assert result.ok and got == self._payloads(a, [0, 1])
        # TP=1 writes b; each TP=2 rank reads its own head.
        assert self._put_chunk(tp1, b, self._payloads(b, [0, 1])).ok
        for rank, engine in enumerate((rank0, rank1)):
            result, got = self._get_chunk(engine, b, self.chunk_bytes)
            assert result.ok and got == self._payloads(b, [rank]), f"rank {rank} got another head"

    def test_contains(self) -> None:
        backend = self.open()
        if not backend.shared:
            pytest.skip("contains() is asked of shared tiers only")
        chunks = self.chunks(50, 2)
        assert self.put(backend, chunks).ok
        missing = make_key(99)
        assert backend.contains([*chunks, missing]) == [True, True, False]
        backend.delete([next(iter(chunks))])
        assert backend.contains(list(chunks)) == [False, True]

    def test_recover_lists_chunks_whose_shards_are_all_there(self) -> None:
        if not self.persistent:
            pytest.skip("only persistent media recover")
        backend = self.open()
        a, b = make_key(43), make_key(44)
        assert self._put_chunk(self._engine(backend, 1, 0), a, self._payloads(a, [0, 1])).ok
        assert self._put_chunk(self._engine(backend, 2, 0), b, self._payloads(b, [0])).ok
        backend = self.reopen(backend)
        assert set(self._engine(backend, 1, 0).recover()) == {a}  # b lacks head 1
        assert set(self._engine(backend, 2, 0).recover()) == {a, b}
        assert set(self._engine(backend, 2, 1).recover()) == {a}
