"""``tiercache config check FILE``: validate a config and print what it resolves to."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tiercache.config.schema import ConfigError, load_config
from tiercache.config.sizes import format_size


def run_check(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {}
    for item in args.set or ():
        key, sep, value = item.partition("=")
        if not sep:
            print(f"--set expects KEY=VALUE, got {item!r}")
            return 2
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    try:
        config = load_config(args.file, **overrides)
    except ConfigError as exc:
        print(f"INVALID\n{exc}")
        return 1
    print(f"OK: {args.file or '(defaults)'}")
    print(f"  chunk_tokens: {config.chunk_tokens}")
    for i, tier in enumerate(config.tiers):
        role = "host staging tier" if i == 0 else "lower tier"
        print(f"  tiers[{i}] {tier.name}: backend={tier.backend} capacity={format_size(tier.capacity)} "
              f"policy={tier.policy} ({role})")
    if args.block_size:
        try:
            config.check_engine(args.block_size)
        except ConfigError as exc:
            print(f"INVALID for block size {args.block_size}: {exc}")
            return 1
        print(f"  fits engine block size {args.block_size}: {config.chunk_tokens // args.block_size} blocks per chunk")
    if args.json:
        print(config.model_dump_json(indent=2))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("config", help="work with tiercache config files")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    c = csub.add_parser(
        "check",
        help="validate a YAML config (with TIERCACHE_* env overrides applied)",
        description="Validate a config file the way the connector does at start-up; "
        "errors name the offending key and the allowed values.",
    )
    c.add_argument("file", nargs="?", help="YAML file (omit to check the defaults + env)")
    c.add_argument("--block-size", type=int, help="also check against this engine block size")
    c.add_argument("--set", action="append", metavar="KEY=VALUE", help="inline override, as in kv_connector_extra_config")
    c.add_argument("--json", action="store_true", help="print the fully resolved config as JSON")
    c.set_defaults(func=run_check)
