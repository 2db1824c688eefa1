"""Unit tests of the LMDB tier (backends/lmdb/backend.py): its own rules beyond the conformance kit.

Settings and construction through the plugin registry; map sizing; the
on-disk layout (a sub-database per namespace and rank, framed values);
intake checks (keys, views) and the order of failed keys; the budget counted
in the sub-database (exact across writers); an exhausted map; checksum and
foreign-frame rejection; deletes seen at once; recovery that reads no chunk
body; several backends of one process on one environment; counters.
Multi-process behaviour is in tests/integration/test_lmdb_multiprocess.py.
"""

from __future__ import annotations

import pathlib
import resource
import time
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
from tiercache.backends.lmdb.backend import (
    MAP_HEADROOM_MIN_BYTES,
    MAX_KEY_BYTES,
    LMDBBackend,
    LMDBSettings,
    database_name,
    default_map_size,
    max_frame_bytes,
)

from tiercache import integrity
from tiercache.backend import BackendContext, JobResult
from tiercache.config.schema import ConfigError, TierConfig
from tiercache.tiers.registry import backend_class, create_backend

NS = b"unit-ns1"
CHUNK = 4096
PAGE = 4096


# ------------------------------------------------------------------------------ helpers
def key(i: int, namespace: bytes = NS) -> bytes:
    return namespace + i.to_bytes(32, "big") + bytes(4)


def payload(i: int, size: int = CHUNK, version: int = 0) -> bytes:
    return np.random.default_rng([i, version]).bytes(size)


def context(capacity_chunks: int = 16, chunk: int = CHUNK, namespace: bytes = NS,
            rank: int = 0, world_size: int = 1) -> BackendContext:
    return BackendContext("lmdb", namespace, chunk, capacity_chunks * max_frame_bytes(chunk),
                          rank=rank, world_size=world_size)


class Tiers:
    """Opens backends for one test and closes them all after it."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.opened: list[LMDBBackend] = []
        self._job = 0

    def open(
        self, ctx: BackendContext | None = None, name: str = "env", **options: object
    ) -> LMDBBackend:
        tier = LMDBBackend(LMDBSettings(path=self.root / name, **options), ctx or context())
        self.opened.append(tier)
        return tier

    def run(self, tier: LMDBBackend, kind: str, keys: Sequence[bytes],
            views: Sequence[object]) -> JobResult:
        self._job += 1
        submit = tier.submit_put if kind == "put" else tier.submit_get
        submit(self._job, list(keys), list(views))  # type: ignore[arg-type]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            results = tier.poll()
            if results:
                (result,) = results
                assert result.job_id == self._job
                return result
            time.sleep(0.0005)
        raise TimeoutError(f"job {self._job} not reported")

    def put(self, tier: LMDBBackend, ids: Sequence[int], version: int = 0) -> JobResult:
        return self.run(tier, "put", [key(i) for i in ids],
                        [memoryview(payload(i, tier.context.chunk_bytes, version)) for i in ids])

    def get(self, tier: LMDBBackend, ids: Sequence[int]) -> tuple[JobResult, list[bytearray]]:
        bufs = [bytearray(b"\xa5" * tier.context.chunk_bytes) for _ in ids]
        return self.run(tier, "get", [key(i) for i in ids], [memoryview(b) for b in bufs]), bufs


@pytest.fixture
def tiers(tmp_path: pathlib.Path) -> Iterator[Tiers]:
    t = Tiers(tmp_path)
    yield t
    for tier in t.opened:
        tier.close()


def raw_put(tier: LMDBBackend, k: bytes, value: bytes) -> None:
    """Write a value under ``k`` behind the backend's framing (with its own handles)."""
    with tier._env.begin(db=tier._db, write=True) as txn:
        txn.put(k, value)


def raw_value(tier: LMDBBackend, k: bytes) -> bytes | None:
    with tier._env.begin(db=tier._db) as txn:
        return txn.get(k)


