"""`tiercache bench server` and `tiercache inspect` against a real cache server, nothing, and HTTP ports.

The cache server is a ``tiercache serve`` subprocess (tests/server/harness.py);
the HTTP port is Python's own http.server; every command runs as a user runs
it, ``python -m tiercache.cli.main ...``. What must hold: a benchmark against
nothing or against the wrong kind of port fails (exit 1) saying what is
there, a benchmark against a server exits 0 and writes its JSON and a PNG
beside it, and each inspect pointed at the other kind of port names the
command to use.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.server.harness import ROOT, ServerProcess, free_port

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tiercache(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tiercache.cli.main", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("srv")
    proc = ServerProcess(directory, max_value_bytes=64 << 10, metrics={"port": free_port()},
                         tiers=[{"name": "cpu", "backend": "cpu", "capacity": "8MiB"}]).start()
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def http_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                            cwd=tmp_path_factory.mktemp("www"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        _wait(port)
        yield port
    finally:
        proc.kill()
        proc.wait()


def _wait(port: int, timeout: float = 30.0) -> None:
    import socket
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def test_bench_server_against_nothing_fails_saying_so(tmp_path: pathlib.Path) -> None:
    out = tiercache("bench", "server", "--server", f"127.0.0.1:{free_port()}", "--seconds", "1",
                    "--json", str(tmp_path / "b.json"))
    assert out.returncode == 1
    assert "no cache server at" in out.stderr and "nothing listens there" in out.stderr
    assert not (tmp_path / "b.json").exists()


def test_bench_server_against_an_http_port_names_it(http_port: int) -> None:
    out = tiercache("bench", "server", "--server", f"127.0.0.1:{http_port}", "--seconds", "1")
    assert out.returncode == 1
    assert "that port speaks HTTP" in out.stderr and "tiercache inspect engine" in out.stderr


def test_bench_server_writes_json_and_png(server: ServerProcess, tmp_path: pathlib.Path) -> None:
    result = tmp_path / "run.json"
    out = tiercache("bench", "server", "--server", server.address, "--clients", "3", "--seconds", "1.5",
                    "--chunk-bytes", "16KiB", "--json", str(result))
    assert out.returncode == 0, out.stderr
    report = json.loads(result.read_text())
    assert report["requests"] > 0 and report["errors"] == 0 and report["corrupt"] == 0
    assert report["timeline"][0] == [0.0, 0] and report["timeline"][-1][1] > 0
    png = tmp_path / "run.png"
    assert f"plot: {png}" in out.stdout
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    again = tiercache("bench", "server", "--server", server.address, "--clients", "1", "--seconds", "0.5",
                      "--json", str(tmp_path / "np.json"), "--no-plot")
    assert again.returncode == 0 and not (tmp_path / "np.png").exists()


def test_inspect_server_both_spellings_and_watch(server: ServerProcess) -> None:
    new = tiercache("inspect", "server", server.address)
    old = tiercache("inspect", "--server", server.address)
    for out in (new, old):
        assert out.returncode == 0, out.stderr
        assert "host memory:" in out.stdout and "tiers:" in out.stdout
    watched = tiercache("inspect", "server", server.address, "--watch", "0.2", "--count", "2")
    assert watched.returncode == 0 and watched.stdout.count("host memory:") == 2
    lines = tiercache("inspect", "server", server.address, "--json", "--watch", "0.2", "--count", "2")
    assert [json.loads(line)["server"] for line in lines.stdout.splitlines()] != []


def test_inspect_server_on_an_http_port_says_so(http_port: int) -> None:
    out = tiercache("inspect", "server", f"127.0.0.1:{http_port}", "--timeout", "2")
    assert out.returncode == 1
    assert "that port speaks HTTP" in out.stderr
    assert f"tiercache inspect engine http://127.0.0.1:{http_port}/metrics" in out.stderr
    assert "bad magic" not in out.stderr
    no_page = tiercache("inspect", "engine", f"127.0.0.1:{http_port}")
    assert no_page.returncode == 1 and "answered HTTP 404" in no_page.stderr and "is it a vLLM engine" in no_page.stderr


def test_inspect_engine_pointed_at_a_cache_server(server: ServerProcess) -> None:
    protocol_port = tiercache("inspect", "engine", server.address, "--timeout", "3")
    assert protocol_port.returncode == 1
    assert f"tiercache inspect server {server.address}" in protocol_port.stderr
    metrics_page = tiercache("inspect", "engine", f"127.0.0.1:{server.config['metrics']['port']}")
    assert metrics_page.returncode == 1
    assert "cache server's metrics page" in metrics_page.stderr
