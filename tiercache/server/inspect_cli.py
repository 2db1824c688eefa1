"""``tiercache inspect server HOST:PORT [--token T] [--tls-ca FILE]``: what a running cache server holds.

Prints the server's capacity and usage per tier, hit rates (overall and the
share served from lower tiers) and the connected clients with their own
counters; ``--json`` prints the raw STATS reply instead. The whole server is
shown to an *admin* tenant's token (``admin: true``, or the ``auth_token``
shorthand); any other tenant's token shows that tenant's view only (its own
clients and counters, store-wide usage hidden), and the report says so. TLS
with ``--tls-ca`` (and ``--tls-cert``/``--tls-key`` for mutual TLS). Exit
status 1 when the server cannot be reached or refuses (wrong token, TLS), or
the port speaks HTTP (an engine's ``/metrics``: the message says to use
``tiercache inspect engine URL``), 2 for bad arguments. The ``inspect``
command itself (server and engine, ``--watch``) is tiercache/cli/inspect_cli.py;
this module is the server's part, also runnable as
``python -m tiercache.server.inspect_cli --server HOST:PORT``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

from tiercache.config.sizes import format_size


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def as_plain(obj: Any) -> Any:
    """A reply as JSON-ready dicts and lists (bodies travel as arrays; JSON gets names)."""
    if isinstance(obj, msgspec.Struct):
        return {name: as_plain(getattr(obj, name)) for name in obj.__struct_fields__}
    if isinstance(obj, list):
        return [as_plain(x) for x in obj]
    return obj


def render(stats: Any, address: str) -> str:
    """The human report of a StatsReply."""
    lines = [
        f"server {stats.server} (tiercache {stats.version}) at {address}, up {stats.uptime_s:.1f} s"
        + (", DRAINING" if stats.draining else ""),
    ]
    if stats.tenant_view:
        lines.append(f"tenant view ({stats.tenant_view}): your clients and counters only; store-wide "
                     "usage is hidden (shown as 0): use an admin token for the whole server")
    lines += [
        (f"host memory: {format_size(stats.used_bytes)} used of {format_size(stats.capacity_bytes)} "
         f"({_pct(stats.used_bytes, stats.capacity_bytes)}); values up to {format_size(stats.max_value_bytes)}"),
        (f"gets: {stats.get_keys} keys, hit rate {_pct(stats.hits, stats.get_keys)}; "
         f"puts: {stats.put_keys} keys, {stats.stored} stored; refused messages: {stats.refused_messages}"),
        "tiers:",
    ]
    rows = [["tier", "backend", "capacity", "used", "use%", "chunks", "hits", "hit share", "stored", "evictions"]]
    for t in stats.tiers:
        rows.append([
            t.name, t.backend, format_size(t.capacity_bytes), format_size(t.used_bytes),
            _pct(t.used_bytes, t.capacity_bytes), str(t.chunks), str(t.hit_chunks),
            _pct(t.hit_chunks, stats.get_keys), str(t.stored_chunks), str(t.evictions),
        ])
    lines.append(_table(rows))
    lines.append(f"clients: {len(stats.clients)} connected")
    if stats.clients:
        rows = [["session", "client", "peer", "path", "connected", "requests", "puts", "gets", "hit rate",
                 "in", "out", "errors"]]
        for c in stats.clients:
            rows.append([
                str(c.session), c.client or "-", c.peer, c.data_path, f"{c.connected_s:.0f}s",
                str(c.requests), str(c.put_keys), str(c.get_keys), _pct(c.hits, c.get_keys),
                format_size(c.bytes_in), format_size(c.bytes_out), str(c.errors),
            ])
        lines.append(_table(rows))
    return "\n".join(lines)


def fetch_stats(args: argparse.Namespace) -> Any:
    """The server's StatsReply; ValueError for bad options, ConnectionError with the reason otherwise."""
    from tiercache.cli.http_probe import http_hint
    from tiercache.server.client import ServerClient
    from tiercache.server.protocol import ProtocolError, RemoteError

    token = args.token if args.token is not None else os.environ.get("TIERCACHE_SERVER_TOKEN")
    tls = _tls(args)
    try:
        with ServerClient(args.server, token=token, client_name="tiercache-inspect", timeout_s=args.timeout,
                          tls=tls, server_name=args.tls_server_name) as c:
            return c.stats()
    except ValueError:
        raise
    except ConnectionRefusedError as exc:
        raise ConnectionError(f"cannot inspect {args.server}: nothing listens there ({exc})") from None
    except (OSError, ProtocolError, RemoteError) as exc:
        hint = None if isinstance(exc, RemoteError) else http_hint(args.server)
        raise ConnectionError(f"cannot inspect {args.server}: {hint or exc}") from None


def run_inspect(args: argparse.Namespace) -> int:
    try:
        stats = fetch_stats(args)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    except ConnectionError as exc:
        print(exc, file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(as_plain(stats), indent=2))
    else:
        print(render(stats, args.server))
    return 0


def _tls(args: argparse.Namespace) -> Any:
    """The TLS context the TLS options ask for (None: plaintext); ValueError naming the option."""
    if not (args.tls or args.tls_ca or args.tls_cert or args.tls_key):
        return None
    from pydantic import ValidationError

    from tiercache.server.tls import ClientTlsConfig, client_context

    try:
        config = ClientTlsConfig(ca_file=args.tls_ca, cert_file=args.tls_cert, key_file=args.tls_key)
    except ValidationError as exc:
        raise ValueError("; ".join(f"--tls: {e['msg']}" for e in exc.errors())) from None
    return client_context(config)


def add_server_options(s: argparse.ArgumentParser | Any) -> None:
    """The options of a server inspection (token, TLS, timeout); ``--server`` is added by the caller."""
    s.add_argument("--token", help="an admin tenant's token for the whole server (a tenant's own token "
                   "shows only its clients and counters; default: $TIERCACHE_SERVER_TOKEN)")
    s.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's CAs")
    s.add_argument("--tls-ca", metavar="FILE", help="connect with TLS, trusting this CA bundle (PEM)")
    s.add_argument("--tls-cert", metavar="FILE", help="client certificate (PEM), for mutual TLS")
    s.add_argument("--tls-key", metavar="FILE", help="private key of --tls-cert (PEM)")
    s.add_argument("--tls-server-name", metavar="NAME",
                   help="name the server's certificate must carry (default: the host of --server)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tiercache.server.inspect_cli",
                                     description="Ask a running tiercache server for its statistics.")
    parser.add_argument("--server", required=True, metavar="HOST:PORT", help="the server's address")
    add_server_options(parser)
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the server")
    parser.add_argument("--json", action="store_true", help="print the raw statistics as JSON")
    return run_inspect(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
