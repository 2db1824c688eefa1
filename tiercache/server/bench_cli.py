"""``tiercache bench server``: load a running cache server and report throughput and latency.

    tiercache bench server --server 127.0.0.1:7470 --clients 16 --seconds 10 --chunk-bytes 64KiB

N client threads, each with its own connection, put new chunks and read back
recent ones for a bounded time (:mod:`tiercache.server.loadgen`), with a tqdm
progress bar; then one table: requests/s, GB/s each way, p50/p99 latency per
operation, hits, misses, and corrupt chunks. ``--json FILE`` also writes the
report, and a plot of it beside it (``FILE`` with ``.png``: requests/s over
the run, p50/p99 per operation; tiercache/cli/plots.py, skipped with one line
when matplotlib is missing). Exit status 1 when the server cannot be reached
before the run (nothing listening, a wrong token, an HTTP port: the message
says which), when no request succeeded or any failed, or when a chunk came
back corrupt; 2 for bad arguments. Also runnable as
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


def reach(address: str, token: str | None, timeout_s: float = 5.0) -> str | None:
    """None when one client can say HELLO to the server; else why not, in a sentence."""
    from tiercache.cli.http_probe import http_hint
    from tiercache.server.client import ServerClient
    from tiercache.server.protocol import ProtocolError, RemoteError

    try:
        with ServerClient(address, token, "tiercache-bench", timeout_s, connect_timeout_s=timeout_s):
            pass  # entering connects and says HELLO (the token is checked there)
    except ConnectionRefusedError:
        return f"no cache server at {address}: nothing listens there (start one with `tiercache serve`)"
    except RemoteError as exc:
        return f"the server at {address} refused the benchmark's client: {exc} (--token or $TIERCACHE_SERVER_TOKEN)"
    except (OSError, ProtocolError) as exc:
        return f"cannot use {address} as a cache server: {http_hint(address) or exc}"
    return None


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
    problem = reach(args.server, token)
    if problem:
        print(f"tiercache bench server: {problem}", file=sys.stderr)
        return 1
    bar = tqdm(total=round(args.seconds, 1), unit="s", desc=f"{args.clients} clients", leave=False,
               bar_format="{desc}: {bar} {n:.1f}/{total:.1f}s {postfix}")
    started = time.monotonic()
    timeline: list[tuple[float, int]] = [(0.0, 0)]

    def progress(requests: int) -> None:
        elapsed = time.monotonic() - started
        timeline.append((round(min(elapsed, args.seconds), 3), requests))  # the last poll comes after the end
        bar.n = min(round(elapsed, 1), bar.total)
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
        _write(args, r.as_dict(), timeline)
    return _verdict(r, args.server)


def _write(args: argparse.Namespace, report: dict[str, Any], timeline: list[tuple[float, int]]) -> None:
    from tiercache.cli.plots import draw_load_report, png_beside

    with open(args.json, "w", encoding="utf-8") as f:
        json.dump({**report, "timeline": timeline}, f, indent=2)
    print(f"  results: {args.json}")
    if args.no_plot:
        return
    title = (f"tiercache bench server {args.server}: {report['clients']} clients, "
             f"{report['chunk_bytes']} B chunks x {report['batch']} per request")
    png = draw_load_report(report, timeline, png_beside(args.json), title)
    if png is not None:
        print(f"  plot: {png}")


def _verdict(r: Any, address: str) -> int:
    """The exit status, with a line on stderr for each reason it is not 0."""
    failed = []
    if not r.requests:
        failed.append(f"no request succeeded ({r.errors} failed): is the server at {address} still up?")
    elif r.errors:
        failed.append(f"{r.errors} requests failed (the connection was lost or refused; see the server's log)")
    if r.corrupt:
        failed.append(f"{r.corrupt} chunks came back different from what was put")
    for line in failed:
        print(f"tiercache bench server: {line}", file=sys.stderr)
    return 1 if failed else 0


def add_parser(sub: Any) -> None:
    b = sub.add_parser(
        "bench", help="generate load and measure (bench server: a cache server)",
        description="Generate load against a running target and measure it. The data-path benchmarks "
        "(host, disk, Redis, LMDB tiers, P/D, end to end) live in a source checkout: `python -m bench` "
        "lists them; each writes bench/results/<name>.json and a PNG of its tables beside it.",
    )
    bsub = b.add_subparsers(dest="bench_command", metavar="TARGET", required=True)
    s = bsub.add_parser(
        "server",
        help="concurrent clients putting and getting against a cache server",
        description="Load a running tiercache server for a bounded time; report throughput and\n"
        "p50/p99 latency, and check every chunk read back byte for byte. Fails (exit 1)\n"
        "when the server cannot be reached, a request fails or a chunk comes back corrupt.",
        epilog="examples:\n"
        "  tiercache bench server --server 127.0.0.1:7470 --clients 16 --seconds 10 --json run.json\n"
        "        16 connections for 10 s; run.json and its plot run.png\n"
        "  tiercache bench server --server 127.0.0.1:7470 --chunk-bytes 2MiB --batch 2 --get-ratio 0.9\n"
        "        large chunks, read-mostly\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("--server", required=True, metavar="HOST:PORT",
                   help="a running cache server's protocol port (tiercache serve; default port 7470)")
    s.add_argument("--token", help="the server's auth token (default: $TIERCACHE_SERVER_TOKEN)")
    s.add_argument("--clients", type=int, default=16, metavar="N",
                   help="concurrent clients, one connection each (default %(default)s)")
    s.add_argument("--seconds", type=float, default=10.0, help="how long to run (default %(default)s)")
    s.add_argument("--chunk-bytes", default="64KiB", metavar="SIZE",
                   help="bytes per chunk: 64KiB, 2MiB, ... (default %(default)s)")
    s.add_argument("--batch", type=int, default=8, metavar="N", help="chunks per request (default %(default)s)")
    s.add_argument("--get-ratio", type=float, default=0.5, metavar="R",
                   help="share of requests that are gets, 0..1 (default %(default)s)")
    s.add_argument("--keyspace", type=int, default=1024, metavar="N",
                   help="gets read among the last N keys put; below the server's capacity, mostly hits "
                   "(default %(default)s)")
    s.add_argument("--json", metavar="FILE",
                   help="also write the report as JSON, and its plot as FILE with .png (needs matplotlib)")
    s.add_argument("--no-plot", action="store_true", help="with --json: write no PNG")
    s.set_defaults(func=run_bench_server)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiercache")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
