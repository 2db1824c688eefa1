"""Redis tier throughput (backends/redis/backend.py) next to raw pipelined redis-py moving the same bytes.

What is measured, per chunk size: moving ``--total`` bytes of chunks into a
redis-server this benchmark starts on a loopback port (puts) and back out
into caller buffers (gets), in pipelines of ``--batch`` chunks.

* ``tier``: :class:`tiercache.backends.redis.backend.RedisBackend` through its public
  API: ``submit_put``/``submit_get`` of every job (``--batch`` chunks, one
  pipeline each) at once, then ``poll`` every ``--poll-ms`` until all have
  reported. That includes the framing and xxh3_64 checksum of every put, its
  verification on every get, the copy into the caller's buffer, the I/O
  threads and the hand-over of results. Once per ``--io-threads`` value
  (default 1 and 2).
* ``raw``: redis-py as an application would use it, with hiredis (its
  default serializer and parser), on one thread of its own: per batch, a
  pipeline of ``SET key value`` (value: a memoryview of the same source
  bytes), or of ``GET key`` followed by copying each reply into the same
  caller buffers (``numpy.copyto``). The same keys (``tc:`` + chunk key).
  This is the target: tier / raw >= 80%.
* ``raw_nocopy``: the same, but with redis-py's pure-Python serializer, which
  hands a memoryview value to the socket without copying it (hiredis's
  serializer copies every value twice). Not a target; it shows what the puts
  of any redis-py client can reach, since the tier sends its frames the same
  zero-copy way. Gets use hiredis in all three.

glibc's malloc thresholds are fixed for the run (``steady_malloc`` of
bench/lmdb_tier.py; ``--glibc-malloc-defaults`` keeps them dynamic): hiredis
allocates a fresh bytes object for every reply, and whether a 256 KiB - 4 MiB
block comes from a warm heap or from a fresh mmap (a page fault per 4 KiB)
otherwise depends on the allocation history of the thread's arena, which
moved client CPU per GB by 30-45% for tier and raw alike.

Every get is verified byte exact (untimed). After each measurement the server
is flushed (FLUSHALL SYNC, untimed), so every put writes fresh keys. The
runners take turns in an order that rotates every repetition, so that load
from other processes hits all alike; the table shows medians, and ratios are
the median over repetitions of tier / raw measured in the same repetition.

Run from the repository root: ``python -m bench.redis_tier`` (``--help`` for
options). Needs redis-server on PATH (scripts/setup.sh installs it). Results
go to ``bench/results/redis_tier.json``. The server runs in a temporary
directory with no persistence and is stopped at the end.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis
from redis.connection import PythonRespSerializer
from tiercache.backends.redis.backend import RedisBackend, RedisSettings, redis_key
from tqdm import tqdm

from bench.common import describe_machine, machine_info, print_table, write_result
from bench.lmdb_tier import steady_malloc
from tests.integration.redis_servers import RedisServer, redis_binaries
from tiercache.backend import BackendContext

DEFAULT_SIZES = "256K,1M,4M"
NAMESPACE = bytes.fromhex("0011223344556677")
GB = 1e9


# ------------------------------------------------------------------------------ options
def parse_bytes(text: str) -> int:
    """``"256K"`` -> 262144; K, M and G are powers of 1024."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.redis_tier",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--sizes", default=DEFAULT_SIZES, help="chunk sizes (default %(default)s)")
    add("--total", default="128M", help="bytes moved per measurement (default %(default)s)")
    add("--batch", type=int, default=16,
        help="chunks per pipeline: the tier's job size and pipeline_batch (default 16)")
    add("--repeat", type=int, default=7, help="measurements per cell; medians shown (default 7)")
    add("--io-threads", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2],
        help="tier io_threads settings to measure, each against the same raw runs (default 1,2)")
    add("--poll-ms", type=float, default=1.0,
        help="how often the submitting thread polls for results, as an engine step would "
             "(default %(default)s, as in the other tier benchmarks; each poll takes the GIL "
             "from the I/O threads, which costs most at small chunks on a loaded machine)")
    add("--no-raw-nocopy", action="store_true", help="skip the zero-copy raw runner")
    add("--glibc-malloc-defaults", action="store_true",
        help="keep glibc's dynamic mmap/trim thresholds instead of fixing them")
    add("--out", default="redis_tier", help="result name under bench/results/ (default %(default)s)")
    add("--seed", type=int, default=0)
    return parser.parse_args(argv)


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
    def make(cls, chunk_bytes: int, total: int, batch: int, rng: np.random.Generator) -> Workload:
        count = max(batch, total // chunk_bytes // batch * batch)
        src_buf = np.frombuffer(rng.bytes(count * chunk_bytes), dtype=np.uint8)
        dst_buf = np.zeros(count * chunk_bytes, dtype=np.uint8)
        keys = [NAMESPACE + i.to_bytes(32, "big") + bytes(4) for i in range(count)]
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
            raise SystemExit(f"{what}: chunks of {self.chunk_bytes} bytes came back wrong")
        self.dst_buf.fill(0)


def _slices(buf: np.ndarray, size: int) -> list[memoryview]:
    view = memoryview(buf)
    return [view[i:i + size] for i in range(0, len(buf), size)]


# ------------------------------------------------------------------------------ runners
class _PlainPythonConnection(redis.Connection):
    """redis-py's pure-Python serializer: memoryview values go to the socket uncopied."""

    def _construct_command_packer(self, packer: Any) -> Any:
        return PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)


