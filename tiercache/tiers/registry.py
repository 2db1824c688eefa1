"""The backend registry: built-in media and third-party plugins, found by name.

A plugin is a :class:`~tiercache.backend.Backend` subclass registered under the
entry point group ``tiercache.backends``::

    [project.entry-points."tiercache.backends"]
    mystore = "mypkg.store:MyStoreBackend"

and is then named in YAML exactly like a built-in (``backend: mystore``).
A class may also be named by its import path without any registration
(``backend: "mypkg.store:MyStoreBackend"``), as the test kit's misbehaving
backends are (tiercache/testing/faulty_backends.py).
Built-in lower tiers are registered the same way in tiercache's own pyproject.toml;
the table below is the fallback for a source checkout that was never installed.
The host tier (``backend: cpu``, always first) is not among them: it is the core's
own slab (tiercache/transfer/host_slab.py), never constructed here, and the config
refuses ``cpu`` for any other tier.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from pydantic import ValidationError

from tiercache.backend import Backend, BackendContext
from tiercache.config.schema import ConfigError, TierConfig

ENTRY_POINT_GROUP = "tiercache.backends"
#: Optional packages of built-in backends -> the extra that installs them (pyproject.toml).
EXTRA_OF_MODULE: dict[str, str] = {"redis": "redis", "hiredis": "redis", "lmdb": "lmdb", "nixl": "nixl"}
BUILTIN_BACKENDS: dict[str, str] = {
    "disk": "tiercache.backends.disk.backend:DiskBackend",
    "lmdb": "tiercache.backends.lmdb.backend:LMDBBackend",
    "redis": "tiercache.backends.redis.backend:RedisBackend",
    "server": "tiercache.backends.server.backend:ServerBackend",
}


def available_backends() -> dict[str, str]:
    """Backend name -> ``module:Class`` target, entry points over built-ins."""
    found = dict(BUILTIN_BACKENDS)
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        found[ep.name] = ep.value
    return found


def backend_class(name: str) -> type[Backend]:
    """Import the backend class registered as ``name``; ConfigError if unknown or broken."""
    targets = available_backends()
    target = targets.get(name)
    if target is None and ":" in name:
        target = name  # an import path, module:Class
    if target is None:
        raise ConfigError(f"backend: unknown {name!r}; available: {sorted(targets)}")
    module_name, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing in EXTRA_OF_MODULE:
            raise ConfigError(
                f"backend {name!r} needs the Python package {missing!r}, which is not installed: "
                f"pip install 'tiercache[{EXTRA_OF_MODULE[missing]}]'") from exc
        raise ConfigError(f"backend {name!r}: cannot load {target}: {exc}") from exc
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"backend {name!r}: cannot load {target}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise ConfigError(f"backend {name!r}: {target} is not a tiercache Backend subclass")
    return cls


def backend_settings(tier: TierConfig, index: int | None = None) -> tuple[type[Backend], Any]:
    """The tier's backend class and its options validated by the backend's settings model.

    What engine start-up does before constructing a backend, and all that
    ``tiercache config check`` does: ConfigError naming the tier and key.
    """
    cls = backend_class(tier.backend)
    where = f"tiers.{index}.options" if index is not None else f"tier {tier.name} options"
    try:
        settings = cls.settings_model(**tier.options)
    except ValidationError as exc:
        problems = "; ".join(
            f"{where}.{'.'.join(str(p) for p in e['loc'])}: "
            f"{'unknown key' if e['type'] == 'extra_forbidden' else e['msg']}"
            for e in exc.errors()
        )
        raise ConfigError(problems) from None
    return cls, settings


def check_tier_backends(tiers: Sequence[TierConfig]) -> None:
    """Validate every lower tier's backend and options as start-up will (ConfigError on the first bad one)."""
    for index, tier in enumerate(tiers[1:], start=1):
        try:
            backend_settings(tier, index)
        except ConfigError as exc:
            raise ConfigError(f"tiers.{index} ({tier.name}): {exc}") from None


def create_backend(tier: TierConfig, context: BackendContext, index: int | None = None) -> Backend:
    """Validate the tier's options with the backend's settings model and construct it."""
    cls, settings = backend_settings(tier, index)
    return cls(settings, context)  # type: ignore[call-arg]
