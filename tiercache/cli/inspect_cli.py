"""``tiercache inspect``: what a running engine's tiercache or a cache server holds, once or ``--watch``.

    tiercache inspect engine http://127.0.0.1:8000/metrics    an engine (vLLM's own /metrics)
    tiercache inspect server 127.0.0.1:7470                  a cache server (tiercache serve)
    tiercache inspect engine 127.0.0.1:8000 --watch 2        refresh every 2 s until Ctrl-C

An *engine* is read from a Prometheus page: vLLM's ``/metrics`` on the API
port, where tiercache's connector metrics appear, or a standalone tiercache
metrics port (``metrics.port``). It shows the tiers with usage against
capacity, hit tokens per tier, the hit rate (hit tokens / lookup tokens),
evictions and contained faults (tiercache/cli/engine_view.py); ``--watch``
adds what happened in the last interval. A *server* is asked over its own
protocol (tiercache/server/inspect_cli.py: tiers, hit rates, clients).
``tiercache inspect --server HOST:PORT`` is the older spelling of
``inspect server``; an address alone picks engine for an ``http://`` URL and
server otherwise. Pointed at the wrong kind of port, each says what the port
is and which command to use. Exit status: 0, 1 when the target cannot be
read, 2 for bad arguments; ``--watch`` ends with 0 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

KINDS = ("engine", "server")
EXAMPLES = """\
examples:
  tiercache inspect engine http://127.0.0.1:8000/metrics
        an engine started with tiercache: tiers, usage, hit rate, evictions
  tiercache inspect engine 127.0.0.1:8000 --watch 2
        the same every 2 s, with hits and evictions in the last interval (Ctrl-C ends it)
  tiercache inspect server 127.0.0.1:7470 --token "$ADMIN_TOKEN"
        a cache server (tiercache serve): capacity, tiers, hit rates, clients
  tiercache inspect engine 127.0.0.1:8000 --json --watch 10 --count 6
        one JSON object per line, six times, for a script or a log
"""


def _target(args: argparse.Namespace) -> tuple[str, str]:
    """(kind, address) from the positionals and ``--server``; ValueError when they make no sense."""
    kind, address = args.kind, args.address
    if args.server is not None:
        if kind is not None:
            raise ValueError("give either `inspect server HOST:PORT` or `inspect --server HOST:PORT`, not both")
        return "server", args.server
    if kind is None:
        raise ValueError("what to inspect? `tiercache inspect engine URL` or `tiercache inspect server "
                         "HOST:PORT` (tiercache inspect --help)")
    if kind not in KINDS:
        if address is not None:
            raise ValueError(f"unknown target {kind!r}: use `engine` or `server`")
        kind, address = ("engine" if "://" in kind else "server"), kind
    if address is None:
        raise ValueError(f"`tiercache inspect {kind}` needs an address "
                         + ("(e.g. http://127.0.0.1:8000/metrics)" if kind == "engine" else "(HOST:PORT)"))
    return kind, address


def _engine_step(args: argparse.Namespace, url: str) -> Callable[[], str]:
    from tiercache.cli.engine_view import render, snapshot
    from tiercache.cli.prom_scrape import engine_samples

    previous: list[Any] = []

    def step() -> str:
        snap = snapshot(url, engine_samples(url, args.timeout))
        text = json.dumps(snap.as_dict()) if args.json else render(snap, previous[-1] if previous else None)
        previous[:] = [snap]
        return text

    return step


def _server_step(args: argparse.Namespace, address: str) -> Callable[[], str]:
    from tiercache.server.inspect_cli import as_plain, fetch_stats, render

    args.server = address

    def step() -> str:
        stats = fetch_stats(args)
        return json.dumps(as_plain(stats), indent=None if args.watch else 2) if args.json else render(stats, address)

    return step


def run_inspect(args: argparse.Namespace) -> int:
    from tiercache.cli.prom_scrape import ScrapeError, normalize_url

    try:
        kind, address = _target(args)
        step = _engine_step(args, normalize_url(address)) if kind == "engine" else _server_step(args, address)
        first = step()
    except ValueError as exc:
        print(f"tiercache inspect: {exc}", file=sys.stderr)
        return 2
    except (ScrapeError, ConnectionError) as exc:
        print(f"tiercache inspect: {exc}", file=sys.stderr)
        return 1
    if args.watch is None:
        print(first)
        return 0
    return _watch(args, first, step, (ScrapeError, ConnectionError))


def _watch(args: argparse.Namespace, first: str, step: Callable[[], str], errors: tuple[type, ...]) -> int:
    """Print ``first``, then ``step()`` every ``--watch`` seconds, ``--count`` times in all or until Ctrl-C."""
    clear = sys.stdout.isatty() and not args.json
    shown, text = 0, first
    try:
        while True:
            if clear:
                sys.stdout.write("\x1b[H\x1b[2J")
            elif shown and not args.json:
                print()
            print(text, flush=True)
            if clear:
                print(f"\n(every {args.watch:g} s; Ctrl-C to stop)", flush=True)
            shown += 1
            if args.count and shown >= args.count:
                return 0
            time.sleep(args.watch)
            try:
                text = step()
            except errors as exc:  # the engine restarting: say so, keep watching
                text = f"tiercache inspect: {exc} (retrying every {args.watch:g} s)"
    except KeyboardInterrupt:
        return 0


def add_parser(sub: Any) -> None:
    from tiercache.server.inspect_cli import add_server_options

    s = sub.add_parser(
        "inspect",
        help="show an engine's tiercache (tiers, usage, hit rate, evictions) or a cache server; --watch",
        description=__doc__.replace("``", "`"),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("kind", nargs="?", metavar="engine|server",
                   help="engine: a vLLM engine's metrics URL; server: a cache server's HOST:PORT")
    s.add_argument("address", nargs="?", metavar="ADDRESS",
                   help="engine: http://HOST:PORT/metrics (HOST:PORT means that); server: HOST:PORT")
    s.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until Ctrl-C, showing what changed since")
    s.add_argument("--count", type=int, default=0, metavar="N", help="with --watch: stop after N reports")
    s.add_argument("--json", action="store_true",
                   help="print JSON instead (with --watch: one object per line)")
    s.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer (default 5)")
    server = s.add_argument_group("server options")
    server.add_argument("--server", metavar="HOST:PORT", help="the older spelling of `inspect server HOST:PORT`")
    add_server_options(server)
    s.set_defaults(func=run_inspect)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiercache")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["inspect", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