class RawRunner:
    """redis-py pipelines on one thread of its own (the tier's I/O runs on its own threads)."""

    def __init__(self, server: RedisServer, nocopy: bool) -> None:
        pool = redis.ConnectionPool.from_url(
            server.url, **({"connection_class": _PlainPythonConnection} if nocopy else {})
        )
        self.client = redis.Redis(connection_pool=pool)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raw-redis")

    def put(self, work: Workload) -> None:
        self._thread.submit(self._put, work).result()

    def get(self, work: Workload) -> None:
        self._thread.submit(self._get, work).result()

    def close(self) -> None:
        self._thread.shutdown()
        self.client.close()
        self.client.connection_pool.disconnect()

    def _put(self, work: Workload) -> None:
        for keys, src, _ in work.batches():
            pipe = self.client.pipeline(transaction=False)
            for key, value in zip(keys, src):
                pipe.set(redis_key(key), value)
            pipe.execute()

    def _get(self, work: Workload) -> None:
        for keys, _, dst in work.batches():
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.get(redis_key(key))
            for out, value in zip(dst, pipe.execute()):
                np.copyto(np.frombuffer(out, dtype=np.uint8), np.frombuffer(value, dtype=np.uint8))


class TierRunner:
    """The Redis tier through submit/poll, every job in flight at once (as the engine pipelines)."""

    def __init__(self, settings: RedisSettings, context: BackendContext, poll_secs: float) -> None:
        self.backend = RedisBackend(settings, context)
        self._poll_secs = poll_secs
        self._next_job = 0

    def put(self, work: Workload) -> None:
        self._run([(self.backend.submit_put, keys, src) for keys, src, _ in work.batches()])

    def get(self, work: Workload) -> None:
        self._run([(self.backend.submit_get, keys, dst) for keys, _, dst in work.batches()])

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
                    raise SystemExit(f"tier job {result.job_id} failed {failed} keys "
                                     f"({self.backend.stats()})")
                pending.discard(result.job_id)
            if pending:
                time.sleep(self._poll_secs)


Runner = TierRunner | RawRunner


# ------------------------------------------------------------------------------ measuring
def timed(fn: Callable[[Workload], None], work: Workload) -> float:
    start = time.perf_counter()
    fn(work)
    return work.total_bytes / (time.perf_counter() - start) / GB


def measure_size(
    chunk_bytes: int, args: argparse.Namespace, server: RedisServer, rng: np.random.Generator,
    bar: tqdm,
) -> list[dict[str, Any]]:
    """One result per ``--io-threads`` value: medians (GB/s) of tier and raw, and the ratios."""
    work = Workload.make(chunk_bytes, parse_bytes(args.total), args.batch, rng)
    context = BackendContext(tier_name="bench", namespace=NAMESPACE, chunk_bytes=chunk_bytes,
                             capacity_bytes=len(work.keys) * RedisBackend.footprint(chunk_bytes))
    runners: dict[str, Runner] = {}
    try:
        for threads in args.io_threads:
            settings = RedisSettings(url=server.url, io_threads=threads,
                                     pipeline_batch=args.batch, socket_timeout=30)
            runners[f"tier{threads}"] = TierRunner(settings, context, args.poll_ms / 1000)
        runners["raw"] = RawRunner(server, nocopy=False)
        if not args.no_raw_nocopy:
            runners["raw_nocopy"] = RawRunner(server, nocopy=True)
        samples = _interleaved(work, runners, server, args.repeat, bar)
        stats = {n: r.backend.stats() for n, r in runners.items() if isinstance(r, TierRunner)}
    finally:
        for runner in runners.values():
            runner.close()
    return [_summary(work, t, samples, stats[f"tier{t}"]) for t in args.io_threads]


