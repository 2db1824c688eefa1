"""Config: sources and precedence, sizes, and errors that name the key."""

from __future__ import annotations

import pathlib

import pytest

from tiercache.config.schema import ConfigError, config_from_extra, load_config
from tiercache.config.sizes import format_size, parse_size
from tiercache.server.config import load_server_config


@pytest.mark.parametrize(
    ("text", "expected"),
    [(4096, 4096), ("16GiB", 16 << 30), ("512MiB", 512 << 20), ("2GB", 2 * 10**9), ("1.5KiB", 1536), ("0", 0)],
)
def test_parse_size(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "-1", "12XB", True, -5, None])
def test_parse_size_rejects(bad: object) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


def test_format_size() -> None:
    assert format_size(3 << 20) == "3.0 MiB" and format_size(12) == "12 B"


def write(tmp_path: pathlib.Path, text: str) -> pathlib.Path:
    path = tmp_path / "tc.yaml"
    path.write_text(text)
    return path


def test_yaml_env_inline_precedence(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "chunk_tokens: 128\nnamespace_salt: yaml\noffload_decode_tokens: false\n")
    assert load_config(path).chunk_tokens == 128
    monkeypatch.setenv("TIERCACHE_CHUNK_TOKENS", "512")
    monkeypatch.setenv("TIERCACHE_METRICS__PORT", "9400")
    cfg = load_config(path)
    assert cfg.chunk_tokens == 512 and cfg.metrics.port == 9400 and cfg.namespace_salt == "yaml"
    cfg = config_from_extra({"config_file": str(path), "chunk_tokens": 64})
    assert cfg.chunk_tokens == 64 and cfg.offload_decode_tokens is False


def test_tiers_and_sizes_from_yaml(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, "tiers:\n  - name: cpu\n    capacity: 2GiB\n    policy: arc\n")
    (tier,) = load_config(path).tiers
    assert tier.capacity == 2 << 30 and tier.policy == "arc" and tier.backend == "cpu"


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"chunk_tokenz": 5}, "chunk_tokenz: unknown key"),
        ({"chunk_tokens": 0}, "chunk_tokens"),
        ({"tiers": [{"name": "cpu", "capacity": "lots"}]}, "tiers.0.capacity"),
        ({"tiers": [{"name": "cpu", "capacity": "1GiB", "policy": "mru"}]}, "tiers.0.policy"),
        ({"tiers": [{"name": "d", "backend": "disk", "capacity": "1GiB"}]}, "tiers.0.backend"),
        ({"tiers": [{"name": "a", "capacity": 1}, {"name": "a", "backend": "disk", "capacity": 1}]}, "duplicate"),
        ({"load_mode": "later"}, "load_mode"),
        ({"metrics": {"port": 70000}}, "metrics.port"),
    ],
)
def test_errors_name_the_key(overrides: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, **overrides)
    assert fragment in str(err.value)


@pytest.mark.parametrize("load", [load_config, load_server_config], ids=["engine", "server"])
@pytest.mark.parametrize("lower", [{"backend": "cpu"}, {}], ids=["named", "default"])
def test_cpu_is_the_host_tier_and_first_only(load, lower: dict) -> None:  # type: ignore[no-untyped-def]
    tiers = [{"name": "cpu", "capacity": "1MiB"}, {"name": "d", "backend": "disk", "capacity": "1MiB"},
             {"name": "more", "capacity": "1MiB", **lower}]
    with pytest.raises(ConfigError, match=r"tiers\.2\.backend: 'cpu' is the host tier .* can only be the first tier"):
        load(tiers=tiers)


def test_env_error_names_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCACHE_CHUNK_TOKENS", "many")
    with pytest.raises(ConfigError, match="chunk_tokens"):
        load_config(None)


def test_bad_files(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "chunk_tokens: [1,\n"))
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"))


def test_check_engine_block_size() -> None:
    cfg = load_config(None, chunk_tokens=256)
    cfg.check_engine(32)
    with pytest.raises(ConfigError, match="chunk_tokens: 256 is not a multiple of the engine block size 96"):
        cfg.check_engine(96)


def test_config_is_frozen() -> None:
    cfg = load_config(None)
    with pytest.raises(Exception):
        cfg.chunk_tokens = 1  # type: ignore[misc]


def test_shipped_configs_are_valid() -> None:
    root = pathlib.Path(__file__).resolve().parents[2] / "configs"
    files = sorted(p for p in root.glob("*.yaml") if p.name != "server.yaml")  # the server's own schema
    assert files
    for path in files:
        load_config(path).check_engine(32)


def test_host_tier_options_are_checked_and_prefault_defaults_to_unset() -> None:
    assert load_config().host_options.prefault is None  # the worker decides: on for P/D roles
    cfg = load_config(tiers=[{"name": "cpu", "backend": "cpu", "capacity": "1MiB", "options": {"prefault": True}}])
    assert cfg.host_options.prefault is True
    with pytest.raises(ConfigError, match=r"tiers.0.options \(host tier\): prefualt: Extra inputs"):
        load_config(tiers=[{"name": "cpu", "backend": "cpu", "capacity": "1MiB", "options": {"prefualt": True}}])
    with pytest.raises(ConfigError, match="prefault"):
        load_config(tiers=[{"name": "cpu", "backend": "cpu", "capacity": "1MiB", "options": {"prefault": "maybe"}}])


def test_deadlines_have_defaults_and_bounds() -> None:
    d = config_from_extra({}).deadlines
    assert (d.load_s, d.store_s, d.lookup_s) == (5.0, 30.0, 1.0)
    assert config_from_extra({"deadlines": {"lookup_s": 0.25}}).deadlines.lookup_s == 0.25
    with pytest.raises(ConfigError, match="lookup_s"):
        config_from_extra({"deadlines": {"lookup_s": 0}})
