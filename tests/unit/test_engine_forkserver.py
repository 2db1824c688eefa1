"""The engine fork server: a forked runner is its own process group, with the environment,
working directory, log and exit status the launcher asked for, and vLLM already imported.

The runners here run :func:`probe` (not an engine): it reports what it sees as JSON on its
stdout, which the fork server points at the log file.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from tiercache.testing.engine_forkserver import ForkedRunner

PROBE = f"{__name__}:probe"


def probe(argv: list[str]) -> int:
    """Print what the runner sees; ``argv``: [exit status] or ["sleep"] (start a grandchild, sleep)."""
    report: dict[str, Any] = {
        "pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0), "cwd": os.getcwd(),
        "env": dict(os.environ), "vllm_preloaded": "vllm.entrypoints.llm" in sys.modules,
    }
    if argv[0] == "sleep":
        report["grandchild"] = subprocess.Popen(["sleep", "60"]).pid
    print(json.dumps(report), flush=True)
    if argv[0] == "sleep":
        time.sleep(60)
    return int(argv[0]) if argv[0] != "sleep" else 0


def report_of(log: pathlib.Path, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        lines = [line for line in text.splitlines() if line.startswith("{")]
        if lines:
            return json.loads(lines[-1])
        time.sleep(0.05)
    raise AssertionError(f"no report in {log}")


def process_state(pid: int) -> str:
    """The state letter in /proc/PID/stat, or "gone"."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


def test_runner_gets_exactly_the_environment_cwd_log_and_exit_status_asked_for(tmp_path: pathlib.Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCACHE_TEST_PARENT_ONLY", "1")  # in the caller's environment, not the runner's
    log = tmp_path / "runner.log"
    env = {"PATH": os.environ.get("PATH", ""), "TIERCACHE_TEST_MARK": "asked-for"}
    runner = ForkedRunner(["7"], log, tmp_path, env, entry=PROBE)
    assert runner.wait() == 7 and runner.returncode == 7 and runner.poll() == 7
    seen = report_of(log)
    assert seen["pid"] == runner.pid == seen["pgid"] == seen["sid"]  # a session and group of its own
    assert seen["pid"] != os.getpid()
    assert seen["cwd"] == str(tmp_path)
    assert seen["env"] == env


def test_killing_the_runners_group_kills_what_it_started(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "runner.log"
    runner = ForkedRunner(["sleep"], log, tmp_path, {"PATH": os.environ.get("PATH", "")}, entry=PROBE)
    seen = report_of(log)
    assert runner.poll() is None
    os.killpg(runner.pid, signal.SIGKILL)
    assert runner.wait() == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while process_state(seen["grandchild"]) not in ("gone", "Z"):  # a zombie waits for init to reap it
        assert time.monotonic() < deadline, "the runner's own child survived the group kill"
        time.sleep(0.05)


def test_the_fork_server_imported_vllm_before_the_runner_started(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("vllm")
    log = tmp_path / "runner.log"
    runner = ForkedRunner(["0"], log, tmp_path, {"PATH": os.environ.get("PATH", "")}, entry=PROBE)
    assert runner.wait() == 0
    assert report_of(log)["vllm_preloaded"], "the runner had to import vLLM itself"
