"""Faults of the disk tier on real files, real filesystems and real processes (no mocks).

* a writer process killed with SIGKILL in the middle of writing chunks: the
  restarted tier serves no damaged chunk, removes the half-written files and
  keeps its index equal to what is on disk;
* a corrupted, truncated or foreign chunk file: the load fails, is counted,
  the file is removed, and a recomputed store heals it;
* a root that cannot be written: a clear start-up error naming the path;
* a full filesystem (a 4 MiB tmpfs): stores fail and are counted, loads go on,
  and space freed by deletes is used again.

Mounting needs root; tests that need a mount skip with the reason otherwise.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from tiercache.backends.disk.backend import DiskBackend, DiskSettings

from tests.integration import mounted
from tiercache.backend import BackendContext, JobResult
from tiercache.config.schema import ConfigError
from tiercache.integrity import ALIGN
from tiercache.testing.conformance import make_key, make_payload, wait_for_jobs

NS = b"fault-ns"
CHUNK = 64 << 10


def context(capacity: int = 256 << 20, chunk: int = CHUNK, namespace: bytes = NS) -> BackendContext:
    return BackendContext("faults", namespace, chunk, capacity)


def open_tier(root: pathlib.Path, capacity: int = 256 << 20, **options: object) -> DiskBackend:
    return DiskBackend(DiskSettings(root=root, **options), context(capacity))  # type: ignore[arg-type]


class Driver:
    """Runs jobs against one tier and waits for them (the owner's thread)."""

    def __init__(self, tier: DiskBackend) -> None:
        self.tier = tier
        self.job = 0

    def put(self, keys: list[bytes], version: int = 0) -> JobResult:
        self.job += 1
        views = [memoryview(make_payload(k, self.tier.chunk_bytes, version)) for k in keys]
        self.tier.submit_put(self.job, keys, views)
        return wait_for_jobs(self.tier, [self.job])[self.job]

    def get(self, keys: list[bytes]) -> tuple[JobResult, list[bytes]]:
        self.job += 1
        buffers = [bytearray(self.tier.chunk_bytes) for _ in keys]
        self.tier.submit_get(self.job, keys, [memoryview(b) for b in buffers])
        return wait_for_jobs(self.tier, [self.job])[self.job], [bytes(b) for b in buffers]


def files_under(root: pathlib.Path, suffix: str) -> list[pathlib.Path]:
    return [p for p in root.rglob(f"*{suffix}") if p.is_file()]


def keys_on_disk(root: pathlib.Path) -> set[bytes]:
    return {bytes.fromhex(p.name.removesuffix(".chunk")) for p in files_under(root, ".chunk")}


# ----------------------------------------------------------------------- SIGKILL mid-write
WRITER = textwrap.dedent(
    """
    import sys, time
    from tiercache.backends.disk.backend import DiskBackend, DiskSettings
    from tiercache.backend import BackendContext
    from tiercache.testing.conformance import make_key, make_payload

    root, fsync, reuse, log_path, first = sys.argv[1:6]
    ns, chunk, next_key = b"fault-ns", 64 << 10, int(first)
    settings = DiskSettings(root=root, fsync=fsync, io_threads=4, reuse_files=reuse == "1")
    tier = DiskBackend(settings, BackendContext("faults", ns, chunk, 256 << 20))
    log = open(log_path, "w", buffering=1)
    jobs, done = {}, 0
    while True:                      # runs until it is killed
        while len(jobs) < 4:         # four jobs of eight chunks in flight
            keys = [make_key(next_key + n, ns) for n in range(8)]
            next_key += 8
            jobs[next_key] = keys
            tier.submit_put(next_key, keys, [memoryview(make_payload(k, chunk)) for k in keys])
        results = tier.poll()
        if not results:
            time.sleep(0.001)
        for result in results:
            jobs.pop(result.job_id)
            log.write("".join("ok " + key.hex() + "\\n" for key in result.ok_keys))
            log.write("".join("failed " + key.hex() + "\\n" for key in result.failed_keys))
            old = [make_key(result.job_id - 8 * 20 - 8 + n, ns) for n in range(8)]
            log.write("".join("deleting " + key.hex() + "\\n" for key in old))
            tier.delete(old)         # evict the chunks of the job twenty jobs back
            log.write("".join("deleted " + key.hex() + "\\n" for key in old))
            done += 1
            if done == 12:
                log.write("ready\\n")
    """
)


def run_writer_and_kill(
    root: pathlib.Path, fsync: str, reuse: bool, log: pathlib.Path, first: int
) -> int:
    """Start the writer and SIGKILL it as soon as a write is seen in progress (a .tmp file
    exists; within two seconds of it being ready); the number of .tmp files it left."""
    argv = [str(root), fsync, "1" if reuse else "0", str(log), str(first)]
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and "ready\n" in log.read_text()):
            if proc.poll() is not None:
                stderr = proc.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
                pytest.fail(f"writer exited early: {stderr}")
            if time.monotonic() > deadline:
                pytest.fail("writer never became ready")
            time.sleep(0.02)
        give_up = time.monotonic() + 2
        while not any_tmp_file(root) and time.monotonic() < give_up:
            pass
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return len(files_under(root, ".tmp"))


