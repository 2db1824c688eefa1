"""Disk tier throughput against a raw sequential-I/O ceiling, and warm-restart recovery time.

What is measured, for each chunk size, fsync policy and file reuse setting:

* ``store``: ``--total`` bytes of chunks written through
  :class:`tiercache.backends.disk.backend.DiskBackend` (``submit_put`` of jobs of
  ``--job-chunks`` chunks, all submitted at once, polled to completion): one
  framed, checksummed file per chunk, written under a temporary (or free-file)
  name and renamed;
* ``load``: the same chunks read back (``submit_get``), each verified;

from and into page-aligned host memory (as an engine's pinned slab is), with
the tier's default ``io_threads`` unless ``--threads`` says otherwise. Rates
count payload bytes only (a frame also carries a 4 KiB header block).

The ceiling, same bytes, same directory, same run, interleaved with the tier's
measurements so that load from other processes hits both alike: a raw
sequential write, then read, of one file of ``--total`` bytes in chunk-sized
requests, with O_DIRECT where the directory allows it (buffered otherwise),
done by ``fio`` (psync engine, queue depth 1) when it is installed, else by
this script's own loop of ``os.pwrite`` / ``os.preadv`` from one aligned
buffer. Like fio, the loop lays the file out first (untimed), so the timed
write overwrites allocated blocks: the faster of the two ways to write a file.
Before each repetition the previous one's writeback, journal commits and
discards are let finish (``sync``, untimed).

Two kinds of tier store are measured: ``reused`` (``reuse_files: true``, the
default, in its steady state: the chunks of the previous repetition were
deleted, as a full cache evicts, and the new ones overwrite their files) and
``new`` (``reuse_files: false``: every store creates a file). The table shows
medians of ``--repeat`` repetitions and the median of per-repetition ratios;
the target is 80% of the ceiling.

Recovery: ``--recovery-chunks`` chunks (4 KiB payloads) are stored, the tier
is closed, and opening it again plus ``recover()`` is timed (a scan of names
and sizes; no chunk body is read); a sample of the recovered chunks must load.
``--drop-caches`` drops the kernel's page, dentry and inode caches first
(root only; it slows other processes for a moment), for a cold-start figure.

Run: ``python -m bench disk_tier`` (``--help`` for options). Results go to
``bench/results/disk_tier.json``. Scratch files go under ``--dir`` (default: a
new directory in the system temp dir) and are removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from hashlib import sha256
from pathlib import Path

import numpy as np
from tqdm import tqdm

if __package__ in (None, ""):  # run as a script (python bench/<name>.py): import `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiercache.backends.disk.backend import DiskBackend, DiskSettings

from bench import common
from tiercache.backend import BackendContext, JobResult
from tiercache.integrity import ALIGN, aligned_frame_bytes

GB = 1e9
TARGET = 0.80
NAMESPACE = b"benchdsk"


# ------------------------------------------------------------------------------ options
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = common.BenchParser(
        "disk_tier", __doc__,
        ceiling="a raw sequential write, then read, of one file of --total bytes in chunk-sized "
        "requests in the same directory (fio, psync, queue depth 1, or --no-fio's own "
        "pwrite/preadv loop), O_DIRECT where the directory allows it; target: tier >= 80% of it",
        examples=("--dir /mnt/nvme --sizes 1MiB --fsync batch --reuse on --recovery-chunks 0",),
        out="disk_tier", sizes=True,
        quick={"sizes": "256KiB", "total": "8MiB", "repeat": 1, "fsync": "none", "reuse": "on",
               "recovery_chunks": 1000},
    )
    add = parser.add_argument
    add("--dir", default=None, help="scratch directory (default: a new one in the temp dir)")
    parser.add_sizes("256KiB,1MiB,4MiB", "chunk sizes")
    parser.add_size("--total", "128MiB", "bytes per measurement")
    parser.add_repeat(3, "repetitions per cell; medians shown")
    add("--fsync", default="none,batch", help="fsync policies to measure (default %(default)s)")
    add(
        "--reuse",
        default="on,off",
        help="tier reuse_files settings to measure: on = stores overwrite the files of deleted "
        "chunks (a full cache), off = every store creates a file (default %(default)s)",
    )
    add("--threads", type=int, default=None, help="io_threads of the tier (default: its default)")
    add("--direct-io", choices=("auto", "on", "off"), default="auto", help="tier direct_io")
    add("--job-chunks", type=int, default=16, help="chunks per job (default %(default)s)")
    add("--recovery-chunks", type=int, default=100_000, help="0 skips (default %(default)s)")
    add("--drop-caches", action="store_true", help="cold-cache recovery (root; global effect)")
    add("--no-fio", action="store_true", help="use the own raw loop even if fio is installed")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------ memory
def aligned_buffer(size: int) -> tuple[mmap.mmap, np.ndarray]:
    """Page-aligned anonymous memory (an mmap) and a uint8 array over it."""
    mem = mmap.mmap(-1, size)
    return mem, np.frombuffer(mem, np.uint8)


def chunk_key(i: int) -> bytes:
    return NAMESPACE + sha256(b"bench-%d" % i).digest() + b"\0\0\0\0"


# ------------------------------------------------------------------------------ the ceiling
class RawDisk:
    """Sequential write/read of one file in chunk-sized requests: the ceiling."""

    def __init__(self, directory: Path, direct: bool, use_fio: bool) -> None:
        self.path = directory / "raw.bin"
        self.direct = direct
        self.fio = shutil.which("fio") if use_fio else None

    @property
    def label(self) -> str:
        how = "fio (psync, iodepth 1)" if self.fio else "own raw loop (pwrite/preadv)"
        return f"{how}, {'O_DIRECT' if self.direct else 'buffered'}"

    def lay_out(self, src: mmap.mmap, size: int, total: int) -> None:
        """Write the file once, untimed: timed writes then overwrite allocated blocks (as fio)."""
        self.clean()
        self._write_loop(src, size, total, os.O_CREAT)

    def write(self, src: mmap.mmap, size: int, total: int) -> float:
        if self.fio:
            return self._fio("write", size, total)
        start = time.perf_counter()
        self._write_loop(src, size, total, 0)
        return time.perf_counter() - start

    def _write_loop(self, src: mmap.mmap, size: int, total: int, create: int) -> None:
        flags = os.O_WRONLY | create | (os.O_DIRECT if self.direct else 0)
        view = memoryview(src)
        fd = os.open(self.path, flags, 0o644)
        try:
            for offset in range(0, total, size):
                slot = offset % len(view)
                os.pwrite(fd, view[slot : slot + size], offset)
            if not self.direct:
                os.fsync(fd)  # buffered: count the bytes reaching the device
        finally:
            os.close(fd)

    def read(self, dst: mmap.mmap, size: int, total: int) -> float:
        if self.fio:
            return self._fio("read", size, total)
        flags = os.O_RDONLY | (os.O_DIRECT if self.direct else 0)
        view = memoryview(dst)
        start = time.perf_counter()
        fd = os.open(self.path, flags)
        try:
            for offset in range(0, total, size):
                slot = offset % len(view)
                os.preadv(fd, [view[slot : slot + size]], offset)
        finally:
            os.close(fd)
        return time.perf_counter() - start

    def _fio(self, rw: str, size: int, total: int) -> float:
        cmd = [
            self.fio,
            "--name=raw",
            f"--filename={self.path}",
            f"--rw={rw}",
            f"--bs={size}",
            f"--size={total}",
            f"--direct={int(self.direct)}",
            "--ioengine=psync",
            "--output-format=json",
            *(["--end_fsync=1"] if rw == "write" and not self.direct else []),
        ]
        out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        job = out["jobs"][0][rw]
        return total / job["bw_bytes"]

    def clean(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


# ------------------------------------------------------------------------------ the tier
class TierRun:
    """One disk tier and the jobs that store/load ``count`` chunks of ``size`` bytes."""

    def __init__(
        self,
        root: Path,
        size: int,
        count: int,
        fsync: str,
        reuse: bool,
        args: argparse.Namespace,
        src: mmap.mmap,
        dst: mmap.mmap,
    ) -> None:
        options: dict[str, object] = {
            "root": root,
            "fsync": fsync,
            "direct_io": args.direct_io,
            "reuse_files": reuse,
        }
        if args.threads:
            options["io_threads"] = args.threads
        context = BackendContext("bench", NAMESPACE, size, count * aligned_frame_bytes(size))
        self.tier = DiskBackend(DiskSettings(**options), context)  # type: ignore[arg-type]
        self.size = size
        self.keys = [chunk_key(i) for i in range(count)]
        slots = len(src) // size
        self.src = [
            memoryview(src)[(i % slots) * size : (i % slots + 1) * size] for i in range(count)
        ]
        self.dst = [
            memoryview(dst)[(i % slots) * size : (i % slots + 1) * size] for i in range(count)
        ]
        self.job_chunks = args.job_chunks
        self.next_job = 0

    def clear(self) -> None:
        """Delete every chunk (a full cache evicting): the next store writes them anew."""
        self.tier.delete(self.keys)

    def store(self) -> float:
        return self._run(self.tier.submit_put, self.src)

    def load(self) -> float:
        return self._run(self.tier.submit_get, self.dst)

    def _run(self, submit, views: list[memoryview]) -> float:  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        jobs = set()
        for first in range(0, len(self.keys), self.job_chunks):
            self.next_job += 1
            jobs.add(self.next_job)
            last = first + self.job_chunks
            submit(self.next_job, self.keys[first:last], views[first:last])
        results = wait_all(self.tier, jobs)
        secs = time.perf_counter() - start
        failed = sum(len(r.failed_keys) for r in results)
        if failed:
            raise RuntimeError(f"{failed} chunks failed: {self.tier.stats()}")
        return secs

    def verify(self, src: np.ndarray, dst: np.ndarray) -> None:
        dst[:] = 0
        self.load()
        if not np.array_equal(src[: len(dst)], dst):
            raise AssertionError("loaded bytes differ from the stored ones")


def settle() -> None:
    """Let the previous step's writeback, journal commits and discards finish (untimed)."""
    os.sync()


