"""Shorthands a user types instead of a whole tier list: one-key sizes and dotted keys.

* :func:`expand_dotted`: ``{"metrics.port": 9400}`` (``--set metrics.port=9400``,
  or the same key inline in ``kv_connector_extra_config``) becomes
  ``{"metrics": {"port": 9400}}``, merged with the other keys of that section.
  Lists are not addressed by index (``tiers.1.capacity`` is an error that says
  what to use instead).
* :func:`expand_sizes`: ``cpu_size`` sets the host tier's capacity; ``disk_size``
  and ``disk_path`` set the first disk tier's capacity and root, or add a disk
  tier when there is none -- like vLLM's ``--kv-offloading-size`` or LMCache's
  ``LMCACHE_MAX_LOCAL_CPU_SIZE``. Also read from ``TIERCACHE_CPU_SIZE``,
  ``TIERCACHE_DISK_SIZE``, ``TIERCACHE_DISK_PATH``. They win over the tier list
  they are applied to (from a preset, a file or inline).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tiercache.config.yaml_file import ConfigError

DEFAULT_DISK_ROOT = "/var/tmp/tiercache/disk"
SIZE_KEYS = ("cpu_size", "disk_size", "disk_path")


def expand_dotted(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``overrides`` with every dotted key turned into nested mappings (ConfigError on a clash).

    A dotted key merges into a section given whole (``metrics={...}`` and
    ``metrics.port=...``); giving one leaf twice is a clash.
    """
    out: dict[str, Any] = {k: v for k, v in overrides.items() if "." not in str(k)}
    for key, value in overrides.items():
        if "." not in str(key):
            continue
        parts = str(key).split(".")
        if any(not p for p in parts):
            raise ConfigError(f"{key}: empty part in a dotted key")
        if any(p.isdigit() for p in parts):
            raise ConfigError(
                f"{key}: list items cannot be set one by one; give the whole list (tiers=[...]) or "
                f"the one-key sizes cpu_size, disk_size, disk_path")
        node = out
        for part in parts[:-1]:
            child = node.get(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{key}: {part!r} is given both as a value and as a section")
            node[part] = child = dict(child)
            node = child
        if parts[-1] in node:
            raise ConfigError(f"{key}: given twice")
        node[parts[-1]] = value
    return out


def _as_dict(tier: Any) -> dict[str, Any]:
    return dict(tier.model_dump()) if hasattr(tier, "model_dump") else dict(tier)


def expand_sizes(data: dict[str, Any], default_tiers: list[dict[str, Any]]) -> dict[str, Any]:
    """``data`` (the merged sources, before validation) with the one-key sizes applied to ``tiers``."""
    cpu_size, disk_size, disk_path = (data.get(k) for k in SIZE_KEYS)
    if cpu_size is None and disk_size is None and disk_path is None:
        return data
    tiers = [_as_dict(t) for t in (data.get("tiers") or default_tiers)]
    if not tiers or not isinstance(tiers[0], dict):
        return data  # the tier list itself is invalid: its own validation says why
    if cpu_size is not None:
        tiers[0] = {**tiers[0], "capacity": cpu_size}
    if disk_size is not None or disk_path is not None:
        disk = next((i for i, t in enumerate(tiers) if t.get("backend") == "disk"), None)
        if disk is None:
            if disk_size is None:
                raise ValueError("disk_path: there is no disk tier to point there; give disk_size too "
                                 "(the new disk tier's byte budget)")
            tiers.append({"name": "disk", "backend": "disk", "capacity": disk_size,
                          "options": {"root": disk_path or DEFAULT_DISK_ROOT}})
        else:
            tier = dict(tiers[disk])
            if disk_size is not None:
                tier["capacity"] = disk_size
            if disk_path is not None:
                tier["options"] = {**(tier.get("options") or {}), "root": disk_path}
            tiers[disk] = tier
    return {**data, "tiers": tiers}