def _interleaved(
    work: Workload, runners: dict[str, Runner], server: RedisServer, repeat: int, bar: tqdm
) -> dict[str, list[float]]:
    """``<runner>_put`` / ``<runner>_get`` GB/s samples; runner order rotates every repetition."""
    names = list(runners)
    samples: dict[str, list[float]] = {f"{n}_{op}": [] for n in names for op in ("put", "get")}
    with server.client() as admin:
        for rep in range(-1, repeat):  # rep -1 warms every runner up, unrecorded
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                runner = runners[name]
                put, get = timed(runner.put, work), timed(runner.get, work)
                work.verify(f"{name} {work.chunk_bytes}")
                admin.flushall(asynchronous=False)
                if rep >= 0:
                    samples[f"{name}_put"].append(put)
                    samples[f"{name}_get"].append(get)
                bar.update(1)
    return samples


def _summary(
    work: Workload, threads: int, samples: dict[str, list[float]], stats: dict[str, Any]
) -> dict[str, Any]:
    tier = f"tier{threads}"
    picked = {f"tier_{op}": samples[f"{tier}_{op}"] for op in ("put", "get")}
    picked.update({k: v for k, v in samples.items() if k.startswith("raw")})
    out: dict[str, Any] = {
        "chunk_bytes": work.chunk_bytes,
        "chunks": len(work.keys),
        "batch": work.batch,
        "io_threads": threads,
        "median_gbps": {name: statistics.median(values) for name, values in picked.items()},
        "put_ratio": _median_ratio(picked["tier_put"], picked["raw_put"]),
        "get_ratio": _median_ratio(picked["tier_get"], picked["raw_get"]),
    }
    if "raw_nocopy_put" in picked:
        out["put_ratio_nocopy"] = _median_ratio(picked["tier_put"], picked["raw_nocopy_put"])
        out["get_ratio_nocopy"] = _median_ratio(picked["tier_get"], picked["raw_nocopy_get"])
    out["samples_gbps"] = picked
    out["tier_stats"] = stats
    return out


def _median_ratio(tier: list[float], raw: list[float]) -> float:
    """Median of the per-repetition ratios (each pair measured in the same repetition, so
    drifting load from other processes cancels better than in a ratio of medians)."""
    return statistics.median(t / r for t, r in zip(tier, raw))


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if redis_binaries() is None:
        raise SystemExit("redis-server and redis-cli must be on PATH (scripts/setup.sh)")
    if not args.glibc_malloc_defaults:
        steady_malloc()
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    rng = np.random.default_rng(args.seed)
    results: list[dict[str, Any]] = []
    runners = len(args.io_threads) + 1 + (not args.no_raw_nocopy)
    with tempfile.TemporaryDirectory(prefix="tiercache-redis-bench-") as tmp:
        server = RedisServer(Path(tmp)).start()
        try:
            with tqdm(total=len(sizes) * (args.repeat + 1) * runners, desc="redis tier",
                      unit="cell") as bar:
                for size in sizes:
                    results += measure_size(size, args, server, rng, bar)
            with server.client() as admin:
                redis_version = admin.info("server")["redis_version"]
        finally:
            server.stop()
    machine = machine_info(["redis", "hiredis", "xxhash", "numpy"])
    machine["redis_server"] = redis_version
    _print(results, args, machine)
    path = write_result(args.out, results, options=vars(args), machine=machine)
    print(f"wrote {path}")


def _print(results: list[dict[str, Any]], args: argparse.Namespace, machine: dict[str, Any]) -> None:
    nocopy = not args.no_raw_nocopy
    headers = ["chunk", "io_threads", "tier put GB/s", "raw put GB/s", "put %"]
    headers += ["nocopy put GB/s", "put % nocopy"] if nocopy else []
    headers += ["tier get GB/s", "raw get GB/s", "get %"]
    print_table(
        headers, [_row(r, nocopy) for r in results],
        title=(f"Redis tier vs raw redis-py+hiredis (redis-server {machine['redis_server']}, "
               f"loopback), {args.total} per cell, {args.batch} chunks per pipeline, median of "
               f"{args.repeat}; {describe_machine(machine)}"),
    )


def _row(r: dict[str, Any], nocopy: bool) -> tuple[str, ...]:
    med = r["median_gbps"]
    row = [f"{r['chunk_bytes'] >> 10} KiB", str(r["io_threads"]),
           f"{med['tier_put']:.2f}", f"{med['raw_put']:.2f}", f"{100 * r['put_ratio']:.0f}%"]
    if nocopy:
        row += [f"{med['raw_nocopy_put']:.2f}", f"{100 * r['put_ratio_nocopy']:.0f}%"]
    row += [f"{med['tier_get']:.2f}", f"{med['raw_get']:.2f}", f"{100 * r['get_ratio']:.0f}%"]
    return tuple(row)


if __name__ == "__main__":
    main()
