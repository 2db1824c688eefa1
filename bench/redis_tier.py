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
bench/tier_runs.py; ``--glibc-malloc-defaults`` keeps them dynamic): hiredis
allocates a fresh bytes object for every reply, and whether a 256 KiB - 4 MiB
block comes from a warm heap or from a fresh mmap (a page fault per 4 KiB)
otherwise depends on the allocation history of the thread's arena, which
moved client CPU per GB by 30-45% for tier and raw alike.

Every get is verified byte exact (untimed). After each measurement the server
is flushed (FLUSHALL SYNC, untimed), so every put writes fresh keys. The
runners take turns in an order that rotates every repetition, so that load
from other processes hits all alike; the table shows medians, and ratios are
the median over repetitions of tier / raw measured in the same repetition.

Run from the repository root: ``python -m bench redis_tier`` (``--help`` for
options). Needs redis-server on PATH (scripts/setup.sh installs it). Results
go to ``bench/results/redis_tier.json``. The server runs in a temporary
directory with no persistence and is stopped at the end.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import redis
from redis.connection import PythonRespSerializer

if __package__ in (None, ""):  # run as a script (python bench/<name>.py): import `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiercache.backends.redis.backend import RedisBackend, RedisSettings, redis_key

from bench import common, tier_runs
from tests.integration.redis_servers import RedisServer, redis_binaries
from tiercache.backend import BackendContext

NAMESPACE = bytes.fromhex("0011223344556677")


# ------------------------------------------------------------------------------ options
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = tier_runs.tier_parser(
        "redis_tier", __doc__,
        ceiling="raw pipelined redis-py with hiredis moving the same bytes, in the same batches, "
        "to the same redis-server (started by this benchmark on loopback; needs redis-server "
        "on PATH); target: tier >= 80% of it",
        example="--sizes 256KiB,4MiB --total 64MiB --io-threads 2",
        total="128MiB", repeat=7,
        batch_help="chunks per pipeline: the tier's job size and pipeline_batch",
    )
    parser.add_argument("--no-raw-nocopy", action="store_true",
                        help="skip the zero-copy raw runner")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------ runners
class _PlainPythonConnection(redis.Connection):
    """redis-py's pure-Python serializer: memoryview values go to the socket uncopied."""

    def _construct_command_packer(self, packer: Any) -> Any:
        return PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)


class RawRunner(tier_runs.OwnThreadRunner):
    """redis-py pipelines on one thread of its own (the tier's I/O runs on its own threads)."""

    def __init__(self, server: RedisServer, nocopy: bool) -> None:
        super().__init__("raw-redis")
        pool = redis.ConnectionPool.from_url(
            server.url, **({"connection_class": _PlainPythonConnection} if nocopy else {})
        )
        self.client = redis.Redis(connection_pool=pool)

    def close(self) -> None:
        super().close()
        self.client.close()
        self.client.connection_pool.disconnect()

    def _put(self, work: tier_runs.Workload) -> None:
        for keys, src, _ in work.batches():
            pipe = self.client.pipeline(transaction=False)
            for key, value in zip(keys, src):
                pipe.set(redis_key(key), value)
            pipe.execute()

    def _get(self, work: tier_runs.Workload) -> None:
        for keys, _, dst in work.batches():
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.get(redis_key(key))
            for out, value in zip(dst, pipe.execute()):
                np.copyto(np.frombuffer(out, dtype=np.uint8), np.frombuffer(value, dtype=np.uint8))


# ------------------------------------------------------------------------------ measuring
def measure_size(
    chunk_bytes: int, args: argparse.Namespace, server: RedisServer, rng: np.random.Generator,
    bar: Any,
) -> list[dict[str, Any]]:
    """One result per ``--io-threads`` value: medians (GB/s) of tier and raw, and the ratios."""
    work = tier_runs.Workload.make(chunk_bytes, args.total, args.batch, rng, NAMESPACE)
    context = BackendContext(tier_name="bench", namespace=NAMESPACE, chunk_bytes=chunk_bytes,
                             capacity_bytes=len(work.keys) * RedisBackend.footprint(chunk_bytes))

    def add_runners(runners: dict[str, tier_runs.Runner]) -> None:
        for threads in args.io_threads:
            settings = RedisSettings(url=server.url, io_threads=threads,
                                     pipeline_batch=args.batch, socket_timeout=30)
            runners[f"tier{threads}"] = tier_runs.TierRunner(RedisBackend(settings, context),
                                                   args.poll_ms / 1000)
        runners["raw"] = RawRunner(server, nocopy=False)
        if not args.no_raw_nocopy:
            runners["raw_nocopy"] = RawRunner(server, nocopy=True)

    with server.client() as admin:  # every put writes fresh keys: flushed after each runner
        return tier_runs.measure_cell(work, args.io_threads, args.repeat, bar, add_runners,
                            reset=lambda _runner: admin.flushall(asynchronous=False))


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if redis_binaries() is None:
        raise SystemExit("redis-server and redis-cli must be on PATH (scripts/setup.sh)")
    if not args.glibc_malloc_defaults:
        tier_runs.steady_malloc()
    rng = np.random.default_rng(args.seed)
    results: list[dict[str, Any]] = []
    runners = len(args.io_threads) + 1 + (not args.no_raw_nocopy)
    with tempfile.TemporaryDirectory(prefix="tiercache-redis-bench-") as tmp:
        server = RedisServer(Path(tmp)).start()
        try:
            with common.progress(args, len(args.sizes) * (args.repeat + 1) * runners, "redis tier",
                          "cell") as bar:
                for size in args.sizes:
                    results += measure_size(size, args, server, rng, bar)
            with server.client() as admin:
                redis_version = admin.info("server")["redis_version"]
        finally:
            server.stop()
    machine = common.machine_info(["redis", "hiredis", "xxhash", "numpy"])
    machine["redis_server"] = redis_version
    tier_runs.print_ratio_table(
        results, [] if args.no_raw_nocopy else ["nocopy"],
        title=(f"Redis tier vs raw redis-py+hiredis (redis-server {machine['redis_server']}, "
               f"loopback), {common.size_label(args.total)} per cell, "
               f"{args.batch} chunks per pipeline, "
               f"median of {args.repeat}; {common.describe_machine(machine)}"),
    )
    common.save_results(args, results, machine)


if __name__ == "__main__":
    main()
