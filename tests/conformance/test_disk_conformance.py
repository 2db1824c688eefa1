"""The disk tier (backends/disk/backend.py) against the conformance kit, in each of its I/O modes.

Every variant is built the way the engine builds it: through
:func:`tiercache.tiers.registry.create_backend` from a tier config naming ``disk``.
The variants cover O_DIRECT with ``fsync: batch`` (on a filesystem that allows
O_DIRECT, such as the ext4 or tmpfs under pytest's tmp_path), buffered I/O with
``fsync: none``, O_DIRECT with ``fsync: always``, ``fsync: batch`` without
syncfs(2) and without file reuse, and ``direct_io: auto`` on a ramfs, which
refuses O_DIRECT, so the tier must fall back to buffered I/O.

After the kit come the disk tier's own rules: the namespaced layout, settings
validation, aligned (in-place O_DIRECT) and unaligned (bounce buffer) views,
odd chunk sizes, one write per key in flight, deletes racing writes, exact
frame accounting, close, and a random concurrent workload checked against
every version ever written.
"""

from __future__ import annotations

import logging
import mmap
import os
import pathlib
import random
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from tiercache.backends.disk import backend as disk_module
from tiercache.backends.disk.backend import DiskBackend, DiskSettings

from tests.integration import mounted
from tiercache.backend import Backend, BackendContext, JobResult
from tiercache.config.schema import ConfigError, TierConfig
from tiercache.integrity import ALIGN, aligned_frame_bytes, round_up
from tiercache.tiers.registry import create_backend
from tiercache.testing.conformance import (
    BackendConformance,
    make_key,
    make_payload,
    wait_for_jobs,
)


class DiskConformance(BackendConformance):
    """Shared by the variants: how to open, corrupt and measure a disk tier."""

    persistent = True
    bytes_per_chunk = aligned_frame_bytes(BackendConformance.chunk_bytes)
    options: ClassVar[dict[str, Any]] = {}
    expect_mode: ClassVar[str | None] = None

    def root_for(self, path: pathlib.Path) -> pathlib.Path:
        return path

    def make_backend(self, path: pathlib.Path, context: BackendContext) -> Backend:
        tier = TierConfig(
            name=context.tier_name,
            backend="disk",
            capacity=context.capacity_bytes,
            options={"root": str(self.root_for(path)), **self.options},
        )
        backend = create_backend(tier, context)
        assert isinstance(backend, DiskBackend)
        if self.expect_mode is not None:
            assert backend.io_mode == self.expect_mode
        return backend

    def corrupt_chunk(self, backend: Backend, key: bytes) -> None:
        assert isinstance(backend, DiskBackend)
        with open(backend.path_of(key), "r+b") as f:
            f.seek(ALIGN + 1234)  # inside the payload
            byte = f.read(1)
            f.seek(ALIGN + 1234)
            f.write(bytes([byte[0] ^ 0xFF]))

    def used_bytes(self, backend: Backend, path: pathlib.Path) -> int:
        total = 0
        for directory, _, files in os.walk(self.root_for(path)):
            total += sum(os.stat(os.path.join(directory, f)).st_size for f in files)
        return total


class TestDiskDirectBatch(DiskConformance):
    options: ClassVar[dict[str, Any]] = {"direct_io": "auto", "fsync": "batch", "io_threads": 4}


class TestDiskBufferedNoSync(DiskConformance):
    options: ClassVar[dict[str, Any]] = {"direct_io": "off", "fsync": "none", "io_threads": 2}
    expect_mode = "buffered"


class TestDiskFsyncAlways(DiskConformance):
    options: ClassVar[dict[str, Any]] = {"direct_io": "auto", "fsync": "always", "io_threads": 3}