def wait_all(tier: DiskBackend, jobs: set[int], timeout: float = 600.0) -> list[JobResult]:
    results: list[JobResult] = []
    deadline = time.monotonic() + timeout
    while len(results) < len(jobs):
        got = tier.poll()
        results.extend(got)
        if not got:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(jobs) - len(results)} jobs not done in {timeout}s")
            time.sleep(0.001)  # the engine polls once per step; this only keeps a core free
    return results


# ------------------------------------------------------------------------------ cells
@dataclass
class Cell:
    chunk_bytes: int
    fsync: str
    files: str  # "reused": stores overwrite deleted chunks' files; "new": every store creates one
    io_mode: str
    chunks: int
    store_gbs: float
    load_gbs: float
    raw_write_gbs: float
    raw_read_gbs: float
    store_vs_raw: float
    load_vs_raw: float


def measure(
    args: argparse.Namespace,
    scratch: Path,
    raw: RawDisk,
    size: int,
    fsync: str,
    reuse: bool,
    bufs: tuple,
    bar: tqdm,
) -> Cell:
    src_map, src_np, dst_map, dst_np = bufs
    total = args.total // size * size
    count = total // size
    root = scratch / f"tier-{size}-{fsync}-{reuse}"
    run = TierRun(root, size, count, fsync, reuse, args, src_map, dst_map)
    try:
        run.store()  # warm-up, and a correctness check of what the timed runs move
        run.verify(src_np, dst_np)
        rates: dict[str, list[float]] = {"store": [], "load": [], "write": [], "read": []}
        raw.lay_out(src_map, size, total)
        for _ in range(args.repeat):
            run.clear()
            settle()
            rates["write"].append(total / raw.write(src_map, size, total) / GB)
            rates["store"].append(total / run.store() / GB)
            rates["read"].append(total / raw.read(dst_map, size, total) / GB)
            rates["load"].append(total / run.load() / GB)
            bar.update(1)
        raw.clean()
    finally:
        run.tier.close()
        shutil.rmtree(run.tier.directory.parent, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    return Cell(
        chunk_bytes=size,
        fsync=fsync,
        files="reused" if reuse else "new",
        io_mode=run.tier.io_mode,
        chunks=count,
        store_gbs=med["store"],
        load_gbs=med["load"],
        raw_write_gbs=med["write"],
        raw_read_gbs=med["read"],
        store_vs_raw=statistics.median(a / b for a, b in zip(rates["store"], rates["write"])),
        load_vs_raw=statistics.median(a / b for a, b in zip(rates["load"], rates["read"])),
    )


# ------------------------------------------------------------------------------ recovery
@dataclass
class Recovery:
    chunks: int
    chunk_bytes: int
    create_secs: float
    open_secs: list[float]
    recover_secs: list[float]
    median_secs: float
    chunks_per_sec: float
    cold_cache: bool
    sample_hits: int


def measure_recovery(args: argparse.Namespace, scratch: Path) -> Recovery:
    count, size = args.recovery_chunks, 4096
    root = scratch / "recovery"
    context = BackendContext("bench", NAMESPACE, size, count * aligned_frame_bytes(size))
    settings = DiskSettings(root=root, fsync="none", direct_io=args.direct_io)  # type: ignore[arg-type]
    # Filling is not what is measured: buffered writes and more threads make it quicker.
    filling = settings.model_copy(update={"io_threads": 8, "direct_io": "off"})
    tier = DiskBackend(filling, context)
    payload = memoryview(bytes(range(256)) * (size // 256))
    start = time.perf_counter()
    step, job = 512, 0
    with common.progress(args, count, f"store {count} chunks", "chunk", leave=False) as bar:
        for first in range(0, count, step * 8):  # eight jobs in flight at a time
            jobs = set()
            for lo in range(first, min(first + step * 8, count), step):
                job += 1
                keys = [chunk_key(i) for i in range(lo, min(lo + step, count))]
                tier.submit_put(job, keys, [payload] * len(keys))
                jobs.add(job)
            bar.update(sum(len(r.ok_keys) for r in wait_all(tier, jobs)))
    create_secs = time.perf_counter() - start
    tier.close()
    settle()
    opens, recovers = [], []
    for _ in range(3):
        if args.drop_caches:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        start = time.perf_counter()
        tier = DiskBackend(settings, context)
        opened = time.perf_counter()
        keys = list(tier.recover())
        opens.append(opened - start)
        recovers.append(time.perf_counter() - start)
        if len(keys) != count:
            raise AssertionError(f"recovered {len(keys)} of {count} chunks")
        hits = sample_hits(tier, keys[:: max(1, count // 100)], size)
        tier.close()
    shutil.rmtree(root, ignore_errors=True)
    median = statistics.median(recovers)
    return Recovery(
        count, size, create_secs, opens, recovers, median, count / median, args.drop_caches, hits
    )


def sample_hits(tier: DiskBackend, keys: list[bytes], size: int) -> int:
    buffers = [bytearray(size) for _ in keys]
    tier.submit_get(1, keys, [memoryview(b) for b in buffers])
    (result,) = wait_all(tier, {1})
    expected = bytes(range(256)) * (size // 256)
    return sum(1 for b in buffers if b == expected) if result.ok else 0


# ------------------------------------------------------------------------------ main
@contextlib.contextmanager
def scratch_dir(path: str | None) -> Iterator[Path]:
    if path:
        root = Path(path) / f"tiercache-disk-bench-{os.getpid()}"
        root.mkdir(parents=True)
    else:
        root = Path(tempfile.mkdtemp(prefix="tiercache-disk-bench-"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def probe_direct(directory: Path) -> bool:
    fd = -1
    try:
        fd = os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        os.pwrite(fd, mmap.mmap(-1, ALIGN), 0)
        return True
    except OSError:
        return False
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            (directory / "probe").unlink()


def print_cells(cells: list[Cell], title: str) -> None:
    headers = [
        "chunk",
        "fsync",
        "files",
        "io",
        "store GB/s",
        "raw write GB/s",
        "store/raw",
        "load GB/s",
        "raw read GB/s",
        "load/raw",
    ]
    rows = [
        [
            common.size_label(c.chunk_bytes),
            c.fsync,
            c.files,
            c.io_mode,
            f"{c.store_gbs:.2f}",
            f"{c.raw_write_gbs:.2f}",
            f"{c.store_vs_raw:.0%}",
            f"{c.load_gbs:.2f}",
            f"{c.raw_read_gbs:.2f}",
            f"{c.load_vs_raw:.0%}",
        ]
        for c in cells
    ]
    common.print_table(headers, rows, title)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    sizes = args.sizes
    policies = [p.strip() for p in args.fsync.split(",") if p.strip()]
    machine = common.machine_info(["numpy", "xxhash"])
    with scratch_dir(args.dir) as scratch:
        direct = args.direct_io != "off" and probe_direct(scratch)
        raw = RawDisk(scratch, direct, use_fio=not args.no_fio)
        slab = min(args.total, 256 << 20)
        src_map, src_np = aligned_buffer(slab)
        dst_map, dst_np = aligned_buffer(slab)
        src_np[:] = np.random.default_rng(0).integers(0, 256, slab, dtype=np.uint8)
        bufs = (src_map, src_np, dst_map, dst_np)
        cells = []
        reuses = [r.strip() == "on" for r in args.reuse.split(",") if r.strip()]
        steps = len(sizes) * len(policies) * len(reuses) * args.repeat
        with common.progress(args, steps, "disk tier", "rep") as bar:
            for size in sizes:
                for fsync in policies:
                    for reuse in reuses:
                        cells.append(measure(args, scratch, raw, size, fsync, reuse, bufs, bar))
        recovery = measure_recovery(args, scratch) if args.recovery_chunks else None
        df = subprocess.run(["df", "-T", str(scratch)], capture_output=True, text=True, check=False)
        filesystem = df.stdout.splitlines()[-1:]
    title = (
        f"disk tier vs raw sequential I/O on {scratch.parent} ({' '.join(filesystem)})\n"
        f"ceiling: {raw.label}; total {common.size_label(args.total)} per cell, "
        f"median of {args.repeat}; "
        f"target {TARGET:.0%}\n{common.describe_machine(machine)}"
    )
    print_cells(cells, title)
    if recovery:
        print(
            f"warm restart: {recovery.chunks} chunks recovered in {recovery.median_secs:.3f}s "
            f"({recovery.chunks_per_sec / 1e3:.0f}k chunks/s; open+recover, median of 3"
            f"{', cold caches' if recovery.cold_cache else ', warm dentry cache'}); "
            f"{recovery.sample_hits} sampled chunks hit again; "
            f"stored in {recovery.create_secs:.1f}s"
        )
    missed = [c for c in cells if min(c.store_vs_raw, c.load_vs_raw) < TARGET]
    if missed:
        print(
            f"below the {TARGET:.0%} target: "
            + ", ".join(f"{common.size_label(c.chunk_bytes)}/{c.fsync}/{c.files}" for c in missed)
        )
    results = {
        "cells": [asdict(c) for c in cells],
        "recovery": asdict(recovery) if recovery else None,
        "ceiling": raw.label,
        "target": TARGET,
    }
    common.save_results(args, results, machine)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
