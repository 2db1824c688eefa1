"""The backend conformance kit: the tests every tiercache storage backend passes.

A backend author (built-in or third-party) subclasses :class:`BackendConformance`
in a pytest module and says how to open their backend::

    from tiercache.testing.conformance import BackendConformance

    class TestMyStore(BackendConformance):
        persistent = True                      # reopening the same path sees the same chunks

        def make_backend(self, path, context):
            return MyStoreBackend(MyStoreBackend.settings_model(root=str(path)), context)

        def corrupt_chunk(self, backend, key):  # optional: enables the checksum test
            ...flip a stored byte of ``key`` on the medium...

and pytest runs every ``test_*`` method below against it: put/get round trip,
batch semantics, concurrent jobs, partial failure, the byte budget, recovery
after reopening (persistent media), checksum rejection, namespace isolation,
idempotent close, and that views are not kept after their JobResult; through
store shards (tiercache/testing/conformance_shards.py): TP ranks apart, TP sizes
sharing heads, and ``contains`` of shared tiers. The harness the tests drive the
backend with (open, put/get, waiting for jobs) is conformance_harness.py; keys
and payloads come from payloads.py. Both are re-exported here, where backend
suites import them from.

What the kit holds a backend to (the contract of :class:`~tiercache.backend.Backend`):

* every submitted job is reported by :meth:`~tiercache.backend.Backend.poll`
  exactly once, as one JobResult whose ``ok_keys`` and ``failed_keys`` split
  the job's keys, each in submission order; ``bytes`` is the payload bytes of
  the ok keys; ``poll`` never blocks (each call returns within
  ``poll_budget_s``);
* a failed get never leaves bytes of a missing chunk in its view, and a get
  that fails verification leaves the view either untouched or zeroed;
* a put that would exceed ``context.capacity_bytes`` fails (those keys only),
  the medium stays within budget, and ``delete`` frees space at once.

Buffers: the kit owns every view it hands a backend, and checks that the
backend neither reads a put's view nor writes a get's view after reporting the
job. Threads: the kit calls the backend from the test's thread only.
"""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from tiercache.backend import Backend, BackendContext
from tiercache.testing.conformance_harness import check_split, wait_for_jobs
from tiercache.testing.conformance_shards import StoreShardChecks
from tiercache.testing.payloads import (
    KIT_NAMESPACE,
    OTHER_NAMESPACE,
    SENTINEL,
    make_key,
    make_payload,
)

__all__ = [
    "KIT_NAMESPACE",
    "OTHER_NAMESPACE",
    "SENTINEL",
    "BackendConformance",
    "check_split",
    "make_key",
    "make_payload",
    "wait_for_jobs",
]