class TestDiskBatchWithoutSyncfs(DiskConformance):
    """``fsync: batch`` where syncfs(2) is missing: per-file fdatasync, per-directory fsync."""

    options: ClassVar[dict[str, Any]] = {
        "direct_io": "auto",
        "fsync": "batch",
        "reuse_files": False,
    }

    @pytest.fixture(autouse=True)
    def _no_syncfs(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(disk_module, "_SYNCFS", None)


class TestDiskRamfsFallback(DiskConformance):
    """ramfs refuses O_DIRECT: ``auto`` must choose buffered I/O and pass the same kit."""

    options: ClassVar[dict[str, Any]] = {"direct_io": "auto", "fsync": "batch"}
    expect_mode = "buffered"
    ramfs: ClassVar[pathlib.Path]

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _ramfs(cls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
        with mounted("ramfs", tmp_path_factory.mktemp("ramfs")) as mount:
            cls.ramfs = mount
            yield

    def root_for(self, path: pathlib.Path) -> pathlib.Path:
        return self.ramfs / path.parent.name  # one tree per test, on the ramfs


# ------------------------------------------------------------------ disk specifics, beyond the kit
NS = b"disk-ns1"


def disk_tier(
    root: pathlib.Path,
    chunk: int = 16384,
    capacity: int = 64 << 20,
    rank: int = 0,
    namespace: bytes = NS,
    **options: Any,
) -> DiskBackend:
    context = BackendContext("disk", namespace, chunk, capacity, rank=rank)
    return DiskBackend(DiskBackend.settings_model(root=root, **options), context)


def put(tier: DiskBackend, job: int, chunks: dict[bytes, bytes]) -> JobResult:
    tier.submit_put(job, list(chunks), [memoryview(v) for v in chunks.values()])
    return wait_for_jobs(tier, [job])[job]


def get(
    tier: DiskBackend, job: int, keys: list[bytes], views: list[memoryview] | None = None
) -> tuple[JobResult, list[bytes]]:
    if views is None:
        views = [memoryview(bytearray(tier.chunk_bytes)) for _ in keys]
    tier.submit_get(job, keys, views)
    return wait_for_jobs(tier, [job])[job], [bytes(v) for v in views]


def chunk_set(first: int, count: int, size: int, version: int = 0) -> dict[bytes, bytes]:
    keys = [make_key(i, NS) for i in range(first, first + count)]
    return {k: make_payload(k, size, version) for k in keys}


def test_layout_is_namespaced_per_rank(tmp_path: pathlib.Path) -> None:
    tier = disk_tier(tmp_path, rank=3)
    key = make_key(7, NS)
    path = pathlib.Path(tier.path_of(key))
    assert path.parent.parent == tmp_path / NS.hex() / "rank3"
    assert len(path.parent.name) == 2 and int(path.parent.name, 16) < 256
    assert path.name == key.hex() + ".chunk"
    assert (
        put(tier, 1, {key: make_payload(key, 16384)}).ok and path.stat().st_size == tier.frame_bytes
    )
    other = disk_tier(tmp_path, rank=3, namespace=b"other-ns")
    assert not pathlib.Path(other.path_of(key)).exists() and list(other.recover()) == []
    tier.close()
    other.close()


def test_settings_are_validated_with_named_keys(tmp_path: pathlib.Path) -> None:
    context = BackendContext("disk", NS, 4096, 1 << 20)

    def build(**options: Any) -> Backend:
        tier = TierConfig(name="d", backend="disk", capacity=1 << 20, options=options)
        return create_backend(tier, context, index=1)

    with pytest.raises(ConfigError, match="tiers.1.options.root: Field required"):
        build()
    with pytest.raises(ConfigError, match="tiers.1.options.fsinc: unknown key"):
        build(root=str(tmp_path), fsinc="none")
    with pytest.raises(ConfigError, match="tiers.1.options.fsync: .*'none', 'batch' or 'always'"):
        build(root=str(tmp_path), fsync="sometimes")
    with pytest.raises(ConfigError, match="tiers.1.options.io_threads"):
        build(root=str(tmp_path), io_threads=0)
    with pytest.raises(ConfigError, match="direct_io: .*'auto', 'on' or 'off'"):
        build(root=str(tmp_path), direct_io="maybe")
    defaults = DiskSettings(root=tmp_path)
    assert (defaults.io_threads, defaults.fsync, defaults.direct_io) == (4, "batch", "auto")


def test_io_mode_is_logged(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tiercache.backends.disk.backend"):
        tier = disk_tier(tmp_path, direct_io="off")
    assert tier.io_mode == "buffered"
    assert any("buffered I/O" in r.getMessage() for r in caplog.records)
    tier.close()


@pytest.mark.parametrize("direct_io", ["auto", "off"])
@pytest.mark.parametrize("chunk", [4096, 10_000, 1 << 20])
@pytest.mark.parametrize("where", ["aligned", "unaligned"])
def test_aligned_and_unaligned_buffers(
    tmp_path: pathlib.Path, direct_io: str, chunk: int, where: str
) -> None:
    """Page-aligned views take the in-place O_DIRECT path, others the bounce buffer."""
    tier = disk_tier(tmp_path, chunk=chunk, direct_io=direct_io)
    chunks = chunk_set(0, 3, chunk)
    offset = 0 if where == "aligned" else 1
    src = mmap.mmap(-1, 3 * round_up(chunk) + ALIGN)
    dst = mmap.mmap(-1, 3 * round_up(chunk) + ALIGN)
    spans = [(offset + i * round_up(chunk), offset + i * round_up(chunk) + chunk) for i in range(3)]
    for (a, b), data in zip(spans, chunks.values()):
        src[a:b] = data
    keys = list(chunks)
    tier.submit_put(1, keys, [memoryview(src)[a:b] for a, b in spans])
    assert wait_for_jobs(tier, [1])[1].ok
    result, _ = get(tier, 2, keys, [memoryview(dst)[a:b] for a, b in spans])
    assert result.ok and all(dst[a:b] == data for (a, b), data in zip(spans, chunks.values()))
    tier.close()
    tier = disk_tier(tmp_path, chunk=chunk, direct_io="off" if direct_io == "auto" else "auto")
    assert set(tier.recover()) == set(keys)  # frames are the same in either I/O mode
    result, got = get(tier, 3, keys)
    assert result.ok and got == list(chunks.values())
    tier.close()


def test_unusable_views_and_keys_fail_only_their_key(tmp_path: pathlib.Path) -> None:
    tier = disk_tier(tmp_path, chunk=4096)
    good = make_key(1, NS)
    too_long = b"k" * 101
    keys = [good, make_key(2, NS), too_long]
    views = [memoryview(bytes(4096)), memoryview(bytes(100)), memoryview(bytes(4096))]
    tier.submit_put(1, keys, views)
    result = wait_for_jobs(tier, [1])[1]
    assert result.ok_keys == (good,) and result.failed_keys == tuple(keys[1:])
    read_only = memoryview(bytes(4096))
    result, _ = get(tier, 2, [good], [read_only])
    assert result.failed_keys == (good,)
    with pytest.raises(ValueError, match="2 keys but 1 views"):
        tier.submit_get(3, [good, good], [memoryview(bytearray(4096))])
    assert tier.stats()["put_failures"] == 2
    tier.close()


def test_a_key_has_one_write_in_flight(tmp_path: pathlib.Path) -> None:
    tier = disk_tier(tmp_path, chunk=1 << 20)
    key = make_key(0, NS)
    tier.submit_put(1, [key], [memoryview(make_payload(key, 1 << 20, 0))])
    tier.submit_put(2, [key], [memoryview(make_payload(key, 1 << 20, 1))])
    results = wait_for_jobs(tier, [1, 2])
    assert results[1].ok_keys == (key,) and results[2].failed_keys == (key,)
    _, got = get(tier, 3, [key])
    assert got == [make_payload(key, 1 << 20, 0)]
    tier.close()


@pytest.mark.parametrize("reuse_files", [True, False])
def test_delete_while_writing_leaves_no_chunk(tmp_path: pathlib.Path, reuse_files: bool) -> None:
    tier = disk_tier(tmp_path, chunk=1 << 20, fsync="always", reuse_files=reuse_files)
    chunks = chunk_set(0, 8, 1 << 20)
    keys = list(chunks)
    tier.submit_put(1, keys, [memoryview(v) for v in chunks.values()])
    tier.delete(keys[:4])  # while the writes are (most likely) in flight
    result = wait_for_jobs(tier, [1])[1]
    assert set(keys[4:]) <= set(result.ok_keys)
    tier.poll()
    assert tier.contains(keys) == [False] * 4 + [True] * 4
    chunk_files = {p.name for p in tmp_path.rglob("*.chunk")}
    assert chunk_files == {pathlib.Path(tier.path_of(k)).name for k in keys[4:]}
    free_files = list(tmp_path.rglob("*.free"))
    assert len(free_files) == (4 if reuse_files else 0) == tier.stats()["free_files"]
    assert not list(tmp_path.rglob("*.tmp"))
    assert tier.stats()["bytes_used"] == (4 + len(free_files)) * tier.frame_bytes
    tier.close()


@pytest.mark.parametrize("reuse_files", [True, False])
def test_deleted_files_are_reused_or_removed(tmp_path: pathlib.Path, reuse_files: bool) -> None:
    frame = aligned_frame_bytes(16384)
    tier = disk_tier(tmp_path, capacity=4 * frame, reuse_files=reuse_files)
    first = chunk_set(0, 4, 16384)
    assert put(tier, 1, first).ok
    inodes = {os.stat(tier.path_of(k)).st_ino for k in first}
    tier.delete(list(first)[:2])
    assert tier.stats()["free_files"] == (2 if reuse_files else 0)
    assert tier.stats()["bytes_used"] == (4 if reuse_files else 2) * frame
    second = chunk_set(10, 2, 16384)
    assert put(tier, 2, second).ok  # fits either way: free files are inside the budget
    if reuse_files:  # the new chunks live in the old files (inode numbers are reused anyway)
        assert {os.stat(tier.path_of(k)).st_ino for k in second} <= inodes
    tier.delete(list(second))
    tier.close()
    tier = disk_tier(tmp_path, capacity=4 * frame, reuse_files=reuse_files)  # free files survive
    assert tier.stats()["free_files"] == (2 if reuse_files else 0)
    result, got = get(tier, 3, list(first)[2:])
    assert result.ok and got == list(first.values())[2:]
    tier.close()
    tier = disk_tier(tmp_path, capacity=2 * frame, reuse_files=reuse_files)  # a smaller budget
    assert set(tier.recover()) == set(list(first)[2:])  # free files were trimmed first
    assert tier.stats()["free_files"] == 0 and not list(tmp_path.rglob("*.free"))
    tier.close()


def test_budget_counts_frames_exactly(tmp_path: pathlib.Path) -> None:
    frame = aligned_frame_bytes(10_000)
    tier = disk_tier(tmp_path, chunk=10_000, capacity=3 * frame + frame - 1)
    result = put(tier, 1, chunk_set(0, 5, 10_000))
    assert len(result.ok_keys) == 3 and tier.stats()["over_budget"] == 2
    assert tier.stats()["bytes_used"] == 3 * frame
    # an overwrite writes a second file before it replaces the first: no room for it now
    assert put(tier, 2, chunk_set(0, 1, 10_000, version=1)).failed_keys == result.ok_keys[:1]
    tier.delete([result.ok_keys[2]])
    assert put(tier, 3, chunk_set(0, 1, 10_000, version=1)).ok
    assert tier.stats()["bytes_used"] == 2 * frame  # the rename let the old version's file go
    _, got = get(tier, 4, [result.ok_keys[0]])
    assert got == list(chunk_set(0, 1, 10_000, version=1).values())
    tier.close()


def test_close_waits_and_refuses_new_jobs(tmp_path: pathlib.Path) -> None:
    tier = disk_tier(tmp_path, chunk=1 << 20)
    chunks = chunk_set(0, 6, 1 << 20)
    tier.submit_put(1, list(chunks), [memoryview(v) for v in chunks.values()])
    tier.close()
    assert not list(tmp_path.rglob("*.tmp"))
    with pytest.raises(RuntimeError, match="closed"):
        tier.submit_get(2, [], [])
    tier.close()


def test_random_concurrent_workload_never_serves_wrong_bytes(tmp_path: pathlib.Path) -> None:
    """Puts, overwrites, gets and deletes of overlapping keys with many jobs in flight."""
    rng = random.Random(1234)
    size = 8192
    tier = disk_tier(tmp_path, chunk=size, capacity=40 * aligned_frame_bytes(size), io_threads=4)
    keys = [make_key(i, NS) for i in range(60)]
    versions: dict[bytes, set[int]] = {k: set() for k in keys}  # every version ever written
    job = 0
    for _ in range(40):
        inflight: dict[int, tuple[str, list[bytes], list[bytearray]]] = {}
        for _ in range(rng.randint(1, 6)):
            job += 1
            batch = rng.sample(keys, rng.randint(1, 8))
            if rng.random() < 0.5:
                version = rng.randint(0, 3)
                for k in batch:
                    versions[k].add(version)
                bufs = [bytearray(make_payload(k, size, version)) for k in batch]
                tier.submit_put(job, batch, [memoryview(b) for b in bufs])
                inflight[job] = ("put", batch, bufs)
            else:
                bufs = [bytearray(size) for _ in batch]
                tier.submit_get(job, batch, [memoryview(b) for b in bufs])
                inflight[job] = ("get", batch, bufs)
            if rng.random() < 0.3:
                tier.delete(rng.sample(keys, rng.randint(1, 5)))
        results = wait_for_jobs(tier, inflight)
        for job_id, (kind, batch, bufs) in inflight.items():
            result = results[job_id]
            assert set(result.ok_keys) | set(result.failed_keys) == set(batch)
            if kind == "get":
                for key, buf in zip(batch, bufs):
                    if key in result.ok_keys:
                        assert any(bytes(buf) == make_payload(key, size, v) for v in versions[key])
        tier.poll()
        stats = tier.stats()
        files = list(tmp_path.rglob("*.chunk"))
        free = list(tmp_path.rglob("*.free"))
        assert (stats["chunks"], stats["free_files"]) == (len(files), len(free))
        assert stats["bytes_used"] == (len(files) + len(free)) * tier.frame_bytes
        assert stats["bytes_used"] <= tier.capacity_bytes
        assert not list(tmp_path.rglob("*.tmp"))
        assert {bytes.fromhex(p.name[:-6]) for p in files} == {
            k for k in keys if tier.contains([k])[0]
        }
    tier.close()
