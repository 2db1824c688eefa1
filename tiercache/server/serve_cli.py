"""``tiercache serve --config FILE``: run the cache server until SIGTERM (then drain, exit 0).

Config errors are reported (naming the key) with exit status 1 before any
memory is allocated or any socket bound. Also runnable on its own:
``python -m tiercache.server.serve_cli --config configs/server.yaml``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from tiercache.config.schema import ConfigError


def run_serve(args: argparse.Namespace) -> int:
    from tiercache.config.presets import server_preset_path
    from tiercache.server.config import load_server_config
    from tiercache.server.service import serve

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    overrides: dict[str, Any] = {}
    if args.host is not None:
        overrides["host"] = args.host
    if args.port is not None:
        overrides["port"] = args.port
    if args.port_file is not None:
        overrides["port_file"] = args.port_file
    try:
        config = load_server_config(args.config or server_preset_path(), **overrides)
        return serve(config)
    except ConfigError as exc:
        print(f"INVALID\n{exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the port is taken, the address is not ours, ...
        print(f"cannot serve: {exc}", file=sys.stderr)
        return 1


def add_parser(sub: Any) -> None:
    s = sub.add_parser(
        "serve",
        help="run the tiercache cache server (host memory + lower tiers behind TCP/NIXL)",
        description="Serve chunks to engines over TCP or TLS (and NIXL where both sides have it). "
        "Clients authenticate with a tenant's token (auth: token, the default: the config must name "
        "tokens; auth: none only on loopback). SIGTERM drains in-flight requests and copies, then exits 0.",
    )
    s.add_argument("--config", help="your server YAML (default: the packaged preset, configs/server.yaml: "
                   "loopback, port 7470, 8 GiB of host memory and a 200 GiB disk tier; the token from "
                   "TIERCACHE_SERVER_TOKEN)")
    s.add_argument("--host", help="override the config's bind address")
    s.add_argument("--port", type=int, help="override the config's port (0: any free port)")
    s.add_argument("--port-file", help="write the bound port to this file once listening")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(func=run_serve)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiercache")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
