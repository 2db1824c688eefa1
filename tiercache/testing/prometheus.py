"""A real Prometheus server for tests: scrape loopback targets, then ask its HTTP API.

:class:`PrometheusServer` writes a config that scrapes the given ``host:port``
targets every second, starts Debian's ``prometheus`` binary (package
``prometheus``; scripts/setup.sh installs it) on a loopback port with its data
in a temporary folder, and answers PromQL through ``/api/v1/query``.
:func:`prometheus_binary` is None when it is not installed (tests skip).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

import yaml


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


class PrometheusServer:
    """One ``prometheus`` process on ``127.0.0.1:port``, scraping ``targets`` (job name -> host:port)."""

    def __init__(self, directory: pathlib.Path, port: int, targets: dict[str, str]) -> None:
        self.directory, self.port = directory, port
        directory.mkdir(parents=True, exist_ok=True)
        self.config_path = directory / "prometheus.yml"
        self.log_path = directory / "prometheus.log"
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [target]}]}
                               for job, target in targets.items()],
        }
        self.config_path.write_text(yaml.safe_dump(config))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> PrometheusServer:
        binary = prometheus_binary()
        assert binary, "prometheus not on PATH"
        cmd = [binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={self.directory / 'data'}",
               f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"prometheus not ready within {timeout_s}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def api(self, path: str, **params: str) -> dict[str, Any]:
        """A GET of ``/api/v1/<path>``; its ``data`` (raises with Prometheus' error otherwise)."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        if body.get("status") != "success":
            raise ValueError(f"prometheus refused {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query: ``[{"metric": {labels}, "value": [ts, "value"]}, ...]``."""
        return self.api("query", query=expr)["result"]

    def wait_for(self, expr: str, ok: Callable[[list[dict[str, Any]]], bool], timeout_s: float = 30.0
                 ) -> list[dict[str, Any]]:
        """Query until ``ok(result)``; the result (AssertionError naming the last one after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if ok(result):
                return result
            if time.monotonic() > deadline:
                targets = self.api("targets")["activeTargets"]
                health = [(t["scrapeUrl"], t["health"], t.get("lastError")) for t in targets]
                raise AssertionError(f"{expr}: {result} after {timeout_s}s; targets {health}")
            time.sleep(0.5)


def values(result: list[dict[str, Any]]) -> list[float]:
    return [float(r["value"][1]) for r in result]
