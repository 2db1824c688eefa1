"""The shared YAML config loader (tiercache.config.yaml_file): files, sources, error messages."""

from __future__ import annotations

import pathlib
import re

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import SettingsConfigDict

from tiercache.config import schema as engine_config
from tiercache.server.config import load_server_config
from tiercache.config.yaml_file import (
    ConfigError,
    YamlBackedSettings,
    describe_validation_error,
    load_settings,
    read_yaml,
)


class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid")

    port: int = Field(default=1, ge=0, le=65535)


class Demo(YamlBackedSettings):
    model_config = SettingsConfigDict(
        env_prefix="TC_YAMLTEST_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    size: int = Field(default=1, gt=0)
    name: str = "x"
    inner: Inner = Field(default_factory=Inner)
    low: int = 0
    high: int = 10

    @model_validator(mode="after")
    def _order(self) -> Demo:
        if self.low > self.high:
            raise ValueError(f"low: {self.low} is above high {self.high}")
        return self



def write(tmp_path: pathlib.Path, text: str) -> pathlib.Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_config_error_is_shared() -> None:
    assert engine_config.ConfigError is ConfigError
    assert issubclass(ConfigError, ValueError)


def test_read_yaml(tmp_path: pathlib.Path) -> None:
    assert read_yaml(write(tmp_path, "")) == {}
    data = read_yaml(write(tmp_path, "size: 3\ninner: {port: 9}\n"))
    assert data == {"size": 3, "inner": {"port": 9}}
    path = write(tmp_path, "size: [1,\n")
    bad_yaml = f"(?s)config_file: {re.escape(str(path))} is not valid YAML: .*line 2"
    with pytest.raises(ConfigError, match=bad_yaml):
        read_yaml(path)
    with pytest.raises(ConfigError, match="config_file: .* must hold a mapping, not list"):
        read_yaml(write(tmp_path, "- 1\n"))
    with pytest.raises(ConfigError, match=f"config_file: cannot read {re.escape(str(tmp_path))}"):
        read_yaml(tmp_path)  # a directory


def test_describe_validation_error_names_each_key() -> None:
    with pytest.raises(ValidationError) as err:
        Demo(size=0, inner={"port": 70000, "prot": 1})
    text = describe_validation_error(err.value, "invalid demo config", pathlib.Path("/etc/d.yaml"))
    lines = text.splitlines()
    assert lines[0] == "invalid demo config (config_file /etc/d.yaml):"
    assert any(line.startswith("  size: ") and line.endswith("(got 0)") for line in lines)
    assert any(line.startswith("  inner.port: ") and line.endswith("(got 70000)") for line in lines)
    assert "  inner.prot: unknown key (got 1)" in lines
    assert len(lines) == 4

    hidden = describe_validation_error(err.value, "invalid demo config", None, show_input=False)
    assert hidden.splitlines()[0] == "invalid demo config:"
    assert "  inner.prot: unknown key" in hidden.splitlines() and "(got" not in hidden


def test_describe_cross_field_error_keeps_its_own_key() -> None:
    with pytest.raises(ValidationError) as err:
        Demo(low=5, high=1)
    text = describe_validation_error(err.value, "invalid demo config", None)
    assert text.splitlines() == ["invalid demo config:", "  low: 5 is above high 1"]


def test_load_settings_sources_and_precedence(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, "size: 3\nname: yaml\ninner: {port: 9}\n")
    cfg = load_settings(Demo, path, {}, title="t")
    assert (cfg.size, cfg.name, cfg.inner.port) == (3, "yaml", 9)
    monkeypatch.setenv("TC_YAMLTEST_SIZE", "4")
    cfg = load_settings(Demo, str(path), {"name": "inline"}, title="t")
    assert (cfg.size, cfg.name, cfg.inner.port) == (4, "inline", 9)
    assert Demo().size == 4 and Demo().name == "x"  # outside load_settings: no file is read


def test_load_settings_errors(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="config_file: no such file: .*missing.yaml"):
        load_settings(Demo, tmp_path / "missing.yaml", {}, title="t")
    path = write(tmp_path, "size: 0\nsise: 2\n")
    with pytest.raises(ConfigError) as err:
        load_settings(Demo, path, {}, title="invalid demo config")
    lines = str(err.value).splitlines()
    assert lines[0] == f"invalid demo config (config_file {path}):"
    assert "  sise: unknown key (got 2)" in lines
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert Demo().size == 1  # the failed load left no file behind for later builds


def test_server_config_errors_do_not_echo_values(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_server_config(None, auth_tokn="s3cret-value", port=-1)
    text = str(err.value)
    assert text.startswith("invalid tiercache server config:")
    assert "auth_tokn: unknown key" in text and "port:" in text
    assert "s3cret" not in text
    path = write(tmp_path, "max_keys_per_message: 0\n")
    first_lines = f"server config (config_file {path}):\n  max_keys_per_message: "
    with pytest.raises(ConfigError, match=re.escape(first_lines)):
        load_server_config(path)


def test_engine_config_errors_echo_values() -> None:
    with pytest.raises(ConfigError) as err:
        engine_config.load_config(None, chunk_tokens=0)
    assert str(err.value).startswith("invalid tiercache config:\n  chunk_tokens: ")
    assert str(err.value).endswith("(got 0)")