def any_tmp_file(root: pathlib.Path) -> bool:
    for fan in root.glob("*/rank0/[0-9a-f][0-9a-f]"):
        with os.scandir(fan) as entries:
            if any(e.name.endswith(".tmp") for e in entries):
                return True
    return False


def logged(log: pathlib.Path) -> dict[str, set[bytes]]:
    """Keys the writer reported, by what it reported: ok, deleting, deleted (whole lines only)."""
    found: dict[str, set[bytes]] = {
        "ok": set(),
        "failed": set(),
        "deleting": set(),
        "deleted": set(),
    }
    for line in log.read_text().splitlines(keepends=True):
        if line.endswith("\n") and " " in line:
            what, hexkey = line.split()
            found[what].add(bytes.fromhex(hexkey))
    return found


@pytest.mark.parametrize(("fsync", "reuse"), [("none", False), ("batch", False), ("none", True)])
def test_sigkill_mid_write_then_restart(tmp_path: pathlib.Path, fsync: str, reuse: bool) -> None:
    root = tmp_path / "disk"
    tmp_seen = 0
    stored: set[bytes] = set()  # reported stored
    maybe_gone: set[bytes] = set()  # a delete was started (it may or may not have run)
    deleted: set[bytes] = set()  # a delete returned
    round_ = 0
    while round_ < 3 or (not reuse and not tmp_seen and round_ < 8):  # kills are racy: retry
        log = tmp_path / f"writer-{round_}.log"
        tmp_seen += run_writer_and_kill(root, fsync, reuse, log, round_ * 1_000_000)
        reported = logged(log)
        assert len(reported["ok"]) >= 12 * 8 and not reported["failed"]
        stored |= reported["ok"]
        maybe_gone |= reported["deleting"]
        deleted |= reported["deleted"]

        tier = open_tier(root)  # the restart
        try:
            recovered = list(tier.recover())
            stats = tier.stats()
            assert not files_under(root, ".tmp"), "half-written files survived the restart"
            assert set(recovered) == keys_on_disk(root), "index differs from the files on disk"
            assert len(recovered) == len(set(recovered))
            lost = stored - maybe_gone - set(recovered)
            assert not lost, f"round {round_}: {len(lost)} reported stores were lost"
            assert not set(recovered) & deleted, "a deleted chunk came back"
            owned = files_under(root, ".chunk") + files_under(root, ".free")
            assert stats["bytes_used"] == (len(recovered) + stats["free_files"]) * tier.frame_bytes
            assert stats["bytes_used"] == sum(p.stat().st_size for p in owned)
            driver = Driver(tier)
            for start in range(0, len(recovered), 64):
                keys = recovered[start : start + 64]
                result, data = driver.get(keys)
                assert result.ok, f"{len(result.failed_keys)} recovered chunks failed to load"
                for key, got in zip(keys, data):
                    assert got == make_payload(key, CHUNK), "a recovered chunk has wrong bytes"
            assert tier.stats()["checksum_failures"] == 0
        finally:
            tier.close()
        round_ += 1
    if not reuse:  # every write goes to a new .tmp file: some must have been cut short
        assert tmp_seen > 0, f"no kill landed mid-write (no .tmp file left in {round_} rounds)"


