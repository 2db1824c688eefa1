"""``tiercache bench server``: load a running cache server and report throughput and latency.

    tiercache bench server --server 127.0.0.1:7470 --clients 16 --seconds 10 --chunk-bytes 64KiB

N client threads, each with its own connection, put new chunks and read back
recent ones for a bounded time (:mod:`tiercache.server.loadgen`), with a tqdm
progress bar; then one table: requests/s, GB/s each way, p50/p99 latency per
operation, hits, misses, and corrupt chunks (always 0, or the exit status is
1). ``--json FILE`` also writes the report. Also runnable as
``python -m tiercache.server.bench_cli server --server HOST:PORT``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from tiercache.config.sizes import parse_size


def run_bench_server(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tiercache.server.loadgen import LoadGenerator

    token = args.token if args.token is not None else os.environ.get("TIERCACHE_SERVER_TOKEN")
    try:
        chunk = parse_size(args.chunk_bytes)
        gen = LoadGenerator(args.server, token, args.clients, chunk, args.batch, args.get_ratio,
                            keyspace=args.keyspace)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    bar = tqdm(total=round(args.seconds, 1), unit="s", desc=f"{args.clients} clients", leave=False,
               bar_format="{desc}: {bar} {n:.1f}/{total:.1f}s {postfix}")
    started = time.monotonic()

    def progress(requests: int) -> None:
        bar.n = min(round(time.monotonic() - started, 1), bar.total)
        bar.set_postfix_str(f"{requests} requests")

    report = gen.run(args.seconds, progress)
    bar.close()
    r = report
    print(f"tiercache bench server: {args.server}, {r.clients} clients x {r.seconds:.1f} s, "
          f"chunks of {r.chunk_bytes} bytes, {r.batch} per request")
    print(f"  requests: {r.requests} ({r.requests_per_s:.0f}/s), errors {r.errors}")
    print(f"  put: {r.put_keys} keys ({r.put_ok} stored), {r.put_gbps:.3f} GB/s, "
          f"p50 {r.put_p50_ms:.2f} ms, p99 {r.put_p99_ms:.2f} ms")
    print(f"  get: {r.get_keys} keys ({r.hits} hits, {r.misses} misses), {r.get_gbps:.3f} GB/s, "
          f"p50 {r.get_p50_ms:.2f} ms, p99 {r.get_p99_ms:.2f} ms")
    print(f"  corrupt chunks: {r.corrupt}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(r.as_dict(), f, indent=2)
    return 1 if r.corrupt else 0


def add_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="generate load and measure (bench server: a cache server)")
    bsub = b.add_subparsers(dest="bench_command", metavar="TARGET", required=True)
    s = bsub.add_parser(
        "server",
        help="concurrent clients putting and getting against a cache server",
        description="Load a running tiercache server for a bounded time; report throughput and "
        "p50/p99 latency, and check every chunk read back byte for byte.",
    )
    s.add_argument("--server", required=True, metavar="HOST:PORT")
    s.add_argument("--token", help="the server's auth token (default: $TIERCACHE_SERVER_TOKEN)")
    s.add_argument("--clients", type=int, default=16, help="concurrent clients (connections)")
    s.add_argument("--seconds", type=float, default=10.0, help="how long to run")
    s.add_argument("--chunk-bytes", default="64KiB", help="bytes per chunk (e.g. 64KiB, 2MiB)")
    s.add_argument("--batch", type=int, default=8, help="chunks per request")
    s.add_argument("--get-ratio", type=float, default=0.5, help="share of requests that are gets")
    s.add_argument("--keyspace", type=int, default=1024,
                   help="gets read among the last N keys put (below the server's capacity: mostly hits)")
    s.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    s.set_defaults(func=run_bench_server)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiercache")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
