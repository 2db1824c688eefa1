"""The LMDB tier across real processes: one environment, several engines on one node.

Every test starts real processes (``multiprocessing`` with ``spawn``, so no
LMDB state is inherited through fork) that open the same environment with
their own :class:`~tiercache.backends.lmdb.backend.LMDBBackend`, as the engines of a
node do, and report back through a queue:

* a writer stores chunks, one write transaction per job, while a read-only
  and a read-write process read them back: every chunk they get is byte
  exact, and they only ever see whole transactions (the read-only one opened
  before the writer had created the namespace);
* a process whose map is smaller than what another process wrote adopts the
  grown map and reads on;
* a writer killed (SIGKILL) in the middle of its transactions leaves an
  environment that another process opens, writes and reads;
* two writers of one namespace share its budget exactly.
"""

from __future__ import annotations

import multiprocessing
import pathlib
import random
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from tiercache.backends.lmdb.backend import LMDBBackend, LMDBSettings

from tiercache.backend import BackendContext, JobResult

NAMESPACE = b"mp-ns-01"
CHUNK = 64 << 10
BATCH = 4
TIMEOUT_S = 60.0

_spawn = multiprocessing.get_context("spawn")


# ------------------------------------------------------------------------------ helpers
def key_of(i: int) -> bytes:
    return NAMESPACE + i.to_bytes(32, "big") + bytes(4)


def payload_of(key: bytes, size: int = CHUNK) -> bytes:
    return random.Random(key).randbytes(size)


def open_tier(
    path: pathlib.Path, capacity_chunks: int = 512, chunk: int = CHUNK, **options: Any
) -> LMDBBackend:
    context = BackendContext(
        tier_name="lmdb", namespace=NAMESPACE, chunk_bytes=chunk,
        capacity_bytes=capacity_chunks * LMDBBackend.footprint(chunk),
    )
    return LMDBBackend(LMDBSettings(path=path, **options), context)


_job_ids = iter(range(1, 1 << 30))


def run_job(
    tier: LMDBBackend, kind: str, keys: Sequence[bytes], views: Sequence[memoryview]
) -> JobResult:
    """Submit one job and poll until it is reported."""
    job = next(_job_ids)
    (tier.submit_put if kind == "put" else tier.submit_get)(job, list(keys), list(views))
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        for result in tier.poll():
            assert result.job_id == job
            return result
        time.sleep(0.001)
    raise TimeoutError(f"{kind} job {job} not reported")


def put_chunks(tier: LMDBBackend, keys: Sequence[bytes], chunk: int = CHUNK) -> JobResult:
    return run_job(tier, "put", keys, [memoryview(payload_of(k, chunk)) for k in keys])


def get_exact(tier: LMDBBackend, keys: Sequence[bytes], chunk: int = CHUNK) -> JobResult:
    """Get ``keys``; assert every one that loads is byte exact."""
    buffers = [bytearray(chunk) for _ in keys]
    result = run_job(tier, "get", keys, [memoryview(b) for b in buffers])
    for key, buf in zip(keys, buffers):
        if key in result.ok_keys:
            assert bytes(buf) == payload_of(key, chunk), f"chunk {key.hex()} came back different"
    return result


def child(report: Any, fn: Callable[..., dict[str, Any]], *args: Any) -> None:
    """Run ``fn`` in the child process and put its result (or its traceback) on ``report``."""
    try:
        report.put(fn(*args))
    except BaseException:
        report.put({"error": traceback.format_exc()})


def start(report: Any, fn: Callable[..., dict[str, Any]], *args: Any) -> Any:
    proc = _spawn.Process(target=child, args=(report, fn, *args), daemon=True)
    proc.start()
    return proc


def collect(report: Any, count: int) -> list[dict[str, Any]]:
    results = [report.get(timeout=TIMEOUT_S) for _ in range(count)]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, "\n".join(errors)
    return results


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)


# ------------------------------------------------------- child process bodies (spawned)
def write_batches(path: pathlib.Path, count: int, pause_s: float) -> dict[str, Any]:
    """Store chunks 0..count-1, BATCH per job (one write transaction each)."""
    tier = open_tier(path)
    try:
        for first in range(0, count, BATCH):
            result = put_chunks(tier, [key_of(i) for i in range(first, first + BATCH)])
            assert result.ok, f"put of batch {first // BATCH} failed {result.failed_keys}"
            time.sleep(pause_s)
        return {"stats": tier.stats()}
    finally:
        tier.close()


def read_until_all(path: pathlib.Path, count: int, readonly: bool) -> dict[str, Any]:
    """Poll the environment until all ``count`` chunks are seen; check every view of it."""
    tier = open_tier(path, readonly=readonly)
    expected = [key_of(i) for i in range(count)]
    rounds, sizes = 0, set()
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            visible = set(tier.recover())
            n = len(visible)
            assert n % BATCH == 0, f"saw {n} chunks: part of a transaction"
            assert visible == set(expected[:n]), "saw chunks out of commit order"
            # Commits only add: what recover() saw is still there (the next batch may
            # have landed since, so the key after it can be either).
            assert tier.contains(expected[:n]) == [True] * n
            result = get_exact(tier, sorted(visible))
            assert result.ok, f"{len(result.failed_keys)} visible chunks failed to load"
            rounds += 1
            sizes.add(n)
            if n == count:
                break
            assert time.monotonic() < deadline, f"only {n} of {count} chunks after {TIMEOUT_S}s"
            time.sleep(0.003)
        return {"rounds": rounds, "distinct_sizes": len(sizes), "stats": tier.stats()}
    finally:
        tier.close()


