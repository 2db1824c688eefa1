"""LMDB tier throughput (backends/lmdb/backend.py) next to raw lmdb put/get of the same values.

What is measured, per chunk size: moving ``--total`` bytes of chunks into the
tier (puts) and back out into caller buffers (gets), in jobs of ``--batch``
chunks.

* ``tier``: :class:`tiercache.backends.lmdb.backend.LMDBBackend` through its public
  API: ``submit_put``/``submit_get`` of every job at once, then ``poll`` every
  ``--poll-ms`` until all have reported. That includes the framing, the
  xxh3_64 checksum of every put and its verification on every get (both done
  while copying: backends/lmdb/frames.py), the budget check, the I/O threads
  and the hand-over of results. Once per
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
of one repetition (target: >= 90%, issue 22). glibc's malloc thresholds are
fixed for the run (``steady_malloc`` of bench/tier_runs.py;
``--glibc-malloc-defaults`` to keep them).

``--frames`` measures the framing alone instead (backends/lmdb/frames.py, on
one thread, no LMDB): ``Framer.unframe`` (checksum while copying) and the
order it replaced (verify the whole value, then copy: ``compact_payload`` and
``numpy.copyto``), both from values that stand in for LMDB's pages (4096-byte
aligned plus LMDB's 16-byte page header, ``--total`` of them, far past the
caches) into caller buffers, against ``numpy.copyto`` of the same payloads;
and ``Framer.frame`` against the same copy. The best of ``--repeat``
interleaved passes (a loaded machine slows passes, never speeds them up).

Run: ``python -m bench lmdb_tier`` (``--help`` for options). Results go to
``bench/results/lmdb_tier.json``. The environments live in a temporary
directory (``--dir`` to pick the disk), removed afterwards.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

if __package__ in (None, ""):  # run as a script (python bench/<name>.py): import `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiercache.backends.lmdb.backend import (
    LMDBBackend,
    LMDBSettings,
    database_name,
    environment_options,
)
from tiercache.backends.lmdb.frames import Framer

from bench import common, tier_runs
from tiercache import integrity
from tiercache.backend import BackendContext

NAMESPACE = bytes.fromhex("00112233445566ff")


# ------------------------------------------------------------------------------ options
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = tier_runs.tier_parser(
        "lmdb_tier", __doc__,
        ceiling="raw lmdb put/get of the same values, on one thread, in an environment opened "
        "with the tier's own options (environment_options); target: tier >= 90% of it",
        example="--sizes 256KiB,4MiB --total 128MiB --io-threads 2",
        total="256MiB", repeat=5, batch_help="chunks per job / transaction",
    )
    add = parser.add_argument
    add("--sync", action="store_true", help="fsync every commit (the tier's sync setting)")
    add("--dir", default=None, help="where the environments go (default: a temporary directory)")
    add("--frames", action="store_true", help="measure the framing alone (see above); "
        "results as <--out>_frames.json")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------ runners
def copy_into(dst: memoryview, src: memoryview) -> None:
    """The copy the tier uses too: numpy, which releases the GIL."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


class RawRunner(tier_runs.OwnThreadRunner):
    """Plain lmdb: one transaction per batch, values copied out of the map into the buffers.

    The work runs on one thread of its own, as the tier's does: LMDB mallocs the
    pages of every value it writes, and glibc serves a thread other than the main
    one from another arena, whose reuse of large blocks differs (on the main
    thread puts of 1-4 MiB values were measured up to 2x slower).
    """

    def __init__(self, path: Path, settings: LMDBSettings, map_size: int) -> None:
        super().__init__("raw-lmdb")
        self.env = lmdb.open(str(path), **environment_options(settings, map_size))
        self.db = self.env.open_db(database_name(NAMESPACE, rank=0))

    def clear(self, work: tier_runs.Workload) -> None:
        self.on_thread(self._clear, work)

    def close(self) -> None:
        super().close()
        self.env.close()

    def _put(self, work: tier_runs.Workload) -> None:
        for keys, src, _ in work.batches():
            with self.env.begin(db=self.db, write=True) as txn:
                for key, value in zip(keys, src):
                    txn.put(key, value)

    def _get(self, work: tier_runs.Workload) -> None:
        for keys, _, dst in work.batches():
            with self.env.begin(db=self.db, buffers=True) as txn:
                for key, out in zip(keys, dst):
                    copy_into(out, txn.get(key))

    def _clear(self, work: tier_runs.Workload) -> None:
        with self.env.begin(db=self.db, write=True) as txn:
            for key in work.keys:
                txn.delete(key)


class LMDBTierRunner(tier_runs.TierRunner):
    """The LMDB tier through submit/poll; clearing waits until the deletes are committed."""

    def __init__(self, settings: LMDBSettings, context: BackendContext, poll_secs: float) -> None:
        super().__init__(LMDBBackend(settings, context), poll_secs)
        self._probe = (NAMESPACE + b"probe", memoryview(bytes(context.chunk_bytes)))

    def clear(self, work: tier_runs.Workload) -> None:
        """Delete the chunks and wait until that is committed (a put queued behind it returns)."""
        self.backend.delete(work.keys)
        key, view = self._probe
        self.run([(self.backend.submit_put, [key], [view])])


