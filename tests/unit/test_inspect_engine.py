"""`tiercache inspect engine`: a real metrics page, served over HTTP, read as a user reads it.

The page is a real :class:`tiercache.metrics.TierCacheMetrics` registry on a
loopback port (what ``metrics.port`` serves; vLLM's ``/metrics`` carries the
same names), so the names the command reads are the names tiercache writes.
Also: every wrong address fails with exit 1 and a sentence saying what is
there (nothing, a page without tiercache metrics, a port that does not
speak HTTP), bad arguments with exit 2.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, start_http_server

from tiercache.cli.engine_view import render, snapshot
from tiercache.cli.prom_scrape import engine_samples
from tiercache.metrics import TierCacheMetrics
from tiercache.testing.ports import free_port

GiB = 1 << 30


def tiercache(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tiercache.cli.main", *args], capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[TierCacheMetrics, str]]:
    """An engine's tiercache metrics on a port: two tiers, 12,288 lookups, 6,140 hits, 7 evictions."""
    m = TierCacheMetrics("0", "tiny", "box-1")
    port = free_port()
    assert m.serve(port)
    for tier, capacity, used in (("cpu", 4 * GiB, GiB), ("disk", 64 * GiB, 3 * GiB)):
        m.label(m.capacity_bytes, tier).set(capacity)
        m.label(m.used_bytes, tier).set(used)
    m.label(m.lookup_tokens).inc(12288)
    m.label(m.hit_tokens, "cpu").inc(6000)
    m.label(m.hit_tokens, "disk").inc(140)
    m.label(m.evictions, "cpu").inc(7)
    m.count_faults({"load_deadline": 2})
    yield m, f"http://127.0.0.1:{port}/metrics"


def test_snapshot_reads_what_tiercache_writes(engine: tuple[TierCacheMetrics, str]) -> None:
    _, url = engine
    snap = snapshot(url, engine_samples(url))
    assert [t.name for t in snap.tiers] == ["cpu", "disk"]
    cpu, disk = snap.tiers
    assert (cpu.capacity_bytes, cpu.used_bytes, cpu.hit_tokens, cpu.evictions) == (4 * GiB, GiB, 6000, 7)
    assert (disk.capacity_bytes, disk.hit_tokens) == (64 * GiB, 140)
    assert snap.lookup_tokens == 12288 and snap.hit_tokens == 6140
    assert snap.faults == {"load_deadline": 2} and snap.engines == ["0"] and snap.instances == ["box-1"]


def test_render_shows_usage_hit_rate_and_what_changed(engine: tuple[TierCacheMetrics, str]) -> None:
    m, url = engine
    before = snapshot(url, engine_samples(url), taken_at=100.0)
    text = render(before)
    assert "hit rate 50.0%" in text and "6,140 tokens" in text
    assert "4.0 GiB" in text and "25.0%" in text and "load_deadline 2" in text
    m.label(m.lookup_tokens).inc(1000)
    m.label(m.hit_tokens, "cpu").inc(250)
    m.label(m.evictions, "cpu").inc(3)
    after = snapshot(url, engine_samples(url), taken_at=105.0)
    changed = render(after, before)
    assert "last 5 s: lookups 1,000 tokens, hits 250 tokens, hit rate 25.0%" in changed
    cpu_row = next(line for line in changed.splitlines() if line.strip().startswith("cpu"))
    assert cpu_row.split()[-2:] == ["250", "3"]  # hits and evictions in the last interval


def test_command_once_watch_and_json(engine: tuple[TierCacheMetrics, str]) -> None:
    _, url = engine
    once = tiercache("inspect", "engine", url)
    assert once.returncode == 0, once.stderr
    assert "tiers:" in once.stdout and "share of lookups" in once.stdout and "evictions" in once.stdout
    short = tiercache("inspect", "engine", url.removeprefix("http://").removesuffix("/metrics"))
    assert short.returncode == 0 and "tiers:" in short.stdout  # HOST:PORT means its /metrics
    watched = tiercache("inspect", "engine", url, "--watch", "0.3", "--count", "2")
    assert watched.returncode == 0 and watched.stdout.count("tiers:") == 2 and "last 0 s:" in watched.stdout
    lines = tiercache("inspect", url, "--json", "--watch", "0.2", "--count", "2").stdout.splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["tiers"][0]["name"] == "cpu"


def test_wrong_addresses_say_what_is_there() -> None:
    nothing = tiercache("inspect", "engine", f"127.0.0.1:{free_port()}")
    assert nothing.returncode == 1 and "nothing listens at" in nothing.stderr
    empty_port = free_port()
    start_http_server(empty_port, addr="127.0.0.1", registry=CollectorRegistry())
    no_tiercache = tiercache("inspect", "engine", f"127.0.0.1:{empty_port}")
    assert no_tiercache.returncode == 1 and "has no tiercache_* metrics" in no_tiercache.stderr
    with _binary_port() as port:
        binary = tiercache("inspect", "engine", f"127.0.0.1:{port}", "--timeout", "3")
    assert binary.returncode == 1 and "does not speak HTTP" in binary.stderr
    assert f"tiercache inspect server 127.0.0.1:{port}" in binary.stderr


def test_bad_arguments_exit_2() -> None:
    for args in (("inspect",), ("inspect", "engine"), ("inspect", "engines", "x:1"),
                 ("inspect", "server", "127.0.0.1:1", "--server", "127.0.0.1:2")):
        out = tiercache(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert out.stderr.startswith("tiercache inspect: ")


def test_help_teaches_both_kinds() -> None:
    out = tiercache("inspect", "--help")
    assert out.returncode == 0
    for text in ("inspect engine http://127.0.0.1:8000/metrics", "inspect server 127.0.0.1:7470", "--watch",
                 "hit tokens / lookup tokens", "examples:"):
        assert text in out.stdout, text


class _binary_port:
    """A TCP port that answers anything with bytes that are not HTTP (as a cache server's port does)."""

    def __enter__(self) -> int:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        threading.Thread(target=self._serve, daemon=True).start()
        return int(self.sock.getsockname()[1])

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(1024)
                conn.sendall(b"TCSV\x00\x01binary reply\n\n")

    def __exit__(self, *exc: object) -> None:
        self.sock.close()