# ----------------------------------------------------------------------- damaged files
def damage(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_corrupted_chunk_is_detected_counted_removed_and_recomputed(
    tmp_path: pathlib.Path, direct_io: str
) -> None:
    tier = open_tier(tmp_path, direct_io=direct_io)
    driver = Driver(tier)
    keys = [make_key(i, NS) for i in range(4)]
    assert driver.put(keys).ok
    payload_bad, header_bad, key_bad = keys[:3]
    damage(tier.path_of(payload_bad), ALIGN + CHUNK - 2, b"\x00\xff")  # last payload bytes
    damage(tier.path_of(header_bad), 16, b"otherns!")  # namespace field of the header
    other = tier.path_of(keys[3])
    os.replace(other, tier.path_of(key_bad))  # a whole frame, but of another key
    result, data = driver.get(keys)  # keys[3]'s file is gone (moved away above)
    assert result.ok_keys == () and result.failed_keys == tuple(keys)
    assert data == [bytes(CHUNK)] * 4  # nothing of the damaged frames reached the buffers
    stats = tier.stats()
    assert (stats["checksum_failures"], stats["malformed_frames"], stats["misses"]) == (1, 2, 1)
    tier.poll()  # failed chunks are dropped on the owner's next poll
    assert tier.contains(keys) == [False, False, False, False]
    assert not any(os.path.exists(tier.path_of(k)) for k in keys)
    assert tier.stats()["bytes_used"] == 0 and tier.stats()["quarantined"] == 4
    assert driver.put(keys).ok  # the recomputed chunks are stored again
    result, data = driver.get(keys)
    assert result.ok and data == [make_payload(k, CHUNK) for k in keys]
    tier.close()


def test_truncated_chunk_is_refused_on_load_and_dropped_on_restart(tmp_path: pathlib.Path) -> None:
    tier = open_tier(tmp_path)
    driver = Driver(tier)
    keys = [make_key(i, NS) for i in range(3)]
    assert driver.put(keys).ok
    os.truncate(tier.path_of(keys[0]), ALIGN + CHUNK // 2)
    result, data = driver.get(keys[:2])
    assert result.failed_keys == (keys[0],) and result.ok_keys == (keys[1],)
    assert data[0] == bytes(CHUNK) and data[1] == make_payload(keys[1], CHUNK)
    assert tier.stats()["malformed_frames"] == 1
    os.truncate(tier.path_of(keys[1]), 100)  # truncated behind a live tier, found on restart
    tier.close()
    tier = open_tier(tmp_path)
    assert set(tier.recover()) == {keys[2]}  # sizes only: no chunk body was read
    assert tier.stats()["dropped_on_recover"] == 1
    assert not os.path.exists(tier.path_of(keys[1]))
    tier.close()


def test_restart_lists_damaged_bodies_without_reading_them(tmp_path: pathlib.Path) -> None:
    tier = open_tier(tmp_path)
    driver = Driver(tier)
    keys = [make_key(i, NS) for i in range(5)]
    assert driver.put(keys).ok
    tier.close()
    for key in keys:  # damage every payload: recovery cannot tell, loads must
        damage(tier.path_of(key), ALIGN + 7, b"\x13\x37")
    tier = open_tier(tmp_path)
    assert set(tier.recover()) == set(keys)
    result, _ = Driver(tier).get(keys)
    assert result.failed_keys == tuple(keys) and tier.stats()["checksum_failures"] == 5
    tier.close()


def test_restart_over_a_smaller_budget_keeps_the_newest(tmp_path: pathlib.Path) -> None:
    tier = open_tier(tmp_path)
    driver = Driver(tier)
    keys = [make_key(i, NS) for i in range(6)]
    for n, key in enumerate(keys):
        assert driver.put([key]).ok
        os.utime(tier.path_of(key), (1_000_000 + n, 1_000_000 + n))  # a clear age order
    frame = tier.frame_bytes
    tier.close()
    tier = open_tier(tmp_path, capacity=4 * frame)
    assert list(tier.recover()) == keys[2:]  # oldest first, the two oldest gone
    assert (
        tier.stats()["bytes_used"]
        == 4 * frame
        == sum(p.stat().st_size for p in files_under(tmp_path, ".chunk"))
    )
    tier.close()


# ----------------------------------------------------------------------- unwritable roots
def test_root_under_a_file_is_a_startup_error(tmp_path: pathlib.Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="cannot create .*not-a-dir"):
        open_tier(blocker / "cache")


def test_read_only_filesystem_is_a_startup_error(tmp_path: pathlib.Path) -> None:
    with (
        mounted("tmpfs", tmp_path / "ro", "ro,size=1m") as root,
        pytest.raises(ConfigError, match=f"cannot create {root}.*[Rr]ead-only"),
    ):
        open_tier(root / "cache")


def test_read_only_existing_tree_is_a_startup_error(tmp_path: pathlib.Path) -> None:
    with mounted("tmpfs", tmp_path / "rw", "size=1m") as root:
        open_tier(root).close()  # the tree exists
        subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
        with pytest.raises(ConfigError, match=f"cannot write in {root}.*[Rr]ead-only"):
            open_tier(root)


def test_direct_io_on_where_refused_is_a_startup_error(tmp_path: pathlib.Path) -> None:
    with mounted("ramfs", tmp_path / "ramfs") as root:
        with pytest.raises(ConfigError, match="refuses O_DIRECT"):
            open_tier(root, direct_io="on")
        tier = open_tier(root, direct_io="auto")
        assert tier.io_mode == "buffered"
        tier.close()


# ----------------------------------------------------------------------- full filesystem
@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_full_filesystem_drops_stores_and_keeps_serving(
    tmp_path: pathlib.Path, direct_io: str
) -> None:
    with mounted("tmpfs", tmp_path / "small", "size=4m") as root:
        tier = open_tier(root, capacity=1 << 30, direct_io=direct_io, fsync="batch")
        driver = Driver(tier)
        keys = [make_key(i, NS) for i in range(80)]  # 80 x 68 KiB: twice the filesystem
        results = [driver.put(keys[i : i + 8]) for i in range(0, len(keys), 8)]
        stored = [k for r in results for k in r.ok_keys]
        dropped = [k for r in results for k in r.failed_keys]
        stats = tier.stats()
        assert stored and dropped, "the filesystem never filled up"
        assert stats["enospc"] >= len(dropped) > 0 and stats["put_failures"] == len(dropped)
        assert not files_under(root, ".tmp"), "a failed store left its temporary file"
        assert keys_on_disk(root) == set(stored)
        assert stats["bytes_used"] == len(stored) * tier.frame_bytes
        result, data = driver.get(stored)  # the engine keeps serving what is there
        assert result.ok and data == [make_payload(k, CHUNK) for k in stored]
        tier.delete(stored[:10])
        again = driver.put(dropped[:5])
        assert again.ok, "space freed by deletes was not used again"
        tier.close()


def test_full_filesystem_at_startup_still_starts(tmp_path: pathlib.Path) -> None:
    with mounted("tmpfs", tmp_path / "full", "size=1m") as root:
        open_tier(root).close()  # the tree exists
        with open(root / "filler", "wb") as f:  # then something else fills the disk
            try:
                while True:
                    f.write(b"\x00" * 65536)
            except OSError:
                pass
        tier = open_tier(root)
        result = Driver(tier).put([make_key(0, NS)])
        assert result.failed_keys == (make_key(0, NS),) and tier.stats()["enospc"] == 1
        tier.close()
