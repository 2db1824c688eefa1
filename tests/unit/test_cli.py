"""The tiercache command: help that teaches, config check exit codes."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def tiercache(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tiercache.cli.main", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_help_lists_commands_and_examples() -> None:
    out = tiercache("--help")
    assert out.returncode == 0
    for word in ("demo", "config", "kv_connector_module_path", "examples:"):
        assert word in out.stdout
    assert "--prompt-tokens" in tiercache("demo", "--help").stdout


def test_config_check_ok_and_errors() -> None:
    ok = tiercache("config", "check", "configs/cpu.yaml", "--block-size", "32")
    assert ok.returncode == 0 and "8 blocks per chunk" in ok.stdout
    bad = tiercache("config", "check", "configs/cpu.yaml", "--set", "chunk_tokenz=1")
    assert bad.returncode == 1 and "chunk_tokenz: unknown key" in bad.stdout
    misfit = tiercache("config", "check", "configs/cpu.yaml", "--block-size", "96")
    assert misfit.returncode == 1 and "not a multiple" in misfit.stdout
