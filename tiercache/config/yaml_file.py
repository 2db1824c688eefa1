"""Loading a pydantic-settings model from a YAML file, with errors that name the key.

Shared by the engine's configuration (:mod:`tiercache.config.schema`) and the cache
server's (:mod:`tiercache.server.config`), so both read files and report
problems the same way:

* :class:`ConfigError`, the one exception a bad configuration raises;
* :func:`read_yaml`, a YAML file as a mapping (unreadable file, bad YAML or a
  top level that is not a mapping: a ConfigError naming ``config_file``);
* :class:`YamlFileSource`, a settings source that feeds a model the file named
  by the :func:`load_settings` call in progress (a model opts in by returning
  it from ``settings_customise_sources``);
* :func:`describe_validation_error`, a pydantic ``ValidationError`` as one
  line per offending key (dotted path, message, optionally the value given);
* :func:`load_settings`, which ties these together.
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsError

SettingsT = TypeVar("SettingsT", bound=BaseSettings)

#: The YAML file of the load_settings call in progress (None: no file).
_current_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "tiercache_yaml_config_file", default=None
)


class ConfigError(ValueError):
    """A configuration problem, raised at start-up with the offending key named."""


def read_yaml(path: Path) -> dict[str, Any]:
    """The mapping held by the YAML file ``path`` (an empty file is ``{}``).

    Raises ConfigError if the file cannot be read, is not valid YAML, or holds
    something other than a mapping.
    """
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"config_file: cannot read {path}: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config_file: {path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config_file: {path} must hold a mapping, not {type(data).__name__}")
    return data


class YamlFileSource(PydanticBaseSettingsSource):
    """Settings source: the YAML file of the :func:`load_settings` call in progress.

    Empty outside such a call (or when it names no file), so building the
    model directly reads only its other sources.
    """

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        raise NotImplementedError  # __call__ is used instead

    def __call__(self) -> dict[str, Any]:
        path = _current_file.get()
        return read_yaml(path) if path is not None else {}


class YamlBackedSettings(BaseSettings):
    """Settings read from, in order: constructor keywords, the environment, the YAML file being loaded.

    Subclass it instead of ``BaseSettings`` (with its own ``model_config``): the
    YAML file is the one :func:`load_settings` was given.
    """

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, YamlFileSource(settings_cls))


def describe_validation_error(
    exc: ValidationError, title: str, path: Path | None, *, show_input: bool = True
) -> str:
    """A multi-line message naming every offending key of ``exc``.

    The first line is ``"<title> (config_file <path>):"``; then one line per
    error: ``"  <dotted.key>: <message>"`` (``unknown key`` for a key the model
    does not have), followed by ``(got <value>)`` when ``show_input``. A
    cross-field check has no key of its own; its message, which names the keys
    itself, is shown as is. Pass ``show_input=False`` where values may be
    secrets.
    """
    where = f" (config_file {path})" if path else ""
    lines = [f"{title}{where}:"]
    for err in exc.errors():
        msg = err["msg"]
        if not err["loc"]:  # a cross-field check: its message names the key itself
            lines.append("  " + msg.removeprefix("Value error, "))
            continue
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        line = f"  {key}: {msg}"
        if show_input:
            line += f" (got {err.get('input')!r})"
        lines.append(line)
    return "\n".join(lines)


def _settings_error_message(model: type[BaseSettings], exc: SettingsError, title: str) -> str:
    """The environment variable behind a pydantic-settings parse error, named with what it expects."""
    found = re.search(r'field "(\w+)"', str(exc))
    prefix = str(model.model_config.get("env_prefix") or "")
    where = f"{prefix}{found.group(1)}".upper() if found else "an environment variable"
    cause = f": {exc.__cause__}" if exc.__cause__ else ""
    return f"{title}: {where} is not valid JSON{cause} (lists and sections are given as JSON)"


def load_settings(
    model: type[SettingsT],
    config_file: str | Path | None,
    overrides: Mapping[str, Any],
    *,
    title: str,
    show_input: bool = True,
) -> SettingsT:
    """Build ``model`` from ``overrides``, its other sources and the YAML ``config_file``.

    The file reaches the model through :class:`YamlFileSource`, which the model
    must list in its ``settings_customise_sources``. Raises ConfigError if the
    file is missing or unreadable, or naming every offending key (see
    :func:`describe_validation_error` for ``title`` and ``show_input``).
    """
    path = Path(config_file).expanduser() if config_file else None
    if path is not None and not path.is_file():
        raise ConfigError(f"config_file: no such file: {path}")
    token = _current_file.set(path)
    try:
        return model(**overrides)
    except ValidationError as exc:
        message = describe_validation_error(exc, title, path, show_input=show_input)
        raise ConfigError(message) from None
    except SettingsError as exc:  # an environment variable that does not parse (a list that is not JSON)
        raise ConfigError(_settings_error_message(model, exc, title)) from None
    finally:
        _current_file.reset(token)
