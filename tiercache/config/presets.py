"""Presets: the config files shipped inside the package, named without a path.

A pip user writes ``"kv_connector_extra_config": {"preset": "cpu"}`` (or sets
``TIERCACHE_PRESET=cpu``) instead of a ``config_file`` path that only exists in
a source checkout. The files are the repository's ``configs/*.yaml``, installed
as the package ``tiercache.presets`` (pyproject.toml maps the directory), so a
preset and ``configs/<name>.yaml`` are the same file.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from tiercache.config.yaml_file import ConfigError

PRESETS_PACKAGE = "tiercache.presets"
SERVER_PRESET = "server"  # the cache server's config, not an engine's


def _presets_dir() -> Path:
    return Path(str(resources.files(PRESETS_PACKAGE)))


def engine_preset_names() -> list[str]:
    """The names an engine may give as ``preset`` (sorted)."""
    return sorted(p.stem for p in _presets_dir().glob("*.yaml") if p.stem != SERVER_PRESET)


def preset_path(name: str) -> Path:
    """The file of engine preset ``name``; ConfigError naming the available ones if there is none."""
    names = engine_preset_names()
    if name not in names:
        raise ConfigError(f"preset: unknown {name!r}; available: {names} (or give config_file: a path)")
    return _presets_dir() / f"{name}.yaml"


def server_preset_path() -> Path:
    """The cache server's packaged config (``tiercache serve`` without ``--config``)."""
    return _presets_dir() / f"{SERVER_PRESET}.yaml"


def resolve_config_file(config_file: str | Path | None, preset: str | None) -> str | Path | None:
    """The YAML file to read: ``config_file``, or the file of ``preset``; both is an error."""
    if preset is not None and config_file is not None:
        raise ConfigError(
            f"preset and config_file: give one (preset {preset!r} is a packaged file, "
            f"config_file {str(config_file)!r} your own); inline keys override either")
    if preset is not None:
        if not isinstance(preset, str):
            raise ConfigError(f"preset: a name such as 'cpu', got {preset!r}")
        return preset_path(preset)
    return config_file
