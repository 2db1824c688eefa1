"""Chunk frames: sealing and verifying with xxh3_64 and with the keyed MAC, next to memcpy.

What is measured: :mod:`tiercache.integrity` on compact frames (the Redis and
cache-server tiers' shape), per chunk size, one thread:

* ``seal``: :func:`~tiercache.integrity.frame_header` of a chunk (the header
  and its checksum over header and payload: what every put costs);
* ``verify``: :func:`~tiercache.integrity.verify_frame` of it (every load);

each with ``xxh3`` (the default) and ``mac`` (keyed BLAKE2b, a tier with a
``mac_key``). References in the same run, over the same bytes: ``memcpy``
(``numpy.copyto`` of each chunk into another buffer: the ceiling, and the
figure the ratios divide by) and, for context, ``hmac-sha256`` of each chunk
(the standard library's other keyed MAC, which uses the CPU's SHA extensions
where it has them).

Each measurement goes once over ``--total`` bytes cut into chunks of the
size (so every pass streams from memory, not cache), warmed up first,
repeated ``--repeat`` times, interleaved so that load from other processes
hits all alike; the table shows medians in GB/s (1e9 bytes per second of
payload) and each rate over memcpy's. A verify runs on frames the seal made,
so it is the full check, not the early-out of a bad one.

Run: ``python -m bench integrity`` (``--help`` for options). Results go to
``bench/results/integrity.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script (python bench/<name>.py): import `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from tiercache.integrity import MacKey, frame_header, verify_frame

NAMESPACE = b"bench-ns"
SECRET = "bench-integrity-mac-secret"
KINDS = ("memcpy", "xxh3 seal", "xxh3 verify", "mac seal", "mac verify", "hmac-sha256")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = common.BenchParser(
        "integrity", __doc__,
        ceiling="numpy.copyto of the same chunks (memcpy), measured in the same run.",
        examples=["", "--sizes 1MiB,32MiB --total 1GiB"],
        out="integrity",
        progress=False,
        quick={"sizes": [256 << 10, 4 << 20], "total": 64 << 20, "repeat": 2},
        sizes=True,
    )
    parser.add_sizes("256KiB,4MiB,32MiB", "chunk sizes")
    parser.add_size("--total", "512MiB", "bytes per measurement, cut into chunks")
    parser.add_repeat(5)
    return parser.parse_args(argv)


def measure(size: int, total: int, repeat: int) -> dict[str, float]:
    """Median GB/s of each kind over chunks of ``size`` bytes."""
    count = max(1, total // size)
    src = np.random.default_rng(0).integers(0, 256, count * size, dtype=np.uint8)
    dst = np.empty_like(src)
    chunks = [memoryview(src[i * size : (i + 1) * size]) for i in range(count)]
    outs = [dst[i * size : (i + 1) * size] for i in range(count)]
    keys = [NAMESPACE + i.to_bytes(36, "little") for i in range(count)]
    mac = MacKey(SECRET)
    raw_key = hashlib.sha256(SECRET.encode()).digest()
    plain_heads = [frame_header(NAMESPACE, k, c) for k, c in zip(keys, chunks)]
    mac_heads = [frame_header(NAMESPACE, k, c, mac=mac) for k, c in zip(keys, chunks)]

    def memcpy() -> None:
        for out, chunk in zip(outs, chunks):
            np.copyto(out, np.frombuffer(chunk, np.uint8))

    def seal(key: MacKey | None) -> Callable[[], None]:
        def run() -> None:
            for k, c in zip(keys, chunks):
                frame_header(NAMESPACE, k, c, mac=key)
        return run

    def verify(heads: list[bytearray], key: MacKey | None) -> Callable[[], None]:
        def run() -> None:
            for h, k, c in zip(heads, keys, chunks):
                verify_frame(h, c, NAMESPACE, k, mac=key)
        return run

    def sha() -> None:
        for chunk in chunks:
            hmac.new(raw_key, chunk, "sha256").digest()

    runs: dict[str, Callable[[], None]] = {
        "memcpy": memcpy, "xxh3 seal": seal(None), "xxh3 verify": verify(plain_heads, None),
        "mac seal": seal(mac), "mac verify": verify(mac_heads, mac), "hmac-sha256": sha,
    }
    samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for run in runs.values():
        run()  # warm-up: pages touched, code paths loaded
    for _ in range(repeat):
        for kind, run in runs.items():
            started = time.perf_counter()
            run()
            samples[kind].append(count * size / (time.perf_counter() - started) / 1e9)
    return {kind: statistics.median(values) for kind, values in samples.items()}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    machine = common.machine_info(["numpy", "xxhash"])
    print(common.describe_machine(machine))
    results = []
    for size in args.sizes:
        rates = measure(size, args.total, args.repeat)
        results.append({"chunk_bytes": size, "gbps": rates,
                        "ratio_to_memcpy": {k: v / rates["memcpy"] for k, v in rates.items()}})
    rows = [(common.size_label(r["chunk_bytes"]), kind, f"{r['gbps'][kind]:.2f}",
             f"{r['ratio_to_memcpy'][kind]:.2f}") for r in results for kind in KINDS]
    common.print_table(["chunk", "what", "GB/s", "/memcpy"], rows,
                       f"chunk frames, one thread (medians of {args.repeat})")
    common.save_results(args, results, machine)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
