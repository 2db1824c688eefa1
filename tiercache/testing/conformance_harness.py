"""The conformance kit's harness: how a kit test drives the backend under test.

:class:`BackendHarness` is the base of every kit class
(:class:`~tiercache.testing.conformance.BackendConformance` and the checks it
mixes in, :class:`~tiercache.testing.conformance_shards.StoreShardChecks`). It
holds what a backend author writes (:meth:`~BackendHarness.make_backend`, the
optional :meth:`~BackendHarness.corrupt_chunk` and
:meth:`~BackendHarness.used_bytes`, the class attributes) and what the tests
call: open/reopen on the test's path, one put or get per job, waiting for
results. It defines no ``test_*`` method; authors subclass
:class:`~tiercache.testing.conformance.BackendConformance`, not this.

:func:`wait_for_jobs` and :func:`check_split` are also used on their own by
tests and benchmarks that drive a backend outside the kit.

Buffers: the harness owns every view it hands a backend (fresh bytearrays per
job). Threads: the harness calls the backend from the test's thread only.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import ClassVar

import pytest

from tiercache.backend import Backend, BackendContext, JobResult
from tiercache.testing.payloads import KIT_NAMESPACE, SENTINEL, make_key, make_payload


def wait_for_jobs(
    backend: Backend, job_ids: Iterable[int], timeout: float = 30.0, poll_budget: float = 0.5
) -> dict[int, JobResult]:
    """Poll until every job in ``job_ids`` is reported; their results by job id.

    Fails the test if a job is reported twice, a job that was not asked for is
    reported, one ``poll()`` call takes longer than ``poll_budget`` seconds, or
    the jobs are not all reported within ``timeout`` seconds.
    """
    wanted = set(job_ids)
    got: dict[int, JobResult] = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(wanted):
        started = time.perf_counter()
        results = backend.poll()
        spent = time.perf_counter() - started
        assert spent <= poll_budget, f"poll() blocked for {spent:.3f}s (budget {poll_budget}s)"
        assert isinstance(results, list), f"poll() returned {type(results).__name__}, not a list"
        for result in results:
            assert isinstance(result, JobResult), f"poll() returned {result!r}"
            assert result.job_id in wanted, f"result for a job never submitted: {result.job_id}"
            assert result.job_id not in got, f"job {result.job_id} reported twice"
            got[result.job_id] = result
        if len(got) < len(wanted):
            if time.monotonic() > deadline:
                missing = sorted(wanted - got.keys())
                raise AssertionError(f"jobs {missing} not reported within {timeout}s")
            if not results:
                time.sleep(0.0005)
    return got


def check_split(result: JobResult, keys: Sequence[bytes]) -> None:
    """``ok_keys`` and ``failed_keys`` split ``keys``, each in submission order."""
    assert isinstance(result.ok_keys, tuple) and isinstance(result.failed_keys, tuple)
    ok, failed = set(result.ok_keys), set(result.failed_keys)
    assert not ok & failed, f"keys both ok and failed: {ok & failed}"
    assert ok | failed == set(keys) and len(result.ok_keys) + len(result.failed_keys) == len(keys)
    assert result.ok_keys == tuple(k for k in keys if k in ok), "ok_keys out of submission order"
    assert result.failed_keys == tuple(k for k in keys if k in failed), "failed_keys out of order"


class BackendHarness:
    """What an author overrides and what the kit's tests call; see the module docstring.

    Override :meth:`make_backend` (required), :meth:`corrupt_chunk` and
    :meth:`used_bytes` (optional), and the class attributes below as needed.
    """

    #: Whether chunks survive closing and reopening the backend on the same path.
    persistent: ClassVar[bool] = False
    #: Payload bytes of every chunk the kit stores (``context.chunk_bytes``).
    chunk_bytes: ClassVar[int] = 16384
    #: Medium bytes one chunk costs against the budget (payload + framing); None: chunk_bytes.
    #: Sizes the budget of the kit's contexts, so that ``capacity_chunks`` chunks fit.
    bytes_per_chunk: ClassVar[int | None] = None
    #: How many chunks fit in the budget of the default context.
    capacity_chunks: ClassVar[int] = 8
    #: Seconds a job may take before the kit gives up on it.
    job_timeout_s: ClassVar[float] = 30.0
    #: Seconds one poll() call may take (poll must never wait for I/O).
    poll_budget_s: ClassVar[float] = 0.5

    # -------------------------------------------------------- what the author writes
    def make_backend(self, path: pathlib.Path, context: BackendContext) -> Backend:
        """Open the backend on ``path`` (reopening the same path sees the same chunks)."""
        raise NotImplementedError("a conformance suite must implement make_backend()")

    def corrupt_chunk(self, backend: Backend, key: bytes) -> None:
        """Damage the stored payload of ``key`` on the medium (behind the backend's back)."""
        raise NotImplementedError

    def used_bytes(self, backend: Backend, path: pathlib.Path) -> int | None:
        """Bytes the medium really holds now, measured independently; None if unknown."""
        return None

    # -------------------------------------------------------- helpers for the tests
    @pytest.fixture(autouse=True)
    def _kit_state(self, tmp_path: pathlib.Path) -> Iterator[None]:
        self._opened: list[Backend] = []
        self._next_job = 1
        self.path = tmp_path / "medium"
        self.path.mkdir()
        yield
        for backend in self._opened:
            backend.close()

    def context(
        self, capacity_chunks: int | None = None, namespace: bytes = KIT_NAMESPACE
    ) -> BackendContext:
        per_chunk = self.bytes_per_chunk or self.chunk_bytes
        chunks = self.capacity_chunks if capacity_chunks is None else capacity_chunks
        return BackendContext(
            tier_name="kit",
            namespace=namespace,
            chunk_bytes=self.chunk_bytes,
            capacity_bytes=chunks * per_chunk,
        )

    def open(self, context: BackendContext | None = None) -> Backend:
        """Open the backend under test on this test's path (closed after the test)."""
        backend = self.make_backend(self.path, context or self.context())
        self._opened.append(backend)
        return backend

    def reopen(self, backend: Backend, context: BackendContext | None = None) -> Backend:
        """Close ``backend`` and open a fresh one on the same path."""
        backend.close()
        return self.open(context)

    def job_id(self) -> int:
        self._next_job += 1
        return self._next_job

    def wait(self, backend: Backend, job_ids: Iterable[int]) -> dict[int, JobResult]:
        return wait_for_jobs(backend, job_ids, self.job_timeout_s, self.poll_budget_s)

    def put(self, backend: Backend, chunks: dict[bytes, bytes]) -> JobResult:
        """Store ``chunks`` in one job and wait for it."""
        job = self.job_id()
        keys = list(chunks)
        backend.submit_put(job, keys, [memoryview(bytearray(chunks[k])) for k in keys])
        result = self.wait(backend, [job])[job]
        check_split(result, keys)
        return result

    def get(self, backend: Backend, keys: Sequence[bytes]) -> tuple[JobResult, dict[bytes, bytes]]:
        """Load ``keys`` in one job into sentinel-filled buffers; the result and every buffer."""
        job = self.job_id()
        buffers = [bytearray([SENTINEL]) * self.chunk_bytes for _ in keys]
        backend.submit_get(job, list(keys), [memoryview(b) for b in buffers])
        result = self.wait(backend, [job])[job]
        check_split(result, keys)
        return result, {k: bytes(b) for k, b in zip(keys, buffers)}

    def chunks(self, first: int, count: int, version: int = 0) -> dict[bytes, bytes]:
        keys = [make_key(i) for i in range(first, first + count)]
        return {k: make_payload(k, self.chunk_bytes, version) for k in keys}

    def assert_loads(self, backend: Backend, chunks: dict[bytes, bytes]) -> None:
        result, got = self.get(backend, list(chunks))
        assert result.failed_keys == (), f"{len(result.failed_keys)} stored chunks failed to load"
        assert result.bytes == len(chunks) * self.chunk_bytes
        for key, data in chunks.items():
            assert got[key] == data, f"chunk {key.hex()} came back different"
