"""What the key-value tier benchmarks share (bench/lmdb_tier.py, bench/redis_tier.py).

Both move ``--total`` bytes of chunks of one size into a tier and back out,
in jobs of ``--batch`` chunks, through the tier's public API (:class:`TierRunner`:
every job submitted at once, then polled every ``--poll-ms``) and through a
raw client of the same store (a subclass of :class:`OwnThreadRunner`), taking
turns in an order that rotates every repetition (:func:`measure_cell`); the
figures are medians (GB/s) and the medians of per-repetition tier / raw ratios
(:func:`summary`), printed by :func:`print_ratio_table`.

Buffers: a :class:`Workload` owns its source and destination arrays; runners
read the source views and write the destination views, one runner at a time.
A raw runner's put/get run on one thread of its own (as a tier's I/O does,
and so that glibc serves it from another arena than the main thread's); the
tier runners submit and poll from the calling thread.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.common import BenchParser, kib_label, print_table

GB = 1e9
_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters
_M_MMAP_THRESHOLD = -3


# ------------------------------------------------------------------------------ options
def tier_parser(
    name: str, doc: str | None, *, ceiling: str, example: str, total: str, repeat: int,
    batch_help: str,
) -> BenchParser:
    """The options both tier benchmarks take; each adds its own after these."""
    parser = BenchParser(
        name, doc, ceiling=ceiling, examples=(example,), out=name, sizes=True,
        quick={"sizes": "256KiB", "total": "8MiB", "repeat": 1, "io_threads": "1"},
    )
    add = parser.add_argument
    parser.add_sizes("256KiB,1MiB,4MiB", "chunk sizes")
    parser.add_size("--total", total, "bytes moved per measurement")
    add("--batch", type=int, default=16, help=f"{batch_help} (default 16)")
    parser.add_repeat(repeat)
    add("--io-threads", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2],
        help="tier io_threads settings to measure, each against the same raw runs (default 1,2)")
    add("--poll-ms", type=float, default=1.0,
        help="how often the submitting thread polls for results, as an engine step would "
             "(default %(default)s; each poll takes the GIL from the I/O threads, which costs "
             "most at small chunks on a loaded machine)")
    add("--glibc-malloc-defaults", action="store_true",
        help="keep glibc's dynamic mmap/trim thresholds (see steady_malloc) instead of fixing them")
    parser.add_seed()
    return parser


# ------------------------------------------------------------------------------ workload
@dataclass
class Workload:
    """The chunks of one size: keys, source bytes, destination buffers, batches."""

    chunk_bytes: int
    keys: list[bytes]
    src_buf: np.ndarray
    src: list[memoryview]
    dst_buf: np.ndarray
    dst: list[memoryview]
    batch: int

    @classmethod
    def make(
        cls, chunk_bytes: int, total: int, batch: int, rng: np.random.Generator, namespace: bytes
    ) -> Workload:
        count = max(batch, total // chunk_bytes // batch * batch)
        src_buf = np.frombuffer(rng.bytes(count * chunk_bytes), dtype=np.uint8)
        dst_buf = np.zeros(count * chunk_bytes, dtype=np.uint8)
        keys = [namespace + i.to_bytes(32, "big") + bytes(4) for i in range(count)]
        return cls(chunk_bytes, keys, src_buf, _slices(src_buf, chunk_bytes), dst_buf,
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
        if not np.array_equal(self.src_buf, self.dst_buf):
            bad = next(i for i, (s, d) in enumerate(zip(self.src, self.dst)) if s != d)
            raise SystemExit(f"{what}: chunk {bad} of {self.chunk_bytes} bytes came back wrong")
        self.dst_buf.fill(0)


def _slices(buf: np.ndarray, size: int) -> list[memoryview]:
    view = memoryview(buf)
    return [view[i:i + size] for i in range(0, len(buf), size)]


# ------------------------------------------------------------------------------ malloc
def steady_malloc() -> None:
    """Fix glibc's mmap threshold (32 MiB) and trim threshold (1 GiB) for this process.

    LMDB (without writemap) mallocs the pages of every value a write transaction
    puts and frees them at commit, and hiredis allocates a fresh bytes object for
    every reply. glibc moves its mmap threshold as it frees large blocks, so
    whether a 1-4 MiB block comes from a warm heap or from a fresh mmap (a page
    fault per 4 KiB) depends on the allocation history of the thread's arena:
    raw lmdb puts of 1 MiB values were measured at 1.3 GB/s or at 3.1 GB/s in the
    same process. Fixed thresholds give tier and raw the same warm heap, so their
    ratio measures the tier, not the allocator.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)


# ------------------------------------------------------------------------------ runners
class OwnThreadRunner:
    """A raw client's put/get of a workload, on one thread of its own (subclasses: _put, _get)."""

    def __init__(self, thread_name: str) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)

    def put(self, work: Workload) -> None:
        self._thread.submit(self._put, work).result()

    def get(self, work: Workload) -> None:
        self._thread.submit(self._get, work).result()

    def on_thread(self, fn: Callable[[Workload], None], work: Workload) -> None:
        self._thread.submit(fn, work).result()

    def close(self) -> None:
        self._thread.shutdown()

    def _put(self, work: Workload) -> None:
        raise NotImplementedError

    def _get(self, work: Workload) -> None:
        raise NotImplementedError


