"""Run a real cache server in a subprocess for tests: write its config, start it, wait, stop it.

The server is started exactly as a user starts it (``python -m tiercache.cli.main
serve --config FILE``, falling back to ``python -m tiercache.server.serve_cli``
while the ``serve`` subcommand is not registered in tiercache/cli/main.py) on a free
loopback port below 32768 (outside Linux's ephemeral range, so a client's own
ports never collide with it). Used by tests/server and the server's
conformance suite; one :class:`ServerProcess` per server, owned by the test.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A loopback TCP port below 32768 that nothing listens on right now."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below 32768")


def _serve_command() -> list[str]:
    """``tiercache serve`` if the CLI knows it, else the module's own runner."""
    from tiercache.cli import main as cli

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            cli.build_parser().parse_args(["serve", "--config", "x"])
    except SystemExit:
        return [sys.executable, "-m", "tiercache.server.serve_cli"]
    return [sys.executable, "-m", "tiercache.cli.main", "serve"]


class ServerProcess:
    """One server subprocess with its own config file and log."""

    def __init__(self, directory: pathlib.Path, **config: Any) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.config: dict[str, Any] = {"nixl": "off", **config}
        if not {"auth", "auth_token", "tenants"} & self.config.keys():
            self.config["auth"] = "none"  # loopback test servers: open unless the test configures tokens
        self.config.setdefault("port", free_port())
        self.config_path = directory / "server.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.log_path = directory / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def port(self) -> int:
        return int(self.config["port"])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 90.0) -> ServerProcess:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [*_serve_command(), "--config", str(self.config_path)],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"server did not listen on {self.port} within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (drain) and wait; the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def rss_bytes(self) -> int:
        """Resident memory of the server process now."""
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def hwm_bytes(self) -> int:
        """Peak resident memory of the server process so far."""
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmHWM")