# ------------------------------------------------------------------------------ measuring
def measure_size(
    chunk_bytes: int, args: argparse.Namespace, root: Path, rng: np.random.Generator, bar: Any
) -> list[dict[str, Any]]:
    """One result per ``--io-threads`` value: medians (GB/s) of tier and raw, and the ratios."""
    work = tier_runs.Workload.make(chunk_bytes, args.total, args.batch, rng, NAMESPACE)
    context = BackendContext(
        tier_name="bench", namespace=NAMESPACE, chunk_bytes=chunk_bytes,
        capacity_bytes=(len(work.keys) + 2) * (chunk_bytes + 4096),
    )

    def add_runners(runners: dict[str, tier_runs.Runner]) -> None:
        for threads in args.io_threads:
            settings = LMDBSettings(
                path=root / f"tier{threads}", io_threads=threads, sync=args.sync
            )
            runners[f"tier{threads}"] = LMDBTierRunner(settings, context, args.poll_ms / 1000)
        map_size = runners[f"tier{args.io_threads[0]}"].backend.map_size  # type: ignore[union-attr]
        runners["raw"] = RawRunner(root / "raw", LMDBSettings(path=root / "raw", sync=args.sync),
                                   map_size)

    return tier_runs.measure_cell(work, args.io_threads, args.repeat, bar, add_runners,
                        reset=lambda runner: runner.clear(work))  # type: ignore[union-attr]


def measure_frames(chunk_bytes: int, args: argparse.Namespace) -> dict[str, Any]:
    """GB/s of the framing paths and of a plain copy, best of ``--repeat`` interleaved passes."""
    n = max(1, args.total // chunk_bytes)
    keys = [NAMESPACE + i.to_bytes(36, "little") for i in range(n)]
    framer = Framer(NAMESPACE, chunk_bytes)
    head = integrity.compact_header_len(len(keys[0]))
    stride = -(-(head + chunk_bytes + 16) // 4096) * 4096
    pages = np.empty(n * stride, dtype=np.uint8)
    values, payloads = [], []
    rng = np.random.default_rng(args.seed)
    for i, key in enumerate(keys):
        frame = framer.frame(key, memoryview(rng.integers(0, 256, chunk_bytes, dtype=np.uint8)))
        value = pages[i * stride + 16 : i * stride + 16 + frame.nbytes]
        value[:] = np.frombuffer(frame, dtype=np.uint8)
        values.append(memoryview(value).toreadonly())
        payloads.append(value[head:])
    outs = np.zeros((n, chunk_bytes), dtype=np.uint8)
    outs.fill(1)  # touched: no pass pays the page faults of fresh memory

    def copy() -> None:
        for src, out in zip(payloads, outs):
            np.copyto(out, src)

    def verify_then_copy() -> None:
        for key, value, out in zip(keys, values, outs):
            copy_into(memoryview(out), integrity.compact_payload(value, NAMESPACE, key))

    def unframe() -> None:
        for key, value, out in zip(keys, values, outs):
            framer.unframe(key, value, memoryview(out))

    def frame() -> None:
        for key, out in zip(keys, outs):
            framer.frame(key, memoryview(out))

    runs = {"copy": copy, "verify_then_copy": verify_then_copy, "unframe": unframe, "frame": frame}
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(max(1, args.repeat)):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    gbs = {name: n * chunk_bytes / secs / 1e9 for name, secs in best.items()}
    unframe()
    assert all(bytes(o) == bytes(p) for o, p in zip(outs, payloads)), "unframe lost bytes"
    return {"chunk_bytes": chunk_bytes, "gbs": gbs,
            "ratio": {k: v / gbs["copy"] for k, v in gbs.items() if k != "copy"}}


def frames_main(args: argparse.Namespace) -> None:
    results = [measure_frames(size, args) for size in args.sizes]
    machine = common.machine_info(["lmdb", "xxhash", "numpy"])
    rows = [(common.size_label(r["chunk_bytes"]), *(f"{r['gbs'][k]:.2f}" for k in r["gbs"]),
             *(f"{r['ratio'][k]:.0%}" for k in ("verify_then_copy", "unframe", "frame")))
            for r in results]
    print(common.format_table(
        ["chunk", "copy GB/s", "verify+copy GB/s", "unframe GB/s", "frame GB/s",
         "verify+copy", "unframe", "frame"], rows,
        title=f"LMDB frames vs numpy.copyto, best of {args.repeat}; "
              f"{common.describe_machine(machine)}"))
    common.save_results(args, results, machine, name=f"{args.out}_frames")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.frames:
        frames_main(args)
        return
    if not args.glibc_malloc_defaults:
        tier_runs.steady_malloc()
    rng = np.random.default_rng(args.seed)
    root = Path(tempfile.mkdtemp(prefix="tiercache-lmdb-bench-", dir=args.dir))
    results: list[dict[str, Any]] = []
    cells = len(args.sizes) * (args.repeat + 1) * (len(args.io_threads) + 1)
    try:
        with common.progress(args, cells, "lmdb tier", "cell") as bar:
            for size in args.sizes:
                results += measure_size(size, args, root, rng, bar)
                shutil.rmtree(root, ignore_errors=True)
                root.mkdir()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    machine = common.machine_info(["lmdb", "xxhash", "numpy"])
    tier_runs.print_ratio_table(
        results, [],
        title=(f"LMDB tier vs raw lmdb, {common.size_label(args.total)} per cell, "
               f"{args.batch} chunks "
               f"per txn, median of {args.repeat}; {common.describe_machine(machine)}"),
    )
    common.save_results(args, results, machine)


if __name__ == "__main__":
    main()