def read_after_growth(path: pathlib.Path, ready: Any, go: Any, count: int) -> dict[str, Any]:
    """Open with a small map, let another process grow the data past it, then read."""
    tier = open_tier(path, readonly=True, map_size=4 << 20)
    try:
        before = tier._env.info()["map_size"]
        ready.set()
        assert go.wait(TIMEOUT_S)
        result = get_exact(tier, [key_of(i) for i in range(count)])
        return {"before": before, "after": tier._env.info()["map_size"],
                "ok": len(result.ok_keys), "stats": tier.stats()}
    finally:
        tier.close()


def write_forever(path: pathlib.Path, committed: Any) -> dict[str, Any]:
    """Store batches of large chunks until killed; announce each committed batch."""
    tier = open_tier(path, capacity_chunks=4096, chunk=CHUNK * 4)
    first = 0
    while True:
        keys = [key_of(i) for i in range(first, first + BATCH)]
        assert put_chunks(tier, keys, CHUNK * 4).ok
        committed.put(first + BATCH)
        first += BATCH


def write_and_read_back(path: pathlib.Path, committed: int) -> dict[str, Any]:
    """After a writer died: read what it committed, write more, read that too."""
    tier = open_tier(path, capacity_chunks=4096, chunk=CHUNK * 4)
    try:
        held = set(tier.recover())
        old = [key_of(i) for i in range(committed)]
        assert held >= set(old), "a committed chunk is gone"
        assert get_exact(tier, old, CHUNK * 4).ok
        new = [key_of(i) for i in range(10_000, 10_000 + BATCH)]
        assert put_chunks(tier, new, CHUNK * 4).ok
        assert get_exact(tier, new, CHUNK * 4).ok
        return {"held": len(held), "stats": tier.stats()}
    finally:
        tier.close()


def put_some(path: pathlib.Path, first: int, count: int, capacity: int, go: Any) -> dict[str, Any]:
    tier = open_tier(path, capacity_chunks=capacity)
    try:
        assert go.wait(TIMEOUT_S)
        stored = 0
        for i in range(first, first + count):  # one job per chunk: the two writers interleave
            stored += len(put_chunks(tier, [key_of(i)]).ok_keys)
        return {"stored": stored}
    finally:
        tier.close()


# ------------------------------------------------------------------------------ tests
def create_environment(path: pathlib.Path) -> None:
    """Make the environment exist (a read-only process cannot create it), without our namespace."""
    context = BackendContext("lmdb", b"other-ns", CHUNK, 4 * LMDBBackend.footprint(CHUNK))
    LMDBBackend(LMDBSettings(path=path), context).close()


def test_readers_see_whole_transactions_byte_exact(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "env"
    create_environment(path)
    report = _spawn.Queue()
    count = 96
    readers = [start(report, read_until_all, path, count, readonly) for readonly in (True, False)]
    time.sleep(0.5)  # the readers open first: the namespace does not exist yet
    writer = start(report, write_batches, path, count, 0.01)
    results = collect(report, 3)
    for proc in (writer, *readers):
        proc.join(TIMEOUT_S)
        assert proc.exitcode == 0
    reads = [r for r in results if "rounds" in r]
    assert len(reads) == 2
    for r in reads:
        assert r["distinct_sizes"] > 2, "the reader never saw the writer in progress"
        assert r["stats"]["checksum_failures"] == 0 and r["stats"]["gets"] >= count
    (written,) = [r for r in results if "rounds" not in r]
    assert written["stats"]["puts"] == count and written["stats"]["put_failures"] == 0


def test_map_grown_by_another_process_is_adopted(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "env"
    create_environment(path)
    report = _spawn.Queue()
    ready, go = _spawn.Event(), _spawn.Event()
    count = 128  # 8 MiB of chunks: twice the reader's map
    reader = start(report, read_after_growth, path, ready, go, count)
    assert ready.wait(TIMEOUT_S)
    writer = start(report, write_batches, path, count, 0.0)
    (wrote,) = collect(report, 1)
    assert wrote["stats"]["puts"] == count
    go.set()
    (read,) = collect(report, 1)
    for proc in (reader, writer):
        proc.join(TIMEOUT_S)
    assert read["ok"] == count, read
    assert read["after"] > read["before"] and read["after"] > count * CHUNK


def test_writer_killed_mid_write_leaves_a_usable_environment(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "env"
    committed = _spawn.Queue()
    report = _spawn.Queue()
    writer = start(report, write_forever, path, committed)
    done = 0
    while done < 5 * BATCH:
        done = committed.get(timeout=TIMEOUT_S)
    time.sleep(0.05)  # let it be inside its next transactions
    writer.kill()
    writer.join(TIMEOUT_S)
    assert writer.exitcode == -9
    while not committed.empty():  # batches committed before the kill
        done = committed.get()
    survivor = start(report, write_and_read_back, path, done)
    (result,) = collect(report, 1)
    survivor.join(TIMEOUT_S)
    assert survivor.exitcode == 0
    assert result["held"] >= done and result["stats"]["checksum_failures"] == 0


def test_two_writers_share_one_budget(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "env"
    create_environment(path)
    report = _spawn.Queue()
    go = _spawn.Event()
    capacity = 8
    writers = [start(report, put_some, path, first, 6, capacity, go) for first in (0, 100)]
    time.sleep(0.3)
    go.set()
    results = collect(report, 2)
    for proc in writers:
        proc.join(TIMEOUT_S)
    assert sum(r["stored"] for r in results) == capacity
    tier = open_tier(path, capacity_chunks=capacity)
    try:
        assert len(tier.recover()) == capacity
        assert tier.stats()["bytes_used"] == capacity * LMDBBackend.footprint(CHUNK)
    finally:
        tier.close()


@pytest.fixture(autouse=True)
def _no_leftover_children() -> Iterator[None]:
    yield
    for proc in _spawn.active_children():  # a failed test's children
        proc.kill()
        proc.join(5)