class TierRunner:
    """A tier through submit/poll, every job in flight at once (as the engine pipelines)."""

    def __init__(self, backend: Any, poll_secs: float) -> None:
        self.backend = backend
        self._poll_secs = poll_secs
        self._next_job = 0

    def put(self, work: Workload) -> None:
        self.run([(self.backend.submit_put, keys, src) for keys, src, _ in work.batches()])

    def get(self, work: Workload) -> None:
        self.run([(self.backend.submit_get, keys, dst) for keys, _, dst in work.batches()])

    def close(self) -> None:
        self.backend.close()

    def run(self, jobs: list[tuple[Callable[..., None], list[bytes], list[memoryview]]]) -> None:
        pending: set[int] = set()
        for submit, keys, views in jobs:
            self._next_job += 1
            pending.add(self._next_job)
            submit(self._next_job, keys, views)
        while pending:
            for result in self.backend.poll():
                if not result.ok:
                    failed = len(result.failed_keys)
                    raise SystemExit(f"tier job {result.job_id} failed {failed} keys "
                                     f"({self.backend.stats()})")
                pending.discard(result.job_id)
            if pending:
                time.sleep(self._poll_secs)


Runner = TierRunner | OwnThreadRunner


# ------------------------------------------------------------------------------ measuring
def timed(fn: Callable[[Workload], None], work: Workload) -> float:
    """GB/s of ``fn(work)``."""
    start = time.perf_counter()
    fn(work)
    return work.total_bytes / (time.perf_counter() - start) / GB


def measure_cell(
    work: Workload,
    io_threads: list[int],
    repeat: int,
    bar: tqdm,
    add_runners: Callable[[dict[str, Runner]], None],
    reset: Callable[[Runner], None],
) -> list[dict[str, Any]]:
    """One :func:`summary` per ``io_threads`` value, for the runners ``add_runners`` puts in.

    Tier runners are named ``tier<io_threads>``, raw ones ``raw`` or ``raw_<what>``.
    ``reset`` runs after each runner's put and get (untimed), so that the next put
    writes fresh keys. Every runner is closed at the end, also on failure.
    """
    runners: dict[str, Runner] = {}
    try:
        add_runners(runners)
        samples = _interleaved(work, runners, repeat, bar, reset)
        stats = {n: r.backend.stats() for n, r in runners.items() if isinstance(r, TierRunner)}
    finally:
        for runner in runners.values():
            runner.close()
    return [summary(work, t, samples, stats[f"tier{t}"]) for t in io_threads]


def _interleaved(
    work: Workload, runners: dict[str, Runner], repeat: int, bar: tqdm,
    reset: Callable[[Runner], None],
) -> dict[str, list[float]]:
    """``<runner>_put`` / ``<runner>_get`` GB/s samples; runner order rotates every repetition."""
    names = list(runners)
    samples: dict[str, list[float]] = {f"{n}_{op}": [] for n in names for op in ("put", "get")}
    for rep in range(-1, repeat):  # rep -1 warms every runner up, unrecorded
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            runner = runners[name]
            put, get = timed(runner.put, work), timed(runner.get, work)
            work.verify(f"{name} {work.chunk_bytes}")
            reset(runner)
            if rep >= 0:
                samples[f"{name}_put"].append(put)
                samples[f"{name}_get"].append(get)
            bar.update(1)
    return samples


def summary(
    work: Workload, threads: int, samples: dict[str, list[float]], stats: dict[str, Any]
) -> dict[str, Any]:
    """Medians of tier ``tier<threads>`` and every raw runner, and the tier / raw ratios.

    ``put_ratio``/``get_ratio`` against ``raw``; ``put_ratio_<what>``/``get_ratio_<what>``
    against each ``raw_<what>``.
    """
    picked = {f"tier_{op}": samples[f"tier{threads}_{op}"] for op in ("put", "get")}
    picked.update({k: v for k, v in samples.items() if k.startswith("raw")})
    out: dict[str, Any] = {
        "chunk_bytes": work.chunk_bytes,
        "chunks": len(work.keys),
        "batch": work.batch,
        "io_threads": threads,
        "median_gbps": {name: statistics.median(values) for name, values in picked.items()},
    }
    raws = [k.removesuffix("_put") for k in picked if k.startswith("raw") and k.endswith("_put")]
    for raw in raws:
        suffix = raw.removeprefix("raw")
        for op in ("put", "get"):
            out[f"{op}_ratio{suffix}"] = median_ratio(picked[f"tier_{op}"], picked[f"{raw}_{op}"])
    out["samples_gbps"] = picked
    out["tier_stats"] = stats
    return out


def median_ratio(tier: list[float], raw: list[float]) -> float:
    """Median of the per-repetition ratios (each pair measured in the same repetition, so
    drifting load from other processes cancels better than in a ratio of medians)."""
    return statistics.median(t / r for t, r in zip(tier, raw))


# ------------------------------------------------------------------------------ table
def print_ratio_table(results: list[dict[str, Any]], extras: list[str], title: str) -> None:
    """chunk, io_threads, puts (tier, raw, ratio, then each ``raw_<extra>``), gets (likewise)."""
    headers = ["chunk", "io_threads", "tier put GB/s", "raw put GB/s", "put %"]
    for extra in extras:
        headers += [f"{extra} put GB/s", f"put % {extra}"]
    headers += ["tier get GB/s", "raw get GB/s", "get %"]
    print_table(headers, [_row(r, extras) for r in results], title=title)


def _row(r: dict[str, Any], extras: list[str]) -> tuple[str, ...]:
    med = r["median_gbps"]
    row = [kib_label(r["chunk_bytes"]), str(r["io_threads"]),
           f"{med['tier_put']:.2f}", f"{med['raw_put']:.2f}", f"{100 * r['put_ratio']:.0f}%"]
    for extra in extras:
        row += [f"{med[f'raw_{extra}_put']:.2f}", f"{100 * r[f'put_ratio_{extra}']:.0f}%"]
    row += [f"{med['tier_get']:.2f}", f"{med['raw_get']:.2f}", f"{100 * r['get_ratio']:.0f}%"]
    return tuple(row)