# ---------------------------------------------------------------------------- settings
def test_settings_defaults() -> None:
    s = LMDBSettings(path="/x")
    assert s.map_size is None and s.max_readers == 126 and s.sync is False
    assert s.io_threads == 1 and s.subdir is True and s.readonly is False
    assert LMDBSettings(path="/x", map_size="1GiB").map_size == 1 << 30


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "path"),
        ({"path": "/x", "colour": 1}, "unknown key"),
        ({"path": "/x", "io_threads": 0}, "io_threads"),
        ({"path": "/x", "max_readers": 0}, "max_readers"),
        ({"path": "/x", "map_size": "lots"}, "map_size"),
    ],
)
def test_bad_options_are_config_errors(options: dict[str, object], message: str) -> None:
    tier = TierConfig(name="lmdb", backend="lmdb", capacity=1 << 20, options=options)
    with pytest.raises(ConfigError, match=message):
        create_backend(tier, context())


def test_built_through_the_registry(tmp_path: pathlib.Path) -> None:
    assert backend_class("lmdb") is LMDBBackend
    tier = TierConfig(name="lmdb", backend="lmdb", capacity=1 << 20,
                      options={"path": str(tmp_path / "e"), "io_threads": 2})
    backend = create_backend(tier, context())
    try:
        assert isinstance(backend, LMDBBackend) and backend.settings.io_threads == 2
    finally:
        backend.close()


def test_capacity_below_one_frame_is_refused(tmp_path: pathlib.Path) -> None:
    tight = BackendContext("lmdb", NS, CHUNK, max_frame_bytes(CHUNK) - 1)
    with pytest.raises(ValueError, match="holds no chunk frame"):
        LMDBBackend(LMDBSettings(path=tmp_path / "e"), tight)


# ------------------------------------------------------------------------------- sizing
def test_footprint_is_the_largest_frame() -> None:
    assert LMDBBackend.footprint(CHUNK) == max_frame_bytes(CHUNK)
    assert max_frame_bytes(CHUNK) == integrity.compact_header_len(MAX_KEY_BYTES) + CHUNK


def test_default_map_size_counts_overflow_pages_and_headroom() -> None:
    frame = max_frame_bytes(256 << 10)  # 256 KiB + 168 + LMDB's 16 -> 65 pages each
    assert default_map_size(100, frame, PAGE) == 100 * 65 * PAGE + MAP_HEADROOM_MIN_BYTES
    big = 10_000 * 65 * PAGE
    assert default_map_size(10_000, frame, PAGE) == big + big // 4


def test_default_map_covers_every_rank(tiers: Tiers) -> None:
    one = tiers.open(context(capacity_chunks=50_000), name="a")
    four = tiers.open(context(capacity_chunks=50_000, world_size=4), name="b")
    assert one.map_size == default_map_size(50_000, one.frame_bytes)
    assert four.map_size == default_map_size(200_000, one.frame_bytes)
    assert tiers.open(context(), name="c", map_size="200MiB").map_size == 200 << 20


@pytest.mark.parametrize("sync", [False, True])
def test_environment_flags(tiers: Tiers, sync: bool) -> None:
    tier = tiers.open(sync=sync, max_readers=20)
    flags = tier._env.flags()
    assert flags["sync"] is sync and flags["metasync"] is sync and flags["subdir"] is True
    assert tier._env.max_readers() == 20
    assert tier._env.info()["map_size"] == tier.map_size


# ------------------------------------------------------------------------------- layout
def test_values_are_frames_in_a_namespace_and_rank_database(tiers: Tiers) -> None:
    tier = tiers.open(context(rank=3, world_size=4))
    assert tiers.put(tier, [1]).ok
    assert database_name(NS, 3) == b"tiercache/frames-v1/" + NS.hex().encode() + b"/rank3"
    assert tier._env.dbs() == [database_name(NS, 3)]
    frame = raw_value(tier, key(1))
    assert frame is not None and len(frame) == integrity.compact_header_len(len(key(1))) + CHUNK
    out = bytearray(CHUNK)
    integrity.decode_frame(frame, NS, key(1), memoryview(out))
    assert bytes(out) == payload(1)


