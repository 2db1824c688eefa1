"""LMDB tier throughput (backends/lmdb/backend.py) next to raw lmdb put/get of the same values.

What is measured, per chunk size: moving ``--total`` bytes of chunks into the
tier (puts) and back out into caller buffers (gets), in jobs of ``--batch``
chunks.

* ``tier``: :class:`tiercache.backends.lmdb.backend.LMDBBackend` through its public
  API: ``submit_put``/``submit_get`` of every job at once, then ``poll`` every
  ``--poll-ms`` until all have reported. That includes the framing, the
  xxh3_64 checksum of every put and its verification on every get, the budget
  check, the I/O threads and the hand-over of results. Once per
  ``--io-threads`` value (default 1 and 2: with 2, two gets run at once).
* ``raw``: the lmdb package alone, on one thread of its own (as the tier's I/O
  runs on its own thread), on an environment opened with the very same
  options (``environment_options``: map size, sync flags, readers) and a named
  database: one write transaction per batch of ``txn.put(key, value)``; one
  read transaction (``buffers=True``) per batch copying each value into the
  same caller buffers with the tier's copy (``numpy.copyto``). The ceiling of
  a tier on LMDB, with one thread.

The values are the same random bytes in both; every cell is verified byte
exact (untimed). Each repetition deletes its chunks afterwards (untimed), so
the next one writes into recycled pages, as a tier in steady state does. The
runners take turns in an order that rotates every repetition, so that load
from other processes hits all alike; the table shows medians and the ratio
tier / raw: the median over repetitions of the ratio of the two measurements
of one repetition (target: >= 80%). glibc's malloc thresholds are fixed for
the run (:func:`steady_malloc`; ``--glibc-malloc-defaults`` to keep them).

Run: ``python -m bench.lmdb_tier`` (``--help`` for options). Results go to
``bench/results/lmdb_tier.json``. The environments live in a temporary
directory (``--dir`` to pick the disk), removed afterwards.
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
from tqdm import tqdm

from bench.common import describe_machine, machine_info, print_table, write_result
from tiercache.backend import BackendContext
from tiercache.backends.lmdb.backend import (
    LMDBBackend,
    LMDBSettings,
    database_name,
    environment_options,
)

DEFAULT_SIZES = "256K,1M,4M"
NAMESPACE = bytes.fromhex("00112233445566ff")
GB = 1e9
_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters
_M_MMAP_THRESHOLD = -3


# ------------------------------------------------------------------------------ options
def parse_bytes(text: str) -> int:
    """``"256K"`` -> 262144; K, M and G are powers of 1024."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.lmdb_tier",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--sizes", default=DEFAULT_SIZES, help="chunk sizes (default %(default)s)")
    add("--total", default="256M", help="bytes moved per measurement (default %(default)s)")
    add("--batch", type=int, default=16, help="chunks per job / transaction (default 16)")
    add("--repeat", type=int, default=5, help="measurements per cell; medians shown (default 5)")
    add("--io-threads", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2],
        help="tier io_threads settings to measure, each against the same raw runs (default 1,2)")
    add("--poll-ms", type=float, default=1.0,
        help="how often the submitting thread polls for results, as an engine step would "
             "(default %(default)s)")
    add("--glibc-malloc-defaults", action="store_true",
        help="keep glibc's dynamic mmap/trim thresholds (see steady_malloc) instead of fixing them")
    add("--sync", action="store_true", help="fsync every commit (the tier's sync setting)")
    add("--dir", default=None, help="where the environments go (default: a temporary directory)")
    add("--out", default="lmdb_tier", help="result name under bench/results/ (default %(default)s)")
    add("--seed", type=int, default=0)
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------ workload
@dataclass
class Workload:
    """The chunks of one size: keys, source bytes, destination buffers, batches."""

    chunk_bytes: int
    keys: list[bytes]
    src: list[memoryview]
    dst_buf: np.ndarray
    dst: list[memoryview]
    batch: int

    @classmethod
    def make(cls, chunk_bytes: int, total: int, batch: int, rng: np.random.Generator) -> Workload:
        count = max(batch, total // chunk_bytes // batch * batch)
        src_buf = np.frombuffer(rng.bytes(count * chunk_bytes), dtype=np.uint8)
        dst_buf = np.zeros(count * chunk_bytes, dtype=np.uint8)
        keys = [NAMESPACE + i.to_bytes(32, "big") + bytes(4) for i in range(count)]
        return cls(chunk_bytes, keys, _slices(src_buf, chunk_bytes), dst_buf,
                   _slices(dst_buf, chunk_bytes), batch)

    @property
    def total_bytes(self) -> int:
        return len(self.keys) * self.chunk_bytes

    def batches(self) -> list[tuple[list[bytes], list[memoryview], list[memoryview]]]:
        b = self.batch
        return [(self.keys[i:i + b], self.src[i:i + b], self.dst[i:i + b])
                for i in range(0, len(self.keys), b)]

    def verify(self, what: str) -> None:
        """Every destination chunk equals its source (then clears the destination)."""
        for i, (s, d) in enumerate(zip(self.src, self.dst)):
            if s != d:
                raise SystemExit(f"{what}: chunk {i} of {self.chunk_bytes} bytes came back wrong")
        self.dst_buf.fill(0)


def _slices(buf: np.ndarray, size: int) -> list[memoryview]:
    view = memoryview(buf)
    return [view[i:i + size] for i in range(0, len(buf), size)]


# ------------------------------------------------------------------------------ malloc
def steady_malloc() -> None:
    """Fix glibc's mmap threshold (32 MiB) and trim threshold (1 GiB) for this process.

    LMDB (without writemap) mallocs the pages of every value a write transaction
    puts and frees them at commit. glibc moves its mmap threshold as it frees
    large blocks, so whether a 1-4 MiB value's pages come from a warm heap or
    from a fresh mmap (a page fault per 4 KiB) depends on the allocation history
    of the thread's arena: raw puts of 1 MiB values were measured at 1.3 GB/s or
    at 3.1 GB/s in the same process. Fixed thresholds give tier and raw the same
    warm heap, so their ratio measures the tier, not the allocator.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)


def copy_into(dst: memoryview, src: memoryview) -> None:
    """The copy the tier uses too: numpy, which releases the GIL."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


class RawRunner:
    """Plain lmdb: one transaction per batch, values copied out of the map into the buffers.

    The work runs on one thread of its own, as the tier's does: LMDB mallocs the
    pages of every value it writes, and glibc serves a thread other than the main
    one from another arena, whose reuse of large blocks differs (on the main
    thread puts of 1-4 MiB values were measured up to 2x slower).
    """

    def __init__(self, path: Path, settings: LMDBSettings, map_size: int) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raw-lmdb")
        self.env = lmdb.open(str(path), **environment_options(settings, map_size))
        self.db = self.env.open_db(database_name(NAMESPACE, rank=0))

    def put(self, work: Workload) -> None:
        self._thread.submit(self._put, work).result()

    def get(self, work: Workload) -> None:
        self._thread.submit(self._get, work).result()

    def clear(self, work: Workload) -> None:
        self._thread.submit(self._clear, work).result()

    def close(self) -> None:
        self._thread.shutdown()
        self.env.close()

    def _put(self, work: Workload) -> None:
        for keys, src, _ in work.batches():
            with self.env.begin(db=self.db, write=True) as txn:
                for key, value in zip(keys, src):
                    txn.put(key, value)

    def _get(self, work: Workload) -> None:
        for keys, _, dst in work.batches():
            with self.env.begin(db=self.db, buffers=True) as txn:
                for key, out in zip(keys, dst):
                    copy_into(out, txn.get(key))

    def _clear(self, work: Workload) -> None:
        with self.env.begin(db=self.db, write=True) as txn:
            for key in work.keys:
                txn.delete(key)


class TierRunner:
    """The LMDB tier through submit/poll, every job in flight at once (as the engine pipelines)."""

    def __init__(self, settings: LMDBSettings, context: BackendContext, poll_secs: float) -> None:
        self.backend = LMDBBackend(settings, context)
        self._poll_secs = poll_secs
        self._next_job = 0
        self._probe = (NAMESPACE + b"probe", memoryview(bytes(context.chunk_bytes)))

    def put(self, work: Workload) -> None:
        self._run([(self.backend.submit_put, keys, src) for keys, src, _ in work.batches()])

    def get(self, work: Workload) -> None:
        self._run([(self.backend.submit_get, keys, dst) for keys, _, dst in work.batches()])

    def clear(self, work: Workload) -> None:
        """Delete the chunks and wait until that is committed (a put queued behind it returns)."""
        self.backend.delete(work.keys)
        key, view = self._probe
        self._run([(self.backend.submit_put, [key], [view])])

    def close(self) -> None:
        self.backend.close()

    def _run(self, jobs: list[tuple[Callable[..., None], list[bytes], list[memoryview]]]) -> None:
        pending: set[int] = set()
        for submit, keys, views in jobs:
            self._next_job += 1
            pending.add(self._next_job)
            submit(self._next_job, keys, views)
        while pending:
            for result in self.backend.poll():
                if not result.ok:
                    failed = len(result.failed_keys)
                    raise SystemExit(f"tier job {result.job_id} failed {failed} keys")
                pending.discard(result.job_id)
            if pending:
                time.sleep(self._poll_secs)


# ------------------------------------------------------------------------------ measuring
def timed(fn: Callable[[Workload], None], work: Workload) -> float:
    start = time.perf_counter()
    fn(work)
    return work.total_bytes / (time.perf_counter() - start) / GB


def measure_size(
    chunk_bytes: int, args: argparse.Namespace, root: Path, rng: np.random.Generator, bar: tqdm
) -> list[dict[str, Any]]:
    """One result per ``--io-threads`` value: medians (GB/s) of tier and raw, and the ratios."""
    work = Workload.make(chunk_bytes, parse_bytes(args.total), args.batch, rng)
    context = BackendContext(
        tier_name="bench", namespace=NAMESPACE, chunk_bytes=chunk_bytes,
        capacity_bytes=(len(work.keys) + 2) * (chunk_bytes + 4096),
    )
    runners: dict[str, TierRunner | RawRunner] = {}
    try:
        for threads in args.io_threads:
            settings = LMDBSettings(
                path=root / f"tier{threads}", io_threads=threads, sync=args.sync
            )
            runners[f"tier{threads}"] = TierRunner(settings, context, args.poll_ms / 1000)
        map_size = runners[f"tier{args.io_threads[0]}"].backend.map_size  # type: ignore[union-attr]
        runners["raw"] = RawRunner(root / "raw", LMDBSettings(path=root / "raw", sync=args.sync),
                                   map_size)
        samples = _interleaved(work, runners, args.repeat, bar)
        stats = {n: r.backend.stats() for n, r in runners.items() if isinstance(r, TierRunner)}
    finally:
        for runner in runners.values():
            runner.close()
    return [_summary(work, t, samples, stats[f"tier{t}"]) for t in args.io_threads]


def _interleaved(
    work: Workload, runners: dict[str, TierRunner | RawRunner], repeat: int, bar: tqdm
) -> dict[str, list[float]]:
    """``<runner>_put`` / ``<runner>_get`` GB/s samples; runner order rotates every repetition."""
    names = list(runners)
    samples: dict[str, list[float]] = {f"{n}_{op}": [] for n in names for op in ("put", "get")}
    for rep in range(-1, repeat):  # rep -1 warms every environment up, unrecorded
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            runner = runners[name]
            put, get = timed(runner.put, work), timed(runner.get, work)
            work.verify(f"{name} {work.chunk_bytes}")
            runner.clear(work)
            if rep >= 0:
                samples[f"{name}_put"].append(put)
                samples[f"{name}_get"].append(get)
            bar.update(1)
    return samples


def _summary(
    work: Workload, threads: int, samples: dict[str, list[float]], stats: dict[str, int]
) -> dict[str, Any]:
    tier = f"tier{threads}"
    picked = {f"{who}_{op}": samples[f"{name}_{op}"]
              for who, name in (("tier", tier), ("raw", "raw")) for op in ("put", "get")}
    return {
        "chunk_bytes": work.chunk_bytes,
        "chunks": len(work.keys),
        "batch": work.batch,
        "io_threads": threads,
        "median_gbps": {name: statistics.median(values) for name, values in picked.items()},
        "put_ratio": _median_ratio(picked["tier_put"], picked["raw_put"]),
        "get_ratio": _median_ratio(picked["tier_get"], picked["raw_get"]),
        "samples_gbps": picked,
        "tier_stats": stats,
    }


def _median_ratio(tier: list[float], raw: list[float]) -> float:
    """Median of the per-repetition ratios (each pair measured in the same repetition, so
    drifting load from other processes cancels better than in a ratio of medians)."""
    return statistics.median(t / r for t, r in zip(tier, raw))


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.glibc_malloc_defaults:
        steady_malloc()
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    rng = np.random.default_rng(args.seed)
    root = Path(tempfile.mkdtemp(prefix="tiercache-lmdb-bench-", dir=args.dir))
    results: list[dict[str, Any]] = []
    cells = len(sizes) * (args.repeat + 1) * (len(args.io_threads) + 1)
    try:
        with tqdm(total=cells, desc="lmdb tier", unit="cell") as bar:
            for size in sizes:
                results += measure_size(size, args, root, rng, bar)
                shutil.rmtree(root, ignore_errors=True)
                root.mkdir()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    machine = machine_info(["lmdb", "xxhash", "numpy"])
    print_table(
        ["chunk", "io_threads", "tier put GB/s", "raw put GB/s", "put %",
         "tier get GB/s", "raw get GB/s", "get %"],
        [_row(r) for r in results],
        title=(f"LMDB tier vs raw lmdb, {args.total} per cell, {args.batch} chunks per txn, "
               f"median of {args.repeat}; {describe_machine(machine)}"),
    )
    path = write_result(args.out, results, options=vars(args), machine=machine)
    print(f"wrote {path}")


def _row(r: dict[str, Any]) -> tuple[str, ...]:
    med = r["median_gbps"]
    return (
        f"{r['chunk_bytes'] >> 10} KiB", str(r["io_threads"]),
        f"{med['tier_put']:.2f}", f"{med['raw_put']:.2f}", f"{100 * r['put_ratio']:.0f}%",
        f"{med['tier_get']:.2f}", f"{med['raw_get']:.2f}", f"{100 * r['get_ratio']:.0f}%",
    )


if __name__ == "__main__":
    main()
