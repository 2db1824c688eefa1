"""``tiercache config check [FILE | --preset NAME]``: validate a config as engine start-up does and print it.

One code path with the connector: the config is built by
:func:`tiercache.config.schema.load_config` (file or packaged preset, then
``TIERCACHE_*`` env, then ``--set`` keys, dotted for sections) and every lower
tier's backend and options are validated by the backend registry, exactly as
engine start-up validates them before constructing the backends. ``--json``
prints the resolved config as JSON and nothing else (errors go to stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tiercache.config.presets import engine_preset_names
from tiercache.config.schema import ConfigError, TierCacheConfig, load_config
from tiercache.config.sizes import format_size
from tiercache.tiers.registry import check_tier_backends


def parse_sets(items: list[str] | None) -> dict[str, Any]:
    """``--set KEY=VALUE`` items as overrides (a value is JSON when it parses, else a string)."""
    overrides: dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects KEY=VALUE (KEY may be dotted: metrics.port=9400), got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


def checked_config(args: argparse.Namespace) -> TierCacheConfig:
    """The config ``args`` name, validated as the connector validates it at start-up."""
    config = load_config(args.file, preset=args.preset, **parse_sets(args.set))
    check_tier_backends(config.tiers)
    if args.block_size:
        config.check_engine(args.block_size)
    return config


def describe(config: TierCacheConfig, args: argparse.Namespace) -> list[str]:
    lines = [f"OK: {args.file or (f'preset {args.preset}' if args.preset else '(defaults)')}",
             f"  chunk_tokens: {config.chunk_tokens}"]
    for i, tier in enumerate(config.tiers):
        role = "host staging tier" if i == 0 else "lower tier"
        lines.append(f"  tiers[{i}] {tier.name}: backend={tier.backend} capacity={format_size(tier.capacity)} "
                     f"policy={tier.policy} ({role})")
    if args.block_size:
        lines.append(f"  fits engine block size {args.block_size}: "
                     f"{config.chunk_tokens // args.block_size} blocks per chunk")
    return lines


def run_check(args: argparse.Namespace) -> int:
    try:
        config = checked_config(args)
    except ConfigError as exc:
        print(f"INVALID\n{exc}", file=sys.stderr if args.json else sys.stdout)
        return 1
    print(config.model_dump_json(indent=2) if args.json else "\n".join(describe(config, args)))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("config", help="work with tiercache config files")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    c = csub.add_parser(
        "check",
        help="validate a config (file or preset, env, --set) as engine start-up does",
        description="Validate a config exactly as the connector does at engine start-up: the schema, "
        "then every lower tier's backend and its options. Errors name the offending key and the "
        "allowed values; exit status 1.",
        epilog="examples:\n"
        "  tiercache config check --preset cpu-disk --set cpu_size=16GiB --set disk_path=/mnt/nvme\n"
        "  tiercache config check my.yaml --set metrics.port=9400 --block-size 16\n"
        "  TIERCACHE_CPU_SIZE=8GiB tiercache config check --preset cpu --json\n"
        f"presets: {', '.join(engine_preset_names())}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("file", nargs="?", help="your YAML file (omit for --preset, TIERCACHE_PRESET or the defaults)")
    c.add_argument("--preset", help="a packaged preset instead of a file (as \"preset\" in kv_connector_extra_config)")
    c.add_argument("--block-size", type=int, help="also check against this engine block size")
    c.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="inline override, as in kv_connector_extra_config (dotted: metrics.port=9400)")
    c.add_argument("--json", action="store_true", help="print only the resolved config, as JSON")
    c.set_defaults(func=run_check)