def test_ranks_and_namespaces_are_apart(tiers: Tiers) -> None:
    rank0 = tiers.open(context(rank=0, world_size=2))
    rank1 = tiers.open(context(rank=1, world_size=2))  # same path: shares the environment
    assert rank0._env is rank1._env
    assert tiers.put(rank0, [1], version=0).ok and tiers.put(rank1, [1], version=1).ok
    (r0, (b0,)), (r1, (b1,)) = tiers.get(rank0, [1]), tiers.get(rank1, [1])
    assert r0.ok and bytes(b0) == payload(1, version=0)
    assert r1.ok and bytes(b1) == payload(1, version=1)
    other = tiers.open(context(namespace=b"other-ns"))
    assert other.recover() == [] and other.contains([key(1)]) == [False]


# ------------------------------------------------------------------------------- intake
def test_bad_keys_and_views_fail_in_submission_order(tiers: Tiers) -> None:
    tier = tiers.open()
    good = [key(0), key(1)]
    keys = [key(0), key(5, b"other-ns"), b"", key(1), NS + bytes(MAX_KEY_BYTES), key(2), key(3)]
    views = [memoryview(payload(0)), memoryview(payload(5)), memoryview(payload(6)),
             memoryview(payload(1)), memoryview(payload(7)), memoryview(bytes(CHUNK + 1)),
             memoryview(b"")]
    result = tiers.run(tier, "put", keys, views)
    assert result.ok_keys == tuple(good)
    assert result.failed_keys == tuple(k for k in keys if k not in good)
    assert result.bytes == 2 * CHUNK
    assert tier.stats()["put_failures"] == 5


