"""The ``tiercache`` command: demo, config check, serve, inspect, bench server.

Each subcommand lives in its own module and registers itself here with an
``add_parser(subparsers)`` function; ``tiercache <cmd> --help`` explains each.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tiercache import __version__

EPILOG = """\
examples:
  tiercache demo                          vLLM + tiercache, cold vs warm time-to-first-token
  tiercache config check --preset cpu-disk --set cpu_size=16GiB
                                          validate a preset (or a file) as engine start-up does
  tiercache serve --config configs/server.yaml
                                          run the shared cache server (engines use backend: server)
  tiercache inspect engine http://127.0.0.1:8000/metrics --watch 2
                                          an engine's tiers, usage, hit rate, evictions, live
  tiercache inspect server 127.0.0.1:7470 a cache server: capacity, usage per tier, hit rates, clients
  tiercache bench server --server 127.0.0.1:7470 --clients 16 --seconds 10 --json out.json
                                          load a cache server; out.json and a plot, out.png
  TIERCACHE_CHUNK_TOKENS=512 tiercache config check my.yaml
                                          ... your own file, with an environment override applied

Enable tiercache in vLLM with:
  --kv-transfer-config '{"kv_connector":"TierCacheConnector",
    "kv_connector_module_path":"tiercache.connector.vllm","kv_role":"kv_both",
    "kv_connector_extra_config":{"preset":"cpu","cpu_size":"16GiB"}}'
"""


def build_parser() -> argparse.ArgumentParser:
    from tiercache.cli import config_cli, demo, inspect_cli
    from tiercache.server import bench_cli, serve_cli

    parser = argparse.ArgumentParser(
        prog="tiercache",
        description="tiercache: tiered KV-cache offloading for vLLM (GPU <-> host <-> disk <-> remote).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tiercache {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo.add_parser(sub)
    config_cli.add_parser(sub)
    serve_cli.add_parser(sub)
    inspect_cli.add_parser(sub)
    bench_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