class BackendConformance(StoreShardChecks):
    """Base class of a backend's conformance tests; see the module docstring.

    Override :meth:`make_backend` (required), :meth:`corrupt_chunk` and
    :meth:`used_bytes` (optional), and the class attributes of
    :class:`~tiercache.testing.conformance_harness.BackendHarness` as needed.
    """

    # -------------------------------------------------------- the contract
    def test_is_a_backend(self) -> None:
        backend = self.open()
        assert isinstance(backend, Backend)
        assert isinstance(type(backend).name, str) and type(backend).name
        assert isinstance(type(backend).settings_model, type)
        assert issubclass(type(backend).settings_model, BaseModel)
        assert backend.poll() == []

    def test_round_trip(self) -> None:
        backend = self.open()
        chunks = self.chunks(0, 4)
        result = self.put(backend, chunks)
        assert result.ok and result.bytes == 4 * self.chunk_bytes and result.secs >= 0
        self.assert_loads(backend, chunks)

    def test_round_trip_read_only_source(self) -> None:
        backend = self.open()
        key = make_key(0)
        data = make_payload(key, self.chunk_bytes)
        job = self.job_id()
        backend.submit_put(job, [key], [memoryview(data)])  # bytes: a read-only view
        assert self.wait(backend, [job])[job].ok_keys == (key,)
        self.assert_loads(backend, {key: data})

    def test_batch_semantics(self) -> None:
        backend = self.open()
        stored = self.chunks(0, 3)
        put = self.put(backend, stored)
        assert put.ok_keys == tuple(stored)
        a, b, c = stored
        missing = [make_key(100), make_key(101)]
        keys = [missing[0], a, b, missing[1], c]
        result, got = self.get(backend, keys)
        assert result.ok_keys == (a, b, c) and result.failed_keys == tuple(missing)
        assert result.bytes == 3 * self.chunk_bytes
        for key in (a, b, c):
            assert got[key] == stored[key]
        for key in missing:  # nothing was stored: the view must be as it was
            assert got[key] == bytes([SENTINEL]) * self.chunk_bytes

    def test_empty_jobs(self) -> None:
        backend = self.open()
        put_job, get_job = self.job_id(), self.job_id()
        backend.submit_put(put_job, [], [])
        backend.submit_get(get_job, [], [])
        results = self.wait(backend, [put_job, get_job])
        for result in results.values():
            assert result.ok_keys == () and result.failed_keys == () and result.bytes == 0

    def test_concurrent_jobs(self) -> None:
        backend = self.open(self.context(capacity_chunks=16))
        batches = [self.chunks(4 * j, 4) for j in range(4)]
        puts = {}
        for batch in batches:  # all in flight before the first poll
            job = self.job_id()
            puts[job] = batch
            backend.submit_put(job, list(batch), [memoryview(bytearray(v)) for v in batch.values()])
        results = self.wait(backend, puts)
        for job, batch in puts.items():
            check_split(results[job], list(batch))
            assert results[job].ok, f"job {job} failed {len(results[job].failed_keys)} keys"
        gets = {}
        for batch in batches:
            job = self.job_id()
            buffers = {k: bytearray(self.chunk_bytes) for k in batch}
            gets[job] = (batch, buffers)
            backend.submit_get(job, list(batch), [memoryview(b) for b in buffers.values()])
        results = self.wait(backend, gets)
        for job, (batch, buffers) in gets.items():
            assert results[job].ok_keys == tuple(batch)
            assert all(bytes(buffers[k]) == v for k, v in batch.items())

    def test_overwrite(self) -> None:
        backend = self.open()
        first = self.chunks(0, 2, version=0)
        second = self.chunks(0, 2, version=1)
        assert self.put(backend, first).ok
        assert self.put(backend, second).ok
        self.assert_loads(backend, second)

    def test_delete(self) -> None:
        backend = self.open()
        chunks = self.chunks(0, 3)
        assert self.put(backend, chunks).ok
        gone, kept = list(chunks)[:2], list(chunks)[2]
        backend.delete(gone)
        backend.delete(gone)  # again: nothing left to delete, no error
        backend.delete([make_key(999)])  # never stored: no error
        result, got = self.get(backend, list(chunks))
        assert result.ok_keys == (kept,) and result.failed_keys == tuple(gone)
        assert got[kept] == chunks[kept]

    def test_budget_refuses_then_delete_frees(self) -> None:
        context = self.context()
        backend = self.open(context)
        most = context.capacity_bytes // self.chunk_bytes  # payload alone: no more can fit
        chunks = self.chunks(0, most + 3)
        result = self.put(backend, chunks)
        assert 1 <= len(result.ok_keys) <= most, (
            f"{len(result.ok_keys)} chunks of {self.chunk_bytes} bytes stored in a budget of "
            f"{context.capacity_bytes} bytes"
        )
        assert len(result.failed_keys) >= 3
        self._assert_within_budget(backend, context)
        self.assert_loads(backend, {k: chunks[k] for k in result.ok_keys})
        fresh = self.chunks(1000, 1)
        assert self.put(backend, fresh).failed_keys == tuple(fresh)  # still full
        backend.delete([result.ok_keys[0]])
        assert self.put(backend, fresh).ok_keys == tuple(fresh)  # the freed space is usable
        self._assert_within_budget(backend, context)
        self.assert_loads(backend, fresh)

    def _assert_within_budget(self, backend: Backend, context: BackendContext) -> None:
        used = self.used_bytes(backend, self.path)
        if used is not None:
            assert used <= context.capacity_bytes, (
                f"medium holds {used} bytes, budget {context.capacity_bytes}"
            )

    def test_failed_put_leaves_no_chunk(self) -> None:
        context = self.context(capacity_chunks=1)
        backend = self.open(context)
        chunks = self.chunks(0, context.capacity_bytes // self.chunk_bytes + 2)
        result = self.put(backend, chunks)
        assert result.ok_keys and len(result.failed_keys) >= 2
        loaded, got = self.get(backend, list(chunks))
        assert loaded.ok_keys == result.ok_keys and loaded.failed_keys == result.failed_keys
        for key in result.failed_keys:
            assert got[key] == bytes([SENTINEL]) * self.chunk_bytes

    def test_recover_after_reopen(self) -> None:
        if not self.persistent:
            backend = self.open()
            assert self.put(backend, self.chunks(0, 2)).ok
            assert list(self.reopen(backend).recover()) == []
            return
        backend = self.open()
        assert list(backend.recover()) == []
        chunks = self.chunks(0, 5)
        assert self.put(backend, chunks).ok
        dropped = next(iter(chunks))
        backend.delete([dropped])
        del chunks[dropped]
        backend = self.reopen(backend)
        recovered = list(backend.recover())
        assert len(recovered) == len(set(recovered)), "recover() returned a key twice"
        assert set(recovered) == set(chunks)
        self.assert_loads(backend, chunks)
        result, _ = self.get(backend, [dropped])
        assert result.failed_keys == (dropped,)

    def test_namespaces_are_apart(self) -> None:
        if not self.persistent:
            pytest.skip("only persistent media are shared between engines")
        backend = self.open()
        chunks = self.chunks(0, 2)
        assert self.put(backend, chunks).ok
        other = self.reopen(backend, self.context(namespace=OTHER_NAMESPACE))
        assert list(other.recover()) == []
        result, got = self.get(other, list(chunks))
        assert result.failed_keys == tuple(chunks)
        assert all(v == bytes([SENTINEL]) * self.chunk_bytes for v in got.values())
        backend = self.reopen(other)
        self.assert_loads(backend, chunks)

    def test_checksum_rejects_corruption(self) -> None:
        backend = self.open()
        chunks = self.chunks(0, 2)
        assert self.put(backend, chunks).ok
        bad, good = list(chunks)
        try:
            self.corrupt_chunk(backend, bad)
        except NotImplementedError:
            pytest.skip("corrupt_chunk() not implemented for this backend")
        result, got = self.get(backend, [bad, good])
        assert result.ok_keys == (good,) and result.failed_keys == (bad,)
        assert got[good] == chunks[good]
        assert got[bad] in (bytes([SENTINEL]) * self.chunk_bytes, bytes(self.chunk_bytes)), (
            "a chunk that failed verification left bytes in the view"
        )
        assert self.put(backend, {bad: chunks[bad]}).ok  # recomputed and stored again
        self.assert_loads(backend, chunks)

    def test_close_is_idempotent(self) -> None:
        backend = self.open()
        assert self.put(backend, self.chunks(0, 1)).ok
        backend.close()
        backend.close()

    def test_put_view_not_kept(self) -> None:
        backend = self.open()
        key = make_key(0)
        data = make_payload(key, self.chunk_bytes)
        source = bytearray(data)
        job = self.job_id()
        backend.submit_put(job, [key], [memoryview(source)])
        assert self.wait(backend, [job])[job].ok
        source[:] = bytes(len(source))  # the engine reuses its buffer
        self.assert_loads(backend, {key: data})

    def test_get_view_not_written_after_result(self) -> None:
        backend = self.open()
        chunks = self.chunks(0, 2)
        assert self.put(backend, chunks).ok
        target = bytearray(self.chunk_bytes)
        job = self.job_id()
        key = next(iter(chunks))
        backend.submit_get(job, [key], [memoryview(target)])
        assert self.wait(backend, [job])[job].ok
        snapshot = bytes(target)
        assert snapshot == chunks[key]
        assert self.put(backend, self.chunks(0, 2, version=1)).ok  # more I/O on the same key
        self.get(backend, list(chunks))
        assert bytes(target) == snapshot, "the backend wrote into a view after reporting its job"