def test_views_of_any_layout_round_trip(tiers: Tiers) -> None:
    tier = tiers.open()
    source = np.frombuffer(payload(9), dtype=np.float16).reshape(32, -1)  # 2-D, not bytes
    assert tiers.run(tier, "put", [key(9)], [memoryview(source)]).ok
    target = np.zeros((16, CHUNK // 16), dtype=np.uint8)
    assert tiers.run(tier, "get", [key(9)], [memoryview(target)]).ok
    assert target.tobytes() == payload(9)


def test_unusable_get_views_fail(tiers: Tiers) -> None:
    tier = tiers.open()
    assert tiers.put(tier, [1, 2, 3]).ok
    strided = memoryview(bytearray(2 * CHUNK))[::2]
    read_only = memoryview(bytes(CHUNK))
    smaller = bytearray(b"\xa5" * (CHUNK - 1))
    views = [strided, read_only, memoryview(smaller)]
    result = tiers.run(tier, "get", [key(1), key(2), key(3)], views)
    assert result.failed_keys == (key(1), key(2), key(3))
    assert bytes(smaller) == b"\xa5" * (CHUNK - 1)  # intact frame, wrong size: untouched
    assert tier.stats()["checksum_failures"] == 0


def test_mismatched_job_fails_whole_and_never_raises(tiers: Tiers) -> None:
    tier = tiers.open()
    result = tiers.run(tier, "put", [key(0), key(1)], [memoryview(payload(0))])
    assert result.failed_keys == (key(0), key(1)) and result.ok_keys == ()


# ------------------------------------------------------------------------------- budget
def test_budget_counts_chunks_in_the_database(tiers: Tiers) -> None:
    tier = tiers.open(context(capacity_chunks=4))
    assert tier.capacity_chunks == 4
    first = tiers.put(tier, [0, 1, 2, 3, 4, 5])
    assert first.ok_keys == tuple(key(i) for i in range(4))
    assert tiers.put(tier, [0, 1], version=1).ok  # overwriting needs no room
    assert tier.stats()["bytes_used"] == 4 * tier.frame_bytes
    tier.delete([key(0)])
    assert tiers.put(tier, [4]).ok
    stats = tier.stats()
    assert stats["puts"] == 7 and stats["put_failures"] == 2
    assert stats["bytes_used"] == 4 * tier.frame_bytes


def test_budget_is_shared_by_writers_of_one_namespace(tiers: Tiers) -> None:
    a = tiers.open(context(capacity_chunks=4))
    b = tiers.open(context(capacity_chunks=4))  # another backend on the same database
    assert tiers.put(a, [0, 1, 2]).ok
    result = tiers.put(b, [10, 11, 12])
    assert result.ok_keys == (key(10),) and result.failed_keys == (key(11), key(12))


def test_full_map_drops_puts_and_keeps_serving(tiers: Tiers) -> None:
    chunk = 256 << 10
    tier = tiers.open(context(capacity_chunks=64, chunk=chunk), map_size="2MiB")
    stored: list[int] = []
    dropped = 0
    for first in range(0, 24, 2):
        ids = [first, first + 1]
        result = tiers.put(tier, ids)
        if result.ok:
            stored += ids
        else:
            assert result.failed_keys == tuple(key(i) for i in ids)  # the whole transaction
            dropped += 2
    stats = tier.stats()
    assert stored and dropped and stats["map_full"] == dropped == stats["put_failures"]
    result, bufs = tiers.get(tier, stored)
    assert result.ok and all(bytes(b) == payload(i, chunk) for i, b in zip(stored, bufs))
    tier.delete([key(i) for i in stored])
    assert tiers.put(tier, [100, 101]).ok  # room again
    assert tiers.get(tier, [100, 101])[0].ok


# ------------------------------------------------------------------------------ integrity
def test_damaged_and_foreign_frames_are_misses_and_counted(tiers: Tiers) -> None:
    tier = tiers.open()
    assert tiers.put(tier, [1, 2, 3, 4]).ok
    damaged = bytearray(raw_value(tier, key(1)) or b"")
    damaged[-100] ^= 0x01
    raw_put(tier, key(1), bytes(damaged))
    raw_put(tier, key(2), raw_value(tier, key(3)) or b"")  # key 3's intact frame under key 2
    raw_put(tier, key(4), b"short")
    result, bufs = tiers.get(tier, [1, 2, 3, 4])
    assert result.ok_keys == (key(3),) and result.failed_keys == (key(1), key(2), key(4))
    assert bytes(bufs[0]) == bytes(CHUNK)  # copied while hashed, then zeroed on the mismatch
    assert all(bytes(b) == b"\xa5" * CHUNK for b in (bufs[1], bufs[3]))  # refused before copying
    assert tier.stats()["checksum_failures"] == 3


# ------------------------------------------------------------------------------ deletes
def test_delete_is_seen_at_once_by_gets_and_contains(tiers: Tiers) -> None:
    tier = tiers.open(io_threads=3)
    assert tiers.put(tier, list(range(8))).ok
    tier.delete([key(i) for i in range(4)])
    assert tier.contains([key(i) for i in range(8)]) == [False] * 4 + [True] * 4
    result, _ = tiers.get(tier, list(range(8)))
    assert result.ok_keys == tuple(key(i) for i in range(4, 8))
    tier.delete([key(99)])  # never stored: nothing happens
    wait_until(lambda: not tier._deleting)
    assert tier.stats()["delete_failures"] == 0 and len(tier.recover()) == 4


def wait_until(condition: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline
        time.sleep(0.001)


# ------------------------------------------------------------------------------ recover
def test_recover_reads_keys_not_bodies(tiers: Tiers) -> None:
    chunk = 1 << 20
    ctx = context(capacity_chunks=64, chunk=chunk)
    tier = tiers.open(ctx)
    for first in range(0, 64, 16):
        assert tiers.put(tier, list(range(first, first + 16))).ok
    tier.close()
    tier = tiers.open(ctx)  # a fresh map: nothing of it is paged in yet
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    keys = tier.recover()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert sorted(keys) == [key(i) for i in range(64)]
    assert faults < 1024, f"{faults} page faults: recover() read chunk bodies (64 MiB)"


# ---------------------------------------------------------------------------- lifecycle
def test_backends_of_one_process_share_the_environment(tiers: Tiers) -> None:
    a = tiers.open()
    b = tiers.open(context(namespace=b"second-n"))
    assert a._env is b._env
    a.close()
    assert tiers.put(b, [0]).ok is False  # key of NS: refused by the other namespace
    assert tiers.run(b, "put", [key(0, b"second-n")], [memoryview(payload(0))]).ok
    b.close()
    c = tiers.open()  # the last user closed it; this opens it afresh
    assert c._env is not a._env and c.recover() == []


def test_read_only_backend_reads_and_refuses_writes(tiers: Tiers) -> None:
    writer = tiers.open()
    assert tiers.put(writer, [1]).ok
    writer.close()
    reader = tiers.open(readonly=True)
    assert tiers.get(reader, [1])[0].ok
    assert tiers.put(reader, [2]).failed_keys == (key(2),)
    reader.delete([key(1)])  # no-op on a read-only tier
    assert reader.contains([key(1)]) == [True]
    with pytest.raises(ValueError, match="read-only"):
        tiers.open()  # a writer cannot join a read-only environment of this process


def test_closed_backend_fails_jobs_and_never_raises(tiers: Tiers) -> None:
    tier = tiers.open()
    assert tiers.put(tier, [1]).ok
    tier.close()
    tier.submit_put(7, [key(2)], [memoryview(payload(2))])
    tier.submit_get(8, [key(1)], [memoryview(bytearray(CHUNK))])
    results = {r.job_id: r for r in tier.poll()}  # every job is still reported, as failed
    assert results[7].failed_keys == (key(2),) and results[8].failed_keys == (key(1),)
    assert tier.contains([key(1)]) == [False] and tier.recover() == []
    tier.delete([key(1)])
    assert tier.stats()["bytes_used"] == 0


def test_many_jobs_in_flight_on_several_threads(tiers: Tiers) -> None:
    tier = tiers.open(context(capacity_chunks=256), io_threads=3)
    for first in range(0, 128, 8):
        tier.submit_put(first, [key(i) for i in range(first, first + 8)],
                        [memoryview(payload(i)) for i in range(first, first + 8)])
    done = drain(tier, 16)
    assert all(r.ok for r in done)
    bufs = {i: bytearray(CHUNK) for i in range(128)}
    for first in range(0, 128, 8):
        tier.submit_get(1000 + first, [key(i) for i in range(first, first + 8)],
                        [memoryview(bufs[i]) for i in range(first, first + 8)])
    assert all(r.ok for r in drain(tier, 16))
    assert all(bytes(bufs[i]) == payload(i) for i in range(128))
    stats = tier.stats()
    assert stats["puts"] == stats["gets"] == 128 and stats["bytes_used"] == 128 * tier.frame_bytes


def drain(tier: LMDBBackend, count: int) -> list[JobResult]:
    results: list[JobResult] = []
    deadline = time.monotonic() + 30
    while len(results) < count:
        assert time.monotonic() < deadline
        results += tier.poll()
        time.sleep(0.0005)
    return results


def test_keys_that_are_not_bytes_fail_without_raising(tiers: Tiers) -> None:
    tier = tiers.open()
    odd: list = ["text", 7, bytearray(key(1)), memoryview(key(2))]
    result = tiers.run(tier, "put", odd, [memoryview(payload(i)) for i in range(4)])
    assert result.ok_keys == (key(1), key(2)) and result.failed_keys == ("text", 7)
    assert tier.contains(odd + [b"", key(3)]) == [False, False, True, True, False, False]
    tier.delete(odd + [b""])
    assert tier.contains([key(1), key(2)]) == [False, False]
