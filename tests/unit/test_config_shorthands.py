"""Presets, one-key sizes, dotted keys and `tiercache config check` (issue 21: packaging and config)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from tiercache.connector.vllm_version import UnsupportedVLLMVersion, check_vllm_version
from tiercache.config.presets import engine_preset_names
from tiercache.config.schema import ConfigError, config_from_extra, load_config
from tiercache.tiers.registry import backend_class, check_tier_backends

GIB = 1 << 30


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("TIERCACHE_"):
            monkeypatch.delenv(name)


def test_every_documented_preset_is_packaged_and_loads() -> None:
    names = engine_preset_names()
    for name in ("cpu", "cpu-disk", "cpu-disk-redis", "cpu-server", "pd-prefill", "pd-decode"):
        assert name in names
        config = config_from_extra({"preset": name})
        assert config.tiers[0].backend == "cpu"
    assert "server" not in names  # the cache server's config is not an engine preset


def test_preset_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"preset: unknown 'gpu'; available: \['cpu'"):
        config_from_extra({"preset": "gpu"})
    with pytest.raises(ConfigError, match="preset and config_file: give one"):
        config_from_extra({"preset": "cpu", "config_file": "/x.yaml"})


def test_inline_keys_override_a_preset() -> None:
    config = config_from_extra({"preset": "cpu-disk", "chunk_tokens": 64, "metrics.port": 9400})
    assert config.chunk_tokens == 64 and config.metrics.port == 9400
    assert [t.backend for t in config.tiers] == ["cpu", "disk"]


def test_cpu_size_sets_the_host_tier() -> None:
    config = config_from_extra({"preset": "cpu-disk", "cpu_size": "16GiB"})
    assert config.tiers[0].capacity == 16 * GIB
    assert config.tiers[1].capacity == 100 * GIB  # the preset's disk tier untouched


def test_disk_size_adds_a_disk_tier_or_resizes_the_one_there() -> None:
    added = config_from_extra({"disk_size": "2GiB", "disk_path": "/mnt/nvme/kv"})
    assert [(t.backend, t.capacity, t.options) for t in added.tiers[1:]] == \
        [("disk", 2 * GIB, {"root": "/mnt/nvme/kv"})]
    resized = config_from_extra({"preset": "cpu-disk", "disk_size": "3GiB", "disk_path": "/data"})
    assert len(resized.tiers) == 2
    assert resized.tiers[1].capacity == 3 * GIB
    assert resized.tiers[1].options["root"] == "/data" and resized.tiers[1].options["io_threads"] == 4


def test_disk_path_without_a_disk_tier_or_size_is_an_error() -> None:
    with pytest.raises(ConfigError, match="disk_path: there is no disk tier"):
        config_from_extra({"disk_path": "/data"})


def test_sizes_and_preset_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCACHE_PRESET", "cpu-disk")
    monkeypatch.setenv("TIERCACHE_CPU_SIZE", "8GiB")
    monkeypatch.setenv("TIERCACHE_DISK_SIZE", "5GiB")
    config = load_config()
    assert [t.capacity for t in config.tiers] == [8 * GIB, 5 * GIB]


def test_a_malformed_tier_list_in_the_environment_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCACHE_TIERS", "[{bad")
    with pytest.raises(ConfigError, match="TIERCACHE_TIERS is not valid JSON"):
        load_config()


def test_dotted_keys_merge_into_a_section_and_refuse_list_items() -> None:
    config = config_from_extra({"metrics": {"host": "0.0.0.0"}, "metrics.port": 9400})
    assert (config.metrics.host, config.metrics.port) == ("0.0.0.0", 9400)
    with pytest.raises(ConfigError, match="tiers.1.capacity: list items cannot be set one by one"):
        config_from_extra({"tiers.1.capacity": 5})
    with pytest.raises(ConfigError, match="metrics.nope: unknown key"):
        config_from_extra({"metrics.nope": 1})


def test_lower_tier_backends_are_checked_like_start_up() -> None:
    bad_name = config_from_extra({"tiers": [{"name": "cpu", "capacity": 1000},
                                            {"name": "x", "backend": "nope", "capacity": 5}]})
    with pytest.raises(ConfigError, match=r"tiers.1 \(x\): backend: unknown 'nope'"):
        check_tier_backends(bad_name.tiers)
    typo = config_from_extra({"tiers": [{"name": "cpu", "capacity": 1000},
                                        {"name": "d", "backend": "disk", "capacity": 5,
                                         "options": {"root": "/x", "io_thread": 2}}]})
    with pytest.raises(ConfigError, match="tiers.1.options.io_thread: unknown key"):
        check_tier_backends(typo.tiers)
    check_tier_backends(config_from_extra({"preset": "cpu-disk-redis"}).tiers)  # the presets pass


def test_a_missing_optional_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "lmdb" or m.startswith("tiercache.backends.lmdb")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lmdb", None)  # import lmdb now fails as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'tiercache\[lmdb\]'"):
        backend_class("lmdb")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tiercache.cli.main", "config", "check", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def test_config_check_cli_json_is_only_json_and_errors_exit_1() -> None:
    ok = cli("--preset", "cpu-disk", "--set", "cpu_size=2GiB", "--set", "metrics.port=9400", "--json")
    assert ok.returncode == 0, ok.stderr
    resolved = json.loads(ok.stdout)
    assert resolved["tiers"][0]["capacity"] == 2 * GIB and resolved["metrics"]["port"] == 9400
    bad = cli("--preset", "cpu", "--set", 'tiers=[{"name":"cpu","capacity":1000},'
              '{"name":"d","backend":"disk","capacity":5,"options":{"rooot":"/x"}}]')
    assert bad.returncode == 1 and "tiers.1.options.rooot: unknown key" in bad.stdout


def test_vllm_version_range(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.3.dev5+gabcdef")
    for old in ("0.31.2", "0.33.0", "not-a-version"):
        with pytest.raises(UnsupportedVLLMVersion, match="tiercache supports vLLM"):
            check_vllm_version(old)
    monkeypatch.setenv("TIERCACHE_ALLOW_UNSUPPORTED_VLLM", "1")
    with caplog.at_level(logging.WARNING):
        check_vllm_version("0.33.0")
    assert "at your own risk" in caplog.text


def test_the_server_preset_is_what_serve_reads_without_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from tiercache.config.presets import server_preset_path
    from tiercache.server.config import load_server_config

    monkeypatch.setenv("TIERCACHE_SERVER_TOKEN", "a-token-long-enough-for-the-server")
    config = load_server_config(server_preset_path())
    assert (config.host, config.port) == ("127.0.0.1", 7470) and [t.backend for t in config.tiers] == ["cpu", "disk"]
