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
  tiercache config check configs/cpu.yaml validate a config file and show what it means
  tiercache serve --config configs/server.yaml
                                          run the shared cache server (engines use backend: server)
  tiercache inspect --server 127.0.0.1:7470
                                          capacity, usage per tier, hit rates, clients
  tiercache bench server --server 127.0.0.1:7470 --clients 16 --seconds 10
  TIERCACHE_CHUNK_TOKENS=512 tiercache config check configs/cpu.yaml
                                          ... with an environment override applied

Enable tiercache in vLLM with:
  --kv-transfer-config '{"kv_connector":"TierCacheConnector",
    "kv_connector_module_path":"tiercache.connector.vllm","kv_role":"kv_both",
    "kv_connector_extra_config":{"config_file":"configs/cpu.yaml"}}'
"""


def build_parser() -> argparse.ArgumentParser:
    from tiercache.cli import config_cli, demo
    from tiercache.server import bench_cli, inspect_cli, serve_cli

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
